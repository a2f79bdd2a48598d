"""Carrying out the syncer core's actions, the same way for every driver.

``SyncerRunner.run(event)`` hands the event to ``SyncerCore`` at the driver's clock and
passes each action it returns to the function the driver injected for that kind: send
a fragment's value, send DES-LOC moments, log (and count) a record, act on a fail-slow
rung. When the event merged fragments, it tells the core how long that took (the grace
window allows for it) and tells the driver which fragments merged. The ZeroMQ service,
the in-process carrier and the simulator all drive their core through one of these.

No sockets, queues, files or clocks here: those are the injected functions' business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rackmend.core.failslow import FailSlowAction
from rackmend.core.records import Merged, SyncerRecord
from rackmend.core.syncer import Action, Event, SendMomentUpdate, SendUpdate, SyncerCore, SyncTimed

__all__ = ["SyncerRunner"]


def _ignore(_: object) -> None:
    return None


@dataclass
class SyncerRunner:
    """Drives ``core`` with ``clock``; see the module docstring."""

    core: SyncerCore
    clock: Callable[[], float]
    """The driver's time in seconds (a monotonic clock, or a simulator's virtual time)."""
    send_update: Callable[[SendUpdate], None]
    """Deliver a fragment's new value to the learners the action names."""
    record: Callable[[SyncerRecord], None]
    """Log (and count) one of the core's typed records."""
    send_moments: Callable[[SendMomentUpdate], None] = _ignore
    """Deliver averaged DES-LOC moments (drivers that run none may leave this out)."""
    fail_slow: Callable[[FailSlowAction], None] = _ignore
    """Act on a rung of the fail-slow ladder: the core has applied its effect on
    membership already; a network driver reports ``AdviseLearner`` to the learner."""
    merged: Callable[[list[int], float], None] = lambda fragments, seconds: None
    """Told, after an event that merged, the fragments (the core's numbering) and the
    seconds each took on average."""
    time_merges: bool = True
    """Whether merge time is measured on ``clock`` and fed back (``SyncTimed``) to the
    core's grace window. A simulator whose clock stands still while it computes says
    False."""

    def run(self, event: Event) -> list[Action]:
        """Apply ``event`` at ``clock()``, carry out the actions, and return them."""
        t0 = self.clock()
        actions = self.core.handle(event, t0)
        merged: list[int] = []
        for action in actions:
            if isinstance(action, SendUpdate):
                self.send_update(action)
            elif isinstance(action, SyncerRecord):
                self.record(action)
                if isinstance(action, Merged):
                    merged.append(action.fragment)
            elif isinstance(action, SendMomentUpdate):
                self.send_moments(action)
            else:
                self.fail_slow(action)
        if merged:
            seconds = (self.clock() - t0) / len(merged) if self.time_merges else 0.0
            if self.time_merges:
                for p in merged:
                    self.core.handle(SyncTimed(p, seconds), self.clock())
            self.merged(merged, seconds)
        return actions
