"""When a syncer round closes: its phase and clock, shared by parameter and moment rounds.

A round (one fragment's, or one DES-LOC moment kind's) is ``OPEN`` until the first
fresh contribution (one based on the current version) arrives, then ``GATHERING`` until
``min_quorum`` fresh ones are in, then in ``GRACE`` until its deadline passes or every
expected learner is in. Deterministic mode has no quorum and no grace: a round closes
when every expected learner is in. What is pending, merging and logging live with the
round's owner (``core.syncer_fragment``, ``core.moments``); this module only decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

__all__ = ["Phase", "RoundClock"]


class Phase(enum.Enum):
    OPEN = "open"
    """No fresh contribution yet (stale ones may be pending: they ride along)."""
    GATHERING = "gathering"
    """Fresh work is in; fewer than ``min_quorum`` learners' so far."""
    GRACE = "grace"
    """Quorum reached: closes at ``deadline``, or earlier once every expected learner is in."""


@dataclass
class RoundClock:
    """One round's phase and the times it changed."""

    phase: Phase = Phase.OPEN
    first_arrival: float | None = None
    """When the first fresh contribution arrived (``GATHERING`` began)."""
    quorum_at: float | None = None
    """When ``min_quorum`` fresh contributions were in (``GRACE`` began)."""
    deadline: float | None = None
    """When the grace window ends."""

    def arrived(self, now: float) -> None:
        """A fresh contribution arrived at ``now``."""
        if self.phase is Phase.OPEN:
            self.phase, self.first_arrival = Phase.GATHERING, now

    def due(self, now: float, fresh: int, all_in: bool, *, deterministic: bool, min_quorum: int,
            grace: Callable[[], float], on_quorum: Callable[[float], None] | None = None) -> bool:
        """Whether the round closes at ``now`` with ``fresh`` fresh learners in (``all_in``:
        every expected learner among them). Reaching quorum starts the grace window of
        ``grace()`` seconds; ``on_quorum`` is first told how long the quorum took (the
        syncer's estimate of it is part of the grace window)."""
        if not fresh:
            return False
        if deterministic:
            return all_in
        if fresh < min_quorum:
            return False
        if self.phase is not Phase.GRACE:
            self.phase, self.quorum_at = Phase.GRACE, now
            if on_quorum is not None:
                assert self.first_arrival is not None
                on_quorum(now - self.first_arrival)
            self.deadline = now + grace()
        assert self.deadline is not None
        return all_in or now >= self.deadline
