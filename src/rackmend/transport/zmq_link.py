"""A learner's link to a ``rackmend syncer`` over ZeroMQ (one DEALER per learner rank).

An I/O thread owns the DEALER socket: it sends what the learner queues (over an
inproc pipe, without copying tensor bytes; ``RackmendOptimizer`` queues from its send
thread, one thread at a time uses the pipe), sends heartbeats, answers the syncer's
requests (initial values, rejoin after a syncer restart) and checks every update
against the layout before the training thread sees it. ZeroMQ reconnects on its own,
so a syncer that goes away and comes back needs nothing from the caller.

With a lossy downlink codec the syncer sends each merge as an encoded change from
the previous version. The I/O thread keeps, per fragment, the latest full value and
version it received (first from the join's reset updates) and rebuilds the new value
as held + decode(change), the same sum the syncer computed, so the training thread
only ever sees full values equal to the syncer's bit for bit. A change whose base is
not the held version means one was lost: the thread asks for the full value
(``fetch``) and delivers nothing for that fragment until it arrives.

DES-LOC's moments and averaged moments travel as control messages: in order, never
replaced by a newer one and not acknowledged (they leave every K_u or K_v steps, far
less often than parameter sends).
"""

from __future__ import annotations

import logging
import dataclasses
import math
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution, MomentContribution, Update
from rackmend.core.pieces import Piece, RankPieces, whole_pieces, wire_pieces
from rackmend.core.settings import RunRules, SyncerSettings
from rackmend.core.shards import Shard
from rackmend.transport import wire
from rackmend.transport.base import QueueLink, TransportError
from rackmend.transport.outbox import SHORT_HWM, Outbox
from rackmend.transport.tokens import TokenFile, default_token_dir

__all__ = ["ZmqLink", "CurveClientKeys"]

log = logging.getLogger("rackmend.link")

# Every message the syncer gets from a learner it does not know (each heartbeat, say)
# is answered with a rejoin request; one hello per this many seconds answers them all.
# Each hello makes the syncer send the whole model, so a hello per request would flood
# a slow link with copies of the model.
_HELLO_BACKOFF_S = 3.0

FETCH_RETRY_S = 2.0
"""Seconds after which an unanswered ``fetch`` is sent again (messages can be dropped
while the syncer is unreachable)."""


_MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
              | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class _Connection:
    """The link's connection as its socket monitor reports it, in words."""

    def __init__(self) -> None:
        self.state = "not connected yet"
        self.since = time.monotonic()
        self.retries = 0
        self.handshakes_failed = 0
        self.connects = 0
        """TCP connections made (each retried attempt that got as far counts)."""
        self.drops = 0
        """Connections dropped after TCP connected."""

    def note(self, event: int, now: float) -> None:
        if event == zmq.EVENT_CONNECT_RETRIED:
            self.retries += 1
            if self.state != "up":
                self.state = "connection refused or unreachable, retrying"
            return
        if event & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            self.handshakes_failed += 1
        self.connects += event == zmq.EVENT_CONNECTED
        self.drops += event == zmq.EVENT_DISCONNECTED
        self.state = {zmq.EVENT_CONNECTED: "TCP connected, ZeroMQ handshake pending",
                      zmq.EVENT_HANDSHAKE_SUCCEEDED: "up",
                      zmq.EVENT_DISCONNECTED: "disconnected, reconnecting",
                      zmq.EVENT_CLOSED: "closed"}.get(event, "handshake failed (Curve keys or protocol)")
        self.since = now

    def describe(self, now: float) -> str:
        extra = [f"{self.retries} connection attempt(s) retried"] if self.retries else []
        if self.connects:
            extra.append(f"{self.connects} TCP connection(s) made, {self.drops} dropped")
        if self.handshakes_failed:
            extra.append(f"{self.handshakes_failed} handshake(s) failed")
        return (f"connection: {self.state} for {now - self.since:.0f}s"
                + (f" ({', '.join(extra)})" if extra else ""))


def new_session() -> int:
    """A session number for a new link: microseconds since the epoch, then 8 random bits
    (links started within one microsecond differ). Below 2**63 until the year 2262."""
    return (time.time_ns() // 1000) << 8 | secrets.randbits(8)


@dataclass(frozen=True, kw_only=True)
class CurveClientKeys:
    """CurveZMQ keys of a learner: its own pair and the syncer's public key (Z85 text)."""

    public: bytes
    """This learner's public key."""
    secret: bytes
    """This learner's secret key."""
    server_public: bytes
    """The syncer's public key (from its ``.key`` file)."""


def _ranks(process_group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in ``process_group`` (the default group when
    None) once torch.distributed is initialised; before that, torchrun's ``RANK`` and
    ``WORLD_SIZE``; without either, one rank."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class ZmqLink(QueueLink):
    """LearnerLink over ZeroMQ. ``endpoint`` like ``tcp://127.0.0.1:5555``."""

    carries_moments = True

    def __init__(
        self,
        endpoint: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        heartbeat_s: float = 1.0,
        curve: CurveClientKeys | None = None,
        max_message_bytes: int = 1 << 31,
        leave_timeout_s: float = 3.0,
        join_progress_s: float = 5.0,
        shard: Shard = Shard(),
        token_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(lambda: self._error)
        if "," in endpoint:
            raise ValueError(f"{endpoint!r} lists several endpoints: a sharded syncer is reached through "
                             "rackmend.transport.connect(endpoints) (a ShardedLink), one ZmqLink per shard")
        self.endpoint = endpoint
        self.shard = shard
        """The syncer shard at ``endpoint``: this link carries its fragments only (all of
        them for ``0/1``, one syncer for the whole model). ``ShardedLink`` sets it."""
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither (then they come from torch.distributed)")
        if rank is None or world_size is None:
            rank, world_size = _ranks(process_group)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.rank = rank
        self.world_size = world_size
        """Ranks of this learner; this link carries fragments p with p % world_size == rank.
        RackmendOptimizer refuses a link whose ranks differ from its process group's."""
        self.heartbeat_s = heartbeat_s
        self.max_message_bytes = max_message_bytes
        self.leave_timeout_s = leave_timeout_s
        """How long ``leave`` waits for the syncer's ``bye`` before the link closes anyway."""
        self.join_progress_s = join_progress_s
        """While ``join`` waits, a warning on logger ``rackmend.link`` every this many
        seconds says what it waits for (a silent wait looks like a hang)."""
        self._init_requested = False
        self._bye = threading.Event()
        self._leaving = False
        self._hello_at = -math.inf
        self._hello_due: float | None = None
        """I/O thread only: when a hello asked for during the back-off goes out."""
        self._last_send = -math.inf
        """I/O thread only: when the last message left (heartbeats fill the gaps)."""
        self.learner_id: str | None = None
        self._curve = curve
        self._error: BaseException | None = None
        self._busy: str | None = None
        """The syncer's reason of the last ``busy`` refusal of our hello (None: none yet,
        or a hello was answered since): what a join that times out names."""
        self._ctx = zmq.Context.instance()
        pipe = f"inproc://rackmend-link-{uuid.uuid4().hex}"
        self._pipe_out = self._ctx.socket(zmq.PAIR)
        self._pipe_out.bind(pipe)
        self._pipe_name = pipe
        self._fragments: list[FragmentSpec] = []
        self._owned: RankPieces = ()
        """Per fragment, the pieces this rank sends and receives (whole fragments p = rank
        mod world for a plain rack)."""
        self._wire_pieces: list[tuple[Piece, ...] | None] = []
        """Per fragment, the pieces its messages name; None where this rank owns it whole."""
        self._initial: list[list[torch.Tensor]] = []
        """Per fragment, this rank's owned values at join: what seeds a fresh syncer until a
        merged value of the fragment arrives (``_global``), when it is dropped."""
        self._hello: list[Any] = []
        self._hello_args: tuple[Any, ...] = ()
        self._token_dir = Path(token_dir) if token_dir is not None else default_token_dir()
        """Where this rank's resume token is kept for a restarted process (``rackmend.transport.tokens``)."""
        self._token_file: TokenFile | None = None
        self._token: str | None = None
        """I/O thread, once joining: the resume token the syncer gave this rank, or one a
        process gone before left; the hello presents it."""
        self._thread: threading.Thread | None = None
        self._connection = _Connection()
        """The TCP/ZeroMQ connection's latest state, from the socket monitor (I/O thread)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dropped_sends = 0
        """Heartbeats not sent because the syncer was unreachable at that moment."""
        self._outbox = Outbox(keep_sent=True)  # what a restarted syncer did not take in goes again
        self._session = new_session()
        """New for every link, so a learner restarted from a checkpoint (its step count
        resumed) numbers its sends in a session of its own, not as replays; later than
        every earlier one, so the syncer refuses sessions below a floor (replays of
        sessions too old to be remembered one by one)."""
        self._seq: dict[int, int] = {}
        """Per fragment, the last sequence number sent (the sending thread only:
        ``RackmendOptimizer``'s send thread)."""
        self._moment_seq: dict[tuple[int, str], int] = {}
        """DES-LOC: per (fragment, kind), the last sequence number sent (the sending thread only)."""
        self.fetches_sent = 0
        """``fetch`` requests sent after a lost delta update (retries included)."""
        self._global: dict[int, tuple[int, int, tuple[torch.Tensor, ...]]] = {}
        """I/O thread only: per fragment, the latest full value received, its epoch and version."""
        self._fetching: dict[int, float] = {}
        """I/O thread only: fragments with a fetch outstanding, and when it was sent."""
        self.syncer_settings: SyncerSettings | None = None
        """The round settings the syncer stated in its latest answer to a join (None: a
        syncer that predates them). Set before the answer's update is handed over, so
        it is there once ``join`` returns."""

    @classmethod
    def from_env(cls, endpoint: str | None = None, **kwargs: Any) -> "ZmqLink":
        """A link whose endpoint comes from the argument or ``RACKMEND_CONNECT``; rank and
        world size as in the constructor. For several endpoints (a sharded syncer) use
        ``rackmend.transport.connect``, which reads the same variable."""
        endpoint = endpoint or os.environ.get("RACKMEND_CONNECT")
        if not endpoint:
            raise TransportError("no syncer endpoint: pass one or set RACKMEND_CONNECT=tcp://host:port")
        return cls(endpoint, **kwargs)

    # ------------------------------------------------------------------ LearnerLink
    def join(self, learner_id: str, fragments: Sequence[FragmentSpec],
             initial: Sequence[Sequence[torch.Tensor]], timeout: float, *,
             settings: RunRules, pieces: RankPieces | None = None) -> list[Update]:
        """As ``LearnerLink.join``; ``pieces``: for a rank of a sharded rack, the pieces it
        owns per fragment (``initial`` then holds this rank's local tensors, of which the
        owned ones seed a fresh syncer). Updates carry those pieces only."""
        self.learner_id = learner_id
        self._fragments = list(fragments)
        owned = pieces if pieces is not None else whole_pieces(fragments, self.rank, self.world_size)
        self._owned = tuple(ps if self.shard.owns(p) else () for p, ps in enumerate(owned))
        self._wire_pieces = [None if pieces is None else wire_pieces(f, ps) for f, ps in zip(fragments, self._owned)]
        self._initial = [[initial[f.index][pc.tensor].detach().cpu().clone() for pc in ps]
                         for f, ps in zip(fragments, self._owned)] if pieces is not None else \
            [[t.detach().cpu().clone() for t in ts] if self.shard.owns(p) else [] for p, ts in enumerate(initial)]
        self._token_file = TokenFile(self._token_dir, self.endpoint, learner_id, self.rank)
        self._token = self._token_file.load()
        self._hello_args = (learner_id, self.rank, self.world_size, fragments, settings, pieces, self.shard)
        self._hello = wire.hello_frames(*self._hello_args, token=self._token)
        self._thread = threading.Thread(target=self._run, name=f"rackmend-link-{learner_id}", daemon=True)
        self._thread.start()
        got: dict[int, Update] = {}
        start = time.monotonic()
        end = start + timeout
        next_note = start + self.join_progress_s
        owned = sum(1 for ps in self._owned if ps)
        log.info("%s (rank %d) joining the syncer at %s", learner_id, self.rank, self.endpoint)
        while len(got) < owned:
            upd = self._get(min(end, next_note))
            if upd is not None:
                got[upd.fragment] = upd
                continue
            now = time.monotonic()
            if now >= end and self._busy is not None:
                raise TransportError(
                    f"join of {learner_id}: within {timeout:g}s the syncer at {self.endpoint} answered its hello "
                    f"with 'busy': {self._busy}. Another connection holds {learner_id}'s rank {self.rank} and keeps "
                    "it live. Is another process running with this id (a previous run not yet stopped)? Without "
                    "Curve keys, learner ids are first-come: whoever says hello first holds the id while it "
                    "stays live. With Curve keys bound to ids (`rackmend keygen DIR ID`, syncer --allowed-keys) "
                    "only this learner's key may speak as it (docs/reliability.md)")
            if now >= end:
                raise TransportError(
                    f"join of {learner_id}: no answer from the syncer at {self.endpoint} within {timeout:g}s "
                    f"({self._join_state(got, owned)}). Check that `rackmend syncer` is running and listening "
                    "there (it prints 'listening on ...'), that this host can reach that port, and that the "
                    "Curve keys match (the syncer logs refused keys as auth_denied). To wait longer, raise "
                    "LearnerConfig.join_timeout (the timeout RackmendOptimizer joins with)")
            log.warning("%s (rank %d) waiting for the syncer at %s: %.0fs of %gs, %s", learner_id, self.rank,
                        self.endpoint, now - start, timeout, self._join_state(got, owned))
            next_note = now + self.join_progress_s
        return list(got.values())

    def _join_state(self, got: dict[int, Update], owned: int) -> str:
        """What a waiting join has heard so far, for a person reading the log."""
        if self.bytes_received == 0 and not self._init_requested:
            return f"nothing received yet; {self._connection.describe(time.monotonic())}"
        if self._busy is not None:
            return f"the syncer refuses its hello as busy (retrying): {self._busy}"
        if self._init_requested:
            return (f"sent the initial values as the first learner; {len(got)} of {owned} fragments "
                    "came back so far")
        return (f"the syncer answers but sent {len(got)} of {owned} fragments (it may wait for the first "
                "learner's initial values)")

    def send(self, contribution: Contribution) -> None:
        # Numbered here, per fragment within this link's session: the syncer refuses a
        # number it has seen, so a replayed or duplicated message is never merged twice.
        self._seq[contribution.fragment] = seq = self._seq.get(contribution.fragment, 0) + 1
        contribution = dataclasses.replace(contribution, session=self._session, seq=seq)
        frames = wire.contribution_frames(contribution, self.rank)
        self._pipe_out.send_multipart([b"C", str(contribution.fragment).encode(), *frames], copy=False)

    def send_moments(self, contribution: MomentContribution) -> None:
        """DES-LOC: queue a moment contribution for the syncer; returns at once."""
        key = (contribution.fragment, contribution.kind)
        self._moment_seq[key] = seq = self._moment_seq.get(key, 0) + 1
        contribution = dataclasses.replace(contribution, session=self._session, seq=seq)
        self._pipe_out.send_multipart([b"M", *wire.moments_frames(contribution, self.rank)], copy=False)

    @property
    def superseded_sends(self) -> int:
        """Contributions replaced by a newer one of the same fragment before the link had
        room for them (the newer one carries the same work: counters are cumulative)."""
        return self._outbox.superseded

    def leave(self) -> None:
        if self._thread is None:
            return
        if self._thread.is_alive() and self.bytes_received > 0:  # else the syncer never heard of us
            # Wait for the syncer's bye: closing at once can lose the leave (a socket closed
            # with unread updates in its receive buffer is reset, not flushed), and then
            # rounds would wait for this learner until its heartbeat timeout.
            self._leaving = True
            self._pipe_out.send_multipart([b"L", *wire.encode({"type": "leave", "learner": self.learner_id,
                                                                "rank": self.rank})])
            if self._bye.wait(self.leave_timeout_s) and self._token_file is not None:
                self._token_file.forget()  # the syncer freed the id: nothing to resume
        if self._thread.is_alive():
            self._pipe_out.send_multipart([b"STOP"])
            self._thread.join(5.0)
        self._pipe_out.close(linger=0)
        self._thread = None

    close = leave

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        pipe = self._ctx.socket(zmq.PAIR)
        # What the connection itself does (refused, retried, up, handshake failed): what a
        # join that hears nothing tells the person waiting.
        monitor = dealer.get_monitor_socket(_MONITORED)
        try:
            dealer.setsockopt(zmq.LINGER, 2000)
            dealer.setsockopt(zmq.SNDHWM, SHORT_HWM)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            # The syncer binds a learner rank to the connection it said hello on. A routing
            # id of our own (random, never zero-led: those are ZeroMQ's) keeps that binding
            # across reconnects, where an id the syncer assigned would change each time.
            dealer.setsockopt(zmq.ROUTING_ID, b"rk" + secrets.token_bytes(14))
            if self._curve is not None:
                dealer.curve_publickey = self._curve.public
                dealer.curve_secretkey = self._curve.secret
                dealer.curve_serverkey = self._curve.server_public
            dealer.connect(self.endpoint)
            pipe.connect(self._pipe_name)
            poller = zmq.Poller()
            poller.register(dealer, zmq.POLLIN)
            poller.register(pipe, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            self._send_hello(dealer)
            next_beat = time.monotonic() + self.heartbeat_s
            beat = wire.encode({"type": "heartbeat", "learner": self.learner_id, "rank": self.rank})
            while True:
                # POLLOUT only while something can leave: a contribution held for its
                # fragment's acknowledgement would make every poll return at once (a busy
                # loop that takes the GIL from the training thread).
                poller.modify(dealer, zmq.POLLIN | (zmq.POLLOUT if self._outbox.sendable() else 0))
                wake = min(t for t in (next_beat, self._hello_due, self._outbox.next_expiry()) if t is not None)
                ready = dict(poller.poll(max(0.0, wake - time.monotonic()) * 1000))
                if ready.get(pipe, 0) & zmq.POLLIN:
                    msg = pipe.recv_multipart(copy=False)
                    kind = msg[0].bytes
                    if kind == b"STOP":
                        self._flush(dealer)
                        return
                    if kind == b"C":
                        self._outbox.add_latest(int(msg[1].bytes), msg[2:])
                    elif kind == b"L":  # the leave follows the contributions queued before it
                        self._outbox.add_last(msg[1:])
                    else:
                        self._outbox.add_control(msg[1:])
                if ready.get(monitor, 0) & zmq.POLLIN:
                    self._connection.note(recv_monitor_message(monitor)["event"], time.monotonic())
                if ready.get(dealer, 0) & zmq.POLLIN:
                    self._receive(dealer, dealer.recv_multipart(copy=False))
                self._flush(dealer)
                if self._hello_due is not None and time.monotonic() >= self._hello_due:
                    self._send_hello(dealer)
                if time.monotonic() >= next_beat:
                    # Whatever waits in the outbox: a contribution held until the last one of
                    # its fragment is acknowledged sends nothing, and the syncer would take
                    # the silence for a dead learner (and let another connection take its id).
                    if time.monotonic() - self._last_send >= self.heartbeat_s:
                        self._send_now(dealer, beat)
                    next_beat = time.monotonic() + self.heartbeat_s
                for p, sent in list(self._fetching.items()):
                    if time.monotonic() - sent >= FETCH_RETRY_S:
                        self._fetch(dealer, p)
        except BaseException as exc:  # surfaced to the training thread by _get
            log.exception("link I/O thread failed")
            self._error = exc
        finally:
            dealer.disable_monitor()
            monitor.close()
            dealer.close()
            pipe.close()

    def _send_hello(self, dealer: zmq.Socket) -> None:
        self._hello_at = time.monotonic()
        self._hello_due = None
        # A syncer that asks for a hello (restarted, or a shard resumed from its checkpoint)
        # took in none of what it did not acknowledge: it goes again after the hello, and
        # merges if still within staleness (8 contributions were lost this way).
        again = self._outbox.resend_inflight()
        if again:
            log.info("%s: %d contribution(s) the syncer did not take in go again after the hello",
                     self.learner_id, again)
        self._send(dealer, self._hello)

    def _send(self, dealer: zmq.Socket, frames: list[Any]) -> None:
        """Queue a control message (sent in order, never dropped) and send what fits."""
        self._outbox.add_control(frames)
        self._flush(dealer)

    def _flush(self, dealer: zmq.Socket) -> None:
        # Never block: while the syncer is unreachable or the link is full, messages wait
        # in the outbox, where a newer contribution of a fragment replaces an older one.
        def send(frames: list[Any]) -> None:
            dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            self._last_send = time.monotonic()
            self.bytes_sent += sum(len(f) if isinstance(f, (bytes, memoryview)) else len(f.buffer) for f in frames)

        self._outbox.flush(send)

    def _send_now(self, dealer: zmq.Socket, frames: list[Any]) -> None:
        """Send at once or not at all (heartbeats: a late one is worthless)."""
        try:
            dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            self._last_send = time.monotonic()
        except zmq.Again:
            self.dropped_sends += 1

    def _receive(self, dealer: zmq.Socket, frames: list[zmq.Frame]) -> None:
        self.bytes_received += sum(len(f.buffer) for f in frames)
        try:
            typed = wire.parse_from_syncer(frames, self.max_message_bytes)
            msg = typed.message
            if isinstance(typed, wire.UpdateIn):
                p = wire.fragment_field(msg.header, len(self._fragments), "update")
                version = msg.header.get("version")
                if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                    raise wire.WireError(f"update has a bad version {version!r}")
                self._send(dealer, wire.ack_frames(p, self.learner_id, self.rank))
                self._busy = None  # the hello was taken after all
                self._on_update(dealer, msg, p, version)
            elif isinstance(typed, wire.InitRequestIn):
                self._init_requested = True
                # The seeder's ranks each send what they own (a plain rank: every fragment
                # whole): the newest merged value received, so a syncer restarted without
                # its checkpoint goes on from the global model the learners hold, not from
                # the one this learner joined with; the join-time value where none came yet.
                for p, initial in enumerate(self._initial):
                    values = self._global[p][2] if p in self._global else initial
                    if values:
                        self._send(dealer, wire.init_frames(self.learner_id or "", self.rank, p, values,
                                                            self._wire_pieces[p]))
            elif isinstance(typed, wire.WelcomeIn):
                token = wire.parse_welcome(msg, self.learner_id, self.rank)
                if token != self._token:
                    self._token = token
                    self._hello = wire.hello_frames(*self._hello_args, token=token)
                    assert self._token_file is not None
                    self._token_file.save(token)
            elif isinstance(typed, wire.ByeIn):
                self._bye.set()
            elif isinstance(typed, wire.FailSlowIn):
                self._advice.put(wire.parse_fail_slow(msg, self.learner_id))
            elif isinstance(typed, wire.MomentsUpdateIn):
                self._moment_box.put(wire.parse_moments_update(msg, self._fragments))
            elif isinstance(typed, wire.SyncerAckIn):
                self._outbox.ack(wire.parse_ack(msg, len(self._fragments)))
            elif isinstance(typed, wire.ErrorIn):
                code, reason = typed.code, typed.reason
                if code == "rejoin" and self._leaving:
                    self._bye.set()  # the syncer does not know us any more: nothing to leave
                elif code in ("rejoin", "busy"):
                    if code == "busy":  # our id's rank is live on another connection (a restart of ours?)
                        self._busy = reason
                        log.warning("syncer: %s; retrying the hello", reason)
                    if time.monotonic() - self._hello_at > _HELLO_BACKOFF_S:
                        log.info("syncer asks %s to join again (it restarted?); sending hello", self.learner_id)
                        self._send_hello(dealer)
                    elif self._hello_due is None:
                        # Within the back-off: not ignored (it may be the only request, say after
                        # a restarted syncer dropped the hello sent just before), but answered
                        # once the back-off is over, however many more arrive meanwhile.
                        self._hello_due = self._hello_at + _HELLO_BACKOFF_S
                elif code == "fatal":
                    self._error = TransportError(f"the syncer refused {self.learner_id}: {reason}")
                else:
                    log.warning("syncer rejected a message from %s: %s", self.learner_id, reason)
        except wire.WireError as exc:
            log.warning("dropped a malformed message from the syncer: %s", exc)

    def _on_update(self, dealer: zmq.Socket, msg: wire.Message, p: int, version: int) -> None:
        """Deliver an update as a full value: a full one as it is, a delta rebuilt on
        the held value (or, after a gap, a fetch for the full value instead)."""
        h = msg.header
        epoch = h.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= wire.MAX_EPOCH:
            raise wire.WireError(f"update has a bad epoch {str(epoch)[:30]}")
        held = self._global.get(p)
        # A new epoch is a syncer resumed from a checkpoint: its version numbers past
        # the checkpoint name other values than the ones held, so nothing is compared
        # with them and its value is adopted like a rejoin answer.
        same_epoch = held is not None and held[0] == epoch
        if not h.get("delta", False):
            if h.get("reset", False):
                try:
                    said = wire.parse_syncer_settings(msg)
                except wire.WireError as exc:
                    # Advice only: the value itself is checked on its own, and a join
                    # must not fail over what the syncer says about its rounds.
                    log.warning("the syncer's settings in its answer to %s are malformed, ignored: %s",
                                self.learner_id, exc)
                else:
                    if said is not None:
                        self.syncer_settings = said
            reset = bool(h.get("reset", False)) or (held is not None and not same_epoch)
            tensors = self._parse_value(msg, p)
            self._fetching.pop(p, None)
            if not reset and held is not None and version < held[1]:
                return  # a fetch answer overtaken by newer values: keep the newer one
            self._hold_global(p, epoch, version, tensors)
            self._box.put(Update(p, version, tensors, reset=reset, epoch=epoch))
            return
        base = h.get("base_version")
        if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < version:
            raise wire.WireError(f"delta update of version {version} has a bad base_version {base!r}")
        if held is not None and same_epoch and base < held[1]:
            return  # older than what is held: nothing to learn from it
        if held is None or not same_epoch or base > held[1]:
            if p not in self._fetching:  # at most one outstanding; the loop re-sends it
                self._fetch(dealer, p)
            return
        decoded, encoded = wire.parse_encoded(msg, self._fragments[p])
        # held + decoded, in this order: the syncer's theta = old + decoded, bit for bit.
        full = tuple(old + d for old, d in zip(held[2], decoded))
        self._hold_global(p, epoch, version, full)
        self._box.put(Update(p, version, full, epoch=epoch, delta=encoded))

    def _hold_global(self, p: int, epoch: int, version: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """The newest full value of fragment ``p``: what deltas build on and, from now on,
        what seeds a fresh syncer (the join-time copy is dropped)."""
        self._global[p] = (epoch, version, tensors)
        self._initial[p] = []

    def _parse_value(self, msg: wire.Message, p: int) -> tuple[torch.Tensor, ...]:
        """A full value of fragment ``p``: this rank's pieces of it, exactly those."""
        if self._wire_pieces[p] is None:
            return wire.parse_tensors(msg, self._fragments[p])
        pieces, tensors, encoded = wire.parse_pieces(msg, self._fragments, p)
        if pieces != self._wire_pieces[p] or encoded is not None:
            raise wire.WireError(f"update of fragment {p} carries pieces {pieces}, this rank owns "
                                 f"{self._wire_pieces[p]} (uncompressed)")
        return tensors

    def _fetch(self, dealer: zmq.Socket, p: int) -> None:
        log.info("%s lost an update of fragment %d; fetching its full value", self.learner_id, p)
        self._fetching[p] = time.monotonic()
        self.fetches_sent += 1
        self._send(dealer, wire.fetch_frames(self.learner_id or "", self.rank, p))
