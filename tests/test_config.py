"""Config validation names the field and says what to change."""

from __future__ import annotations

import dataclasses

import pytest

from rackmend import CompressionConfig, ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.codecs import CODECS
from rackmend.config import APPLY_RULES, MERGES, RunConfig, field_docs, literal_choices


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
        (lambda: SyncerConfig(staleness_decay=-0.1), "staleness_decay"),
        (lambda: SyncerConfig(staleness_decay=float("nan")), "staleness_decay"),
        (lambda: SyncerConfig(staleness_decay=float("inf")), "staleness_decay"),
        (lambda: SyncerConfig(staleness_cutoff=0), "staleness_cutoff"),
        (lambda: SyncerConfig(staleness_cutoff=-2), "staleness_cutoff"),
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


CONFIGS = (ScheduleConfig, SyncerConfig, LearnerConfig, CompressionConfig, RunConfig, RackmendConfig)


def test_every_field_has_a_docstring() -> None:
    for cls in CONFIGS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert len(docs.get(f.name, "")) > 10, f"{cls.__name__}.{f.name} has no docstring"


def test_choice_fields_are_literal_typed() -> None:
    found = {(cls.__name__, name): allowed for cls in CONFIGS for name, allowed in literal_choices(cls).items()}
    assert {("ScheduleConfig", "packing"), ("SyncerConfig", "weighting"), ("SyncerConfig", "merge"),
            ("SyncerConfig", "anchoring"), ("LearnerConfig", "apply")} <= set(found)
    assert found[("SyncerConfig", "merge")] == MERGES and found[("LearnerConfig", "apply")] == APPLY_RULES


@pytest.mark.parametrize("cls,name", [(cls, name) for cls in (ScheduleConfig, SyncerConfig, LearnerConfig)
                                      for name in literal_choices(cls)])
def test_a_literal_field_rejects_other_values_listing_the_allowed(cls, name: str) -> None:
    allowed = literal_choices(cls)[name]
    for value in allowed:
        assert getattr(cls(**{name: value}), name) == value
    with pytest.raises(ConfigError) as err:
        cls(**{name: allowed[0][:-1].title()})  # a typo: a letter short, capitalised
    text = str(err.value)
    assert text.startswith(f"{name}=") and all(a in text for a in allowed), text
    assert f"did you mean {allowed[0]!r}" in text, text  # the typo's closest value
    with pytest.raises(ConfigError, match="one of"):
        cls(**{name: "zzzzzzzz"})


def test_codec_names_are_checked_against_the_registry() -> None:
    with pytest.raises(ConfigError, match="compression.uplink='int9'.*" + ".*".join(CODECS)):
        CompressionConfig(uplink="int9")


def test_the_syncer_config_has_no_learner_part() -> None:
    run = RunConfig(deterministic=True)
    assert {f.name for f in dataclasses.fields(RunConfig)} == {"syncer", "compression", "deterministic"}
    full = RackmendConfig(deterministic=True)
    assert isinstance(full, RunConfig) and full.apply_rule() == "overwrite"
    assert not hasattr(run, "apply_rule") and run.replace(deterministic=False).deterministic is False
    schedule = ScheduleConfig()
    object.__setattr__(schedule, "packing", "stripes")  # past the freeze and its own check
    with pytest.raises(ConfigError, match="packing='stripes'.*balanced, strided"):
        RackmendConfig(schedule=schedule)  # a part's values are checked again
    with pytest.raises(ConfigError, match="SyncerConfig.overlap=1 pins tau on the syncer, but ScheduleConfig.overlap "
                                          "is 2"):
        RackmendConfig(syncer=SyncerConfig(overlap=1))
    assert RackmendConfig(syncer=SyncerConfig(overlap=2)).syncer.overlap == 2


def test_a_config_cannot_change_under_a_built_optimizer(one_thread: None) -> None:
    """``cfg.schedule.overlap = 99`` after building the optimizer used to be taken: the
    learner then never applied a merge (versions [0, 0] after 48 steps) and nothing
    failed. Every config refuses the change, saying how to build a changed copy, and the
    run trains as configured."""
    from helpers import make_inner, make_model, train

    from rackmend import InProcessSyncer, RackmendOptimizer
    from rackmend.compat.tsugi import MendConfig
    from rackmend.service import ServiceConfig

    config = RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=2, overlap=2),
                            syncer=SyncerConfig(outer_kwargs={"momentum": 0.0}))
    hub = InProcessSyncer.for_model(config, make_model())
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
    try:
        with pytest.raises(dataclasses.FrozenInstanceError,
                           match=r"ScheduleConfig.overlap cannot change.*config.replace\(schedule=dataclasses.replace"):
            config.schedule.overlap = 99  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError, match="RackmendConfig.deterministic"):
            opt.config.deterministic = True  # type: ignore[misc]
        with pytest.raises(TypeError, match="frozen config"):
            config.syncer.outer_kwargs["momentum"] = 0.9  # type: ignore[index]
        train(opt, model, "l0", range(1, 49))
        # 6 sends per fragment; how many merges are back by the last step depends on timing.
        assert min(opt.versions) >= 1, f"no merge applied in 48 steps (versions {opt.versions})"
    finally:
        opt.close()
        hub.close()
    # What the caller passed in stays theirs: changing it later cannot reach the config.
    roster, kwargs = ["a", "b"], {"momentum": 0.5}
    sc = SyncerConfig(learners=roster, min_quorum=2, outer_kwargs=kwargs)  # type: ignore[arg-type]
    roster.append("c")
    kwargs["momentum"] = 0.9
    assert sc.learners == ("a", "b") and sc.outer_kwargs == {"momentum": 0.5}
    changed = config.replace(schedule=dataclasses.replace(config.schedule, overlap=3))
    assert changed.schedule.overlap == 3 and config.schedule.overlap == 2
    for part, name, value in ((ServiceConfig(), "bind", "tcp://127.0.0.1:1"), (MendConfig(), "sync_period_steps", 4),
                              (config.learner, "mix_alpha", 0.1), (config.compression, "uplink", "int8")):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"{type(part).__name__}.{name} cannot change"):
            setattr(part, name, value)
