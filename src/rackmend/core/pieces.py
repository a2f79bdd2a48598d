"""Pieces: which part of each global tensor a learner rank sends and receives.

A rank of a sharded rack (FSDP2, tensor parallel, HSDP) holds only a block of each
parameter. A *piece* names such a block: the tensor's index in its fragment, the
block's offsets in the global tensor and its shape. A rank *owns* the pieces it
sends and receives; where several ranks hold the same block (DDP, HSDP's replicate
dimension, a TP ``Replicate`` placement) exactly one of them owns it, chosen by
``owner`` (the one place that rule is written). ``rank_layout`` applies it to every
rank's blocks (``RackBlocks``, gathered by the learner driver) and gives one rank's
``RankLayout``, which the learner core runs on. A plain rack's rank owns whole
tensors: ``whole_pieces`` gives that layout, which is the one a learner that declares
no pieces at hello has.

Pure functions and frozen values: nothing here knows torch.distributed, sockets or
clocks. Reading a DTensor's placements is ``rackmend.learner.pieces``'s job; assembling
a learner's pieces into whole tensors is the syncer service's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rackmend.core.fragments import FragmentSpec, TensorSpec

__all__ = [
    "Piece",
    "RankPieces",
    "RackBlocks",
    "RankLayout",
    "Holding",
    "owner",
    "holders",
    "differing_copies",
    "rank_layout",
    "plain_layout",
    "whole_pieces",
    "is_whole",
    "wire_pieces",
    "pieces_problem",
    "cover_problem",
    "piece_spec",
    "cut",
    "pieces_to_wire",
    "pieces_from_wire",
]


@dataclass(frozen=True)
class Piece:
    """A block of one tensor of a fragment: ``tensor`` (its index in the fragment),
    where the block starts in the global tensor and its shape."""

    tensor: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def covers(self, spec: TensorSpec) -> bool:
        """Whether this block is the whole of ``spec``."""
        return self.shape == spec.shape and not any(self.offsets)


RankPieces = tuple[tuple[Piece, ...], ...]
"""Per fragment, the pieces one rank owns, in tensor order (an empty tuple: none)."""


RackBlocks = Sequence[Sequence[Sequence[Piece | None]]]
"""Per rank of a rack, per fragment and tensor: the block that rank holds (None: it
holds no element of that tensor, e.g. an empty uneven shard)."""


def owner(fragment: int, holders: Sequence[int]) -> int:
    """The rank that sends and receives a block several ranks hold: the
    ``fragment mod len(holders)``-th of them in ascending order. For a plain rack
    (every rank holds every tensor) that is rank ``fragment mod world``, so the
    fragments of a DDP rack are striped over its ranks."""
    # A range (every rank of a plain rack) is ascending already: no list of world entries.
    ranks = holders if isinstance(holders, range) and holders.step > 0 else sorted(holders)
    return ranks[fragment % len(ranks)]


@dataclass(frozen=True)
class Holding:
    """A block some ranks of a rack hold, those ranks (ascending) and which of them owns it."""

    block: Piece
    ranks: tuple[int, ...]
    owner: int


def holders(fragments: Sequence[FragmentSpec], rack: RackBlocks) -> list[list[list[Holding]]]:
    """Per fragment and tensor: each distinct block some rank of ``rack`` holds, with the
    ranks holding it and its ``owner``, ordered by those ranks. The same on every rank
    given the same ``rack``, so collective set-up (process groups) can follow this order."""
    out = []
    for f in fragments:
        per_tensor = []
        for i in range(len(f.tensors)):
            by_block: dict[Piece, list[int]] = {}
            for r, blocks in enumerate(rack):
                if blocks[f.index][i] is not None:
                    by_block.setdefault(blocks[f.index][i], []).append(r)
            per_tensor.append([Holding(b, tuple(rs), owner(f.index, rs))
                               for b, rs in sorted(by_block.items(), key=lambda kv: kv[1])])
        out.append(per_tensor)
    return out


def differing_copies(fragments: Sequence[FragmentSpec], rack: RackBlocks,
                     prints: Sequence[Sequence[Sequence[int | None]]]) -> list[tuple[str, dict[int, int]]]:
    """The parameters of which ranks holding the same block hold different values:
    (tensor name, {rank: fingerprint} of those ranks), given every rank's fingerprint
    of each block it holds (``prints[rank][fragment][tensor]``; None: not compared).
    rackmend takes such copies to be alike (one owner sends the block for all of them,
    and the merged value overwrites every copy), which holds for DDP replicas, HSDP's
    replicate dimension and a TP ``Replicate`` placement; copies that differ are parts
    of a tensor sharded in a way rackmend cannot see (hand-made tensor parallelism,
    FSDP1's flat parameters) or replicas not yet made equal. Buffers are left out:
    DDP with ``broadcast_buffers=False`` keeps them apart on purpose."""
    out = []
    for f, per_fragment in zip(fragments, holders(fragments, rack)):
        for i, per_tensor in enumerate(per_fragment):
            if f.tensors[i].is_buffer:
                continue
            for held in per_tensor:
                seen = {r: prints[r][f.index][i] for r in held.ranks}
                if len({v for v in seen.values() if v is not None}) > 1:
                    out.append((f.tensors[i].name, {r: v for r, v in seen.items() if v is not None}))
    return out


@dataclass(frozen=True)
class RankLayout:
    """One rank's part of its rack, per fragment: the block it holds of each tensor and
    the pieces it owns (sends, and receives merged values of). Build with
    ``rank_layout`` or ``plain_layout``."""

    blocks: tuple[tuple[Piece | None, ...], ...]
    """Per fragment and tensor, this rank's block (None: it holds nothing of the tensor).
    A fragment's local value is one tensor per entry, in this order."""
    owned: RankPieces
    """Per fragment, the blocks of ``blocks`` this rank owns, in tensor order."""
    sharded: bool
    """Whether ``owned`` differs from a plain rack's whole-fragment striping: then the
    pieces travel in the hello and in every message."""


def rank_layout(fragments: Sequence[FragmentSpec], rack: RackBlocks, rank: int) -> RankLayout:
    """``rank``'s layout in ``rack``: of every block several ranks hold, ``owner`` picks
    the one that owns it."""
    if not 0 <= rank < len(rack):
        raise ValueError(f"rank {rank} is not in the rack's 0..{len(rack) - 1}")
    mine = rack[rank]
    if len(mine) != len(fragments) or any(len(b) != len(f.tensors) for f, b in zip(fragments, mine)):
        raise ValueError(f"rank {rank}'s blocks do not match the layout of {len(fragments)} fragments "
                         "(one entry per fragment, one block or None per tensor)")
    owned = tuple(tuple(h.block for per_tensor in per_fragment for h in per_tensor if h.owner == rank)
                  for per_fragment in holders(fragments, rack))
    return RankLayout(tuple(tuple(b) for b in mine), owned, owned != whole_pieces(fragments, rank, len(rack)))


def plain_layout(fragments: Sequence[FragmentSpec], rank: int, world: int) -> RankLayout:
    """A plain rack's rank (DDP, or one process): it holds every tensor whole and owns the
    fragments ``owner`` stripes onto it."""
    return RankLayout(tuple(_whole(f) for f in fragments), whole_pieces(fragments, rank, world), False)


def whole_pieces(fragments: Sequence[FragmentSpec], rank: int, world: int) -> RankPieces:
    """What ``rank`` of a plain rack of ``world`` ranks owns: every tensor of the fragments
    ``owner`` gives it, whole."""
    return tuple(_whole(f) if owner(f.index, range(world)) == rank else () for f in fragments)


def _whole(spec: FragmentSpec) -> tuple[Piece, ...]:
    return tuple(Piece(i, (0,) * len(t.shape), t.shape) for i, t in enumerate(spec.tensors))


def is_whole(spec: FragmentSpec, pieces: Sequence[Piece]) -> bool:
    """Whether ``pieces`` are every tensor of ``spec``, whole (one rank owns the fragment)."""
    return (len(pieces) == len(spec.tensors)
            and all(pc.tensor == i and pc.covers(t) for i, (pc, t) in enumerate(zip(pieces, spec.tensors))))


def wire_pieces(spec: FragmentSpec, pieces: Sequence[Piece]) -> tuple[Piece, ...] | None:
    """What a message about ``spec`` carrying ``pieces`` names: None when they are the
    whole fragment (it travels as from a plain rack), else the pieces."""
    return None if is_whole(spec, pieces) else tuple(pieces)


def pieces_problem(fragments: Sequence[FragmentSpec], pieces: RankPieces) -> str | None:
    """Why one rank's declared pieces cannot be right for ``fragments``, or None: one
    entry per fragment, tensors ascending and each at most once, every block non-empty
    (unless it is the whole of an empty tensor) and inside its tensor's global shape with
    as many dimensions."""
    if len(pieces) != len(fragments):
        return f"pieces are declared for {len(pieces)} fragments, the layout has {len(fragments)}"
    for f, owned in zip(fragments, pieces):
        last = -1
        for pc in owned:
            if not last < pc.tensor < len(f.tensors):
                return (f"fragment {f.index}: piece of tensor {pc.tensor} is out of order, repeated or beyond "
                        f"the fragment's {len(f.tensors)} tensors")
            last = pc.tensor
            spec = f.tensors[pc.tensor]
            where = f"fragment {f.index}, {spec.name} {list(spec.shape)}: piece at {list(pc.offsets)} of {list(pc.shape)}"
            if len(pc.offsets) != len(spec.shape) or len(pc.shape) != len(spec.shape):
                return f"{where} has another number of dimensions than the tensor"
            if pc.covers(spec):
                continue  # the whole tensor, which may have no elements (a plain rack's empty tensor)
            if pc.numel == 0:
                return f"{where} is empty (a rank owning nothing of a tensor declares no piece of it)"
            if any(o < 0 or s < 1 or o + s > g for o, s, g in zip(pc.offsets, pc.shape, spec.shape)):
                return f"{where} lies outside the tensor"
    return None


def cover_problem(fragments: Sequence[FragmentSpec], ranks: Sequence[RankPieces]) -> str | None:
    """Why the pieces the ranks of one learner own do not cover every element of every
    tensor exactly once (a gap: nobody would send it; an overlap: two ranks would), or
    None. Marks the covered elements of one tensor at a time (a byte each): the elements
    left unmarked are the gaps, and the pieces' sizes beyond the marked count are overlaps.
    Exact for any shapes of blocks."""
    for f in fragments:
        by_tensor: list[list[tuple[int, Piece]]] = [[] for _ in f.tensors]
        for rank, pieces in enumerate(ranks):
            for pc in pieces[f.index]:
                by_tensor[pc.tensor].append((rank, pc))
        for spec, held in zip(f.tensors, by_tensor):
            total = sum(pc.numel for _, pc in held)
            if total == spec.numel and len(held) == 1:
                continue  # one rank owns it whole (pieces lie inside their tensor: pieces_problem)
            covered = torch.zeros(spec.shape, dtype=torch.bool)
            for _, pc in held:
                covered[pc.slices()] = True
            gaps = spec.numel - int(covered.sum())
            overlaps = total - (spec.numel - gaps)
            if gaps or overlaps:
                owners = ", ".join(f"rank {r} {list(pc.offsets)}+{list(pc.shape)}" for r, pc in held[:8]) or "nobody"
                what = []
                if gaps:
                    what.append(f"{gaps} elements owned by no rank")
                if overlaps:
                    what.append(f"{overlaps} elements owned by more than one rank (counted once per extra owner)")
                return (f"fragment {f.index}, {spec.name} {list(spec.shape)}: {' and '.join(what)} (owned: {owners}"
                        f"{', ...' if len(held) > 8 else ''}). Every element must be sent by exactly one rank")
    return None


def piece_spec(spec: FragmentSpec, pieces: Sequence[Piece]) -> FragmentSpec:
    """A fragment spec listing ``pieces`` as its tensors (same names and dtypes, the
    pieces' shapes): what a message carrying those pieces is checked against."""
    return FragmentSpec(spec.index, spec.offset, tuple(
        TensorSpec(spec.tensors[pc.tensor].name, pc.shape, spec.tensors[pc.tensor].dtype,
                   spec.tensors[pc.tensor].is_embedding, spec.tensors[pc.tensor].is_buffer)
        for pc in pieces))


def cut(values: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> tuple[torch.Tensor, ...]:
    """The blocks ``pieces`` name out of a fragment's whole ``values`` (views)."""
    return tuple(values[pc.tensor][pc.slices()] for pc in pieces)


def pieces_to_wire(pieces: Sequence[Piece]) -> list[list[Any]]:
    return [[pc.tensor, list(pc.offsets), list(pc.shape)] for pc in pieces]


def pieces_from_wire(raw: Any) -> tuple[Piece, ...]:
    """Inverse of ``pieces_to_wire``; ValueError on anything malformed (bounds are
    ``pieces_problem``'s, which needs the layout)."""
    if not isinstance(raw, list):
        raise ValueError("pieces: expected a list")
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and _is_int(entry[0])
                and all(isinstance(v, list) and len(v) <= 8 and all(_is_int(x) for x in v) for v in entry[1:])):
            raise ValueError(f"pieces: malformed entry {str(entry)[:80]} (expected [tensor, offsets, shape])")
        out.append(Piece(entry[0], tuple(entry[1]), tuple(entry[2])))
    return tuple(out)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62
