"""Merge + outer step throughput of the syncer core, against a plain tensor copy.

Runbook: ``python benchmarks/merge.py --quick`` (or ``make bench``). For each repeat,
side by side: (a) copy 8 learners' fragments once (the memory-bandwidth yardstick),
(b) ``merge_deltas`` + the Nesterov outer step on the same bytes, (c) the whole
round through ``SyncerCore`` (validation incl. finiteness, merge, step, snapshot).
GB/s counts fragment bytes coming in (learners x fragment size). Target: (b)/(a) >= 0.3.
"""

from __future__ import annotations

import time

import torch

from _common import finish, parser, summary
from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core import Contribution, ContributionArrived, FragmentSpec, LearnerJoined, SyncerCore, TensorSpec
from rackmend.core.merge import contribution_weight, merge_deltas


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=8)
    p.add_argument("--fragment-mb", type=float, default=64.0)
    p.add_argument("--merge", default="mean", choices=["mean", "rda"])
    args = p.parse_args()
    repeats = 3 if args.quick else 9
    m = args.learners
    n_tensors = 4
    numel = int(args.fragment_mb * 2**20 / 4 / n_tensors)
    ids = tuple(f"l{i}" for i in range(m))
    spec = FragmentSpec(0, 0, tuple(TensorSpec(f"t{i}", (numel,), torch.float32) for i in range(n_tensors)))
    nbytes = spec.nbytes * m
    g = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(numel, generator=g) * 1e-3 for _ in range(n_tensors)] for _ in range(m)]
    weights = [contribution_weight("tokens_sq_per_step", 1000 + 10 * i, 24) for i in range(m)]
    copies = [[torch.empty_like(t) for t in d] for d in deltas]
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=24, num_fragments=1),
                            syncer=SyncerConfig(min_quorum=m, learners=ids, merge=args.merge))
    theta = [torch.zeros(numel) for _ in range(n_tensors)]
    opt = config.syncer.build_outer_optimizer(theta)
    core = SyncerCore(config, [spec], [theta])
    for lid in ids:
        core.handle(LearnerJoined(lid), 0.0)

    copy_s, merge_s, core_s = [], [], []
    for r in range(repeats + 1):  # first repeat warms up and is dropped
        t0 = time.perf_counter()
        for src, dst in zip(deltas, copies):
            torch._foreach_copy_(dst, src)
        t1 = time.perf_counter()
        merged = merge_deltas(deltas, weights, args.merge)
        for th, gr in zip(theta, merged):
            th.grad = gr
        opt.step()
        t2 = time.perf_counter()
        for i, lid in enumerate(ids):
            core.handle(ContributionArrived(Contribution(lid, 0, r, 24 * (r + 1), 24, 1000.0 + i, 0.1, tuple(deltas[i]))), float(r))
        t3 = time.perf_counter()
        assert core.versions[0] == r + 1
        if r:
            copy_s.append(t1 - t0)
            merge_s.append(t2 - t1)
            core_s.append(t3 - t2)
    gbps = lambda secs: [nbytes / s / 1e9 for s in secs]  # noqa: E731
    rows = {"copy": summary(gbps(copy_s)), "merge+outer": summary(gbps(merge_s)), "core round": summary(gbps(core_s))}
    ratios = summary([c / mg for c, mg in zip(copy_s, merge_s)])
    print(f"{m} learners x {args.fragment_mb:.0f} MB fragment ({args.merge}), {repeats} repeats, GB/s of fragment bytes")
    print(f"{'path':<12} {'median':>8} {'min':>8} {'max':>8}")
    for name, s in rows.items():
        print(f"{name:<12} {s['median']:>8.2f} {s['min']:>8.2f} {s['max']:>8.2f}")
    print(f"merge/copy ratio per repeat: median {ratios['median']:.2f} [{ratios['min']:.2f}, {ratios['max']:.2f}]")
    finish("merge", args.out,
           {"inputs": vars(args) | {"out": str(args.out), "repeats": repeats, "bytes": nbytes},
            "seconds": {"copy": copy_s, "merge": merge_s, "core": core_s}, "gbps": rows},
           {"merge_gbps": rows["merge+outer"]["median"], "copy_gbps": rows["copy"]["median"],
            "ratio": ratios["median"], "core_gbps": rows["core round"]["median"]})


if __name__ == "__main__":
    main()
