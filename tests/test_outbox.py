"""The outbox's ordering rules, with a send function that records (no sockets), and a
real link that waits for an acknowledgement without spinning."""

from __future__ import annotations

import os
import signal
import time

from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, ZmqLink
from rackmend.transport.outbox import Outbox

from helpers import make_inner, make_model, train
from procs import Procs


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


def test_what_was_not_acknowledged_goes_again_after_a_hello_unless_newer_waits() -> None:
    """A restarted syncer took in none of what it did not acknowledge: with ``keep_sent``
    each key's unacknowledged message is queued again after the hello; a key with a
    newer message waiting sends only that one, an acknowledged one nothing. Without
    ``keep_sent`` (the syncer's side: updates to every peer) nothing is held or resent."""
    sent: list[str] = []
    box = Outbox(keep_sent=True)
    for key, frames in ((0, ["a1"]), (1, ["b1"]), (2, ["c1"])):
        box.add_latest(key, frames)
    assert box.flush(lambda frames: sent.append(frames[0]), now=0.0)
    box.ack(1)
    box.add_latest(2, ["c2"])  # newer than the unacknowledged c1: held
    assert box.resend_inflight() == 1
    box.add_control(["hello"])
    assert box.flush(lambda frames: sent.append(frames[0]), now=1.0)
    assert sent == ["a1", "b1", "c1", "hello", "c2", "a1"], sent
    plain = Outbox()
    plain.add_latest(0, ["a1"])
    assert plain.flush(lambda frames: None, now=0.0)
    assert plain.resend_inflight() == 0 and not plain


def test_held_data_is_not_sendable_until_acknowledged_or_expired() -> None:
    box = Outbox(ack_timeout=5.0)
    assert not box.sendable(0.0) and box.next_expiry() is None
    box.add_latest(0, ["c1"])
    assert box.sendable(0.0)
    box.flush(lambda frames: None, now=1.0)
    box.add_latest(0, ["c2"])  # held: c1 is in flight
    assert box and not box.sendable(2.0) and box.next_expiry() == 6.0
    assert box.sendable(6.5)  # c1 counts as lost after ack_timeout
    box.add_control(["hello"])
    assert box.sendable(2.0)


def test_a_link_waiting_for_an_acknowledgement_does_not_spin(procs: Procs) -> None:
    """A contribution held until its fragment's last one is acknowledged used to leave
    POLLOUT set on the link's socket: every poll returned at once, a busy loop that took a
    core and the GIL from the training thread until the acknowledgement came (up to the
    outbox's ack_timeout when it never does)."""
    syncer, endpoint = procs.syncer("--overlap", "1")
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=2, num_fragments=1, overlap=1))
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(endpoint), learner_id="l0")
    try:
        train(opt, model, "l0", range(1, 3))  # one send, acknowledged
        time.sleep(0.5)
        os.kill(syncer.pid, signal.SIGSTOP)  # from now on nothing is acknowledged
        try:
            train(opt, model, "l0", range(3, 7))  # sent at step 4 (in flight), then step 6: held
            time.sleep(0.3)
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(1.5)
            cpu = time.process_time() - cpu0
            wall = time.monotonic() - wall0
        finally:
            os.kill(syncer.pid, signal.SIGCONT)
        assert opt.link._outbox and not opt.link._outbox.sendable(), "the test did not hold a contribution back"
        # Idle but for heartbeats; a busy loop takes most of a core (>= 0.9 s here unloaded).
        assert cpu < 0.25 * wall, f"the process used {cpu:.2f} s of CPU in {wall:.2f} s while waiting"
    finally:
        opt.close()
