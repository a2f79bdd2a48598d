"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from procs import Procs


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the 2 cores (make test): an intra-op pool of 2 per worker, used by
    # several learner threads at once, oversubscribes them and its spinning threads slowed
    # an in-process run of 3 learners from 2 s to over a minute.
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
