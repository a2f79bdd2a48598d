"""A learner written against the tsugi-mend SDK's quickstart, run on rackmend's
``compat.tsugi`` layer (test helper). The loop below is the SDK's quickstart with its
two placeholders written out: a real fragment provider (the local parameter deltas
since the last sync, the SDK's contract) and the SDK's ``apply_merged_delta``.

python tests/_tsugi_proc.py --endpoint tcp://127.0.0.1:PORT --id l0 --learners l0,l1 --steps 12 --out DIR
Writes the final parameters to DIR/<id>.safetensors and the collected merge results to
DIR/<id>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import batch, make_inner, make_model  # noqa: E402

from rackmend.compat.tsugi import MendConfig, get_runtime, mend_init, mend_shutdown  # noqa: E402


def make_fragment_provider(model: torch.nn.Module, base: dict[str, torch.Tensor]):
    """The SDK's fragment provider: each parameter's change since the last sync."""
    def provide() -> dict[str, torch.Tensor]:
        return {name: p.detach() - base[name] for name, p in model.named_parameters()}
    return provide


def apply_merged_delta(model: torch.nn.Module, delta) -> None:
    """The SDK's caller-side apply: add the merged delta to the parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, d in delta.items():
            params[name].add_(d)


def train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, b) -> float:
    x, y, _ = b
    loss = model(x, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def main() -> int:
    a = argparse.ArgumentParser()
    a.add_argument("--endpoint", required=True)
    a.add_argument("--id", required=True)
    a.add_argument("--learners", required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--H", type=int, default=3)
    a.add_argument("--P", type=int, default=2)
    a.add_argument("--out", type=Path, required=True)
    args = a.parse_args()
    torch.set_num_threads(1)
    learners = tuple(args.learners.split(","))
    model = make_model()
    optimizer = make_inner(model)
    loader = [batch(args.id, t) for t in range(1, args.steps + 1)]

    # ---- the SDK's quickstart, as written for tsugi-mend --------------------------
    config = MendConfig(
        quorum_min_learners=len(learners),
        grace_window_ms=2000,
        token_weighted_merge=True,
        sync_period_steps=args.H,
        concurrent_outer_step=True,
        diagnostics_dir=str(args.out / "mend_diag"),
        num_fragments=args.P,     # rackmend additions: P fragments, bit-reproducible mode
        deterministic=True,
    )

    mend_init(model, config, endpoint=args.endpoint, learner_id=args.id, optimizer=optimizer, learners=learners)
    runtime = get_runtime(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = []

    for step, b in enumerate(loader):
        runtime.step_begin(step)
        loss = train_one_step(model, optimizer, b)

        sched = runtime.schedule_for(step)
        if sched.should_sync_params and not runtime.outer_step_in_flight():
            runtime.outer_step_begin(
                round_id=step,
                fragment_provider=make_fragment_provider(model, base),
            )

        result = runtime.outer_step_collect()
        if result is not None:
            apply_merged_delta(model, result.merged_delta)
            base = {n: p.detach().clone() for n, p in model.named_parameters()}
            results.append({"round_id": result.round_id, "fragments": list(result.fragments),
                            "versions": list(result.versions), "staleness": result.staleness,
                            "step": result.step, "delta_len": len(result.merged_delta), "loss": loss})

        runtime.step_end(step, tokens=b[2])

    versions = list(runtime.optimizer.versions)
    mend_shutdown(model)
    # --------------------------------------------------------------------------------
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              str(args.out / f"{args.id}.safetensors"))
    (args.out / f"{args.id}.json").write_text(json.dumps({"results": results, "versions": versions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
