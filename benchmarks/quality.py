"""Training quality at equal tokens: the arms, an outer-optimizer sweep, and the
heterogeneous-speed ablation, on the demo's byte-level GPT.

Runbook: ``python benchmarks/quality.py`` (full: every section, about an hour on 2
cores), ``--quick`` (fewer steps and seeds, a smoke run of a few minutes), or one
section with ``--section arms|sweep|hetero``. Prints a table per section, writes
``benchmarks/results/quality.json`` and ends with a ``RESULT`` line.

Every learner sees its own data stream; every arm trains the same total tokens
(M learners x steps x batch x block), so the arms differ only in how they
synchronise. All arms but the heterogeneous ablation run in deterministic mode, so a
number depends only on the seed, not on thread timing:

- ``data-parallel``: average every step (H=1, P=1, tau=0, outer SGD lr 1, no momentum).
- ``alone``: one learner for M x steps (nothing to merge).
- ``averaging``: plain parameter averaging every H steps (P=1, tau=0, lr 1, no momentum).
- ``diloco``: classic DiLoCo (P=1, tau=0, Nesterov SGD lr 0.7, momentum 0.9).
- ``rackmend``: rackmend's defaults (``SyncerConfig()``, P=4, tau=2) with H=16.
- ``rackmend-async``: the same, asynchronous with K=1 and the adaptive grace window
  (the only arm whose number also depends on thread timing).
- ``rackmend-desloc``: ``rackmend`` with DES-LOC on (Adam's moments averaged too, every
  K_u = 3H and K_v = 6H steps, ``ScheduleConfig.desloc``).

The sweep varies the outer learning rate and momentum of the rackmend schedule, at
M=4, H=16 and then across H and M. The ablation (``hetero``) runs asynchronously with
half the learners 18 % slower and 10 % step-time jitter: K=M, K=1 without a grace
window, K=1 with the adaptive grace window, and the last with a staleness-aware outer
step (CGAD's scale on rackmend's SGD step; an Adam outer step with and without CGAD),
at equal wall time and at equal tokens; ``--variants`` picks some of them.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from _common import finish, parser
from rackmend.config import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.demo.threads import thread_settings, train_arm
from rackmend.workloads import ByteCorpus

H_DEFAULT = 16


def outer(lr: float, momentum: float) -> dict[str, Any]:
    """SyncerConfig fields of SGD at ``lr`` with Nesterov ``momentum`` (none at 0)."""
    kwargs = {"momentum": momentum, "nesterov": True} if momentum > 0 else {"momentum": 0.0}
    return {"outer_lr": lr, "outer_kwargs": kwargs}


def config(M: int, H: int, P: int, tau: int, *, deterministic: bool = True, desloc: bool = False,
           **syncer: Any) -> RackmendConfig:
    ids = tuple(f"learner{i}" for i in range(M))
    return RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau, desloc=desloc),
                          syncer=SyncerConfig(min_quorum=M if deterministic else syncer.pop("min_quorum", 1),
                                              learners=ids, **syncer),
                          deterministic=deterministic)


def arms(M: int, H: int) -> dict[str, tuple[RackmendConfig, int]]:
    """Arm name -> (config, number of learners)."""
    return {
        "data-parallel": (config(M, 1, 1, 0, weighting="uniform", **outer(1.0, 0.0)), M),
        "alone": (config(1, H, 1, 0, **outer(1.0, 0.0)), 1),
        "averaging": (config(M, H, 1, 0, **outer(1.0, 0.0)), M),
        "diloco": (config(M, H, 1, 0, **outer(0.7, 0.9)), M),
        "rackmend": (config(M, H, 4, 2), M),
        "rackmend-async": (config(M, H, 4, 2, deterministic=False), M),
        "rackmend-desloc": (config(M, H, 4, 2, desloc=True), M),
    }


GUARD_EVENTS: list[int] = []
"""Norm-guard clips per run, in run order (reported: honest training should have none)."""


def run(cfg: RackmendConfig, learners: int, steps_total: int, seed: int, corpus: ByteCorpus) -> float:
    """Held-out loss of the global model after ``steps_total`` learner steps in all."""
    s = thread_settings(learners=learners, steps=steps_total // learners, seed=seed, evals=1)
    result = train_arm("q", cfg, s, corpus)
    GUARD_EVENTS.append(result.guard_events)
    return result.points[-1][2]


def bootstrap(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def section_arms(steps: int, seeds: list[int], M: int, corpus: ByteCorpus, only: list[str] | None) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    print(f"\narms at equal tokens: M={M}, {steps} steps per learner, H={H_DEFAULT}, seeds {seeds}")
    print(f"{'arm':<16} {'median':>8} {'95% interval':>18}  per seed")
    for name, (cfg, learners) in arms(M, H_DEFAULT).items():
        if only and name not in only:
            continue
        losses = [run(cfg, learners, steps * M, seed, corpus) for seed in seeds]
        lo, hi = bootstrap(losses)
        rows[name] = {"losses": losses, "median": statistics.median(losses), "interval": [lo, hi]}
        print(f"{name:<16} {rows[name]['median']:>8.3f} {f'[{lo:.3f}, {hi:.3f}]':>18}  "
              + " ".join(f"{x:.3f}" for x in losses), flush=True)
    return rows


def section_sweep(steps: int, M: int, corpus: ByteCorpus, quick: bool) -> dict[str, Any]:
    lrs = [0.5, 1.0] if quick else [0.5, 0.8, 1.0, 1.2]
    moms = [0.0, 0.9] if quick else [0.0, 0.5, 0.9]
    grid: list[dict[str, Any]] = []
    print(f"\nouter-optimizer sweep: rackmend schedule (P=4, tau=2), M={M}, H={H_DEFAULT}, seed 0")
    print(f"{'lr':>5} {'momentum':>9} {'loss':>8}")
    for lr in lrs:
        for mom in moms:
            loss = run(config(M, H_DEFAULT, 4, 2, **outer(lr, mom)), M, steps * M, 0, corpus)
            grid.append({"lr": lr, "momentum": mom, "loss": loss})
            print(f"{lr:>5} {mom:>9} {loss:>8.3f}", flush=True)
    best = sorted(grid, key=lambda g: g["loss"])[:2]
    candidates = {f"lr{b['lr']}_m{b['momentum']}": (b["lr"], b["momentum"]) for b in best}
    candidates.setdefault("lr1.0_m0.0", (1.0, 0.0))  # plain averaging's outer step on rackmend's schedule
    across: list[dict[str, Any]] = []
    shapes = [(M, 8), (M, 32), (2, H_DEFAULT)] if quick else [(M, 8), (M, 32), (2, H_DEFAULT), (8, H_DEFAULT)]
    print("\nacross H and M (same total tokens per shape), seed 0")
    print(f"{'setting':<20} {'M':>3} {'H':>3} {'loss':>8} {'averaging P=1':>14}")
    for M2, H2 in shapes:
        plain = run(config(M2, H2, 1, 0, **outer(1.0, 0.0)), M2, steps * M, 0, corpus)
        for name, (lr, mom) in candidates.items():
            P = min(4, H2)
            tau = min(2, H2 - 1)
            loss = run(config(M2, H2, P, tau, **outer(lr, mom)), M2, steps * M, 0, corpus)
            across.append({"setting": name, "M": M2, "H": H2, "loss": loss, "averaging": plain})
            print(f"{name:<20} {M2:>3} {H2:>3} {loss:>8.3f} {plain:>14.3f}", flush=True)
    return {"grid": grid, "across": across}


HETERO_CGAD = dict(staleness_decay=0.25, staleness_cutoff=5)
"""CGAD's alpha and cosine cutoff in the heterogeneous ablation (the paper's defaults
are not public in what we read: 0.25 per version, and a cutoff one past the default
``max_staleness`` of 4, so no accepted contribution is zeroed)."""
HETERO_ADAM = dict(outer_optimizer="Adam", outer_lr=0.01, outer_kwargs={})
"""The Adam outer step CGAD is paired with in the paper. lr 0.01 is a guess, not swept:
about the size of a learner's own move over a period (inner lr 3e-3 x H=16, partly noise)."""


def section_hetero(steps: int, M: int, corpus: ByteCorpus, outer_fields: dict[str, Any],
                   seeds: list[int], only: list[str] | None = None) -> dict[str, Any]:
    """Half the learners 18 % slower, every step +-10 % jitter (sleep-based, so the
    compute of the 2-core machine does not set the pace). Per seed the variants run one
    after another; the loss at equal wall time is read at the end of that seed's
    fastest variant (of those run)."""
    base_s = 0.06
    grace = dict(min_quorum=1, grace_max=2.0)
    variants = {
        "K=M": dict(min_quorum=M, grace_max=5.0),
        "K=1, no grace": dict(min_quorum=1, grace_max=0.0),
        "K=1, adaptive grace": grace,
        "K=1, grace, CGAD scale on SGD": {**grace, **HETERO_CGAD},
        "K=1, grace, Adam": {**grace, **HETERO_ADAM},
        "K=1, grace, CGAD (Adam)": {**grace, **HETERO_ADAM, **HETERO_CGAD},
    }
    variants = {k: v for k, v in variants.items() if not only or k in only}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    print(f"\nheterogeneous speeds: M={M}, half 18% slower, 10% jitter, {steps} steps per learner, seeds {seeds}")
    print(f"{'seed':>4} {'variant':<30} {'loss at equal tokens':>21} {'wall s':>8} {'merges':>7}")
    for seed in seeds:
        this: dict[str, dict[str, Any]] = {}
        for name, fields in variants.items():
            cfg = config(M, H_DEFAULT, 4, 2, deterministic=False, **{**outer_fields, **fields})
            rng = random.Random(seed)

            def delay(idx: int, step: int) -> float:
                slow = 1.18 if idx >= M // 2 else 1.0
                return base_s * slow * rng.uniform(0.9, 1.1)

            s = thread_settings(learners=M, steps=steps, seed=seed, evals=4)
            t0 = time.perf_counter()
            r = train_arm(name, cfg, s, corpus, step_delay=delay)
            this[name] = {"seed": seed, "points": r.points, "loss": r.points[-1][2],
                          "wall_s": time.perf_counter() - t0, "merges": r.merges}
            print(f"{seed:>4} {name:<30} {this[name]['loss']:>21.3f} {this[name]['wall_s']:>8.1f} {r.merges:>7}",
                  flush=True)
        wall = min(r["wall_s"] for r in this.values())
        for name, r in this.items():
            r["loss_at_equal_wall"] = at_time(r["points"], wall)
            runs[name].append(r)
    rows: dict[str, Any] = {}
    print("medians over seeds (loss at equal tokens; at the equal wall time of each seed's fastest variant):")
    for name, rs in runs.items():
        losses, at_wall = [r["loss"] for r in rs], [r["loss_at_equal_wall"] for r in rs]
        rows[name] = {"runs": rs, "loss": statistics.median(losses), "losses": losses,
                      "loss_at_equal_wall": statistics.median(at_wall), "losses_at_equal_wall": at_wall,
                      "wall_s": statistics.median(r["wall_s"] for r in rs)}
        print(f"  {name:<30} {rows[name]['loss']:.3f} [{min(losses):.3f}, {max(losses):.3f}]   "
              f"{rows[name]['loss_at_equal_wall']:.3f} [{min(at_wall):.3f}, {max(at_wall):.3f}]")
    return rows


def at_time(points: list[tuple[int, float, float]], wall: float) -> float:
    """Loss at ``wall`` seconds, linearly interpolated between evaluations."""
    for (_, t0, l0), (_, t1, l1) in zip(points, points[1:]):
        if t0 <= wall <= t1:
            return l0 + (l1 - l0) * (wall - t0) / (t1 - t0) if t1 > t0 else l1
    return points[-1][2]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--section", choices=("all", "arms", "sweep", "hetero"), default="all")
    p.add_argument("--steps", type=int, default=None, help="inner steps per learner (default 480; quick 96)")
    p.add_argument("--arms", default="", help="comma-separated arms of the arms section to run (default: all)")
    p.add_argument("--variants", default="", help="semicolon-separated variants of the hetero section (default: all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = args.steps or (96 if args.quick else 480)
    seeds = [0] if args.quick else [0, 1, 2]
    M = 4
    corpus = ByteCorpus()
    out: dict[str, Any] = {"inputs": {"steps_per_learner": steps, "seeds": seeds, "M": M, "H": H_DEFAULT}}
    result: dict[str, float] = {}
    if args.section in ("all", "arms"):
        out["arms"] = section_arms(steps, seeds, M, corpus, [a for a in args.arms.split(",") if a])
        result.update({f"{k}_loss": v["median"] for k, v in out["arms"].items()})
    if args.section in ("all", "sweep"):
        out["sweep"] = section_sweep(steps, M, corpus, args.quick)
        best = min(out["sweep"]["grid"], key=lambda g: g["loss"])
        result.update(best_lr=best["lr"], best_momentum=best["momentum"], best_loss=best["loss"])
    if args.section in ("all", "hetero"):
        sc = SyncerConfig()
        out["hetero"] = section_hetero(steps, M, corpus, {"outer_lr": sc.outer_lr, "outer_kwargs": sc.outer_kwargs},
                                       seeds, [v for v in args.variants.split(";") if v])
        result.update({f"hetero_{k.replace(' ', '').replace(',', '_')}_loss": v["loss"]
                       for k, v in out["hetero"].items()})
    out["guard_events"] = GUARD_EVENTS
    result["guard_events"] = sum(GUARD_EVENTS)
    print(f"norm guard: {sum(GUARD_EVENTS)} contributions clipped in {len(GUARD_EVENTS)} runs")
    finish("quality" if args.section == "all" else f"quality-{args.section}", args.out, out, result)


if __name__ == "__main__":
    main()
