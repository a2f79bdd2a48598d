"""The simulator's goodput model: chip failures, restarts and elastic reshapes over the
real cores, the data-parallel baselines, the accounting, and agreement with a real
in-process run."""

from __future__ import annotations

import math

import pytest

from helpers import run_inprocess
from rackmend.cli import main as cli_main
from rackmend.config import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.records import Merged, SyncerRecord
from rackmend.sim import Failures, Kill, RackSpec, SimConfig, Simulation, Slowdown, simulate
from rackmend.sim.config import YEAR
from rackmend.sim.cli import format_goodput
from rackmend.sim.goodput import simulate_data_parallel

H, P, TAU, GRACE = 8, 2, 1, 2.0


def run(**kw: object) -> RackmendConfig:
    return RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU),
                          syncer=SyncerConfig(grace_max=GRACE, **kw))  # type: ignore[arg-type]


def merges(records: list[SyncerRecord]) -> list[tuple]:
    return [(r.fragment, r.version, r.merged, r.stale) for r in records if isinstance(r, Merged)]


def test_merge_sequence_equals_a_real_in_process_run() -> None:
    """Deterministic mode over the real optimizer and in-process syncer (threads, a real
    model) and over the simulator: the same rounds merge the same learners in the same
    order, since the decisions are the same cores'."""
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1), deterministic=True,
                            learner=LearnerConfig(apply="overwrite"))
    ids, steps = ["l0", "l1", "l2"], 4 * 6  # the helpers' ids; the simulator's are L0..
    _, hub = run_inprocess(config, ids, steps)
    real = [m for m in merges(hub.records) if m[1] <= steps // 4]
    sim = Simulation(SimConfig(run=config, racks=tuple(RackSpec() for _ in ids), duration=steps + 0.5,
                               fragment_size=4))
    sim.run()
    simulated = [(p, v, tuple(i.lower() for i in ids_), stale) for p, v, ids_, stale in merges(sim.syncer_records)]
    assert simulated == real and len(real) == 2 * (steps // 4)


def test_killed_learner_is_never_waited_for_beyond_the_grace_bound() -> None:
    # Killed and back, three times; it stays expected between (never declared silent),
    # so each round it misses waits for it, at most one grace window.
    kills = tuple(Kill(learner=2, at=a, rejoin_at=a + 40.0) for a in (30.0, 100.0, 170.0))
    base = dict(run=run(), racks=tuple(RackSpec(uplink_latency=0.1, downlink_latency=0.1) for _ in range(3)),
                duration=240.0, silence_timeout=None)
    healthy = simulate(SimConfig(**base))  # type: ignore[arg-type]
    sim = Simulation(SimConfig(**base, kills=kills))  # type: ignore[arg-type]
    report = sim.run()
    assert [lr.steps for lr in report.learners[:2]] == [lr.steps for lr in healthy.learners[:2]]
    waits = [r.wait_s for r in sim.syncer_records if isinstance(r, Merged)]
    assert max(waits) <= GRACE + 0.2 + 1e-9
    assert report.max_merge_gap is not None and report.max_merge_gap <= H * 1.0 + 0.2 + GRACE + 1e-9


def test_repeated_failures_of_one_learner() -> None:
    kills = tuple(Kill(learner=0, at=a, rejoin_at=a + 10.0) for a in (20.0, 50.0, 80.0, 110.0))
    report = simulate(SimConfig(run=run(), racks=tuple(RackSpec() for _ in range(3)), duration=150.0, kills=kills))
    back = report.learners[0]
    assert back.down_s == pytest.approx(40.0)
    assert 150 - 40 - 4 * 2 <= back.steps <= 150 - 40
    assert back.merged > 0 and back.rejected == 0
    with pytest.raises(ConfigError, match="while still dead"):
        SimConfig(racks=(RackSpec(),), kills=(Kill(learner=0, at=5.0), Kill(learner=0, at=9.0)))


def test_goodput_of_hand_computed_restarts() -> None:
    """Two learners of 2 chips, steps of 1 s, H=8 with one fragment sent every 4 steps
    (P=2): learner 0 dies at 10.5 and is back at 30.5. Lost: the half step in progress
    (0.5 s x 2 chips) and the steps since each fragment's last send, half the model each
    (fragment 0, offset 0, sent after step 8: 2 steps; fragment 1, offset 4, after step 4:
    6 steps; (2 + 6) x 2 chips x 0.5 = 8 chip-s); down: 20 s x 2 chips; blocked: its join
    (0 s at zero latency)."""
    cfg = SimConfig(run=run(), racks=(RackSpec(), RackSpec()), duration=60.0,
                    kills=(Kill(learner=0, at=10.5, rejoin_at=30.5),), failures=Failures(chips=4, mtbi_hours=1e12))
    g = simulate(cfg).goodput
    assert g is not None
    assert g.allocated == pytest.approx(4 * 60.0)
    assert g.down == pytest.approx(2 * 20.0)
    assert [f.offset for f in Simulation(cfg).specs] == [0, 4]
    assert g.lost == pytest.approx(0.5 * 2 + 8.0)
    assert g.paused == g.failed == 0.0
    assert g.useful == pytest.approx(4 * 60.0 - 40.0 - 9.0, abs=1e-6)
    assert math.fsum(g.shares().values()) == pytest.approx(1.0)
    assert g.uptime == pytest.approx(1.0)  # learner 1 trained throughout


def test_a_slow_rack_and_a_dead_rack_show_in_the_breakdown() -> None:
    """``--slow 3:4`` reported 100 % goodput though that rack did a quarter of its steps,
    and ``--kill 3:100`` without a rejoin put the rest of the run into ``down``
    ("restarting"). Four racks of 1 chip and 1 s steps: a rack at 4x from t=0 spends 3/4
    of its chip-time being slow (3/16 of the run's); a rack killed at 100 s of 300 is
    dead for 200 s; one killed and back is down, not dead."""
    racks = tuple(RackSpec() for _ in range(4))
    slow = simulate(SimConfig(run=run(), racks=racks, duration=300.0, slowdowns=(Slowdown(learner=3, factor=4.0),)))
    g = slow.goodput
    assert g is not None and g.slow == pytest.approx(300.0 * 3 / 4, rel=0.02)
    assert g.goodput == pytest.approx(1 - 3 / 16, abs=0.01) and slow.learners[3].steps == pytest.approx(75, abs=1)
    assert math.fsum(g.shares().values()) == pytest.approx(1.0)
    dead = simulate(SimConfig(run=run(), racks=racks, duration=300.0, kills=(Kill(learner=3, at=100.0),))).goodput
    assert dead is not None and dead.dead == pytest.approx(200.0) and dead.down == 0.0
    assert math.fsum(dead.shares().values()) == pytest.approx(1.0)
    back = simulate(SimConfig(run=run(), racks=racks, duration=300.0,
                              kills=(Kill(learner=3, at=100.0, rejoin_at=150.0),))).goodput
    assert back is not None and back.down == pytest.approx(50.0) and back.dead == 0.0
    # A step slowed and then lost counts once: its normal time as lost, the rest as slow.
    both = simulate(SimConfig(run=run(), racks=racks, duration=300.0, slowdowns=(Slowdown(learner=3, factor=4.0),),
                              kills=(Kill(learner=3, at=101.0),))).goodput
    assert both is not None and both.slow == pytest.approx(101.0 * 3 / 4, rel=0.03) and both.lost > 0
    assert math.fsum(both.shares().values()) == pytest.approx(1.0)
    assert f"slow {100 * g.slow / g.allocated:.2f}, lost" in format_goodput(g)


def test_elastic_failures_pause_shrink_and_regrow() -> None:
    f = Failures(chips=8, mtbi_hours=40.0 / 3600, failure_mode="elastic", downscale_time=3.0, upscale_time=5.0,
                 repair_time=30.0)
    report = simulate(SimConfig(run=run(), racks=(RackSpec(), RackSpec()), duration=600.0, failures=f, seed=1))
    g = report.goodput
    assert g is not None and g.failures > 10
    assert g.paused > 0 and g.failed > 0 and g.down == 0.0
    assert math.fsum(g.shares().values()) == pytest.approx(1.0)
    assert 0.3 < g.goodput < 1.0
    assert all(lr.rejected == 0 for lr in report.learners)


def test_skipping_steps_changes_nothing() -> None:
    """The simulator hands a learner's core only the steps where it can act (a send, an
    apply) and the values that arrived in between at those; waking every learner at
    every step, as a training loop does, gives the same run bit for bit. Elastic failures
    change a learner's chips, so the steps skipped before one count at the chips they
    ran on; a reshape drops the steps planned ahead, whose jitter draws go to the next
    steps. Jitter keeps events apart: at one instant their order decides."""
    sched = ScheduleConfig(sync_every=24, num_fragments=4, overlap=2)
    cases = [
        SimConfig(run=RackmendConfig(schedule=sched), duration=1800.0, seed=5,
                  racks=tuple(RackSpec(jitter=0.1, uplink_latency=0.2, downlink_latency=0.2) for _ in range(6)),
                  failures=Failures(chips=3_000_000, failure_mode="elastic")),
        SimConfig(run=RackmendConfig(schedule=sched, learner=LearnerConfig(apply="overwrite")), duration=1800.0,
                  seed=1, racks=tuple(RackSpec(jitter=0.05) for _ in range(6)),
                  failures=Failures(chips=3_000_000, failure_mode="restart")),
        SimConfig(run=run(), duration=600.0, seed=2, slowdowns=(Slowdown(learner=0, factor=3.0, start=50.0, end=200.0),),
                  racks=tuple(RackSpec(jitter=0.3, uplink_latency=0.3 * i, downlink_latency=1.5, uplink_bandwidth=20.0)
                              for i in range(4)),
                  kills=(Kill(learner=2, at=100.0, rejoin_at=160.0), Kill(learner=3, at=401.3))),
    ]
    for cfg in cases:
        skipping, every = Simulation(cfg), Simulation(cfg, every_step=True)
        report = skipping.run()
        assert report.to_dict() == every.run().to_dict()
        assert [r.to_record() for r in skipping.syncer_records] == [r.to_record() for r in every.syncer_records]
        assert sum(report.merges) > 50
    assert report.goodput is not None and report.goodput.lost > 0


def test_data_parallel_goodput_closed_forms() -> None:
    """Few failures: non-elastic, goodput ~ 1 / (1 + rate x restart); elastic,
    ~ exp(-rate x (downscale + upscale)) while reshapes rarely overlap."""
    n, day = 150_000, 86_400.0
    rate = n / YEAR
    g = [simulate_data_parallel(Failures(chips=n, failure_mode="restart", restart_time=60.0), duration=day,
                                seed=s).goodput for s in range(4)]
    assert sum(g) / 4 == pytest.approx(1 / (1 + rate * 60.0), abs=0.02)
    e = [simulate_data_parallel(Failures(chips=n, failure_mode="elastic", downscale_time=5.0, upscale_time=5.0),
                                duration=day, seed=s).goodput for s in range(4)]
    assert sum(e) / 4 == pytest.approx(math.exp(-rate * 10.0), abs=0.02)
    # One failure, by hand: a job of 2 chips fails once in a day, down 100 s.
    one = simulate_data_parallel(Failures(chips=2, mtbi_hours=2 * 24 * 10, restart_time=100.0,
                                          failure_mode="restart"), duration=day, seed=0)
    assert one.down == pytest.approx(2 * 100.0 * one.failures)
    assert one.useful + one.lost + one.down == pytest.approx(2 * day)


def test_failures_during_a_reshape_are_absorbed_or_restart_it() -> None:
    """Many failures, reshapes overlapping: absorbed (the default), the job trains between
    events that each start a pause, goodput ~ 1 / (1 + rate x (downscale + upscale)) (each
    failure comes back as a repair); restarted by each event, pauses chain and goodput
    falls toward exp(-rate x (downscale + upscale)). The same holds for a decoupled
    learner's reshapes (the engine), which the fit of docs/simulate.md chose with it."""
    n, hours = 2_400_000, 6 * 3600.0
    rate, pauses = n / YEAR, 10.0

    def mean(overlap: str) -> float:
        f = Failures(chips=n, failure_mode="elastic", downscale_time=5.0, upscale_time=5.0, repair_time=600.0,
                     reshape_overlap=overlap)  # type: ignore[arg-type]
        return sum(simulate_data_parallel(f, duration=hours, seed=s, step_time=0.01).goodput for s in range(3)) / 3

    absorb, restart = mean("absorb"), mean("restart")
    assert absorb == pytest.approx(1 / (1 + rate * pauses), abs=0.02), absorb
    assert restart == pytest.approx(math.exp(-rate * pauses), abs=0.03), restart
    assert absorb > restart + 0.08

    def learner(overlap: str) -> float:
        f = Failures(chips=8, mtbi_hours=40.0 / 3600, failure_mode="elastic", downscale_time=6.0, upscale_time=6.0,
                     repair_time=30.0, reshape_overlap=overlap)  # type: ignore[arg-type]
        g = simulate(SimConfig(run=run(), racks=(RackSpec(), RackSpec()), duration=900.0, failures=f, seed=3)).goodput
        assert g is not None
        return g.paused

    assert learner("absorb") < 0.9 * learner("restart")


def test_decoupled_beats_data_parallel_at_the_same_failures() -> None:
    f = Failures(chips=1_200_000, failure_mode="restart")
    dp = simulate_data_parallel(f, duration=1800.0, seed=0)
    sim = simulate(SimConfig(run=RackmendConfig(schedule=ScheduleConfig(sync_every=24, num_fragments=4)),
                             racks=tuple(RackSpec() for _ in range(8)), duration=1800.0, failures=f))
    assert sim.goodput is not None and sim.goodput.goodput > dp.goodput + 0.2
    assert sim.goodput.uptime > dp.uptime + 0.2


def test_cli_options_come_from_the_config_dataclasses(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", "--racks", "2", "-H", "8", "--num-fragments", "2", "--overlap", "1",
                     "--chips", "64", "--mtbi-hours", "0.01", "--failure-mode", "restart", "--restart-time", "5",
                     "--duration", "60", "--no-failslow"]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "chip failures" in out
    with pytest.raises(SystemExit):
        cli_main(["simulate", "--failure-mode", "reboot"])
    assert cli_main(["simulate", "--data-parallel", "--chips", "150000", "--duration", "3600"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("goodput")
    # An hour is shorter than 10 repair times: the goodput printed overstates a long run's, and it says so.
    assert "warning: the run (3600 s) is shorter than 10x repair_time (3600 s)" in captured.err
    assert cli_main(["simulate", "--data-parallel", "--chips", "150000", "--duration", "36000"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_short_run_overstates_goodput_as_its_warning_says() -> None:
    """The warning's claim, measured: at 600k chips an elastic data-parallel job's goodput
    over one hour is higher than over ten (repairs in flight have not piled up yet)."""
    f = Failures(chips=600_000, failure_mode="elastic")
    short = simulate_data_parallel(f, duration=3600.0, seed=0).goodput
    long = simulate_data_parallel(f, duration=36_000.0, seed=0).goodput
    assert short > long + 0.02, (short, long)
    assert f.short_run_warning(3600.0) and f.short_run_warning(36_000.0) is None
