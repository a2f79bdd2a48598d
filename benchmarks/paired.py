"""Paired comparison of the arms over seeds and emulated links: what rackmend buys.

Runbook: ``python benchmarks/paired.py`` (3 seeds, 64 steps, 3 links: about 30 minutes
on 2 cores) or ``--quick`` (2 seeds, 48 steps, 2 links: about 10 minutes). For every link setting and seed,
each arm trains the same model on the same data for the same number of steps per
learner (so held-out loss compares at equal tokens), with no faults, M=4 learner
processes, each behind its own emulated link, against a real syncer process. Per arm
and link setting: compute utilization (time in inner steps / wall, per learner), tokens/s,
held-out loss of the final global model (equal tokens), WAN bytes per token (all of it,
and "steady": without the one-off join traffic of one model up and one per learner
down, which dominates a run this short), blocked time, median step and compute time;
medians over seeds with bootstrap 95 % confidence intervals. The ``local`` arm (no
rackmend, no link) is the step-time baseline: with no added latency, rackmend's step
time is compared with it, seed by seed.

Last line: ``RESULT ...`` with the headline ratios at the first link setting.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from _common import finish, parser
from rackmend.demo.orchestrate import ArmRun, run_arm
from rackmend.demo.report import loss_at_tokens
from rackmend.demo.spec import FaultPlan, LinkPlan, RunSettings, arm_specs
from rackmend.workloads import GPT, GPTConfig

ARMS = ("local", "data-parallel", "diloco", "rackmend", "rackmend-int4")
# (name, link): the WAN first, then a link with no added latency for the step-time check.
LINKS = (
    ("wan-100ms-50mbit", LinkPlan(bandwidth_mbit=50.0, latency_ms=100.0, jitter=0.5)),
    ("wan-30ms-200mbit", LinkPlan(bandwidth_mbit=200.0, latency_ms=30.0, jitter=0.5)),
    ("lan-0ms", LinkPlan(bandwidth_mbit=None, latency_ms=0.0, jitter=0.0)),
)


def bootstrap_ci(samples: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap confidence interval of the median."""
    if len(samples) < 2:
        return (samples[0], samples[0]) if samples else (float("nan"), float("nan"))
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(samples, k=len(samples))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def measure(run: ArmRun, common_tokens: int, model_bytes: int) -> dict[str, float]:
    healthy = run.learners
    # Joining costs a fixed amount (the first learner uploads the model once, each
    # learner downloads it once); what a longer run pays per token is the rest.
    one_off = model_bytes * (1 + len(run.learners)) if run.links else 0
    step_times = [t for ls in healthy for t in ls.step_times]
    loss = None if run.name == "local" else loss_at_tokens(run.points, common_tokens)
    return {
        "utilization": statistics.mean(run.utilization(ls) for ls in healthy),
        "utilization_min": min(run.utilization(ls) for ls in healthy),
        "tokens_per_s": run.tokens / run.wall_s,
        "loss_at_equal_tokens": float("nan") if loss is None else loss,
        "wan_bytes_per_token": run.wan_bytes / run.tokens if run.tokens else float("nan"),
        "steady_wan_bytes_per_token": (run.wan_bytes - one_off) / run.tokens if run.tokens else float("nan"),
        "uplink_bytes_per_token": ((sum(link["bytes_up"] for link in run.links.values()) - model_bytes * bool(one_off))
                                   / run.tokens if run.tokens else float("nan")),
        "blocked_s_per_learner": statistics.mean(ls.blocked_s for ls in healthy),
        "step_s_median": statistics.median(step_times),
        "compute_s_median": statistics.median(c for ls in healthy for c in _computes(run, ls.learner)),
    }


def _computes(run: ArmRun, lid: str) -> list[float]:
    return [r["compute"] for r in run.steps[lid]]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3, --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per learner (default 64, --quick 48)")
    p.add_argument("--links", default=None,
                   help="comma-separated link settings (default all; --quick: wan-100ms-50mbit,lan-0ms)")
    args = p.parse_args()
    seeds = args.seeds or (2 if args.quick else 3)
    steps = args.steps or (48 if args.quick else 64)
    names = args.links or ("wan-100ms-50mbit,lan-0ms" if args.quick else ",".join(n for n, _ in LINKS))
    chosen = [(n, link) for n, link in LINKS if n in names.split(",")]
    if not chosen:
        sys.exit(f"--links: none of {names!r} is known; use {', '.join(n for n, _ in LINKS)}")
    cells: dict[str, dict[str, list[dict[str, float]]]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rackmend-paired-") as tmp:
        for link_name, link in chosen:
            # The local arm has no link (one run, at the link with no added latency, is its
            # step-time baseline); the int4 arm matters where bandwidth is scarce.
            arms = tuple(a for a in ARMS if a != ("rackmend-int4" if link_name == "lan-0ms" else "local"))
            cells[link_name] = {arm: [] for arm in arms}
            for seed in range(seeds):
                s = RunSettings(duration_s=None, max_steps=steps, seed=seed, arms=arms, link=link,
                                faults=FaultPlan.none(), evals=4, model=GPTConfig())
                runs = {}
                for name, spec in arm_specs(s).items():
                    print(f"[{time.monotonic() - t_start:6.0f}s] {link_name} seed {seed}: {name} ...", flush=True)
                    runs[name] = run_arm(spec, s, Path(tmp) / f"{link_name}-{seed}-{name}")
                tokens = min(r.points[-1][0] for n, r in runs.items() if n != "local")
                model_bytes = sum(p.numel() * p.element_size() for p in GPT(s.model).parameters())
                for name, run in runs.items():
                    cells[link_name][name].append(measure(run, tokens, model_bytes))
    table, rows = summarise(cells)
    print(table)
    first = chosen[0][0]
    head = rows[first]
    result: dict[str, Any] = {
        "link": first,
        "util_rackmend": head["rackmend"]["utilization"]["median"],
        "util_dp": head["data-parallel"]["utilization"]["median"],
        "loss_ratio_rackmend_dp": head["rackmend"]["loss_at_equal_tokens"]["median"]
        / head["data-parallel"]["loss_at_equal_tokens"]["median"],
        "bytes_ratio_dp_rackmend": head["data-parallel"]["steady_wan_bytes_per_token"]["median"]
        / head["rackmend"]["steady_wan_bytes_per_token"]["median"],
    }
    if "rackmend-int4" in head:
        result["bytes_ratio_rackmend_int4"] = (head["rackmend"]["steady_wan_bytes_per_token"]["median"]
                                               / head["rackmend-int4"]["steady_wan_bytes_per_token"]["median"])
        result["uplink_ratio_rackmend_int4"] = (head["rackmend"]["uplink_bytes_per_token"]["median"]
                                                / head["rackmend-int4"]["uplink_bytes_per_token"]["median"])
        result["loss_ratio_int4_fp32"] = (head["rackmend-int4"]["loss_at_equal_tokens"]["median"]
                                          / head["rackmend"]["loss_at_equal_tokens"]["median"])
    if "lan-0ms" in rows:
        pairs = list(zip(cells["lan-0ms"]["rackmend"], cells["lan-0ms"]["local"]))
        result["step_ratio_rackmend_local_lan"] = statistics.median(r["step_s_median"] / l["step_s_median"]
                                                                    for r, l in pairs)
        result["compute_ratio_rackmend_local_lan"] = statistics.median(
            r["compute_s_median"] / l["compute_s_median"] for r, l in pairs)
    finish("paired", args.out, {"seeds": seeds, "steps": steps, "arms": ARMS,
                                "links": {n: vars(link) for n, link in chosen}, "cells": cells, "summary": rows},
           result)


def summarise(cells: dict[str, dict[str, list[dict[str, float]]]]) -> tuple[str, dict[str, Any]]:
    metrics = ("utilization", "tokens_per_s", "loss_at_equal_tokens", "wan_bytes_per_token",
               "steady_wan_bytes_per_token", "uplink_bytes_per_token", "blocked_s_per_learner", "step_s_median", "compute_s_median")
    rows: dict[str, Any] = {}
    lines = []
    head = f"{'link':<18} {'arm':<14}" + "".join(f" {m:>26}" for m in metrics)
    lines += [head, "-" * len(head)]
    for link_name, arms in cells.items():
        rows[link_name] = {}
        for arm, samples in arms.items():
            rows[link_name][arm] = {}
            cols = []
            for m in metrics:
                values = [s[m] for s in samples if s[m] == s[m]]  # drops NaN
                if not values:
                    rows[link_name][arm][m] = {"median": float("nan"), "ci95": [float("nan")] * 2, "n": 0}
                    cols.append(f" {'–':>26}")
                    continue
                med = statistics.median(values)
                lo, hi = bootstrap_ci(values)
                rows[link_name][arm][m] = {"median": med, "ci95": [lo, hi], "n": len(values)}
                cols.append(f" {med:>10.4g} [{lo:>6.4g},{hi:>6.4g}]")
            lines.append(f"{link_name:<18} {arm:<14}" + "".join(cols))
    return "\n".join(lines), rows


if __name__ == "__main__":
    main()
