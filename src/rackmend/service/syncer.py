"""The syncer as a network service: a ZeroMQ ROUTER socket in front of ``SyncerCore``.

This module owns sockets, time, membership (hello, heartbeats, leave, silence),
checkpoints and authentication. The round logic stays in ``rackmend.core.syncer``;
the bytes' format and validation in ``rackmend.transport.wire``.

One thread, one loop: poll the socket until the next grace deadline, heartbeat
check or stop request, feed what arrived to the core, carry out its actions.

It feeds the syncer's Prometheus metrics (``rackmend.service.metrics``) from the
core's actions and records and from what it measures itself, and serves them on
``metrics_port`` when set.

It also answers read-only ``status`` requests (``rackmend status``) from what it
tracks per learner (ranks, state, bytes, step time, version lag) and per fragment;
such a client passes the same Curve authentication as a learner but never becomes a
member of a round.
"""

from __future__ import annotations

import dataclasses
import math
import json
import logging
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import zmq

from rackmend.config import (OPTION, OPTION_SCALE, ConfigError, LearnerConfig, RackmendConfig, RunConfig,
                             ScheduleConfig, frozen_config)
from rackmend.core.assembly import Assembler, assemble
from rackmend.core.fragments import FragmentSpec, fingerprint, layout_difference, layout_from_wire, layout_to_wire
from rackmend.core.pieces import Piece, RankPieces, cover_problem, is_whole, pieces_problem, whole_pieces
from rackmend.core.failslow import AdviseLearner, FailSlowBlip, MarkForEviction, RestoreLearner, StopExpecting
from rackmend.core.settings import (LearnerSettings, Mismatch, SyncerSettings, peer_mismatch, same_codec,
                                    syncer_mismatch)
from rackmend.core.shards import Shard, parse_shard
from rackmend.core.shards import owner as owner_shard
from rackmend.core.records import Incomplete, Joined, Left, Merged, PieceDropped, Rejected, SyncerRecord
from rackmend.core.syncer_fragment import global_values
from rackmend.core.syncer import (
    Action,
    ContributionArrived,
    Event,
    FinalMerge,
    LearnerJoined,
    LearnerLeft,
    MomentsArrived,
    SendMomentUpdate,
    SendUpdate,
    SyncerCore,
    SyncTimed,
    Tick,
)
from rackmend.service.checkpoint import load_checkpoint, remove_stale_temps, save_checkpoint
from rackmend.service.identity import EventLimiter, load_key_ids
from rackmend.service.metrics import SyncerMetrics, is_loopback_host
from rackmend.transport import wire
from rackmend.transport.outbox import SHORT_HWM, Outbox

__all__ = ["ServiceConfig", "SyncerService"]

log = logging.getLogger("rackmend.syncer")

_SERVICE_LOG: dict[str, tuple[int, str]] = {
    "auth_denied": (logging.WARNING, "auth denied: "),
    "identity_refused": (logging.WARNING, ""),
    "takeover": (logging.WARNING, ""),
    "bad_message": (logging.INFO, ""),
    "unknown_peer": (logging.INFO, ""),
    "silent": (logging.INFO, ""),
    "suppressed": (logging.INFO, ""),
}
"""How loud the service's own records are in the Python log (level, and a prefix for a
warning's reason); others go to the JSONL log only. The core's records carry their
level (``SyncerRecord.level``)."""

STRANGER_MAX_BYTES = wire.MAX_HEADER_BYTES + (64 << 10)
"""Largest message taken from a connection that has not joined (a hello is one header
frame): junk from strangers never needs more memory than this past ZeroMQ."""
AUTO_ZMQ_CAP = 256 << 20
"""ZeroMQ's pre-read cap (fixed when the socket binds) when neither the operator
(``--max-message-mb``) nor a checkpoint gives the model's size: the layout arrives later,
with the first hello. ZeroMQ reads a whole message into memory before the syncer sees
it, so this bounds what one connection that never joined can cost (three strangers'
512 MiB messages cost +1.5 GiB RSS under the former 2 GiB cap). A first learner whose
largest fragment needs more is refused by name, pointing at ``--max-message-mb``."""
MAX_QUEUED_REPLIES = 16
"""Error and receipt replies held per connection that reads none of them; more are
dropped (counted as ``replies_dropped``): a peer that never reads costs bounded memory."""
_FRAGMENT_MESSAGES = ("contrib", "init", "fetch", "ack", "moments")
"""What a learner sends about one fragment (its ``fragment`` field is renumbered for a shard's core)."""
LOG_WINDOW_S = 10.0
"""The window of ``ServiceConfig.log_burst``, seconds."""


def layout_message_limit(fragments: list[FragmentSpec]) -> int:
    """The largest message a joined learner sends for this layout: its largest fragment
    uncompressed (an ``init`` or a ``contrib``) plus the largest header allowed."""
    return max((f.nbytes for f in fragments), default=0) + wire.MAX_HEADER_BYTES


@frozen_config
@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Where and how the syncer service listens, checkpoints and authenticates."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint of the ROUTER socket. Without Curve keys only loopback
    addresses are allowed unless ``insecure`` is set."""

    insecure: bool = False
    """Allow a non-loopback bind without CurveZMQ (traffic unauthenticated and in clear)."""

    secret_key_file: str | None = field(default=None, metadata={OPTION: "secret_key"})
    """The syncer's ``.key_secret`` file from ``rackmend keygen``; turns CurveZMQ on."""

    allowed_keys_dir: str | None = field(default=None, metadata={OPTION: "allowed_keys"})
    """Directory of learners' public ``.key`` files; only those may connect (needs the
    syncer's secret key, ``secret_key_file``)."""

    checkpoint_dir: str | None = None
    """Directory checkpoints are written to; unset (None): no checkpoints."""

    checkpoint_every: int = 50
    """Write a checkpoint every this many merges (and always on SIGTERM/SIGINT)."""

    resume: bool = False
    """Start from the checkpoint in ``checkpoint_dir`` (an error if there is none)."""

    heartbeat_timeout: float = 10.0
    """Seconds without any message after which a learner rank counts as gone and
    rounds stop waiting for it. Learners send heartbeats every second by default;
    set this to several heartbeat periods so a busy learner is not dropped."""

    max_message_bytes: int | None = field(default=None, metadata={OPTION: "max_message_mb", OPTION_SCALE: 2**20})
    """Largest message accepted: bytes here, MiB as ``rackmend syncer --max-message-mb``;
    larger ones are rejected (logged, answered). Beyond twice this
    ZeroMQ drops the sender's connection before reading the message into memory.
    None: follow the model, its largest fragment plus the header bound (with
    ``resume`` ZeroMQ's cap follows it too; on a fresh start ZeroMQ's cap is
    ``AUTO_ZMQ_CAP``, 256 MiB, since the model is not known when the socket binds: a
    first learner whose largest fragment needs more is refused, naming the value to
    pass, and the ``message_limit`` event names it too). Connections that have not
    joined are held to ``STRANGER_MAX_BYTES`` (or this, if smaller) either way."""

    takeover_after: float = 5.0
    """Seconds a learner rank must have been silent before a hello for its id and rank
    from another connection takes its place. Sooner, the hello is refused (logged as
    ``identity_refused``; the learner's link retries): a stranger cannot evict or
    impersonate a live learner. A restarted learner process waits this long at most;
    keep it above a few heartbeat periods of the learners (1 s by default)."""

    log_path: str | None = field(default=None, metadata={OPTION: "log"})
    """JSONL file of every event (merges, joins, rejections); unset (None): not written."""

    init_timeout: float = 60.0
    """Seconds a fresh syncer waits for the next initial value (``init``) from the
    learner it asked to seed the model. Past it, that learner counts as gone and the
    request passes to another waiting learner (events ``init_timeout``, then
    ``init_request``); without one, the next learner to join is asked. Raise it when a
    single fragment of the model takes longer than this to upload."""

    log_burst: int = 5
    """Per connection (per learner for rejected contributions) and kind of bad input,
    the most log records per 10 s; the rest are counted in one ``suppressed`` record per
    window, so a junk flood cannot fill the disk. Raise it to see every rejection of
    one misbehaving learner."""

    ready_file: str | None = None
    """Once the socket is bound and the loop serves, the bound endpoint is written to
    this file (atomically: a reader never sees half of it), for scripts that start the
    syncer on port 0. None: not written."""

    metrics_port: int = 0
    """TCP port of the Prometheus endpoint (``http://HOST:PORT/metrics``); 0: none.
    ``docs/operations.md`` lists the metrics."""

    progress_every: float = 30.0
    """Seconds between the progress lines logged at INFO: the merges since the last line,
    each fragment's latest version and the learners merged in them (or, with learners connected
    and nothing merged, that no merge happened). 0: none. Every merge is in the
    ``log_path`` file either way."""

    threads: int = 0
    """Threads the syncer computes with: the merge's sums and the contributions' norms
    spread over a pool of this many workers, and torch's own operations (the outer step,
    codec decoding, finiteness checks) use as many. 0: as many as torch uses by default
    (the machine's physical cores). ``docs/capacity.md`` shows what each thread buys."""

    shard: str = "0/1"
    """This syncer's part of the model, ``s/S``: shard ``s`` of ``S`` owns the fragments
    ``p`` with ``p mod S == s`` and knows nothing of the others (no coordination between
    shards). Start one ``rackmend syncer --shard s/S`` per shard, each with its own port
    and checkpoint directory, and give every learner all S endpoints in shard order
    (``--connect tcp://a:5555,tcp://b:5555``). ``0/1``: one syncer for the whole model."""

    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on. Metrics are served without
    authentication: keep the loopback default and scrape from this machine, or put a
    firewall in front (a warning is logged for any other address)."""

    def validate(self) -> None:
        parse_shard(self.shard)
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 1, or 0 for torch's default (the physical cores); got "
                              f"{self.threads} (--threads)")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port in 1..65535, or 0 for no metrics endpoint; got "
                              f"{self.metrics_port} (--metrics-port)")
        if not self.metrics_host.strip():
            raise ConfigError("metrics_host is empty; give an address such as 127.0.0.1 (--metrics-host)")
        if self.log_burst < 1:
            raise ConfigError(f"log_burst must be >= 1 records per window, got {self.log_burst}")
        if self.progress_every < 0:
            raise ConfigError(f"progress_every must be >= 0 seconds (0: no progress lines), got {self.progress_every} "
                              "(--progress-every)")
        if not self.init_timeout > 0:
            raise ConfigError(f"init_timeout must be > 0 seconds, got {self.init_timeout}; the default is 60 "
                              "(--init-timeout)")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 merges, got {self.checkpoint_every}")
        if self.max_message_bytes is not None and self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0 (or None: follow the model), got "
                              f"{self.max_message_bytes}; --max-message-mb takes MiB")
        if not self.takeover_after > 0:
            raise ConfigError(f"takeover_after must be > 0 seconds, got {self.takeover_after}; the default is 5 "
                              "(--takeover-after)")
        if self.heartbeat_timeout <= 0:
            raise ConfigError(f"heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (where to find the checkpoint)")
        if self.allowed_keys_dir and not self.secret_key_file:
            raise ConfigError("allowed_keys_dir needs secret_key_file: Curve authentication needs the syncer's key")
        if not self.secret_key_file and not self.insecure and not _is_loopback(self.bind):
            raise ConfigError(
                f"bind={self.bind!r} is not a loopback address and no Curve key is set: traffic would be "
                "unauthenticated; pass --secret-key (see `rackmend keygen`) or --insecure")

    def __post_init__(self) -> None:
        self.validate()


def _is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    # '*', interface names, host names: not provably loopback
    return is_loopback_host(endpoint.split("://", 1)[-1].rsplit(":", 1)[0])


class _AuthLog:
    """Logger for pyzmq's authenticator: it reports refusals at debug level only; an
    operator needs to see them, so they become warnings and events."""

    def __init__(self, on_denied: Callable[[str], None]) -> None:
        self._log = logging.getLogger("rackmend.auth")
        self._on_denied = on_denied

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        text = msg % args if args else msg
        if "DENIED" in text:
            self._on_denied(text)
        else:
            self._log.debug(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


@dataclass
class _Peer:
    learner_id: str
    rank: int
    world: int
    last_seen: float
    pieces: RankPieces
    """Per fragment, the pieces this rank sends and receives."""
    cuts: list[tuple[Piece, ...] | None]
    """Per fragment, the pieces its messages carry; None where it owns the fragment whole
    (or nothing of it): those travel as for a plain rack, deltas included."""

    def owns(self, fragment: int) -> bool:
        return bool(self.pieces[fragment])


def _rank_pieces(layout: list[FragmentSpec], hello: wire.Hello) -> RankPieces:
    """What a rank owns: its declared pieces, or a plain rank's whole fragments."""
    return hello.pieces if hello.pieces is not None else whole_pieces(layout, hello.rank, hello.world)


@dataclass
class _Gated:
    """A hello of a sharded learner's rank, held until every rank of it has said hello."""

    msg: wire.Message
    hello: wire.Hello
    last_seen: float


@dataclass
class _Progress:
    """What the next progress line sums up: merges since ``at`` and who was merged (the
    latest versions are ``SyncerService._last_merge``'s)."""

    at: float
    merges: int = 0
    learners: set[str] = field(default_factory=set)


@dataclass
class _LearnerStats:
    """What ``status`` reports about one learner id (all its ranks together)."""

    state: str
    """joining (waiting for the first learner's initial values), connected, left, silent."""
    first_seen: float
    last_seen: float
    bytes_in: int = 0
    bytes_out: int = 0
    contributions: int = 0
    rejected: int = 0
    step: int | None = None
    """Inner step count of its newest contribution."""
    step_time: float | None = None
    """Mean seconds per inner step its newest contribution reported."""
    last_contribution: float | None = None
    based: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per fragment: (base_version of its newest contribution, how many versions behind
    the syncer's that base was when the contribution arrived)."""


def _nbytes(frames: list[Any]) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f.buffer) if isinstance(f, zmq.Frame) else len(f)
               for f in frames)


@dataclass
class _Pending:
    """Layout offered by the first learner while its initial values are on the way."""

    layout: list[FragmentSpec]
    seeders: dict[bytes, RankPieces | None]
    """The connections asked for the initial values, with the pieces each owns (None: a
    plain rank, which sends every fragment whole); only their ``init`` messages count
    (values of two learners' different initialisations must never be mixed). One
    connection for a plain learner, every rank's for a sharded one."""
    seeder_id: str
    settings: LearnerSettings
    asked_at: float
    """When the seeder was asked, or last delivered a fragment."""
    values: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    parts: dict[int, dict[bytes, tuple[tuple[Piece, ...], tuple[Any, ...]]]] = field(default_factory=dict)
    """Per fragment, the pieces of a sharded seeder received so far, by connection."""
    waiting: list[tuple[bytes, Any]] = field(default_factory=list)


class SyncerService:
    """Serve learners until ``stop()`` (or SIGTERM/SIGINT when run in the main thread).

    ``config`` holds the run's settings on the syncer's side; of its schedule only
    ``overlap`` counts. H, P and the apply rule are the learners': the first learner's
    hello sets them for the run (a ``RackmendConfig``'s ``learner`` part is not read)."""

    def __init__(self, config: RunConfig, service: ServiceConfig,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.service = service
        self.shard: Shard = parse_shard(service.shard)
        if service.threads:
            torch.set_num_threads(service.threads)
        self.threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rackmend-merge") if self.threads > 1 else None
        """The core's workers (``SyncerCore.pool``); shut down with the service."""
        self._layout: list[FragmentSpec] | None = None
        """The model's whole layout (every fragment, in the model's numbering): what hellos
        are checked against. The core holds this shard's fragments only, renumbered from 0
        (``Shard.fragments``); fragment numbers are translated at the service's edge:
        ``_on_message`` for what arrives, ``_out`` and ``_globalize`` for what leaves."""
        self.clock = clock
        self.metrics = SyncerMetrics(clock, self.shard)
        """Counted whether or not they are served (``metrics_port``)."""
        self.core: SyncerCore | None = None
        self.peers: dict[bytes, _Peer] = {}
        self.rejected_messages = 0
        self.merges = 0
        self._pending: _Pending | None = None
        self._gate: dict[str, dict[bytes, _Gated]] = {}
        """Per sharded learner, hellos of ranks held until all its ranks have said hello."""
        self._learner_pieces: dict[str, dict[int, RankPieces]] = {}
        """Per sharded learner admitted, what each rank owns (kept while ranks come and go)."""
        self._assembler: Assembler | None = None
        self._first: tuple[str, LearnerSettings] | None = None
        """The learner whose H and P the run uses (the seeder, or from the checkpoint)."""
        self._uplink_noted: set[str] = set()
        self.started_at = clock()
        self.status_requests = 0
        """Read-only ``status`` requests answered."""
        self._stats: dict[str, _LearnerStats] = {}
        self._ident_learner: dict[bytes, str] = {}
        """Connection -> learner id, kept after a peer is dropped (its last sends still count)."""
        self._last_merge: dict[int, dict[str, Any]] = {}
        self._progress = _Progress(at=clock())
        """Merges since the last progress line (``progress_every``)."""
        self._checkpoint_at: float | None = None
        self._stop = threading.Event()
        self._log_file = open(service.log_path, "a", encoding="utf-8") if service.log_path else None
        self._log_lock = threading.Lock()  # the authenticator's thread logs refusals too
        self._limiter = EventLimiter(service.log_burst, LOG_WINDOW_S)
        self.replies_dropped = 0
        """Error and receipt replies not queued because their connection reads none."""
        self.queued_replies_max = 0
        """The most control messages ever waiting for one connection."""
        self._key_ids: dict[str, frozenset[str] | None] | None = None
        """With Curve and an allowed-keys directory: public key (Z85) -> learner ids it may use."""
        self._ctx = zmq.Context.instance()
        self._auth: Any = None
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted learner rank takes its identity back
        # A short per-peer queue that reports "full" (EAGAIN) instead of dropping: what does
        # not fit waits in the peer's Outbox, where a newer value of a fragment replaces an
        # unsent older one, so a slow link carries fresh values rather than a backlog.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SHORT_HWM)
        self._outboxes: dict[bytes, Outbox] = {}
        self.epoch = 1 + secrets.randbelow(wire.MAX_EPOCH)
        """Drawn at every start, never stored: a crash after a merge was sent but before
        it was checkpointed makes the resumed run reissue that version number with
        another value, and (epoch, version) keeps the two apart at the learners."""
        self.superseded_updates = 0
        """Updates replaced in a peer's outbox by a newer value before its link had room."""
        if service.resume:  # before the bind: the checkpoint's layout sizes ZeroMQ's cap
            self._resume()
        # ZeroMQ's own cap is twice the limit: a message just over the limit still reaches
        # the validator and gets a logged, answered rejection; a far bigger one is cut off
        # by ZeroMQ (the connection dropped) before it can use the memory. The option only
        # applies to connections accepted after the bind, so it cannot follow the layout
        # of a fresh run; the per-message checks in _on_message do.
        limit = self._message_limit()
        self._zmq_cap = AUTO_ZMQ_CAP if limit is None else 2 * limit
        self.sock.setsockopt(zmq.MAXMSGSIZE, self._zmq_cap)
        self._setup_curve()
        self.sock.bind(service.bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.metrics_url: str | None = None
        """Where ``/metrics`` is served; None without ``metrics_port``."""
        if service.metrics_port:
            try:
                self.metrics_url = self.metrics.serve(service.metrics_host, service.metrics_port)
            except ConfigError:
                self.sock.close(linger=0)
                raise

    # ------------------------------------------------------------------ running
    def serve(self) -> None:
        """Run the loop; returns after ``stop()`` or a signal, with a checkpoint written."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
        if self.service.checkpoint_dir:
            removed = remove_stale_temps(self.service.checkpoint_dir)
            if removed:
                self._event("checkpoint_tmp_removed", paths=[str(p) for p in removed])
                log.info("removed %d temporary file(s) of interrupted checkpoint writes in %s", len(removed),
                         self.service.checkpoint_dir)
        self._event("listening", endpoint=self.endpoint, resumed=self.core is not None, epoch=self.epoch,
                    metrics=self.metrics_url)
        if self.service.ready_file:
            tmp = Path(self.service.ready_file + ".tmp")
            tmp.write_text(self.endpoint, encoding="utf-8")
            tmp.replace(self.service.ready_file)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # No per-peer POLLOUT on a ROUTER: while something waits for room, retry soon.
                timeout = 0.01 if any(box.sendable() for box in self._outboxes.values()) else 0.1
                deadline = self.core.next_deadline() if self.core else None
                if deadline is not None:
                    timeout = min(timeout, max(0.0, deadline - self.clock()))
                if poller.poll(timeout * 1000):
                    # Drain what is queued before ticking, so a burst is one pass.
                    for _ in range(1000):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                self._check_silence()
                self._check_init()
                self._expire_pieces()
                self._summarise_suppressed(self._limiter.expired(self.clock()))
                self._report_progress()
                if self.core is not None:
                    self._drive(Tick())
                for ident in [i for i, box in self._outboxes.items() if box]:
                    self._flush(ident)
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ messages
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident, body = frames[0].bytes, frames[1:]
        msg: wire.Message | None = None
        try:
            joined = ident in self.peers or (self._pending is not None and ident in self._pending.seeders)
            limit = self._message_limit()
            if not joined:
                total = sum(len(f) for f in body)
                bound = min(STRANGER_MAX_BYTES, self.service.max_message_bytes or STRANGER_MAX_BYTES)
                if total > bound:
                    raise wire.WireError(f"message of {total} bytes from a connection that has not joined exceeds "
                                         f"the limit of {bound} bytes before a hello is accepted")
            msg = wire.decode_header(body, wire.SYNCER_RECEIVES, limit or AUTO_ZMQ_CAP)
            if msg.type == "status":  # read-only, names no learner: the Curve handshake is its check
                self._answer_status(ident, msg)
                return
            if self._key_ids is not None and not self._key_allows(ident, body[0], msg):
                return
            if not self.shard.whole and msg.type in _FRAGMENT_MESSAGES:
                self._localize(msg)
            self._handle(ident, msg)
        except wire.WireError as exc:
            self.rejected_messages += 1
            self._peer_event(ident, "bad_message", peer=ident.hex(), reason=str(exc))
            self._reply_error(ident, "bad_message", str(exc))
        except Exception as exc:  # noqa: BLE001 - one message must never end the service for everyone
            # A fault that validation missed: drop this message, keep serving. The state
            # it reached is whatever the handler had done before raising (each handler
            # checks before it changes anything, so that is usually nothing).
            self.rejected_messages += 1
            kind = msg.type if msg is not None else "?"
            lid = str(msg.header.get("learner", "")) if msg is not None else ""
            reason = f"internal error handling a {kind} message: {type(exc).__name__}: {str(exc)[:300]}"
            if self._peer_event(ident, "internal_error", peer=ident.hex(), learner=lid, type=kind, reason=reason):
                log.exception("%s from peer %s (learner %r); message dropped, serving on", reason, ident.hex(), lid)
            self._reply_error(ident, "rejected", reason)
        finally:
            lid = msg.header.get("learner", "") if msg is not None else ""
            stats = self._stats.get(lid)
            nbytes = _nbytes(body)
            if stats is not None:  # only ids that passed a hello: a stranger cannot grow this table
                stats.bytes_in += nbytes
                stats.last_seen = self.clock()
            self.metrics.received(lid if stats is not None else None, nbytes)

    def _localize(self, msg: wire.Message) -> None:
        """A message about one fragment, renumbered to this shard's numbering (the core's);
        one about another shard's fragment is refused, naming the shard that owns it."""
        p = msg.header.get("fragment")
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            return  # malformed: the parser names it
        if not self.shard.owns(p):
            raise wire.WireError(f"fragment {p} belongs to syncer shard {owner_shard(p, self.shard.count)} of "
                                 f"{self.shard.count}; this is shard {self.shard}. Give the learner every shard's "
                                 "endpoint in shard order")
        msg.header["fragment"] = self.shard.local(p)

    def _out(self, upd: Any) -> Any:
        """An update (or averaged moments) of the core, numbered as the model for the wire."""
        return upd if self.shard.whole else dataclasses.replace(upd, fragment=self.shard.to_global(upd.fragment))

    def _pieces(self, hello: wire.Hello) -> RankPieces:
        """What the rank that said ``hello`` owns of this shard's fragments (declared pieces, or
        a plain rank's whole fragments by the owner-rank rule, which counts the model's fragments)."""
        return self.shard.select(_rank_pieces(hello.layout, hello))

    def _declared(self, hello: wire.Hello) -> RankPieces | None:
        """A sharded rack rank's declared pieces of this shard's fragments; None for a plain rank."""
        return None if hello.pieces is None else self.shard.select(hello.pieces)

    def _answer_status(self, ident: bytes, msg: wire.Message) -> None:
        """Read-only: answered from the current state, the asker never becomes a peer
        (each request is not logged: a refreshing view asks every second)."""
        nonce = wire.parse_status_request(msg)
        self.status_requests += 1
        self._send(ident, wire.status_reply_frames(nonce, self.status()), droppable=True)

    def _message_limit(self) -> int | None:
        """The largest message a joined learner may send: the operator's, else the
        layout's (None while no layout is known)."""
        if self.service.max_message_bytes is not None:
            return self.service.max_message_bytes
        layout = self.core.fragments if self.core is not None else self._pending.layout if self._pending else None
        return None if layout is None else layout_message_limit(layout)  # this shard's fragments: all it receives

    def _key_allows(self, ident: bytes, frame: zmq.Frame, msg: wire.Message) -> bool:
        """Whether the Curve key this message came with may speak as the learner it names
        (refused and logged as ``auth_denied`` otherwise)."""
        assert self._key_ids is not None
        key = frame.get("User-Id")  # what the authenticator returned: the client's public key, Z85
        allowed = self._key_ids.get(key, frozenset())
        lid = msg.header["learner"]
        if allowed is None or lid in allowed:
            return True
        self.rejected_messages += 1
        reason = (f"the Curve key {key[:8]}... may speak as {sorted(allowed)} only, not as {lid!r}; give this "
                  f"learner its own key, or list {lid!r} in the key file's 'learners' metadata "
                  "(rackmend keygen --learners)")
        self._peer_event(ident, "auth_denied", peer=ident.hex(), learner=lid, type=msg.type, key=key, reason=reason)
        self._reply_error(ident, "fatal" if msg.type == "hello" else "denied", reason)
        return False

    def _holder(self, ident: bytes, lid: str, rank: int) -> tuple[bytes, _Peer] | None:
        """The other connection that holds learner ``lid``'s rank ``rank``, if any."""
        for other, peer in self.peers.items():
            if other != ident and peer.learner_id == lid and peer.rank == rank:
                return other, peer
        return None

    def _handle(self, ident: bytes, msg: wire.Message) -> None:
        h = msg.header
        lid, rank = h["learner"], h["rank"]
        if msg.type == "hello":
            self._hello(ident, msg)
            return
        if msg.type == "init":
            self._init(ident, msg)
            return
        peer = self.peers.get(ident)
        if peer is None and self._pending is not None and any(i == ident for i, _ in self._pending.waiting):
            return  # its hello is answered once the first learner's initial values are in
        gated = self._gate.get(lid, {}).get(ident)
        if peer is None and gated is not None:
            gated.last_seen = self.clock()
            return  # its hello is answered once every rank of its learner has said hello
        if peer is None and msg.type == "ack":
            return  # a receipt from a peer dropped meanwhile: its next heartbeat gets it back
        if peer is None or peer.learner_id != lid or peer.rank != rank:
            self.rejected_messages += 1
            holder = self._holder(ident, lid, rank)
            if holder is not None:
                # The id is bound to the connection that said hello for it: a contribution,
                # heartbeat or leave naming it from anywhere else is someone else's.
                reason = (f"learner {lid} rank {rank} is held by another connection; a {msg.type} naming it is "
                          "accepted from that connection only")
                self._peer_event(ident, "identity_refused", peer=ident.hex(), learner=lid, rank=rank,
                                 type=msg.type, reason=reason)
                self._reply_error(ident, "rejoin", reason)
                return
            # Unknown to this syncer (it restarted, or the learner was declared silent).
            self._peer_event(ident, "unknown_peer", peer=ident.hex(), learner=lid, type=msg.type)
            self._reply_error(ident, "rejoin", "send hello first")
            return
        peer.last_seen = self.clock()
        if msg.type == "heartbeat":
            return
        if msg.type == "leave":
            del self.peers[ident]
            self._send(ident, wire.encode({"type": "bye"}))  # lets the learner exit knowing it was heard
            if not self._ranks_of(lid):
                self._stats[lid].state = "left"
                self._forget_pieces(lid, "the learner left")
                self._drive(LearnerLeft(lid, "leave"), ident=ident)
            return
        if msg.type == "fetch":
            self._fetch(ident, peer, msg)
            return
        if msg.type == "ack":
            box = self._outboxes.get(ident)
            if box is not None and self.core is not None:
                box.ack(wire.parse_ack(msg, len(self.core.fragments)))
                self._flush(ident)
            return
        if msg.type == "moments":
            self._moments(ident, peer, msg)
            return
        assert msg.type == "contrib" and self.core is not None
        contribution = wire.parse_contribution(msg, self.core.fragments, self._pool)
        self._send(ident, wire.ack_frames(self.shard.to_global(contribution.fragment)), droppable=True)  # received, whatever the core decides
        if contribution.pieces is not None:
            whole = self._assemble(ident, peer, contribution)
            if whole is None:
                return
            contribution = whole
        stats = self._stats[lid]
        p = contribution.fragment
        stats.contributions += 1
        lag = self.core.versions[p] - contribution.base_version  # before the merge it may close
        if any(isinstance(a, Rejected) for a in self._drive(ContributionArrived(contribution))):
            return  # a refused contribution's step time and base say nothing true about the learner
        stats.step, stats.step_time, stats.last_contribution = contribution.step, contribution.step_time, self.clock()
        stats.based[self.shard.to_global(p)] = (contribution.base_version, lag)
        self.metrics.contribution(lid, contribution.step_time, max(lag for _, lag in stats.based.values()))

    def _moments(self, ident: bytes, peer: _Peer, msg: wire.Message) -> None:
        """DES-LOC: a learner's moments, checked on the wire and then by the core."""
        assert self.core is not None
        c = wire.parse_moments(msg, self.core.fragments)
        if not peer.owns(c.fragment):
            raise wire.WireError(f"moments: rank {peer.rank} of {peer.world} does not own fragment {c.fragment}")
        self._drive(MomentsArrived(c))

    def _hello(self, ident: bytes, msg: wire.Message, admitted: bool = False) -> None:
        """``admitted``: a sharded learner's rank whose ranks have all said hello and
        cover every tensor (``_through_gate``)."""
        if not self._may_take(ident, msg.header["learner"], msg.header["rank"]):
            return  # before parsing: a storm of hellos costs a dictionary scan each
        held = self.peers.get(ident)
        if held is not None and (held.learner_id, held.rank) != (msg.header["learner"], msg.header["rank"]):
            # One connection speaks for one learner rank (a link never changes id): else one
            # socket could park any number of ids in every round's membership.
            self.rejected_messages += 1
            reason = (f"this connection holds learner {held.learner_id} rank {held.rank}; a hello as "
                      f"{msg.header['learner']} rank {msg.header['rank']} needs a connection of its own")
            self._peer_event(ident, "identity_refused", peer=ident.hex(), learner=msg.header["learner"],
                             rank=msg.header["rank"], type="hello", reason=reason)
            self._reply_error(ident, "fatal", reason)
            return
        hello = wire.parse_hello(msg)
        lid, rank, layout = hello.learner_id, hello.rank, hello.layout
        worlds = {p.world for i, p in self.peers.items() if i != ident and p.learner_id == lid}
        if worlds and worlds != {hello.world}:
            self.rejected_messages += 1
            reason = (f"learner {lid} is connected with {worlds.pop()} ranks; a hello as its rank {rank} of "
                      f"{hello.world} does not fit (every rank of one learner declares the same world size)")
            self._peer_event(ident, "identity_refused", peer=ident.hex(), learner=lid, rank=rank, type="hello",
                             reason=reason)
            self._reply_error(ident, "busy", reason)
            return
        if not self._settings_agree(ident, hello):
            return
        now = self.clock()
        stats = self._stats.setdefault(lid, _LearnerStats(state="joining", first_seen=now, last_seen=now))
        self._ident_learner[ident] = lid
        if hello.pieces is not None and not admitted:
            for other, gated in self._through_gate(ident, msg, hello):
                self._hello(other, gated, admitted=True)
            return
        if self.core is None:
            pend = self._pending
            if pend is None:
                self._layout = layout
                pend = self._pending = _Pending(self.shard.fragments(layout), {ident: self._declared(hello)}, lid,
                                                hello.settings, self.clock())
                self._event("init_request", learner=lid, fragments=len(pend.layout))
                self._send(ident, wire.encode({"type": "init_request"}))
            elif pend.seeder_id == lid and hello.pieces is not None and ident not in pend.seeders:
                # A sharded seeder: each of its ranks sends the pieces it owns.
                pend.seeders[ident] = self._declared(hello)
                self._send(ident, wire.encode({"type": "init_request"}))
            pend.waiting = [(i, m) for i, m in pend.waiting if i != ident] + [(ident, msg)]
            return
        if self._first is None:  # resumed from a checkpoint that predates recorded settings
            self._first = (lid, hello.settings)
        holder = self._holder(ident, lid, rank)
        if holder is not None:  # silent for takeover_after (checked above): the rank came back elsewhere
            del self.peers[holder[0]]
            self._event("takeover", learner=lid, rank=rank, peer=ident.hex(), previous=holder[0].hex(),
                        silent_s=round(self.clock() - holder[1].last_seen, 3))
        pieces = self._pieces(hello)
        cuts = [None if not ps or is_whole(f, ps) else ps for f, ps in zip(self.core.fragments, pieces)]
        self.peers[ident] = peer = _Peer(lid, rank, hello.world, self.clock(), pieces, cuts)
        stats.state = "connected"
        self.metrics.joined(lid)
        if ident in self._outboxes:
            self._outboxes[ident].forget_inflight()  # a new session: old sends will not be acknowledged
        for action in self.core.handle(LearnerJoined(lid), self.clock()):
            if isinstance(action, Joined):
                # The core knows learners, not ranks: each rank of a multi-rank learner
                # joins, so its join says which. Per connection: a hello storm (ids are
                # first-come without --learners) costs a bounded number of log lines, the
                # rest counted in 'suppressed'.
                if self._limiter.allow(("join", ident), self.clock(), peer=ident.hex()):
                    line = {**action.to_record(), "rank": rank, "world": hello.world}
                    self._say(line, action.level)
                    self._record(line)
            elif isinstance(action, SyncerRecord):
                self._log_record(self.shard.record(action))
        for upd in (f.current for f in self.core.frags):
            if peer.owns(upd.fragment):
                self._send_update(ident, upd, self._update_frames(peer, upd, reset=True), reset=True)

    def _through_gate(self, ident: bytes, msg: wire.Message, hello: wire.Hello) -> list[tuple[bytes, wire.Message]]:
        """Hold a sharded learner's hellos until every one of its ranks has said hello
        (or is connected already), then check that the pieces they own cover every
        element of every tensor exactly once. Returns the hellos to admit now: none while
        ranks are missing or when the cover is wrong. Where the pieces of ranks still
        connected (perhaps the learner's previous run) take part in a wrong cover, it
        waits for those ranks to say hello again; where only new hellos do, every rank of
        the learner is refused (``settings_refused`` with setting ``pieces``)."""
        lid, now = hello.learner_id, self.clock()
        gate = self._gate.setdefault(lid, {})
        for other in [i for i, g in gate.items() if i != ident and g.hello.rank == hello.rank]:
            del gate[other]  # the rank said hello again from another connection: the newer one counts
        gate[ident] = _Gated(msg, hello, now)
        ranks: dict[int, RankPieces] = {g.hello.rank: self._pieces(g.hello) for g in gate.values()}
        connected = {p.rank: p.pieces for p in self.peers.values() if p.learner_id == lid and p.rank not in ranks}
        ranks.update(connected)
        if len(ranks) < hello.world:
            self._event("gate", learner=lid, rank=hello.rank, ranks=sorted(ranks), world=hello.world)
            return []
        problem = cover_problem(self.shard.fragments(hello.layout), [ranks[r] for r in range(hello.world)])
        if problem is not None and connected:
            # Ranks still connected may belong to the learner's previous run (killed, not
            # yet timed out), which a relaunch sharded another way replaces as its ranks say
            # hello: wait for their hellos rather than refuse the new run for pieces its
            # predecessor declared. A new hello of every rank is then checked by itself.
            reason = f"with the pieces ranks {sorted(connected)} declared when they connected: {problem}"
            self._event("gate", learner=lid, rank=hello.rank, ranks=sorted(r for r in ranks if r not in connected),
                        world=hello.world, waiting_for=sorted(connected), reason=reason)
            log.info("learner %s: rank %d waits for ranks %s to say hello again (a relaunch sharded another way?) "
                     "before its pieces are checked; %s", lid, hello.rank, sorted(connected), reason)
            return []
        if problem is not None:
            reason = (f"learner {lid}'s ranks do not share its tensors out exactly: {problem}. Each rank must "
                      "declare the blocks it holds of each DTensor (rackmend.learner.pieces does this from the "
                      "placements); are all ranks running the same model and sharding?")
            self._peer_event(ident, "settings_refused", learner=lid, rank=hello.rank, setting="pieces",
                             learner_value=None, syncer_value=None, reason=reason)
            log.warning("refused learner %s: %s", lid, reason)
            # Every rank is in the gate (no other rank is connected); a rank that said hello
            # again on its connection is a peer too, and goes.
            was_peer = [i for i in gate if self.peers.pop(i, None) is not None]
            for i in gate:
                self._reply_error(i, "fatal", reason)
            del self._gate[lid]
            if was_peer and self.core is not None and not any(p.learner_id == lid for p in self.peers.values()):
                self._drive(LearnerLeft(lid, "refused"))
            return []
        del self._gate[lid]
        self._learner_pieces[lid] = ranks
        return [(i, g.msg) for i, g in sorted(gate.items(), key=lambda kv: kv[1].hello.rank)]

    def _update_frames(self, peer: _Peer, upd: Any, reset: bool = False, full: bool = False) -> list[Any]:
        """An update as ``peer`` receives it: its pieces only, or the whole fragment."""
        return wire.update_frames(self._out(upd), reset=reset, full=full, pieces=peer.cuts[upd.fragment],
                                  syncer=SyncerSettings.from_config(self.config))

    def _assemble(self, ident: bytes, peer: _Peer, c: Any) -> Any:
        """A rank's pieces of a contribution; the learner's whole contribution once every
        rank owning a piece of the fragment has sent its piece of that step, else None."""
        assert self.core is not None
        p = c.fragment
        if c.pieces != peer.pieces[p]:
            self.rejected_messages += 1
            reason = (f"learner {c.learner_id} rank {c.rank} sent pieces {list(c.pieces)[:4]} of fragment {p}, "
                      f"but declared {list(peer.pieces[p])[:4]} at hello")
            self._peer_event(ident, "bad_message", peer=ident.hex(), reason=reason)
            self._reply_error(ident, "rejected", reason)
            return None
        if self._assembler is None:
            self._assembler = Assembler(self.core.fragments)
        owners = self._learner_pieces.get(c.learner_id, {})
        expected = frozenset(r for r, ps in owners.items() if ps[p])
        whole, records = self._assembler.add(c, expected, self.clock())
        self._assembly_records(records)
        return whole

    def _assembly_records(self, records: list[Incomplete] | list[Incomplete | PieceDropped]) -> None:
        for record in map(self.shard.record, records):
            self.metrics.record(record)  # an incomplete contribution counts as rejected
            self._log_record(record)

    def _expire_pieces(self) -> None:
        """Drop partial contributions that waited too long for a rank, and hellos of
        ranks that went silent at the gate."""
        now, bound = self.clock(), self.service.heartbeat_timeout
        if self._assembler is not None:
            self._assembly_records(self._assembler.expire(now, bound))
        for lid, gate in list(self._gate.items()):
            for ident in [i for i, g in gate.items() if now - g.last_seen > bound]:
                del gate[ident]
            if not gate:
                del self._gate[lid]

    def _may_take(self, ident: bytes, lid: str, rank: int) -> bool:
        """Whether a hello from ``ident`` may claim ``lid``'s rank ``rank``: nobody else
        holds it, or its holder has been silent for ``takeover_after``."""
        holder = self._holder(ident, lid, rank)
        if holder is None:
            return True
        silent = self.clock() - holder[1].last_seen
        if silent >= self.service.takeover_after:
            return True
        self.rejected_messages += 1
        reason = (f"learner {lid} rank {rank} is live on another connection (heard {silent:.1f}s ago); a new "
                  f"connection takes it over only after {self.service.takeover_after:g}s of silence "
                  "(--takeover-after). Two learners with one id? Give each its own --id")
        self._peer_event(ident, "identity_refused", peer=ident.hex(), learner=lid, rank=rank, type="hello",
                         reason=reason)
        self._reply_error(ident, "busy", reason)
        return False

    def _settings_agree(self, ident: bytes, hello: wire.Hello) -> bool:
        """Refuse (``fatal``, logged) a learner whose settings or layout cannot work with
        this run; note once per learner an uplink codec other than the syncer's."""
        lid, s = hello.learner_id, hello.settings
        roster = self.config.syncer.learners
        if roster and lid not in roster:
            # --learners is also the list of ids that may join: an id outside it is a typo
            # or a stranger, and either would otherwise take part in every round.
            mismatch: Mismatch | None = Mismatch("learner_id", lid, list(roster), (
                f"learner id {lid!r} is not in the syncer's --learners list {list(roster)}; start the learner "
                "with one of those ids, or add it to --learners"))
        else:
            mismatch = syncer_mismatch(lid, s, self.config)
        first = self._first or ((self._pending.seeder_id, self._pending.settings) if self._pending else None)
        if mismatch is None and first is not None:
            mismatch = peer_mismatch(lid, s, *first)
        layout = self._layout
        difference = layout_difference(layout, hello.layout) if mismatch is None and layout is not None else None
        if difference is not None:
            mismatch = Mismatch("layout", fingerprint(hello.layout), fingerprint(layout), (
                f"parameter layout differs: learner {lid} has {difference}. Its tensors (names, shapes, dtypes) or "
                "how they are split (ScheduleConfig sync_every, num_fragments, packing, sync_buffers) differ from "
                "the model this syncer trains. Start it from the same model definition and config, or start a "
                "fresh syncer (without --resume) for a new model"))
        needed = layout_message_limit(self.shard.fragments(hello.layout))
        if mismatch is None and layout is None and self.service.max_message_bytes is None and needed > self._zmq_cap:
            # The first learner sets the model. ZeroMQ's cap, fixed at the bind before the model
            # was known, would cut its larger messages off unread: it would retry for ever.
            mb = math.ceil(needed / 2**20)
            mismatch = Mismatch("message_limit", needed, self._zmq_cap, (
                f"learner {lid}'s largest fragment needs messages of up to {mb} MiB; this syncer was started "
                f"without knowing the model's size and reads at most {self._zmq_cap >> 20} MiB per message. "
                f"Restart it with --max-message-mb {mb}, or split the model into more fragments "
                "(ScheduleConfig.num_fragments)"))
        if mismatch is None and hello.shard != self.shard:
            mismatch = Mismatch("shard", str(hello.shard), str(self.shard), (
                f"learner {lid} sent this syncer the hello meant for syncer shard {hello.shard}, but it is shard "
                f"{self.shard}. " + ("Give the learner every shard's endpoint, in shard order (shard 0 first)"
                                    if not self.shard.whole or not hello.shard.whole else "")))
        if mismatch is None and not self.shard.fragments(hello.layout):
            mismatch = Mismatch("shard", len(hello.layout), str(self.shard), (
                f"syncer shard {self.shard} owns no fragment of a model of {len(hello.layout)} fragments; run at "
                f"most {len(hello.layout)} shards (ScheduleConfig.num_fragments)"))
        problem = pieces_problem(hello.layout, hello.pieces) if mismatch is None and hello.pieces is not None else None
        if problem is not None:
            mismatch = Mismatch("pieces", None, None, (
                f"learner {lid} rank {hello.rank} declares pieces that cannot be: {problem}. Each rank declares the "
                "blocks it owns of each tensor, inside the tensor's global shape"))
        if mismatch is not None:
            self._peer_event(ident, "settings_refused", learner=lid, rank=hello.rank, setting=mismatch.setting,
                        learner_value=mismatch.learner_value, syncer_value=mismatch.other_value,
                        reason=mismatch.reason)
            log.warning("refused learner %s: %s", lid, mismatch.reason)
            self._reply_error(ident, "fatal", mismatch.reason)
            return False
        syncer_uplink = self.config.compression.uplink
        if lid not in self._uplink_noted and not same_codec(s.uplink, syncer_uplink):
            # Allowed (each message names its codec), but worth a line: the two may be meant to agree.
            self._uplink_noted.add(lid)
            self._event("uplink_codec_differs", learner=lid, learner_codec=s.uplink, syncer_codec=syncer_uplink)
            log.info("learner %s sends uplink codec %r; this syncer was started with --uplink-codec %r "
                     "(accepted: messages name their codec)", lid, s.uplink, syncer_uplink)
        return True

    def _check_init(self) -> None:
        """Pass the seeding role on when the seeder stopped delivering initial values:
        otherwise a learner that died between hello and init blocks the syncer forever."""
        pend = self._pending
        if pend is None or self.clock() - pend.asked_at <= self.service.init_timeout:
            return
        others = [(i, m) for i, m in pend.waiting if i not in pend.seeders]
        nxt = others[0][1].header["learner"] if others else None
        self._event("init_timeout", learner=pend.seeder_id, seconds=round(self.clock() - pend.asked_at, 3),
                    received=len(pend.values), next=nxt)
        log.warning("learner %s sent no initial value for %.0fs (--init-timeout); %s", pend.seeder_id,
                    self.clock() - pend.asked_at,
                    f"asking {nxt} instead" if nxt else "the next learner to join will be asked")
        if not others:
            self._pending = None
            return
        hello = wire.parse_hello(others[0][1])
        # A plain learner's first connection seeds alone; a sharded learner's ranks all do.
        seeders = {i: self._declared(h) for i, h in ((i, wire.parse_hello(m)) for i, m in others)
                   if h.learner_id == hello.learner_id and (i == others[0][0] or h.pieces is not None)}
        self._pending = _Pending(pend.layout, seeders, hello.learner_id, hello.settings, self.clock(), waiting=others)
        self._event("init_request", learner=hello.learner_id, fragments=len(pend.layout), replaces=pend.seeder_id)
        for ident in seeders:
            self._send(ident, wire.encode({"type": "init_request"}))

    def _fetch(self, ident: bytes, peer: _Peer, msg: wire.Message) -> None:
        """A learner lost a delta update: answer with the full current value (codec 0,
        not a reset, so it is applied like any merged value)."""
        assert self.core is not None
        p = msg.header.get("fragment")
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < len(self.core.fragments):
            raise wire.WireError(f"fetch for unknown fragment {str(p)[:20]}")
        if not peer.owns(p):
            raise wire.WireError(f"fetch: rank {peer.rank} of {peer.world} does not own fragment {p}")
        upd = self.core.frags[p].current
        self._event("fetch", learner=peer.learner_id, rank=peer.rank, fragment=self.shard.to_global(p),
                    version=upd.version)
        self._send_update(ident, upd, self._update_frames(peer, upd, full=True))

    def _init(self, ident: bytes, msg: wire.Message) -> None:
        pend = self._pending
        if self.core is not None or pend is None or ident not in pend.seeders:
            return  # late, unasked-for, or from a seeder replaced after init_timeout
        p = msg.header.get("fragment")
        if not isinstance(p, int) or not 0 <= p < len(pend.layout):
            raise wire.WireError(f"init for unknown fragment {p!r}")
        owned = pend.seeders[ident]
        if owned is None:
            tensors = wire.parse_tensors(msg, pend.layout[p])
            pend.values[p] = tuple(t.clone() for t in tensors)
        else:
            pieces, tensors, encoded = wire.parse_pieces(msg, pend.layout, p)
            if (pieces if pieces is not None else whole_pieces(pend.layout, 0, 1)[p]) != owned[p] or encoded:
                raise wire.WireError(f"init of fragment {p} carries other pieces than the rank declared at hello")
            parts = pend.parts.setdefault(p, {})
            parts[ident] = (owned[p], tuple(t.clone() for t in tensors))
            if set(parts) >= {i for i, ps in pend.seeders.items() if ps is not None and ps[p]}:
                pend.values[p] = assemble(pend.layout[p], list(parts.values()))
        pend.asked_at = self.clock()  # progress: a slow upload of a large model is not a dead seeder
        if len(pend.values) == len(pend.layout):
            try:
                self._start_core(pend.layout, [list(pend.values[p]) for p in range(len(pend.layout))], pend.settings)
            except ConfigError as exc:  # e.g. a lossy downlink codec for a bfloat16 model
                self._pending = None
                for waiting_ident, _ in pend.waiting:
                    self._send(waiting_ident, wire.encode({"type": "error", "code": "fatal", "reason": str(exc)}))
                raise wire.WireError(f"cannot start on this model: {exc}") from None
            self._event("initialised", learner=msg.header["learner"])
            self._first = (pend.seeder_id, pend.settings)
            self._pending = None
            for waiting_ident, hello in pend.waiting:
                self._hello(waiting_ident, hello)

    # ------------------------------------------------------------------ core driving
    def _start_core(self, layout: list[FragmentSpec], values: list[list[torch.Tensor]],
                    settings: LearnerSettings | None) -> None:
        """The core, with the run's H, P, tau and apply rule taken from the learner that
        set them (the syncer has no value of its own for H, P and the apply rule, and
        its grace window depends on them)."""
        run = self.config
        schedule, learner = run.schedule, LearnerConfig()
        if settings is not None:
            schedule = ScheduleConfig(sync_every=settings.sync_every, num_fragments=settings.num_fragments,
                                      overlap=run.schedule.overlap, desloc=settings.desloc,
                                      desloc_ku=settings.desloc_ku or None, desloc_kv=settings.desloc_kv or None)
            learner = LearnerConfig(apply=settings.apply)
        config = RackmendConfig(schedule=schedule, syncer=run.syncer, compression=run.compression,
                                deterministic=run.deterministic, learner=learner)
        self.core = SyncerCore(config, layout, values, epoch=self.epoch, pool=self._pool)
        self._versions_to_metrics()
        if self.service.max_message_bytes is None:
            limit = layout_message_limit(layout)
            # ZeroMQ's pre-read cap was fixed at the bind, before this layout was known.
            self._event("message_limit", bytes=limit, max_message_mb=math.ceil(limit / 2**20),
                        zmq_cap=2 * limit if self.service.resume else AUTO_ZMQ_CAP)

    def _drive(self, event: Event, ident: bytes | None = None) -> list[Action]:
        """Feed ``event`` to the core and carry out its actions; returns them (records in
        the core's fragment numbering). ``ident``: the connection whose message caused
        it, whose ``leave`` records are rate-limited per connection."""
        assert self.core is not None
        t0 = self.clock()
        merged: list[int] = []
        if isinstance(event, LearnerLeft):
            self.metrics.left(event.learner_id)
        actions = self.core.handle(event, t0)
        for action in actions:
            if isinstance(action, SendUpdate):
                frames = None  # shared by every peer that receives the whole fragment
                for ident, peer in self.peers.items():
                    if peer.learner_id in action.to and peer.owns(action.update.fragment):
                        if peer.cuts[action.update.fragment] is not None:
                            mine = self._update_frames(peer, action.update, reset=action.reset)
                        else:
                            mine = frames = frames or wire.update_frames(
                                self._out(action.update), reset=action.reset,
                                syncer=SyncerSettings.from_config(self.config))
                        self._send_update(ident, action.update, mine, reset=action.reset)
            elif isinstance(action, SyncerRecord):
                record = self.shard.record(action)  # the model's fragment numbers from here on
                self.metrics.record(record)  # before the log's rate limit: metrics count every one
                if isinstance(record, Rejected):
                    logged = self._limiter.allow(("reject", record.learner), t0, learner=record.learner)
                elif isinstance(record, Left) and ident is not None:
                    logged = self._limiter.allow(("leave", ident), t0, peer=ident.hex())
                else:
                    logged = True
                if logged:
                    self._log_record(record)
                if isinstance(record, Rejected):
                    if record.learner in self._stats:
                        self._stats[record.learner].rejected += 1
                    reason = f"contribution rejected: {record.reason}"
                    for rank_ident in self._ranks_of(record.learner):
                        self._reply_error(rank_ident, "rejected", reason)
                elif isinstance(record, Merged):
                    assert isinstance(action, Merged)
                    merged.append(action.fragment)  # the core's numbering: it is told the sync time
                    self._last_merge[record.fragment] = {
                        "t": record.t, "version": record.version, "merged": list(record.merged)}
                    self._progress.merges += 1
                    self._progress.learners.update(record.merged)
            elif isinstance(action, SendMomentUpdate):
                frames = None
                for ident, peer in self.peers.items():
                    if peer.learner_id in action.to and peer.owns(action.update.fragment):
                        frames = frames or wire.moments_update_frames(self._out(action.update))
                        self._send(ident, list(frames))
            elif isinstance(action, AdviseLearner):
                self.metrics.failslow(action)
                frames = wire.fail_slow_frames(action.report)
                for ident in self._ranks_of(action.report.learner):  # every rank: any may act on it
                    self._send(ident, list(frames))
            elif isinstance(action, (FailSlowBlip, StopExpecting, MarkForEviction, RestoreLearner)):
                self.metrics.failslow(action)  # the core applied it to membership already
        if merged:
            seconds = (self.clock() - t0) / len(merged)
            self.metrics.merge_compute([seconds] * len(merged))
            for p in merged:
                self.core.handle(SyncTimed(p, seconds), self.clock())
            before = self.merges // self.service.checkpoint_every
            self.merges += len(merged)
            if self.merges // self.service.checkpoint_every > before:
                self.checkpoint()
        return actions

    def _versions_to_metrics(self) -> None:
        assert self.core is not None
        self.metrics.versions({self.shard.to_global(p): v for p, v in enumerate(self.core.versions)})

    def _forget_pieces(self, lid: str, reason: str) -> None:
        if self._assembler is not None:
            self._assembly_records(self._assembler.forget(lid, self.clock(), reason))

    def _ranks_of(self, lid: str) -> list[bytes]:
        return [i for i, p in self.peers.items() if p.learner_id == lid]

    def _check_silence(self) -> None:
        now = self.clock()
        for ident, peer in list(self.peers.items()):
            if now - peer.last_seen > self.service.heartbeat_timeout:
                del self.peers[ident]
                self._event("silent", learner=peer.learner_id, rank=peer.rank,
                            seconds=round(now - peer.last_seen, 3))
                if not self._ranks_of(peer.learner_id):
                    if peer.learner_id in self._stats:
                        self._stats[peer.learner_id].state = "silent"
                    if self.core is not None:
                        self._forget_pieces(peer.learner_id, "every rank of the learner went silent")
                        self._drive(LearnerLeft(peer.learner_id, "silent"))

    def _send(self, ident: bytes, frames: list[Any], *, droppable: bool = False) -> None:
        """A control message (error, bye, init_request): queued in order, never replaced.
        ``droppable`` (errors, receipts): dropped, and counted, when the connection
        already has ``MAX_QUEUED_REPLIES`` waiting (it reads none of them)."""
        box = self._outboxes.setdefault(ident, Outbox())
        if droppable and box.control_pending >= MAX_QUEUED_REPLIES:
            self.replies_dropped += 1
            return
        box.add_control(frames)
        self.queued_replies_max = max(self.queued_replies_max, box.control_pending)
        self._flush(ident)

    def _reply_error(self, ident: bytes, code: str, reason: str) -> None:
        self._send(ident, wire.encode({"type": "error", "code": code, "reason": reason}), droppable=True)

    def _peer_event(self, ident: bytes, event: str, **fields: Any) -> bool:
        """A record of bad input from one connection, rate-limited per connection and kind
        (counted in the metrics, by ``event``, whether logged or not). Whether it was logged."""
        self.metrics.refusal(event)
        if self._limiter.allow((event, ident), self.clock(), peer=ident.hex()):
            self._event(event, **fields)
            return True
        return False

    def _auth_denied(self, text: str) -> None:
        """A refused Curve handshake, from the authenticator's thread. A client with an
        unknown key retries every reconnect interval, and a stranger can mint keys at
        will, so refusals share one rate limit, with a count of those left out (all are
        counted in the metrics)."""
        self.metrics.refusal("auth_denied")
        if self._limiter.allow(("auth_denied",), self.clock()):
            self._event("auth_denied", reason=text)

    def _summarise_suppressed(self, expired: list[tuple[Any, int, dict[str, Any]]]) -> None:
        for key, count, fields in expired:
            self._event("suppressed", of=key[0], count=count, window_s=LOG_WINDOW_S, **fields)

    def _send_update(self, ident: bytes, upd: Any, frames: list[Any], reset: bool = False) -> None:
        """A fragment's new value; replaces one of the same fragment still waiting. The
        replacement goes as a full value (a delta would skip the one never sent), and
        keeps the reset flag of a join answer it replaces."""
        box = self._outboxes.setdefault(ident, Outbox())
        waiting = box.tag(upd.fragment)
        if waiting is not None:
            reset = reset or waiting == "reset"
            peer = self.peers.get(ident)
            frames = (self._update_frames(peer, upd, reset=reset, full=True) if peer is not None
                      else wire.update_frames(self._out(upd), reset=reset, full=True,
                                              syncer=SyncerSettings.from_config(self.config)))
            self.superseded_updates += 1
        box.add_latest(upd.fragment, frames, "reset" if reset else "")
        self._flush(ident)

    def _flush(self, ident: bytes) -> None:
        box = self._outboxes.get(ident)
        if box is None:
            return
        lid = self._ident_learner.get(ident, "")
        stats = self._stats.get(lid)

        def send(frames: list[Any]) -> None:
            self.sock.send_multipart([ident, *frames], copy=False, flags=zmq.NOBLOCK)
            nbytes = _nbytes(frames)
            if stats is not None:
                stats.bytes_out += nbytes
            self.metrics.sent(lid if stats is not None else None, nbytes)

        try:
            done = box.flush(send)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; its messages have nowhere to go
            self._event("send_dropped", peer=ident.hex(), reason=exc.strerror)
            del self._outboxes[ident]
            return
        if done and ident not in self.peers:  # gone: nothing it has not acknowledged matters now
            del self._outboxes[ident]
            if not any(i == ident for i, _ in (self._pending.waiting if self._pending else ())):
                self._ident_learner.pop(ident, None)

    # ------------------------------------------------------------------ state
    def checkpoint(self) -> Path | None:
        if self.core is None or not self.service.checkpoint_dir:
            return None
        tensors, meta = self.core.state_dict()
        assert self._layout is not None
        # The model's whole layout and this shard's place in it: ``theta/{p}/...`` count the
        # shard's fragments from 0 (``Shard.fragments``); export and resume map them back.
        meta = {**meta, "layout": layout_to_wire(self._layout), "shard": str(self.shard), "merges": self.merges,
                "rejected_messages": self.rejected_messages}
        if self._first is not None:
            meta["first_learner"] = {"learner": self._first[0], "settings": self._first[1].to_wire()}
        path = save_checkpoint(self.service.checkpoint_dir, tensors, meta)
        self._checkpoint_at = self.clock()
        self.metrics.checkpointed(self._checkpoint_at)
        self._event("checkpoint", path=str(path), versions=list(self.core.versions), **self._shard_field())
        return path

    def status(self) -> dict[str, Any]:
        """What ``rackmend status`` shows: the syncer, every fragment's round and every
        learner seen (or expected), as plain values. Ages and durations in seconds."""
        now = self.clock()
        core = self.core

        def age(t: float | None) -> float | None:
            return None if t is None else round(now - t, 3)

        syncer: dict[str, Any] = {
            "endpoint": self.endpoint,
            "shard": str(self.shard),
            "state": "running" if core is not None else "initialising" if self._pending else "waiting for a learner",
            "uptime_s": age(self.started_at),
            "protocol": wire.PROTOCOL_VERSION,
            "merges": self.merges,
            "rejected_messages": self.rejected_messages,
            "rejected_contributions": core.rejected if core is not None else 0,
            "superseded_updates": self.superseded_updates,
            "deterministic": self.config.deterministic,
            "min_quorum": self.config.syncer.min_quorum,
            "grace_s": round(core.grace(), 4) if core is not None else None,
            "curve": bool(self.service.secret_key_file),
            "checkpoint_age_s": age(self._checkpoint_at),
            "metrics": self.metrics_url,
            "status_requests": self.status_requests,
        }
        fragments: list[dict[str, Any]] = []
        for p, spec in enumerate(core.fragments if core is not None else ()):
            assert core is not None
            frag, last = core.frags[p], self._last_merge.get(self.shard.to_global(p))
            rnd, clock = frag.round, frag.round.clock
            fragments.append({
                "fragment": self.shard.to_global(p),
                "version": frag.version,
                "tensors": len(spec.tensors),
                "bytes": spec.nbytes,
                "phase": clock.phase.value,
                "waiting": sorted(rnd.pending),
                "fresh": sorted(lid for lid, c in rnd.pending.items() if c.base_version == frag.version),
                "round_age_s": age(clock.first_arrival),
                "grace_left_s": None if clock.deadline is None else round(clock.deadline - now, 3),
                "last_merge_age_s": age(last["t"]) if last else None,
                "last_merged": last["merged"] if last else [],
            })
        learners: list[dict[str, Any]] = []
        members = core.members if core is not None else {}
        for lid in sorted(set(self._stats) | set(members) | set(self.config.syncer.learners)):
            st = self._stats.get(lid)
            ranks = sorted(peer.rank for peer in self.peers.values() if peer.learner_id == lid)
            worlds = {peer.world for peer in self.peers.values() if peer.learner_id == lid}
            member = members.get(lid)
            learners.append({
                "id": lid,
                "state": st.state if st is not None else "never joined",
                "ranks": ranks,
                "world": max(worlds) if worlds else None,
                "expected": bool(member.expected) if member is not None else lid in self.config.syncer.learners,
                "last_seen_s": age(st.last_seen) if st else None,
                "step": st.step if st else None,
                "step_time_s": st.step_time if st else None,
                "last_contribution_s": age(st.last_contribution) if st else None,
                "contributions": st.contributions if st else 0,
                "rejected": st.rejected if st else 0,
                "version_lag": max((lag for _, lag in st.based.values()), default=None) if st else None,
                "based_on": [{"fragment": p, "base_version": b, "lag": lag} for p, (b, lag) in sorted(st.based.items())]
                if st else [],
                "bytes_in": st.bytes_in if st else 0,
                "bytes_out": st.bytes_out if st else 0,
            })
        return {"syncer": syncer, "fragments": fragments, "learners": learners}

    def _resume(self) -> None:
        loaded = load_checkpoint(self.service.checkpoint_dir or "")
        if loaded is None:
            raise ConfigError(f"resume: no checkpoint in {self.service.checkpoint_dir}")
        tensors, meta = loaded
        saved = parse_shard(meta.get("shard", "0/1"))  # checkpoints written before shards: the whole model
        if saved != self.shard:
            raise ConfigError(f"resume: the checkpoint in {self.service.checkpoint_dir} is syncer shard {saved}'s, "
                              f"this syncer is --shard {self.shard}; give each shard its own --checkpoint-dir and "
                              "resume it with the --shard it was started with")
        self._layout = layout_from_wire(meta["layout"])
        layout = self.shard.fragments(self._layout)
        try:
            values = global_values(tensors, layout)
        except ValueError as exc:
            raise ConfigError(f"resume: the checkpoint in {self.service.checkpoint_dir}: {exc}") from None
        first = meta.get("first_learner")
        if first is not None:
            self._first = (first["learner"], LearnerSettings(**first["settings"]))
        self._start_core(layout, values, None if self._first is None else self._first[1])
        assert self.core is not None
        self.core.load_state_dict(tensors, meta)
        self._versions_to_metrics()
        self.merges = int(meta.get("merges", 0))
        self.rejected_messages = int(meta.get("rejected_messages", 0))
        self._event("resumed", versions=list(self.core.versions), **self._shard_field())

    def _setup_curve(self) -> None:
        s = self.service
        if not s.secret_key_file:
            return
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(s.secret_key_file)
        if secret is None:
            raise ConfigError(f"{s.secret_key_file} holds no secret key; pass the .key_secret file")
        self._auth = ThreadAuthenticator(self._ctx, log=_AuthLog(self._auth_denied))  # type: ignore[arg-type]
        self._auth.start()
        if s.allowed_keys_dir:
            self._key_ids = load_key_ids(s.allowed_keys_dir)
            self._auth.configure_curve(domain="*", location=s.allowed_keys_dir)
        else:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        self.sock.curve_server = True
        self.sock.curve_publickey = public
        self.sock.curve_secretkey = secret

    def _shutdown(self) -> None:
        try:
            if self.core is not None:
                # Before the checkpoint, so contributions that were sent (and acknowledged)
                # are in the saved value rather than dropped with the process.
                self._drive(FinalMerge())
                for ident in [i for i, box in self._outboxes.items() if box]:
                    self._flush(ident)
            self.checkpoint()
        finally:
            self._summarise_suppressed(self._limiter.flush())
            self._event("stopped", merges=self.merges, rejected_messages=self.rejected_messages,
                        replies_dropped=self.replies_dropped, log_suppressed=self._limiter.suppressed_total,
                        queued_replies_max=self.queued_replies_max)
            self.sock.close(linger=500)
            self.metrics.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._auth is not None:
                self._auth.stop()
            with self._log_lock:
                if self._log_file:
                    self._log_file.close()
                    self._log_file = None

    def _shard_field(self) -> dict[str, str]:
        """For records that list every fragment's version: which fragments (a shard's, from 0)."""
        return {} if self.shard.whole else {"shard": str(self.shard)}

    def _event(self, event: str, **fields: Any) -> None:
        """One of the service's own records (the core's are ``SyncerRecord``s)."""
        record = {"event": event, "t": self.clock(), **fields}
        self._say(record, *_SERVICE_LOG.get(event, (logging.NOTSET, "")))
        self._record(record)

    def _log_record(self, record: SyncerRecord) -> None:
        """One of the core's records (its fragment already in the model's numbering)."""
        line = record.to_record()
        self._say(line, record.level)
        self._record(line)

    def _report_progress(self) -> None:
        """The progress line at INFO every ``progress_every`` seconds (see there)."""
        every, now, pr = self.service.progress_every, self.clock(), self._progress
        if not every or now - pr.at < every:
            return
        if pr.merges:
            versions = ", ".join(f"{p}: v{m['version']}" for p, m in sorted(self._last_merge.items()))
            log.info("progress: %d merges in the last %.1f s (latest versions %s); learners merged: %s", pr.merges,
                     now - pr.at, versions, ", ".join(sorted(pr.learners)))
        elif self.peers:
            connected = sorted({p.learner_id for p in self.peers.values()})
            log.info("progress: no merge in the last %.1f s; connected: %s", now - pr.at, ", ".join(connected))
        self._progress = _Progress(at=now)

    @staticmethod
    def _say(record: dict, level: int, prefix: str = "") -> None:
        """Log ``record`` to the Python log at ``level``: WARNING and above as ``prefix``
        and its reason sentence, INFO as the whole record, lower levels not (the JSONL
        log, ``_record``, has every record)."""
        if level >= logging.WARNING:
            log.warning("%s%s", prefix, record.get("reason", record))
        elif level >= logging.INFO:
            log.info("%s", record)

    def _record(self, record: dict) -> None:
        """Write ``record`` to the JSONL log (tests wrap this to watch the log)."""
        with self._log_lock:
            if self._log_file:
                self._log_file.write(json.dumps(record) + "\n")
                self._log_file.flush()
