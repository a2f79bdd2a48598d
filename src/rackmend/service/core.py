"""The syncer service's sans-I/O core: every decision the service makes, none of its I/O.

``ServiceCore`` takes what arrived (a connection's id and the message's frames, typed
once by ``wire.parse_from_learner``), the clock, and a ``Send`` to hand messages to,
and decides: who a connection is and whether it may speak as the learner it names
(``service.membership``: hellos, takeovers, resume tokens, the gate of sharded
learners, settings agreement, Curve key ids, silence), the seeding of a fresh model by
the first learner, contributions arriving piece-wise (``service.assembly``), what
waits per connection and what replaces what (``transport.outbox``), rate limits on the
log, progress and ``status``, and when to checkpoint. It drives ``SyncerCore`` (the
rounds) through ``SyncerRunner`` and turns its actions into messages, records and
metrics.

What does not live here: the ZeroMQ socket, its poll loop, Curve's authenticator
thread, signals, the ready file, the JSONL file and the metrics HTTP server
(``rackmend.service.syncer``); the bytes' format and validation
(``rackmend.transport.wire``); the round logic (``rackmend.core.syncer``). Checkpoint
files are written through ``service.checkpointing`` when a directory is configured.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rackmend.config import ConfigError, RunConfig
from rackmend.core.failslow import AdviseLearner, FailSlowAction
from rackmend.core.fragments import FragmentSpec, fragment_problem
from rackmend.core.records import Joined, Left, Merged, Rejected, SyncerRecord
from rackmend.core.settings import RunRules, SyncerSettings
from rackmend.core.shards import Shard, parse_shard
from rackmend.core.shards import owner as owner_shard
from rackmend.core.status import SyncerPart, SyncerStatus
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
    Tick,
)
from rackmend.core.syncer_runner import SyncerRunner
from rackmend.service.assembly import PendingInit, PieceAssembly
from rackmend.service.checkpointing import Checkpoints, Saved
from rackmend.service.config import (ALL_CONNECTIONS_BURST, AUTO_ZMQ_CAP, LOG_WINDOW_S, STRANGER_MAX_BYTES,
                                     ServiceConfig, layout_message_limit)
from rackmend.service.events import (
    AuthDenied,
    BadMessage,
    Fetched,
    IdentityRefused,
    Initialised,
    InitRequested,
    InitTimedOut,
    InternalError,
    MessageLimit,
    Resumed,
    SendDropped,
    ServiceEvent,
    Stopped,
    Suppressed,
    UnknownPeer,
)
from rackmend.service.identity import EventLimiter
from rackmend.service.membership import Membership, Peer
from rackmend.service.metrics import SyncerMetrics
from rackmend.service.progress import Tracker, age_s
from rackmend.transport import wire
from rackmend.transport.outbox import Outbox

__all__ = ["ServiceCore", "Send", "PeerGone", "MAX_QUEUED_REPLIES"]

log = logging.getLogger("rackmend.syncer")

MAX_QUEUED_REPLIES = 16
"""Error and receipt replies held per connection that reads none of them; more are
dropped (counted as ``replies_dropped``): a peer that never reads costs bounded memory."""
_FRAGMENT_MESSAGES = (wire.ContribIn, wire.InitIn, wire.FetchIn, wire.AckIn, wire.MomentsIn)
"""What a learner sends about one fragment (its ``fragment`` field is renumbered for a shard's core)."""

Send = Callable[[bytes, list[Any]], None]
"""``send(connection, frames)``: the transport's, given to ``ServiceCore``. Raises
``zmq.Again`` when the connection has no room now (the rest waits in its outbox) and
``PeerGone`` when it is gone (its messages are dropped)."""


class PeerGone(Exception):
    """Raised by a ``Send``: the connection is gone; the text says why."""


def _nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)


_ALL_CONNECTIONS = "all connections"
"""The rate limiter's key, beside an event kind, for that kind over every connection
(connections are keyed by their ZeroMQ identity, bytes, so this str cannot collide)."""


class ServiceCore:
    """Everything the syncer service decides, with no socket, thread or signal: bytes and
    the clock in, messages queued per connection and log records out.

    ``receive`` takes one message as it arrived (the connection's id, its frames and,
    under Curve, the public key it authenticated with); ``tick`` does what time alone
    decides (silence, the seeding deadline, the grace window, progress lines). Messages
    go out through the transport's ``send`` as soon as they are queued, as far as the
    connection has room; ``flush`` retries what waits. ``emit`` gets each JSONL log line.
    ``SyncerService`` is this core behind a ZeroMQ socket; tests drive it directly on a
    fake clock.

    ``config`` holds the run's settings on the syncer's side. H, P, tau, DES-LOC's periods
    and the apply rule are the learners' (``RunRules``): the first learner's hello sets
    them for the run (a ``RackmendConfig``'s ``schedule`` and ``learner`` parts are not
    read; ``SyncerConfig.overlap`` may pin tau).
    ``key_ids``: with Curve and an allowed-keys directory, the learner ids each public
    key may use. ``epoch``: drawn at random when not given."""

    def __init__(self, config: RunConfig, service: ServiceConfig, *, send: Send,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[[dict], None] = lambda line: None,
                 epoch: int | None = None, key_ids: dict[str, frozenset[str] | None] | None = None) -> None:
        self.config = config
        self._transmit = send
        self.service = service
        self.shard: Shard = parse_shard(service.shard)
        self._emit = emit
        self._layout: list[FragmentSpec] | None = None
        """The model's whole layout (every fragment, in the model's numbering): what hellos
        are checked against. The core holds this shard's fragments only, renumbered from 0
        (``Shard.fragments``); fragment numbers are translated at the service's edge:
        ``receive`` for what arrives, ``_out`` and ``Shard.record`` for what leaves."""
        self.clock = clock
        self.metrics = SyncerMetrics(clock, self.shard)
        """Counted whether or not they are served (``metrics_port``)."""
        self.core: SyncerCore | None = None
        self._runner: SyncerRunner | None = None
        """Carries out the core's actions (``_drive``); made with the core."""
        self._cause: bytes | None = None
        self._join: tuple[int, int] | None = None
        """What ``_drive`` is driving for, read by the ``_on_*`` methods: the connection,
        and (rank, world) when it is that rank's join."""
        self.rejected_messages = 0
        self.merges = 0
        self._pending: PendingInit | None = None
        self._first: tuple[str, RunRules] | None = None
        """The learner whose rules the run uses (the seeder, or from the checkpoint)."""
        self._unruled: Saved | None = None
        """A checkpoint to resume from that does not record the run's rules (written before
        hellos carried them): restored under the first hello's."""
        self.started_at = clock()
        self.status_requests = 0
        """Read-only ``status`` requests answered."""
        self.endpoint = ""
        """Where the service listens (set by it once bound), for ``status``."""
        self.metrics_url: str | None = None
        """Where ``/metrics`` is served (set by the service); None when not served."""
        self.tracker = Tracker(clock, self.shard, self.metrics, service.progress_every)
        self.assembly = PieceAssembly(self.shard, clock, self.metrics, log_record=self._log_record,
                                      refuse=self._refuse)
        self.checkpoints = Checkpoints(service.checkpoint_dir, self.shard, clock, self.metrics, self.event)
        self._limiter = EventLimiter(service.log_burst, LOG_WINDOW_S)
        self.replies_dropped = 0
        """Error and receipt replies not queued because their connection reads none."""
        self.queued_replies_max = 0
        """The most control messages ever waiting for one connection."""
        self._outboxes: dict[bytes, Outbox] = {}
        self.epoch = 1 + secrets.randbelow(wire.MAX_EPOCH) if epoch is None else epoch
        """Drawn at every start, never stored: a crash after a merge was sent but before
        it was checkpointed makes the resumed run reissue that version number with
        another value, and (epoch, version) keeps the two apart at the learners."""
        self.superseded_updates = 0
        """Updates replaced in a peer's outbox by a newer value before its link had room."""
        self.members = Membership(config, service, self.shard, clock, event=self.event, peer_event=self._peer_event,
                                  reply_error=self._reply_error, refuse=self._refuse, key_ids=key_ids)
        if service.resume:
            self._resume()
        limit = self._message_limit()
        self.zmq_cap = AUTO_ZMQ_CAP if limit is None else 2 * limit
        """What the transport reads of one message at most (ZeroMQ's ``MAXMSGSIZE``):
        twice the limit, so a message just over the limit still reaches the validator and
        gets a logged, answered rejection, while a far bigger one is cut off unread. Fixed
        at the start: after a resume, the checkpoint's layout sizes it; a fresh run's
        layout comes later, and the per-message checks in ``receive`` follow it."""

    @property
    def peers(self) -> dict[bytes, Peer]:
        """The connected learner ranks, by connection (``Membership.peers``)."""
        return self.members.peers

    # ------------------------------------------------------------------ time
    def wake_in(self) -> float:
        """Seconds until ``tick`` has something to do at the latest: the next grace
        deadline, or soon while a connection has room to be sent to."""
        now = self.clock()
        timeout = 0.01 if any(box.sendable(now) for box in self._outboxes.values()) else 0.1
        deadline = self.core.next_deadline() if self.core else None
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - now))
        return timeout

    def tick(self) -> None:
        """What time decides: silent learners dropped, a dead seeder replaced, partial
        contributions expired, suppressed log lines summarised, progress reported, the
        core's deadlines. Call it after each batch of ``receive`` and at ``wake_in``."""
        self.members.drop_silent(self.clock(), self._silent)
        self._check_init()
        self._expire_pieces()
        self._summarise_suppressed(self._limiter.expired(self.clock()))
        self.tracker.report_progress(self.peers.values())
        if self.core is not None:
            self._drive(Tick())

    def finish(self) -> None:
        """The service stops: contributions that arrived are merged and their results
        sent (as far as the links have room), a checkpoint is written, ``stopped`` logged."""
        try:
            if self.core is not None:
                # Before the checkpoint, so contributions that were sent (and acknowledged)
                # are in the saved value rather than dropped with the process.
                self._drive(FinalMerge())
                self.flush()
            self.checkpoint()
        finally:
            self._summarise_suppressed(self._limiter.flush())
            self.event(Stopped, merges=self.merges, rejected_messages=self.rejected_messages,
                        replies_dropped=self.replies_dropped, log_suppressed=self._limiter.suppressed_total,
                        queued_replies_max=self.queued_replies_max)

    # ------------------------------------------------------------------ messages
    def receive(self, ident: bytes, body: Sequence[Any], key: str | None = None) -> None:
        """One message from connection ``ident``: its frames (bytes, memoryviews or
        ZeroMQ frames) and, under Curve, the public key (Z85) it authenticated with.
        Bad input is refused, logged and answered; it never raises."""
        msg: wire.FromLearner | wire.StatusIn | None = None
        try:
            joined = ident in self.peers or (self._pending is not None and ident in self._pending.seeders)
            limit = self._message_limit()
            if not joined:
                total = _nbytes(body)
                bound = min(STRANGER_MAX_BYTES, self.service.max_message_bytes or STRANGER_MAX_BYTES)
                if total > bound:
                    raise wire.WireError(f"message of {total} bytes from a connection that has not joined exceeds "
                                         f"the limit of {bound} bytes before a hello is accepted")
            msg = wire.parse_from_learner(body, limit or AUTO_ZMQ_CAP)
            if isinstance(msg, wire.StatusIn):  # read-only, names no learner: the Curve handshake is its check
                self._answer_status(ident, msg)
                return
            if self.members.key_ids is not None and not self.members.key_allows(ident, key or "", msg):
                return
            if not self.shard.whole and isinstance(msg, _FRAGMENT_MESSAGES):
                self._localize(msg.message)
            self._handle(ident, msg)
        except wire.WireError as exc:
            self._refuse(ident, BadMessage, "bad_message", str(exc))
        except Exception as exc:  # noqa: BLE001 - one message must never end the service for everyone
            # A fault that validation missed: drop this message, keep serving. The state
            # it reached is whatever the handler had done before raising (each handler
            # checks before it changes anything, so that is usually nothing).
            self.rejected_messages += 1
            learner = isinstance(msg, wire.FromLearner)
            kind = msg.type if learner else "status" if msg is not None else "?"
            lid = msg.learner if learner else ""
            reason = f"internal error handling a {kind} message: {type(exc).__name__}: {str(exc)[:300]}"
            if self._peer_event(ident, InternalError, learner=lid, type=kind, reason=reason):
                log.exception("%s from peer %s (learner %r); message dropped, serving on", reason, ident.hex(), lid)
            self._reply_error(ident, "rejected", reason)
        finally:
            self.tracker.received(msg.learner if isinstance(msg, wire.FromLearner) else "", _nbytes(body))

    def _localize(self, msg: wire.Message) -> None:
        """A message about one fragment, renumbered to this shard's numbering (the core's);
        one about another shard's fragment is refused, naming the shard that owns it."""
        p = msg.header.get("fragment")
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            return  # malformed: the parser names it
        problem = None if self._layout is None else fragment_problem(p, len(self._layout))
        if problem:  # named as the model numbers it: past here the core would name its own number
            raise wire.WireError(problem)
        if not self.shard.owns(p):
            raise wire.WireError(f"fragment {p} belongs to syncer shard {owner_shard(p, self.shard.count)} of "
                                 f"{self.shard.count}; this is shard {self.shard}. Give the learner every shard's "
                                 "endpoint in shard order")
        msg.header["fragment"] = self.shard.local(p)

    def _out(self, upd: Any) -> Any:
        """An update (or averaged moments) of the core, numbered as the model for the wire."""
        return upd if self.shard.whole else dataclasses.replace(upd, fragment=self.shard.to_global(upd.fragment))

    def _answer_status(self, ident: bytes, msg: wire.StatusIn) -> None:
        """Read-only: answered from the current state, the asker never becomes a peer
        (each request is not logged: a refreshing view asks every second)."""
        self.status_requests += 1
        self._send(ident, wire.status_reply_frames(msg.nonce, self.status().to_json()), droppable=True)

    def _message_limit(self) -> int | None:
        """The largest message a joined learner may send: the operator's, else the
        layout's (None while no layout is known)."""
        if self.service.max_message_bytes is not None:
            return self.service.max_message_bytes
        layout = self.core.fragments if self.core is not None else self._pending.layout if self._pending else None
        return None if layout is None else layout_message_limit(layout)  # this shard's fragments: all it receives

    def _handle(self, ident: bytes, msg: wire.FromLearner) -> None:
        lid, rank = msg.learner, msg.rank
        if isinstance(msg, wire.HelloIn):
            self._hello(ident, msg.message)
            return
        if isinstance(msg, wire.InitIn):
            self._init(ident, msg.message)
            return
        peer = self.peers.get(ident)
        if peer is None and self._pending is not None and any(i == ident for i, _ in self._pending.waiting):
            return  # its hello is answered once the first learner's initial values are in
        gated = self.members.gate.get(lid, {}).get(ident)
        if peer is None and gated is not None:
            gated.last_seen = self.clock()
            return  # its hello is answered once every rank of its learner has said hello
        if peer is None and isinstance(msg, wire.AckIn):
            return  # a receipt from a peer dropped meanwhile: its next heartbeat gets it back
        if peer is None or peer.learner_id != lid or peer.rank != rank:
            if self.members.holder(ident, lid, rank) is not None:
                # The id is bound to the connection that said hello for it: a contribution,
                # heartbeat or leave naming it from anywhere else is someone else's.
                reason = (f"learner {lid} rank {rank} is held by another connection; a {msg.type} naming it is "
                          "accepted from that connection only")
                self._refuse(ident, IdentityRefused, "rejoin", reason, learner=lid, rank=rank, type=msg.type)
                return
            # Unknown to this syncer (it restarted, or the learner was declared silent).
            self.rejected_messages += 1
            self._peer_event(ident, UnknownPeer, learner=lid, type=msg.type)
            self._reply_error(ident, "rejoin", "send hello first")
            return
        peer.last_seen = self.clock()
        if isinstance(msg, wire.HeartbeatIn):
            return
        if isinstance(msg, wire.LeaveIn):
            self._leave(ident, lid, rank)
        elif isinstance(msg, wire.FetchIn):
            self._fetch(ident, peer, msg.message)
        elif isinstance(msg, wire.AckIn):
            box = self._outboxes.get(ident)
            if box is not None and self.core is not None:
                box.ack(wire.parse_ack(msg.message, len(self.core.fragments)))
                self.flush_one(ident)
        elif isinstance(msg, wire.MomentsIn):
            self._moments(ident, peer, msg.message)
        else:
            assert isinstance(msg, wire.ContribIn) and self.core is not None
            self._contribution(ident, peer, msg.message)

    def _leave(self, ident: bytes, lid: str, rank: int) -> None:
        del self.peers[ident]
        self.members.release(lid, rank)
        self._send(ident, wire.encode({"type": "bye"}))  # lets the learner exit knowing it was heard
        if not self.members.ranks_of(lid):
            self.tracker.stats[lid].state = "left"
            self.assembly.forget(lid, "the learner left")
            self._drive(LearnerLeft(lid, "leave"), ident=ident)

    def _contribution(self, ident: bytes, peer: Peer, msg: wire.Message) -> None:
        assert self.core is not None
        lid = peer.learner_id
        contribution = wire.parse_contribution(msg, self.core.fragments)
        self._send(ident, wire.ack_frames(self.shard.to_global(contribution.fragment)), droppable=True)  # received, whatever the core decides
        if contribution.pieces is not None:
            whole = self.assembly.add(ident, peer, contribution, self.core.fragments,
                                      self.members.learner_pieces.get(lid, {}))
            if whole is None:
                return
            contribution = whole
        stats = self.tracker.stats[lid]
        p = contribution.fragment
        stats.contributions += 1
        lag = self.core.versions[p] - contribution.base_version  # before the merge it may close
        if any(isinstance(a, Rejected) for a in self._drive(ContributionArrived(contribution))):
            return  # a refused contribution's step time and base say nothing true about the learner
        stats.step, stats.step_time, stats.last_contribution = contribution.step, contribution.step_time, self.clock()
        stats.based[self.shard.to_global(p)] = (contribution.base_version, lag)
        self.metrics.contribution(lid, contribution.step_time, max(lag for _, lag in stats.based.values()))

    def _moments(self, ident: bytes, peer: Peer, msg: wire.Message) -> None:
        """DES-LOC: a learner's moments, checked on the wire and then by the core."""
        assert self.core is not None
        c = wire.parse_moments(msg, self.core.fragments)
        if not peer.owns(c.fragment):
            raise wire.WireError(f"moments: rank {peer.rank} of {peer.world} does not own fragment {c.fragment}")
        self._drive(MomentsArrived(c))

    def _hello(self, ident: bytes, msg: wire.Message, admitted: bool = False) -> None:
        """``admitted``: a sharded learner's rank whose ranks have all said hello and
        cover every tensor (``Membership.through_gate``)."""
        first = self._first or ((self._pending.seeder_id, self._pending.settings) if self._pending else None)
        hello = self.members.admit(ident, msg, first=first, layout=self._layout, zmq_cap=self.zmq_cap)
        if hello is None:
            return
        lid, rank, layout = hello.learner_id, hello.rank, hello.layout
        stats = self.tracker.hello(ident, lid)
        if hello.pieces is not None and not admitted:
            for other, gated in self.members.through_gate(ident, msg, hello, self._refused):
                self._hello(other, gated, admitted=True)
            return
        if self.core is None and self._unruled is not None:
            try:
                self._restore(self._unruled, hello.settings)
            except ValueError as exc:  # ConfigError: the checkpoint does not fit these rules
                # Kept for a learner whose rules fit: never seeded anew over it in silence.
                self.core, self._runner = None, None
                self._send(ident, wire.encode({"type": "error", "code": "fatal", "reason": str(exc)}))
                raise wire.WireError(f"cannot resume the checkpoint under learner {lid}'s rules: {exc}") from None
            self._unruled, self._first = None, (lid, hello.settings)
        if self.core is None:
            pend = self._pending
            if pend is None:
                self._layout = layout
                pend = self._pending = PendingInit(self.shard.fragments(layout), {ident: self.members.declared(hello)},
                                                   lid, hello.settings, self.clock())
                self.event(InitRequested, learner=lid, fragments=len(pend.layout))
                self._send(ident, wire.encode({"type": "init_request"}))
            elif pend.seeder_id == lid and hello.pieces is not None and ident not in pend.seeders:
                # A sharded seeder: each of its ranks sends the pieces it owns.
                pend.seeders[ident] = self.members.declared(hello)
                self._send(ident, wire.encode({"type": "init_request"}))
            pend.waiting = [(i, m) for i, m in pend.waiting if i != ident] + [(ident, msg)]
            return
        # admit checked: the hello presents the rank's token, or its holder was silent for takeover_after
        self.members.take_over(ident, lid, rank, hello.token)
        _, token = self.members.join(ident, hello, self.core.fragments)
        self._send(ident, wire.welcome_frames(lid, rank, token))
        stats.state = "connected"
        self.metrics.joined(lid)
        if ident in self._outboxes:
            self._outboxes[ident].forget_inflight()  # a new session: old sends will not be acknowledged
        self._drive(LearnerJoined(lid), ident=ident, join=(rank, hello.world))

    def _update_frames(self, peer: Peer, upd: Any, reset: bool = False, full: bool = False) -> list[Any]:
        """An update as ``peer`` receives it: its pieces only, or the whole fragment."""
        return wire.update_frames(self._out(upd), reset=reset, full=full, pieces=peer.cuts[upd.fragment],
                                  syncer=SyncerSettings.from_config(self.config))

    def _check_init(self) -> None:
        """Pass the seeding role on when the seeder stopped delivering initial values:
        otherwise a learner that died between hello and init blocks the syncer forever."""
        pend = self._pending
        if pend is None or self.clock() - pend.asked_at <= self.service.init_timeout:
            return
        others = [(i, m) for i, m in pend.waiting if i not in pend.seeders]
        nxt = others[0][1].header["learner"] if others else None
        self.event(InitTimedOut, learner=pend.seeder_id, seconds=round(self.clock() - pend.asked_at, 3),
                    received=len(pend.values), next=nxt)
        log.warning("learner %s sent no initial value for %.0fs (--init-timeout); %s", pend.seeder_id,
                    self.clock() - pend.asked_at,
                    f"asking {nxt} instead" if nxt else "the next learner to join will be asked")
        if not others:
            self._pending = None
            return
        hello = wire.parse_hello(others[0][1])
        # A plain learner's first connection seeds alone; a sharded learner's ranks all do.
        seeders = {i: self.members.declared(h) for i, h in ((i, wire.parse_hello(m)) for i, m in others)
                   if h.learner_id == hello.learner_id and (i == others[0][0] or h.pieces is not None)}
        self._pending = PendingInit(pend.layout, seeders, hello.learner_id, hello.settings, self.clock(),
                                    waiting=others)
        self.event(InitRequested, learner=hello.learner_id, fragments=len(pend.layout), replaces=pend.seeder_id)
        for ident in seeders:
            self._send(ident, wire.encode({"type": "init_request"}))

    def _fetch(self, ident: bytes, peer: Peer, msg: wire.Message) -> None:
        """A learner lost a delta update: answer with the full current value (codec 0,
        not a reset, so it is applied like any merged value)."""
        assert self.core is not None
        p = wire.fragment_field(msg.header, len(self.core.fragments), "fetch")
        if not peer.owns(p):
            raise wire.WireError(f"fetch: rank {peer.rank} of {peer.world} does not own fragment {p}")
        upd = self.core.frags[p].current
        self.event(Fetched, learner=peer.learner_id, rank=peer.rank, fragment=self.shard.to_global(p),
                    version=upd.version)
        self._send_update(ident, upd, self._update_frames(peer, upd, full=True))

    def _init(self, ident: bytes, msg: wire.Message) -> None:
        pend = self._pending
        if self.core is not None or pend is None or ident not in pend.seeders:
            return  # late, unasked-for, or from a seeder replaced after init_timeout
        pend.add(ident, msg)
        pend.asked_at = self.clock()  # progress: a slow upload of a large model is not a dead seeder
        if len(pend.values) == len(pend.layout):
            try:
                self._start_core(pend.layout, [list(pend.values[p]) for p in range(len(pend.layout))], pend.settings)
            except ConfigError as exc:  # e.g. a lossy downlink codec for a bfloat16 model
                self._pending = None
                for waiting_ident, _ in pend.waiting:
                    self._send(waiting_ident, wire.encode({"type": "error", "code": "fatal", "reason": str(exc)}))
                raise wire.WireError(f"cannot start on this model: {exc}") from None
            self.event(Initialised, learner=msg.header["learner"])
            self._first = (pend.seeder_id, pend.settings)
            self._pending = None
            for waiting_ident, hello in pend.waiting:
                self._hello(waiting_ident, hello)

    # ------------------------------------------------------------------ core driving
    def _start_core(self, layout: list[FragmentSpec], values: list[list[torch.Tensor]], rules: RunRules) -> None:
        """The core, with the run's rules (H, P, tau, apply rule, DES-LOC) those of the
        learner that set them: the syncer has none of its own."""
        self.core = SyncerCore(rules.config(self.config), layout, values, epoch=self.epoch)
        self._runner = SyncerRunner(self.core, self.clock, send_update=self._on_update, record=self._on_record,
                                    send_moments=self._on_moments, fail_slow=self._on_fail_slow,
                                    merged=self._on_merged)
        self.tracker.versions_to_metrics(self.core)
        if self.service.max_message_bytes is None:
            limit = layout_message_limit(layout)
            # ZeroMQ's pre-read cap was fixed at the bind, before this layout was known.
            self.event(MessageLimit, bytes=limit, max_message_mb=math.ceil(limit / 2**20),
                        zmq_cap=2 * limit if self.service.resume else AUTO_ZMQ_CAP)

    def _drive(self, event: Event, ident: bytes | None = None, join: tuple[int, int] | None = None) -> list[Action]:
        """Feed ``event`` to the core through ``SyncerRunner``, which hands each action to
        the ``_on_*`` methods below; returns the actions (records in the core's fragment
        numbering). ``ident``: the connection whose message caused it (its ``leave`` and
        ``join`` records are rate-limited per connection); ``join``: (rank, world) of the
        rank whose hello this ``LearnerJoined`` is."""
        assert self._runner is not None
        if isinstance(event, LearnerLeft):
            self.metrics.left(event.learner_id)
        self._cause, self._join = ident, join
        try:
            return self._runner.run(event)
        finally:
            self._cause, self._join = None, None

    def _on_update(self, action: SendUpdate) -> None:
        upd = action.update
        if self._join is not None and self._cause is not None:
            # A rank's hello: the current values go to that rank alone, as a rejoin answer
            # (the core addresses learners; this is one rank of one).
            peer = self.peers[self._cause]
            if peer.owns(upd.fragment):
                self._send_update(self._cause, upd, self._update_frames(peer, upd, reset=True), reset=True)
            return
        frames = None  # shared by every peer that receives the whole fragment
        for ident, peer in self.peers.items():
            if peer.learner_id in action.to and peer.owns(upd.fragment):
                if peer.cuts[upd.fragment] is not None:
                    mine = self._update_frames(peer, upd, reset=action.reset)
                else:
                    mine = frames = frames or wire.update_frames(
                        self._out(upd), reset=action.reset, syncer=SyncerSettings.from_config(self.config))
                self._send_update(ident, upd, mine, reset=action.reset)

    def _on_moments(self, action: SendMomentUpdate) -> None:
        frames = None
        for ident, peer in self.peers.items():
            if peer.learner_id in action.to and peer.owns(action.update.fragment):
                frames = frames or wire.moments_update_frames(self._out(action.update))
                self._send(ident, list(frames))

    def _on_record(self, action: SyncerRecord) -> None:
        record = self.shard.record(action)  # the model's fragment numbers from here on
        self.metrics.record(record)  # before the log's rate limit: metrics count every one
        now, cause = self.clock(), self._cause
        if isinstance(record, Joined) and self._join is not None and cause is not None:
            # The core knows learners, not ranks: each rank of a multi-rank learner joins,
            # so its join says which. Per connection: a hello storm (ids are first-come
            # without --learners) costs a bounded number of log lines, the rest counted
            # in 'suppressed'.
            if self._limiter.allow(("join", cause), now, peer=cause.hex()):
                rank, world = self._join
                self._log_record(dataclasses.replace(record, rank=rank, world=world))
            return
        if isinstance(record, Rejected):
            logged = self._limiter.allow(("reject", record.learner), now, learner=record.learner)
        elif isinstance(record, Left) and cause is not None:
            logged = self._limiter.allow(("leave", cause), now, peer=cause.hex())
        else:
            logged = True
        if logged:
            self._log_record(record)
        if isinstance(record, Rejected):
            if record.learner in self.tracker.stats:
                self.tracker.stats[record.learner].rejected += 1
            reason = f"contribution rejected: {record.reason}"
            for rank_ident in self.members.ranks_of(record.learner):
                self._reply_error(rank_ident, "rejected", reason)
        elif isinstance(record, Merged):
            self.tracker.merged(record)

    def _on_fail_slow(self, action: FailSlowAction) -> None:
        self.metrics.failslow(action)  # the core applied it to membership already
        if isinstance(action, AdviseLearner):
            frames = wire.fail_slow_frames(action.report)
            for ident in self.members.ranks_of(action.report.learner):  # every rank: any may act on it
                self._send(ident, list(frames))

    def _on_merged(self, fragments: list[int], seconds: float) -> None:
        self.metrics.merge_compute([seconds] * len(fragments))
        before = self.merges // self.service.checkpoint_every
        self.merges += len(fragments)
        if self.merges // self.service.checkpoint_every > before:
            self.checkpoint()

    def _silent(self, lid: str) -> None:
        """Every rank of learner ``lid`` went silent (``Membership.drop_silent``)."""
        if lid in self.tracker.stats:
            self.tracker.stats[lid].state = "silent"
        if self.core is not None:
            self.assembly.forget(lid, "every rank of the learner went silent")
            self._drive(LearnerLeft(lid, "silent"))

    def _refused(self, lid: str) -> None:
        """The gate refused every rank of learner ``lid``, connected ones included
        (``Membership.through_gate``)."""
        if self.core is not None:
            self._drive(LearnerLeft(lid, "refused"))

    def _expire_pieces(self) -> None:
        """Drop partial contributions that waited too long for a rank, and hellos of
        ranks that went silent at the gate."""
        now = self.clock()
        self.assembly.expire(now, self.service.heartbeat_timeout)
        self.members.expire_gate(now)

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
        self.flush_one(ident)

    def _reply_error(self, ident: bytes, code: str, reason: str) -> None:
        self._send(ident, wire.encode({"type": "error", "code": code, "reason": reason}), droppable=True)

    def _refuse(self, ident: bytes, kind: type[ServiceEvent], code: str, reason: str, **fields: Any) -> None:
        """Refuse a message from ``ident``: counted in ``rejected_messages``, logged as a
        ``kind`` event (``_peer_event``: ``fields`` and the reason) and answered with an
        error ``code`` giving the reason."""
        self.rejected_messages += 1
        self._peer_event(ident, kind, **fields, reason=reason)
        self._reply_error(ident, code, reason)

    def _peer_event(self, ident: bytes, kind: type[ServiceEvent], **fields: Any) -> bool:
        """A ``kind`` event of bad input from connection ``ident`` (its ``peer``), rate-limited
        per kind over all connections, then per connection (counted in the metrics, by
        event, whether logged or not). Whether it was logged."""
        self.metrics.refusal(kind.event)
        now = self.clock()
        every = self.service.log_burst * ALL_CONNECTIONS_BURST
        if (self._limiter.allow((kind.event, _ALL_CONNECTIONS), now, burst=every)
                and self._limiter.allow((kind.event, ident), now, peer=ident.hex())):
            self.event(kind, peer=ident.hex(), **fields)
            return True
        return False

    def auth_denied(self, text: str) -> None:
        """A refused Curve handshake, from the authenticator's thread. A client with an
        unknown key retries every reconnect interval, and a stranger can mint keys at
        will, so refusals share one rate limit, with a count of those left out (all are
        counted in the metrics)."""
        self.metrics.refusal(AuthDenied.event)
        if self._limiter.allow((AuthDenied.event,), self.clock()):
            self.event(AuthDenied, reason=text)

    def _summarise_suppressed(self, expired: list[tuple[Any, int, dict[str, Any]]]) -> None:
        for key, count, fields in expired:
            self.event(Suppressed, of=key[0], count=count, window_s=LOG_WINDOW_S, **fields)

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
        self.flush_one(ident)

    def flush(self) -> None:
        """Send what waits for every connection, as far as each has room."""
        for ident in [i for i, box in self._outboxes.items() if box]:
            self.flush_one(ident)

    def flush_one(self, ident: bytes) -> None:
        """Send what waits for connection ``ident`` through the transport's ``send``
        until it has no room (``zmq.Again``) or is gone (``PeerGone``)."""
        box = self._outboxes.get(ident)
        if box is None:
            return
        lid = self.tracker.ident_learner.get(ident, "")
        stats = self.tracker.stats.get(lid)

        def send(frames: list[Any]) -> None:
            self._transmit(ident, frames)
            nbytes = _nbytes(frames)
            if stats is not None:
                stats.bytes_out += nbytes
            self.metrics.sent(lid if stats is not None else None, nbytes)

        try:
            done = box.flush(send, self.clock())
        except PeerGone as exc:
            self.event(SendDropped, peer=ident.hex(), reason=str(exc))
            del self._outboxes[ident]
            return
        if done and ident not in self.peers:  # gone: nothing it has not acknowledged matters now
            del self._outboxes[ident]
            if not any(i == ident for i, _ in (self._pending.waiting if self._pending else ())):
                self.tracker.ident_learner.pop(ident, None)

    # ------------------------------------------------------------------ state
    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (``Checkpoints.save``); None without a core or a directory."""
        return self.checkpoints.save(self.core, layout=self._layout, merges=self.merges,
                                     rejected_messages=self.rejected_messages, first=self._first)

    def status(self) -> SyncerStatus:
        """What ``rackmend status`` shows: the syncer, every fragment's round and every
        learner seen (or expected) (``Tracker.status``). Ages and durations in seconds."""
        now = self.clock()
        core = self.core
        syncer = SyncerPart(
            endpoint=self.endpoint, shard=str(self.shard),
            state="running" if core is not None else "initialising" if self._pending else "waiting for a learner",
            uptime_s=age_s(now, self.started_at), protocol=wire.PROTOCOL_VERSION, merges=self.merges,
            rejected_messages=self.rejected_messages, rejected_contributions=core.rejected if core is not None else 0,
            superseded_updates=self.superseded_updates, deterministic=self.config.deterministic,
            min_quorum=self.config.syncer.min_quorum, grace_s=round(core.grace(), 4) if core is not None else None,
            curve=bool(self.service.secret_key_file), checkpoint_age_s=age_s(now, self.checkpoints.at),
            metrics=self.metrics_url, status_requests=self.status_requests)
        return self.tracker.status(now, syncer, core, self.peers.values(), self.config.syncer.learners)

    def _resume(self) -> None:
        saved = self.checkpoints.load()
        self._layout = saved.layout
        if saved.first is None:
            # Written before hellos carried the run's rules: the first hello brings them.
            self._unruled = saved
        else:
            self._first = saved.first
            self._restore(saved, saved.first[1])

    def _restore(self, saved: Saved, rules: RunRules) -> None:
        """Start the core on a checkpoint's values and state, under ``rules``."""
        self._start_core(self.shard.fragments(saved.layout), saved.values, rules)
        assert self.core is not None
        try:
            self.core.load_state_dict(saved.tensors, saved.meta)
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # what check_meta does not know of
            raise ConfigError(f"resume: the checkpoint in {self.checkpoints.directory} does not fit this syncer "
                              f"({type(exc).__name__}: {exc}); start without --resume or restore a copy") from None
        self.tracker.versions_to_metrics(self.core)
        self.merges = saved.meta.merges
        self.rejected_messages = saved.meta.rejected_messages
        self.event(Resumed, versions=tuple(self.core.versions), shard=self.checkpoints.shard_name())

    def event(self, kind: type[ServiceEvent], **fields: Any) -> None:
        """Log one of the service's own events, now."""
        self._log_record(kind(t=self.clock(), **fields))

    def _log_record(self, record: SyncerRecord) -> None:
        """Log a record: the core's (its fragment already in the model's numbering) or the
        service's own (``rackmend.service.events``)."""
        line = record.to_record()
        self._say(line, record.level, record.log_prefix)
        self._record(line)

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
        """Hand ``record`` to ``emit`` (``SyncerService`` writes it to the JSONL log)."""
        self._emit(record)
