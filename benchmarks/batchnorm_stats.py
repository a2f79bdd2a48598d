"""Merged BatchNorm statistics in training, against the pooled variance of the racks' data.

Two racks on N(-3, 1) and N(+3, 1) in every feature (pooled variance 10) train a
BatchNorm -> Linear regression for 20 rounds through ``RackmendOptimizer`` and an
in-process syncer (``tests/test_batchnorm_merge.py``'s run). For each schedule it
reports the merged ``running_var`` per feature two ways: as learners send it (their
rack's own estimate since the last merged value, ``rackmend.learner.statistics``) and,
for comparison, with the running values sent as they stand (the rule before that
module: ``RunningStats.sent`` patched to send nothing else, in this process only).

    python benchmarks/batchnorm_stats.py      # a few seconds

Prints a table and writes ``benchmarks/results/batchnorm_stats.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from _common import finish, parser  # noqa: E402
from test_batchnorm_merge import _train_racks  # noqa: E402

from rackmend.learner.statistics import RunningStats  # noqa: E402

SCHEDULES = [(0.1, 8, 0), (0.1, 4, 1), (None, 8, 1), (0.1, 64, 0)]
"""(BatchNorm momentum, H, overlap)."""


def main() -> int:
    parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'momentum':>8} {'H':>3} {'tau':>3}  {'own estimate':>24}  {'as they stand':>24}")
    for momentum, h, tau in SCHEDULES:
        own = _train_racks(momentum, h, tau, steps=20 * h).bn.running_var.tolist()
        with mock.patch.object(RunningStats, "sent", lambda self, fragment, pieces: None):
            raw = _train_racks(momentum, h, tau, steps=20 * h).bn.running_var.tolist()
        rows.append({"momentum": momentum, "H": h, "overlap": tau, "own_estimate": own, "as_they_stand": raw})
        span = lambda v: f"{min(v):.2f}-{max(v):.2f}"  # noqa: E731
        print(f"{str(momentum):>8} {h:>3} {tau:>3}  {span(own):>24}  {span(raw):>24}", flush=True)
    first = rows[0]
    finish("batchnorm_stats", None, {"pooled_variance": 10.0, "rounds": 20, "rows": rows},
           {"h8_own_min": min(first["own_estimate"]), "h8_own_max": max(first["own_estimate"]),
            "h8_as_they_stand_max": max(first["as_they_stand"])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
