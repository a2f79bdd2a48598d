"""Fail-slow detection and its ladder: the detector on small synthetic traces (the
benchmark's checks at a small size), the syncer core walking the whole ladder and
back under a fake clock, the wire message, and a real syncer with a learner process
that turns slow."""

from __future__ import annotations

import math
import random
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from failslow import windows  # noqa: E402

from helpers import free_port, metric, scrape  # noqa: E402
from procs import events, wait_for  # noqa: E402
from rackmend import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig  # noqa: E402
from rackmend.core import (  # noqa: E402
    AdviseLearner,
    Contribution,
    ContributionArrived,
    FailSlowBlip,
    FailSlowMonitor,
    FailSlowReport,
    FragmentSpec,
    LearnerJoined,
    FailSlowNoted,
    Merged,
    Rejected,
    SyncerRecord,
    MarkForEviction,
    RestoreLearner,
    SendUpdate,
    StepTimeDetector,
    StopExpecting,
    SyncerCore,
    TensorSpec,
)
from rackmend.core.records import FAILSLOW_EVENTS  # noqa: E402
from rackmend.core.syncer import _failslow_reason  # noqa: E402
from rackmend.service.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from rackmend.transport import wire  # noqa: E402


# ------------------------------------------------------------------ the detector
def trace(kind: str, seed: int, cv: float, n: int, warmup: int = 600, slow: int = 300,
          window: int = 1) -> list[tuple[int, str]]:
    """(step index, verdict kind) of every verdict the detector gives on a benchmark trace."""
    det = StepTimeDetector()
    rng = random.Random(f"test-{kind}-{cv}-{seed}")
    out = []
    for end, seconds, steps in windows(kind, n, warmup, slow, window, rng, cv, 0.002):
        v = det.add(seconds, steps)
        if v is not None:
            out.append((end, v.kind))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_jitter_and_spikes_raise_no_alarm(seed: int) -> None:
    verdicts = trace("jitter", seed, 0.3, 20_000)
    assert [v for v in verdicts if v[1] == "slow"] == []


@pytest.mark.parametrize("kind, cv, target", [
    ("2x", 0.3, 10),  # the targets where the noise allows them
    ("2x", 0.1, 10),
    ("1.2x", 0.1, 30),
    ("ramp", 0.1, 40),
    # At CV 0.3 per step 1.2x needs ~60 steps at this false-alarm rate whatever the
    # detector (module docstring of rackmend.core.failslow); bound what it does.
    ("1.2x", 0.3, 100),
    ("ramp", 0.3, 65),
])
def test_slowdown_flagged_within_target_then_restored(kind: str, cv: float, target: int) -> None:
    warmup, slow = 600, 300
    verdicts = trace(kind, 0, cv, 1200, warmup, slow)
    slow_at = [end for end, k in verdicts if k == "slow"]
    restored_at = [end for end, k in verdicts if k == "restored"]
    # min_steps=10 counts from the estimated onset, which noise can put a step or two early.
    assert slow_at and warmup + 8 <= slow_at[0] <= warmup + target, verdicts
    assert len(slow_at) == 1 and len(restored_at) == 1, verdicts  # no flapping
    assert warmup + slow < restored_at[0] <= warmup + slow + max(60, target), verdicts


def test_windowed_means_are_detected_like_steps() -> None:
    """A contribution reports a mean over several steps: same detection, rounded to windows."""
    verdicts = trace("2x", 0, 0.3, 1200, window=6)
    slow_at = [end for end, k in verdicts if k == "slow"]
    assert slow_at and 610 <= slow_at[0] <= 624, verdicts


def test_short_stall_is_a_blip_not_a_slowdown() -> None:
    det = StepTimeDetector(baseline_steps=64)
    rng = random.Random(3)
    kinds = []
    for i in range(400):
        stall = 4.0 if 200 <= i < 205 else 1.0  # 5 steps, fewer than min_steps
        v = det.add(0.1 * stall * rng.lognormvariate(0, 0.05))
        if v is not None:
            kinds.append(v.kind)
    assert kinds == ["blip"]


def test_bad_detector_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_slowdown"):
        StepTimeDetector(min_slowdown=0)
    with pytest.raises(ConfigError, match="failslow_min_steps"):
        SyncerConfig(failslow_min_steps=0)
    with pytest.raises(ConfigError, match="failslow_evict_cost"):
        SyncerConfig(failslow_evict_cost=-1)


# ------------------------------------------------------------------ the ladder in the core
N = 4
STEPS = 4  # inner steps per contribution (each learner sends one fragment per round)


def make_core(join: bool = True, **syncer) -> SyncerCore:
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=STEPS, num_fragments=1, overlap=1),
        # A grace window of tau (not H - tau) steps: Fleet never ticks, and its rounds stay
        # in phase only if a window has run out by the next round's first arrival.
        learner=LearnerConfig(apply="overwrite"),
        syncer=SyncerConfig(min_quorum=2, learners=("a", "b", "c"), grace_max=5.0, outer_optimizer="SGD",
                            outer_lr=1.0, outer_kwargs={}, failslow_baseline_steps=64, failslow_min_steps=10,
                            failslow_advise_after=20, failslow_evict_cost=6.0, **syncer),
    )
    core = SyncerCore(config, [FragmentSpec(0, 0, (TensorSpec("w", (N,), torch.float32),))], [[torch.zeros(N)]])
    for lid in "abc" if join else "":
        core.handle(LearnerJoined(lid), 0.0)
    return core


class Fleet:
    """Three learners sending one contribution per round; c's steps take ``factor`` x."""

    def __init__(self, core: SyncerCore) -> None:
        self.core = core
        self.now = 0.0
        self.step = 0
        self.rng = random.Random(0)
        self.log: list[SyncerRecord] = []
        self.typed: list[object] = []

    def round(self, factor: float = 1.0, fleet: float = 1.0) -> list[dict]:
        """One round: a and b, then c; returns the merge records."""
        self.step += STEPS
        merges = []
        for lid in "abc":
            seconds = 0.1 * fleet * (factor if lid == "c" else 1.0) * self.rng.lognormvariate(0, 0.03)
            c = Contribution(lid, 0, self.core.versions[0], self.step, STEPS, 4.0 * STEPS, seconds,
                             (torch.ones(N),), rank=1 if lid == "c" else 0, rank_steps=STEPS,
                             rank_step_time=seconds)
            for a in self.core.handle(ContributionArrived(c), self.now):
                if isinstance(a, SyncerRecord):
                    self.log.append(a)
                    if isinstance(a, Merged):
                        merges.append(a.to_record())
                elif not isinstance(a, SendUpdate):
                    self.typed.append(a)
        self.now += STEPS * 0.1 * fleet
        return merges

    def failslow(self, since: int = 0) -> list[FailSlowNoted]:
        """The fail-slow records from ``log[since]`` on."""
        return [r for r in self.log[since:] if isinstance(r, FailSlowNoted)]

    def rungs(self, since: int = 0) -> list[type]:
        """The rung of each fail-slow record from ``log[since]`` on."""
        return [type(r.action) for r in self.failslow(since)]


def test_core_walks_the_ladder_and_back() -> None:
    core = make_core()
    fleet = Fleet(core)
    for _ in range(70):  # 280 healthy steps: baselines learnt (64 samples at least)
        fleet.round()
    assert fleet.failslow() == [] and fleet.typed == []
    assert core.expected_learners() == {"a", "b", "c"}
    estimate = core.step_time_estimate()

    for _ in range(20):  # c turns 2x slow
        fleet.round(factor=2.0)
    assert fleet.rungs()[:2] == [StopExpecting, AdviseLearner], fleet.rungs()
    noted = fleet.failslow()[0]
    slow = noted.action.report
    assert slow.learner == "c" and slow.rank == 1 and 1.8 < slow.ratio < 2.2 and slow.steps >= 10
    assert "rounds stop waiting" in noted.reason
    stop, advise = fleet.typed[:2]
    assert isinstance(stop, StopExpecting) and stop.report.learner == "c" and stop.report.state == "slow"
    assert isinstance(advise, AdviseLearner) and advise.report.state == "slow" and advise.report.rank == 1
    assert advise.report.steps >= 20  # failslow_advise_after
    assert core.expected_learners() == {"a", "b"}
    # The grace window's step-time estimate no longer takes c's slow steps.
    assert core.step_time_estimate() == pytest.approx(estimate, rel=0.1)
    # Rounds close once a and b are in; c's work still merges (in the next round).
    merges = fleet.round(factor=2.0)
    assert [m["merged"] for m in merges] == [["a", "b"]]
    merges = fleet.round(factor=2.0)
    assert "c" in merges[0]["merged"] and merges[0]["weights"]["c"] > 0

    # Its cost (0.1 s extra per step x steps x 2 others) passes failslow_evict_cost=6 s.
    assert fleet.rungs()[2:4] == [MarkForEviction, AdviseLearner]
    evict = [r.action.report for r in fleet.failslow() if isinstance(r.action, MarkForEviction)]
    assert len(evict) == 1 and 6.0 <= evict[0].cost_s < 8.0
    assert any(isinstance(a, MarkForEviction) for a in fleet.typed)
    assert any(isinstance(a, AdviseLearner) and a.report.state == "evict" for a in fleet.typed)

    before = len(fleet.typed)
    for _ in range(30):  # back to normal
        fleet.round()
    restored = [a for a in fleet.typed[before:] if isinstance(a, RestoreLearner)]
    assert len(restored) == 1 and restored[0].report.learner == "c"
    told = [a for a in fleet.typed[before:] if isinstance(a, AdviseLearner)]
    assert [a.report.state for a in told] == ["restored"]
    assert fleet.rungs()[-2:] == [RestoreLearner, AdviseLearner]
    assert core.expected_learners() == {"a", "b", "c"}  # rounds wait for it again


def test_a_slowdown_the_whole_fleet_shares_is_not_fail_slow() -> None:
    core = make_core()
    fleet = Fleet(core)
    for _ in range(70):
        fleet.round()
    for _ in range(30):
        fleet.round(fleet=1.5)  # everyone 1.5x: longer sequences, a shared filesystem...
    assert StopExpecting not in fleet.rungs()
    assert core.expected_learners() == {"a", "b", "c"}


# ------------------------------------------------------------------ two learners
def pair_trace(seed: int, cv: float, shared: dict[tuple[int, int], float],
               b_slow: dict[tuple[int, int], float] | None = None, n: int = 2400,
               window: int = 4) -> list[tuple[int, str, str]]:
    """(step, learner, action) of each ladder action on two learners a and b that send
    medians of ``window`` steps in turn (a first, so b's newest sample is a send behind);
    ``shared``: slowdown factors both see over [start, end) steps; ``b_slow``: b's own."""
    monitor = FailSlowMonitor()
    rng = random.Random(f"pair-{seed}-{cv}")
    sigma = math.sqrt(math.log1p(cv * cv))
    out = []

    def factor(spans: dict[tuple[int, int], float], i: int) -> float:
        return math.prod(f for (start, end), f in spans.items() if start <= i < end)

    for w in range(n // window):
        for lid in "ab":
            times = [0.1 * factor(shared, i) * (factor(b_slow or {}, i) if lid == "b" else 1.0)
                     * rng.lognormvariate(-sigma * sigma / 2, sigma) for i in range(w * window, (w + 1) * window)]
            for act in monitor.observe(lid, 0, (w + 1) * window, statistics.median(times), window, 2):
                out.append(((w + 1) * window, lid, type(act).__name__))
    return out


SHARED = {(600, 900): 1.5, (1300, 1400): 3.0, (1800, 2100): 2.0}
"""Slowdowns both learners share: the issue's shared CPU, a 3x burst, a long 2x spell."""


@pytest.mark.parametrize("cv", [0.1, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_learners_sharing_a_slowdown_are_not_flagged(seed: int, cv: float) -> None:
    """With M=2 the other learner is the whole fleet: a slowdown both see is the workload.
    (Before: both flagged on every shared slowdown, one on the noise of a 12-step median,
    the other then judged against a fleet of nobody.)"""
    acts = pair_trace(seed, cv, SHARED)
    flagged = [a for a in acts if a[2] == "StopExpecting"]
    # At CV 0.3 two learners' levels over the same span still differ by 3 standard errors
    # now and then (FLEET_Z); about one shared slowdown in 30 (a sweep: 3 in 90). Never both.
    assert len(flagged) <= (0 if cv < 0.2 else 1), acts


@pytest.mark.parametrize("cv, factor", [(0.1, 1.3), (0.3, 1.3), (0.1, 2.0), (0.3, 2.0)])
def test_two_learners_one_slow_is_still_flagged_then_restored(cv: float, factor: float) -> None:
    acts = pair_trace(0, cv, {}, b_slow={(1000, 1500): factor})
    flagged = [(step, lid) for step, lid, kind in acts if kind == "StopExpecting"]
    restored = [(step, lid) for step, lid, kind in acts if kind == "RestoreLearner"]
    assert [lid for _, lid in flagged] == ["b"], acts
    # 1.3x at CV 0.3 needs ~40 steps whatever the detector (module docstring); a margin.
    assert 1000 < flagged[0][0] <= 1000 + (100 if factor < 1.5 else 20), acts
    assert [lid for _, lid in restored] == ["b"] and 1500 < restored[0][0] <= 1600, acts


def test_the_other_learner_is_judged_against_the_flagged_one_when_it_is_all_the_fleet() -> None:
    """b is flagged (2x, its own); then a slowdown hits both: a must be judged against b,
    not against nobody, and not be flagged for what b sees too."""
    acts = pair_trace(0, 0.1, {(1200, 1500): 1.5}, b_slow={(600, 2400): 2.0})
    flagged = [(step, lid) for step, lid, kind in acts if kind == "StopExpecting"]
    assert [lid for _, lid in flagged] == ["b"] and flagged[0][0] < 700, acts


def test_a_learner_left_alone_is_not_flagged_and_a_flag_ends_when_the_fleet_leaves() -> None:
    """Two equal learners, one leaves: the survivor was flagged 7 times on host noise
    ("1.15x relative to the fleet", the fleet being itself). A fleet check needs a fleet:
    alone, a slowdown is noted (a blip saying so), never flagged; and a learner flagged
    while there was a fleet is unflagged (state ``alone``) once the fleet has left."""
    monitor = FailSlowMonitor(advise_after=0)
    rng = random.Random(5)
    acts: list[tuple[int, str, object]] = []

    def send(lid: str, w: int, factor: float) -> None:
        times = [0.1 * factor * rng.lognormvariate(0, 0.05) for _ in range(4)]
        acts.extend((w * 4, lid, a) for a in monitor.observe(lid, 0, w * 4, statistics.median(times), 4, 2))

    for w in range(1, 200):  # both learn their baselines
        send("a", w, 1.0)
        send("b", w, 1.0)
    assert acts == []
    monitor.forget("b")  # b leaves
    for w in range(200, 600):  # host noise on a: 1.3x spells, each long enough to flag with a fleet
        send("a", w, 1.3 if (w // 50) % 2 else 1.0)
    kinds = [type(a) for _, _, a in acts]
    assert StopExpecting not in kinds and AdviseLearner not in kinds and not monitor.is_slow("a"), acts
    noted = [a for _, _, a in acts if isinstance(a, FailSlowBlip)]
    assert noted and all(a.report.state == "alone" for a in noted), acts
    assert "the only learner with a step-time baseline" in _failslow_reason(noted[0])

    # With a fleet again: c is flagged 2x slow, then every other learner leaves.
    acts.clear()
    for w in range(600, 800):
        send("a", w, 1.0)
        send("c", w, 1.0 if w < 700 else 2.0)
    assert monitor.is_slow("c") and [type(a) for _, lid, a in acts if lid == "c"][:2] == [StopExpecting, AdviseLearner]
    acts.clear()
    monitor.forget("a")
    send("c", 800, 2.0)
    assert [(type(a), a.report.state) for _, _, a in acts] == [(RestoreLearner, "alone"), (AdviseLearner, "alone")]
    assert not monitor.is_slow("c") and "rounds wait for it again" in _failslow_reason(acts[0][2])


def test_detector_state_survives_a_syncer_checkpoint(tmp_path: Path) -> None:
    """Baselines, CUSUMs and the ladder go through a checkpoint file and back: a learner
    flagged before the restart is still flagged (and not waited for) after its rejoin,
    and the resumed syncer then reaches the same verdicts as one that never stopped."""
    core = make_core()
    fleet = Fleet(core)
    for _ in range(70):
        fleet.round()
    for _ in range(8):
        fleet.round(factor=2.0)
    assert core.failslow is not None and core.failslow.is_slow("c")
    assert core.expected_learners() == {"a", "b"}
    before = core.failslow.state_dict()
    save_checkpoint(tmp_path, *core.state_dict())
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None

    resumed = make_core(join=False)
    resumed.load_state_dict(loaded.tensors, loaded.meta)
    assert resumed.failslow is not None and resumed.failslow.state_dict() == before
    for lid in "abc":  # the learners' hellos to the restarted syncer
        resumed.handle(LearnerJoined(lid), fleet.now)
    assert resumed.failslow.state_dict() == before
    assert resumed.failslow.is_slow("c") and resumed.expected_learners() == {"a", "b"}

    twin = Fleet(resumed)
    twin.now, twin.step = fleet.now, fleet.step
    twin.rng.setstate(fleet.rng.getstate())
    seen = len(fleet.log)
    for f in (fleet, twin):
        for _ in range(4):
            f.round(factor=2.0)
        for _ in range(30):
            f.round()
    after = fleet.failslow(seen)
    assert RestoreLearner in fleet.rungs(seen)
    assert twin.failslow() == after
    assert resumed.expected_learners() == {"a", "b", "c"}
    assert resumed.failslow.state_dict() == core.failslow.state_dict()

    # A later rejoin (not the first after the restart) starts the learner's baseline anew.
    resumed.handle(LearnerJoined("c"), twin.now)
    assert not any(lid == "c" for lid, _ in resumed.failslow.detectors)


def test_off_and_deterministic_runs_have_no_detector() -> None:
    assert make_core(failslow=False).failslow is None
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=STEPS, num_fragments=1, overlap=0),
                            syncer=SyncerConfig(learners=("a",)), deterministic=True)
    core = SyncerCore(config, [FragmentSpec(0, 0, (TensorSpec("w", (N,), torch.float32),))], [[torch.zeros(N)]])
    assert core.failslow is None


def test_absurd_rank_step_time_is_rejected() -> None:
    core = make_core()
    c = Contribution("a", 0, 0, 4, 4, 16.0, 0.1, (torch.ones(N),), rank_steps=4, rank_step_time=1e9)
    (rej,) = [a for a in core.handle(ContributionArrived(c), 0.0) if isinstance(a, Rejected)]
    assert rej.code == "bounds" and "rank_step_time" in rej.reason


# ------------------------------------------------------------------ the wire
def test_fail_slow_message_round_trips_and_is_validated() -> None:
    r = FailSlowReport(learner="l1", rank=2, state="slow", ratio=2.0, fleet_ratio=1.9, baseline_s=0.1, steps=12,
                       cost_s=3.5)
    msg = wire.decode_header(wire.fail_slow_frames(r), wire.SYNCER_TYPES, 1 << 20)
    assert wire.parse_fail_slow(msg, "l1") == r
    with pytest.raises(wire.WireError, match="names learner"):
        wire.parse_fail_slow(msg, "other")
    for bad in ({"state": "dead"}, {"ratio": -1.0}, {"steps": "many"}, {"ratio": float("nan")}):
        msg = wire.decode_header(wire.fail_slow_frames(r), wire.SYNCER_TYPES, 1 << 20)
        msg.header.update(bad)
        with pytest.raises(wire.WireError):
            wire.parse_fail_slow(msg, "l1")


def test_contribution_rank_timing_round_trips_and_old_messages_stay_valid() -> None:
    spec = FragmentSpec(0, 0, (TensorSpec("w", (N,), torch.float32),))
    c = Contribution("l1", 0, 0, 8, 8, 64.0, 0.2, (torch.ones(N),), session=5, seq=1, rank_steps=3,
                     rank_step_time=0.25)
    got = wire.parse_contribution(wire.decode_header(wire.contribution_frames(c, 1), wire.LEARNER_TYPES, 1 << 20),
                                  [spec])
    assert (got.rank, got.rank_steps, got.rank_step_time) == (1, 3, 0.25)
    old = wire.decode_header(wire.contribution_frames(c, 0), wire.LEARNER_TYPES, 1 << 20)
    del old.header["rank_steps"], old.header["rank_step_time"]  # as a learner before this field sends it
    got = wire.parse_contribution(old, [spec])
    assert (got.rank_steps, got.rank_step_time, got.step_time) == (0, 0.0, 0.2)
    bad = wire.decode_header(wire.contribution_frames(c, 0), wire.LEARNER_TYPES, 1 << 20)
    bad.header["rank_step_time"] = -1.0
    with pytest.raises(wire.WireError, match="rank_step_time"):
        wire.parse_contribution(bad, [spec])


# ------------------------------------------------------------------ a real syncer and learners
def test_service_flags_a_slow_learner_advises_it_and_restores_it(procs, tmp_path: Path) -> None:
    flags = ["--learners", "l0,l1", "--failslow-baseline-steps", "64", "--failslow-min-steps", "8",
             "--failslow-advise-after", "0", "--grace-max", "0.5"]
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    syncer, endpoint = procs.syncer(*flags, "--metrics-port", str(port))
    common = ["--step-sleep", "0.03", "--learners", "l0,l1"]
    fast = procs.learner(endpoint, "l0", "--steps", "320", *common)
    slow = procs.learner(endpoint, "l1", "--steps", "320", *common, "--slow-from", "120", "--slow-until", "200",
                         "--slow-factor", "3")
    alive = (syncer, fast, slow)

    def rungs(kind: type) -> list[FailSlowNoted]:
        return [e for e in events(tmp_path, FailSlowNoted) if isinstance(e.action, kind)]

    # This machine's other processes can slow a 30 ms step by 10-30 % for a while, and
    # flagging that is the detector's job: the test looks for the injected x3 only.
    def injected() -> list[FailSlowNoted]:
        return [e for e in rungs(StopExpecting) if e.action.report.ratio > 2]

    wait_for(injected, 60, "the slow learner to be flagged", alive)
    flag = injected()[0]
    assert (flag.action.report.learner, flag.action.report.rank) == ("l1", 0), flag
    # The slow window lasts 80 steps (7 s or more): the metrics show l1 as slow meanwhile.
    wait_for(lambda: metric(scrape(url), "rackmend_learner_failslow_state", learner="l1") == 1, 30,
             "the metrics to show l1 as slow", alive)
    # The fast learner may finish first (it has no slow window to sit out).
    wait_for(lambda: [e for e in rungs(RestoreLearner) if e.t > flag.t], 60,
             "the slow learner to be restored", (syncer, slow))
    assert [e.action.report.learner for e in rungs(RestoreLearner) if e.t > flag.t][0] == "l1"
    for p in (fast, slow):
        assert p.wait(60) == 0
    wait_for(lambda: metric(scrape(url), "rackmend_learner_connected") == 0, 30, "both leaves in the metrics")
    final = scrape(url)  # nothing happens any more: every ladder step counted equals the log's
    for rung, name in FAILSLOW_EVENTS.items():  # the metric's label is the rung's word of its log event
        label = name.removeprefix("failslow_")
        assert metric(final, "rackmend_failslow_events_total", event=label) == len(rungs(rung)), name
    assert metric(final, "rackmend_learner_failslow_state") == 0  # both left: their cases are closed
    out = procs.output("l1")
    # The advised ratio is the injected x3 as measured on a shared machine: above 2, and
    # not necessarily below 4 when other processes slowed the slow window further.
    ratios = [float(r) for r in re.findall(r"the syncer reports rank 0 fail-slow: ([0-9.]+)x", out)]
    assert any(r > 2 for r in ratios), out[-3000:]
    # Restored at the end of its slow window, or, when l0 finished first, as the only learner left.
    assert "back at normal speed" in out or "this learner is the only one left" in out, out[-3000:]
