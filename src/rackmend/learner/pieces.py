"""The learner's view of a sharded rack: each rank's local blocks of the model's tensors.

``RackPieces`` turns the model's tensors of each fragment into what this rank works
on: for a ``DTensor`` (FSDP2's ``fully_shard``, tensor parallelism, HSDP) its local
shard, ``to_local()`` (a view: writing it writes the parameter; nothing ever gathers
a whole parameter), placed in the global tensor from its placements over the mesh
(``compute_local_shape_and_global_offset``, uneven shards included); a plain tensor
is one block covering all of it. The ranks then exchange their blocks' places (a few
integers each, once) so that every rank knows who else holds the same block: of
those, ``rackmend.core.pieces.owner`` picks the one that sends it and receives its
updates (``layout``, this rank's ``RankLayout``, which the learner core runs on); the
others get the value from it by a broadcast inside the rack (``spread``), over a
process group of exactly the ranks holding that block.

The rules (which pieces travel, the outer gradient over them, when values apply) are
the learner core's (``rackmend.core.learner``); this module holds the collectives the
driver answers the core with: ``gather_offers`` (every rank's offers of a step, from
which the core decides what changes) and ``spread`` received values to the ranks that
hold copies. With one rank everything is whole and owned.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

import torch

from rackmend.config import ConfigError
from rackmend.core.fragments import FragmentSpec, fingerprint
from rackmend.core.learner import MAX_OFFER_VALUES, Change, Offer
from rackmend.core.messages import Update
from rackmend.core.pieces import Piece, differing_copies, holders, rank_layout
from rackmend.transport.base import TransportError

__all__ = ["RackPieces", "local_block", "bit_sum", "refuse_fsdp1", "refuse_differing_copies"]

log = logging.getLogger("rackmend.learner")

_MAX_ID_BYTES = 128
"""The longest learner id the wire accepts (``rackmend.transport.wire``), in bytes."""

_NONE = -(2**62)
"""Neutral value of a MAX all-reduce (no rank reports anything this small)."""


def local_block(t: torch.Tensor, index: int) -> tuple[torch.Tensor, Piece | None]:
    """(the tensor this rank holds of ``t``, its place in the global tensor); the place
    is None when the rank holds no element of it (an uneven shard can be empty)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch without distributed support: no DTensor either
        DTensor = None  # type: ignore[assignment,misc]
    if DTensor is None or not isinstance(t, DTensor):
        # Whole even when empty: every rank holds it, so the rack stays plain (a None here
        # would read as a block missing on this rank and make a single process "sharded").
        return t.detach(), Piece(index, (0,) * t.dim(), tuple(t.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [p for p in t.placements if not isinstance(p, (Shard, _StridedShard, Replicate))]
    if odd:  # Partial: the local tensor is a summand, not a block
        raise ConfigError(f"a DTensor parameter has placement {odd[0]} (placements {tuple(t.placements)}); rackmend "
                          "synchronises Shard and Replicate placements only (FSDP2, tensor parallel, HSDP)")
    local = t.to_local().detach()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise ConfigError(f"a DTensor's local tensor has shape {list(local.shape)}, its placements "
                          f"{tuple(t.placements)} say {list(shape)} (padded shards are not supported)")
    if not local.numel():
        return local, None
    if any(isinstance(p, _StridedShard) for p in t.placements) and not _contiguous(t):
        raise ConfigError(f"a DTensor parameter's local shard (placements {tuple(t.placements)}) is not one "
                          "block of the global tensor; rackmend sends blocks only")
    return local, Piece(index, tuple(int(o) for o in offsets), tuple(int(s) for s in shape))


def refuse_fsdp1(model: torch.nn.Module) -> None:
    """Raise if ``model`` has a module wrapped in FSDP1 (``FullyShardedDataParallel``): its
    ranks keep their parameters as slices of flat buffers, plain tensors whose place in
    the global tensors nothing tells rackmend (with ``use_orig_params=False`` every rank's
    slice even has the same shape, and would be taken for a copy of one tensor)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be FSDP1
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        raise ConfigError(
            "the model is wrapped in FSDP1 (FullyShardedDataParallel), which keeps each rank's parameters as "
            "slices of flat buffers that rackmend cannot place in the global tensors; shard it with FSDP2, "
            "torch.distributed.fsdp.fully_shard, instead (docs/integration.md, 'Sharded models'), or use "
            "DistributedDataParallel for a replicated rack")


def _differ_text(differ: Sequence[tuple[str, dict[int, int], bool]]) -> str:
    named = "; ".join(f"{name} (ranks {', '.join(map(str, sorted(seen)))}: {len(set(seen.values()))} different "
                      "values)" for name, seen, _ in differ[:3])
    return (f"{len(differ)} parameters that several ranks of this rack hold as copies of one block differ between "
            f"those ranks: {named}{' ...' if len(differ) > 3 else ''}")


def refuse_differing_copies(differ: Sequence[tuple[str, dict[int, int], bool]]) -> None:
    """After the rack's first step (``RackPieces.differing_copies`` then): raise if copies
    differ by more than rounding, warn if by rounding only. rackmend takes copies to be
    alike (one rank sends a block for all, the merged value overwrites every copy): a
    rack that does not keep them equal loses all but one rank's values silently."""
    real = [d for d in differ if not d[2]]
    if real:
        raise ConfigError(
            f"{_differ_text(real)} after the first step, though the join made them equal: this rack does not keep "
            "them equal. rackmend takes a plain tensor (or a DTensor's Replicate placement) of a multi-rank learner "
            "to be the same on every rank holding it: one rank sends it for all and the merged value overwrites "
            "the others'. If each rank holds a different part of it (hand-made tensor parallelism), shard it as a "
            "DTensor (FSDP2's fully_shard, parallelize_module); if the ranks train on different data, synchronise "
            "their gradients (DistributedDataParallel)")
    if differ:
        log.warning("%s after the first step by rounding only (kernels that sum in varying order); each merge puts "
                    "one value on every copy again", _differ_text(differ))


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(t: torch.Tensor) -> torch.Tensor | None:
    """An exact summary of ``t``'s bits, a 0-d int64 tensor on its device: the sum
    (wrapping) of its elements read as integers of their width. Integer addition is
    associative, so equal copies give equal fingerprints on any rank and device,
    whatever order the sum runs in. Values that differ almost always give different
    ones (the same elements in another order would not: a check of copies, not of
    order). None for an element width with no integer type."""
    as_int = _INT_OF_WIDTH.get(t.element_size())
    if as_int is None:
        return None
    bits = t.detach().reshape(-1).view(as_int)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for chunk in bits.split(1 << 24):  # the int64 copy the sum casts to stays small
        total += chunk.sum(dtype=torch.int64)
    return total


def _contiguous(t: Any) -> bool:
    """Whether the rows a strided shard holds (FSDP2 over TP) are consecutive in every
    dimension, so that offsets and a shape describe them. Uses the index lists torch
    computes for ``compute_local_shape_and_global_offset``; where those internals are
    missing, the syncer's cover check (gaps and overlaps) stays the guard."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import Shard, _StridedShard
    except ImportError:
        return True
    mesh, shape = t.device_mesh, list(t.shape)
    coordinate = mesh.get_coordinate()
    indices: dict[int, Any] = {}
    for mesh_dim, p in enumerate(t.placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        size, index = _get_shard_size_and_offsets(shape[p.dim], mesh.size(mesh_dim), coordinate[mesh_dim], p,
                                                  indices.get(p.dim), t.shape[p.dim], False)
        shape[p.dim] = size
        indices[p.dim] = index
    return all(len(ix) <= 1 or bool((ix[1:] - ix[:-1] == 1).all()) for ix in indices.values())


class RackPieces:
    """Per fragment: this rank's local tensors, its ``layout`` and, for blocks that
    several ranks hold, the group to broadcast in. Built collectively (every rank of
    ``group`` constructs it at the same point, as ``RackmendOptimizer`` does)."""

    def __init__(self, fragments: Sequence[FragmentSpec], tensors: Sequence[Sequence[torch.Tensor]],
                 group: Any = None) -> None:
        dist = torch.distributed
        self.fragments = list(fragments)
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        blocks = [[local_block(t, i) for i, t in enumerate(ts)] for ts in tensors]
        self.local: list[list[torch.Tensor]] = [[b[0] for b in bs] for bs in blocks]
        """Per fragment, the tensors this rank holds (views of the model's), in fragment order."""
        mine = [[b[1] for b in bs] for bs in blocks]
        for f, bs in zip(self.fragments, mine):
            for spec, b in zip(f.tensors, bs):
                if b is not None and any(o + s > g for o, s, g in zip(b.offsets, b.shape, spec.shape)):
                    raise ConfigError(f"{spec.name}: this rank's block at {list(b.offsets)} of {list(b.shape)} lies "
                                      f"outside the tensor's global shape {list(spec.shape)}")
        self._device = self._collective_device()
        self._replicas: list[list[tuple[int, Any] | None]] = [[None] * len(f.tensors) for f in self.fragments]
        """Per fragment and tensor: (owner's global rank, group of the ranks holding this
        rank's block) when other ranks hold it too, else None."""
        if self.distributed:
            self._check_same_layout()
        rack = self._gather_blocks(mine) if self.distributed else [mine]
        self.layout = rank_layout(self.fragments, rack, self.rank)
        """This rank's blocks and owned pieces (what the learner core runs on)."""
        held_by = holders(self.fragments, rack)
        self._rack = rack
        self._copies = any(len(h.ranks) > 1 for per_fragment in held_by for per_tensor in per_fragment
                           for h in per_tensor)
        """Whether any rank holds a block another holds too (the same on every rank)."""
        groups: dict[tuple[int, ...], Any] = {}
        for f, per_fragment in zip(self.fragments, held_by):
            for i, per_tensor in enumerate(per_fragment):
                for held in per_tensor:
                    if len(held.ranks) < 2:
                        continue
                    if held.ranks not in groups:
                        # Every rank creates every group, in this same order (new_group's contract).
                        groups[held.ranks] = self._new_group(held.ranks)
                    if held.block == mine[f.index][i]:
                        self._replicas[f.index][i] = (self._global(held.owner), groups[held.ranks])
        differ = self.differing_copies()
        if differ:
            # The join puts the owner's value on every copy, and DDP wrapped later keeps them
            # equal; whether the rack keeps them equal shows after its first step (the
            # driver calls this again then).
            log.warning("%s at construction; the join will make them equal. If the rack keeps them equal (DDP, or "
                        "the same batches on every rank) all is well; if not, the first step raises",
                        _differ_text(differ))

    # ------------------------------------------------------------------ collectives
    def check_learner_id(self, learner_id: str) -> None:
        """Raise on every rank unless every rank of the rack passed this ``learner_id``:
        ranks that call themselves different learners would each wait at the syncer for
        the rest of a rack that never comes, and their join would time out as if the
        syncer were unreachable. One all-gather of the ids' bytes, once. Collective."""
        if not self.distributed:
            return
        raw = learner_id.encode()[:_MAX_ID_BYTES]
        row = torch.zeros(_MAX_ID_BYTES + 1, dtype=torch.int64)
        row[0] = len(raw)
        row[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        ids = [bytes(got[1:1 + int(got[0])].tolist()).decode(errors="replace") for got in self._all_gather(row)]
        if len(set(ids)) > 1:
            shown = ", ".join(f"rank {r} {i!r}" for r, i in enumerate(ids[:8]))
            raise ConfigError(
                f"the ranks of this rack pass different learner ids ({shown}{', ...' if len(ids) > 8 else ''}); "
                "all ranks of one learner pass the same learner_id (or RACKMEND_LEARNER_ID), one per rack, not "
                "per rank: the syncer assembles a learner's contribution from its ranks")

    def gather_offers(self, offers: Sequence[Offer | None]) -> tuple[tuple[Offer | None, ...], ...]:
        """Every rank's offers (``ShareChanges``: this rank's are ``offers``, one per
        fragment, None where it owns nothing of it), indexed [rank][fragment], the same on
        every rank. One all-gather of a few integers per fragment. Collective."""
        if not self.distributed:
            return (tuple(offers),)
        n = len(self.fragments)
        width = 3 + 2 * MAX_OFFER_VALUES
        row = torch.zeros((n, width), dtype=torch.int64)  # [owner, change, count, (version, epoch) x count]
        for p, offer in enumerate(offers):
            if offer is None:
                continue
            if len(offer.values) > MAX_OFFER_VALUES:
                raise ValueError(f"fragment {p}: an offer of {len(offer.values)} values; at most "
                                 f"{MAX_OFFER_VALUES} travel")
            row[p, :3] = torch.tensor([1, int(offer.change), len(offer.values)])
            for i, (version, epoch) in enumerate(offer.values):
                row[p, 3 + 2 * i:5 + 2 * i] = torch.tensor([version, epoch])
        table = []
        for got in self._all_gather(row):
            ranks_offers: list[Offer | None] = []
            for owner, change, count, *values in got.tolist():
                ranks_offers.append(Offer(Change(change), tuple((values[2 * i], values[2 * i + 1])
                                                                for i in range(count))) if owner else None)
            table.append(tuple(ranks_offers))
        return tuple(table)

    def spread(self, p: int, upd: Update | None, meta: tuple[int, int, bool] | None = None) -> Update:
        """Fragment ``p``'s new value on every rank as ``local`` has it (one tensor per
        tensor of the fragment): owners pass what they received (their pieces, ``upd``),
        the others None; a block held by several ranks is broadcast from its owner among
        them. ``meta`` = (version, epoch, reset) when every rank knows it (``SpreadValue``);
        otherwise the owners' are all-reduced. Collective: every rank calls it for ``p``."""
        if not self.distributed:
            assert upd is not None
            return upd
        if meta is None:
            report = torch.full((5,), _NONE, dtype=torch.int64)
            if upd is not None:
                report = torch.tensor([upd.version, -upd.version, upd.epoch, -upd.epoch, int(upd.reset)])
            v, neg_v, e, neg_e, reset = (int(x) for x in self._all_reduce_max(report))
            if v < 0 or v != -neg_v or e != -neg_e:
                raise TransportError(f"fragment {p}: the ranks owning it received different values (versions "
                                     f"{-neg_v}..{v}); cannot put one value on every rank")
            meta = (v, e, bool(reset))
        received = iter(upd.tensors if upd is not None else ())
        tensors = []
        for i, (local, block) in enumerate(zip(self.local[p], self.layout.blocks[p])):
            mine = block is not None and block in self.layout.owned[p]
            value = next(received) if mine else torch.empty(tuple(local.shape), dtype=local.dtype)
            replicas = self._replicas[p][i]
            if replicas is not None and local.numel():  # an empty block has nothing to broadcast
                src, group = replicas
                value = self._broadcast(value if not mine else value.clone(), src, group)
            tensors.append(value)
        return Update(p, meta[0], tuple(tensors), reset=meta[2], epoch=meta[1])

    # ------------------------------------------------------------------ helpers
    def _check_same_layout(self) -> None:
        """Raise on every rank unless every rank has this fragment layout (the same
        tensors, names and global shapes, split the same way): the collectives that
        follow exchange a row per tensor, and ranks with other layouts would fail in
        them with a size mismatch, or worse. One all-gather of two integers, once."""
        digest = int(fingerprint(self.fragments), 16)
        row = torch.tensor([sum(len(f.tensors) for f in self.fragments), digest - (digest >> 63 << 64)],
                           dtype=torch.int64)
        ranks = [tuple(got.tolist()) for got in self._all_gather(row)]
        if len(set(ranks)) > 1:
            shown = ", ".join(f"rank {r}: {n} tensors, layout {h & (2**64 - 1):016x}" for r, (n, h) in enumerate(ranks[:8]))
            raise ConfigError(
                f"the ranks of this rack have different models or fragment layouts ({shown}"
                f"{', ...' if len(ranks) > 8 else ''}). Every rank of one learner holds the same model, whole or "
                "sharded as DTensors, with the same ScheduleConfig; pipeline parallelism, where ranks hold "
                "different layers, is not supported")

    def differing_copies(self) -> list[tuple[str, dict[int, int], bool]]:
        """The parameters whose copies (a block several ranks hold) differ between those
        ranks: (name, {rank: bit sum}, whether the difference is only rounding: sums equal
        to 1e-6 of the sum of magnitudes, as kernels summing in varying order leave). One
        all-gather of a few numbers per tensor; only shared blocks are read. Collective."""
        if not self.distributed or not self._copies:
            return []  # the same decision on every rank: nobody enters the all-gather alone
        row = torch.zeros((sum(len(ts) for ts in self.local), 4), dtype=torch.int64)
        """Per tensor: present, bit sum, then the sum and the sum of magnitudes (float64 bits)."""
        k = 0
        for ts, replicas in zip(self.local, self._replicas):
            for t, replica in zip(ts, replicas):
                bits = bit_sum(t) if replica is not None else None
                if bits is not None:
                    row[k, :2] = torch.stack([torch.ones((), dtype=torch.int64), bits.cpu()])
                    # NaN (never "rounding") where sums of magnitudes mean nothing: integers.
                    sums = torch.stack([t.detach().sum(dtype=torch.float64),
                                        torch.linalg.vector_norm(t.detach(), ord=1, dtype=torch.float64)]
                                       ).cpu() if t.is_floating_point() else torch.full((2,), float("nan"),
                                                                                       dtype=torch.float64)
                    row[k, 2:] = sums.view(torch.int64)
                k += 1
        prints, sums = [], []
        for got in self._all_gather(row):
            present, bits = got[:, 0].tolist(), got[:, 1].tolist()
            prints.append(self._per_tensor([b if ok else None for ok, b in zip(present, bits)]))
            sums.append(self._per_tensor(got[:, 2:].contiguous().view(torch.float64).tolist()))
        out = []
        where = {spec.name: (f.index, i) for f in self.fragments for i, spec in enumerate(f.tensors)}
        for name, seen in differing_copies(self.fragments, self._rack, prints):
            p, i = where[name]
            totals = [sums[r][p][i] for r in seen]
            scale = max(abs(m) for _, m in totals) or 1.0
            out.append((name, seen, max(t for t, _ in totals) - min(t for t, _ in totals) <= 1e-6 * scale))
        return out

    def _per_tensor(self, flat: list[Any]) -> list[list[Any]]:
        """A list with one entry per tensor of every fragment, split per fragment."""
        it = iter(flat)
        return [[next(it) for _ in ts] for ts in self.local]

    def _gather_blocks(self, mine: list[list[Piece | None]]) -> list[list[list[Piece | None]]]:
        """Every rank's blocks (``mine`` is this rank's), as int64 tensors (no pickling):
        per tensor, a present flag, then offsets and shape."""
        dims = [len(spec.shape) for f in self.fragments for spec in f.tensors]
        # A missing block still takes its tensor's room, so every rank's row has one length.
        rows, k = [], 0
        for bs in mine:
            for b in bs:
                nd = dims[k]
                rows += [1, *b.offsets, *b.shape] if b is not None else [0] * (1 + 2 * nd)
                k += 1
        everyone = []
        for row in self._all_gather(torch.tensor(rows, dtype=torch.int64)):
            vals, at, per = row.tolist(), 0, []
            for f in self.fragments:
                fb: list[Piece | None] = []
                for i, spec in enumerate(f.tensors):
                    nd = len(spec.shape)
                    if vals[at]:
                        fb.append(Piece(i, tuple(vals[at + 1:at + 1 + nd]), tuple(vals[at + 1 + nd:at + 1 + 2 * nd])))
                    else:
                        fb.append(None)
                    at += 1 + 2 * nd
                per.append(fb)
            everyone.append(per)
        return everyone

    def _collective_device(self) -> torch.device | None:
        """Where collective buffers live: the tensors' CUDA device under NCCL, else the host."""
        if not self.distributed or torch.distributed.get_backend(self.group) != "nccl":
            return None
        for ts in self.local:
            for t in ts:
                if t.is_cuda:
                    return t.device
        return torch.device("cuda", torch.cuda.current_device())

    def _global(self, rank: int) -> int:
        return torch.distributed.get_global_rank(self.group, rank) if self.group is not None else rank

    def _new_group(self, ranks: tuple[int, ...]) -> Any:
        if len(ranks) == self.world:
            return self.group
        return torch.distributed.new_group([self._global(r) for r in ranks])

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` of every rank of the group, in rank order (same shape on every rank)."""
        dev = self._device
        out = [torch.empty_like(t, device=dev) for _ in range(self.world)]
        torch.distributed.all_gather(out, t.to(dev) if dev is not None else t, group=self.group)
        return [o.cpu() for o in out] if dev is not None else out

    def rack_tokens(self, tokens: float) -> float:
        """The sum of every rank's ``tokens`` for this step: ranks of a data-parallel rack
        train on batches of their own, whose sizes (padding, packing, the last batch) differ.
        One all-reduce of one number. Collective."""
        if not self.distributed:
            return tokens
        dev = self._device
        buf = torch.tensor([float(tokens)], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(buf, group=self.group)
        return float(buf.item())

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dev = self._device
        buf = t.to(dev) if dev is not None else t
        torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return buf.cpu() if dev is not None else buf

    def _broadcast(self, t: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        dev = self._device
        buf = t.to(dev) if dev is not None else t
        torch.distributed.broadcast(buf, src, group=group)
        return buf.cpu() if dev is not None else buf
