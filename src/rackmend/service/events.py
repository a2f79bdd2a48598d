"""The syncer service's own log events, typed, and reading a syncer's log back.

The core's records (``rackmend.core.records``) say what the round logic did; the events
here say what the service did around it: it listened, checkpointed, refused a message
or a connection, handed a learner rank to a new connection, stopped. Each is a frozen
dataclass like the core's records, with ``to_record()`` for its line of the JSONL log
(``docs/operations.md``, "The event log": the lines read as they did when the service
wrote dicts) and a ``level`` for the Python log. ``read_event`` turns any line of a
syncer's log back into its typed record, the core's or the service's, and ``read_log``
a whole log file, so a reader dispatches on types, never on event-name strings.

What does not live here: the writing of the log and the rate limit on bad input
(``rackmend.service.syncer``), what the metrics count (``rackmend.service.metrics``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from rackmend.core.records import OMIT_NONE, SyncerRecord, event_classes, from_record, record_of

__all__ = [
    "ServiceEvent",
    "Listening",
    "CheckpointWritten",
    "CheckpointTempsRemoved",
    "Resumed",
    "Stopped",
    "MessageLimit",
    "InitRequested",
    "InitTimedOut",
    "Initialised",
    "Fetched",
    "BadMessage",
    "InternalError",
    "UnknownPeer",
    "IdentityRefused",
    "AuthDenied",
    "SettingsRefused",
    "UplinkCodecDiffers",
    "Gated",
    "TakenOver",
    "Silent",
    "SendDropped",
    "Suppressed",
    "read_event",
    "read_log",
    "read_line",
]


@dataclass(frozen=True, kw_only=True)
class ServiceEvent(SyncerRecord):
    """Base of the service's own events (``t``: the service's clock, monotonic seconds)."""


# ------------------------------------------------------------------ lifecycle
@dataclass(frozen=True, kw_only=True)
class Listening(ServiceEvent):
    """The socket is bound and the service serves."""

    event: ClassVar[str] = "listening"
    endpoint: str
    """The endpoint learners connect to (the bound port filled in)."""
    resumed: bool
    """Whether it resumed from a checkpoint."""
    epoch: int
    """This run's epoch (values based on another epoch are refused)."""
    metrics: str | None
    """The Prometheus metrics URL; None when not served."""


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten(ServiceEvent):
    """A checkpoint was written."""

    event: ClassVar[str] = "checkpoint"
    path: str
    """Its file."""
    versions: tuple[int, ...]
    """Each fragment's version in it (the shard's fragments, for a shard)."""
    shard: str | None = field(default=None, metadata=OMIT_NONE)
    """``s/S`` for a syncer shard; None for the whole model."""


@dataclass(frozen=True, kw_only=True)
class CheckpointTempsRemoved(ServiceEvent):
    """Temporary files of checkpoint writes cut short by a crash were removed at start."""

    event: ClassVar[str] = "checkpoint_tmp_removed"
    paths: tuple[str, ...]
    """The files removed."""


@dataclass(frozen=True, kw_only=True)
class Resumed(ServiceEvent):
    """The state was loaded from the newest checkpoint (``--resume``)."""

    event: ClassVar[str] = "resumed"
    versions: tuple[int, ...]
    """Each fragment's version as loaded."""
    shard: str | None = field(default=None, metadata=OMIT_NONE)
    """``s/S`` for a syncer shard; None for the whole model."""


@dataclass(frozen=True, kw_only=True)
class Stopped(ServiceEvent):
    """The service stopped; its totals."""

    event: ClassVar[str] = "stopped"
    merges: int
    """Merges made by this process."""
    rejected_messages: int
    """Messages refused before the round logic."""
    replies_dropped: int
    """Error and receipt replies dropped for a connection that read none."""
    log_suppressed: int
    """Log records left out by the rate limit (each counted in a ``suppressed`` event)."""
    queued_replies_max: int
    """The most replies one connection had waiting."""


@dataclass(frozen=True, kw_only=True)
class MessageLimit(ServiceEvent):
    """The message size bound the first learner's model set (``--max-message-mb`` auto)."""

    event: ClassVar[str] = "message_limit"
    bytes: int
    """The bound on one message, bytes."""
    max_message_mb: int
    """The same in MiB, rounded up: what to pass to pin it."""
    zmq_cap: int
    """ZeroMQ's own cap on a message, bytes."""


# ------------------------------------------------------------------ seeding and fetches
@dataclass(frozen=True, kw_only=True)
class InitRequested(ServiceEvent):
    """A fresh syncer asked a learner for the model's initial values."""

    event: ClassVar[str] = "init_request"
    learner: str
    """The learner asked."""
    fragments: int
    """Fragments it is to send."""
    replaces: str | None = field(default=None, metadata=OMIT_NONE)
    """The learner asked before it, which sent nothing in time; None for the first ask."""


@dataclass(frozen=True, kw_only=True)
class InitTimedOut(ServiceEvent):
    """The learner asked for initial values sent none for ``--init-timeout`` seconds."""

    event: ClassVar[str] = "init_timeout"
    learner: str
    """The learner that was asked."""
    seconds: float
    """How long it was waited for."""
    received: int
    """Fragments it had sent."""
    next: str | None
    """The learner asked next; None when none waits."""


@dataclass(frozen=True, kw_only=True)
class Initialised(ServiceEvent):
    """Every fragment's initial value has come: the model exists."""

    event: ClassVar[str] = "initialised"
    learner: str
    """The learner whose values seeded it."""


@dataclass(frozen=True, kw_only=True)
class Fetched(ServiceEvent):
    """A learner rank fetched a fragment's full value (after a lost delta)."""

    event: ClassVar[str] = "fetch"
    learner: str
    """The learner."""
    rank: int
    """Its rank."""
    fragment: int
    """The fragment, in the model's numbering."""
    version: int
    """The version sent."""


# ------------------------------------------------------------------ refusals (rate-limited per connection)
@dataclass(frozen=True, kw_only=True)
class BadMessage(ServiceEvent):
    """A malformed message (or one that breaks a bound) was refused."""

    event: ClassVar[str] = "bad_message"
    level: ClassVar[int] = logging.INFO
    peer: str
    """The connection's ZeroMQ identity, hex."""
    reason: str
    """What was wrong, naming the field."""


@dataclass(frozen=True, kw_only=True)
class InternalError(ServiceEvent):
    """Handling a message raised (a fault validation missed): dropped, service goes on."""

    event: ClassVar[str] = "internal_error"
    peer: str
    """The connection, hex."""
    learner: str
    """The learner id it named ("" when none)."""
    type: str
    """The message type ("?" when it did not parse)."""
    reason: str
    """The exception."""


@dataclass(frozen=True, kw_only=True)
class UnknownPeer(ServiceEvent):
    """A message from a connection that has not joined (after a syncer restart, say)."""

    event: ClassVar[str] = "unknown_peer"
    level: ClassVar[int] = logging.INFO
    peer: str
    """The connection, hex."""
    learner: str
    """The learner id it named."""
    type: str
    """The message type."""


@dataclass(frozen=True, kw_only=True)
class IdentityRefused(ServiceEvent):
    """A message naming a learner rank that another connection holds was refused."""

    event: ClassVar[str] = "identity_refused"
    level: ClassVar[int] = logging.WARNING
    peer: str
    """The connection, hex."""
    learner: str
    """The learner id it named."""
    rank: int
    """The rank it named."""
    type: str
    """The message type."""
    reason: str
    """Why, and what to do."""


@dataclass(frozen=True, kw_only=True)
class AuthDenied(ServiceEvent):
    """A Curve key was refused: at the handshake (only ``reason``), or because the key
    may not speak as the learner a message names (``peer`` and the rest set)."""

    event: ClassVar[str] = "auth_denied"
    level: ClassVar[int] = logging.WARNING
    log_prefix: ClassVar[str] = "auth denied: "
    peer: str | None = field(default=None, metadata=OMIT_NONE)
    """The connection, hex."""
    learner: str | None = field(default=None, metadata=OMIT_NONE)
    """The learner id the message named."""
    type: str | None = field(default=None, metadata=OMIT_NONE)
    """The message type."""
    key: str | None = field(default=None, metadata=OMIT_NONE)
    """The client's public key, Z85."""
    reason: str
    """Why."""


@dataclass(frozen=True, kw_only=True)
class SettingsRefused(ServiceEvent):
    """A hello whose settings, layout or pieces cannot work with this run was refused."""

    event: ClassVar[str] = "settings_refused"
    peer: str
    """The connection, hex."""
    learner: str
    """The learner id."""
    rank: int
    """Its rank."""
    setting: str
    """The setting that differs (``pieces``, ``shard``, ``learner_id``, a config field)."""
    learner_value: Any
    """The learner's value (None where it is not one value)."""
    syncer_value: Any
    """The run's value."""
    reason: str
    """Why, and what to change."""


@dataclass(frozen=True, kw_only=True)
class UplinkCodecDiffers(ServiceEvent):
    """A learner sends another uplink codec than the syncer's (accepted; once per learner)."""

    event: ClassVar[str] = "uplink_codec_differs"
    learner: str
    """The learner."""
    learner_codec: str
    """Its uplink codec."""
    syncer_codec: str
    """The syncer's ``--uplink-codec``."""


@dataclass(frozen=True, kw_only=True)
class Gated(ServiceEvent):
    """A sharded learner's rank said hello and waits for the others (``waiting_for`` set:
    for connected ranks to say hello again before the pieces are checked)."""

    event: ClassVar[str] = "gate"
    learner: str
    """The learner."""
    rank: int
    """The rank that said hello."""
    ranks: tuple[int, ...]
    """Ranks held in the gate."""
    world: int
    """The learner's rank count."""
    waiting_for: tuple[int, ...] | None = field(default=None, metadata=OMIT_NONE)
    """Connected ranks that must say hello again."""
    reason: str | None = field(default=None, metadata=OMIT_NONE)
    """Why they must."""


@dataclass(frozen=True, kw_only=True)
class TakenOver(ServiceEvent):
    """A hello from a new connection took a learner rank over from another one."""

    event: ClassVar[str] = "takeover"
    level: ClassVar[int] = logging.WARNING
    learner: str
    """The learner."""
    rank: int
    """The rank."""
    peer: str
    """The new connection, hex."""
    previous: str
    """The connection that held it, hex."""
    silent_s: float
    """How long that one had been silent."""
    token: bool = False
    """The new connection presented the rank's resume token (its own learner, restarted or
    reconnected); else the silence had passed ``takeover_after``."""


@dataclass(frozen=True, kw_only=True)
class Silent(ServiceEvent):
    """A learner rank sent nothing for the heartbeat timeout and was dropped."""

    event: ClassVar[str] = "silent"
    level: ClassVar[int] = logging.INFO
    learner: str
    """The learner."""
    rank: int
    """The rank."""
    seconds: float
    """Seconds since it was last heard."""


@dataclass(frozen=True, kw_only=True)
class SendDropped(ServiceEvent):
    """Sending to a connection failed; what was queued for it was dropped."""

    event: ClassVar[str] = "send_dropped"
    peer: str
    """The connection, hex."""
    reason: str | None
    """The socket's error."""


@dataclass(frozen=True, kw_only=True)
class Suppressed(ServiceEvent):
    """Records of one kind from one connection (or one learner's rejections) left out of
    the log by the rate limit in one window."""

    event: ClassVar[str] = "suppressed"
    level: ClassVar[int] = logging.INFO
    of: str
    """The event left out."""
    count: int
    """How many."""
    window_s: float
    """The window, seconds."""
    peer: str | None = field(default=None, metadata=OMIT_NONE)
    """The connection, hex (None when counted per learner)."""
    learner: str | None = field(default=None, metadata=OMIT_NONE)
    """The learner (rejected contributions are counted per learner)."""


# ------------------------------------------------------------------ reading a log back
_BY_EVENT = event_classes(ServiceEvent, __name__)


def read_event(line: Mapping[str, Any]) -> SyncerRecord:
    """The typed record of one line of a syncer's JSONL log: a core record
    (``rackmend.core.records``) or one of the service's events above. ValueError for a
    line that is neither (another program's log, or another version's), naming its event."""
    if not isinstance(line, Mapping):
        raise ValueError(f"not a line of a syncer log: a JSON {type(line).__name__}, not an object")
    record = from_record(line)
    if record is not None:
        return record
    event = line.get("event")
    cls = _BY_EVENT.get(event) if isinstance(event, str) else None
    if cls is None:
        raise ValueError(f"not a line of this version's syncer log (event {event!r})")
    return record_of(cls, line)


def read_log(path: str | Path) -> list[SyncerRecord]:
    """Every record of the syncer log at ``path``, typed, in order; [] when there is no
    file yet. A last line not yet ended by a newline (being written) is left for the
    next read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    complete = text.rpartition("\n")[0]
    return [read_line(line, n) for n, line in enumerate(complete.splitlines(), 1) if line.strip()]


def read_line(text: str, number: int | None = None) -> SyncerRecord:
    """The typed record of one line of a syncer's JSONL log (``read_event`` of its JSON).
    ValueError for anything else, naming the line (``number``, from 1) and why: not
    JSON, nested too deep to read, or not a record of this version."""
    where = "a log line" if number is None else f"line {number}"
    try:
        return read_event(json.loads(text))
    except RecursionError:  # json's reader recurses once per level of nesting
        raise ValueError(f"{where}: JSON nested too deeply to be a syncer log line") from None
    except ValueError as exc:  # json.JSONDecodeError included
        raise ValueError(f"{where}: {exc}") from None
