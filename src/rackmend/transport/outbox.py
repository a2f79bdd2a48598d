"""What waits to be sent on one connection when the link is slower than its sender.

A fragment's value (or outer gradient) is only worth sending in its newest form: an
older one still queued when a newer one is made would arrive stale and use the link
twice. So instead of letting ZeroMQ queue every message (its default high-water mark
is a thousand messages: a growing backlog on a slow link, every contribution later
than the one before), both ends keep ZeroMQ's queue short and hold back here:

- control messages (hello, init, fetch, leave, errors, bye), all of them, in order;
- at most one data message per key (a fragment), the newest replacing an unsent older one;
- at most one data message per key *in flight*: the next one for that key leaves only
  once the receiver has acknowledged the last (or ``ack_timeout`` passed). Kernel socket
  buffers hold megabytes, seconds of a slow link, so a short ZeroMQ queue alone does not
  keep a backlog away; counting what the receiver has not yet confirmed does, whatever
  the buffers, and costs no throughput on a fast link (other fragments go meanwhile).

Control messages go first, except those added with ``add_last`` (a leave), which wait
until every data message queued before them has been sent: the work a learner sent
before leaving must reach the syncer before the leave does. Sockets are not touched here: ``flush`` calls the
``send`` function it is given until that raises ``zmq.Again`` (no room yet).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Hashable

import zmq

__all__ = ["Outbox"]

SHORT_HWM = 2
"""ZeroMQ send high-water mark (messages) used with an Outbox: room for one message
being written to the kernel and one behind it; everything else waits here."""


class Outbox:
    """Pending messages of one peer; see the module docstring."""

    def __init__(self, ack_timeout: float = 15.0, *, keep_sent: bool = False) -> None:
        self.ack_timeout = ack_timeout
        """Seconds after which an unacknowledged data message counts as lost."""
        self.keep_sent = keep_sent
        """Hold each key's last sent data message until it is acknowledged, for
        ``resend_inflight`` (a learner's link: one contribution per fragment). Off where
        the messages are large and many (the syncer's updates to every peer)."""
        self._control: deque[list[Any]] = deque()
        self._latest: dict[Hashable, tuple[str, list[Any]]] = {}
        self._inflight: dict[Hashable, tuple[float, list[Any] | None]] = {}
        """Per key, when its last data message was sent and (``keep_sent``) that message,
        until acknowledged."""
        self._last: deque[list[Any]] = deque()
        self.superseded = 0
        """Data messages replaced by a newer one before they could be sent."""

    def __bool__(self) -> bool:
        """Whether messages wait to be sent (in-flight ones do not count)."""
        return bool(self._control or self._latest or self._last)

    def sendable(self, now: float | None = None) -> bool:
        """Whether ``flush`` would send something now. A data message held until the last
        one of its key is acknowledged does not count until ``ack_timeout`` frees the key:
        a caller that polls for room only while this is true does not spin meanwhile."""
        now = time.monotonic() if now is None else now
        if self._control:
            return True
        if any(k not in self._inflight or now - self._inflight[k][0] > self.ack_timeout for k in self._latest):
            return True
        return bool(self._last) and not self._latest

    def next_expiry(self) -> float | None:
        """When (``time.monotonic``) the earliest held data message stops waiting for its
        key's acknowledgement; None when none waits. A caller sleeping on its socket wakes
        by then: no acknowledgement may ever come."""
        due = [self._inflight[k][0] + self.ack_timeout for k in self._latest if k in self._inflight]
        return min(due) if due else None

    @property
    def control_pending(self) -> int:
        """Control messages waiting to be sent."""
        return len(self._control)

    def ack(self, key: Hashable) -> None:
        """The receiver has the last data message sent for ``key``."""
        self._inflight.pop(key, None)

    def forget_inflight(self) -> None:
        """The connection was replaced (rejoin): nothing sent before will be acknowledged."""
        self._inflight.clear()

    def resend_inflight(self) -> int:
        """The receiver forgot this connection (it restarted and asks for a hello): what it
        did not acknowledge it never took in, so each key's unacknowledged message is
        queued again, after the control messages (the hello), unless a newer one for the
        key waits already. Returns how many were queued again."""
        again = 0
        for key, (_, frames) in self._inflight.items():
            if frames is not None and key not in self._latest:
                self._latest[key] = ("", frames)
                again += 1
        self._inflight.clear()
        return again

    def add_control(self, frames: list[Any]) -> None:
        self._control.append(frames)

    def add_last(self, frames: list[Any]) -> None:
        """A control message that leaves only after every data message held now or
        later has been sent (bounded by ``ack_timeout``, which frees stuck keys)."""
        self._last.append(frames)

    def tag(self, key: Hashable) -> str | None:
        """The tag of the unsent data message held for ``key``, or None."""
        entry = self._latest.get(key)
        return None if entry is None else entry[0]

    def add_latest(self, key: Hashable, frames: list[Any], tag: str = "") -> bool:
        """Hold ``frames`` as the message for ``key``; True when it replaced an unsent one
        (which keeps its place in the sending order, so no key starves)."""
        replaced = key in self._latest
        self._latest[key] = (tag, frames)
        self.superseded += replaced
        return replaced

    def flush(self, send: Callable[[list[Any]], None], now: float | None = None) -> bool:
        """Send what fits; True when nothing is left to send. ``send`` raises
        ``zmq.Again`` when the connection has no room; any other error propagates."""
        now = time.monotonic() if now is None else now
        for key in [k for k, (t, _) in self._inflight.items() if now - t > self.ack_timeout]:
            del self._inflight[key]
        try:
            while self._control:
                send(self._control[0])
                self._control.popleft()
            for key in [k for k in self._latest if k not in self._inflight]:
                frames = self._latest[key][1]
                send(frames)
                del self._latest[key]
                self._inflight[key] = (now, frames if self.keep_sent else None)
            while self._last and not self._latest:
                send(self._last[0])
                self._last.popleft()
        except zmq.Again:
            return False
        return not self._control and not self._latest and not self._last
