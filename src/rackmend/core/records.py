"""What the syncer core reports, as typed records (its log-bearing actions).

Every record the syncer core (``rackmend.core.syncer``) or the piece assembler
(``rackmend.core.assembly``) returns is one of the frozen dataclasses below. A driver
dispatches on the type (``isinstance(a, Merged)``, ``Rejected``) and reads fields as
attributes; it never branches on an event-name string. ``to_record()`` gives the
record's line of the JSONL log (``docs/protocol.md``, "The syncer's log"): the event
name first, then ``t``, then the fields in declaration order, so the log reads as it did
when the core returned plain dicts. ``level`` says how loud a driver should be:
``WARNING`` for what probably means a run is wrong, ``INFO`` for membership and
refusals, ``DEBUG`` for the routine rest (the JSONL log has them all).

Records hold plain values (tuples and dicts of str, int, float); they are not to be
modified. A sharded syncer renumbers ``fragment`` with ``Shard.renumber``
(``dataclasses.replace``), so a record's fragment is the core's or the model's number
depending on who holds it; the driver that renumbers says which.
"""

from __future__ import annotations

import functools
import logging
import types
from collections import abc
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from rackmend.core.failslow import (
    AdviseLearner,
    FailSlowAction,
    FailSlowBlip,
    FailSlowReport,
    MarkForEviction,
    RestoreLearner,
    StopExpecting,
)

__all__ = [
    "SyncerRecord",
    "Joined",
    "Left",
    "ExpectationSet",
    "Rejected",
    "Superseded",
    "Combined",
    "Guarded",
    "Merged",
    "Dropped",
    "MergeHarmful",
    "TokenUnits",
    "FinalMerged",
    "MomentsMerged",
    "FailSlowNoted",
    "Incomplete",
    "PieceDropped",
    "RejectCode",
    "REJECT_CODES",
    "FAILSLOW_EVENTS",
    "WARNING_EVENTS",
    "from_record",
    "record_of",
    "event_classes",
    "OMIT_NONE",
]

RejectCode = Literal["unknown_fragment", "not_joined", "layout", "counters", "bounds", "epoch", "ahead", "stale",
                     "non_finite", "replay", "norm_overflow", "moments_off", "negative"]
"""Why a contribution was refused, as a fixed word (``Rejected.code``, the ``code`` of a
``reject`` record, beside its ``reason`` sentence): what metrics count by, since a
sentence names values. unknown_fragment, not_joined; layout (tensors unlike the
fragment's); counters (negative or NaN) and bounds (beyond ``MAX_*``); epoch (based on a
value of another syncer run); ahead (a base version the syncer never made); stale (more
than ``max_staleness`` versions behind); non_finite; replay (or an older send than one
accepted); norm_overflow; moments_off (DES-LOC moments in a run without DES-LOC);
negative (a negative second moment)."""

REJECT_CODES: tuple[str, ...] = get_args(RejectCode)
"""Every ``RejectCode``, in order."""

FAILSLOW_EVENTS: dict[type, str] = {
    FailSlowBlip: "failslow_blip",
    StopExpecting: "failslow_slow",
    AdviseLearner: "failslow_advise",
    MarkForEviction: "failslow_evict",
    RestoreLearner: "failslow_restore",
}
"""The log event of each rung of the fail-slow ladder (also the metrics' label)."""

OMIT_NONE = {"omit_none": True}
"""Field metadata: left out of ``to_record()`` when None (a key the log has only sometimes)."""


def _plain(value: Any) -> Any:
    """``value`` as the log holds it: tuples as lists (JSON arrays, and what a reader of
    ``to_record()`` compares with), dicts copied."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class SyncerRecord:
    """Base of every record: when it happened, its log event name and level."""

    event: ClassVar[str]
    """The ``event`` of its JSONL line."""
    level: ClassVar[int] = logging.DEBUG
    """How loud a driver logs it (``logging`` levels); the JSONL log holds every record."""
    log_prefix: ClassVar[str] = ""
    """What a driver's Python log puts before the reason of a record at WARNING or above."""

    t: float
    """The core's ``now`` when it happened (seconds, the driver's clock)."""

    def to_record(self) -> dict[str, Any]:
        """The record's JSONL line as a dict: ``event``, ``t``, then the fields in order."""
        out: dict[str, Any] = {"event": self.event}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[f.name] = _plain(value)
        return out


# ------------------------------------------------------------------ membership
@dataclass(frozen=True, kw_only=True)
class Joined(SyncerRecord):
    """A learner joined (first time or again) and is sent every fragment's value."""

    event: ClassVar[str] = "join"
    level: ClassVar[int] = logging.INFO
    learner: str
    """The learner id."""
    expected: bool
    """Whether rounds wait for it (False: flagged fail-slow before a syncer restart)."""
    rank: int | None = field(default=None, metadata=OMIT_NONE)
    """The rank whose hello this join answered; the core knows learners, not ranks, so
    the service sets it (each rank of a multi-rank learner joins). None from the core."""
    world: int | None = field(default=None, metadata=OMIT_NONE)
    """That learner's rank count, set with ``rank``."""


@dataclass(frozen=True, kw_only=True)
class Left(SyncerRecord):
    """A learner left or was declared gone; rounds stop waiting for it."""

    event: ClassVar[str] = "leave"
    level: ClassVar[int] = logging.INFO
    learner: str
    """The learner id."""
    reason: str
    """``leave`` (graceful) or the driver's word for it (``silent``, ``refused``, ...)."""


@dataclass(frozen=True, kw_only=True)
class ExpectationSet(SyncerRecord):
    """Rounds start or stop waiting for a connected learner (``ExpectationChanged``)."""

    event: ClassVar[str] = "expected"
    learner: str
    """The learner id."""
    expected: bool
    """Whether rounds wait for it from now on."""
    reason: str
    """The driver's reason for the change."""


# ------------------------------------------------------------------ contributions
@dataclass(frozen=True, kw_only=True)
class Rejected(SyncerRecord):
    """A contribution (parameters, or DES-LOC moments when ``kind`` is set) was refused;
    its work is not merged. The core counts it in ``SyncerCore.rejected``."""

    event: ClassVar[str] = "reject"
    level: ClassVar[int] = logging.INFO
    learner: str
    """The sender's learner id."""
    fragment: int
    """The fragment it was for (as sent: may be out of range, see ``code``)."""
    kind: str | None = field(default=None, metadata=OMIT_NONE)
    """The moment kind for a moment contribution; None for parameters."""
    code: RejectCode
    """Why, as a fixed word (what metrics count by)."""
    reason: str
    """Why, as a sentence naming the values."""


@dataclass(frozen=True, kw_only=True)
class Superseded(SyncerRecord):
    """One send of a learner replaced another of the same round, whose work it holds
    (parameters), or a newer estimate replaced an older one (moments, ``kind`` set)."""

    event: ClassVar[str] = "superseded"
    learner: str
    """The sender's learner id."""
    fragment: int
    """The fragment of the round."""
    kind: str | None = field(default=None, metadata=OMIT_NONE)
    """The moment kind for moments; None for parameters."""
    step: int
    """The learner step of the send that was dropped."""
    by_step: int
    """The learner step of the send kept in its place."""
    base_version: int | None = field(default=None, metadata=OMIT_NONE)
    """The dropped send's base version (parameters only)."""
    by_base_version: int | None = field(default=None, metadata=OMIT_NONE)
    """The kept send's base version (parameters only)."""


@dataclass(frozen=True, kw_only=True)
class Combined(SyncerRecord):
    """Two sends of one learner hold disjoint work (it applied a merged value between
    them): both merge, summed."""

    event: ClassVar[str] = "combined"
    learner: str
    """The sender's learner id."""
    fragment: int
    """The fragment of the round."""
    steps: tuple[int, int]
    """Learner steps of the older and the newer send."""
    base_versions: tuple[int, int]
    """Their base versions."""
    c_steps: tuple[int, int]
    """Their inner-step counts."""
    c_tokens: tuple[float, float]
    """Their token counts."""


@dataclass(frozen=True, kw_only=True)
class Guarded(SyncerRecord):
    """The norm guard clipped a contribution (parameters), or a learner's moments of one
    round (``kind`` set), to its bound; if it names honest learners, raise
    ``SyncerConfig.norm_guard``."""

    event: ClassVar[str] = "guard"
    level: ClassVar[int] = logging.WARNING
    learner: str
    """The sender's learner id."""
    fragment: int
    """The fragment."""
    kind: str | None = field(default=None, metadata=OMIT_NONE)
    """The moment kind for moments; None for parameters."""
    version: int | None = field(default=None, metadata=OMIT_NONE)
    """Moments: the version the clipped round became."""
    step: int | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: the learner step of the send."""
    norm: float
    """The contribution's L2 norm."""
    median: float | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: the guard's scale (the lower median of recent merged norms, capped)."""
    c_steps: int | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: the inner steps the send holds."""
    usual_steps: int | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: the usual inner steps of a merged send of the fragment."""
    behind: int | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: versions its base is behind the current one."""
    bound: float
    """The norm it was clipped to."""
    action: Literal["clipped"] = "clipped"
    """What the guard did."""
    reason: str
    """The sentence a person reads."""

    def to_record(self) -> dict[str, Any]:
        out = super().to_record()
        if self.kind is not None:
            # A moments record names its round before the numbers, as it always has.
            order = ("event", "t", "learner", "fragment", "kind", "version", "action", "norm", "bound", "reason")
            out = {k: out[k] for k in order}
        return out


# ------------------------------------------------------------------ rounds
@dataclass(frozen=True, kw_only=True)
class Merged(SyncerRecord):
    """A fragment's round merged: the outer step ran and the new version was sent (the
    ``SendUpdate`` just before this record). One per merge; ``docs/protocol.md`` says
    what each field means."""

    event: ClassVar[str] = "merge"
    fragment: int
    """The fragment."""
    round: int
    """The version the round was based on (the new version minus one)."""
    version: int
    """The new version."""
    merged: tuple[str, ...]
    """Learners whose work went in, sorted."""
    absent: tuple[str, ...]
    """Expected learners with no work in it, sorted."""
    stale: tuple[str, ...]
    """Merged learners whose work was based on an older version than ``round``."""
    stale_scales: Mapping[str, float] | None = field(default=None, metadata=OMIT_NONE)
    """Per ``stale`` learner, the factor CGAD multiplied its outer gradient by
    (``SyncerConfig.staleness_decay``, ``staleness_cutoff``; 0: counted as a zero);
    None, and absent from the log line, with CGAD off or nothing stale."""
    weights: Mapping[str, float]
    """Per merged learner, its normalised merge weight."""
    absent_share: float
    """The share of the weight counted for absent learners (``count_absent``)."""
    tokens: Mapping[str, float]
    """Per merged learner, the tokens its work reported."""
    gains: Mapping[str, float]
    """Per merged learner that reported one, its merge gain."""
    quorum_s: float | None
    """Seconds from the first fresh arrival to quorum; None when closed without one."""
    wait_s: float
    """Seconds from the first fresh arrival to the merge."""
    grace_s: float | None
    """The grace window this round was given; None when closed without one."""
    codecs: Mapping[str, str]
    """Per merged learner, the uplink codec of its send (``none``: raw)."""
    bytes_in: int
    """Bytes received for the merged work."""
    bytes_out: int
    """Bytes of the new value sent, over all learners."""
    cause: Literal["leave", "final"] | None = field(default=None, metadata=OMIT_NONE)
    """Why a round closed early: a graceful leave, or ``FinalMerge``; None otherwise."""


@dataclass(frozen=True, kw_only=True)
class Dropped(SyncerRecord):
    """Work was dropped at merge time (a combined or re-anchored sum, or the merged
    value, not finite; for moments, ``kind`` set, the round's mean): the global value
    was not changed by it. The core counts the dropped contributions as rejected."""

    event: ClassVar[str] = "merge_dropped"
    level: ClassVar[int] = logging.WARNING
    fragment: int
    """The fragment."""
    kind: str | None = field(default=None, metadata=OMIT_NONE)
    """The moment kind of a dropped moments round; None for parameters."""
    dropped: tuple[str, ...] | None = field(default=None, metadata=OMIT_NONE)
    """Parameters: the learners whose pending work was dropped; None for moments."""
    version: int
    """The fragment's (or moment kind's) version, unchanged."""
    reason: str
    """The sentence a person reads."""


@dataclass(frozen=True, kw_only=True)
class MergeHarmful(SyncerRecord):
    """Applying a fragment's merges made the learners' probe loss worse
    ``HARMFUL_STREAK`` times in a row: the outer step is probably too large."""

    event: ClassVar[str] = "merge_harmful"
    level: ClassVar[int] = logging.WARNING
    fragment: int
    """The fragment."""
    streak: int
    """Consecutive harmful merges (``HARMFUL_STREAK``)."""
    median_gain: float
    """The last merge's median reported gain (negative: worse)."""
    reason: str
    """The sentence a person reads."""


@dataclass(frozen=True, kw_only=True)
class TokenUnits(SyncerRecord):
    """A learner's tokens per step differ from the fleet's by ``TOKEN_UNITS_RATIO`` or
    more: probably other units, so its merge weight is off (warned once per learner)."""

    event: ClassVar[str] = "token_units"
    level: ClassVar[int] = logging.WARNING
    learner: str
    """The learner id."""
    tokens_per_step: float
    """Its tokens per step."""
    others_median: float
    """The other learners' median tokens per step."""
    reason: str
    """The sentence a person reads."""


@dataclass(frozen=True, kw_only=True)
class FinalMerged(SyncerRecord):
    """The driver is stopping (``FinalMerge``): the rounds listed merge now."""

    event: ClassVar[str] = "final_merge"
    fragments: tuple[int, ...]
    """Fragments with pending work, in the core's numbering."""
    learners: Mapping[str, tuple[str, ...]]
    """Per such fragment (as a string key, for JSON), the learners pending in it."""


@dataclass(frozen=True, kw_only=True)
class MomentsMerged(SyncerRecord):
    """DES-LOC: a round of one moment kind of one fragment was averaged and sent (the
    ``SendMomentUpdate`` just before this record)."""

    event: ClassVar[str] = "moments"
    fragment: int
    """The fragment."""
    kind: str
    """``exp_avg`` or ``exp_avg_sq``."""
    version: int
    """The new version of that kind."""
    merged: tuple[str, ...]
    """Learners averaged, sorted."""
    stale: tuple[str, ...]
    """Merged learners whose moments were based on an older version."""
    weights: Mapping[str, float]
    """Per learner, its normalised weight."""
    tokens: Mapping[str, float]
    """Per learner, its reported tokens."""
    steps: Mapping[str, int]
    """Per learner, the learner step of its moments."""
    wait_s: float
    """Seconds from the first fresh arrival to the average."""
    bytes_in: int
    """Bytes received for the averaged moments."""
    clipped: Mapping[str, Mapping[str, float]]
    """Per clipped learner, its ``norm`` and the ``bound`` (also in a ``Guarded`` each)."""
    bytes_out: int
    """Bytes of the average sent, over all learners."""


@dataclass(frozen=True, kw_only=True)
class FailSlowNoted(SyncerRecord):
    """One rung of the fail-slow ladder, as logged. The core returns the rung itself
    (``action``) just before this record, and has applied its effect on membership."""

    action: FailSlowAction
    """The rung (``FailSlowBlip``, ``StopExpecting``, ``AdviseLearner``,
    ``MarkForEviction`` or ``RestoreLearner``) with its report."""
    reason: str
    """The sentence a person reads."""

    @property
    def event(self) -> str:  # type: ignore[override]
        """``failslow_*`` by rung (``FAILSLOW_EVENTS``)."""
        return FAILSLOW_EVENTS[type(self.action)]

    @property
    def level(self) -> int:  # type: ignore[override]
        """WARNING for the rungs that change what the fleet does (slow, evict)."""
        return logging.WARNING if isinstance(self.action, (StopExpecting, MarkForEviction)) else logging.DEBUG

    def to_record(self) -> dict[str, Any]:
        r = self.action.report
        return {"event": self.event, "t": self.t, "learner": r.learner, "rank": r.rank, "state": r.state,
                "ratio": r.ratio, "fleet_ratio": r.fleet_ratio, "baseline_s": r.baseline_s, "steps": r.steps,
                "cost_s": r.cost_s, "reason": self.reason}


# ------------------------------------------------------------------ piece assembly
@dataclass(frozen=True, kw_only=True)
class Incomplete(SyncerRecord):
    """A sharded learner's partial contribution was dropped before all its ranks' pieces
    came (``rackmend.core.assembly``); counted as rejected."""

    event: ClassVar[str] = "incomplete"
    level: ClassVar[int] = logging.WARNING
    learner: str
    """The learner id."""
    fragment: int
    """The fragment."""
    step: int
    """The learner step of the partial contribution."""
    ranks: tuple[int, ...]
    """Ranks whose pieces had come."""
    missing: tuple[int, ...]
    """Ranks whose pieces had not."""
    reason: str
    """The sentence a person reads."""


@dataclass(frozen=True, kw_only=True)
class PieceDropped(SyncerRecord):
    """One rank's piece was dropped (sent twice, or older than the partial one held)."""

    event: ClassVar[str] = "piece_dropped"
    level: ClassVar[int] = logging.WARNING
    learner: str
    """The learner id."""
    fragment: int
    """The fragment."""
    rank: int
    """The rank that sent it."""
    step: int
    """The learner step it was of."""
    reason: str
    """The sentence a person reads."""


WARNING_EVENTS = frozenset({cls.event for cls in (TokenUnits, MergeHarmful, Guarded, Dropped)}
                           | {FAILSLOW_EVENTS[StopExpecting], FAILSLOW_EVENTS[MarkForEviction]})
"""Event names of the core's records at ``WARNING`` level (for readers of the log file;
a driver uses ``record.level``)."""


# ------------------------------------------------------------------ reading a log back
def _typed(value: Any, hint: Any, name: str) -> Any:
    """A JSON value as the field ``name`` of type ``hint`` holds it (arrays as tuples,
    also inside mappings; an int where a float is due as that float). ValueError naming
    the field when the value is of another type: a log line is outside input, and a
    record with a string where a count belongs would fail far from where it was read."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return None if value is None else _typed(value, next(a for a in args if a is not type(None)), name)
    if hint is Any:
        return value
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError(f"{name} is {value!r}, not one of {list(args)}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{name} is a JSON {type(value).__name__}, not an array")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{name} has {len(value)} values, not {len(args)}")
        return tuple(_typed(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is abc.Mapping:
        if not isinstance(value, dict):
            raise ValueError(f"{name} is a JSON {type(value).__name__}, not an object")
        return {k: _typed(v, args[1], f"{name}[{k!r}]") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is hint):
        return value
    raise ValueError(f"{name} is {_json_kind(value)}, not {_JSON_NAME.get(hint, hint)}")


_JSON_NAME = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _json_kind(value: Any) -> str:
    """How a JSON reader names what ``value`` came from."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def event_classes(base: type[SyncerRecord], module: str) -> dict[str, type[SyncerRecord]]:
    """Every subclass of ``base`` (at any depth) defined in ``module`` that names its own
    ``event``, by event name: what a reader of a log looks a line's class up in. Only
    ``module``'s, so the answer does not depend on which other modules were imported first;
    ValueError if two of them share an event name (a line could not say which it is)."""
    found: dict[str, type[SyncerRecord]] = {}
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        event = cls.__dict__.get("event")
        if isinstance(event, str) and cls.__module__ == module:
            if event in found:
                raise ValueError(f"{found[event].__name__} and {cls.__name__} both log as {event!r}")
            found[event] = cls
    return found


_hints = functools.cache(get_type_hints)  # evaluating the string annotations costs more than a line


def record_of(cls: type[SyncerRecord], line: Mapping[str, Any]) -> SyncerRecord:
    """``line`` (a JSONL log line as a dict) read as a ``cls`` record: arrays become the
    tuples its fields hold, keys it has no field for are left out. ValueError, naming the
    event and the field, when a field without a default is missing or of another type."""
    hints = _hints(cls)
    try:
        return cls(**{f.name: _typed(line[f.name], hints[f.name], f.name) for f in fields(cls) if f.name in line})
    except (TypeError, ValueError) as exc:  # a field missing, or a fixed-length array of another length
        raise _not_a_record(line.get("event"), exc) from None


def _not_a_record(event: Any, exc: Exception) -> ValueError:
    return ValueError(f"a {event!r} log line that is not a record of this version: {exc}")


_BY_EVENT = event_classes(SyncerRecord, __name__)
_RUNGS = {event: cls for cls, event in FAILSLOW_EVENTS.items()}


def from_record(line: Mapping[str, Any]) -> SyncerRecord | None:
    """The typed record a JSONL log line of the syncer core came from (``to_record()``
    read back: ``from_record(json.loads(json.dumps(r.to_record()))) == r``); None for a
    line the core does not write (the service's own events, which
    ``rackmend.service.events.read_event`` reads). Keys a driver added that the record
    has no field for are left out. ValueError, naming the event, for a core event with
    missing fields."""
    event = line.get("event")
    if not isinstance(event, str):
        return None
    rung = _RUNGS.get(event)
    if rung is not None:
        try:
            hints = _hints(FailSlowReport)
            report = FailSlowReport(**{f.name: _typed(line[f.name], hints[f.name], f.name)
                                       for f in fields(FailSlowReport) if f.name in line})
            return FailSlowNoted(t=_typed(line["t"], float, "t"), action=rung(report),  # type: ignore[arg-type]
                                 reason=_typed(line["reason"], str, "reason"))
        except (KeyError, TypeError, ValueError) as exc:
            raise _not_a_record(event, exc) from None
    cls = _BY_EVENT.get(event)
    return None if cls is None else record_of(cls, line)
