"""The goodput table of docs/simulate.md: data-parallel (not elastic, elastic) and
decoupled learners (M = 2, 4, 8, 16, elastic) under chip failures, at 150k to 2.4M chips,
over the real syncer and learner cores in virtual time; mean ± sd over seeds, beside
the Decoupled DiLoCo paper's published cells. Also measures simulated learner-steps per
second of one cell (1.2M chips, M=16).

    python benchmarks/simulate_goodput.py              # 24 simulated hours, 3 seeds
    python benchmarks/simulate_goodput.py --quick      # 1 hour, 1 seed

Every assumption is a ``Failures`` field (``rackmend simulate --help``); the defaults are
the calibrated ones. The published run (3 seeds, 24 hours, the defaults) writes
benchmarks/results/simulate_goodput.json and docs/img/simulate_goodput.png, which the
docs cite; any other run (``--quick``, other seeds or hours) writes
``benchmarks/results/scratch/`` instead unless ``--out``/``--plot`` say where. Prints a
line per cell as it finishes.
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser  # noqa: E402

from rackmend.config import RackmendConfig, ScheduleConfig  # noqa: E402
from rackmend.sim import Failures, RackSpec, SimConfig, simulate  # noqa: E402
from rackmend.sim.goodput import simulate_data_parallel  # noqa: E402

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PUBLISHED = {
    "data-parallel, not elastic": (72, 57, 38, 27, 18),
    "data-parallel, elastic": (88, 80, 69, 58, 40),
    "decoupled, M = 8": (98, 96, 94, 88, 80),
}
H, P, TAU = 24, 4, 2


def cell(system: str, m: int, chips: int, seed: int, hours: float) -> dict:
    duration = hours * 3600.0
    t0 = time.perf_counter()
    if system.startswith("data-parallel"):
        mode = "restart" if "not elastic" in system else "elastic"
        g = simulate_data_parallel(Failures(chips=chips, failure_mode=mode), duration=duration, seed=seed)
        steps, extra = 0, {}
    else:
        run = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU))
        r = simulate(SimConfig(run=run, racks=tuple(RackSpec() for _ in range(m)), duration=duration, seed=seed,
                               failures=Failures(chips=chips, failure_mode="elastic")))
        g = r.goodput
        steps = sum(lr.steps for lr in r.learners)
        extra = {"merges": sum(r.merges), "version_lag_median": r.version_lag_median,
                 "version_lag_max": r.version_lag_max, "max_merge_gap": r.max_merge_gap}
    assert g is not None
    return {"system": system, "m": m, "chips": chips, "seed": seed, "goodput": g.goodput, "uptime": g.uptime,
            "shares": g.shares(), "failures": g.failures, "learner_steps": steps,
            "wall_s": time.perf_counter() - t0, **extra}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; --quick 1)")
    p.add_argument("--hours", type=float, default=None, help="simulated hours per cell (default 24; --quick 1)")
    p.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes (default 1)")
    p.add_argument("--plot", type=Path, default=None,
                   help="plot file (default: docs/img/simulate_goodput.png for the published run, else scratch)")
    a = p.parse_args()
    seeds = a.seeds or (1 if a.quick else 3)
    hours = a.hours or (1.0 if a.quick else 24.0)
    published = seeds == 3 and hours == 24.0
    scratch = Path(__file__).parent / "results" / "scratch"
    out = a.out or (None if published else scratch / "simulate_goodput.json")
    plot = a.plot or (Path(__file__).parent.parent / "docs/img/simulate_goodput.png" if published
                      else scratch / "simulate_goodput.png")
    systems = [("data-parallel, not elastic", 1), ("data-parallel, elastic", 1)] + [
        (f"decoupled, M = {m}", m) for m in (2, 4, 8, 16)]
    jobs = [(s, m, n, seed, hours) for s, m in systems for n in CHIPS for seed in range(seeds)]
    short = Failures().short_run_warning(hours * 3600.0)
    if short:
        print(f"warning: {short}", flush=True)
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(a.jobs) as pool:
        futures = [pool.submit(cell, *job) for job in jobs]
        for done in as_completed(futures):
            r = done.result()
            rows.append(r)
            print(f"[{len(rows)}/{len(jobs)}] {r['system']}, {r['chips'] // 1000}k chips, seed {r['seed']}: "
                  f"goodput {100 * r['goodput']:.1f} %, uptime {100 * r['uptime']:.1f} % ({r['wall_s']:.0f} s; "
                  f"{time.perf_counter() - t0:.0f} s so far)", flush=True)
    rows.sort(key=lambda r: jobs.index((r["system"], r["m"], r["chips"], r["seed"], hours)))
    total = time.perf_counter() - t0
    # Speed: the M=16, 1.2M-chip cell (alone in its process).
    speed = [r["learner_steps"] / r["wall_s"] for r in rows if r["m"] == 16 and r["chips"] == 1_200_000]
    table = {}
    print(f"goodput %, mean ± sd over {seeds} seed(s), {hours:g} simulated hours, (published), "
          "* = more than 5 points off")
    print(f"{'system':<28}" + "".join(f"{n // 1000:>18}k" for n in CHIPS))
    for s, _ in systems:
        cells = []
        line = f"{s:<28}"
        for i, n in enumerate(CHIPS):
            g = [100 * r["goodput"] for r in rows if r["system"] == s and r["chips"] == n]
            mean, sd = statistics.fmean(g), statistics.stdev(g) if len(g) > 1 else 0.0
            pub = PUBLISHED.get(s, (None,) * 5)[i]
            off = pub is not None and abs(mean - pub) > 5
            cells.append({"chips": n, "mean": mean, "sd": sd, "published": pub, "within_5": None if pub is None
                          else not off})
            line += f"{mean:>9.1f}±{sd:<4.1f}" + (f"({pub:>2}){'*' if off else ' '}" if pub else " " * 5)
        table[s] = cells
        print(line)
    print(f"{len(rows)} cells in {total:.0f} s with {a.jobs} process(es); "
          f"M=16 at 1.2M chips: {statistics.fmean(speed):.0f} simulated learner-steps/s")
    _plot(table, plot)
    finish("simulate_goodput", out, {"seeds": seeds, "hours": hours, "H": H, "P": P, "tau": TAU,
                                       "failures": Failures().__dict__, "table": table, "cells": rows,
                                       "wall_s": total},
           {"learner_steps_per_s": statistics.fmean(speed), "table_s": total,
            "decoupled_m8_1.2M": table["decoupled, M = 8"][3]["mean"]})


def _plot(table: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [n / 1e6 for n in CHIPS]
    for s, cells in table.items():
        line = ax.errorbar(x, [c["mean"] for c in cells], yerr=[c["sd"] for c in cells], marker="o", capsize=3,
                           label=s)
        pub = [c["published"] for c in cells]
        if pub[0] is not None:
            ax.plot(x, pub, linestyle="--", marker="x", color=line[0].get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:g}M" for v in x])
    ax.minorticks_off()  # the log axis's minor ticks printed stray labels over "2.4M"
    ax.set_xlabel("chips (MTBI 1 year per chip)")
    ax.set_ylabel("goodput %")
    ax.set_title("simulated goodput (solid) vs published (dashed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
