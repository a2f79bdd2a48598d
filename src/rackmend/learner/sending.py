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
``check`` or ``wait`` (the driver checks at every step). What does not live here:
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


class SendThread:
    """One worker thread running send jobs in order; see the module docstring."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rackmend-send-{name}")
        self._pending: deque[tuple[int | None, Future[None]]] = deque()

    def submit(self, job: Callable[[], None], fragment: int | None = None) -> None:
        """Queue ``job`` (about ``fragment``, when it reads that fragment's snapshot memory)."""
        while len(self._pending) >= MAX_PENDING:
            self._pending.popleft()[1].result()
        self._pending.append((fragment, self._pool.submit(job)))

    def check(self) -> None:
        """Raise the error of a finished job, if any; forget finished jobs."""
        while self._pending and self._pending[0][1].done():
            self._pending.popleft()[1].result()

    def wait(self, fragment: int | None = None) -> None:
        """Block until every queued job (with ``fragment``: every job up to the last one
        about that fragment) has run; raise the first error."""
        if fragment is not None:
            last = max((i for i, (p, _) in enumerate(self._pending) if p == fragment), default=-1)
            for _ in range(last + 1):
                self._pending.popleft()[1].result()
            return
        while self._pending:
            self._pending.popleft()[1].result()

    def close(self) -> None:
        """Run what is queued, then stop the worker; raise the first error."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
