"""The multi-process demo machinery: a tiny real run (syncer process, learner
processes behind emulated links, a fail-slow learner) and the report written from it;
plus the pieces the demo relies on: arm configs reaching the syncer intact, settings
validation, loss interpolation."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from rackmend.config import ConfigError
from rackmend.core.failslow import RestoreLearner, StopExpecting
from rackmend.core.records import FailSlowNoted, Left, Merged, from_record
from rackmend.demo.orchestrate import run_arm, syncer_flags
from rackmend.demo.report import REPORT_FILES, loss_at_tokens, write_report
from rackmend.demo.spec import FaultPlan, LinkPlan, RunSettings, arm_specs, config_from_dict, config_to_dict
from rackmend.service import cli as service_cli
from rackmend.workloads import GPTConfig

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


def test_arm_configs_reach_the_syncer_unchanged() -> None:
    """The flags the orchestrator passes to `rackmend syncer` rebuild each arm's syncer config."""
    s = RunSettings(learners=3, sync_every=8, fragments=2, overlap=1,
                    arms=("data-parallel", "diloco", "rackmend", "rackmend-int4"),
                    faults=FaultPlan.none())
    for name, spec in arm_specs(s).items():
        p = argparse.ArgumentParser()
        service_cli.add_syncer_arguments(p)
        config, _ = service_cli.build(service_cli.resolve(p.parse_args(syncer_flags(spec)), environ={}))
        assert config.syncer == spec.config.syncer, name
        assert config.deterministic == spec.config.deterministic, name
        assert config.compression == spec.config.compression, name
        assert config_from_dict(json.loads(json.dumps(config_to_dict(spec.config)))) == spec.config


def test_arms_differ_as_the_issue_asks() -> None:
    specs = arm_specs(RunSettings(arms=("data-parallel", "diloco", "rackmend", "rackmend-int4", "local")))
    dp, diloco, rm = (specs[n].config for n in ("data-parallel", "diloco", "rackmend"))
    assert (dp.schedule.sync_every, dp.schedule.num_fragments, dp.schedule.overlap, dp.deterministic) == (1, 1, 0, True)
    assert dp.syncer.min_quorum == 4 and dp.syncer.outer_lr == 1.0 and dp.syncer.resolved_outer_kwargs() == {}
    assert (diloco.schedule.num_fragments, diloco.schedule.overlap, diloco.deterministic) == (1, 0, True)
    assert diloco.syncer.outer_lr == 0.7 and diloco.syncer.resolved_outer_kwargs() == {"momentum": 0.9, "nesterov": True}
    assert (rm.schedule.num_fragments, rm.syncer.min_quorum, rm.deterministic) == (4, 1, False)
    assert specs["local"].config is None
    int4 = specs["rackmend-int4"].config
    assert (int4.compression.uplink, int4.compression.downlink) == ("int4", "int4")
    assert (rm.compression.uplink, rm.compression.downlink) == ("none", "none")
    assert int4.replace(compression=rm.compression) == rm


@pytest.mark.parametrize("changes,fragment", [
    ({"faults": FaultPlan(kill_learner=7)}, "kill_learner=7"),
    ({"faults": FaultPlan(kill_at=0.6, restart_at=0.5)}, "restart_at"),
    ({"faults": FaultPlan(slow_factor=1.0)}, "slow_factor"),
    ({"arms": ("rackmend", "nonsense")}, "nonsense"),
    ({"duration_s": None}, "duration_s"),
    ({"link": LinkPlan(jitter=2.0)}, "jitter"),
    ({"lr_schedule": "cosine"}, "set max_steps"),
    ({"lr_schedule": "linear"}, "lr_schedule"),
    ({"max_steps": 10, "warmup_steps": 10}, "warmup_steps"),
    ({"lr_final": 2.0}, "lr_final"),
    ({"warmup_steps": 5}, "cosine schedule"),
])
def test_bad_settings_say_what_to_change(changes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunSettings(**changes)


def test_the_cosine_schedule_reaches_the_inner_optimizer_step_by_step() -> None:
    """Warm-up, then a half cosine ending at lr_final x lr on the last step; train_steps
    moves the optimizer's learning rate after every inner step."""
    import torch

    from rackmend.demo.threads import thread_settings
    from rackmend.demo.worker import train_steps

    s = thread_settings(steps=40, lr=0.01, lr_schedule="cosine", warmup_steps=4, lr_final=0.2)
    class Fit(torch.nn.Linear):  # train_steps calls model(x, y) for the loss
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return torch.nn.functional.mse_loss(super().forward(x), y)

    model = Fit(3, 1)
    inner = torch.optim.AdamW(model.parameters(), lr=s.lr)
    schedule = s.scheduler(inner)
    used = [inner.param_groups[0]["lr"]]  # LambdaLR sets the first step's rate when built
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    steps = train_steps(model, inner, None, lambda: (x, y), 8, max_steps=s.max_steps, schedule=schedule,
                        on_step=lambda d: used.append(inner.param_groups[0]["lr"]))
    used = used[:steps]  # the rate of each step taken (the last entry is the one after the run)
    assert steps == 40 and len(used) == 40
    assert used[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert used[4] == pytest.approx(0.01) and used[-1] == pytest.approx(0.002)
    assert all(a >= b for a, b in zip(used[4:], used[5:])), "the cosine part must only fall"
    constant = thread_settings(steps=40)
    assert {constant.lr_factor(i) for i in range(40)} == {1.0} and constant.scheduler(inner) is None


def test_loss_interpolation() -> None:
    pts = [(0, 0.0, 5.0), (100, 1.0, 3.0), (300, 2.0, 2.0), (340, 3.0, 1.8)]
    assert loss_at_tokens(pts, 100) == 3.0 and loss_at_tokens(pts, 340) == 1.8
    assert loss_at_tokens(pts, 320) == pytest.approx(1.9)
    assert loss_at_tokens(pts, 341) is None
    # A line from the start (or between evaluations far apart) is not trusted.
    assert loss_at_tokens(pts, 50) is None and loss_at_tokens(pts, 200) is None


@pytest.mark.timeout(300)
@pytest.mark.serial  # learner processes whose step times the fail-slow check reads
def test_tiny_run_writes_every_report_file(tmp_path: Path) -> None:
    """Two learner processes, a real syncer, emulated links, one learner fail-slow: the
    syncer flags it in its slow window and restores it, and the report says so."""
    s = RunSettings(
        learners=2, duration_s=10.0, batch_size=4, sync_every=8, fragments=2, overlap=1, evals=3,
        arms=("rackmend", "local"), model=TINY, heartbeat_timeout_s=5.0,
        # A tiny model's 1 ms steps vary many times over on a shared machine; paced to
        # 25 ms, the learners' speed is steady enough for a x4 to stand out.
        min_step_s=0.025,
        link=LinkPlan(bandwidth_mbit=200.0, latency_ms=10.0, jitter=0.5),
        # The window opens after 4 s (~150 steps): the demo's 64-step baseline is learnt.
        faults=FaultPlan(kill_learner=None, worse_link_learner=None, slow_learner=1, slow_from=0.4,
                         slow_until=0.7, slow_factor=4.0),
    )
    runs = [run_arm(spec, s, tmp_path / "raw" / name) for name, spec in arm_specs(s).items()]
    out = tmp_path / "report"
    summary = write_report(out, runs, s, "pytest tiny run")
    for name in REPORT_FILES:
        path = out / name
        assert path.exists() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    assert "rackmend" in report and "local" in report and "fail-slow" in report
    rows = {r["arm"]: r for r in json.loads((out / "summary.json").read_text())["arms"]}
    assert set(rows) == {"rackmend", "local"} == {r["arm"] for r in summary["arms"]}
    rm, local = runs
    assert all(ls.steps > 5 for ls in rm.learners + local.learners)
    assert rm.merges(), "the rackmend arm merged nothing"
    assert rm.points[-1][2] < rm.points[0][2], "held-out loss of the global model did not fall"
    assert len(rm.points) >= 3, "too few held-out evaluations"
    assert rm.wan_bytes > 0 and not local.links
    # Every learner finished with a graceful leave that reached the syncer through its link.
    leaves = {r.learner: r.reason for r in rm.records() if isinstance(r, Left)}
    assert leaves == {"learner0": "leave", "learner1": "leave"}
    # The fail-slow learner really was slower inside its window.
    slow = [r["compute"] for r in rm.steps["learner1"] if r["slow"]]
    fast = [r["compute"] for r in rm.steps["learner1"] if not r["slow"]]
    assert slow and fast and statistics.median(slow) > 2 * statistics.median(fast)
    assert statistics.median(fast) >= s.min_step_s  # paced
    steps_lines = (out / "steps.jsonl").read_text().splitlines()
    assert len(steps_lines) == sum(ls.steps for r in runs for ls in r.learners)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["arm"] == "rackmend" and isinstance(from_record(e), Merged) for e in events)
    assert any(e["event"] == "fault_slow" for e in events)

    # Fail-slow detection in the syncer's log: learner1 flagged (with its rank) inside its
    # window, so rounds stopped waiting for it, and restored once its steps were back.
    lo, hi = 0.4 * s.duration_s, 0.7 * s.duration_s
    syncer_log = [r for r in rm.records() if isinstance(r, FailSlowNoted)]
    flags = [r for r in syncer_log if isinstance(r.action, StopExpecting) and r.action.report.learner == "learner1"
             and lo <= r.t <= hi]
    assert flags, syncer_log
    flag = flags[0]
    assert flag.action.report.rank == 0 and flag.action.report.ratio > 2 and "rounds stop waiting" in flag.reason, flag
    restores = [r for r in syncer_log if isinstance(r.action, RestoreLearner) and r.action.report.learner == "learner1"
                and r.t > flag.t]
    assert restores, syncer_log
    assert max(r.t for r in restores) >= hi, syncer_log  # restored after the window, not only inside it
    # While flagged it was not expected: no merge counted it as an absent, awaited learner.
    while_flagged = [m for m in rm.merges() if flag.t < m.t < restores[0].t]
    assert while_flagged and all("learner1" not in m.absent for m in while_flagged)
    assert "fail-slow detection: the syncer flagged learner1 (rank 0)" in report, report
