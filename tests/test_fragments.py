"""Packing parameters into fragments and the per-step send schedule."""

from __future__ import annotations

import math

import pytest

from rackmend.config import ConfigError
from rackmend.core import fragment_offsets, fragments_due, pack_fragments
from rackmend.workloads import GPT, GPTConfig

from helpers import make_model


@pytest.mark.parametrize("P", [2, 4, 8])
def test_balanced_packing_on_gpt_is_even(P: int) -> None:
    model = GPT(GPTConfig(n_layer=6, n_embd=128))
    frags = pack_fragments(model, P, 24)
    sizes = [f.nbytes for f in frags]
    assert max(sizes) / min(sizes) <= 1.5, sizes
    names = [n for f in frags for n in f.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each tensor exactly once


def test_strided_packing_puts_block_i_in_fragment_i_mod_p() -> None:
    model = GPT(GPTConfig(n_layer=6, n_embd=64))
    frags = pack_fragments(model, 3, 24, "strided")
    for f in frags:
        for name in f.names:
            if name.startswith("blocks."):
                assert int(name.split(".")[1]) % 3 == f.index
    assert sum(len(f.names) for f in frags) == len(list(model.parameters()))


def test_embedding_flags() -> None:
    frags = pack_fragments(make_model(), 1, 4)
    flags = {t.name: t.is_embedding for t in frags[0].tensors}
    assert flags["emb.weight"] and not flags["head.weight"]


@pytest.mark.parametrize("P,H", [(24, 24), (4, 10), (10, 4), (7, 3), (1, 5), (5, 1)])
def test_schedule_is_flat_and_complete(P: int, H: int) -> None:
    offsets = fragment_offsets(P, H)
    assert all(0 <= o < H for o in offsets)
    model = GPT(GPTConfig(n_layer=max(1, P), n_embd=16, n_head=2))
    frags = pack_fragments(model, P, H)
    counts = {f.index: 0 for f in frags}
    for step in range(1, 3 * H + 1):
        due = fragments_due(step, frags, H)
        assert len(due) <= math.ceil(P / H)
        for p in due:
            counts[p] += 1
    assert all(c == 3 for c in counts.values()), counts  # once per period, every fragment


def test_too_many_fragments_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="num_fragments"):
        pack_fragments(make_model(), 50, 4)


@pytest.mark.parametrize("P", [2, 3, 5])
def test_batchnorm_statistics_of_a_layer_share_a_fragment(P: int) -> None:
    """A running_var merges with its running_mean's spread (pooled variance) only where
    both are in one fragment: packing keeps them together."""
    from torch import nn

    model = nn.Sequential(*[m for i in range(4) for m in (nn.Linear(8 + i, 8 + i + 1), nn.BatchNorm1d(8 + i + 1))])
    frags = pack_fragments(model, P, 24)
    where = {n: f.index for f in frags for n in f.names}
    bns = [f"{i}.running_var" for i in range(1, 8, 2)]
    assert all(where[n] == where[n.replace("running_var", "running_mean")] for n in bns), where
    for f in frags:
        for n, i in zip(f.names, f.variance_of):
            assert (i is not None) == n.endswith("running_var"), (n, i)
            assert i is None or f.names[i] == n.replace("running_var", "running_mean")
    # A tiny model with P at its tensor count still packs (the pair may then split).
    tiny = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))  # 6 tensors
    assert len(pack_fragments(tiny, 6, 24)) == 6
