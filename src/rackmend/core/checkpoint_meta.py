"""The JSON part of a syncer checkpoint, typed and versioned.

``CheckpointMeta.from_json`` is the one place that reads a checkpoint's metadata: it
checks it (``check_meta``: types, counts, numbers the wire can carry) and upgrades every
older format to the current one, so nothing downstream asks ``.get`` of a missing key.
Each part has one owner: a fragment's entry is ``SyncerFragment.state_dict``'s (version,
outer optimizer, norm guard), the moments' and fail-slow detector's are theirs, the
core's own counters are ``SyncerCore``'s, and the service adds where the checkpoint sits
in the model (layout, shard) and its counts. The tensors beside it (``theta/``,
``optim/``, ``history/``, ``downlink/``, ``moments/``) are their owners' too.

On disk the per-fragment entries stay transposed into lists (``versions``, ``optim``,
``norms``...), as every format has written them, so older readers and tools keep
working. Sans-I/O: reading and writing files is ``rackmend.service.checkpoint``'s.

Formats: 1 is every checkpoint written before the format was numbered (2026-12-07 and
before; keys were added over time and are filled in here when missing); 2 adds
``format`` and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["CHECKPOINT_FORMAT", "CheckpointMeta", "check_meta"]

CHECKPOINT_FORMAT = 2
"""The format ``to_json`` writes; ``from_json`` reads it and every older one."""

_WIRE_INT = 2**63 - 1
"""The largest integer the wire carries (msgpack int64): a larger version or count in a
checkpoint would start the syncer, then fail every join inside the encoder."""
_REQUIRED = {"versions": list, "optim": list, "ema": dict, "rejected": int, "learners": list}
"""Entries every format has, and their JSON types."""
_PER_FRAGMENT = ("norms", "norm_steps", "norm_scale", "norm_learners", "scale_history")
"""The norm guard's entries of a fragment: absent from checkpoints written before the
guards (``SyncerFragment.load_state_dict`` then starts them anew)."""


@dataclass(kw_only=True)
class CheckpointMeta:
    """What a syncer checkpoint holds besides tensors."""

    fragments: list[dict[str, Any]]
    """Per fragment of the checkpoint's shard (from 0): ``SyncerFragment.state_dict``'s
    entry (``version``, ``optim``, and the guard's keys where they were saved)."""
    ema: dict[str, float | None]
    """The core's moving averages: ``step``, ``quorum``, ``sync``."""
    rejected: int
    """Contributions the core refused so far."""
    learners: list[str]
    """Every learner the core has seen."""
    step_times: dict[str, float] = field(default_factory=dict)
    """Per learner, its step-time estimate."""
    sequences: list[list[Any]] = field(default_factory=list)
    """Replay guard: ``[learner, fragment, session, seq, retired]``; ``retired`` lists
    ``[session, seq]`` (format 1 listed bare sessions, upgraded to seq ``MAX_SEQ`` by the
    core)."""
    session_floors: list[list[Any]] = field(default_factory=list)
    """``[learner, fragment, floor]``."""
    last_counts: dict[str, list[float]] = field(default_factory=dict)
    """Per learner ``[c_tokens, c_steps]`` of its last contribution."""
    last_merged: list[list[Any]] = field(default_factory=list)
    """``[learner, fragment, version]`` last merged."""
    epoch: int | None = None
    """The syncer run that wrote it (None: written before epochs)."""
    lineage: list[list[Any]] = field(default_factory=list)
    """``[epoch, versions kept]`` of the runs before it."""
    failslow: dict[str, Any] | None = None
    """``FailSlowMonitor.state_dict`` (None: none ran)."""
    moments: dict[str, Any] | None = None
    """``MomentRounds.state_dict``'s JSON part (None: DES-LOC off)."""
    layout: list[Any] | None = None
    """The model's whole layout, as the wire writes it (service; None from the core alone)."""
    shard: str = "0/1"
    """Which syncer shard wrote it (format 1 before shards: the whole model)."""
    merges: int = 0
    """Merges the service made."""
    rejected_messages: int = 0
    """Messages the service refused."""
    first_learner: dict[str, Any] | None = None
    """``{"learner", "settings"}``: the learner whose ``RunRules`` hold for the run (None:
    written before hellos carried them)."""
    format: int = CHECKPOINT_FORMAT
    """The format it was read from (``to_json`` writes the current one)."""

    @property
    def versions(self) -> list[int]:
        """Each fragment's version."""
        return [int(f["version"]) for f in self.fragments]

    def to_json(self) -> dict[str, Any]:
        """The JSON object written into the checkpoint (fragments transposed into lists)."""
        out: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "versions": self.versions,
            "optim": [f["optim"] for f in self.fragments],
            "ema": self.ema, "step_times": self.step_times, "rejected": self.rejected, "learners": self.learners,
            "sequences": self.sequences, "session_floors": self.session_floors, "last_counts": self.last_counts,
            "last_merged": self.last_merged, "epoch": self.epoch, "lineage": self.lineage,
            "shard": self.shard, "merges": self.merges, "rejected_messages": self.rejected_messages,
        }
        for key in _PER_FRAGMENT:
            out[key] = [f[key] for f in self.fragments]
        for key in ("failslow", "moments", "layout", "first_learner"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, raw: Any) -> "CheckpointMeta":
        """Check ``raw`` (``check_meta``) and upgrade it to the current format; ValueError
        naming the field when it cannot be used."""
        problem = check_meta(raw)
        if problem:
            raise ValueError(problem)
        fmt = raw.get("format", 1)
        if fmt not in (1, CHECKPOINT_FORMAT):
            raise ValueError(f"'format' is {fmt!r}: this rackmend reads checkpoint formats 1 to {CHECKPOINT_FORMAT}; "
                             "upgrade rackmend to resume or export it")
        n = len(raw["versions"])
        if len(raw["optim"]) != n:
            raise ValueError(f"'optim' lists {len(raw['optim'])} fragments, 'versions' {n}")
        fragments: list[dict[str, Any]] = [{"version": raw["versions"][p], "optim": raw["optim"][p]}
                                           for p in range(n)]
        for key in _PER_FRAGMENT:
            values = raw.get(key)
            if values is None:
                continue  # format 1 before the guards: none saved
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"'{key}' must list one entry per fragment ({n})")
            for entry, value in zip(fragments, values):
                entry[key] = value
        for entry in fragments:
            # Format 1 before the guards: no norms; before the growth cap: no scale (the
            # window's median was the guard's) and no history (the cap starts anew);
            # before senders were kept: every learner's bound comes from the whole window.
            for key, empty in (("norms", []), ("norm_steps", []), ("norm_scale", None), ("scale_history", [])):
                entry.setdefault(key, empty)
            if "norm_learners" not in entry or len(entry["norm_learners"]) != len(entry["norms"]):
                entry["norm_learners"] = [""] * len(entry["norms"])
        epoch = raw.get("epoch")
        return cls(fragments=fragments, ema=raw["ema"], rejected=raw["rejected"], learners=raw["learners"],
                   step_times=raw.get("step_times", {}), sequences=raw.get("sequences", []),
                   session_floors=raw.get("session_floors", []), last_counts=raw.get("last_counts", {}),
                   last_merged=raw.get("last_merged", []), epoch=None if epoch is None else int(epoch),
                   lineage=raw.get("lineage", []), failslow=raw.get("failslow"), moments=raw.get("moments"),
                   layout=raw.get("layout"), shard=raw.get("shard", "0/1"), merges=raw.get("merges", 0),
                   rejected_messages=raw.get("rejected_messages", 0), first_learner=raw.get("first_learner"),
                   format=fmt)


def check_meta(meta: Any) -> str | None:
    """What is wrong with a checkpoint's metadata, naming the field, or None: an entry
    missing or of the wrong type, a number beyond the wire's integers or not finite, a
    negative version, epoch or count, a guard scale that is not positive."""
    if not isinstance(meta, dict):
        return f"the metadata is a JSON {type(meta).__name__}, not an object"
    for key, kind in _REQUIRED.items():
        if not isinstance(meta.get(key), kind):
            return f"'{key}' is {'missing' if key not in meta else type(meta[key]).__name__}, not a {kind.__name__}"
    bad = _bad_number(meta, "")
    if bad:
        return bad
    for key in ("versions", "rejected", "epoch", "merges", "rejected_messages"):
        values = meta.get(key, 0)
        for i, v in enumerate(values if isinstance(values, list) else [values]):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                return f"'{key}'{f'[{i}]' if isinstance(values, list) else ''} is {v!r}, not a count >= 0"
    for i, scale in enumerate(meta.get("norm_scale", [])):
        if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
            return f"'norm_scale'[{i}] is {scale!r}: the norm guard's scale must be a positive number"
    for i, norms in enumerate(meta.get("norms", [])):
        if not isinstance(norms, list) or any(not isinstance(n, (int, float)) or n < 0 for n in norms):
            return f"'norms'[{i}] must be a list of norms >= 0, got {str(norms)[:80]}"
    for key, kind in (("shard", str), ("layout", list), ("first_learner", dict), ("failslow", dict),
                      ("moments", dict)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            return f"'{key}' is a {type(meta[key]).__name__}, not a {kind.__name__}"
    return None


def _bad_number(value: Any, where: str) -> str | None:
    """The first number in ``value`` (JSON, walked) beyond the wire's integers or not finite."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        if -_WIRE_INT - 1 <= value <= _WIRE_INT:
            return None
        return f"'{where}' is {value}, beyond the wire's 64-bit integers"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"'{where}' is {value}, not a finite number"
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return f"'{where}' holds a {type(value).__name__}"
    for k, v in items:
        bad = _bad_number(v, f"{where}.{k}" if where else str(k))
        if bad:
            return bad
    return None
