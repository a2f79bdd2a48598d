"""Two learners train through emulated WAN links to a live syncer; one link drops
every connection for a while. The other learner never stalls, and the cut-off one
reconnects by itself (ZeroMQ) and merges again after the outage."""

from __future__ import annotations

import threading
import time

import pytest

from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.netem.link import LinkConfig, LinkEmulator, Outage
from rackmend.service import ServiceConfig, SyncerService
from rackmend.transport.zmq_link import ZmqLink

from helpers import batch, make_inner, make_model

pytestmark = pytest.mark.usefixtures("one_thread")

OUTAGE_START, OUTAGE_S = 2.0, 2.0


def test_two_learners_survive_a_link_outage() -> None:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=1, learners=("l0", "l1"), grace_max=0.1))
    svc = SyncerService(config, ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_timeout=1.0))
    records: list[dict] = []
    record = svc._record
    svc._record = lambda r: (records.append(r), record(r))  # type: ignore[method-assign]
    server = threading.Thread(target=svc.serve, daemon=True)
    server.start()
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
    errors: list[BaseException] = []

    def learner(lid: str) -> None:
        try:
            model = make_model()
            opt = RackmendOptimizer(model, make_inner(model), config,
                                    ZmqLink(links[lid].address, heartbeat_s=0.2), learner_id=lid)
            t = 0
            while time.monotonic() - t_start < OUTAGE_START + OUTAGE_S + 4.0 and t < 5000:
                t += 1
                x, y, tokens = batch(lid, t)
                loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step(tokens=tokens)
                step_times[lid].append(time.monotonic() - t_start)
                time.sleep(0.01)
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(lid,)) for lid in links]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    svc.stop()
    server.join(20)
    for link in links.values():
        link.close()
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    # l0 kept stepping through l1's outage: no gap longer than a second in its steps.
    during = [t for t in step_times["l0"] if OUTAGE_START <= t <= OUTAGE_START + OUTAGE_S]
    assert len(during) > 20
    gaps = [b - a for a, b in zip(step_times["l0"], step_times["l0"][1:])]
    assert max(gaps) < 1.0, f"l0 stalled for {max(gaps):.2f}s"
    # l1 also kept computing while cut off (it never blocks on the syncer).
    assert len([t for t in step_times["l1"] if OUTAGE_START + 0.3 <= t <= OUTAGE_START + OUTAGE_S]) > 10
    merges = [r for r in records if r["event"] == "merge"]
    assert any("l0" in m["merged"] for m in merges)
    # records[0] is the syncer's "listening" event, just before the links started.
    after = [m for m in merges if m["t"] > records[0]["t"] + OUTAGE_START + OUTAGE_S + 0.5]
    assert any("l1" in m["merged"] for m in after), "l1 did not merge again after its link came back"
    assert links["l1"].stats()["dropped_connections"] >= 1
