"""What a learner needs from a transport, whatever carries the bytes.

A link belongs to one learner (or one rank of it). It never blocks in ``send`` or
``poll``; only ``join`` and ``wait`` block, and both take a timeout.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rackmend.core.messages import Contribution, Update

__all__ = ["LearnerLink", "TransportError"]


class TransportError(RuntimeError):
    """The transport could not do what was asked (timeout, refused, closed)."""


@runtime_checkable
class LearnerLink(Protocol):
    def join(self, learner_id: str, timeout: float) -> list[Update]:
        """Announce ``learner_id``; return the current value of every fragment."""
        ...

    def send(self, contribution: Contribution) -> None:
        """Queue a contribution for the syncer; returns at once."""
        ...

    def poll(self) -> list[Update]:
        """Updates that arrived since the last call, oldest first; never blocks."""
        ...

    def wait(self, fragment: int, after_version: int, timeout: float) -> Update | None:
        """Block until an update of ``fragment`` newer than ``after_version`` arrives;
        other updates that arrive meanwhile are kept for the next ``poll``."""
        ...

    def leave(self) -> None:
        """Tell the syncer this learner is leaving; idempotent."""
        ...
