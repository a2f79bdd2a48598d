"""The discrete-event simulator: the real syncer and learner cores in virtual time.

Each run takes a fraction of a second (a toy quadratic, no sockets, no sleeping). The
last test checks the wiring against a plain computation of the algorithm written here.
"""

from __future__ import annotations

import json

import pytest
import torch

from rackmend.cli import main as cli_main
from rackmend.config import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.sim import Kill, RackSpec, SimConfig, Simulation, SimulationError, Slowdown, simulate

H, P, TAU = 8, 2, 1
GRACE_MAX = 2.0


def run_config(**kw: object) -> RackmendConfig:
    det = bool(kw.pop("deterministic", False))
    return RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU),
                          syncer=SyncerConfig(grace_max=GRACE_MAX, **kw), deterministic=det)  # type: ignore[arg-type]


def racks(n: int = 3, **kw: object) -> tuple[RackSpec, ...]:
    return tuple(RackSpec(**kw) for _ in range(n))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ determinism
def test_same_seed_same_report_other_seed_other_report() -> None:
    def cfg(seed: int) -> SimConfig:
        return SimConfig(run=run_config(), racks=racks(3, jitter=0.3, uplink_latency=0.2, downlink_latency=0.1,
                                                       uplink_bandwidth=400.0),
                         duration=120.0, seed=seed, kills=(Kill(learner=1, at=40.0, rejoin_at=70.0),),
                         slowdowns=(Slowdown(learner=2, factor=2.0, start=10.0, end=60.0),))

    first, again, other = simulate(cfg(7)).to_dict(), simulate(cfg(7)).to_dict(), simulate(cfg(8)).to_dict()
    assert first == again
    assert first != other  # the seed drives jitter and targets: it must change something
    assert sum(first["merges"]) > 0 and json.dumps(first)  # JSON-ready


# ------------------------------------------------------------------------ faults
def test_dead_learner_stalls_nobody() -> None:
    base = dict(run=run_config(), racks=racks(3, uplink_latency=0.1, downlink_latency=0.1), duration=200.0)
    healthy = simulate(SimConfig(**base))  # type: ignore[arg-type]
    # It stays connected and expected (never declared silent): every round waits for it
    # until the grace window ends, and no longer.
    dead = simulate(SimConfig(**base, kills=(Kill(learner=2, at=30.0),), silence_timeout=None))  # type: ignore[arg-type]
    live, gone = dead.learners[:2], dead.learners[2]
    assert [lr.steps for lr in live] == [lr.steps for lr in healthy.learners[:2]]
    assert all(lr.idle_s == healthy.learners[0].idle_s for lr in live)  # only the join wait
    assert gone.steps <= 30 and gone.down_s == pytest.approx(170.0)
    for n_dead, n_healthy in zip(dead.merges, healthy.merges):
        assert n_dead >= n_healthy - 1
    # Between two merges of a fragment: H steps, the round trip, and at most one grace window.
    bound = H * 1.0 + 0.2 + GRACE_MAX
    assert dead.max_merge_gap is not None and healthy.max_merge_gap is not None
    assert healthy.max_merge_gap < dead.max_merge_gap <= bound + 1e-9


def test_dead_learner_in_deterministic_mode_waits_until_declared_silent() -> None:
    run = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU), deterministic=True,
                         learner=LearnerConfig(wait_timeout=50.0))
    kill = (Kill(learner=2, at=30.0),)
    # Deterministic rounds wait for every expected learner: a dead one that is never
    # declared gone stalls all, and the live learners' waits time out.
    with pytest.raises(SimulationError, match="waited 50s"):
        simulate(SimConfig(run=run, racks=racks(3), duration=200.0, kills=kill, silence_timeout=None))
    report = simulate(SimConfig(run=run, racks=racks(3), duration=200.0, kills=kill, silence_timeout=20.0))
    live = report.learners[:2]
    assert all(15.0 < lr.idle_s < 30.0 for lr in live)  # blocked from the stall until the silence verdict
    assert all(lr.steps > 150 for lr in live)


def test_slow_learner_is_merged_stale_while_others_go_on() -> None:
    base = dict(run=run_config(), racks=racks(3), duration=240.0)
    healthy = simulate(SimConfig(**base))  # type: ignore[arg-type]
    slow = simulate(SimConfig(**base, slowdowns=(Slowdown(learner=2, factor=4.0),)))  # type: ignore[arg-type]
    fast, lagging = slow.learners[:2], slow.learners[2]
    assert [lr.steps for lr in fast] == [lr.steps for lr in healthy.learners[:2]]
    assert lagging.steps == pytest.approx(fast[0].steps / 4, abs=1)
    assert all(lr.merged_stale == 0 for lr in fast)
    assert 0 < lagging.merged < fast[0].merged / 2
    assert lagging.merged_stale >= lagging.merged - 1  # all but perhaps its first round
    assert healthy.version_lag_max == 0 and slow.version_lag_max is not None and slow.version_lag_max >= 2
    for n_slow, n_healthy in zip(slow.merges, healthy.merges):
        assert n_slow >= n_healthy - 1
    # The run still learns: the global value gets close to the optimum.
    assert slow.global_loss - slow.optimum_loss < 0.25 * (slow.initial_loss - slow.optimum_loss)


def test_rejoined_learner_trains_again_from_the_global_value() -> None:
    report = simulate(SimConfig(run=run_config(), racks=racks(3), duration=150.0,
                                kills=(Kill(learner=0, at=40.0, rejoin_at=80.0),)))
    back = report.learners[0]
    assert back.down_s == pytest.approx(40.0)
    assert 40 + 60 - 2 <= back.steps <= 40 + 70
    assert back.merged > 0 and back.rejected == 0


# ------------------------------------------------------------------------ wiring
def test_deterministic_run_equals_a_plain_computation() -> None:
    """Zero latency, deterministic mode, overwrite, P=1: every H steps each learner sends
    held - local; the syncer's new value is held - outer_lr * mean(deltas) (equal
    weights: equal tokens and steps); at step t_send + tau each learner takes it."""
    h, tau, m, outer_lr, steps = 4, 1, 3, 0.7, 4 * 5 + 2
    run = RackmendConfig(schedule=ScheduleConfig(sync_every=h, num_fragments=1, overlap=tau), deterministic=True,
                         syncer=SyncerConfig(outer_lr=outer_lr), learner=LearnerConfig(apply="overwrite"))
    cfg = SimConfig(run=run, racks=racks(m), duration=steps + 0.5, fragment_size=5, seed=3)
    sim = Simulation(cfg)
    report = sim.run()

    curvature, lr = sim.curvature[0], cfg.lr
    targets = [learner.target[0] for learner in sim.learners]
    local = [torch.zeros(5) for _ in range(m)]
    held = torch.zeros(5)
    merged: torch.Tensor | None = None
    sent_at = None
    for t in range(1, steps + 1):
        for x, c in zip(local, targets):
            x.sub_(lr * curvature * (x - c))
        if t % h == 0:
            deltas = [held - x for x in local]
            merged = held - outer_lr * torch.stack(deltas).mean(0)
            sent_at = t
        if sent_at is not None and t == sent_at + tau:
            assert merged is not None
            held = merged.clone()
            local = [merged.clone() for _ in range(m)]

    assert [lr_.steps for lr_ in report.learners] == [steps] * m
    assert report.merges == (steps // h,)
    assert merged is not None
    torch.testing.assert_close(sim.syncer.frags[0].theta[0], merged, rtol=0, atol=1e-6)
    for learner, x in zip(sim.learners, local):
        torch.testing.assert_close(learner.local[0][0], x, rtol=0, atol=1e-6)
    assert report.global_loss == pytest.approx(sim.loss([merged]), rel=1e-6)


# ------------------------------------------------------------------------ config, CLI
@pytest.mark.parametrize("kwargs,message", [
    (dict(racks=()), "at least one learner"),
    (dict(kills=(Kill(learner=5, at=1.0),)), "learner 5 is not one of the 4 racks"),
    (dict(lr=5.0), "diverges"),
    (dict(run=RackmendConfig(syncer=SyncerConfig(learners=("A",)))), "not simulated learners"),
])
def test_config_errors_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(**kwargs)


def test_rack_spec_and_fault_validation() -> None:
    with pytest.raises(ConfigError, match="jitter must be in"):
        RackSpec(jitter=1.5)
    with pytest.raises(ConfigError, match="rejoin_at must be after"):
        Kill(learner=0, at=5.0, rejoin_at=2.0)
    with pytest.raises(ConfigError, match="factor must be"):
        Slowdown(learner=0, factor=0.0)


def test_cli_prints_json_report_and_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["simulate", "--racks", "3", "--step-time", "1,1,2", "-H", "8", "-P", "2", "--tau", "1",
                   "--kill", "0:20", "--duration", "60", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert [lr["learner"] for lr in report["learners"]] == ["L0", "L1", "L2"]
    assert report["learners"][0]["down_s"] == pytest.approx(40.0)
    assert report["learners"][2]["steps"] < report["learners"][1]["steps"]
    assert cli_main(["simulate", "--racks", "3", "--step-time", "1,2", "--duration", "10"]) == 2
    assert "--step-time lists 2 values for 3 learners" in capsys.readouterr().err
    assert cli_main(["simulate", "--duration", "30", "-H", "8", "-P", "2"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:2] == ["learner", "steps"] and "merges per fragment" in table
