"""Pieces without processes: the owner rule, the checks a hello's pieces go through,
the assembly of a learner's contribution from its ranks' pieces, and a plain model
with empty tensors staying a plain (unsharded) learner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.assembly import Assembler
from rackmend.core.records import Incomplete, Merged, PieceDropped
from rackmend.core.fragments import pack_fragments
from rackmend.core.messages import Contribution
from rackmend.core.pieces import Piece, cover_problem, cut, differing_copies, owner, pieces_problem, whole_pieces
from rackmend.learner.pieces import bit_sum

from helpers import assert_equal_to_reference, batch, make_inner, make_model, run_inprocess
from reference import reference_run

LAYOUT = pack_fragments(make_model(), 2, 3)


def _rows(parts: int) -> list[tuple]:
    """Each of ``parts`` ranks owns a slab of dim 0 of every tensor (FSDP2's Shard(0),
    uneven as torch.chunk: the last ranks may own less, or nothing)."""
    ranks: list[list[list[Piece]]] = [[[] for _ in LAYOUT] for _ in range(parts)]
    for f in LAYOUT:
        for i, t in enumerate(f.tensors):
            size = -(-t.shape[0] // parts)
            for r in range(parts):
                lo, hi = min(r * size, t.shape[0]), min((r + 1) * size, t.shape[0])
                if hi > lo:
                    ranks[r][f.index].append(Piece(i, (lo,) + (0,) * (len(t.shape) - 1), (hi - lo, *t.shape[1:])))
    return [tuple(tuple(ps) for ps in rank) for rank in ranks]


def test_owner_of_a_block_every_rank_holds_is_the_plain_rack_striping() -> None:
    assert [owner(p, range(3)) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert owner(5, [6, 2]) == 6  # the (5 mod 2)-th of the holders in ascending order
    ranks = [whole_pieces(LAYOUT, r, 2) for r in range(2)]
    assert [[bool(ps) for ps in rank] for rank in ranks] == [[True, False], [False, True]]
    assert cover_problem(LAYOUT, ranks) is None


def test_uneven_slabs_cover_every_tensor_and_a_gap_or_overlap_is_named() -> None:
    ranks = _rows(3)
    assert all(pieces_problem(LAYOUT, r) is None for r in ranks)
    assert cover_problem(LAYOUT, ranks) is None
    gap = cover_problem(LAYOUT, ranks[:2])
    assert gap is not None and "owned by no rank" in gap and "more than one" not in gap
    overlap = cover_problem(LAYOUT, [*ranks, ranks[0]])
    assert overlap is not None and "more than one rank" in overlap and "no rank" not in overlap


def test_a_piece_outside_its_tensor_or_empty_or_repeated_is_refused() -> None:
    rank = [list(ps) for ps in _rows(2)[0]]
    first = rank[0][0]
    bad = dict(
        outside=Piece(first.tensor, first.offsets, (LAYOUT[0].tensors[first.tensor].shape[0] + 1, *first.shape[1:])),
        empty=Piece(first.tensor, first.offsets, (0, *first.shape[1:])),
        dims=Piece(first.tensor, first.offsets + (0,), first.shape + (1,)))
    for word, piece in bad.items():
        problem = pieces_problem(LAYOUT, tuple(tuple([piece, *ps[1:]]) if k == 0 else tuple(ps)
                                               for k, ps in enumerate(rank)))
        assert problem is not None, word
    repeated = tuple(tuple([ps[0], ps[0], *ps[1:]]) if k == 0 else tuple(ps) for k, ps in enumerate(rank))
    assert "out of order, repeated" in (pieces_problem(LAYOUT, repeated) or "")


def _contrib(rank: int, pieces: tuple, values: tuple, step: int = 3, **kw: object) -> Contribution:
    fields: dict = dict(learner_id="l0", fragment=0, base_version=1, step=step, c_steps=3, c_tokens=36.0,
                        step_time=0.01 * (rank + 1), tensors=values, pieces=pieces, rank=rank, session=7,
                        seq=step, rank_steps=3, rank_step_time=0.01 * (rank + 1))
    fields.update(kw)
    return Contribution(**fields)  # type: ignore[arg-type]


def test_assembled_contribution_is_the_whole_delta_once_every_rank_is_in() -> None:
    spec = LAYOUT[0]
    whole = tuple(torch.randn(t.shape) for t in spec.tensors)
    ranks = _rows(3)
    asm = Assembler(LAYOUT)
    expected = frozenset(r for r in range(3) if ranks[r][0])
    done = None
    for r in sorted(expected, reverse=True):
        assert done is None
        done, records = asm.add(_contrib(r, ranks[r][0], cut(whole, ranks[r][0])), expected, 0.0)
        assert records == []
    assert done is not None and done.pieces is None
    assert all(torch.equal(a, b) for a, b in zip(done.tensors, whole))
    assert (done.c_steps, done.c_tokens, done.base_version, done.step_time) == (3, 36.0, 1, 0.01 * max(expected) + 0.01)
    assert done.rank == max(expected) and done.seq == 3  # the slowest rank's timing, the lowest rank's seq


def test_incomplete_contributions_are_dropped_with_a_reason() -> None:
    spec = LAYOUT[0]
    whole = tuple(torch.randn(t.shape) for t in spec.tensors)
    ranks = _rows(2)
    asm, expected = Assembler(LAYOUT), frozenset({0, 1})
    asm.add(_contrib(0, ranks[0][0], cut(whole, ranks[0][0]), step=3), expected, 0.0)
    done, records = asm.add(_contrib(0, ranks[0][0], cut(whole, ranks[0][0]), step=6), expected, 1.0)
    assert done is None and [type(r) for r in records] == [Incomplete]
    assert records[0].missing == (1,) and "superseded" in records[0].reason
    late, records = asm.add(_contrib(1, ranks[1][0], cut(whole, ranks[1][0]), step=3, seq=4), expected, 2.0)
    assert late is None and isinstance(records[0], PieceDropped)
    _, records = asm.add(_contrib(1, ranks[1][0], cut(whole, ranks[1][0]), step=6, c_steps=2, seq=6), expected, 2.0)
    assert isinstance(records[0], Incomplete) and "disagree" in records[0].reason
    asm.add(_contrib(0, ranks[0][0], cut(whole, ranks[0][0]), step=9, seq=9), expected, 3.0)
    assert asm.expire(5.0, 10.0) == []
    records = asm.expire(14.0, 10.0)
    assert [r.missing for r in records] == [(1,)] and "incomplete after 10s" in records[0].reason
    assert asm.dropped == 3


@pytest.mark.parametrize("first", [0, 1])
def test_pieces_of_a_relaunched_rack_replace_those_its_old_processes_left(first: int) -> None:
    """torchrun relaunched the rack: both ranks come back in new sessions, counting steps
    from 1 again, while rank 0's piece of step 5 from before waits for a rank 1 that died.
    Whichever new rank sends first, the old piece is dropped as incomplete (the restart
    named) and the new ranks' pieces of step 1 assemble."""
    spec = LAYOUT[0]
    whole = tuple(torch.randn(t.shape) for t in spec.tensors)
    ranks = _rows(2)
    asm, expected = Assembler(LAYOUT), frozenset({0, 1})

    def piece(r: int, step: int, session: int) -> Contribution:
        return _contrib(r, ranks[r][0], cut(whole, ranks[r][0]), step=step, seq=step, session=session)

    for step in (1, 3):  # the old processes: complete contributions
        asm.add(piece(0, step, 7), expected, 0.0)
        assert asm.add(piece(1, step, 8), expected, 0.0)[0] is not None
    assert asm.add(piece(0, 5, 7), expected, 1.0) == (None, [])  # rank 1 dies before its piece of step 5
    done, records = asm.add(piece(first, 1, 20 + first), expected, 2.0)
    assert done is None and [type(r) for r in records] == [Incomplete], records
    assert (records[0].step, records[0].ranks, records[0].missing) == (5, (0,), (1,))
    assert f"rank {first} restarted" in records[0].reason
    done, records = asm.add(piece(1 - first, 1, 21 - first), expected, 2.5)
    assert records == [] and done is not None and done.step == 1
    assert all(torch.equal(a, b) for a, b in zip(done.tensors, whole))


def _with_empty_tensors() -> nn.Module:
    """TinyLM plus a parameter and a buffer with no elements (a zero-width adapter, an
    unused statistics buffer)."""
    model = make_model()
    model.register_parameter("unused", nn.Parameter(torch.zeros(0, 8)))
    model.register_buffer("nothing", torch.zeros(0))
    return model


def test_a_plain_model_with_empty_tensors_stays_plain_and_equals_the_reference(one_thread: None) -> None:
    """A single-process learner whose model has empty tensors holds them whole: it is a
    plain learner (no pieces; ``InProcessLink`` takes it), and two of them through the
    in-process syncer equal the single-process reference bit for bit."""
    ids, steps = ["l0", "l1"], 8
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=2, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=2, learners=tuple(ids)), deterministic=True)
    optimizers: dict = {}
    models, hub = run_inprocess(config, ids, steps, model_fn=_with_empty_tensors, optimizers=optimizers)
    assert not any(opt.core.layout.sharded for opt in optimizers.values())
    assert {name for f in hub.core.fragments for name in f.names} >= {"unused", "nothing"}
    merges = [r for r in hub.records if isinstance(r, Merged)]
    assert sorted({r.fragment for r in merges}) == [0, 1] and all(list(r.merged) == ids for r in merges)
    ref_models, ref_theta = reference_run(_with_empty_tensors, make_inner, batch, config, ids, steps)
    assert_equal_to_reference(models, hub, ref_models, ref_theta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_bit_sums_of_copies_agree_and_of_other_values_differ(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(64, 33, generator=g) * 50).to(dtype)
    strided = t.t().contiguous().t()  # the same values laid out in another order in memory
    assert not strided.is_contiguous()
    assert int(bit_sum(t)) == int(bit_sum(t.clone())) == int(bit_sum(strided))
    other = t.clone()
    other[17, 5] = 1 if dtype == torch.bool and not bool(t[17, 5]) else 0 if dtype == torch.bool else t[17, 5] + 1
    assert int(bit_sum(other)) != int(bit_sum(t))
    assert int(bit_sum(t[:0])) == 0  # an empty block: every holder agrees


def test_differing_copies_names_parameters_several_ranks_hold_unlike() -> None:
    """Copies of one block (every rank of a plain rack holds each tensor whole) must be
    alike; blocks of a sharded tensor differ by nature, and buffers may (DDP with
    ``broadcast_buffers=False``), so neither is compared."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    layout = pack_fragments(model, 1, 3, buffers=True)
    specs = layout[0].tensors
    names = [t.name for t in specs]
    assert "1.running_mean" in names and specs[names.index("1.running_mean")].is_buffer
    whole = tuple(Piece(i, (0,) * len(t.shape), t.shape) for i, t in enumerate(specs))
    rack = [(whole,), (whole,)]
    alike = [[list(range(len(specs)))], [list(range(len(specs)))]]
    assert differing_copies(layout, rack, alike) == []
    unlike = [[list(range(len(specs)))], [[v + 1 for v in range(len(specs))]]]
    found = differing_copies(layout, rack, unlike)
    assert [name for name, _ in found] == [t.name for t in specs if not t.is_buffer]
    assert found[0][1] == {0: 0, 1: 1}
    # Rank 1 unable to fingerprint a tensor (None) leaves rank 0's alone: nothing to compare.
    assert differing_copies(layout, rack, [[list(range(len(specs)))], [[None] * len(specs)]]) == []
    # Sharded: each rank holds its own half of dim 0 of every tensor, so no block has copies.
    halves = [tuple(Piece(i, (r * t.shape[0] // 2,) + (0,) * (len(t.shape) - 1), (t.shape[0] // 2, *t.shape[1:]))
                    for i, t in enumerate(specs)) for r in range(2)]
    assert differing_copies(layout, [(halves[0],), (halves[1],)], unlike) == []
