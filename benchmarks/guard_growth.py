"""How the norm guard behaves in honest training: runs benchmarks/quality.py (its
arguments passed through) and records, at every rescale of a fragment's guard scale, the
window's lower median over the previous scale, whether ``GUARD_GROWTH`` or the
long-horizon cap (``GUARD_LONG_GROWTH`` x the history's median) held the scale down, and
every contribution the guard clipped.

Runbook: ``python benchmarks/guard_growth.py --quick --steps 480 --section arms --arms
rackmend,rackmend-async,rackmend-desloc``. Prints quality.py's table, then one line
``GUARDSTATS {...}``: rescales seen, the largest and 99th-percentile growth per merge,
how many times each cap held the scale down, and ``clipped``: contributions clipped (0
in honest runs: docs/reliability.md). Writes the same as JSON to
``benchmarks/results/guard_growth.json``.

It wraps ``SyncerFragment.rescale`` and ``SyncerCore._guard`` to observe (not change)
them; the run's merges, and so quality.py's results, are those of an unwrapped run.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

from rackmend.core import syncer as S
from rackmend.core import syncer_fragment as F

stats: dict[str, Any] = {"rescales": 0, "max_growth": 0.0, "capped_per_merge": 0, "capped_long": 0, "clipped": 0}
growths: list[float] = []
_rescale = F.SyncerFragment.rescale
_guard = S.SyncerCore._guard


def _observed_rescale(self: F.SyncerFragment) -> None:
    previous = self.norm_scale
    long_cap = self.long_cap()
    _rescale(self)
    if previous is not None and len(self.norms) >= F.GUARD_MIN_NORMS:
        raw = self.window_median()
        stats["rescales"] += 1
        growths.append(raw / previous)
        stats["max_growth"] = max(stats["max_growth"], raw / previous)
        stats["capped_per_merge"] += raw > F.GUARD_GROWTH * previous
        stats["capped_long"] += min(raw, F.GUARD_GROWTH * previous) > long_cap


def _observed_guard(self: S.SyncerCore, c: Any, norm: float, now: float, actions: list) -> Any:
    out = _guard(self, c, norm, now, actions)
    stats["clipped"] += out is not None and out is not c
    return out


if __name__ == "__main__":
    F.SyncerFragment.rescale = _observed_rescale  # type: ignore[method-assign]
    S.SyncerCore._guard = _observed_guard  # type: ignore[method-assign]
    quality = str(Path(__file__).with_name("quality.py"))
    sys.argv = [quality, *sys.argv[1:]]
    try:
        runpy.run_path(quality, run_name="__main__")
    finally:
        growths.sort()
        stats["p99_growth"] = growths[int(0.99 * (len(growths) - 1))] if growths else None
        print("GUARDSTATS", json.dumps(stats))
        out = Path(__file__).with_name("results") / "guard_growth.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"argv": sys.argv[1:], **stats}, indent=2) + "\n")
