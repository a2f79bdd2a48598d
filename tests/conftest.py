"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from procs import TIME_SCALE, Procs
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


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # pytest-timeout's per-test bound (pyproject's, unless --timeout says) moves with the
    # tests' own waits (procs.TIME_SCALE); it reads the option in its own pytest_configure.
    if TIME_SCALE != 1 and getattr(config.option, "timeout", None) is None and config.getini("timeout"):
        config.option.timeout = float(config.getini("timeout")) * TIME_SCALE


# tryfirst: before pytest's own -m selection, which must see the marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "procs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.processes)
        if item.get_closest_marker("processes") and not item.get_closest_marker("integration"):
            # make test runs the serial tests one at a time in one pytest, the others in
            # a second pytest beside it (Makefile). Trainer-stack tests go beside them:
            # they start processes but assert no wall-clock bound, and they are a fifth
            # of the serial run's time.
            item.add_marker(pytest.mark.serial)
        bound = item.get_closest_marker("timeout")
        if bound is not None and bound.args and TIME_SCALE != 1:  # a test's own bound moves too
            item.add_marker(pytest.mark.timeout(float(bound.args[0]) * TIME_SCALE), append=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest):
    """Start processes through it; every one still running is killed at teardown. When
    the test failed, the syncers still running first write every thread's stack (their
    SIGUSR1), and the end of each process's output is printed (pytest shows it)."""
    pr = Procs(tmp_path)
    yield pr
    if request.node.stash.get(_FAILED, False):
        pr.report()
    pr.kill_all()
