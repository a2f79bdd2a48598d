"""The learner's send thread: contributions are built and handed to the link off the training thread.

``SendThread`` runs jobs one at a time, in the order they were given, on one worker
thread: building a contribution (the outer gradient ``held - snapshot`` and a lossy
uplink codec, ``SendFragment.build``), waiting first for a CUDA snapshot's copy to
complete, and the link's ``send``. The training thread only queues them, so the
arithmetic, the wire encoding and the wait for the step's kernels overlap the next
inner step instead of adding to it. One worker keeps the order the core's error
feedback and the syncer's sequence numbers need, and keeps the link's sending side
(a ZeroMQ socket, not thread-safe) on one thread.

A job's failure is never lost: it is raised on the training thread by the next
``check``, ``wait`` or ``submit`` (the driver checks at every step), and the jobs
queued after it are skipped, not sent (a half-built send may have moved the codec's
error feedback; what follows it would be built on that). What does not live here:
what to send and when (``rackmend.core.learner``), the link itself
(``rackmend.transport``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

__all__ = ["SendThread", "MAX_PENDING"]

MAX_PENDING = 8
"""Jobs queued before ``submit`` waits for the oldest. A job takes well under a step (the
link's ``send`` only queues for the link's own I/O thread), so more pending means the
worker is starved; waiting then keeps snapshots from piling up in memory."""


class _Skipped(RuntimeError):
    """A job skipped because an earlier one failed; the training thread is given that
    earlier failure instead."""


class SendThread:
    """One worker thread running send jobs in order; see the module docstring.
    ``initializer`` runs first on the worker (a CUDA learner sets its device there)."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rackmend-send-{name}",
                                        initializer=initializer)
        self._pending: deque[tuple[int | None, Future[None]]] = deque()
        self._failure: BaseException | None = None
        """The first job's failure; set on the worker, raised on the training thread."""
        self._reported = False
        """The failure has been raised on the training thread once."""

    def submit(self, job: Callable[[], None], fragment: int | None = None) -> None:
        """Queue ``job`` (about ``fragment``, when it reads that fragment's snapshot memory)."""
        self.check()
        while len(self._pending) >= MAX_PENDING:
            self._result(self._pending.popleft()[1])
        self._pending.append((fragment, self._pool.submit(self._guarded, job)))

    def _guarded(self, job: Callable[[], None]) -> None:
        if self._failure is not None:
            raise _Skipped("skipped: an earlier send failed") from self._failure
        try:
            job()
        except BaseException as exc:
            self._failure = exc
            raise

    def _result(self, future: Future[None]) -> None:
        try:
            future.result()
        except _Skipped:
            assert self._failure is not None
            self._reported = True
            raise self._failure from None
        except BaseException:
            self._reported = True
            raise

    def check(self) -> None:
        """Raise the failure of a finished job, if any; forget finished jobs."""
        while self._pending and self._pending[0][1].done():
            self._result(self._pending.popleft()[1])
        if self._failure is not None:  # every call after a failure: nothing is sent any more
            self._reported = True
            raise self._failure

    def wait(self, fragment: int | None = None) -> None:
        """Block until every queued job (with ``fragment``: every job up to the last one
        about that fragment) has run; raise the first failure unless it was raised
        already (so a learner can still be checkpointed and closed after it)."""
        last = len(self._pending) - 1 if fragment is None else max(
            (i for i, (p, _) in enumerate(self._pending) if p == fragment), default=-1)
        for _ in range(last + 1):
            future = self._pending.popleft()[1]
            if self._reported:
                future.exception()  # waits; the failure was raised once
            else:
                self._result(future)

    def close(self) -> None:
        """Run what is queued, then stop the worker; raise the first failure unless it
        was raised already."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
