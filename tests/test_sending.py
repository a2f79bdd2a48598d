"""The learner's send thread (``rackmend.learner.sending``): contributions leave from one
thread other than the training thread, in order; a failed send is raised on the
training thread, never lost; ``close`` sends what is queued before leaving; the
results equal a run whose sends leave at once (the deterministic reference tests
cover that bit for bit: tests/test_deterministic.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rackmend import CompressionConfig, InProcessSyncer, RackmendConfig, RackmendOptimizer, ScheduleConfig
from rackmend.core.messages import Contribution
from rackmend.learner.sending import MAX_PENDING, SendThread
from rackmend.transport.base import LearnerLink, TransportError

from torch import nn

from helpers import make_inner, make_model, train


class RecordingLink(LearnerLink):
    """A real in-process link, recording each call (and on which thread), with the faults
    a send thread must not hide: a send that fails (``fail_at``: the n-th; ``failed`` is
    set once it has raised), a slow one (``send_delay``), and sends held until the test
    lets them go (``hold``; each records whether it was let go or gave up after 30 s)."""

    def __init__(self, inner: LearnerLink, *, fail_at: int = 0, send_delay: float = 0.0,
                 hold: threading.Event | None = None) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.send_delay = send_delay
        self.hold = hold
        self.failed = threading.Event()
        self.calls: list[tuple[str, str, int, int]] = []
        """(call, thread name, fragment, step)."""
        self.released: list[bool] = []

    def join(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.inner.join(*args, **kwargs)

    def send(self, contribution: Contribution) -> None:
        if self.hold is not None:
            self.released.append(self.hold.wait(30))
        if self.send_delay:
            time.sleep(self.send_delay)
        self.calls.append(("send", threading.current_thread().name, contribution.fragment, contribution.step))
        if self.fail_at and sum(c[0] == "send" for c in self.calls) == self.fail_at:
            self.failed.set()
            raise TransportError("the link to the syncer failed: injected at this send")
        self.inner.send(contribution)

    def poll(self):  # type: ignore[no-untyped-def]
        return self.inner.poll()

    def wait(self, fragment: int, after_version: int, timeout: float):  # type: ignore[no-untyped-def]
        return self.inner.wait(fragment, after_version, timeout)

    def leave(self) -> None:
        self.calls.append(("leave", threading.current_thread().name, -1, -1))
        self.inner.leave()


def _config(**compression: str) -> RackmendConfig:
    return RackmendConfig(schedule=ScheduleConfig(sync_every=2, num_fragments=2, overlap=1),
                          compression=CompressionConfig(**compression))


def _learner(hub: InProcessSyncer, config: RackmendConfig,
             **faults: float) -> tuple[nn.Module, RecordingLink, RackmendOptimizer]:
    """A learner of the tests' TinyLM on a recording link to ``hub``."""
    model = make_model()
    link = RecordingLink(hub.connect(), **faults)  # type: ignore[arg-type]  # faults: floats and an Event
    opt = RackmendOptimizer(model, make_inner(model), config, link, learner_id="l0")
    return model, link, opt


def test_sends_leave_from_one_thread_in_order() -> None:
    config = _config()
    with InProcessSyncer.for_model(config, make_model()) as hub:
        model, link, opt = _learner(hub, config)
        train(opt, model, "l0", range(1, 13))
        opt.close()
    sends = [c for c in link.calls if c[0] == "send"]
    # One fragment leaves after every step (P = H = 2), in step order, all from the send thread.
    assert [(p, t) for _, _, p, t in sends] == [(t % 2, t) for t in range(1, 13)]
    threads = {name for _, name, _, _ in sends}
    assert len(threads) == 1 and threading.current_thread().name not in threads, threads
    assert link.calls[-1][0] == "leave"
    assert opt.bytes_sent == sum(t.numel() * 4 for t in model.parameters()) * 6


def test_a_failed_send_is_raised_on_the_training_thread_at_the_next_step() -> None:
    config = _config()
    with InProcessSyncer.for_model(config, make_model()) as hub:
        model, link, opt = _learner(hub, config, fail_at=3)
        train(opt, model, "l0", range(1, 4))  # the 3rd send is made at step 3 and fails on the send thread
        assert link.failed.wait(30), "the 3rd send never ran"
        with pytest.raises(TransportError, match="injected at this send"):
            train(opt, model, "l0", range(4, 5))
        with pytest.raises(TransportError, match="injected at this send"):  # and at every step after
            train(opt, model, "l0", range(5, 6))
        assert "rackmend" in opt.state_dict(), "a learner can still be checkpointed after a failed send"
        # close does not raise it again, and still leaves (the syncer stops waiting for
        # this learner at once).
        opt.close()
        assert link.calls[-1][0] == "leave"


def test_sends_leave_while_training_goes_on_and_close_sends_them_before_leaving() -> None:
    config = _config()
    hold = threading.Event()
    with InProcessSyncer.for_model(config, make_model()) as hub:
        model, link, opt = _learner(hub, config, hold=hold)  # type: ignore[arg-type]
        # Two steps, two sends (fragments 1 and 0), both held on the link: training
        # does not wait for them (it would wait for the held send until it gave up).
        train(opt, model, "l0", range(1, 3))
        assert not any(c[0] == "send" for c in link.calls), "a held send completed before it was let go"
        hold.set()
        opt.close()
    assert link.released == [True, True], "a send gave up waiting: training waited for the sends"
    assert [c[0] for c in link.calls] == ["send", "send", "leave"]


def test_state_dict_waits_for_queued_sends() -> None:
    """A checkpoint holds the uplink codec's residuals: it is taken after every send
    made before it has run, so a resumed learner continues the same error feedback."""
    config = _config(uplink="int8")
    with InProcessSyncer.for_model(config, make_model()) as hub:
        model, link, opt = _learner(hub, config, send_delay=0.2)
        train(opt, model, "l0", range(1, 4))
        state = opt.state_dict()
        assert sum(c[0] == "send" for c in link.calls) == 3
        # Residuals of both fragments: the sends of steps 2 and 3 were built before it.
        residuals = [json.loads(k.split("/", 1)[1]) for k in state["rackmend"]["uplink"] if k.startswith("residual/")]
        assert {key[0] for key in residuals} == {0, 1}, residuals
        opt.close()


def test_send_thread_bounds_what_is_queued() -> None:
    release = threading.Event()
    started: list[int] = []
    sender = SendThread("test")

    def job(i: int) -> None:
        started.append(i)
        release.wait(10)

    waiter = threading.Thread(target=lambda: [sender.submit(lambda i=i: job(i)) for i in range(MAX_PENDING + 2)])
    try:
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "submit did not wait with more than MAX_PENDING jobs queued"
    finally:
        release.set()
    waiter.join(10)
    sender.close()
    assert started == list(range(MAX_PENDING + 2))


def test_jobs_after_a_failed_one_are_skipped_and_the_failure_is_raised() -> None:
    go = threading.Event()
    ran: list[str] = []
    sender = SendThread("test")

    def fail() -> None:
        go.wait(10)
        raise TransportError("injected")

    sender.submit(fail)
    sender.submit(lambda: ran.append("after"))
    go.set()
    with pytest.raises(TransportError, match="injected"):
        sender.wait()
    with pytest.raises(TransportError, match="injected"):
        sender.submit(lambda: ran.append("later"))
    sender.close()  # raised already: not again
    assert ran == [], "a job queued after the failed one was run"
    unreported = SendThread("test")
    unreported.submit(fail)
    with pytest.raises(TransportError, match="injected"):
        unreported.close()
