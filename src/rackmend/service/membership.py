"""Who is connected to the syncer as which learner rank, and who may join.

- ``Peer``: a connection that said hello and was admitted: its learner id, rank and the
  pieces it owns of each fragment.
- ``Membership``: the peers, and every check a hello passes before its rank joins: one
  holder per learner rank (``holder``, ``may_take``: the rank's resume token at once,
  anyone else only after ``takeover_after`` of silence, ``reserved`` past a silent drop), one
  rank per connection and one world size per learner (``admit``), settings and layout
  that fit the run (``settings_agree``), the gate that holds a sharded learner's hellos
  until its ranks cover every tensor (``through_gate``); with Curve, whether a key may
  speak as the learner it names (``key_allows``); and silence (``drop_silent``).

Nothing here sends or feeds the core: refusals leave through the callables it is given,
and what a joined rank then does (contributions, fetches, leave), the core's join and the
seeding of a fresh model are ``rackmend.service.core``'s. Which learner ids a key file
allows is read by ``rackmend.service.identity``.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Callable

from rackmend.config import RunConfig
from rackmend.core.fragments import FragmentSpec, fingerprint, layout_difference
from rackmend.core.pieces import Piece, RankPieces, cover_problem, is_whole, pieces_problem, whole_pieces
from rackmend.core.settings import RunRules, Mismatch, peer_mismatch, same_codec, syncer_mismatch
from rackmend.core.shards import Shard
from rackmend.service.config import ServiceConfig, layout_message_limit
from rackmend.service.events import (
    AuthDenied,
    Gated,
    IdentityRefused,
    SettingsRefused,
    Silent,
    TakenOver,
    UplinkCodecDiffers,
)
from rackmend.transport import wire

__all__ = ["Peer", "Membership"]

log = logging.getLogger("rackmend.syncer")

Refuse = Callable[..., None]
"""``refuse(ident, kind, code, reason, **fields)``: count a refused message, log it
(rate-limited) as a ``kind`` event (``rackmend.service.events``) and answer the
connection with error ``code``."""


@dataclass
class Peer:
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
class Reservation:
    """A learner rank's resume token, issued at its join: a hello that presents it takes
    the rank back at once; any other waits for ``takeover_after`` of silence."""

    token: str
    last_seen: float
    """When the rank was last heard, once its connection was dropped as silent (while a
    connection holds the rank, that connection's ``last_seen`` counts)."""


@dataclass
class _Gated:
    """A hello of a sharded learner's rank, held until every rank of it has said hello."""

    msg: wire.Message
    hello: wire.Hello
    last_seen: float


class Membership:
    """The connected learner ranks (``peers``) and the checks a hello passes to join them.

    ``event``, ``peer_event``, ``reply_error`` and ``refuse`` are the service's: a plain
    record, a rate-limited record of one connection's bad input, an error answer, and the
    three together with the refusal counted (``Refuse``). ``key_ids``: with Curve and an
    allowed-keys directory, the learner ids each public key may use (``setup_curve``)."""

    def __init__(self, config: RunConfig, service: ServiceConfig, shard: Shard, clock: Callable[[], float], *,
                 event: Callable[..., None], peer_event: Callable[..., bool],
                 reply_error: Callable[[bytes, str, str], None], refuse: Refuse,
                 key_ids: dict[str, frozenset[str] | None] | None) -> None:
        self.config = config
        self.service = service
        self.shard = shard
        self.clock = clock
        self._event = event
        self._peer_event = peer_event
        self._reply_error = reply_error
        self._refuse = refuse
        self.key_ids = key_ids
        self.peers: dict[bytes, Peer] = {}
        self.gate: dict[str, dict[bytes, _Gated]] = {}
        """Per sharded learner, hellos of ranks held until all its ranks have said hello."""
        self.learner_pieces: dict[str, dict[int, RankPieces]] = {}
        """Per sharded learner admitted, what each rank owns (kept while ranks come and go)."""
        self.reserved: dict[tuple[str, int], Reservation] = {}
        """Per learner rank that joined and has not left: its resume token, kept past a
        silent drop until ``takeover_after`` of silence."""
        self._uplink_noted: set[str] = set()

    def pieces(self, hello: wire.Hello) -> RankPieces:
        """What the rank that said ``hello`` owns of this shard's fragments (declared pieces, or
        a plain rank's whole fragments by the owner-rank rule, which counts the model's fragments)."""
        return self.shard.select(_rank_pieces(hello.layout, hello))

    def declared(self, hello: wire.Hello) -> RankPieces | None:
        """A sharded rack rank's declared pieces of this shard's fragments; None for a plain rank."""
        return None if hello.pieces is None else self.shard.select(hello.pieces)

    def key_allows(self, ident: bytes, key: str, msg: wire.FromLearner) -> bool:
        """Whether ``key``, the Curve public key (Z85) this message came with, may speak as
        the learner it names (refused and logged as ``auth_denied`` otherwise)."""
        assert self.key_ids is not None
        allowed = self.key_ids.get(key, frozenset())
        lid = msg.learner
        if allowed is None or lid in allowed:
            return True
        reason = (f"the Curve key {key[:8]}... may speak as {sorted(allowed)} only, not as {lid!r}; give this "
                  f"learner its own key, or list {lid!r} in the key file's 'learners' metadata "
                  "(rackmend keygen --learners)")
        self._refuse(ident, AuthDenied, "fatal" if isinstance(msg, wire.HelloIn) else "denied", reason, learner=lid,
                     type=msg.type, key=key)
        return False

    def holder(self, ident: bytes, lid: str, rank: int) -> tuple[bytes, Peer] | None:
        """The other connection that holds learner ``lid``'s rank ``rank``, if any."""
        for other, peer in self.peers.items():
            if other != ident and peer.learner_id == lid and peer.rank == rank:
                return other, peer
        return None

    def ranks_of(self, lid: str) -> list[bytes]:
        return [i for i, p in self.peers.items() if p.learner_id == lid]

    def admit(self, ident: bytes, msg: wire.Message, *, first: tuple[str, RunRules] | None,
              layout: list[FragmentSpec] | None, zmq_cap: int) -> wire.Hello | None:
        """The hello in ``msg`` if it may join (refused, logged and answered otherwise):
        its rank is free or silent (``may_take``), this connection speaks for no other rank,
        its world size is its learner's, and its settings fit (``settings_agree``, given
        the learner that set the run, the model's layout and ZeroMQ's cap, where known)."""
        token = msg.header.get("token")
        token = token if isinstance(token, str) and len(token) <= wire.MAX_TOKEN_CHARS else None
        if not self.may_take(ident, msg.header["learner"], msg.header["rank"], token):
            return None  # before parsing: a storm of hellos costs a dictionary scan each
        held = self.peers.get(ident)
        if held is not None and (held.learner_id, held.rank) != (msg.header["learner"], msg.header["rank"]):
            # One connection speaks for one learner rank (a link never changes id): else one
            # socket could park any number of ids in every round's membership.
            reason = (f"this connection holds learner {held.learner_id} rank {held.rank}; a hello as "
                      f"{msg.header['learner']} rank {msg.header['rank']} needs a connection of its own")
            self._refuse(ident, IdentityRefused, "fatal", reason, learner=msg.header["learner"],
                         rank=msg.header["rank"], type="hello")
            return None
        hello = wire.parse_hello(msg)
        lid, rank = hello.learner_id, hello.rank
        worlds = {p.world for i, p in self.peers.items() if i != ident and p.learner_id == lid}
        if worlds and worlds != {hello.world}:
            reason = (f"learner {lid} is connected with {worlds.pop()} ranks; a hello as its rank {rank} of "
                      f"{hello.world} does not fit (every rank of one learner declares the same world size)")
            self._refuse(ident, IdentityRefused, "busy", reason, learner=lid, rank=rank, type="hello")
            return None
        if not self.settings_agree(ident, hello, first=first, layout=layout, zmq_cap=zmq_cap):
            return None
        return hello

    def may_take(self, ident: bytes, lid: str, rank: int, token: str | None) -> bool:
        """Whether a hello from ``ident`` may claim ``lid``'s rank ``rank``: it presents the
        rank's resume token, or nobody else holds the rank and no token reserves it, or
        the rank has been silent for ``takeover_after``."""
        if self.presents_token(lid, rank, token):
            return True  # the learner itself: its connection or process was replaced
        held = self.reserved.get((lid, rank))
        holder = self.holder(ident, lid, rank)
        peer = self.peers.get(ident)
        if holder is None and (held is None or (peer is not None and (peer.learner_id, peer.rank) == (lid, rank))):
            return True
        silent = self.clock() - (holder[1].last_seen if holder is not None else held.last_seen)  # type: ignore[union-attr]
        if silent >= self.service.takeover_after:
            return True
        where = "live on another connection" if holder is not None else "reserved for the process that held it"
        reason = (f"learner {lid} rank {rank} is {where} (heard {silent:.1f}s ago); a hello without its resume "
                  f"token takes it over only after {self.service.takeover_after:g}s of silence "
                  "(--takeover-after). Two learners with one id? Give each its own --id")
        self._refuse(ident, IdentityRefused, "busy", reason, learner=lid, rank=rank, type="hello")
        return False

    def settings_agree(self, ident: bytes, hello: wire.Hello, *, first: tuple[str, RunRules] | None,
                       layout: list[FragmentSpec] | None, zmq_cap: int) -> bool:
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
        if mismatch is None and first is not None:
            mismatch = peer_mismatch(lid, s, *first)
        difference = layout_difference(layout, hello.layout) if mismatch is None and layout is not None else None
        if difference is not None:
            mismatch = Mismatch("layout", fingerprint(hello.layout), fingerprint(layout), (
                f"parameter layout differs: learner {lid} has {difference}. Its tensors (names, shapes, dtypes) or "
                "how they are split (ScheduleConfig sync_every, num_fragments, packing, sync_buffers) differ from "
                "the model this syncer trains. Start it from the same model definition and config, or start a "
                "fresh syncer (without --resume) for a new model"))
        needed = layout_message_limit(self.shard.fragments(hello.layout))
        if mismatch is None and layout is None and self.service.max_message_bytes is None and needed > zmq_cap:
            # The first learner sets the model. ZeroMQ's cap, fixed at the bind before the model
            # was known, would cut its larger messages off unread: it would retry for ever.
            mb = math.ceil(needed / 2**20)
            mismatch = Mismatch("message_limit", needed, zmq_cap, (
                f"learner {lid}'s largest fragment needs messages of up to {mb} MiB; this syncer was started "
                f"without knowing the model's size and reads at most {zmq_cap >> 20} MiB per message. "
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
            self._peer_event(ident, SettingsRefused, learner=lid, rank=hello.rank, setting=mismatch.setting,
                             learner_value=mismatch.learner_value, syncer_value=mismatch.other_value,
                             reason=mismatch.reason)
            log.warning("refused learner %s: %s", lid, mismatch.reason)
            self._reply_error(ident, "fatal", mismatch.reason)
            return False
        syncer_uplink = self.config.compression.uplink
        if lid not in self._uplink_noted and not same_codec(s.uplink, syncer_uplink):
            # Allowed (each message names its codec), but worth a line: the two may be meant to agree.
            self._uplink_noted.add(lid)
            self._event(UplinkCodecDiffers, learner=lid, learner_codec=s.uplink, syncer_codec=syncer_uplink)
            log.info("learner %s sends uplink codec %r; this syncer was started with --uplink-codec %r "
                     "(accepted: messages name their codec)", lid, s.uplink, syncer_uplink)
        return True

    def through_gate(self, ident: bytes, msg: wire.Message, hello: wire.Hello,
                     refused: Callable[[str], None]) -> list[tuple[bytes, wire.Message]]:
        """Hold a sharded learner's hellos until every one of its ranks has said hello
        (or is connected already), then check that the pieces they own cover every
        element of every tensor exactly once. Returns the hellos to admit now: none while
        ranks are missing or when the cover is wrong. Where the pieces of ranks still
        connected (perhaps the learner's previous run) take part in a wrong cover, it
        waits for those ranks to say hello again; where only new hellos do, every rank of
        the learner is refused (``settings_refused`` with setting ``pieces``), and
        ``refused(learner)`` is called if that dropped its last connected rank."""
        lid, now = hello.learner_id, self.clock()
        gate = self.gate.setdefault(lid, {})
        for other in [i for i, g in gate.items() if i != ident and g.hello.rank == hello.rank]:
            del gate[other]  # the rank said hello again from another connection: the newer one counts
        gate[ident] = _Gated(msg, hello, now)
        ranks: dict[int, RankPieces] = {g.hello.rank: self.pieces(g.hello) for g in gate.values()}
        connected = {p.rank: p.pieces for p in self.peers.values() if p.learner_id == lid and p.rank not in ranks}
        ranks.update(connected)
        if len(ranks) < hello.world:
            self._event(Gated, learner=lid, rank=hello.rank, ranks=tuple(sorted(ranks)), world=hello.world)
            return []
        problem = cover_problem(self.shard.fragments(hello.layout), [ranks[r] for r in range(hello.world)])
        if problem is not None and connected:
            # Ranks still connected may belong to the learner's previous run (killed, not
            # yet timed out), which a relaunch sharded another way replaces as its ranks say
            # hello: wait for their hellos rather than refuse the new run for pieces its
            # predecessor declared. A new hello of every rank is then checked by itself.
            reason = f"with the pieces ranks {sorted(connected)} declared when they connected: {problem}"
            gated = tuple(sorted(r for r in ranks if r not in connected))
            self._event(Gated, learner=lid, rank=hello.rank, ranks=gated, world=hello.world,
                        waiting_for=tuple(sorted(connected)), reason=reason)
            log.info("learner %s: rank %d waits for ranks %s to say hello again (a relaunch sharded another way?) "
                     "before its pieces are checked; %s", lid, hello.rank, sorted(connected), reason)
            return []
        if problem is not None:
            reason = (f"learner {lid}'s ranks do not share its tensors out exactly: {problem}. Each rank must "
                      "declare the blocks it holds of each DTensor (rackmend.learner.pieces does this from the "
                      "placements); are all ranks running the same model and sharding?")
            self._peer_event(ident, SettingsRefused, learner=lid, rank=hello.rank, setting="pieces",
                             learner_value=None, syncer_value=None, reason=reason)
            log.warning("refused learner %s: %s", lid, reason)
            # Every rank is in the gate (no other rank is connected); a rank that said hello
            # again on its connection is a peer too, and goes.
            was_peer = [i for i in gate if self.peers.pop(i, None) is not None]
            for i in gate:
                self._reply_error(i, "fatal", reason)
            del self.gate[lid]
            if was_peer and not any(p.learner_id == lid for p in self.peers.values()):
                refused(lid)
            return []
        del self.gate[lid]
        self.learner_pieces[lid] = ranks
        return [(i, g.msg) for i, g in sorted(gate.items(), key=lambda kv: kv[1].hello.rank)]

    def expire_gate(self, now: float) -> None:
        """Drop hellos of ranks that went silent at the gate (``heartbeat_timeout``)."""
        bound = self.service.heartbeat_timeout
        for lid, gate in list(self.gate.items()):
            for ident in [i for i, g in gate.items() if now - g.last_seen > bound]:
                del gate[ident]
            if not gate:
                del self.gate[lid]

    def take_over(self, ident: bytes, lid: str, rank: int, token: str | None) -> None:
        """Drop another connection that holds ``lid``'s rank ``rank``: the hello on ``ident``
        presented the rank's resume token, or the holder was silent for ``takeover_after``
        (``may_take`` checked)."""
        holder = self.holder(ident, lid, rank)
        if holder is not None:
            del self.peers[holder[0]]
            self._event(TakenOver, learner=lid, rank=rank, peer=ident.hex(), previous=holder[0].hex(),
                        silent_s=round(self.clock() - holder[1].last_seen, 3),
                        token=self.presents_token(lid, rank, token))

    def join(self, ident: bytes, hello: wire.Hello, fragments: list[FragmentSpec]) -> tuple[Peer, str]:
        """``ident`` becomes a peer: the rank of ``hello``, owning its pieces of ``fragments``
        (this shard's). Returns it and the rank's resume token: the one it presented, where
        that is the rank's, else a new one (whoever held the rank before loses it)."""
        pieces = self.pieces(hello)
        cuts = [None if not ps or is_whole(f, ps) else ps for f, ps in zip(fragments, pieces)]
        self.peers[ident] = peer = Peer(hello.learner_id, hello.rank, hello.world, self.clock(), pieces, cuts)
        key = (hello.learner_id, hello.rank)
        if not self.presents_token(*key, hello.token):
            self.reserved[key] = Reservation(secrets.token_hex(wire.TOKEN_BYTES), self.clock())
        return peer, self.reserved[key].token

    def presents_token(self, lid: str, rank: int, token: str | None) -> bool:
        """Whether ``token`` is ``lid``'s rank ``rank``'s resume token (compared in constant time)."""
        held = self.reserved.get((lid, rank))
        return held is not None and token is not None and hmac.compare_digest(held.token, token)

    def release(self, lid: str, rank: int) -> None:
        """A rank that left cleanly: its id is free for anyone at once."""
        self.reserved.pop((lid, rank), None)

    def drop_silent(self, now: float, gone: Callable[[str], None]) -> None:
        """Drop the ranks silent for ``heartbeat_timeout`` (each logged ``silent``);
        ``gone(learner)`` when one was its learner's last rank. Forget the resume tokens
        of ranks silent for ``takeover_after`` with no connection holding them."""
        held_now = {(p.learner_id, p.rank) for p in self.peers.values()}
        for key in [k for k, r in self.reserved.items()
                    if k not in held_now and now - r.last_seen >= self.service.takeover_after]:
            del self.reserved[key]
        for ident, peer in list(self.peers.items()):
            if now - peer.last_seen > self.service.heartbeat_timeout:
                del self.peers[ident]
                held = self.reserved.get((peer.learner_id, peer.rank))
                if held is not None:
                    held.last_seen = peer.last_seen
                self._event(Silent, learner=peer.learner_id, rank=peer.rank,
                            seconds=round(now - peer.last_seen, 3))
                if not self.ranks_of(peer.learner_id):
                    gone(peer.learner_id)
