"""A CUDA learner's copies between the device and the host, kept off the training thread's path.

- **Snapshots.** A due fragment's pieces go to pinned host buffers (reused per
  fragment) on a side stream, queued behind the step's kernels; the training thread
  does not wait for them. Buffers, which the next forward pass writes in place, are
  copied from a device clone taken at once. ``ready(p)`` hands the copy's event to the
  send thread (``rackmend.learner.sending``), which waits for it before it reads them. The
  parameters must not change before the copy has read them: ``guard_writes`` makes the
  current stream wait for it (on the device) before the next write (the inner step,
  an apply), so the copy overlaps the next forward and backward.
- **At-send copies** (``keep_local``): kept on the device, queued behind the step (no
  host time, and the apply reads them there), at most ``bound`` fragments in flight;
  beyond that (values late, the syncer away) they go to the host, so an outage cannot
  fill the device.
- **Merged values**: when a value arrives, a staging thread copies it to pinned memory
  and on to the device on a second side stream; the apply waits for that copy on the
  device (an event), never on the host. A copy from ordinary (pageable) host memory
  would first wait for every kernel queued, so the host would lose its lead over the
  device at every apply. On a multi-rank learner the pieces a rank received are staged;
  blocks brought from another rank are not.

What does not live here: when to copy (``rackmend.core.learner``), a CPU learner's
snapshots (plain host copies), the collectives of multi-rank learners
(``rackmend.learner.pieces``), which bring values to the ranks themselves.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence

import logging

import numpy as np
import torch

from rackmend.core.learner import ApplyValue
from rackmend.core.messages import Update

__all__ = ["CudaCopies", "staged_pieces"]

log = logging.getLogger("rackmend.learner")

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32)

_Staged = tuple[list[torch.Tensor], list[torch.Tensor], Any]
"""Pinned host copies, device copies, and the event after the copy to the device."""


class CudaCopies:
    """See the module docstring. ``bound``: fragments in flight whose copies may stay in
    device memory (what the schedule keeps in flight, plus one)."""

    def __init__(self, device: torch.device, bound: int, name: str) -> None:
        self.device = device
        self.bound = bound
        self._copy_stream = torch.cuda.Stream(device=device)
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self._copied: dict[int, Any] = {}
        """Per fragment, the event after its latest snapshot's copy, until ``ready`` takes it."""
        self._unguarded: list[Any] = []
        """Events of snapshot copies that the current stream has not been made to wait for."""
        self._stage_stream = torch.cuda.Stream(device=device)
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rackmend-stage-{name}")
        self._staged: dict[int, tuple[Update, Future[_Staged]]] = {}
        """Per fragment, the newest value that arrived and its copy on the way to the device."""
        self.staged_applies = 0
        """Merged values applied from a staged device copy."""

    # ------------------------------------------------------------------ snapshots
    @torch.no_grad()
    def snapshot(self, p: int, params: Sequence[torch.Tensor], keep: bool, in_flight: int, owns: bool,
                 forward_writes: Sequence[bool], sent: Sequence[torch.Tensor] | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Fragment p's pieces for ``SnapshotTaken``: (host pieces, at-send copy or None).
        The host pieces are pinned buffers the copy is still filling (``ready(p)``). A rank
        that sends nothing of p (``owns`` False) needs only the copy kept for the apply.
        ``forward_writes``: per tensor, whether the next forward pass may write it in place
        (buffers: BatchNorm's running statistics), which ``guard_writes`` does not order.
        ``sent``: what to send in place of ``params`` where it differs (new tensors for
        BatchNorm statistics, ``rackmend.learner.statistics``); the copy kept for the
        apply is always of ``params``."""
        if keep and not owns and in_flight < self.bound:
            kept = [t.detach().clone() for t in params]
            return kept, kept
        buffers = self._pinned.get(p)
        if buffers is None:
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in params]
            self._pinned[p] = buffers
        # Written by the next forward before the copy may have read them: copied from a
        # clone taken now on the current stream (buffers are small).
        sources = [s.detach() if s is not t else t.detach().clone() if w else t.detach()
                   for s, t, w in zip(sent or params, params, forward_writes, strict=True)]
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for buf, src in zip(buffers, sources):
                buf.copy_(src, non_blocking=True)
            # Blocking: the send thread sleeps in its wait instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        for src, w in zip(sources, forward_writes):
            if w:  # made on the current stream, read on the copy stream
                src.record_stream(stream)
        self._copied[p] = done
        self._unguarded.append(done)
        if not keep:
            return buffers, None
        if in_flight < self.bound:
            return buffers, [t.detach().clone() for t in params]
        # The buffers are reused at the next send, so the copy kept must be another.
        done.synchronize()
        return [t.clone() for t in buffers], None if sent is None else [t.detach().clone() for t in params]

    def ready(self, p: int) -> Any:
        """The event after fragment p's latest snapshot copy (the send thread waits for it)."""
        return self._copied.pop(p, None)

    def guard_writes(self) -> None:
        """Make the current stream wait (on the device) for every snapshot copy queued, so
        that its next writes to the parameters come after the copies have read them."""
        if self._unguarded:
            current = torch.cuda.current_stream(self.device)
            for done in self._unguarded:
                current.wait_event(done)
            self._unguarded.clear()

    # ------------------------------------------------------------------ merged values
    def stage(self, arrived: Sequence[Update], in_flight: Sequence[int]) -> None:
        """Start copying arrived values of fragments in flight to the device (the newest
        per fragment; at most ``bound`` at once)."""
        for upd in arrived:
            p = upd.fragment
            if p not in in_flight or (p not in self._staged and len(self._staged) >= self.bound):
                continue
            self.forget(p)
            self._staged[p] = (upd, self._stager.submit(self._to_device, upd))

    def _to_device(self, upd: Update) -> _Staged:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stage_stream):
            host = [_host_copy(torch.empty(t.shape, dtype=t.dtype, pin_memory=True), t) for t in upd.tensors]
            on_device = [h.to(self.device, non_blocking=True) for h in host]
            done = torch.cuda.Event()
            done.record(self._stage_stream)
        return host, on_device, done

    def on_device(self, action: ApplyValue) -> ApplyValue:
        """``action`` reading its value from the device copies staged for it, ordered on
        the current stream after them; as it is where none was staged. A tensor is
        matched by identity: on a rank of a multi-rank learner the value applied is the
        one received (its pieces, the very tensors), or one brought from another rank."""
        p = action.fragment
        staged = self._staged.get(p)
        if staged is None:
            return action
        upd, future = staged
        hits = staged_pieces(upd.tensors, action.update.tensors)
        if not any(h is not None for h in hits):
            if (upd.epoch, upd.version) <= (action.update.epoch, action.update.version):
                self.forget(p)  # never applied now: a newer or this same value is
            return action
        del self._staged[p]
        try:
            _, on_device, done = future.result()
        except Exception as exc:  # the plain path still applies the value
            log.warning("staging merged value %d of fragment %d on %s failed (%s); applied from host memory",
                        action.update.version, p, self.device, exc)
            return action
        self.staged_applies += 1
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        tensors = []
        for t, h in zip(action.update.tensors, hits):
            if h is not None:
                t = on_device[h]
                # Made on the staging stream, read on this one: the allocator must not
                # hand the memory out again before this stream's reads have run.
                t.record_stream(current)
            tensors.append(t)
        return replace(action, update=replace(action.update, tensors=tuple(tensors)))

    def forget(self, p: int) -> None:
        """Drop fragment p's staged value (a newer one came, or a rebase replaced it); its
        copy is cancelled if it has not started."""
        staged = self._staged.pop(p, None)
        if staged is not None:
            staged[1].cancel()
        self._check(staged)

    def _check(self, staged: tuple[Update, Future[_Staged]] | None) -> None:
        """A staging copy not used: its failure, if it failed, is still logged."""
        if staged is not None and staged[1].done() and not staged[1].cancelled() and staged[1].exception() is not None:
            log.warning("staging merged value %d of fragment %d on %s failed: %s", staged[0].version,
                        staged[0].fragment, self.device, staged[1].exception())

    def close(self) -> None:
        self._stager.shutdown(wait=True, cancel_futures=True)


def staged_pieces(staged: Sequence[torch.Tensor], applied: Sequence[torch.Tensor]) -> list[int | None]:
    """For each tensor of a value applied, the index of the very same tensor among those
    staged, or None (a tensor another rank sent, or of another value)."""
    index = {id(t): i for i, t in enumerate(staged)}
    out: list[int | None] = []
    for t in applied:
        i = index.get(id(t))
        out.append(i if i is not None and staged[i] is t else None)
    return out


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` between host tensors; through numpy where it has the dtype, so
    the copy runs on this thread alone, not on a pool of torch threads of its own."""
    if src.dtype in _NUMPY_DTYPES and src.dtype == dst.dtype and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
        return dst
    return dst.copy_(src)
