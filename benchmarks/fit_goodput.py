"""The calibration of docs/simulate.md: the goodput model's unpublished times, fitted by
least squares to the Decoupled DiLoCo paper's two data-parallel rows, and how a failure
or repair during an elastic reshape is charged, chosen by the same fit.

- ``restart_time`` on the non-elastic row, over 60..98 s in steps of 2;
- ``downscale_time`` x ``upscale_time`` on the elastic row, over 2..28 x 0..28 s in
  steps of 2, once per ``reshape_overlap`` (``absorb``, ``restart``).

Each cell is the mean over seeds 0-2 of 24 simulated hours (``simulate_data_parallel``:
the data-parallel baselines, no learners, so the whole fit takes a few minutes). The
decoupled rows are not fitted: they follow from these times (``simulate_goodput.py``).

    python benchmarks/fit_goodput.py --jobs 2
    python benchmarks/fit_goodput.py --quick     # 6 hours, 1 seed, 4 s steps

Prints the best fits and their cells beside the published ones; writes
``benchmarks/results/fit_goodput.json`` (``--quick``: ``results/scratch/``).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, finish, parser  # noqa: E402
from simulate_goodput import CHIPS, PUBLISHED  # noqa: E402

from rackmend.sim import Failures  # noqa: E402
from rackmend.sim.goodput import simulate_data_parallel  # noqa: E402


def row(kw: dict, hours: float, seeds: int) -> list[float]:
    """Goodput % per chip count, mean over seeds, of a data-parallel job with ``Failures(**kw)``."""
    return [100 * statistics.mean(simulate_data_parallel(Failures(chips=n, **kw), duration=hours * 3600, seed=s).goodput
                                  for s in range(seeds)) for n in CHIPS]


def sse(cells: list[float], published: tuple[int, ...]) -> float:
    return sum((c - p) ** 2 for c, p in zip(cells, published))


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    a = p.parse_args()
    hours, seeds, step = (6.0, 1, 4) if a.quick else (24.0, 3, 2)
    candidates = [("not elastic", {"failure_mode": "restart", "restart_time": float(r)}) for r in range(60, 99, step)]
    for overlap in ("absorb", "restart"):
        candidates += [(f"elastic, {overlap}", {"failure_mode": "elastic", "reshape_overlap": overlap,
                                                "downscale_time": float(d), "upscale_time": float(u)})
                       for d, u in itertools.product(range(2, 29, step), range(0, 29, step))]
    print(f"{len(candidates)} candidate settings x {len(CHIPS)} chip counts x {seeds} seed(s) of {hours:g} h",
          flush=True)
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(row, [kw for _, kw in candidates], itertools.repeat(hours), itertools.repeat(seeds),
                             chunksize=8))
    best: dict[str, dict] = {}
    for (family, kw), cells in zip(candidates, rows):
        published = PUBLISHED["data-parallel, not elastic" if family == "not elastic" else "data-parallel, elastic"]
        fit = {"settings": kw, "cells": cells, "sse": sse(cells, published),
               "max_miss": max(abs(c - q) for c, q in zip(cells, published)),
               "within_5": sum(abs(c - q) <= 5 for c, q in zip(cells, published))}
        if family not in best or fit["sse"] < best[family]["sse"]:
            best[family] = fit
    print(f"\n{'best fit':<20}{'settings':<48}" + "".join(f"{n // 1000:>8}k" for n in CHIPS) + "   rms  within 5")
    for family, fit in best.items():
        published = PUBLISHED["data-parallel, not elastic" if family == "not elastic" else "data-parallel, elastic"]
        shown = {k: v for k, v in fit["settings"].items() if k not in ("failure_mode", "reshape_overlap")}
        print(f"{family:<20}{str(shown):<48}" + "".join(f"{c:>9.1f}" for c in fit["cells"])
              + f"{(fit['sse'] / len(CHIPS)) ** 0.5:>6.1f}{fit['within_5']:>7}/5")
        print(f"{'  published':<68}" + "".join(f"{q:>9}" for q in published))
    out = a.out or (RESULTS / "scratch" / "fit_goodput.json" if a.quick else None)
    finish("fit_goodput", out, {"hours": hours, "seeds": seeds, "grid_step_s": step, "best": best},
           {f"{family.replace(', ', '_').replace(' ', '_')}_rms": (fit["sse"] / len(CHIPS)) ** 0.5
            for family, fit in best.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
