"""How fast the norm guard's scale grows in honest training: runs benchmarks/quality.py
(its arguments passed through) and records, at every merge of a fragment, the window's
lower median over the previous merge's scale, and whether ``GUARD_GROWTH`` bound it.

Runbook: ``python benchmarks/guard_growth.py --quick --steps 480 --section arms --arms
rackmend,rackmend-async,rackmend-desloc``. Prints quality.py's table, then one line
``GUARDSTATS {...}``: merges seen, the largest and 99th-percentile growth per merge, and
how many times the cap held the scale down (0 in honest runs: docs/reliability.md).

It wraps ``SyncerCore._rescale`` to observe (not change) each rescale; the run's merges,
and so quality.py's results, are those of an unwrapped run.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

from rackmend.core import syncer as S

stats: dict[str, Any] = {"merges": 0, "max_growth": 0.0, "capped": 0}
growths: list[float] = []
_rescale = S.SyncerCore._rescale


def _observed(self: S.SyncerCore, p: int) -> None:
    window, previous = self.norms[p], self.norm_scale[p]
    _rescale(self, p)
    if previous is not None and len(window) >= S.GUARD_MIN_NORMS:
        raw = sorted(window)[(len(window) - 1) // 2]
        stats["merges"] += 1
        growths.append(raw / previous)
        stats["max_growth"] = max(stats["max_growth"], raw / previous)
        stats["capped"] += raw > self.norm_scale[p]


if __name__ == "__main__":
    S.SyncerCore._rescale = _observed  # type: ignore[method-assign]
    quality = str(Path(__file__).with_name("quality.py"))
    sys.argv = [quality, *sys.argv[1:]]
    try:
        runpy.run_path(quality, run_name="__main__")
    finally:
        growths.sort()
        stats["p99_growth"] = growths[int(0.99 * (len(growths) - 1))] if growths else None
        print("GUARDSTATS", json.dumps(stats))
