"""The merge and the outer step reproduce the independent float64 vectors
(``data/merge_rounds.json``, computed from the design's equations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.records import Merged
from rackmend.core import (
    Contribution,
    ContributionArrived,
    FragmentSpec,
    LearnerJoined,
    SyncerCore,
    TensorSpec,
    contribution_weight,
    merge_deltas,
)

CASES = json.loads((Path(__file__).parent / "data" / "merge_rounds.json").read_text())["cases"]
RTOL, ATOL = 1e-5, 1e-6


def _close(got: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_merge_matches_vectors(case: dict) -> None:
    for rnd in case["rounds"]:
        weights = [contribution_weight(case["weighting"], k, s) for k, s in zip(rnd["c_tokens"], rnd["c_steps"])]
        deltas = [[torch.tensor(d, dtype=torch.float32)] for d in rnd["deltas"]]
        (merged,) = merge_deltas(deltas, weights, case["merge"])
        _close(merged, rnd["merged"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_syncer_core_outer_steps_match_vectors(case: dict) -> None:
    """Every round through the full state machine: quorum, merge, Nesterov outer step."""
    n = len(case["theta_start"])
    learners = tuple(case["rounds"][0]["learners"])
    outer = case["outer"]
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=1, overlap=1),
        syncer=SyncerConfig(
            min_quorum=len(learners), learners=learners, weighting=case["weighting"], merge=case["merge"],
            outer_optimizer=outer["optimizer"], outer_lr=outer["lr"],
            outer_kwargs={"momentum": outer["momentum"], "nesterov": outer["nesterov"]},
            # The vectors pin the merge and outer-step equations; their deltas span 400x
            # on purpose, which the norm guard (a policy on top of them) would clip.
            norm_guard=0.0,
        ),
    )
    spec = FragmentSpec(0, 0, (TensorSpec("theta", (n,), torch.float32),))
    core = SyncerCore(config, [spec], [[torch.tensor(case["theta_start"], dtype=torch.float32)]])
    for lid in learners:
        core.handle(LearnerJoined(lid), now=0.0)
    for r, rnd in enumerate(case["rounds"]):
        merges = []
        # Arrival order reversed on purpose: the result must not depend on it.
        for i in reversed(range(len(rnd["learners"]))):
            c = Contribution(rnd["learners"][i], 0, r, 10 * (r + 1), rnd["c_steps"][i], rnd["c_tokens"][i], 0.0,
                             (torch.tensor(rnd["deltas"][i], dtype=torch.float32),))
            merges += [a for a in core.handle(ContributionArrived(c), now=float(r)) if isinstance(a, Merged)]
        assert len(merges) == 1, "the round must end once every listed learner is in"
        assert core.versions[0] == r + 1
        _close(core.frags[0].theta[0], rnd["theta_after"])
