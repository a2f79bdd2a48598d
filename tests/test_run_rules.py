"""The rules learners and the syncer negotiate have one owner (issue 35, item 3):
``RunRules.validate`` (through ``config.schedule_problem``) decides for a config and for
a hello from the wire alike, with the same sentence."""

from __future__ import annotations

import dataclasses

import pytest

from rackmend.config import CompressionConfig, ConfigError, RackmendConfig, ScheduleConfig
from rackmend.core.fragments import pack_fragments
from rackmend.core.settings import RunRules
from rackmend.transport import wire

from helpers import make_model

GOOD = RunRules.from_config(RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=2, overlap=1)))

# (what a config would say, the same values as a learner would report them)
BROKEN = [
    (dict(sync_every=8, num_fragments=2, overlap=8), dict(overlap=8)),
    (dict(sync_every=8, num_fragments=2, overlap=1, desloc=True, desloc_ku=12),
     dict(desloc=True, desloc_ku=12, desloc_kv=48)),
    (dict(sync_every=8, num_fragments=2, overlap=1, desloc=True, desloc_kv=20),
     dict(desloc=True, desloc_ku=24, desloc_kv=20)),
]


def _parse(rules: RunRules) -> wire.Hello:
    frags = pack_fragments(make_model(), rules.num_fragments, rules.sync_every)
    msg = wire.decode_header(wire.hello_frames("a", 0, 1, frags, rules), wire.LEARNER_TYPES, 1 << 24)
    return wire.parse_hello(msg)


@pytest.mark.parametrize("schedule,reported", BROKEN)
def test_the_config_and_the_wire_refuse_a_broken_rule_with_one_sentence(schedule: dict, reported: dict) -> None:
    with pytest.raises(ConfigError) as config_error:
        ScheduleConfig(**schedule)
    rules = dataclasses.replace(GOOD, **reported)
    with pytest.raises(ConfigError) as rules_error:
        rules.validate()
    with pytest.raises(wire.WireError) as wire_error:
        _parse(rules)
    assert str(rules_error.value) == str(config_error.value)
    assert str(config_error.value) in str(wire_error.value)


@pytest.mark.parametrize("change,message", [
    (dict(apply="auto"), "apply must be one of overwrite, mix, keep_local"),
    (dict(apply="x" * 50), "apply must be one of"),
    (dict(downlink="int4:block_size=0"), "downlink: "),
    (dict(uplink="nosuchcodec"), "uplink: "),
])
def test_rules_a_config_cannot_hold_are_refused_on_the_wire(change: dict, message: str) -> None:
    rules = dataclasses.replace(GOOD, **change)
    with pytest.raises(ConfigError, match=message):
        rules.validate()
    with pytest.raises(wire.WireError, match=message):
        _parse(rules)


def test_every_valid_config_gives_rules_that_hold_and_survive_the_wire() -> None:
    for sch in (ScheduleConfig(num_fragments=4), ScheduleConfig(sync_every=1, num_fragments=1, overlap=0),
                ScheduleConfig(sync_every=16, num_fragments=4, overlap=2, desloc=True, desloc_ku=16)):
        for det in (False, True):
            rules = RunRules.from_config(RackmendConfig(schedule=sch, deterministic=det,
                                                        compression=CompressionConfig(uplink="int4")))
            rules.validate()
            assert _parse(rules).settings == rules
