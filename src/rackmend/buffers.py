"""Float32 CPU buffers for decoded contributions and merge results, used again once
nothing holds them.

A syncer decodes every compressed contribution into fresh float32 memory, keeps it
until the round merges, then drops it; the merge's result lives for one outer step.
Large blocks come from the OS, and glibc hands them back when they are freed (any
block above its mmap threshold, and the top of the heap past its trim threshold), so
the next round faults every 4 KiB page in anew (8 learners' 64 MB fragments: 131k
page faults a round, in ``benchmarks/syncer_capacity.py``). Here the buffers
handed out are kept, and a later request of the same size takes one back when its
storage is referenced by nothing but this module: no tensor, view, numpy array or
storage object of it is left anywhere. No I/O, no clock: the sans-I/O core uses it too.

That test reads the storage's reference counts (``torch._C._storage_Use_Count`` and
the storage object's Python count). Their values for an idle buffer are measured at
import, and the test is checked there to see a view and a held storage object; where
that check fails (another torch), nothing is kept and every buffer is fresh.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

import torch

__all__ = ["empty_float32", "clone_float32", "scratch", "KEEP_BYTES"]

KEEP_BYTES = 4 << 30
"""Most bytes of buffers kept (busy or idle). The buffers kept are at most the most of
each size alive at once (a round's decoded contributions); past this, fresh memory."""

_lock = threading.Lock()
_scratch = threading.local()
_kept: dict[int, list[torch.Tensor]] = {}
_kept_bytes = 0


def _counts(t: torch.Tensor) -> tuple[int, int]:
    """(references to ``t``'s storage, Python references to its storage object)."""
    st = t.untyped_storage()
    return torch._C._storage_Use_Count(st._cdata), sys.getrefcount(st)


def _calibrate() -> Callable[[torch.Tensor], bool] | None:
    """The idle test, or None where this torch does not count the way it relies on."""
    try:
        t = torch.empty(4)
        idle = _counts(t)
        view = t[1:]
        with_view = _counts(t)
        del view
        held = t.untyped_storage()
        with_storage = _counts(t)
        del held
        if not (with_view[0] > idle[0] and with_storage[1] > idle[1] and _counts(t) == idle):
            return None
    except (AttributeError, RuntimeError, TypeError):
        return None
    return lambda x: _counts(x) == idle


_idle = _calibrate()


def empty_float32(n: int, device: torch.device) -> torch.Tensor:
    """A 1-D float32 tensor of ``n`` elements, contents undefined: a kept idle one on the
    CPU where there is one of that size, else a fresh one (kept while room remains)."""
    global _kept_bytes
    if device.type != "cpu" or _idle is None or n == 0:
        return torch.empty(n, dtype=torch.float32, device=device)
    with _lock:
        same = _kept.setdefault(n, [])
        for buf in same:
            if _idle(buf):
                return buf.view(n)  # a new tensor object: ours stays the only one we hold
        buf = torch.empty(n, dtype=torch.float32)
        if _kept_bytes + 4 * n <= KEEP_BYTES:
            same.append(buf)
            _kept_bytes += 4 * n
        return buf.view(n)


def clone_float32(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; of a float32 one in a kept buffer (``empty_float32``)."""
    if t.dtype != torch.float32:
        return t.clone()
    return empty_float32(t.numel(), t.device).view(t.shape).copy_(t)


def scratch(slot: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of a buffer kept per thread and ``slot`` on the CPU, for work that
    is done with it before the thread asks for that slot again (a fresh one per chunk
    would be faulted in anew, and a pool's worker threads get theirs from fresh mmaps);
    elsewhere a fresh one (CUDA's caching allocator makes that cheap)."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    buf = getattr(_scratch, slot, None)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = torch.empty(n, dtype=dtype)
        setattr(_scratch, slot, buf)
    return buf[:n]
