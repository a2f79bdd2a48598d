"""Learners train through emulated WAN links to a live syncer while a link fails.

A dropped link: the other learner never stalls, and the cut-off one reconnects by
itself (ZeroMQ) and merges again after the outage. A stalled link in blocking mode:
the learner the syncer dropped for silence rejoins instead of deadlocking."""

from __future__ import annotations

import time
from typing import Callable

import pytest

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core.records import Left, Merged
from rackmend.netem.link import LinkConfig, LinkEmulator, Outage
from rackmend.transport.zmq_link import ZmqLink

from helpers import batch, make_inner, make_model, run_threads, serving
from procs import of

# Link outages timed in seconds of real time: never beside another heavy test.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.serial]

OUTAGE_START, OUTAGE_S = 2.0, 2.0
STALL_START, STALL_S = 1.5, 2.5


def train_until(config: RackmendConfig, lid: str, endpoint: str, end: float, pause: float,
                on_step: Callable[[], None] | None = None) -> None:
    """One learner through ``endpoint`` until ``time.monotonic()`` reaches ``end``
    (at most 5000 steps), pausing ``pause`` seconds per step; then a graceful leave."""
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(endpoint, heartbeat_s=0.2), learner_id=lid)
    t = 0
    while time.monotonic() < end and t < 5000:
        t += 1
        x, y, tokens = batch(lid, t)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=tokens)
        if on_step is not None:
            on_step()
        time.sleep(pause)
    opt.close()


def test_two_learners_survive_a_link_outage() -> None:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=1, learners=("l0", "l1"), grace_max=0.1))
    svc, records, server = serving(config, heartbeat_timeout=1.0)
    port = int(svc.endpoint.rsplit(":", 1)[1])
    links = {
        "l0": LinkEmulator(("127.0.0.1", port), LinkConfig(latency_s=0.01, bandwidth_bps=50e6), name="l0"),
        "l1": LinkEmulator(("127.0.0.1", port), LinkConfig(latency_s=0.01, bandwidth_bps=50e6, outages=(
            Outage(start=OUTAGE_START, duration=OUTAGE_S, mode="drop"),)), name="l1"),
    }
    for link in links.values():
        link.start()
    t_start = time.monotonic()
    step_times: dict[str, list[float]] = {"l0": [], "l1": []}

    def learner(lid: str) -> None:
        train_until(config, lid, links[lid].address, t_start + OUTAGE_START + OUTAGE_S + 4.0, 0.01,
                    lambda: step_times[lid].append(time.monotonic() - t_start))

    try:
        run_threads(learner, [(lid,) for lid in links])
    finally:
        svc.stop()
        server.join(20)
        for link in links.values():
            link.close()
    # l0 kept stepping through l1's outage: no gap longer than a second in its steps.
    during = [t for t in step_times["l0"] if OUTAGE_START <= t <= OUTAGE_START + OUTAGE_S]
    assert len(during) > 20
    gaps = [b - a for a, b in zip(step_times["l0"], step_times["l0"][1:])]
    assert max(gaps) < 1.0, f"l0 stalled for {max(gaps):.2f}s"
    # l1 also kept computing while cut off (it never blocks on the syncer).
    assert len([t for t in step_times["l1"] if OUTAGE_START + 0.3 <= t <= OUTAGE_START + OUTAGE_S]) > 10
    merges = of(records, Merged)
    assert any("l0" in m.merged for m in merges)
    # records[0] is the syncer's Listening event, just before the links started.
    after = [m for m in merges if m.t > records[0].t + OUTAGE_START + OUTAGE_S + 0.5]
    assert any("l1" in m.merged for m in after), "l1 did not merge again after its link came back"
    assert links["l1"].stats()["dropped_connections"] >= 1
    # Both left gracefully through their links (the syncer's bye came back), not by silence.
    assert {r.learner: r.reason for r in of(records, Left)} == {"l0": "leave", "l1": "leave"}


def test_deterministic_learner_declared_silent_rejoins_without_deadlock() -> None:
    """Blocking mode: both learners' path stalls past the heartbeat timeout while they
    wait for a merge. The syncer drops both (their contributions, delivered late, are
    refused), so no merge happens; when they speak again it takes them back with the
    same version they hold. They must adopt it and go on instead of waiting for a merge
    of contributions the syncer no longer has."""
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=2, num_fragments=1, overlap=0),
                            syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1")),
                            learner=LearnerConfig(wait_timeout=15.0), deterministic=True)
    svc, records, server = serving(config, heartbeat_timeout=1.0)
    port = int(svc.endpoint.rsplit(":", 1)[1])
    stall = LinkEmulator(("127.0.0.1", port), LinkConfig(latency_s=0.005, outages=(
        Outage(start=STALL_START, duration=STALL_S, mode="blackhole"),)), name="wan").start()
    t_start = time.monotonic()
    finished: dict[str, float] = {}

    def learner(lid: str) -> None:
        train_until(config, lid, stall.address, t_start + STALL_START + STALL_S + 3.0, 0.02)
        finished[lid] = time.monotonic() - t_start

    try:
        run_threads(learner, [("l0",), ("l1",)])
    finally:
        svc.stop()
        server.join(20)
        stall.close()
    assert set(finished) == {"l0", "l1"}
    assert max(finished.values()) < STALL_START + STALL_S + 10, f"a learner hung: {finished}"
    t_listen = records[0].t
    silent = [r for r in of(records, Left) if r.learner == "l1" and r.reason == "silent"]
    assert silent, "the stall did not make the syncer drop l1 (the test would prove nothing)"
    back = [r for r in of(records, Merged) if "l1" in r.merged and r.t > silent[0].t]
    assert back, "l1 never merged again after being dropped"
    assert back[0].t - t_listen < STALL_START + STALL_S + 6
