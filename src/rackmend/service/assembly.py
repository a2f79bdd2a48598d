"""Values that arrive piece-wise: each rank of a sharded learner sends the pieces it owns
of a fragment, and the core sees the whole once every rank owning a piece of that
fragment has sent its piece.

- ``PieceAssembly``: contributions. It checks a rank's pieces against what it declared
  at hello, holds the partial contributions (``rackmend.core.assembly.Assembler``, which
  does the work without I/O), drops those that waited too long or whose learner left,
  and logs and counts what it dropped.
- ``PendingInit``: a fresh syncer's initial values, from the first learner (whole
  fragments from a plain rank, pieces from each rank of a sharded one).

Which ranks own which pieces is ``rackmend.service.membership``'s; who is asked to seed
the model, its timeout and starting the core are ``rackmend.service.core``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rackmend.core.assembly import Assembler, assemble
from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution
from rackmend.core.pieces import Piece, RankPieces, whole_pieces
from rackmend.core.records import Incomplete, PieceDropped, SyncerRecord
from rackmend.core.settings import RunRules
from rackmend.core.shards import Shard
from rackmend.service.events import BadMessage
from rackmend.service.membership import Peer, Refuse
from rackmend.service.metrics import SyncerMetrics
from rackmend.transport import wire

__all__ = ["PieceAssembly", "PendingInit"]


class PieceAssembly:
    """Partial contributions of sharded learners, by learner, fragment and step.

    ``log_record`` logs one of the core's records; ``refuse`` is the service's (see
    ``membership.Refuse``)."""

    def __init__(self, shard: Shard, clock: Callable[[], float], metrics: SyncerMetrics, *,
                 log_record: Callable[[SyncerRecord], None], refuse: Refuse) -> None:
        self.shard = shard
        self.clock = clock
        self.metrics = metrics
        self._log_record = log_record
        self._refuse = refuse
        self._assembler: Assembler | None = None
        """Made with the first piece: the core's fragments are known by then."""

    def add(self, ident: bytes, peer: Peer, c: Contribution, fragments: list[FragmentSpec],
            owners: dict[int, RankPieces]) -> Contribution | None:
        """A rank's pieces of a contribution; the learner's whole contribution once every
        rank owning a piece of the fragment (``owners``: each rank's pieces) has sent its
        piece of that step, else None."""
        p = c.fragment
        if c.pieces != peer.pieces[p]:
            reason = (f"learner {c.learner_id} rank {c.rank} sent pieces {list(c.pieces)[:4]} of fragment {p}, "
                      f"but declared {list(peer.pieces[p])[:4]} at hello")
            self._refuse(ident, BadMessage, "rejected", reason)
            return None
        if self._assembler is None:
            self._assembler = Assembler(fragments)
        expected = frozenset(r for r, ps in owners.items() if ps[p])
        whole, records = self._assembler.add(c, expected, self.clock())
        self._records(records)
        return whole

    def expire(self, now: float, bound: float) -> None:
        """Drop partial contributions that waited more than ``bound`` seconds for a rank."""
        if self._assembler is not None:
            self._records(self._assembler.expire(now, bound))

    def forget(self, lid: str, reason: str) -> None:
        """Drop learner ``lid``'s partial contributions (it left, or went silent)."""
        if self._assembler is not None:
            self._records(self._assembler.forget(lid, self.clock(), reason))

    def _records(self, records: list[Incomplete] | list[Incomplete | PieceDropped]) -> None:
        for record in map(self.shard.record, records):
            self.metrics.record(record)  # an incomplete contribution counts as rejected
            self._log_record(record)


@dataclass
class PendingInit:
    """Layout offered by the first learner while its initial values are on the way."""

    layout: list[FragmentSpec]
    seeders: dict[bytes, RankPieces | None]
    """The connections asked for the initial values, with the pieces each owns (None: a
    plain rank, which sends every fragment whole); only their ``init`` messages count
    (values of two learners' different initialisations must never be mixed). One
    connection for a plain learner, every rank's for a sharded one."""
    seeder_id: str
    settings: RunRules
    asked_at: float
    """When the seeder was asked, or last delivered a fragment."""
    values: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    parts: dict[int, dict[bytes, tuple[tuple[Piece, ...], tuple[Any, ...]]]] = field(default_factory=dict)
    """Per fragment, the pieces of a sharded seeder received so far, by connection."""
    waiting: list[tuple[bytes, Any]] = field(default_factory=list)

    def add(self, ident: bytes, msg: wire.Message) -> None:
        """One ``init`` message from the seeder connection ``ident``: a fragment's value
        is in ``values`` once it is whole (a ``WireError`` for an unknown fragment, or
        other pieces than the rank declared)."""
        p = wire.fragment_field(msg.header, len(self.layout), "init")
        owned = self.seeders[ident]
        if owned is None:
            tensors = wire.parse_tensors(msg, self.layout[p])
            self.values[p] = tuple(t.clone() for t in tensors)
        else:
            pieces, tensors, encoded = wire.parse_pieces(msg, self.layout, p)
            if (pieces if pieces is not None else whole_pieces(self.layout, 0, 1)[p]) != owned[p] or encoded:
                raise wire.WireError(f"init of fragment {p} carries other pieces than the rank declared at hello")
            parts = self.parts.setdefault(p, {})
            parts[ident] = (owned[p], tuple(t.clone() for t in tensors))
            if set(parts) >= {i for i, ps in self.seeders.items() if ps is not None and ps[p]}:
                self.values[p] = assemble(self.layout[p], list(parts.values()))
