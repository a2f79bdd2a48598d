"""BatchNorm statistics of racks on different data, merged by the syncer core (one merge)
and in training runs (learners and syncer), against one pass of BatchNorm over the union
of their data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rackmend import InProcessSyncer, LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core import Contribution, ContributionArrived, LearnerJoined, SyncerCore, pack_fragments
from rackmend.core.fragments import fragment_tensors

from helpers import run_threads

BATCH = 64


def batches(seed: int, n: int, loc: torch.Tensor, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [loc + scale * torch.randn(BATCH, loc.numel(), generator=g) for _ in range(n)]


def statistics(data: list[torch.Tensor]) -> nn.BatchNorm1d:
    """BatchNorm run in train mode over ``data``; momentum=None keeps the exact
    cumulative average of the batches' means and (unbiased) variances."""
    bn = nn.BatchNorm1d(data[0].shape[1], momentum=None)
    bn.train()
    with torch.no_grad():
        for x in data:
            bn(x)
    return bn


def test_merged_batchnorm_variance_matches_a_pass_over_the_union() -> None:
    loc_a, loc_b = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([5.0, -3.0, 1.0])
    rack_a = batches(0, 40, loc_a, 1.0)  # twice rack b's data, so weights 2/3 and 1/3
    rack_b = batches(1, 20, loc_b, 2.0)
    init = nn.Sequential(nn.BatchNorm1d(3))
    specs = pack_fragments(init, 1, 4)
    (theta,) = fragment_tensors(init, specs)
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=1, overlap=1),
        syncer=SyncerConfig(min_quorum=2, learners=("a", "b"), weighting="tokens", outer_optimizer="SGD",
                            outer_lr=1.0, outer_kwargs={}, failslow=False))
    core = SyncerCore(config, specs, [[t.detach().clone() for t in theta]])
    for lid in "ab":
        core.handle(LearnerJoined(lid), 0.0)
    for lid, data in (("a", rack_a), ("b", rack_b)):
        rack = nn.Sequential(statistics(data))
        (local,) = fragment_tensors(rack, specs)
        deltas = tuple((g - t).detach().clone() for g, t in zip(theta, local))
        c = Contribution(lid, 0, core.versions[0], 4, 4, float(len(data) * BATCH), 0.1, deltas)
        core.handle(ContributionArrived(c), 0.0)
    assert core.versions[0] == 1, "both in: the round merged"
    merged = core.global_parameters()

    # One pass over the union, its batches mixing both racks' samples as one rack would see them.
    union = torch.cat(rack_a + rack_b)[torch.randperm(60 * BATCH, generator=torch.Generator().manual_seed(2))]
    truth = statistics(list(union.split(BATCH)))
    assert torch.allclose(merged["0.running_mean"], truth.running_mean, atol=0.02)
    # Batches' unbiased variances vs the pooled one: equal up to sampling noise (~1 %).
    assert torch.allclose(merged["0.running_var"], truth.running_var, rtol=0.03), (merged["0.running_var"],
                                                                                    truth.running_var)
    # The plain weighted mean of the racks' variances (the old rule) misses the spread.
    plain = (2 * statistics(rack_a).running_var + statistics(rack_b).running_var) / 3
    assert not torch.allclose(plain, truth.running_var, rtol=0.3)


# ------------------------------------------------------------------ in training
class _Net(nn.Module):
    """BatchNorm on the input, then a linear regression: the statistics are the data's."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=momentum)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(x)).squeeze(-1)


SHIFT = {"l0": -3.0, "l1": 3.0}
"""Each rack's inputs: N(shift, 1) in every feature; the pooled variance is 1 + 9 = 10."""


def _rack_batch(lid: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * int(lid[1:]) + step)
    x = SHIFT[lid] + torch.randn(32, 4, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 1.5]) + 0.1 * torch.randn(32, generator=g)


def _train_racks(momentum: float | None, sync_every: int, overlap: int, steps: int) -> nn.Module:
    """Two racks on shifted data under a real RackmendOptimizer and in-process syncer;
    returns the global model (weights and merged statistics)."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return _Net(momentum)

    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=sync_every, num_fragments=1, overlap=overlap),
        syncer=SyncerConfig(min_quorum=2, learners=tuple(SHIFT), outer_optimizer="SGD", outer_lr=1.0,
                            outer_kwargs={}, failslow=False),
        learner=LearnerConfig(wait_timeout=30), deterministic=True)
    hub = InProcessSyncer.for_model(config, model())

    def rack(lid: str) -> None:
        m = model()
        opt = RackmendOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.01), config, hub.connect(), learner_id=lid)
        for t in range(1, steps + 1):
            x, y = _rack_batch(lid, t)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step(tokens=32)
        opt.close()

    run_threads(rack, [(lid,) for lid in SHIFT])
    hub.close()
    glob = model()
    glob.load_state_dict(hub.core.global_parameters(), strict=False)
    return glob


@pytest.mark.parametrize("momentum,sync_every,overlap", [(0.1, 8, 0), (0.1, 4, 1), (None, 8, 1)])
def test_statistics_merged_in_training_match_the_pooled_data(momentum: float | None, sync_every: int,
                                                             overlap: int) -> None:
    """H < 1/momentum: after each merge a rack's running statistics move only part of the
    way from the global value back to its own data before the next send. What the
    learners send is their own estimate, so the merged variance is the pooled one (10),
    not the ~6 that counting the global value again at every merge gave (issue 33,
    item 10), and the global model predicts with its merged statistics as well as with
    statistics recomputed over both racks' data."""
    glob = _train_racks(momentum, sync_every, overlap, steps=20 * sync_every)
    var, mean = glob.bn.running_var, glob.bn.running_mean
    assert mean.abs().max() < 0.3, mean
    assert torch.allclose(var, torch.full_like(var, 10.0), rtol=0.12), var

    held_out = [_rack_batch(lid, 10_000 + i) for lid in SHIFT for i in range(8)]
    # One pass over both racks' data, its batches mixing them (as in the test above).
    union = torch.cat([x for x, _ in held_out])
    union = union[torch.randperm(len(union), generator=torch.Generator().manual_seed(3))]
    recomputed = copy.deepcopy(glob)
    recomputed.bn.reset_running_stats()
    recomputed.bn.momentum = None
    recomputed.train()
    with torch.no_grad():
        for x in union.split(32):
            recomputed.bn(x)

    def mse(m: nn.Module) -> float:
        m.eval()
        with torch.no_grad():
            return sum(float(nn.functional.mse_loss(m(x), y)) for x, y in held_out) / len(held_out)

    assert abs(mse(glob) / mse(recomputed) - 1) < 0.05, (mse(glob), mse(recomputed))
