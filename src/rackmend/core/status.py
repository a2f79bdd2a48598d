"""The syncer's status answer, typed: what ``rackmend status`` shows and ``--json`` prints.

``SyncerStatus`` holds the service's own part (``SyncerPart``), each fragment's round
(``FragmentStatus``) and each learner seen (``LearnerStatus``). The service builds one
(``ServiceCore.status``), the wire carries ``to_json()``, and a client reads the answer
back with ``from_json``, which checks every field it takes (the answer came over the
network) and fills in what an older syncer did not send. Plain data: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

__all__ = ["BasedOn", "FragmentStatus", "LearnerStatus", "StatusError", "SyncerPart", "SyncerStatus"]

_MAX_INT = 2**63 - 1
T = TypeVar("T")


class StatusError(ValueError):
    """A status answer with a field of the wrong type; the message names it."""


@dataclass(frozen=True, kw_only=True)
class BasedOn:
    """The base version of a learner's newest contribution to one fragment."""

    fragment: int
    base_version: int
    lag: int
    """How many versions behind the syncer's that base was when it arrived."""


@dataclass(frozen=True, kw_only=True)
class FragmentStatus:
    """One fragment's round, as the syncer saw it."""

    fragment: int
    """In the model's numbering (a shard names its own fragments so)."""
    version: int
    tensors: int = 0
    bytes: int = 0
    phase: str = "-"
    """The round clock's phase: open, quorum, grace..."""
    waiting: tuple[str, ...] = ()
    """Learners whose contribution waits in the round."""
    fresh: tuple[str, ...] = ()
    """Those of ``waiting`` based on the current version."""
    round_age_s: float | None = None
    grace_left_s: float | None = None
    last_merge_age_s: float | None = None
    last_merged: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class LearnerStatus:
    """One learner id, all its ranks together."""

    id: str
    state: str = "?"
    """joining, connected, left, silent, or ``never joined`` (expected, never seen)."""
    ranks: tuple[int, ...] = ()
    world: int | None = None
    expected: bool = False
    last_seen_s: float | None = None
    step: int | None = None
    step_time_s: float | None = None
    last_contribution_s: float | None = None
    contributions: int = 0
    rejected: int = 0
    version_lag: int | None = None
    based_on: tuple[BasedOn, ...] = ()
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True, kw_only=True)
class SyncerPart:
    """The service's own part: its counters, endpoint and state. An unreachable shard of a
    split syncer has only ``shard``, ``endpoint``, ``state`` (``unreachable``), ``error``."""

    endpoint: str = ""
    state: str = "?"
    """waiting for a learner, initialising, running; for several shards combined also
    degraded (a shard did not answer) or mixed; unreachable for such a shard."""
    shard: str | None = None
    """``s/S`` for a shard; combined: how many shards answered."""
    uptime_s: float | None = None
    protocol: int | None = None
    merges: int = 0
    rejected_messages: int = 0
    rejected_contributions: int = 0
    superseded_updates: int = 0
    deterministic: bool = False
    min_quorum: int | None = None
    grace_s: float | None = None
    curve: bool = False
    checkpoint_age_s: float | None = None
    metrics: str | None = None
    status_requests: int = 0
    error: str | None = None
    """Why an unreachable shard did not answer."""
    shards: tuple["SyncerPart", ...] = ()
    """Combined: each shard's own part, in shard order."""


@dataclass(frozen=True, kw_only=True)
class SyncerStatus:
    """A syncer's whole status answer."""

    syncer: SyncerPart
    fragments: tuple[FragmentStatus, ...] = ()
    learners: tuple[LearnerStatus, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain values (what the wire carries and ``--json`` prints); ``None``s of the
        syncer part left out where a reader could not tell them from missing (an
        unreachable shard's counters, a single syncer's ``shards`` and ``error``)."""
        out = asdict(self)
        for part in [out["syncer"], *out["syncer"]["shards"]]:
            if not part["shards"]:
                del part["shards"]
            for key in ("error", "shard"):
                if part[key] is None:
                    del part[key]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> "SyncerStatus":
        """The status in ``raw`` (a ``to_json`` result that crossed the wire); StatusError
        naming a field of the wrong type. Fields an older syncer did not send take their
        defaults."""
        doc = _dict(raw, "status")
        return cls(syncer=_part(_dict(doc.get("syncer"), "syncer"), "syncer"),
                   fragments=tuple(_build(FragmentStatus, _dict(f, "fragments[]"), "fragments[]")
                                   for f in _list(doc.get("fragments", []), "fragments")),
                   learners=tuple(_learner(_dict(ln, "learners[]")) for ln in _list(doc.get("learners", []),
                                                                                    "learners")))


def _dict(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise StatusError(f"status: {where} must be a map, got {type(v).__name__}")
    return v


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise StatusError(f"status: {where} must be a list, got {type(v).__name__}")
    return v


def _value(v: Any, kind: str, where: str) -> Any:
    """``v`` checked against a field's annotation (``int``, ``str | None``, ...)."""
    if v is None and "None" in kind:
        return None
    if kind.startswith("tuple["):
        inner = kind[len("tuple["):-1].split(",")[0].strip()
        return tuple(_value(x, inner, f"{where}[]") for x in _list(v, where))
    base = kind.split("|")[0].strip()
    ok = {"int": isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _MAX_INT,
          "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "str": isinstance(v, str), "bool": isinstance(v, bool)}.get(base)
    if not ok:
        raise StatusError(f"status: {where} must be {kind}, got {str(v)[:40]!r}")
    return float(v) if base == "float" else v


def _build(cls: type[T], raw: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> T:
    """``cls`` from the keys of ``raw`` it has (others ignored: a newer syncer's), each
    checked against its annotation; a key it lacks takes the default."""
    values = {f.name: _value(raw[f.name], str(f.type), f"{where}.{f.name}")
              for f in fields(cls) if f.name in raw and f.name not in skip}  # type: ignore[arg-type]
    try:
        return cls(**values)
    except TypeError as exc:  # a required field missing
        raise StatusError(f"status: {where}: {exc}") from None


def _part(raw: dict[str, Any], where: str) -> SyncerPart:
    shards = tuple(_part(_dict(s, f"{where}.shards[]"), f"{where}.shards[]")
                   for s in _list(raw.get("shards", []), f"{where}.shards"))
    return replace(_build(SyncerPart, raw, where, skip=("shards",)), shards=shards)


def _learner(raw: dict[str, Any]) -> LearnerStatus:
    based = tuple(_build(BasedOn, _dict(b, "learners[].based_on[]"), "learners[].based_on[]")
                  for b in _list(raw.get("based_on", []), "learners[].based_on"))
    return replace(_build(LearnerStatus, raw, "learners[]", skip=("based_on",)), based_on=based)
