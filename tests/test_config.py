"""Config validation names the field and says what to change."""

from __future__ import annotations

import pytest

from rackmend import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: SyncerConfig(min_quorum=3, learners=("a", "b")), "min_quorum"),
        (lambda: ScheduleConfig(sync_every=0), "sync_every"),
        (lambda: ScheduleConfig(sync_every=4, overlap=4), "overlap"),
        (lambda: ScheduleConfig(overlap=-1), "overlap"),
        (lambda: ScheduleConfig(packing="round_robin"), "packing"),
        (lambda: SyncerConfig(grace_gamma=0.0), "grace_gamma"),
        (lambda: SyncerConfig(grace_gamma=1.5), "grace_gamma"),
        (lambda: SyncerConfig(weighting="tokens2"), "weighting"),
        (lambda: SyncerConfig(merge="median"), "merge"),
        (lambda: SyncerConfig(anchoring="learner"), "anchoring"),
        (lambda: SyncerConfig(outer_optimizer="NotAnOptimizer"), "outer_optimizer"),
        (lambda: SyncerConfig(learners=("a", "a")), "learners"),
        (lambda: LearnerConfig(apply="replace"), "apply"),
        (lambda: LearnerConfig(mix_alpha=2.0), "mix_alpha"),
    ],
)
def test_bad_values_are_rejected_with_the_field_name(build, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        build()


def test_defaults_are_decoupled_diloco() -> None:
    c = RackmendConfig()
    assert (c.schedule.sync_every, c.schedule.num_fragments, c.schedule.overlap, c.syncer.min_quorum) == (24, 24, 2, 1)
    # The outer step: SGD lr 1.0 without momentum, set by benchmarks/quality.py (not DiLoCo's 0.7/0.9).
    assert c.syncer.weighting == "tokens_sq_per_step" and c.syncer.outer_lr == 1.0
    assert c.syncer.resolved_outer_kwargs() == {}


def test_kw_only() -> None:
    with pytest.raises(TypeError):
        ScheduleConfig(4)  # type: ignore[misc]


def test_outer_kwargs_mismatch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="outer_kwargs"):
        SyncerConfig(outer_optimizer="Adam", outer_kwargs={"nesterov": True})
    assert SyncerConfig(outer_optimizer="Adam").resolved_outer_kwargs() == {}
