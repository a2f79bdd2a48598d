"""A learner whose link is far slower than what it and the syncer produce: queued
values are coalesced (newest per fragment) at both ends instead of piling up, so what
crosses the link stays fresh enough to be merged for the whole run."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core.records import Merged, Rejected
from rackmend.core.syncer import ContributionArrived
from rackmend.netem.link import LinkConfig, LinkEmulator
from rackmend.transport.zmq_link import ZmqLink

from helpers import run_threads, serving
from procs import of

pytestmark = pytest.mark.usefixtures("one_thread")

RUN_S = 8.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))  # 2 x 257 kB fragments


def test_a_slow_link_carries_fresh_values_not_a_backlog() -> None:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=1, learners=("fast", "slow"), grace_max=0.05,
                                                max_staleness=16))
    svc, records, server = serving(config, heartbeat_timeout=30)
    drive = svc.node._drive
    arrivals: list[tuple[float, str, int]] = []  # (time, learner, versions behind when it arrived)

    def watch(event: object, **kw: Any) -> Any:
        if isinstance(event, ContributionArrived) and svc.core is not None:
            c = event.contribution
            arrivals.append((svc.clock(), c.learner_id, svc.core.versions[c.fragment] - c.base_version))
        return drive(event, **kw)

    svc.node._drive = watch  # type: ignore[method-assign]
    port = int(svc.endpoint.rsplit(":", 1)[1])
    # 4 Mbit/s: one fragment takes ~0.5 s, while each learner makes one every ~0.15 s.
    slow = LinkEmulator(("127.0.0.1", port), LinkConfig(bandwidth_bps=4e6, latency_s=0.02),
                        name="slow", max_buffer_bytes=256 * 1024).start()
    links = {"fast": ZmqLink(svc.endpoint, heartbeat_s=0.2), "slow": ZmqLink(slow.address, heartbeat_s=0.2)}
    t_start = time.monotonic()

    def learner(lid: str) -> None:
        model = _model()
        opt = RackmendOptimizer(model, torch.optim.SGD(model.parameters(), lr=1e-3), config, links[lid],
                                learner_id=lid)
        g = torch.Generator().manual_seed(hash(lid) % 1000)
        t = 0
        while time.monotonic() - t_start < RUN_S and t < 100000:
            t += 1
            x = torch.randn(8, 256, generator=g)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step(tokens=8)
            time.sleep(0.03)
        opt.close()

    try:
        run_threads(learner, [(lid,) for lid in links])
    finally:
        svc.stop()
        server.join(20)
        slow.close()
    t0 = records[0].t
    merges = of(records, Merged)
    assert len(merges) > 30, "the fast learner should drive many merges"
    # Both ends coalesced: the slow link could never carry everything that was made.
    assert links["slow"].superseded_sends > 0 and svc.node.superseded_updates > 0
    # So what reaches the syncer from the slow learner is about as stale late in the run
    # as early on, instead of ever staler behind a growing backlog.
    slow_arrivals = [(t - t0, lag) for t, lid, lag in arrivals if lid == "slow"]
    middle = [lag for t, lag in slow_arrivals if 0.3 * RUN_S <= t < 0.6 * RUN_S]
    last = [lag for t, lag in slow_arrivals if 0.6 * RUN_S <= t <= RUN_S]
    assert middle and last, slow_arrivals
    assert max(last) <= max(middle) + 6, f"staleness grew: {slow_arrivals}"
    assert any("slow" in m.merged and m.t - t0 > 0.6 * RUN_S for m in merges), (
        "slow stopped being merged", slow_arrivals, [r.reason for r in of(records, Rejected)][-5:])
