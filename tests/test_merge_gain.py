"""Merge gain: learners measure their probe loss just before and just after applying a
merged value, and the figure reaches the learner's ``merge_gains`` and the syncer's log,
where a streak of harmful merges becomes a ``merge_harmful`` warning."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig, ZmqLink
from rackmend.transport.inprocess import InProcessSyncer

from helpers import batch, make_inner, make_model, run_threads, serving, train

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(outer_lr: float, deterministic: bool = True) -> RackmendConfig:
    return RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
        # norm_guard off: the guard would clip the absurd outer step these tests build on purpose.
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1"), outer_lr=outer_lr, outer_kwargs={"momentum": 0.0},
                            norm_guard=0.0),
        learner=LearnerConfig(wait_timeout=30),
        deterministic=deterministic,
    )


def _probe(model: torch.nn.Module):
    x, y, _ = batch("l9", 0)  # a batch no learner trains on
    return lambda: float(model(x, y))


def _train_pair(config: RackmendConfig, connect, steps: int = 40) -> dict[str, list[float | None]]:
    gains: dict[str, list[float | None]] = {}

    def rack(lid: str) -> None:
        model = make_model()
        opt = RackmendOptimizer(model, make_inner(model), config, connect(), learner_id=lid, probe_loss=_probe(model))
        train(opt, model, lid, range(1, steps + 1))
        gains[lid] = list(opt.merge_gains)
        opt.close()

    run_threads(rack, [("l0",), ("l1",)])
    return gains


def test_an_absurd_outer_step_shows_as_negative_gain_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    results = {}
    for lr in (1.0, 100.0):
        with InProcessSyncer.for_model(_config(lr), make_model()) as hub:
            learner_gains = _train_pair(_config(lr), hub.connect)
        merges = [e for e in hub.merges() if e["gains"]]
        assert len(merges) >= 10, "gains did not reach the syncer's merge records"
        assert all(set(e["gains"]) <= {"l0", "l1"} for e in merges)
        logged = [g for e in merges for g in e["gains"].values()]
        results[lr] = (statistics.median(logged), hub, learner_gains)
    sane, absurd = results[1.0], results[100.0]
    assert absurd[0] < -0.1 and sane[0] > absurd[0] + 0.1, (sane[0], absurd[0])
    measured = [g for gains in absurd[2].values() for g in gains]
    assert all(g is not None for g in measured) and statistics.median(measured) < 0, absurd[2]
    harmful = [e for e in absurd[1].events if e["event"] == "merge_harmful"]
    assert harmful and "outer_lr" in harmful[0]["reason"]
    assert not [e for e in sane[1].events if e["event"] == "merge_harmful"]
    assert "outer step is probably too large" in caplog.text, "the warning did not reach the log"


def test_gains_travel_over_the_wire_to_the_service_log() -> None:
    config = _config(100.0)
    svc, records, thread = serving(config)
    try:
        _train_pair(config, lambda: ZmqLink(svc.endpoint, heartbeat_s=0.2), steps=24)
    finally:
        svc.stop()
        thread.join(20)
    merges = [r for r in records if r["event"] == "merge" and r["gains"]]
    assert merges and statistics.median(g for r in merges for g in r["gains"].values()) < -0.1
    assert any(r["event"] == "merge_harmful" for r in records)
