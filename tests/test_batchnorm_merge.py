"""BatchNorm statistics of racks on different data, merged by the syncer core, against
one pass of BatchNorm over the union of their data."""

from __future__ import annotations

import torch
from torch import nn

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core import Contribution, ContributionArrived, LearnerJoined, SyncerCore, pack_fragments
from rackmend.core.fragments import fragment_tensors

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
