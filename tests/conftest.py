"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from procs import Procs


@pytest.fixture
def one_thread():
    """Concurrent learner threads must not share an intra-op pool: keeps kernels'
    reduction order fixed (bit-exact tests) and the 2-core machine unoversubscribed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def procs(tmp_path: Path):
    """Start processes through it; every one still running is killed at teardown."""
    pr = Procs(tmp_path)
    yield pr
    pr.kill_all()
