"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from procs import Procs


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the 2 cores (make test). An intra-op pool of 2 per worker, used by
    # several learner threads at once beside the other worker's processes, oversubscribes
    # them: an in-process run of 3 learner threads that takes 2 s alone once passed its
    # 60 s bound under two workers (not seen again with one thread per worker).
    torch.set_num_threads(1)


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
