"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from procs import Procs
from rackmend.transport.tokens import TOKEN_DIR_ENV


@pytest.fixture(autouse=True)
def token_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Learner links (in-process and the processes tests start) keep resume tokens in the
    test's own folder, not the user's state folder, and never see another test's."""
    folder = tmp_path / "tokens"
    monkeypatch.setenv(TOKEN_DIR_ENV, str(folder))
    return folder


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
