"""The sans-I/O syncer state machine, driven with a fake clock (plain numbers)."""

from __future__ import annotations

import math

import pytest
import torch

from rackmend import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core import (
    Contribution,
    ContributionArrived,
    ExpectationChanged,
    FragmentSpec,
    LearnerJoined,
    LearnerLeft,
    SendUpdate,
    SyncerCore,
    TensorSpec,
    Tick,
)
from rackmend.core.merge import staleness_scale
from rackmend.core.rounds import Phase
from rackmend.core.syncer_runner import SyncerRunner
from rackmend.core.records import Merged, Rejected, Superseded, SyncerRecord

N = 4


def make_core(learners=("a", "b", "c"), K=2, tau=2, grace_max=1.0, P=1, apply="auto", **syncer) -> SyncerCore:
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=8, num_fragments=P, overlap=tau),
        learner=LearnerConfig(apply=apply),
        syncer=SyncerConfig(min_quorum=K, learners=tuple(learners), grace_max=grace_max,
                            outer_optimizer="SGD", outer_lr=1.0, outer_kwargs={}, **syncer),
    )
    specs = [FragmentSpec(p, 0, (TensorSpec(f"w{p}", (N,), torch.float32),)) for p in range(P)]
    core = SyncerCore(config, specs, [[torch.zeros(N)] for _ in range(P)])
    for lid in learners:
        core.handle(LearnerJoined(lid), 0.0)
    return core


def contrib(lid: str, value: float = 1.0, base: int = 0, step: int = 8, p: int = 0, step_time: float = 0.0,
            steps: int = 8, tokens: float = 8.0) -> ContributionArrived:
    return ContributionArrived(Contribution(lid, p, base, step, steps, tokens, step_time, (torch.full((N,), value),)))


def merges(actions) -> list[dict]:
    """The ``Merged`` records among ``actions``, as their log lines."""
    return events(actions, Merged)


def events(actions, kind: type[SyncerRecord]) -> list[dict]:
    """The records of type ``kind`` among ``actions``, as their log lines (``to_record()``):
    the driver's dispatch by type, and the documented log fields checked at once."""
    return [a.to_record() for a in actions if isinstance(a, kind)]


def test_quorum_then_grace_expiry() -> None:
    core = make_core()
    clock = core.frags[0].round.clock
    assert clock.phase is Phase.OPEN
    assert merges(core.handle(contrib("a"), 0.0)) == []  # 1 < K
    assert core.next_deadline() is None and clock.phase is Phase.GATHERING and clock.first_arrival == 0.0
    assert merges(core.handle(contrib("b"), 0.5)) == []  # quorum; grace (grace_max, no estimates) starts
    assert core.next_deadline() == pytest.approx(1.5) and clock.phase is Phase.GRACE and clock.quorum_at == 0.5
    assert merges(core.handle(Tick(), 1.49)) == []
    (m,) = merges(core.handle(Tick(), 1.5))
    assert core.frags[0].round.clock.phase is Phase.OPEN  # a new round
    assert m["merged"] == ["a", "b"] and m["absent"] == ["c"] and m["round"] == 0
    assert m["quorum_s"] == pytest.approx(0.5) and m["grace_s"] == pytest.approx(1.0)
    assert core.versions[0] == 1 and core.next_deadline() is None
    # outer SGD lr=1 without momentum: theta <- theta - mean(delta); c never contributed,
    # so it is not counted as absent (count_absent only counts learners whose work arrives).
    assert m["absent_share"] == 0.0
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -1.0))


def test_without_count_absent_a_partial_round_takes_the_mean_of_what_came() -> None:
    core = make_core(count_absent=False)
    core.handle(contrib("a"), 0.0)
    core.handle(contrib("b"), 0.5)
    (m,) = merges(core.handle(Tick(), 1.5))
    assert m["absent"] == ["c"] and m["absent_share"] == 0.0
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -1.0))


def test_absent_learner_weighs_what_it_last_merged_with() -> None:
    core = make_core(K=1, grace_max=0.5)
    # round 0: all in (c with 3x the tokens, so 9x the weight at equal steps)
    core.handle(contrib("a", tokens=8.0), 0.0)
    core.handle(contrib("b", tokens=8.0), 0.0)
    (m,) = merges(core.handle(contrib("c", tokens=24.0), 0.0))
    assert m["absent"] == [] and m["absent_share"] == 0.0
    # round 1: only a is in; b (weight 8) and c (weight 72) count as zero at their weights
    core.handle(contrib("a", value=2.0, base=1, step=16, tokens=8.0), 1.0)
    (m,) = merges(core.handle(Tick(), 1.5))
    assert m["merged"] == ["a"] and m["absent"] == ["b", "c"]
    assert m["weights"]["a"] == pytest.approx(8 / 88) and m["absent_share"] == pytest.approx(80 / 88)
    before = -(8 + 8 + 72 * 1.0) / 88
    assert torch.allclose(core.frags[0].theta[0], torch.full((N,), before - 2.0 * 8 / 88))


def test_only_learners_whose_work_still_arrives_count_as_absent() -> None:
    """A joined peer that never contributed, or one whose last merged work is more than
    max_staleness versions old, does not damp the merges of those who train."""
    core = make_core(K=1, grace_max=0.5, max_staleness=2)
    core.handle(contrib("a"), 0.0)
    core.handle(contrib("b"), 0.1)
    (m,) = merges(core.handle(Tick(), 0.6))  # c never sends: absent, but not counted
    assert m["absent"] == ["c"] and m["absent_share"] == 0.0
    t = 1.0
    shares = []
    for v in range(1, 5):  # from now on b is idle too (but connected)
        core.handle(contrib("a", base=v, step=8 * (v + 1)), t)
        (m,) = merges(core.handle(Tick(), t + 0.5))
        shares.append(m["absent_share"])
        t += 1.0
    # b's work went into version 1; it counts while the current version is within
    # max_staleness (2) of that: in the rounds from versions 1, 2 and 3, not from 4.
    assert shares == [pytest.approx(0.5)] * 3 + [0.0]


def test_a_learner_that_left_is_not_counted_as_absent() -> None:
    core = make_core(learners=("a", "b"), K=1, grace_max=30.0)
    core.handle(contrib("a"), 0.0)
    (m,) = merges(core.handle(LearnerLeft("b"), 0.2))
    assert m["merged"] == ["a"] and m["absent_share"] == 0.0
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -1.0))


def test_early_finish_when_roster_complete() -> None:
    core = make_core(learners=("a", "b"), K=1, grace_max=30.0)
    assert merges(core.handle(contrib("a"), 0.0)) == []
    (m,) = merges(core.handle(contrib("b"), 0.1))
    assert m["merged"] == ["a", "b"] and m["absent"] == []


def test_update_sent_to_every_connected_learner_including_absent() -> None:
    core = make_core()
    core.handle(contrib("a"), 0.0)
    core.handle(contrib("b"), 0.0)
    (send,) = [a for a in core.handle(Tick(), 5.0) if isinstance(a, SendUpdate)]
    assert send.to == ("a", "b", "c") and send.update.version == 1


def test_straggler_contribution_lands_in_next_round() -> None:
    core = make_core(anchoring="learner_base", count_absent=False)  # plain arithmetic; re-anchoring and the absent share have their own tests
    core.handle(contrib("a", 1.0), 0.0)
    core.handle(contrib("b", 1.0), 0.0)
    assert merges(core.handle(Tick(), 1.0))[0]["merged"] == ["a", "b"]
    # c's round-0 work arrives late, based on version 0: kept for round 1, nothing lost.
    assert merges(core.handle(contrib("c", 4.0, base=0), 1.2)) == []
    core.handle(contrib("a", 1.0, base=1, step=16), 2.0)
    core.handle(contrib("b", 1.0, base=1, step=16), 2.0)
    (m,) = merges(core.handle(Tick(), 3.0))  # c has no fresh work in: the grace window runs out
    assert m["merged"] == ["a", "b", "c"] and m["stale"] == ["c"] and m["round"] == 1
    # theta: -1 (round 0) then -1 - (1+1+4)/3 = -3
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -3.0))


def test_silent_learner_never_blocks_once_quorum_is_in() -> None:
    core = make_core(K=1, grace_max=0.5)
    for r in range(3):
        t = 10.0 * r
        core.handle(contrib("a", base=r, step=8 * (r + 1)), t)
        assert core.next_deadline() == pytest.approx(t + 0.5)
        (m,) = merges(core.handle(Tick(), t + 0.5))
        assert m["merged"] == ["a"] and m["absent"] == ["b", "c"]
    assert core.versions[0] == 3


def test_leave_stops_waiting_at_once() -> None:
    core = make_core(learners=("a", "b"), K=1, grace_max=30.0)
    core.handle(contrib("a"), 0.0)
    (m,) = merges(core.handle(LearnerLeft("b"), 0.2))
    assert m["merged"] == ["a"]


def test_not_expected_learner_does_not_hold_rounds() -> None:
    core = make_core(learners=("a", "b"), K=1, grace_max=30.0)
    core.handle(ExpectationChanged("b", False, "fail-slow"), 0.0)
    (m,) = merges(core.handle(contrib("a"), 0.1))
    assert m["merged"] == ["a"]
    # its work still merges when it arrives
    core.handle(contrib("b", base=0), 0.2)
    (m,) = merges(core.handle(contrib("a", base=1, step=16), 0.3))
    assert m["merged"] == ["a", "b"]


def test_k_larger_than_roster_rejected_at_config_time() -> None:
    with pytest.raises(ConfigError, match="min_quorum"):
        make_core(learners=("a", "b"), K=3)


def test_grace_shrinks_with_step_time_times_tau() -> None:
    """Learners that drop the steps made since a send (overwrite) leave tau steps of slack."""
    slow = make_core(K=1, grace_max=10.0, apply="overwrite")
    slow.handle(contrib("a", step_time=1.0), 0.0)
    fast = make_core(K=1, grace_max=10.0, apply="overwrite")
    fast.handle(contrib("a", step_time=0.1), 0.0)
    gamma = slow.config.syncer.grace_gamma
    assert slow.grace() == pytest.approx(gamma * 2 * 1.0)
    assert fast.grace() == pytest.approx(gamma * 2 * 0.1)
    assert slow.next_deadline() == pytest.approx(gamma * 2.0)
    # A shorter overlap leaves less slack too; tau=0 leaves none.
    assert make_core(K=1, tau=0, apply="overwrite").grace() == 1.0  # no estimate yet: grace_max
    zero = make_core(K=1, tau=0, grace_max=10.0, apply="overwrite")
    assert merges(zero.handle(contrib("a", step_time=1.0), 0.0))  # no slack -> merges on arrival
    # and the window is capped by grace_max
    capped = make_core(K=1, grace_max=0.3)
    capped.handle(contrib("a", step_time=5.0), 0.0)
    assert capped.grace() == 0.3


def test_learners_that_keep_late_progress_give_the_grace_window_until_their_next_send() -> None:
    """keep_local (the asynchronous default of apply="auto") loses nothing to a later
    value, so the window may use H - tau steps (here 8 - 2) instead of tau."""
    for apply in ("auto", "keep_local"):
        core = make_core(K=1, grace_max=10.0, apply=apply)
        core.handle(contrib("a", step_time=0.1), 0.0)
        assert core.grace() == pytest.approx(core.config.syncer.grace_gamma * 6 * 0.1)
    det = RackmendConfig(schedule=ScheduleConfig(sync_every=8, overlap=2), deterministic=True)
    assert det.apply_rule() == "overwrite" and det.grace_slack_steps() == 2
    short = RackmendConfig(schedule=ScheduleConfig(sync_every=3, overlap=2))
    assert short.apply_rule() == "keep_local" and short.grace_slack_steps() == 2  # never below tau


def test_newest_contribution_per_learner_supersedes() -> None:
    core = make_core(K=2)
    core.handle(contrib("a", 1.0, step=8, steps=8), 0.0)
    core.handle(contrib("a", 3.0, step=16, steps=16), 0.1)  # cumulative: replaces, not adds
    acts = core.handle(contrib("a", 9.0, step=8), 0.2)  # older one arriving late is ignored
    assert events(acts, Superseded)
    core.handle(contrib("b", 1.0), 0.3)
    (m,) = merges(core.handle(Tick(), 5.0))
    assert m["merged"] == ["a", "b"]


@pytest.mark.parametrize(
    "bad,reason",
    [
        (ContributionArrived(Contribution("a", 0, 0, 8, 8, 8.0, 0.0, (torch.full((N,), float("nan")),))), "non-finite"),
        (ContributionArrived(Contribution("a", 0, 0, 8, 8, 8.0, 0.0, (torch.full((N,), float("inf")),))), "non-finite"),
        (ContributionArrived(Contribution("a", 0, 0, 8, 8, 8.0, 0.0, (torch.zeros(N + 1),))), "expected"),
        (ContributionArrived(Contribution("a", 0, 0, 8, 8, 8.0, 0.0, (torch.zeros(N, dtype=torch.float64),))), "expected"),
        (ContributionArrived(Contribution("a", 5, 0, 8, 8, 8.0, 0.0, (torch.zeros(N),))), "unknown fragment"),
        (ContributionArrived(Contribution("zz", 0, 0, 8, 8, 8.0, 0.0, (torch.zeros(N),))), "not joined"),
        (ContributionArrived(Contribution("a", 0, 3, 8, 8, 8.0, 0.0, (torch.zeros(N),))), "ahead"),
        (ContributionArrived(Contribution("a", 0, 0, 8, -1, 8.0, 0.0, (torch.zeros(N),))), "negative"),
    ],
)
def test_bad_contributions_rejected_and_logged(bad, reason: str) -> None:
    core = make_core(K=1)
    acts = core.handle(bad, 0.0)
    (r,) = events(acts, Rejected)
    assert reason in r["reason"]
    assert core.rejected == 1 and not core.frags[0].round.pending
    # ... and everyone else is still served
    assert merges(core.handle(contrib("b"), 0.1) + core.handle(Tick(), 5.0))


def test_too_stale_is_dropped() -> None:
    core = make_core(K=1, grace_max=0.0, max_staleness=1)
    for r in range(3):
        core.handle(contrib("a", base=r, step=8 * (r + 1)), float(r))
    assert core.versions[0] == 3
    (r,) = events(core.handle(contrib("b", base=0), 5.0), Rejected)
    assert "stale" in r["reason"]


def test_syncer_anchoring_reanchors_stale_gradients() -> None:
    def run(anchoring: str) -> torch.Tensor:
        core = make_core(learners=("a", "b"), K=1, grace_max=0.0, anchoring=anchoring, count_absent=False)
        core.handle(contrib("a", 1.0), 0.0)  # theta: 0 -> -1 (version 1)
        core.handle(contrib("b", 1.0, base=0), 1.0)  # stale by one version: waits for a fresh one
        assert core.versions[0] == 1
        core.handle(contrib("a", 1.0, base=1, step=16), 2.0)
        assert core.versions[0] == 2
        return core.frags[0].theta[0].clone()

    # learner_base: -1 - (1 + 1)/2 = -2. syncer: b re-anchored: 1 + (-1 - 0) = 0 -> -1 - (1 + 0)/2 = -1.5
    assert torch.equal(run("learner_base"), torch.full((N,), -2.0))
    assert torch.equal(run("syncer"), torch.full((N,), -1.5))


def _stale_round(tau: int, fresh: float = 0.0, **cgad) -> tuple[torch.Tensor, dict]:
    """Learner a alone makes versions 1..tau (outer SGD lr 1, no momentum: theta = -tau);
    b then sends 5.0 based on version 0 (tau versions behind, re-anchored to 5 - tau)
    and a sends ``fresh`` on the current version, equal weights, nobody counted absent.
    Returns how far that last round moved the value, and its merge record."""
    core = make_core(learners=("a", "b"), K=1, grace_max=0.0, count_absent=False, **cgad)
    for r in range(tau):
        (m,) = merges(core.handle(contrib("a", 1.0, base=r, step=8 * (r + 1)), float(r)))
        assert m["stale"] == [] and "stale_scales" not in m
    # Fresh work alone is never scaled: each of those rounds moved the value by exactly -1.
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -float(tau)))
    assert merges(core.handle(contrib("b", 5.0, base=0), 10.0)) == []  # stale: waits for a fresh one
    (m,) = merges(core.handle(contrib("a", fresh, base=tau, step=8 * (tau + 1)), 11.0))
    assert m["merged"] == ["a", "b"] and m["stale"] == ["b"] and m["weights"] == {"a": 0.5, "b": 0.5}
    return core.frags[0].theta[0] + tau, m


@pytest.mark.parametrize("tau,decay,cutoff", [(1, 0.5, None), (2, 0.25, 4), (3, 0.0, 4), (2, 0.1, 6)])
def test_cgad_moves_the_value_by_sigma_times_a_stale_contribution(tau: int, decay: float, cutoff) -> None:
    sigma = 0.5 * (1 + math.cos(math.pi * tau / cutoff)) * math.exp(-decay * tau) if cutoff else math.exp(-decay * tau)
    assert staleness_scale(tau, decay, cutoff) == pytest.approx(sigma, rel=1e-15)
    off, m_off = _stale_round(tau)
    on, m_on = _stale_round(tau, staleness_decay=decay, staleness_cutoff=cutoff)
    # By hand: b's re-anchored outer gradient is 5 - tau, at weight 1/2; a's is 0.
    assert torch.equal(off, torch.full((N,), -(5.0 - tau) / 2))
    assert on.tolist() == pytest.approx([-sigma * (5.0 - tau) / 2] * N, rel=1e-6)
    assert on.tolist() == pytest.approx((sigma * off).tolist(), rel=1e-6)
    assert "stale_scales" not in m_off and m_on["stale_scales"] == {"b": pytest.approx(sigma, rel=1e-15)}
    assert m_on["weights"] == m_off["weights"]  # the weights are not renormalised


def test_cgad_past_the_cutoff_counts_as_a_zero_at_its_weight() -> None:
    # a's fresh 1.0 and b's re-anchored 3.0 at weight 1/2 each; past the cutoff b's is 0,
    # and still takes its half of the weight: the round moves by 1/2, not by a's 1.
    off, _ = _stale_round(2, fresh=1.0)
    on, m = _stale_round(2, fresh=1.0, staleness_decay=0.3, staleness_cutoff=2)
    assert torch.equal(off, torch.full((N,), -2.0))
    assert torch.equal(on, torch.full((N,), -0.5))
    assert m["stale_scales"] == {"b": 0.0}


def test_cgad_off_is_bit_identical_to_the_defaults() -> None:
    """staleness_decay=0 and no cutoff, spelt out, merge as the defaults do, bit for bit,
    with stale and absent-counted work in the rounds."""
    def run(**cgad) -> tuple[list[torch.Tensor], list[dict]]:
        core = make_core(P=2, K=1, grace_max=0.0, **cgad)
        records = []
        sends = [("a", 0.3, 0, 0), ("b", -1.7, 0, 0), ("a", 0.9, 1, 0), ("c", 2.1, 0, 1), ("a", 0.1, 0, 1),
                 ("b", 0.45, 1, 0), ("a", -0.6, 2, 0), ("c", 1.3, 1, 0), ("b", 0.7, 3, 0), ("c", -0.2, 1, 1),
                 ("a", 0.25, 1, 1)]
        for k, (lid, value, base, p) in enumerate(sends):
            records += merges(core.handle(contrib(lid, value, base=base, step=8 * (k + 1), p=p), float(k)))
        return [t.clone() for f in core.frags for t in f.theta], records

    (theta, records), (theta_off, records_off) = run(), run(staleness_decay=0.0, staleness_cutoff=None)
    assert any(r["stale"] for r in records) and any(r["absent_share"] > 0 for r in records)
    assert all(torch.equal(x, y) for x, y in zip(theta, theta_off))
    assert records == records_off and not any("stale_scales" in r for r in records)


def test_cgad_leaves_buffers_at_the_weighted_mean() -> None:
    """A floating buffer (BatchNorm statistic) becomes the weighted mean of the learners'
    values, stale or not: CGAD scales the parameters' outer gradients only."""
    def run(**cgad) -> list[torch.Tensor]:
        config = RackmendConfig(
            schedule=ScheduleConfig(sync_every=8, num_fragments=1, overlap=2),
            syncer=SyncerConfig(min_quorum=1, learners=("a", "b"), grace_max=0.0, outer_optimizer="SGD",
                                outer_lr=1.0, outer_kwargs={}, count_absent=False, **cgad),
        )
        spec = FragmentSpec(0, 0, (TensorSpec("w", (N,), torch.float32),
                                   TensorSpec("stat", (N,), torch.float32, is_buffer=True)))
        core = SyncerCore(config, [spec], [[torch.zeros(N), torch.zeros(N)]])
        for lid in ("a", "b"):
            core.handle(LearnerJoined(lid), 0.0)

        def send(lid: str, w: float, stat: float, base: int, step: int, now: float) -> list:
            # A buffer's delta is Theta_b - b_m: the learner's value b_m is Theta_b - delta.
            return core.handle(ContributionArrived(Contribution(
                lid, 0, base, step, 8, 8.0, 0.0, (torch.full((N,), w), torch.full((N,), stat)))), now)

        send("a", 1.0, -2.0, 0, 8, 0.0)  # version 1: w = -1, stat = 2 (a's value)
        send("b", 3.0, -6.0, 0, 8, 1.0)  # one version behind: waits
        (m,) = merges(send("a", 0.0, 0.0, 1, 16, 2.0))
        assert m["stale"] == ["b"]
        return [t.clone() for t in core.frags[0].theta]

    (w_off, stat_off), (w_on, stat_on) = run(), run(staleness_decay=0.5, staleness_cutoff=4)
    sigma = staleness_scale(1, 0.5, 4)
    # w: b's 3.0 re-anchored to 2.0, half the weight: -1 - 1 = -2 off, -1 - sigma on.
    assert torch.equal(w_off, torch.full((N,), -2.0))
    assert w_on.tolist() == pytest.approx([-1.0 - sigma] * N, rel=1e-6)
    # stat: b's 6.0 re-anchored on the current 2.0 (delta -6 + 2 - 0 = -4, value 6)
    # and a's 2.0 averaged: 4.0, scaled by nothing.
    assert torch.equal(stat_off, torch.full((N,), 4.0)) and torch.equal(stat_on, stat_off)


def test_stale_contributions_alone_never_open_a_round() -> None:
    """A lagging learner's contribution must not cause an outer step of its own."""
    core = make_core(K=1, grace_max=0.0)
    core.handle(contrib("a"), 0.0)
    assert core.versions[0] == 1
    assert merges(core.handle(contrib("b", base=0), 0.5) + core.handle(Tick(), 9.0)) == []
    assert core.frags[0].round.clock.phase is Phase.OPEN and "b" in core.frags[0].round.pending
    (m,) = merges(core.handle(contrib("a", base=1, step=16), 1.0))
    assert m["merged"] == ["a", "b"] and m["stale"] == ["b"]


def test_join_sends_every_fragment_current_value() -> None:
    core = make_core(P=3, K=1, grace_max=0.0)
    core.handle(contrib("a", p=1), 0.0)
    sends = [a for a in core.handle(LearnerJoined("late"), 1.0) if isinstance(a, SendUpdate)]
    assert sorted(s.update.fragment for s in sends) == [0, 1, 2]
    assert all(s.to == ("late",) for s in sends)
    assert {s.update.fragment: s.update.version for s in sends} == {0: 0, 1: 1, 2: 0}


def test_fragments_are_independent() -> None:
    core = make_core(P=2, K=2)
    core.handle(contrib("a", p=0), 0.0)
    core.handle(contrib("b", p=1), 0.0)
    assert core.versions == [0, 0]
    core.handle(contrib("b", p=0), 0.1)
    assert merges(core.handle(Tick(), 1.1))[0]["fragment"] == 0
    assert core.versions == [1, 0]


def test_records_are_typed_documented_and_write_the_documented_log_lines() -> None:
    """Every record type says what it is, has an event name, and its log line starts
    with ``event`` and ``t``; the levels agree with ``WARNING_EVENTS`` (what readers of
    the log file are told is a warning)."""
    import dataclasses
    import logging

    from rackmend.core import records
    from rackmend.core.failslow import FailSlowReport, RestoreLearner, StopExpecting

    kinds = [getattr(records, n) for n in records.__all__
             if isinstance(getattr(records, n), type) and issubclass(getattr(records, n), SyncerRecord)]
    assert len(kinds) == 17
    for kind in kinds:
        assert kind.__doc__ and dataclasses.is_dataclass(kind)
        assert kind.__dataclass_params__.frozen  # type: ignore[attr-defined]
    plain = [k for k in kinds if k not in (SyncerRecord, records.FailSlowNoted)]
    assert {k.event for k in plain if k.level >= logging.WARNING and k not in (
        records.Incomplete, records.PieceDropped)} | {"failslow_slow", "failslow_evict"} == records.WARNING_EVENTS
    report = FailSlowReport("a", 0, "slow", 2.0, 2.0, 0.1, 10)
    slow = records.FailSlowNoted(t=1.0, action=StopExpecting(report), reason="r")
    back = records.FailSlowNoted(t=2.0, action=RestoreLearner(report), reason="r")
    assert (slow.level, back.level) == (logging.WARNING, logging.DEBUG)
    assert list(slow.to_record())[:3] == ["event", "t", "learner"] and slow.to_record()["event"] == "failslow_slow"
    core = make_core(learners=("a",), K=1)
    acts = core.handle(contrib("a"), 1.0)
    (m,) = [a for a in acts if isinstance(a, Merged)]
    line = m.to_record()
    assert list(line)[:4] == ["event", "t", "fragment", "round"] and line["merged"] == ["a"] and "cause" not in line
    (r,) = [a for a in core.handle(contrib("zz"), 2.0) if isinstance(a, Rejected)]
    assert r.code == "not_joined" and list(r.to_record()) == ["event", "t", "learner", "fragment", "code", "reason"]


@pytest.mark.parametrize("time_merges", [True, False])
def test_the_runner_carries_out_every_action_and_times_merges(time_merges: bool) -> None:
    """One ``SyncerRunner.run``: each action to the function injected for its type, in
    order, and a merge's duration on the driver's clock fed back to the grace window."""
    core = make_core(K=1, grace_max=0.0)
    ticks = iter([10.0, 10.25, 10.5, 20.0, 20.5, 21.0])
    done: list[object] = []
    runner = SyncerRunner(core, lambda: next(ticks), send_update=done.append, record=done.append,
                          merged=lambda fragments, seconds: done.append((fragments, seconds)),
                          time_merges=time_merges)
    actions = runner.run(contrib("a"))
    kinds = [type(a).__name__ for a in done]
    assert kinds == ["SendUpdate", "Merged", "tuple"], kinds
    assert done[:2] == actions  # what the core returned, in its order
    assert done[0].to == ("a", "b", "c") and done[1].t == 10.0
    if time_merges:
        assert done[2] == ([0], 0.25) and core.xi_sync.value == 0.25
    else:
        assert done[2] == ([0], 0.0) and core.xi_sync.value is None
    done.clear()
    runner.run(contrib("b", base=1, step=16))  # K=1, grace 0: merges again at once
    assert [type(a).__name__ for a in done][:2] == ["SendUpdate", "Merged"]


def test_a_cores_membership_view_is_its_own() -> None:
    """No state shared between cores of one process (a sharded syncer's tests, the
    simulator): a member joining one core leaves another's kept view of its membership
    alone, and changes its own."""
    a, b = make_core(), make_core()
    view = a._members_view()
    b.handle(LearnerJoined("d"), 1.0)
    assert a._members_view() is view, "another core's member change invalidated this core's view"
    assert "d" in b.connected_learners() and "d" not in a.connected_learners()
    a.handle(LearnerJoined("e"), 1.0)
    assert a._members_view() is not view and "e" in a.connected_learners()
