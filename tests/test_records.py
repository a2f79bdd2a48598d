"""The syncer core's typed records read back from their JSONL lines (``from_record``):
every kind, built field by field from its type hints, and every record of a simulated
run with a kill and a slowdown, come back equal after ``to_record()`` and JSON."""

from __future__ import annotations

import json
import types
from collections import abc
from dataclasses import fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from rackmend.config import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.failslow import FailSlowReport
from rackmend.core.records import FAILSLOW_EVENTS, FailSlowNoted, Guarded, Joined, Merged, SyncerRecord, from_record
from rackmend.sim import Kill, RackSpec, SimConfig, Simulation, Slowdown


def _all_kinds() -> list[type[SyncerRecord]]:
    kinds, todo = [], list(SyncerRecord.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls is not FailSlowNoted:
            kinds.append(cls)
    return kinds


def _sample(hint: Any, i: int) -> Any:
    """A value of type ``hint`` that JSON does not leave as it is where it can (tuples)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), i)
    if origin is Literal:
        return args[-1]
    if origin is tuple:
        return tuple(_sample(args[0], i + k) for k in range(3)) if args[-1] is Ellipsis else \
            tuple(_sample(a, i + k) for k, a in enumerate(args))
    if origin is abc.Mapping:
        return {f"k{i}": _sample(args[1], i + 1), f"k{i + 1}": _sample(args[1], i + 2)}
    return {str: f"s{i}", int: 10 + i, float: 0.5 + i, bool: i % 2 == 0}[hint]


def _roundtrip(record: SyncerRecord) -> SyncerRecord | None:
    return from_record(json.loads(json.dumps(record.to_record())))


@pytest.mark.parametrize("kind", _all_kinds(), ids=lambda k: k.event)
def test_every_kind_comes_back_from_its_log_line(kind: type[SyncerRecord]) -> None:
    hints = get_type_hints(kind)
    values = {f.name: _sample(hints[f.name], i) for i, f in enumerate(fields(kind))}
    if kind is Guarded:
        values["kind"] = None  # the parameters' form; the moments' form is below
    record = kind(**values)  # type: ignore[arg-type]
    back = _roundtrip(record)
    assert back == record and type(back) is kind


def test_a_guarded_moments_round_comes_back() -> None:
    record = Guarded(t=2.0, learner="a", fragment=1, kind="exp_avg_sq", version=4, norm=9.5, bound=3.25,
                     reason="clipped")
    assert _roundtrip(record) == record


@pytest.mark.parametrize("rung", list(FAILSLOW_EVENTS), ids=lambda r: FAILSLOW_EVENTS[r])
def test_every_fail_slow_rung_comes_back(rung: type) -> None:
    report = FailSlowReport(learner="l1", rank=2, state="slow", ratio=2.5, fleet_ratio=2.25, baseline_s=0.125,
                            steps=7, cost_s=3.5)
    record = FailSlowNoted(t=4.0, action=rung(report), reason="l1 is slow")
    assert _roundtrip(record) == record


def test_a_simulated_run_reads_back_whole() -> None:
    run = RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=2, overlap=1),
                         syncer=SyncerConfig(grace_max=2.0))
    sim = Simulation(SimConfig(run=run, racks=tuple(RackSpec(jitter=0.3, uplink_latency=0.2) for _ in range(3)),
                               duration=120.0, seed=3, kills=(Kill(learner=1, at=40.0, rejoin_at=70.0),),
                               slowdowns=(Slowdown(learner=2, factor=3.0, start=10.0, end=90.0),)))
    sim.run()
    records = sim.syncer_records
    assert {type(r) for r in records} >= {Joined, Merged}, "the run made too few kinds of record to check"
    assert [_roundtrip(r) for r in records] == records


def test_lines_the_core_does_not_write_are_not_records() -> None:
    assert from_record({"event": "checkpoint", "t": 1.0, "versions": [1, 2]}) is None
    assert from_record({"t": 1.0}) is None
    # A driver's extra keys are left out; a line missing a field is refused by name.
    assert from_record({"event": "join", "t": 1.0, "learner": "a", "expected": True, "rank": 0}) == \
        Joined(t=1.0, learner="a", expected=True)
    with pytest.raises(ValueError, match="'merge'"):
        from_record({"event": "merge", "t": 1.0, "fragment": 0})
