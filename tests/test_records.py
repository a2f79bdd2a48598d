"""The syncer's typed records read back from their JSONL lines: every kind of the core's
(``from_record``) and of the service's own events (``read_event``), built field by field
from its type hints, and every record of a simulated run with a kill and a slowdown and
of a real service's log (``read_log``), come back equal after ``to_record()`` and JSON."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from collections import abc
from dataclasses import fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from rackmend.config import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.failslow import FailSlowReport
from rackmend.core.records import FAILSLOW_EVENTS, FailSlowNoted, Guarded, Joined, Merged, SyncerRecord, from_record
from rackmend.service.events import (
    BadMessage,
    CheckpointWritten,
    Initialised,
    InitRequested,
    Listening,
    ServiceEvent,
    Stopped,
    read_event,
    read_line,
    read_log,
)
from rackmend.sim import Kill, RackSpec, SimConfig, Simulation, Slowdown

from helpers import serving
from procs import read_records
from test_trust import CONFIG as RAW_CONFIG
from test_trust import Raw


def _all_kinds(base: type[SyncerRecord], leave_out: type = ServiceEvent) -> list[type[SyncerRecord]]:
    """Every subclass of ``base`` that names its own event, but those of ``leave_out``."""
    kinds, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if isinstance(cls.__dict__.get("event"), str) and not issubclass(cls, leave_out):
            kinds.append(cls)
    return sorted(kinds, key=lambda k: k.event)


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
    if hint is Any:
        return [i, f"s{i}"]  # a JSON value of any kind
    return {str: f"s{i}", int: 10 + i, float: 0.5 + i, bool: i % 2 == 0}[hint]


def _roundtrip(record: SyncerRecord) -> SyncerRecord | None:
    return from_record(json.loads(json.dumps(record.to_record())))


def _example(kind: type[SyncerRecord]) -> SyncerRecord:
    hints = get_type_hints(kind)
    values = {f.name: _sample(hints[f.name], i) for i, f in enumerate(fields(kind))}
    if kind is Guarded:
        values["kind"] = None  # the parameters' form; the moments' form is below
    return kind(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", _all_kinds(SyncerRecord), ids=lambda k: k.event)
def test_every_kind_comes_back_from_its_log_line(kind: type[SyncerRecord]) -> None:
    record = _example(kind)
    back = _roundtrip(record)
    assert back == record and type(back) is kind


@pytest.mark.parametrize("kind", _all_kinds(ServiceEvent, leave_out=type(None)), ids=lambda k: k.event)
def test_every_service_event_comes_back_from_its_log_line(kind: type[SyncerRecord]) -> None:
    record = _example(kind)
    line = json.loads(json.dumps(record.to_record()))
    assert from_record(line) is None, "a service event the core's reader claims"
    back = read_event(line)
    assert back == record and type(back) is kind


def test_the_service_events_have_names_of_their_own() -> None:
    core = {k.event for k in _all_kinds(SyncerRecord)} | set(FAILSLOW_EVENTS.values())
    service = [k.event for k in _all_kinds(ServiceEvent, leave_out=type(None))]
    assert len(service) == len(set(service)) >= 20 and not core & set(service)


def test_a_merge_line_without_cgad_scales_reads_back() -> None:
    """``stale_scales`` (CGAD on) is left out of the line when None, so merge lines stay
    as they were with CGAD off and lines written before it read back."""
    record = dataclasses.replace(_example(Merged), stale_scales=None)
    line = json.loads(json.dumps(record.to_record()))
    assert "stale_scales" not in line and list(line)[:7] == ["event", "t", "fragment", "round", "version", "merged",
                                                              "absent"]
    assert from_record(line) == record
    scaled = dataclasses.replace(record, stale_scales={"b": 0.25})
    assert _roundtrip(scaled) == scaled and list(scaled.to_record()).index("stale_scales") == 8


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
    assert from_record({"event": "join", "t": 1.0, "learner": "a", "expected": True, "peer": "ab"}) == \
        Joined(t=1.0, learner="a", expected=True)
    # The rank the service adds to a join is a field, left out of the core's own lines.
    assert from_record({"event": "join", "t": 1.0, "learner": "a", "expected": True, "rank": 1, "world": 2}) == \
        Joined(t=1.0, learner="a", expected=True, rank=1, world=2)
    assert "rank" not in Joined(t=1.0, learner="a", expected=True).to_record()
    with pytest.raises(ValueError, match="'merge'"):
        from_record({"event": "merge", "t": 1.0, "fragment": 0})
    with pytest.raises(ValueError, match="'combined'"):  # a pair with three values
        from_record({"event": "combined", "t": 1.0, "learner": "a", "fragment": 0, "steps": [1, 2, 3],
                     "base_versions": [0, 0], "c_steps": [1, 1], "c_tokens": [1.0, 1.0]})


SERVICE_LINES = {
    "listening": "endpoint resumed epoch metrics",
    "checkpoint": "path versions shard",
    "checkpoint_tmp_removed": "paths",
    "resumed": "versions shard",
    "stopped": "merges rejected_messages replies_dropped log_suppressed queued_replies_max",
    "message_limit": "bytes max_message_mb zmq_cap",
    "init_request": "learner fragments replaces",
    "init_timeout": "learner seconds received next",
    "initialised": "learner",
    "fetch": "learner rank fragment version",
    "bad_message": "peer reason",
    "internal_error": "peer learner type reason",
    "unknown_peer": "peer learner type",
    "identity_refused": "peer learner rank type reason",
    "auth_denied": "peer learner type key reason",
    "settings_refused": "peer learner rank setting learner_value syncer_value reason",
    "uplink_codec_differs": "learner learner_codec syncer_codec",
    "gate": "learner rank ranks world waiting_for reason",
    "takeover": "learner rank peer previous silent_s token",
    "silent": "learner rank seconds",
    "send_dropped": "peer reason",
    "suppressed": "of count window_s peer learner",
}
"""Each service event's keys after ``event`` and ``t``, in order, every optional one set:
the lines the service wrote as dicts before its events were typed (``settings_refused``
gained ``peer``, docs/operations.md)."""


@pytest.mark.parametrize("kind", _all_kinds(ServiceEvent, leave_out=type(None)), ids=lambda k: k.event)
def test_every_service_event_keeps_its_line_format(kind: type[SyncerRecord]) -> None:
    assert list(_example(kind).to_record()) == ["event", "t", *SERVICE_LINES[kind.event].split()]


def test_a_line_of_no_known_event_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'fault_slow'"):
        read_event({"event": "fault_slow", "t": 1.0})
    with pytest.raises(ValueError, match="'checkpoint'"):
        read_event({"event": "checkpoint", "t": 1.0})  # its path is missing
    with pytest.raises(ValueError, match=r"\['merge'\]"):
        read_event({"event": ["merge"], "t": 1.0})
    with pytest.raises(ValueError, match="list"):
        read_event(["merge"])  # type: ignore[arg-type]


def _wrong(value: Any) -> Any:
    """A JSON value of another type than ``value`` (as its log line holds it)."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 7
    if isinstance(value, list):
        return {"0": value}
    if isinstance(value, dict):
        return [value]
    return 1.5


@pytest.mark.parametrize("kind", _all_kinds(SyncerRecord, leave_out=type(None)), ids=lambda k: k.event)
def test_every_field_of_every_kind_is_type_checked_when_read(kind: type[SyncerRecord]) -> None:
    """A line with one field of the wrong type (or one element of an array or object) is
    not a record: ValueError naming the event and that field."""
    line = json.loads(json.dumps(_example(kind).to_record()))
    hints = get_type_hints(kind)
    checked = 0
    for name in line:
        if name == "event" or hints.get(name) is Any:
            continue
        for bad, where in _spoiled(line[name], name):
            with pytest.raises(ValueError, match=rf"{kind.event!r}.*{where}"):
                read_event({**line, name: bad})
            checked += 1
    assert checked >= len(line) - 1 - sum(hints.get(n) is Any for n in line)


def _spoiled(value: Any, name: str) -> list[tuple[Any, str]]:
    """``value`` with the wrong type, and (for arrays and objects) with one wrong element,
    each with the pattern of the field's name an error must give."""
    import re
    out = [(_wrong(value), re.escape(name))]
    if isinstance(value, list) and value:
        out.append(([_wrong(value[0]), *value[1:]], re.escape(f"{name}[0]")))
    if isinstance(value, dict) and value:
        k = next(iter(value))
        out.append(({**value, k: _wrong(value[k])}, re.escape(f"{name}[{k!r}]")))
    return out


def test_a_merge_line_of_wrong_types_and_lines_nested_too_deep_are_refused_naming_the_line(tmp_path: Path) -> None:
    good = json.dumps(Joined(t=1.0, learner="a", expected=True).to_record())
    merge = {"event": "merge", "t": "soon", "fragment": "0", "round": [], "version": {}, "merged": "a",
             "absent": 3, "stale": None, "weights": [], "grace_s": "x", "codecs": 1, "bytes_in": 1.5,
             "bytes_out": True}
    with pytest.raises(ValueError, match="'merge'"):
        read_event(merge)
    report = FailSlowReport(learner="l1", rank=2, state="slow", ratio=2.5, fleet_ratio=2.25, baseline_s=0.125, steps=7)
    rung = FailSlowNoted(t=4.0, action=list(FAILSLOW_EVENTS)[1](report), reason="slow")
    line = json.loads(json.dumps(rung.to_record()))
    assert read_event(line) == rung
    for name, bad in (("ratio", "2.5"), ("rank", 2.0), ("t", None), ("reason", 3), ("learner", ["l1"])):
        with pytest.raises(ValueError, match=rf"{line['event']!r}.*{name}"):
            read_event({**line, name: bad})
    path = tmp_path / "events.jsonl"
    path.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="line 2: JSON nested too deeply"):
        read_log(path)
    path.write_text(good + "\n" + good + "\n" + json.dumps(merge) + "\n")
    with pytest.raises(ValueError, match="line 3: .*'merge'"):
        read_log(path)
    with pytest.raises(ValueError, match="line 9: .*Expecting"):
        read_line("{not json", 9)
    assert read_line(good) == Joined(t=1.0, learner="a", expected=True)


def test_read_log_leaves_a_line_being_written_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_log(path) == []
    first = Joined(t=1.0, learner="a", expected=True, rank=0, world=2)
    path.write_text(json.dumps(first.to_record()) + "\n" + '{"event": "leave", "t": 2.0, "lear')
    assert read_log(path) == [first]


def test_a_real_service_log_reads_back_typed_and_unchanged(tmp_path: Path) -> None:
    """Every line a running service wrote (listening, a seeding learner, a bad message, a
    checkpoint, the stop) is a typed record whose ``to_record()`` is that line exactly."""
    log = tmp_path / "events.jsonl"
    svc, _, thread = serving(RAW_CONFIG, log_path=str(log), checkpoint_dir=str(tmp_path / "ck"))
    raw = Raw(svc.endpoint, "seed")
    try:
        raw.hello()
        raw.send([b"\x93 not msgpack"])
        assert raw.errors(10.0), "the bad message was not answered"
    finally:
        raw.close()
        svc.stop()
        thread.join(20)
    records = read_log(log)
    # Text, not dicts: the keys' order is part of the log's format.
    assert [json.dumps(r.to_record()) for r in records] == log.read_text().splitlines()
    kinds = [type(r) for r in records]
    assert kinds[0] is Listening and kinds[-1] is Stopped
    assert {InitRequested, Initialised, Joined, BadMessage, CheckpointWritten} <= set(kinds), kinds
    (join,) = [r for r in records if isinstance(r, Joined)]
    assert (join.learner, join.rank, join.world) == ("seed", 0, 1)


def test_the_tests_incremental_log_reader_equals_a_whole_read(tmp_path: Path) -> None:
    """``procs.read_records`` parses only what was added since its last call for a path:
    after each append (one line half-written) it equals ``read_log`` of the whole file."""
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(Joined(t=float(i), learner=f"l{i}", expected=True).to_record()) for i in range(5)]
    assert read_records(path) == []
    with open(path, "w") as f:
        f.write(lines[0] + "\n" + lines[1][:10])
        f.flush()
        assert read_records(path) == read_log(path) and len(read_log(path)) == 1
        f.write(lines[1][10:] + "\n" + "\n".join(lines[2:]) + "\n")
        f.flush()
        assert read_records(path) == read_log(path) and len(read_log(path)) == 5
    path.write_text(lines[4] + "\n")  # a new, shorter file at the same path
    assert read_records(path) == read_log(path) and len(read_log(path)) == 1
