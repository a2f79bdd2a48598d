"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Concurrent learner threads must not share an intra-op pool: keeps kernels'
    reduction order fixed (bit-exact tests) and the 2-core machine unoversubscribed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
