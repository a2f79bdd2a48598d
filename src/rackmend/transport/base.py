"""What a learner needs from a transport, whatever carries the bytes.

A link belongs to one learner (or one rank of it). It never blocks in ``send`` or
``poll``; only ``join`` and ``wait`` block, and both take a timeout.
"""

from __future__ import annotations

import abc
import queue
import time
from typing import Any, Callable, Sequence

import torch

from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution, MomentContribution, MomentUpdate, Update
from rackmend.core.pieces import RankPieces
from rackmend.core.settings import RunRules, SyncerSettings

__all__ = ["LearnerLink", "TransportError", "QueueLink"]

_POLL = 0.05  # seconds; how often a blocked wait rechecks that the carrier is alive


class TransportError(RuntimeError):
    """The transport could not do what was asked (timeout, refused, closed)."""


class LearnerLink(abc.ABC):
    """A learner's end of a transport; ``RackmendOptimizer`` uses this and nothing else.
    A transport subclasses it and implements ``join``, ``send``, ``poll``, ``wait`` and
    ``leave``; the rest has defaults for a link that genuinely lacks the feature (one
    rank, no settings stated by the syncer, no byte count, no fail-slow advice, no
    DES-LOC moments)."""

    rank: int = 0
    """This rank of the learner; the link carries the fragments (or pieces) this rank
    owns. ``RackmendOptimizer`` refuses a link whose ranks differ from its process group's."""

    world_size: int = 1
    """Ranks of the learner (1: a single-process learner, all fragments on this link)."""

    syncer_settings: SyncerSettings | None = None
    """The round settings the syncer stated when this learner joined (min_quorum,
    grace_max, weighting, failslow); None from a link or syncer that does not state them.
    Set by the time ``join`` returns."""

    bytes_received: int | None = None
    """Bytes received from the syncer so far; None for a link that does not count them."""

    carries_moments: bool = False
    """Whether ``send_moments``, ``poll_moments`` and ``wait_moments`` work (DES-LOC,
    ``ScheduleConfig.desloc``, needs it)."""

    @abc.abstractmethod
    def join(
        self,
        learner_id: str,
        fragments: Sequence[FragmentSpec],
        initial: Sequence[Sequence[torch.Tensor]],
        timeout: float,
        *,
        settings: RunRules,
        pieces: RankPieces | None = None,
    ) -> list[Update]:
        """Announce ``learner_id`` with its parameter layout; return the current value
        of every fragment this rank owns. ``initial`` (the learner's own values) seeds a
        syncer that has no state yet. ``settings`` are checked against the syncer's and
        the other learners' (``rackmend.core.settings``); a mismatch raises
        ``TransportError`` naming the setting. ``pieces``: for a rank of a sharded rack,
        the blocks it owns per fragment (``initial`` then holds its local blocks); the
        values returned, and every later update, carry those pieces only. Links that
        cannot carry pieces raise ``TransportError``."""

    @abc.abstractmethod
    def send(self, contribution: Contribution) -> None:
        """Queue a contribution for the syncer; returns at once. ``RackmendOptimizer``
        calls it (and ``send_moments``) from its send thread, one call at a time in the
        order of the sends, never from the training thread (``rackmend.learner.sending``);
        its ``close`` runs what is queued before it calls ``leave``. So leave through
        ``RackmendOptimizer.close``, not by calling the link's ``leave`` yourself."""

    @abc.abstractmethod
    def poll(self) -> list[Update]:
        """Updates that arrived since the last call, oldest first; never blocks."""

    @abc.abstractmethod
    def wait(self, fragment: int, after_version: int, timeout: float) -> Update | None:
        """Block until an update of ``fragment`` newer than ``after_version`` (or a
        ``reset`` update of it, whatever its version) arrives; other updates that arrive
        meanwhile are kept for the next ``poll``."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Tell the syncer this learner is leaving; idempotent."""

    def poll_advice(self) -> list[FailSlowReport]:
        """Fail-slow reports for this learner since the last call, oldest first; never
        blocks. A link that carries none has none."""
        return []

    def send_moments(self, contribution: MomentContribution) -> None:
        """DES-LOC: queue a moment contribution for the syncer; returns at once."""
        raise TransportError(f"{type(self).__name__} does not carry DES-LOC moments")

    def poll_moments(self) -> list[MomentUpdate]:
        """DES-LOC: averaged moments that arrived since the last call, oldest first; never blocks."""
        return []

    def wait_moments(self, fragment: int, kind: str, after_version: int, epoch: int,
                     timeout: float) -> MomentUpdate | None:
        """DES-LOC: block until averaged ``kind`` moments of ``fragment`` newer than
        ``after_version`` (or of another epoch than ``epoch``) arrive; others that arrive
        meanwhile are kept for the next ``poll_moments``."""
        raise TransportError(f"{type(self).__name__} does not carry DES-LOC moments")


class QueueLink(LearnerLink):
    """The receiving half shared by links whose updates land in a ``queue.Queue``:
    ``poll`` and ``wait`` with updates for other fragments held back, never lost;
    ``poll_advice`` for the syncer's fail-slow reports about this learner; and, for
    DES-LOC, ``poll_moments`` and ``wait_moments`` over averaged moments, which land in a
    queue of their own (a carrier puts them in ``_moment_box``)."""

    def __init__(self, alive: Callable[[], BaseException | None]) -> None:
        self._box: "queue.Queue[Update]" = queue.Queue()
        self._held_back: list[Update] = []
        self._alive = alive
        """Returns the carrier's failure, or None while it works."""
        self._advice: "queue.Queue[FailSlowReport]" = queue.Queue()
        self._moment_box: "queue.Queue[MomentUpdate]" = queue.Queue()
        self._moments_held_back: list[MomentUpdate] = []

    def poll_moments(self) -> list[MomentUpdate]:
        """DES-LOC: averaged moments that arrived since the last call, oldest first; never blocks."""
        out, self._moments_held_back = self._moments_held_back, []
        while True:
            try:
                out.append(self._moment_box.get_nowait())
            except queue.Empty:
                return out

    def wait_moments(self, fragment: int, kind: str, after_version: int, epoch: int,
                     timeout: float) -> MomentUpdate | None:
        """DES-LOC: block until averaged ``kind`` moments of ``fragment`` newer than
        ``after_version`` (or of another epoch than ``epoch``) arrive; others that arrive
        meanwhile are kept for the next ``poll_moments``."""
        end = time.monotonic() + timeout

        def wanted(u: MomentUpdate) -> bool:
            return u.fragment == fragment and u.kind == kind and (u.version > after_version or u.epoch != epoch)

        for i, upd in enumerate(self._moments_held_back):
            if wanted(upd):
                return self._moments_held_back.pop(i)
        while True:
            upd = self._get(end, self._moment_box)
            if upd is None:
                return None
            if wanted(upd):
                return upd
            self._moments_held_back.append(upd)

    def poll_advice(self) -> list[FailSlowReport]:
        """Fail-slow reports for this learner since the last call, oldest first; never blocks."""
        out = []
        while True:
            try:
                out.append(self._advice.get_nowait())
            except queue.Empty:
                return out

    def poll(self) -> list[Update]:
        out, self._held_back = self._held_back, []
        while True:
            try:
                out.append(self._box.get_nowait())
            except queue.Empty:
                return out

    def wait(self, fragment: int, after_version: int, timeout: float) -> Update | None:
        end = time.monotonic() + timeout
        wanted = lambda u: u.fragment == fragment and (u.version > after_version or u.reset)  # noqa: E731
        for i, upd in enumerate(self._held_back):
            if wanted(upd):
                return self._held_back.pop(i)
        while True:
            upd = self._get(end)
            if upd is None:
                return None
            if wanted(upd):
                return upd
            self._held_back.append(upd)

    def _get(self, end: float, box: "queue.Queue[Any] | None" = None) -> Any:
        """The next item of ``box`` (the updates' queue by default) before ``end``, or None."""
        box = self._box if box is None else box
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return None
            error = self._alive()
            if error is not None:
                raise TransportError(f"the link to the syncer failed: {error}") from error
            try:
                return box.get(timeout=min(remaining, _POLL))
            except queue.Empty:
                continue
