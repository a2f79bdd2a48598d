"""The wire format between learners and the syncer: a msgpack header frame plus raw
tensor frames, and the validation every received message goes through.

Nothing here opens a socket; ``service`` and ``transport.zmq_link`` move the frames.
Nothing received is ever unpickled: headers are msgpack maps of plain values checked
field by field, tensor frames are raw little-endian bytes checked against the layout.
See ``docs/protocol.md`` for the format as a table.
"""

from __future__ import annotations

import math
import re
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence, cast

import msgpack
import torch

from rackmend.codecs.base import Codec, CodecError, Encoded
from rackmend.config import WEIGHTINGS, ConfigError
from rackmend.codecs.registry import CODECS, codec_by_id
from rackmend.core.fragments import (FragmentSpec, TensorSpec, dtype_name, fingerprint, fragment_problem,
                                     layout_from_wire, layout_to_wire)
from rackmend.core.failslow import REPORT_STATES, FailSlowReport
from rackmend.core.merge import run_jobs
from rackmend.core.messages import MOMENT_KINDS, Contribution, MomentContribution, MomentUpdate, Update, moment_spec
from rackmend.core.pieces import Piece, RankPieces, cut, piece_spec, pieces_from_wire, pieces_problem, pieces_to_wire
from rackmend.core.settings import RunRules, SyncerSettings
from rackmend.core.shards import Shard
from rackmend.core.status import StatusError, SyncerStatus

__all__ = [
    "fragment_field",
    "PROTOCOL_VERSION",
    "CODEC_NONE",
    "MAX_EPOCH",
    "MAX_HEADER_BYTES",
    "MAX_WORLD",
    "MAX_SYNC_EVERY",
    "WireError",
    "valid_learner_id",
    "Message",
    "encode",
    "decode_header",
    "FromLearner",
    "HelloIn",
    "InitIn",
    "ContribIn",
    "HeartbeatIn",
    "LeaveIn",
    "FetchIn",
    "AckIn",
    "MomentsIn",
    "StatusIn",
    "parse_from_learner",
    "FromSyncer",
    "UpdateIn",
    "InitRequestIn",
    "WelcomeIn",
    "ByeIn",
    "FailSlowIn",
    "MomentsUpdateIn",
    "SyncerAckIn",
    "ErrorIn",
    "parse_from_syncer",
    "StatusReplyIn",
    "parse_status_answer",
    "contribution_frames",
    "update_frames",
    "init_frames",
    "hello_frames",
    "Hello",
    "parse_hello",
    "welcome_frames",
    "parse_welcome",
    "TOKEN_BYTES",
    "MAX_TOKEN_CHARS",
    "ack_frames",
    "parse_ack",
    "fetch_frames",
    "fail_slow_frames",
    "parse_fail_slow",
    "parse_contribution",
    "moments_frames",
    "parse_moments",
    "moments_update_frames",
    "parse_moments_update",
    "parse_tensors",
    "parse_encoded",
    "parse_encoded_frames",
    "parse_pieces",
    "message_pieces",
    "status_request_frames",
    "parse_status_request",
    "status_reply_frames",
    "parse_status_reply",
    "parse_syncer_settings",
    "layout_to_wire",
    "layout_from_wire",
]

PROTOCOL_VERSION = 5
"""2 added acknowledgements (``ack``), which senders wait for before the next data
message of a fragment: a version-1 peer would never send them, so the versions do not mix.
3 added ``session`` and ``seq`` to contributions (replays are refused); a version-2
learner would send none. 4 added the syncer's ``epoch`` to updates and ``base_epoch`` to
contributions (a resumed syncer reissues version numbers; a version-3 learner would
apply a reissued version as if it were the one it held), and the learner's ``apply``
rule to the hello's settings (the grace window depends on it). 5 added ``pieces`` (sharded
racks: a rank's blocks of each tensor) to hellos, contributions, inits and updates; a
version-4 syncer would read a rank's pieces as whole tensors. Resume tokens (``welcome``,
a hello's ``token``) came within 5: a peer without them only loses the token's at-once
takeover, so the version stayed."""
CODEC_NONE = 0
"""Codec id of uncompressed tensors; compression codecs use their ``Codec.codec_id``."""
MAX_HEADER_BYTES = 1 << 20
"""A header larger than this is refused before it is parsed (a layout of ~10k tensors fits)."""

_LEARNER_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
"""Matched with ``fullmatch``: ``match`` with ``$`` accepts a trailing newline."""
MAX_SESSION = 2**63 - 1
"""Sessions are random 63-bit numbers (they survive a JSON checkpoint as plain ints)."""
MAX_EPOCH = 2**52 - 1
"""Syncer epochs are drawn below this (exact as a float64 too, for JSON tools)."""
TOKEN_BYTES = 16
"""A learner rank's resume token: this many random bytes, sent as hex (``welcome``)."""
MAX_TOKEN_CHARS = 2 * TOKEN_BYTES
_TOKEN = re.compile(r"[0-9a-f]{%d}" % MAX_TOKEN_CHARS)
LEARNER_TYPES = ("hello", "init", "contrib", "heartbeat", "leave", "fetch", "ack", "moments")
"""What a learner sends (``moments``: DES-LOC's optimizer moments, sent only in a run
whose learners said hello with ``desloc``, so peers that predate it never see one)."""
SYNCER_TYPES = ("update", "init_request", "error", "bye", "ack", "fail_slow", "moments_update", "welcome")
"""What a learner accepts from the syncer (``fail_slow``: advice about its own speed;
``moments_update``: DES-LOC's averaged moments; ``welcome``: the rank's resume token,
at its join)."""
CLIENT_TYPES = ("status",)
"""Read-only requests of a client that is not a learner (``rackmend status``): no
learner id, no rank, never a member of a round."""
SYNCER_RECEIVES = LEARNER_TYPES + CLIENT_TYPES
"""What the syncer's socket accepts: learners' messages and read-only client requests."""
STATUS_REPLY_TYPES = ("status_reply", "error")
"""What a status client accepts (an older syncer answers ``error`` ``bad_message``)."""
MAX_NONCE = 2**63 - 1
MAX_WIRE_INT = 2**63 - 1
"""The largest integer any field may carry (msgpack also encodes unsigned 64-bit ones)."""
MAX_WORLD = 1 << 16
"""The most ranks one learner (one torchrun rack) may declare; a hello claiming more is
refused at parse time, before the syncer sizes anything by it."""
MAX_SHARDS = 1 << 10
"""The most syncer shards a hello may name."""
MAX_SYNC_EVERY = 1 << 24
"""The largest ``sync_every`` (and DES-LOC period) a hello may carry: 16M inner steps
between syncs is far past any useful schedule, and the syncer's counters stay small."""


def valid_learner_id(lid: str) -> bool:
    """Whether ``lid`` is a learner id the wire accepts (the whole string is matched)."""
    return bool(_LEARNER_ID.fullmatch(lid))


class WireError(ValueError):
    """A received message is malformed; the text says which field and why."""


@dataclass(frozen=True)
class Message:
    """A decoded header and the tensor frames that followed it (not yet checked)."""

    type: str
    header: dict[str, Any]
    frames: tuple[memoryview, ...]


def encode(header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> list[Any]:
    """Frames for one message: the packed header, then each tensor's bytes without a copy."""
    frames: list[Any] = [msgpack.packb({"proto": PROTOCOL_VERSION, **header}, use_bin_type=True)]
    for t in tensors:
        t = t.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        # bfloat16 has no numpy dtype; its bytes travel as int16 words unchanged.
        frames.append(memoryview((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()).cast("B"))
    return frames


def _tensor_meta(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}
            for t in tensors]


def _payload(tensors: Sequence[torch.Tensor], encoded: Sequence[Encoded] | None) -> tuple[dict[str, Any], list[Any]]:
    """Header fields ``codec`` and ``tensors`` plus the frames, uncompressed or encoded.

    Encoded entries give the decoded ``dtype`` (float32) and ``shape``, the codec's
    ``params`` and how many ``frames`` follow; each frame's byte length is implied by
    ``Codec.frame_layout(shape, params)``, so the receiver checks it exactly.
    """
    if encoded is None:
        return {"codec": CODEC_NONE, "tensors": _tensor_meta(tensors)}, list(tensors)
    names = {e.codec for e in encoded}
    if len(names) > 1:
        raise ValueError(f"one message carries one codec, got {sorted(names)}")
    codec_id = CODECS[names.pop()].codec_id if names else CODEC_NONE
    meta = [{"dtype": "float32", "shape": list(e.shape), "params": dict(e.params), "frames": len(e.frames)}
            for e in encoded]
    return {"codec": codec_id, "tensors": meta}, [f for e in encoded for f in e.frames]


def _pieces_field(pieces: Sequence[Piece] | None) -> dict[str, Any]:
    """``pieces`` entries aligned with ``tensors`` when a message carries blocks (a rank
    of a sharded rack); nothing when it carries whole tensors."""
    return {} if pieces is None else {"pieces": pieces_to_wire(pieces)}


def contribution_frames(c: Contribution, rank: int) -> list[Any]:
    fields, frames = _payload(c.tensors, c.encoded)
    fields.update(_pieces_field(c.pieces))
    return encode({
        "type": "contrib", "learner": c.learner_id, "rank": rank, "fragment": c.fragment,
        "base_version": c.base_version, "step": c.step, "c_steps": c.c_steps, "c_tokens": float(c.c_tokens),
        "step_time": float(c.step_time), "session": c.session, "seq": c.seq, "base_epoch": c.base_epoch, **fields,
        **({} if c.merge_gain is None else {"merge_gain": float(c.merge_gain)}),
        # Optional, so syncers that predate fail-slow detection read the message as before.
        **({} if c.rank_steps <= 0 else {"rank_steps": c.rank_steps, "rank_step_time": float(c.rank_step_time)}),
    }, frames)


def moments_frames(c: MomentContribution, rank: int) -> list[Any]:
    """DES-LOC: a learner's moments of one kind for one fragment (``moment_spec`` layout)."""
    fields, frames = _payload(c.tensors, c.encoded)
    return encode({
        "type": "moments", "learner": c.learner_id, "rank": rank, "fragment": c.fragment, "kind": c.kind,
        "base_version": c.base_version, "base_epoch": c.base_epoch, "step": c.step, "c_steps": c.c_steps,
        "c_tokens": float(c.c_tokens), "session": c.session, "seq": c.seq, **fields}, frames)


def moments_update_frames(u: MomentUpdate) -> list[Any]:
    """DES-LOC: the syncer's averaged moments, encoded with the moments codec when lossy."""
    fields, frames = _payload(u.tensors, u.encoded)
    return encode({"type": "moments_update", "fragment": u.fragment, "kind": u.kind, "version": u.version,
                   "epoch": u.epoch, **fields}, frames)


def update_frames(u: Update, reset: bool = False, *, full: bool = False,
                  pieces: Sequence[Piece] | None = None, syncer: SyncerSettings | None = None) -> list[Any]:
    """``reset``: an answer to a (re)join, adopted whatever version the learner holds.
    An update carrying an encoded ``delta`` ships it (``delta: true``, ``base_version``
    = version - 1) unless ``reset`` or ``full`` asks for the full-precision value.
    ``pieces``: only these blocks of the value, full precision (for a rank of a
    sharded rack: a delta is encoded over whole tensors and cannot be cut).
    ``syncer``: the syncer's round settings, stated in a reset update (the join's answer)
    only; an optional field, which learners that predate it ignore."""
    said = {"syncer": syncer.to_wire()} if syncer is not None and reset else {}
    if pieces is not None:
        blocks = cut(u.tensors, pieces)
        return encode({"type": "update", "fragment": u.fragment, "version": u.version, "epoch": u.epoch,
                       "codec": CODEC_NONE, "reset": reset, "tensors": _tensor_meta(blocks),
                       **_pieces_field(pieces), **said}, blocks)
    if u.delta is not None and not reset and not full:
        fields, frames = _payload(u.tensors, u.delta)
        return encode({"type": "update", "fragment": u.fragment, "version": u.version, "epoch": u.epoch,
                       "reset": False, "delta": True, "base_version": u.version - 1, **fields}, frames)
    return encode({"type": "update", "fragment": u.fragment, "version": u.version, "epoch": u.epoch,
                   "codec": CODEC_NONE, "reset": reset, "tensors": _tensor_meta(u.tensors), **said}, u.tensors)


def parse_syncer_settings(msg: Message) -> SyncerSettings | None:
    """The checked ``syncer`` field of an ``update`` (None when it has none: a syncer that
    predates it, or not a join's answer). Keys beyond the known ones are ignored, so a
    later syncer may state more."""
    if "syncer" not in msg.header:
        return None
    raw = _field(msg.header, "syncer", dict)
    weighting = _field(raw, "weighting", str)
    if weighting not in WEIGHTINGS:
        raise WireError(f"update: syncer.weighting {weighting[:40]!r} is not one of {', '.join(WEIGHTINGS)}")
    return SyncerSettings(min_quorum=_field(raw, "min_quorum", int, minimum=1),
                          grace_max=float(_field(raw, "grace_max", (int, float), minimum=0)),
                          weighting=weighting, failslow=_field(raw, "failslow", bool))


def ack_frames(fragment: int, learner_id: str | None = None, rank: int = 0) -> list[Any]:
    """Receipt of a fragment's data message (a learner's ack names itself)."""
    header: dict[str, Any] = {"type": "ack", "fragment": fragment}
    if learner_id is not None:
        header.update(learner=learner_id, rank=rank)
    return encode(header)


def fragment_field(h: dict[str, Any], count: int, what: str) -> int:
    """The ``fragment`` of a ``what`` message's header, checked against a layout of
    ``count`` fragments (``fragments.fragment_problem``)."""
    p = h.get("fragment")
    problem = fragment_problem(p, count)
    if problem:
        raise WireError(f"{what}: {problem}")
    assert isinstance(p, int)
    return p


def parse_ack(msg: Message, fragments: int) -> int:
    """The fragment an ``ack`` confirms, checked against the layout's size."""
    return fragment_field(msg.header, fragments, "ack")


def fetch_frames(learner_id: str, rank: int, fragment: int) -> list[Any]:
    """Ask for the current full-precision value of ``fragment`` (after a lost delta)."""
    return encode({"type": "fetch", "learner": learner_id, "rank": rank, "fragment": fragment})


def fail_slow_frames(r: FailSlowReport) -> list[Any]:
    """The syncer's fail-slow advice to a learner (each of its ranks gets a copy)."""
    return encode({"type": "fail_slow", "learner": r.learner, "rank": r.rank, "state": r.state,
                   "ratio": float(r.ratio), "fleet_ratio": float(r.fleet_ratio), "baseline_s": float(r.baseline_s),
                   "steps": r.steps, "cost_s": float(r.cost_s)})


def parse_fail_slow(msg: Message, learner_id: str | None = None) -> FailSlowReport:
    """A checked ``fail_slow`` message; ``learner_id``: the receiving learner, which it must name."""
    h = msg.header
    lid = _field(h, "learner", str)
    if learner_id is not None and lid != learner_id:
        raise WireError(f"fail_slow names learner {lid[:40]!r}, this is {learner_id!r}")
    state = _field(h, "state", str)
    if state not in REPORT_STATES:
        raise WireError(f"fail_slow: state {state[:20]!r} is not one of {', '.join(REPORT_STATES)}")
    values = {k: float(_field(h, k, (int, float), minimum=0)) for k in ("ratio", "fleet_ratio", "baseline_s", "cost_s")}
    return FailSlowReport(learner=lid, rank=_field(h, "rank", int, minimum=0), state=state,
                          steps=_field(h, "steps", int, minimum=0), **values)


def hello_frames(learner_id: str, rank: int, world: int, fragments: Sequence[FragmentSpec],
                 settings: RunRules, pieces: RankPieces | None = None,
                 shard: Shard | None = None, token: str | None = None) -> list[Any]:
    """Announce a learner rank: its layout, the settings the syncer checks and, for a
    rank of a sharded rack, the pieces it owns (None: whole fragments p = rank mod world).
    ``shard``: the syncer shard this hello is meant for (sent only to a sharded syncer,
    which refuses a hello meant for another shard: endpoints given in the wrong order).
    ``token``: the rank's resume token from an earlier ``welcome`` of this syncer."""
    return encode({"type": "hello", "learner": learner_id, "rank": rank, "world": world,
                   "layout": layout_to_wire(fragments), "fingerprint": fingerprint(fragments),
                   "settings": settings.to_wire(),
                   **({} if pieces is None else {"pieces": [pieces_to_wire(ps) for ps in pieces]}),
                   **({} if shard is None or shard.whole else {"shard": [shard.index, shard.count]}),
                   **({} if token is None else {"token": token})})


def welcome_frames(learner_id: str, rank: int, token: str) -> list[Any]:
    """The syncer's answer to an admitted hello, before the fragments' values: the rank's
    resume token, which a later hello of this rank presents to take it back at once."""
    return encode({"type": "welcome", "learner": learner_id, "rank": rank, "token": token})


def parse_welcome(msg: Message, learner_id: str | None, rank: int) -> str:
    """The token of a checked ``welcome`` addressed to ``learner_id``'s rank ``rank``."""
    h = msg.header
    if _field(h, "learner", str) != learner_id or _field(h, "rank", int, minimum=0) != rank:
        raise WireError(f"welcome names learner {str(h['learner'])[:40]!r} rank {h['rank']}, this is "
                        f"{learner_id!r} rank {rank}")
    return _token(h)


def _token(h: dict[str, Any]) -> str:
    token = _field(h, "token", str)
    if not _TOKEN.fullmatch(token):
        raise WireError(f"{h.get('type')}: token must be {MAX_TOKEN_CHARS} lowercase hex characters")
    return token


def init_frames(learner_id: str, rank: int, fragment: int, tensors: Sequence[torch.Tensor],
                pieces: Sequence[Piece] | None = None) -> list[Any]:
    return encode({"type": "init", "learner": learner_id, "rank": rank, "fragment": fragment,
                   "codec": CODEC_NONE, "tensors": _tensor_meta(tensors), **_pieces_field(pieces)}, tensors)


def status_request_frames(nonce: int) -> list[Any]:
    """A read-only request for the syncer's status; the reply echoes ``nonce``."""
    return encode({"type": "status", "nonce": nonce})


def status_reply_frames(nonce: int, status: dict[str, Any]) -> list[Any]:
    """The syncer's answer: ``status`` is ``SyncerStatus.to_json()`` (``parse_status_reply``)."""
    return encode({"type": "status_reply", "nonce": nonce, "status": status})


# ------------------------------------------------------------------------ receiving
def _field(h: dict[str, Any], key: str, kind: type | tuple[type, ...], *, minimum: float | None = None,
           maximum: float | None = None) -> Any:
    """``h[key]``, checked: its type, finite, within [minimum, maximum]. Every integer is
    held to ``MAX_WIRE_INT`` at most even without a ``maximum``: nothing a peer sends may
    size an allocation or a loop beyond what the field means."""
    if key not in h:
        raise WireError(f"header lacks field {key!r}")
    v = h[key]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise WireError(f"field {key!r} must be {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise WireError(f"field {key!r} must be finite, got {v}")
    if minimum is not None and v < minimum:
        raise WireError(f"field {key!r} must be >= {minimum}, got {v}")
    if isinstance(v, int) and not isinstance(v, bool) and maximum is None:
        maximum = MAX_WIRE_INT
    if maximum is not None and v > maximum:
        raise WireError(f"field {key!r} must be <= {maximum}, got {str(v)[:30]}")
    return v


def decode_header(frames: Sequence[Any], allowed: Sequence[str], max_message_bytes: int) -> Message:
    """Unpack and check the header every message type shares; tensors come later."""
    if not frames:
        raise WireError("empty message")
    views = tuple(memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames)
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {views[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(views[0], raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise WireError("header must be a map")
    proto = header.get("proto")
    if proto != PROTOCOL_VERSION:
        raise WireError(f"protocol version {proto!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = header.get("type")
    if kind not in allowed:
        raise WireError(f"unknown message type {str(kind)[:40]!r}; expected one of {', '.join(allowed)}")
    # Every learner message the syncer receives names its sender; a read-only client
    # request does not (it is nobody in a round). ``ack`` travels both ways: the
    # syncer's names nobody.
    syncer_side = tuple(allowed) in (LEARNER_TYPES, SYNCER_RECEIVES)
    if "learner" in header or (syncer_side and kind in LEARNER_TYPES):
        lid = _field(header, "learner", str)
        if not _LEARNER_ID.fullmatch(lid):
            raise WireError("learner id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -")
        _field(header, "rank", int, minimum=0, maximum=MAX_WORLD - 1)
    return Message(kind, header, views[1:])



# ---------------------------------------------------------------- typed inbound messages
# Each side turns bytes into one of these in one place (``parse_from_learner``,
# ``parse_from_syncer``) and dispatches on the class; nothing after that branches on the
# header's ``type`` string. A body that needs the receiver's layout to be checked (a
# contribution's tensors, a fragment number) is parsed by its own ``parse_*`` with the
# ``message`` kept here, since only the receiver knows that layout.

@dataclass(frozen=True)
class FromLearner:
    """A learner rank's message: its header's common fields checked (``decode_header``)."""

    learner: str
    rank: int
    message: Message

    @property
    def type(self) -> str:
        """The wire name (for logs and refusals)."""
        return self.message.type


class HelloIn(FromLearner):
    """``hello``: a rank asks to join (``parse_hello``)."""


class InitIn(FromLearner):
    """``init``: the seeder's initial value of one fragment."""


class ContribIn(FromLearner):
    """``contrib``: an outer gradient of one fragment (``parse_contribution``)."""


class HeartbeatIn(FromLearner):
    """``heartbeat``: the rank is alive."""


class LeaveIn(FromLearner):
    """``leave``: the rank leaves cleanly."""


class FetchIn(FromLearner):
    """``fetch``: the rank asks for a fragment's full value (after a lost delta)."""


class AckIn(FromLearner):
    """``ack``: receipt of an update (``parse_ack``)."""


class MomentsIn(FromLearner):
    """``moments``: DES-LOC optimizer moments of one fragment (``parse_moments``)."""


@dataclass(frozen=True)
class StatusIn:
    """``status``: a read-only client's request, which names no learner."""

    nonce: int


_FROM_LEARNER: dict[str, type[FromLearner]] = {
    "hello": HelloIn, "init": InitIn, "contrib": ContribIn, "heartbeat": HeartbeatIn, "leave": LeaveIn,
    "fetch": FetchIn, "ack": AckIn, "moments": MomentsIn}


def parse_from_learner(frames: Sequence[Any], max_message_bytes: int) -> FromLearner | StatusIn:
    """What the syncer received, typed (``WireError`` when it is not a message it takes)."""
    msg = decode_header(frames, SYNCER_RECEIVES, max_message_bytes)
    if msg.type == "status":
        return StatusIn(parse_status_request(msg))
    return _FROM_LEARNER[msg.type](msg.header["learner"], msg.header["rank"], msg)


@dataclass(frozen=True)
class FromSyncer:
    """A message of the syncer to a learner rank; ``message`` for the body's parser."""

    message: Message


class UpdateIn(FromSyncer):
    """``update``: a fragment's merged value (or a delta to it)."""


class InitRequestIn(FromSyncer):
    """``init_request``: this learner seeds a fresh syncer."""


class WelcomeIn(FromSyncer):
    """``welcome``: the join was accepted; its resume token (``parse_welcome``)."""


class ByeIn(FromSyncer):
    """``bye``: the syncer heard this rank's leave."""


class FailSlowIn(FromSyncer):
    """``fail_slow``: advice about this learner's speed (``parse_fail_slow``)."""


class MomentsUpdateIn(FromSyncer):
    """``moments_update``: averaged DES-LOC moments (``parse_moments_update``)."""


class SyncerAckIn(FromSyncer):
    """``ack``: receipt of a contribution (``parse_ack``)."""


@dataclass(frozen=True)
class ErrorIn(FromSyncer):
    """``error``: a refusal, its ``code`` (``rejoin``, ``busy``, ``fatal``, ``rejected``...) and reason."""

    code: str
    reason: str


def _error_in(msg: Message) -> ErrorIn:
    return ErrorIn(msg, str(msg.header.get("code")), str(msg.header.get("reason", ""))[:500])


_FROM_SYNCER: dict[str, type[FromSyncer]] = {
    "update": UpdateIn, "init_request": InitRequestIn, "welcome": WelcomeIn, "bye": ByeIn, "fail_slow": FailSlowIn,
    "moments_update": MomentsUpdateIn, "ack": SyncerAckIn}


@dataclass(frozen=True)
class StatusReplyIn:
    """``status_reply``: a syncer's status, checked (``parse_status_reply``)."""

    nonce: int
    status: SyncerStatus


def parse_status_answer(frames: Sequence[Any], max_message_bytes: int) -> StatusReplyIn | ErrorIn:
    """What a read-only status client received, typed: the status, or the syncer's refusal."""
    msg = decode_header(frames, STATUS_REPLY_TYPES, max_message_bytes)
    if msg.type == "error":
        return _error_in(msg)
    return StatusReplyIn(*parse_status_reply(msg))


def parse_from_syncer(frames: Sequence[Any], max_message_bytes: int) -> FromSyncer:
    """What a learner's link received, typed (``WireError`` when it is not a message it takes)."""
    msg = decode_header(frames, SYNCER_TYPES, max_message_bytes)
    if msg.type == "error":
        return _error_in(msg)
    return _FROM_SYNCER[msg.type](msg)


_MAX_SETTING_STR = 200
_DESLOC_KEYS = ("desloc", "desloc_ku", "desloc_kv", "moments")


@dataclass(frozen=True)
class Hello:
    """A checked ``hello``: layout, ranks of the learner and its settings."""

    learner_id: str
    rank: int
    world: int
    layout: list[FragmentSpec]
    settings: RunRules
    pieces: RankPieces | None = None
    """The pieces a rank of a sharded rack owns, per fragment; None: a plain rank. Their
    structure is checked here, their bounds by the syncer (``pieces_problem``), which
    refuses the learner by name."""
    shard: Shard = Shard()
    """The syncer shard the learner meant this hello for (``0/1`` when it names none: a
    learner that talks to one syncer for the whole model)."""
    token: str | None = None
    """The resume token it presents (from an earlier ``welcome``); None: none."""


def _setting_str(raw: dict[str, Any], name: str) -> str:
    """A string among a hello's settings (an apply rule, a codec spec), bounded in length;
    what it may say is ``RunRules.validate``'s to check."""
    text = _field(raw, name, str)
    if len(text) > _MAX_SETTING_STR:
        raise WireError(f"hello: settings.{name} is longer than {_MAX_SETTING_STR} characters")
    return text


def parse_hello(msg: Message) -> Hello:
    """Every field of a ``hello``; the settings must be complete and self-consistent."""
    h = msg.header
    try:
        layout = layout_from_wire(h.get("layout"))
    except ValueError as exc:
        raise WireError(f"hello: {exc}") from None
    fp = _field(h, "fingerprint", str)
    if fp != fingerprint(layout):
        raise WireError("hello: fingerprint does not match the layout it came with")
    rank = _field(h, "rank", int, minimum=0, maximum=MAX_WORLD - 1)
    world = _field(h, "world", int, minimum=1, maximum=MAX_WORLD)
    if rank >= world:
        raise WireError(f"hello: rank {rank} and world {world} do not fit (need 0 <= rank < world)")
    if "settings" not in h:
        raise WireError("hello lacks field 'settings' (sync_every, num_fragments, overlap, deterministic, apply, "
                        "uplink, downlink): the learner runs an older rackmend; upgrade it")
    raw = _field(h, "settings", dict)
    expected = set(RunRules.__dataclass_fields__)
    # DES-LOC's keys come only with DES-LOC on (``RunRules.to_wire``).
    required = expected - set(_DESLOC_KEYS) if raw.get("desloc") is None else expected
    if not required <= set(raw) <= expected:
        raise WireError(f"hello: settings must have exactly the keys {sorted(required)}, "
                        f"got {sorted(str(k)[:40] for k in raw)[:10]}")
    # Types and bounds here; the rules between the values are RunRules.validate's alone.
    values: dict[str, Any] = {
        "sync_every": _field(raw, "sync_every", int, minimum=1, maximum=MAX_SYNC_EVERY),
        "num_fragments": _field(raw, "num_fragments", int, minimum=1),
        "overlap": _field(raw, "overlap", int, minimum=0),
        "deterministic": _field(raw, "deterministic", bool),
        "apply": _setting_str(raw, "apply"),
    }
    if values["num_fragments"] != len(layout):
        raise WireError(f"hello: settings say num_fragments={values['num_fragments']}, the layout has "
                        f"{len(layout)} fragments")
    for name in ("uplink", "downlink"):
        values[name] = _setting_str(raw, name)
    if "desloc" in raw:
        if _field(raw, "desloc", bool) is not True:
            raise WireError("hello: settings.desloc is sent only when true")
        values.update({k: _field(raw, k, int, minimum=1, maximum=MAX_SYNC_EVERY) for k in ("desloc_ku", "desloc_kv")},
                      desloc=True, moments=_setting_str(raw, "moments"))
    settings = RunRules(**values)
    try:
        settings.validate()
    except ConfigError as exc:
        raise WireError(f"hello: settings: {str(exc)[:300]}") from None
    pieces = None
    if "pieces" in h:
        raw_pieces = _field(h, "pieces", list)
        try:
            pieces = tuple(pieces_from_wire(ps) for ps in raw_pieces)
        except ValueError as exc:
            raise WireError(f"hello: {exc}") from None
    shard = Shard()
    if "shard" in h:
        raw_shard = _field(h, "shard", list)
        if len(raw_shard) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw_shard) \
                or not 0 <= raw_shard[0] < raw_shard[1] <= MAX_SHARDS:
            raise WireError(f"hello: shard must be [s, S] with 0 <= s < S <= {MAX_SHARDS}, got {str(raw_shard)[:40]}")
        shard = Shard(*raw_shard)
    token = _token(h) if "token" in h else None
    return Hello(h["learner"], rank, world, layout, settings, pieces, shard, token)


def message_pieces(msg: Message, fragments: Sequence[FragmentSpec], p: int) -> tuple[Piece, ...] | None:
    """The ``pieces`` a message about fragment ``p`` carries (checked against the
    layout's shapes), or None when it carries whole tensors."""
    if "pieces" not in msg.header:
        return None
    try:
        pieces = pieces_from_wire(msg.header["pieces"])
    except ValueError as exc:
        raise WireError(str(exc)) from None
    problem = pieces_problem(fragments, tuple(pieces if i == p else () for i in range(len(fragments))))
    if problem:
        raise WireError(problem)
    return pieces


def parse_pieces(msg: Message, fragments: Sequence[FragmentSpec], p: int, pool: Executor | None = None
                 ) -> tuple[tuple[Piece, ...] | None, tuple[torch.Tensor, ...], tuple[Encoded, ...] | None]:
    """(pieces or None, tensors, encoded) of a message about fragment ``p``: with
    pieces, its tensors are checked against the pieces' shapes, else the whole fragment's."""
    pieces = message_pieces(msg, fragments, p)
    spec = fragments[p] if pieces is None else piece_spec(fragments[p], pieces)
    tensors, encoded = parse_encoded(msg, spec, pool)
    return pieces, tensors, encoded


def parse_tensors(msg: Message, spec: FragmentSpec) -> tuple[torch.Tensor, ...]:
    """Uncompressed (codec 0) tensor frames of ``msg`` checked against ``spec`` and
    viewed without a copy; any other codec is refused."""
    tensors, encoded = parse_encoded(msg, spec)
    if encoded is not None:
        raise WireError(f"fragment {spec.index}: a full value must travel uncompressed (codec 0), "
                        f"got codec id {msg.header.get('codec')}")
    return tensors


def parse_encoded(msg: Message, spec: FragmentSpec, pool: Executor | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[Encoded, ...] | None]:
    """Tensors of ``msg`` checked against ``spec``: (values, None) for codec 0, or
    (decoded float32 values, the encoded tensors) for a compression codec. ``pool``: the
    tensors are decoded concurrently on its workers (a receiver's spare cores), in parts
    of a tensor where the codec has ``decode_parts``, into outputs allocated here."""
    codec_id, meta = _tensor_entries(msg, spec)
    if codec_id == CODEC_NONE:
        return _parse_plain(msg, spec, meta), None
    codec, encoded = _checked_encoded(msg, spec, codec_id, meta)
    decoded: list[torch.Tensor | None] = []
    jobs: list[Callable[[], Any]] = []
    for s, e in zip(spec.tensors, encoded):
        try:
            parts = codec.decode_parts(e)
        except CodecError as exc:
            raise WireError(f"{s.name}: {str(exc)[:500]}") from None
        if parts is None:
            jobs.append(partial(_decode_whole, codec, s, e, decoded, len(decoded)))
            decoded.append(None)
        else:
            decoded.append(parts[0])
            jobs.extend(parts[1])
    # Parts of a tensor, not whole tensors, go to the workers: uneven tensors share out evenly.
    run_jobs(jobs, pool)
    return cast("tuple[torch.Tensor, ...]", tuple(decoded)), encoded  # every job has filled its slot


def parse_encoded_frames(msg: Message, spec: FragmentSpec) -> tuple[Codec, tuple[Encoded, ...]]:
    """A compressed message's tensors checked against ``spec`` (every check
    ``parse_encoded`` makes) but not decoded: the codec and each tensor's ``Encoded``,
    for a consumer that decodes piece by piece (int8/int4: ``dequantize_range``). WireError for
    an uncompressed message."""
    codec_id, meta = _tensor_entries(msg, spec)
    if codec_id == CODEC_NONE:
        raise WireError(f"fragment {spec.index}: the message carries plain tensors, not encoded ones")
    return _checked_encoded(msg, spec, codec_id, meta)


def _tensor_entries(msg: Message, spec: FragmentSpec) -> tuple[int, list[dict[str, Any]]]:
    """The header's codec id and one tensor entry (a map) per tensor of ``spec``."""
    h = msg.header
    codec_id = _field(h, "codec", int)
    meta = _field(h, "tensors", list)
    if len(meta) != len(spec.tensors):
        raise WireError(f"fragment {spec.index} has {len(spec.tensors)} tensors; header lists {len(meta)}")
    for m in meta:
        if not isinstance(m, dict):
            raise WireError("tensor entry must be a map")
    return codec_id, meta


def _checked_encoded(msg: Message, spec: FragmentSpec, codec_id: int, meta: list[dict[str, Any]]
                     ) -> tuple[Codec, tuple[Encoded, ...]]:
    """The frames of a compressed message as the codec's ``Encoded`` tensors, each checked
    (frame count, dtype, shape, the codec's own layout and values)."""
    try:
        codec = codec_by_id(codec_id)
    except CodecError as exc:
        raise WireError(str(exc)) from None
    counts = [m.get("frames") for m in meta]
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 16 for n in counts):
        raise WireError(f"{codec.name}: each tensor entry needs 'frames', an int in [0, 16]")
    if sum(counts) != len(msg.frames):
        raise WireError(f"{codec.name}: tensor entries declare {sum(counts)} frames, message carries {len(msg.frames)}")
    encoded, start = [], 0
    for m, s, n in zip(meta, spec.tensors, counts):
        if s.dtype != torch.float32:
            raise WireError(f"{s.name} is {dtype_name(s.dtype)}; codec {codec.name} carries float32 tensors only")
        if m.get("dtype") != "float32" or m.get("shape") != list(s.shape):
            raise WireError(f"{s.name}: expected float32 {list(s.shape)}, "
                            f"got {str(m.get('dtype'))[:20]} {str(m.get('shape'))[:60]}")
        try:
            # In place where the codec allows: a message owns its frames, nobody changes them.
            encoded.append(codec.from_wire(s.shape, m.get("params"), msg.frames[start:start + n], copy=False))
        except CodecError as exc:  # cut: the text may quote attacker-chosen parameter names
            raise WireError(f"{s.name}: {str(exc)[:500]}") from None
        start += n
    return codec, tuple(encoded)


def _decode_whole(codec: Codec, s: TensorSpec, e: Encoded, into: list[torch.Tensor | None], i: int) -> None:
    """into[i] = the decoded ``e`` (for a codec without ``decode_parts``)."""
    try:
        into[i] = codec.decode(e)
    except CodecError as exc:
        raise WireError(f"{s.name}: {str(exc)[:500]}") from None


def _parse_plain(msg: Message, spec: FragmentSpec, meta: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    if len(msg.frames) != len(spec.tensors):
        raise WireError(f"fragment {spec.index} has {len(spec.tensors)} tensors; message carries "
                        f"{len(msg.frames)} frames")
    out = []
    for m, s, frame in zip(meta, spec.tensors, msg.frames):
        if m.get("dtype") != dtype_name(s.dtype) or m.get("shape") != list(s.shape):
            raise WireError(f"{s.name}: expected {dtype_name(s.dtype)} {list(s.shape)}, "
                            f"got {str(m.get('dtype'))[:20]} {str(m.get('shape'))[:60]}")
        if m.get("nbytes") != s.nbytes or frame.nbytes != s.nbytes:
            raise WireError(f"{s.name}: {s.nbytes} bytes expected, header declares {str(m.get('nbytes'))[:20]}, "
                            f"frame has {frame.nbytes}")
        if s.nbytes == 0:
            out.append(torch.empty(s.shape, dtype=s.dtype))
            continue
        wire_dtype = torch.int16 if s.dtype == torch.bfloat16 else s.dtype
        with warnings.catch_warnings():  # read-only frames are fine: nobody writes to them
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(frame, dtype=wire_dtype).view(s.shape)
        out.append(t.view(torch.bfloat16) if s.dtype == torch.bfloat16 else t)
    return tuple(out)


def parse_contribution(msg: Message, fragments: Sequence[FragmentSpec], pool: Executor | None = None
                       ) -> Contribution:
    """A checked ``contrib``; ``pool``: its tensors decoded on the pool's workers."""
    h = msg.header
    p = fragment_field(h, len(fragments), "contrib")
    counters = dict(
        base_version=_field(h, "base_version", int, minimum=0),
        step=_field(h, "step", int, minimum=0),
        c_steps=_field(h, "c_steps", int, minimum=0),
        c_tokens=float(_field(h, "c_tokens", (int, float), minimum=0)),
        step_time=float(_field(h, "step_time", (int, float), minimum=0)),
        session=_field(h, "session", int, minimum=0, maximum=MAX_SESSION),
        seq=_field(h, "seq", int, minimum=1),  # 0 would mean unsequenced: never from the network
        base_epoch=_field(h, "base_epoch", int, minimum=0, maximum=MAX_EPOCH),
    )
    gain = float(_field(h, "merge_gain", (int, float))) if "merge_gain" in h else None
    if "rank_steps" in h:
        counters["rank_steps"] = _field(h, "rank_steps", int, minimum=1)
        counters["rank_step_time"] = float(_field(h, "rank_step_time", (int, float), minimum=0))
    pieces, tensors, encoded = parse_pieces(msg, fragments, p, pool)  # after the cheap checks: decoding costs
    return Contribution(learner_id=h["learner"], fragment=p, tensors=tensors, encoded=encoded, merge_gain=gain,
                        rank=h["rank"], pieces=pieces, **counters)


def _moment_key(h: dict[str, Any], fragments: Sequence[FragmentSpec], what: str) -> tuple[int, str]:
    p = fragment_field(h, len(fragments), what)
    kind = _field(h, "kind", str)
    if kind not in MOMENT_KINDS:
        raise WireError(f"{what}: kind {kind[:30]!r} is not one of {', '.join(MOMENT_KINDS)}")
    return p, kind


def parse_moments(msg: Message, fragments: Sequence[FragmentSpec]) -> MomentContribution:
    """A checked ``moments`` message: counters, and tensors against the fragment's moment
    layout (its parameters' shapes and dtypes; a lossy codec's values decoded)."""
    h = msg.header
    p, kind = _moment_key(h, fragments, "moments")
    counters = dict(
        base_version=_field(h, "base_version", int, minimum=0),
        base_epoch=_field(h, "base_epoch", int, minimum=0, maximum=MAX_EPOCH),
        step=_field(h, "step", int, minimum=0),
        c_steps=_field(h, "c_steps", int, minimum=0),
        c_tokens=float(_field(h, "c_tokens", (int, float), minimum=0)),
        session=_field(h, "session", int, minimum=0, maximum=MAX_SESSION),
        seq=_field(h, "seq", int, minimum=1),
    )
    tensors, encoded = parse_encoded(msg, moment_spec(fragments[p]))
    return MomentContribution(learner_id=h["learner"], fragment=p, kind=kind, tensors=tensors, encoded=encoded,
                              rank=h["rank"], **counters)


def parse_moments_update(msg: Message, fragments: Sequence[FragmentSpec]) -> MomentUpdate:
    """A checked ``moments_update`` message from the syncer (tensors checked, decoded, finite)."""
    h = msg.header
    p, kind = _moment_key(h, fragments, "moments_update")
    version = _field(h, "version", int, minimum=1)
    epoch = _field(h, "epoch", int, minimum=0, maximum=MAX_EPOCH)
    tensors, encoded = parse_encoded(msg, moment_spec(fragments[p]))
    if not all(bool(torch.isfinite(t).all()) for t in tensors if t.numel()):
        raise WireError(f"moments_update of fragment {p} ({kind}) holds non-finite values")
    return MomentUpdate(p, kind, version, tuple(t.clone() for t in tensors), epoch=epoch, encoded=encoded)


def parse_status_request(msg: Message) -> int:
    """The nonce of a ``status`` request (an int in [0, 2^63))."""
    return _field(msg.header, "nonce", int, minimum=0, maximum=MAX_NONCE)


def parse_status_reply(msg: Message) -> tuple[int, SyncerStatus]:
    """(nonce, status) of a ``status_reply``, every field of the status checked
    (``SyncerStatus.from_json``)."""
    nonce = _field(msg.header, "nonce", int, minimum=0)
    try:
        return nonce, SyncerStatus.from_json(_field(msg.header, "status", dict))
    except StatusError as exc:
        raise WireError(str(exc)[:300]) from None
