"""Assembling a sharded learner's contribution from its ranks' pieces.

Each rank of a sharded rack sends the pieces it owns of a due fragment as a
contribution of its own (``Contribution.pieces`` set). ``Assembler`` collects them per
(learner, fragment) and returns one whole-fragment ``Contribution``, the only kind the
syncer core takes, once every rank that owns a piece of the fragment has sent its
piece for the same inner step. What is left incomplete is dropped, with a record that
says why: a newer step of the same fragment arrived first, a rank restarted (its
pieces come in a new session, from step 1 again), or the bound passed to ``expire``
elapsed (a rank died or its link stalled).

The whole contribution's counters: ``base_version``, ``base_epoch`` and ``c_steps``
must be the same in every piece (the ranks step together; a difference drops the
assembly as inconsistent); ``c_tokens`` is the mean over the pieces (each rank counts
its own tokens times the world size, so for equal batches they agree, and for uneven
data-parallel batches the mean is the learner's total); ``step_time`` is the largest
(a rack steps at its slowest rank's pace); the fail-slow timing (``rank``,
``rank_steps``, ``rank_step_time``) is that of the slowest rank; ``session``, ``seq``
and ``merge_gain`` are the lowest sending rank's (the core's replay guard follows that
rank; the others' sequence numbers are checked here).

Sans-I/O: time is passed in; records (``Incomplete``, ``PieceDropped``) are returned, not
written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution
from rackmend.core.pieces import Piece
from rackmend.core.records import Incomplete, PieceDropped

__all__ = ["Assembler", "assemble"]


def assemble(spec: FragmentSpec, parts: Sequence[tuple[Sequence[Piece], Sequence[torch.Tensor]]]
             ) -> tuple[torch.Tensor, ...]:
    """Whole tensors of fragment ``spec`` from (pieces, values) of ranks whose pieces
    cover it exactly once (checked when the learner joined: ``cover_problem``)."""
    whole = [torch.empty(t.shape, dtype=t.dtype) for t in spec.tensors]
    for pieces, values in parts:
        for pc, value in zip(pieces, values):
            whole[pc.tensor][pc.slices()] = value
    return tuple(whole)


@dataclass
class _Partial:
    step: int
    expected: frozenset[int]
    """Ranks that own a piece of the fragment."""
    parts: dict[int, Contribution]
    started: float


class Assembler:
    """Per (learner, fragment), the pieces of one inner step received so far."""

    def __init__(self, fragments: Sequence[FragmentSpec]) -> None:
        self.fragments = list(fragments)
        self._partial: dict[tuple[str, int], _Partial] = {}
        self._seq: dict[tuple[str, int, int], tuple[int, int]] = {}
        """Per (learner, rank, fragment): the session and highest seq taken (replay guard
        for every rank's pieces; the core's guard sees the lowest rank's only)."""
        self.dropped = 0
        """Incomplete contributions dropped."""

    def add(self, c: Contribution, expected: frozenset[int], now: float
            ) -> tuple[Contribution | None, list[Incomplete | PieceDropped]]:
        """Take rank ``c.rank``'s pieces; ``expected``: the ranks that own pieces of the
        fragment. Returns the whole contribution once complete (else None) and records
        of what was dropped."""
        assert c.pieces is not None
        key = (c.learner_id, c.fragment)
        records: list[Incomplete | PieceDropped] = []
        seq_key = (c.learner_id, c.rank, c.fragment)
        last = self._seq.get(seq_key)
        if c.seq > 0 and last is not None and last[0] == c.session and c.seq <= last[1]:
            return None, [self._piece_dropped(now, c, reason=(
                f"replay or older send: seq {c.seq} of session {c.session}, seq {last[1]} was taken already"))]
        # A rank sending in a new session is a new process (torchrun relaunched the rack);
        # its step count starts again, so pieces of a later step waiting here are from
        # before the restart and can never complete.
        restarted = c.seq > 0 and last is not None and last[0] != c.session
        if c.seq > 0:
            self._seq[seq_key] = (c.session, c.seq)
        part = self._partial.get(key)
        if part is not None and c.step < part.step and restarted:
            records.append(self._drop(key, now, f"rank {c.rank} restarted (a new session, at step {c.step}); the "
                                                f"pieces of step {part.step} were sent before it and cannot complete"))
            part = None
        if part is not None and c.step < part.step:
            return None, [self._piece_dropped(now, c, reason=(
                f"rank {c.rank}'s piece of step {c.step} arrived after pieces of step {part.step}"))]
        if part is not None and c.step > part.step:
            records.append(self._drop(key, now, f"superseded: rank {c.rank} sent step {c.step} before the "
                                                f"pieces of step {part.step} were complete"))
            part = None
        if part is None:
            part = self._partial[key] = _Partial(c.step, expected, {}, now)
        if c.rank in part.parts:
            records.append(self._piece_dropped(now, c, reason=f"rank {c.rank} sent step {c.step} twice"))
            return None, records
        first = next(iter(part.parts.values()), None)
        if first is not None:
            mine = (c.base_version, c.base_epoch, c.c_steps)
            theirs = (first.base_version, first.base_epoch, first.c_steps)
            if mine != theirs:
                records.append(self._drop(key, now, (
                    f"ranks disagree on (base_version, base_epoch, c_steps): rank {c.rank} {mine}, rank "
                    f"{first.rank} {theirs}; the rack's ranks did not step or apply together")))
                return None, records
        part.parts[c.rank] = c
        if not part.expected <= set(part.parts):
            return None, records
        del self._partial[key]
        return self._whole(part), records

    def expire(self, now: float, bound: float) -> list[Incomplete]:
        """Drop what has waited longer than ``bound`` seconds for its missing pieces."""
        late = [key for key, part in self._partial.items() if now - part.started > bound]
        return [self._drop(key, now, f"incomplete after {bound:g}s (a rank died, restarted or is cut off)")
                for key in late]

    def forget(self, learner_id: str, now: float, reason: str) -> list[Incomplete]:
        """Drop every partial contribution of a learner that left."""
        return [self._drop(key, now, reason) for key in list(self._partial) if key[0] == learner_id]

    def _drop(self, key: tuple[str, int], now: float, reason: str) -> Incomplete:
        part = self._partial.pop(key)
        self.dropped += 1
        return Incomplete(t=now, learner=key[0], fragment=key[1], step=part.step, ranks=tuple(sorted(part.parts)),
                          missing=tuple(sorted(part.expected - set(part.parts))),
                          reason=f"learner {key[0]}'s contribution to fragment {key[1]} (step {part.step}) dropped: "
                                 f"{reason}")

    @staticmethod
    def _piece_dropped(now: float, c: Contribution, reason: str) -> PieceDropped:
        return PieceDropped(t=now, learner=c.learner_id, fragment=c.fragment, rank=c.rank, step=c.step,
                            reason=f"learner {c.learner_id}: {reason}")

    def _whole(self, part: _Partial) -> Contribution:
        parts = [part.parts[r] for r in sorted(part.parts)]
        lead = parts[0]
        slowest = max(parts, key=lambda c: c.rank_step_time)
        tokens = {c.c_tokens for c in parts}
        spec = self.fragments[lead.fragment]
        return Contribution(
            learner_id=lead.learner_id, fragment=lead.fragment, base_version=lead.base_version, step=lead.step,
            c_steps=lead.c_steps,
            c_tokens=tokens.pop() if len(tokens) == 1 else sum(c.c_tokens for c in parts) / len(parts),
            step_time=max(c.step_time for c in parts),
            tensors=assemble(spec, [(c.pieces or (), c.tensors) for c in parts]),
            merge_gain=lead.merge_gain, session=lead.session, seq=lead.seq, base_epoch=lead.base_epoch,
            rank=slowest.rank, rank_steps=slowest.rank_steps, rank_step_time=slowest.rank_step_time)
