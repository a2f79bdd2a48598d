"""Simulated learner-steps per second of ``rackmend simulate`` in a few scenarios.

Runbook: ``python benchmarks/simulate_speed.py`` (M=16 for 1 simulated hour and M=64 for
15 minutes, each scenario 3 times; ``--quick``: once). Scenarios: ``plain`` (no jitter,
no failures), ``shared`` (20 % jitter, every learner 1.5x slower through the middle 40 %
of the run, learner 0 2x from half-time: the fail-slow monitor reads the fleet at every
contribution), ``fail`` (1.2M chips, elastic chip failures). H=24, P=4, tau=2, 1 s steps.
Reports wall-clock and CPU-time learner-steps/s, the median of the repeats and their
range (CPU time is steadier beside other jobs).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _common import finish, parser
from rackmend.config import RackmendConfig, ScheduleConfig
from rackmend.sim import Failures, RackSpec, SimConfig, Slowdown, simulate


def one(m: int, duration: float, scenario: str) -> dict[str, Any]:
    run = RackmendConfig(schedule=ScheduleConfig(sync_every=24, num_fragments=4, overlap=2))
    extra: dict[str, Any] = {}
    if scenario == "fail":
        extra["failures"] = Failures(chips=1_200_000, failure_mode="elastic")
    if scenario == "shared":
        extra["slowdowns"] = tuple(Slowdown(learner=i, factor=1.5, start=duration * 0.3, end=duration * 0.7)
                                   for i in range(m)) + (Slowdown(learner=0, factor=2.0, start=duration * 0.5),)
    jitter = 0.2 if scenario == "shared" else 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    report = simulate(SimConfig(run=run, racks=tuple(RackSpec(jitter=jitter) for _ in range(m)), duration=duration,
                                seed=0, **extra))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = sum(lr.steps for lr in report.learners)
    return {"steps": steps, "sps": steps / wall, "cpu_sps": steps / cpu}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    a = p.parse_args()
    repeats = 1 if a.quick else 3
    rows: dict[str, dict[str, float]] = {}
    for m, duration in ((16, 3600.0), (64, 900.0)):
        for scenario in ("plain", "shared", "fail"):
            runs = [one(m, duration, scenario) for _ in range(repeats)]
            sps, cpu = [r["sps"] for r in runs], [r["cpu_sps"] for r in runs]
            row = rows[f"M={m} {scenario}"] = {
                "sps": statistics.median(sps), "sps_min": min(sps), "sps_max": max(sps),
                "cpu_sps": statistics.median(cpu), "cpu_sps_min": min(cpu), "cpu_sps_max": max(cpu),
                "steps": runs[0]["steps"]}
            print(f"M={m:<3} {scenario:<7} {row['sps']:>9.0f} learner-steps/s ({row['sps_min']:.0f}-"
                  f"{row['sps_max']:.0f}; CPU time: {row['cpu_sps']:.0f}, {row['cpu_sps_min']:.0f}-"
                  f"{row['cpu_sps_max']:.0f})", flush=True)
    finish("simulate_speed", a.out, {"inputs": {"repeats": repeats}, "rows": rows},
           {k.replace(" ", "_").replace("=", ""): v["sps"] for k, v in rows.items()})


if __name__ == "__main__":
    main()
