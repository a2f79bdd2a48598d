"""The outbox's ordering rules, with a send function that records (no sockets)."""

from __future__ import annotations

from rackmend.transport.outbox import Outbox


def test_a_leave_waits_for_the_data_queued_before_it() -> None:
    """A learner that sends c1, then c2 (held: c1 is not acknowledged yet), then leaves:
    the leave must not overtake c2, or the syncer merges without c2's work and then
    refuses c2 from a learner that has left."""
    sent: list[str] = []
    box = Outbox()
    box.add_latest(0, ["c1"])
    assert box.flush(lambda frames: sent.append(frames[0]), now=0.0)
    box.add_latest(0, ["c2"])  # waits: c1 is in flight
    box.add_last(["leave"])
    box.add_control(["heartbeat"])  # plain control messages still go first
    assert not box.flush(lambda frames: sent.append(frames[0]), now=0.1)
    assert sent == ["c1", "heartbeat"]
    box.ack(0)
    assert box.flush(lambda frames: sent.append(frames[0]), now=0.2)
    assert sent == ["c1", "heartbeat", "c2", "leave"]
    assert not box
