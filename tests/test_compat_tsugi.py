"""The tsugi-mend SDK's API over rackmend (``rackmend.compat.tsugi``): the SDK's quickstart
in two learner processes against a real ``rackmend syncer`` equals the reference bit for
bit; settings are mapped as docs/migration.md says; misuse fails loudly."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from rackmend.compat.tsugi import MendConfig, get_runtime, mend_init, mend_shutdown
from rackmend.config import ConfigError
from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import fragment_offsets
from rackmend.core.messages import Update
from rackmend.core.records import Merged, MomentsMerged
from rackmend.core.settings import SyncerSettings
from rackmend.learner import RackmendOptimizer
from rackmend.service.cli import add_syncer_arguments, build, resolve
from rackmend.transport import InProcessSyncer, wire
from rackmend.transport.zmq_link import ZmqLink

from helpers import assert_files_equal_reference, batch, make_inner, make_model, serving
from procs import HERE, Procs, events, finish
from reference import reference_run

TSUGI = [sys.executable, str(HERE / "_tsugi_proc.py")]


def test_the_sdks_quickstart_in_two_processes_equals_the_reference(procs: Procs, tmp_path: Path) -> None:
    ids, H, P, steps = ["l0", "l1"], 3, 2, 12
    config = MendConfig(quorum_min_learners=2, grace_window_ms=2000, token_weighted_merge=True, sync_period_steps=H,
                        concurrent_outer_step=True, num_fragments=P, deterministic=True)
    _, endpoint = procs.syncer(*config.syncer_flags(ids))
    racks = {lid: procs.start([*TSUGI, "--endpoint", endpoint, "--id", lid, "--learners", ",".join(ids),
                               "--steps", str(steps), "--H", str(H), "--P", str(P), "--out", str(tmp_path)], lid)
             for lid in ids}
    for lid, proc in racks.items():
        finish(proc, procs, lid, timeout=120)

    torch.set_num_threads(1)
    ref_models, _ = reference_run(make_model, make_inner, batch, config.to_rackmend(tuple(ids)), ids, steps)
    assert_files_equal_reference(tmp_path, ids, ref_models)
    merges = events(tmp_path, Merged)
    assert len(merges) >= P * 3 and all(list(e.merged) == ids for e in merges)
    assert all(e.weights["l0"] != e.weights["l1"] for e in merges), "token weights were not used"

    # What outer_step_collect returned: every merged value applied at t_send + tau, in
    # the step after it (collect runs before step_end), labelled with the send's round.
    tau = config.overlap
    expected = []
    for p, offset in enumerate(fragment_offsets(P, H)):
        sends = [t for t in range(1, steps + 1) if (t - offset) % H == 0]
        for k, t in enumerate(sends):
            applied_step = t + tau - 1  # 0-based step whose step_end applied it
            if applied_step < steps - 1:
                expected.append({"round_id": t - 1, "fragments": [p], "versions": [k + 1], "staleness": 0,
                                 "step": applied_step, "delta_len": 0})
    expected.sort(key=lambda r: r["step"])
    for lid in ids:
        out = json.loads((tmp_path / f"{lid}.json").read_text())
        got_results = [{k: v for k, v in r.items() if k != "loss"} for r in out["results"]]
        assert got_results == expected
        diag = [json.loads(line) for line in (tmp_path / "mend_diag" / f"{lid}.jsonl").read_text().splitlines()]
        assert [(d["fragment"], d["version"]) for d in diag] == [
            (r["fragments"][0], r["versions"][0]) for r in expected] + [(1, 4)], "diagnostics miss a merge"


def _syncer_config(flags: list[str]):
    p = argparse.ArgumentParser()
    add_syncer_arguments(p)
    return build(resolve(p.parse_args(flags), {}))[0]


def test_settings_map_to_rackmends_and_the_syncer_flags_agree() -> None:
    c = MendConfig(quorum_min_learners=2, grace_window_ms=1500, token_weighted_merge=False, sync_period_steps=16,
                   concurrent_outer_step=True, compression="int8")
    r = c.to_rackmend(("a", "b"))
    assert (r.schedule.sync_every, r.schedule.num_fragments, r.schedule.overlap) == (16, 1, 2)
    assert (r.syncer.min_quorum, r.syncer.grace_max, r.syncer.weighting) == (2, 1.5, "uniform")
    assert r.compression.uplink == "int8" and not r.deterministic
    s = _syncer_config(c.syncer_flags(("a", "b")))
    for name in ("min_quorum", "grace_max", "weighting", "learners"):
        assert getattr(s.syncer, name) == getattr(r.syncer, name), name
    assert s.syncer.overlap == r.schedule.overlap and s.deterministic == r.deterministic  # pinned
    assert MendConfig(sync_period_steps=1).overlap == 0, "tau must stay below H"
    assert MendConfig(concurrent_outer_step=False).overlap == 0
    assert MendConfig(token_weighted_merge=True).to_rackmend().syncer.weighting == "tokens_sq_per_step"
    assert "--deterministic" in MendConfig(deterministic=True).syncer_flags(("a",))


@pytest.mark.parametrize("field,fix", [("async_tp", "async TP")])
def test_settings_rackmend_cannot_honour_are_refused_with_the_alternative(field: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=f"MendConfig.{field}=True") as info:
        MendConfig(**{field: True})
    assert fix in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"quorum_min_learners": 0}, "quorum_min_learners must be >= 1"),
    ({"grace_window_ms": -1}, "grace_window_ms"),
    ({"sync_period_steps": 0}, "sync_period_steps must be >= 1"),
    ({"concurrent_outer_step": False, "overlap_steps": 2}, "concurrent_outer_step=False"),
    ({"sync_period_steps": 4, "overlap_steps": 4}, "sync_period_steps"),
    ({"compression": "int3"}, "compression"),
])
def test_bad_values_are_refused_in_the_sdks_words(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MendConfig(**kwargs)


def test_misuse_fails_loudly_and_the_delta_is_not_handed_out_twice(one_thread: None) -> None:
    config = MendConfig(sync_period_steps=2, num_fragments=1, concurrent_outer_step=False, deterministic=True,
                        wait_timeout_s=20, tokens_per_step=12)
    model = make_model()
    with pytest.raises(RuntimeError, match="call mend_init"):
        get_runtime(model)
    hub = InProcessSyncer.for_model(config.to_rackmend(("l0",)), make_model())
    try:
        mend_init(model, config, learner_id="l0", link=hub.connect(), learners=("l0",))
        with pytest.raises(RuntimeError, match="already called"):
            mend_init(model, config, learner_id="l0", link=hub.connect())
        rt = get_runtime(model)
        with pytest.raises(RuntimeError, match="step_begin\\(1\\) but the runtime is at step 0"):
            rt.step_begin(1)
        rt.step_begin(0)
        with pytest.raises(RuntimeError, match="no fragment leaves after it"):
            rt.outer_step_begin(round_id=0, fragment_provider={"head.weight": torch.zeros(17, 8)})
        rt.step_end(0)
        rt.step_begin(1)
        assert rt.schedule_for(1).should_sync_params
        with pytest.raises(ValueError, match="'head.bias' with shape \\[3\\]"):
            rt.outer_step_begin(round_id=1, fragment_provider=lambda: {"head.bias": torch.zeros(3)})
        with pytest.raises(ValueError, match="does not synchronise"):
            rt.outer_step_begin(round_id=1, fragment_provider={"nope": torch.zeros(3)})
        rt.outer_step_begin(round_id=41, fragment_provider=lambda: dict(model.named_parameters()))
        with pytest.raises(RuntimeError, match="built without the caller.s optimizer"):
            rt.optimizer.step()
        rt.step_end(1)  # tau = 0, deterministic: applied at once
        result = rt.outer_step_collect()
        assert result is not None and (result.round_id, result.fragments, result.versions) == (41, (0,), (1,))
        assert len(result.merged_delta) == 0 and list(result.merged_delta.items()) == []
        with pytest.raises(KeyError, match="already applied"):
            result.merged_delta["head.weight"]
        assert rt.outer_step_collect() is None
        assert not rt.outer_step_in_flight()
        merged = [e for e in hub.merges()]
        assert merged and merged[0].tokens == {"l0": 24.0}, "tokens_per_step did not reach the merge"
    finally:
        mend_shutdown(model)
        hub.close()
    mend_shutdown(model)  # a second call does nothing


def test_des_loc_and_fail_slow_detection_map_to_rackmends(one_thread: None, tmp_path: Path) -> None:
    """Both were refused as 'not in rackmend yet'; rackmend has both. DES-LOC averages the
    caller's Adam moments (moment rounds at the syncer); fail-slow detection is the
    syncer's (its flag), and the learner writes the syncer's reports to its diagnostics."""
    config = MendConfig(des_loc=True, fail_slow_detection=True, sync_period_steps=4, num_fragments=2,
                        tokens_per_step=12, diagnostics_dir=str(tmp_path / "diag"))
    r = config.to_rackmend()
    assert r.schedule.desloc and r.schedule.moment_periods() == (12, 24) and r.syncer.failslow
    assert "--failslow" in config.syncer_flags() and "--no-failslow" in MendConfig().syncer_flags()
    assert _syncer_config(config.syncer_flags()).syncer.failslow
    assert not _syncer_config(MendConfig().syncer_flags()).syncer.failslow, "the SDK detected nothing by default"
    with pytest.raises(ConfigError, match="fail_slow_detection=True with deterministic=True"):
        MendConfig(fail_slow_detection=True, deterministic=True)
    model = make_model()
    hub = InProcessSyncer.for_model(r, make_model())
    try:
        with pytest.raises(ConfigError, match="pass optimizer="):
            mend_init(model, config, learner_id="l0", link=hub.connect())
        inner = make_inner(model)
        link = hub.connect()
        rt = mend_init(model, config, learner_id="l0", link=link, optimizer=inner)
        for step in range(26):
            rt.step_begin(step)
            x, y, tokens = batch("l0", step + 1)
            inner.zero_grad()
            model(x, y).backward()
            inner.step()
            if step == 20:  # what the syncer's link hands over when it finds this rack slow
                link._advice.put(FailSlowReport(learner="l0", rank=0, state="slow", ratio=1.5, fleet_ratio=1.4,
                                                baseline_s=0.01, steps=12, cost_s=3.0))
            rt.step_end(step, tokens=tokens)
    finally:
        mend_shutdown(model)
        hub.close()
    kinds = {r.kind for r in hub.records if isinstance(r, MomentsMerged)}
    assert kinds == {"exp_avg", "exp_avg_sq"}, f"no DES-LOC moment rounds (got {kinds})"
    diag = [json.loads(line) for line in (tmp_path / "diag" / "l0.jsonl").read_text().splitlines()]
    slow = [d for d in diag if d["event"] == "fail_slow"]
    assert len(slow) == 1 and (slow[0]["state"], slow[0]["ratio"], slow[0]["step"]) == ("slow", 1.5, 20)


def test_round_settings_unlike_the_syncers_are_warned_at_join_naming_the_syncers(
        one_thread: None, caplog: pytest.LogCaptureFixture) -> None:
    """A learner's quorum_min_learners=4 was ignored silently beside a syncer running
    another quorum: the syncer now states its round settings in its answer to a join
    (an optional ``syncer`` field of the reset updates), and a learner whose values differ
    is warned, naming the syncer's value. Plain rackmend learners too."""
    run = MendConfig(sync_period_steps=4).to_rackmend()  # the syncer: min_quorum 1
    svc, _, thread = serving(run)
    models = [make_model() for _ in range(3)]
    opts: list[RackmendOptimizer] = []
    try:
        with caplog.at_level(logging.WARNING, logger="rackmend"):
            rt = mend_init(models[0], MendConfig(sync_period_steps=4, quorum_min_learners=4, tokens_per_step=12),
                           endpoint=svc.endpoint, learner_id="l0", optimizer=make_inner(models[0]))
            mine = run.replace(syncer=dataclasses.replace(run.syncer, min_quorum=2))
            opts.append(RackmendOptimizer(models[1], make_inner(models[1]), mine, ZmqLink(svc.endpoint),
                                          learner_id="l1"))
            opts.append(RackmendOptimizer(models[2], make_inner(models[2]), run, ZmqLink(svc.endpoint),
                                          learner_id="l2"))
    finally:
        for opt in opts:
            opt.close()
        mend_shutdown(models[0])
        svc.stop()
        thread.join(20)
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "syncer runs with" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "MendConfig.quorum_min_learners=4" in warned[0] and "min_quorum=1" in warned[0]
    assert "learner l1's config has SyncerConfig.min_quorum=2" in warned[1] and "min_quorum=1" in warned[1]
    assert "--min-quorum" in warned[1]
    assert rt.optimizer.syncer_settings == SyncerSettings(min_quorum=1, grace_max=2.0, weighting="tokens_sq_per_step",
                                                          failslow=False)

    # On the wire: only a join's answer states it, checked on receipt; old syncers send none.
    value = Update(0, 1, (torch.zeros(2),))
    said = SyncerSettings(min_quorum=3, grace_max=0.5, weighting="uniform", failslow=True)

    def parse(frames: list) -> SyncerSettings | None:
        return wire.parse_syncer_settings(wire.decode_header(frames, wire.SYNCER_TYPES, 1 << 20))
    assert parse(wire.update_frames(value, reset=True, syncer=said)) == said
    assert parse(wire.update_frames(value, reset=False, syncer=said)) is None
    assert parse(wire.update_frames(value, reset=True)) is None
    bad = wire.encode({"type": "update", "fragment": 0, "version": 1, "epoch": 0, "reset": True,
                       "syncer": {**said.to_wire(), "min_quorum": 0}})
    with pytest.raises(wire.WireError, match="min_quorum"):
        parse(bad)
