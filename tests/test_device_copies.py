"""The host-side rules of a CUDA learner's copies (``rackmend.learner.device``), which run
without a GPU: which tensors of an applied value come from a staged copy, and the host
copy into pinned memory. The device side runs in tests/test_cuda.py (``make gpu-check``)."""

from __future__ import annotations

import pytest
import torch

from rackmend.core.messages import Update
from rackmend.learner.device import _host_copy, staged_pieces


def test_staged_pieces_match_the_very_tensors_received() -> None:
    received = Update(0, 3, (torch.ones(2), torch.zeros(3)))
    # One process: the value applied is the one received.
    assert staged_pieces(received.tensors, received.tensors) == [0, 1]
    # A rank of a sharded rack: its own piece as received, another rank's block brought
    # by a broadcast (a new tensor, equal or not), in another order.
    from_other_rank = torch.zeros(3)
    assert staged_pieces(received.tensors, (from_other_rank, received.tensors[0])) == [None, 0]
    # Equal values are not the same tensors: an older value held, a copy.
    assert staged_pieces(received.tensors, tuple(t.clone() for t in received.tensors)) == [None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_host_copy_gives_the_source_bits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(7, 5, generator=g) * 100).to(dtype)
    for s in (src, src.t(), src[::2]):  # strided sources too
        dst = torch.empty(s.shape, dtype=dtype)
        assert _host_copy(dst, s) is dst and torch.equal(dst, s)
