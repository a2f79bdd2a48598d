"""Trust at the syncer: what one learner (or one replayed message) can do to the
global model. Counters and step times are bounded, weights cannot overflow, a
non-finite result is never committed, a contribution far larger than the recent
ones is clipped (``guard``), replays are refused, learner ids are matched whole and
leftovers of interrupted checkpoint writes are cleaned up at start."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core import (
    Contribution,
    ContributionArrived,
    FragmentSpec,
    LearnerJoined,
    SendUpdate,
    SyncerCore,
    TensorSpec,
    Tick,
)
from rackmend.core.fragments import pack_fragments
from rackmend.core.records import Combined, Dropped, Guarded, Joined, Merged, Rejected, SyncerRecord
from rackmend.core.syncer import GUARD_RATE_SLACK, GUARD_STEPS_CAP, RETIRED_SESSIONS
from rackmend.core.syncer_fragment import GUARD_LONG_GROWTH
from rackmend.core.checkpoint_meta import CheckpointMeta
from rackmend.core.settings import RunRules
from rackmend.service.events import CheckpointTempsRemoved, Listening, Resumed, SettingsRefused
from rackmend.transport import wire
from rackmend.transport.zmq_link import new_session

from helpers import make_model, serving
from procs import of

N = 4


def make_core(learners: tuple[str, ...] = ("a", "b"), K: int = 1, initial: float = 0.0, **syncer: object) -> SyncerCore:
    # count_absent off: these tests read the merged value as plain arithmetic over the
    # contributions in; the absent share has its own tests (test_syncer_core.py).
    syncer.setdefault("count_absent", False)
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=8, num_fragments=1, overlap=2),
        syncer=SyncerConfig(min_quorum=K, learners=learners, grace_max=1.0, outer_optimizer="SGD", outer_lr=1.0,
                            outer_kwargs={}, **syncer),  # type: ignore[arg-type]
    )
    spec = FragmentSpec(0, 0, (TensorSpec("w", (N,), torch.float32),))
    core = SyncerCore(config, [spec], [[torch.full((N,), initial)]])
    for lid in learners:
        core.handle(LearnerJoined(lid), 0.0)
    return core


def contrib(lid: str, tensor: torch.Tensor, base: int = 0, step: int = 8, steps: int = 8, tokens: float = 64.0,
            step_time: float = 0.01, **extra: object) -> ContributionArrived:
    return ContributionArrived(Contribution(lid, 0, base, step, steps, tokens, step_time, (tensor,), **extra))  # type: ignore[arg-type]


def events(actions: list, kind: type[SyncerRecord]) -> list[dict]:
    """The records of type ``kind`` among ``actions``, as their log lines."""
    return [a.to_record() for a in actions if isinstance(a, kind)]


# ------------------------------------------------------------------ 1: counters, weights, finiteness
@pytest.mark.parametrize("field,value", [
    ("tokens", 1e200),        # tokens**2 overflows: NaN weights, a NaN fragment for good
    ("tokens", 2.0**63 - 1),  # finite weight, but ~100 % of the merge
    ("steps", 2**62),
    ("step_time", 1e300),
])
def test_out_of_bounds_counters_are_rejected_and_the_fragment_stays_finite(field: str, value: float) -> None:
    core = make_core()
    bad = contrib("b", torch.full((N,), 1.0), **{field: value})  # type: ignore[arg-type]
    rejected = events(core.handle(bad, 0.0), Rejected)
    core.handle(contrib("a", torch.full((N,), 1.0)), 0.1)
    actions = core.handle(Tick(), 5.0)
    assert rejected and "bound" in rejected[0]["reason"] and rejected[0]["code"] == "bounds", rejected
    (m,) = events(actions, Merged)
    assert m["merged"] == ["a"]
    assert torch.isfinite(core.frags[0].theta[0]).all() and torch.equal(core.frags[0].theta[0], torch.full((N,), -1.0))


def test_merge_weights_cannot_overflow() -> None:
    from rackmend.core.merge import merge_weights

    w = merge_weights("tokens_sq_per_step", [1e200, 64.0, 1e300], [8, 8, 1])
    assert all(math.isfinite(x) for x in w) and sum(w) == pytest.approx(1.0)
    assert w[2] == pytest.approx(1.0) and w[1] == 0.0
    # Where the plain formula does not overflow, the weights are the plain ones, bit for bit.
    assert merge_weights("tokens_sq_per_step", [64.0, 32.0], [8, 4]) == [64.0 * 64.0 / 8, 32.0 * 32.0 / 4]


def test_non_finite_outer_step_is_not_committed() -> None:
    # Each value is finite, but theta - delta = 1e38 + 3e38 overflows float32.
    core = make_core(learners=("a",), initial=1e38, norm_guard=0.0)
    actions = core.handle(contrib("a", torch.full((N,), -3e38)), 0.0)
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), 1e38)), "a non-finite value was committed"
    assert core.versions[0] == 0 and not events(actions, Merged)
    (dropped,) = events(actions, Dropped)
    assert "non-finite" in dropped["reason"] and dropped["dropped"] == ["a"]
    # The round goes on: the next contribution merges normally.
    (m,) = events(core.handle(contrib("a", torch.full((N,), 1e37), step=16), 1.0), Merged)
    assert m["merged"] == ["a"] and torch.isfinite(core.frags[0].theta[0]).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_is_refused_on_arrival(bad: float) -> None:
    """Finiteness is read from the norm the guard takes anyway (a NaN or Inf makes it
    non-finite): one read of the values, and still a refusal by name."""
    core = make_core(learners=("a",), norm_guard=0.0)
    t = torch.ones(N)
    t[2] = bad
    actions = core.handle(contrib("a", t), 0.0)
    assert [r["code"] for r in events(actions, Rejected)] == ["non_finite"]
    assert core.versions[0] == 0 and not events(actions, Merged)


def test_finite_values_whose_float32_norm_overflows_are_taken() -> None:
    """3e38 squared overflows float32: the norm is not finite, yet every value is; the
    exact check says so and the norm is taken again in float64."""
    from rackmend.core.syncer_fragment import contribution_norm

    big = torch.full((N,), 3e38)
    assert contribution_norm([big]) == pytest.approx(2 * 3e38, rel=1e-6)
    core = make_core(learners=("a",), norm_guard=0.0)
    actions = core.handle(contrib("a", big), 0.0)
    assert not events(actions, Rejected) and events(actions, Merged)
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -3e38))


def test_the_window_takes_the_norm_of_what_merged() -> None:
    """A send merged as it arrived enters the guard's window with its arrival norm; a
    learner's disjoint work merged combined enters with the norm of the sum."""
    core = make_core(K=2, norm_guard=0.0)
    core.handle(contrib("a", torch.tensor([3.0, 4.0, 0.0, 0.0])), 0.0)
    core.handle(contrib("b", torch.tensor([0.0, 0.0, 6.0, 8.0])), 0.0)
    assert core.versions[0] == 1 and list(core.frags[0].norms) == [5.0, 10.0]
    # b: a send on version 1 (4 steps since applying it at step 12), then, late, the one
    # it made on version 0 at step 12: disjoint work.
    core.handle(contrib("b", torch.tensor([1.0, 0.0, 0.0, 0.0]), base=1, step=16, steps=4), 1.0)
    acts = core.handle(contrib("b", torch.tensor([0.0, 2.0, 0.0, 0.0]), base=0, step=12, steps=4), 1.0)
    assert events(acts, Combined) and not events(acts, Merged)
    acts = core.handle(contrib("a", torch.tensor([0.0, 0.0, 0.0, 2.0]), base=1, step=16), 1.5)
    assert events(acts, Merged)[0]["merged"] == ["a", "b"]
    assert list(core.frags[0].norms)[2:] == [2.0, pytest.approx(math.sqrt(5.0))]


# ------------------------------------------------------------------ 2: the norm guard
def _honest_rounds(core: SyncerCore, rounds: int) -> int:
    g = torch.Generator().manual_seed(0)
    step = 0
    for r in range(rounds):
        step += 8
        for lid in ("a", "b"):
            core.handle(contrib(lid, torch.randn(N, generator=g) * 0.01, base=core.versions[0], step=step), float(r))
        core.handle(Tick(), r + 0.9)
    return step


@pytest.mark.parametrize("kind", ["huge_norm", "one_huge_element"])
def test_guard_clips_a_huge_contribution_among_honest_ones(kind: str) -> None:
    core = make_core(K=2)
    step = _honest_rounds(core, 4)
    before = core.frags[0].theta[0].clone()
    bad = torch.randn(N, generator=torch.Generator().manual_seed(1)) * 0.01 * 1e6
    if kind == "one_huge_element":
        bad = torch.zeros(N)
        bad[0] = 3e38
    core.handle(contrib("a", torch.full((N,), 0.01), base=core.versions[0], step=step + 8), 10.0)
    actions = core.handle(contrib("b", bad, base=core.versions[0], step=step + 8), 10.0)
    (guard,) = events(actions, Guarded)
    margin = core.config.syncer.norm_guard
    assert guard["learner"] == "b" and guard["norm"] > margin * guard["median"] and guard["bound"] == pytest.approx(
        margin * guard["median"])
    assert events(actions, Merged) and torch.isfinite(core.frags[0].theta[0]).all()
    change = torch.linalg.vector_norm(core.frags[0].theta[0] - before).item()
    assert change <= guard["bound"] * 1.01  # the weighted mean of two contributions within the bound


@pytest.mark.parametrize("steps,clipped", [(80, False), (8, True)])
def test_guard_allows_for_the_steps_behind_a_send(steps: int, clipped: bool) -> None:
    # Back from an outage, a learner's first send holds every step made meanwhile (10x the
    # usual 8 here) and its norm grows with them: not an outlier. The same norm over the
    # usual steps is one.
    core = make_core(K=2)
    step = _honest_rounds(core, 4)
    norm = 100 * torch.linalg.vector_norm(torch.full((N,), 0.01)).item()
    big = torch.full((N,), 0.01) * 100
    actions = core.handle(contrib("b", big, base=core.versions[0], step=step + steps, steps=steps), 10.0)
    guards = events(actions, Guarded)
    assert bool(guards) == clipped, guards
    if clipped:
        assert guards[0]["c_steps"] == 8 and guards[0]["usual_steps"] == 8 and guards[0]["norm"] == pytest.approx(norm)


def test_guard_allows_for_a_base_versions_behind() -> None:
    # A learner whose updates stop arriving trains on from its old base and sends the
    # drift since that base every time: one usual period more per version behind.
    core = make_core(K=2)
    step = _honest_rounds(core, 4)
    median = sorted(core.frags[0].norms)[len(core.frags[0].norms) // 2]
    big = torch.full((N,), 1.0)
    big *= 45 * median / torch.linalg.vector_norm(big).item()  # 45x: over 30, under 30 x 2
    assert events(core.handle(contrib("b", big, base=core.versions[0], step=step + 8), 10.0), Guarded)
    assert not events(core.handle(contrib("a", big, base=core.versions[0] - 1, step=step + 8), 10.0), Guarded)


def test_guard_allowance_for_claimed_steps_needs_a_believable_step_counter_and_is_capped() -> None:
    # c_steps is the sender's word: a step counter that went back, or ran faster than
    # GUARD_RATE_SLACK x the other learners' rate, buys the usual bound only; one that
    # keeps pace buys at most GUARD_STEPS_CAP x the usual bound.
    core = make_core(K=2)
    step = _honest_rounds(core, 4)  # 8 steps per second, the last sends at t=3
    bad = torch.full((N,), 1e3)
    factor = core.config.syncer.norm_guard
    # 10**6 steps in 7 s: far over 4 x 8 steps/s.
    (guard,) = events(core.handle(contrib("b", bad, base=core.versions[0], step=step + 10**6, steps=10**6), 10.0),
                      Guarded)
    assert guard["bound"] == pytest.approx(factor * guard["median"])
    assert f"over {GUARD_RATE_SLACK:g}x the reference rate of 8 steps/s" in guard["reason"]
    (guard,) = events(core.handle(contrib("a", bad, base=core.versions[0], step=step - 8, steps=10**6), 10.0),
                      Guarded)
    assert guard["bound"] == pytest.approx(factor * guard["median"]) and "did not advance" in guard["reason"]
    # 10**6 steps over 10**6 s: believable, and capped.
    (guard,) = events(core.handle(contrib("b", bad, base=core.versions[0], step=step + 2 * 10**6, steps=10**6),
                                  10.0 + 10**6), Guarded)
    assert guard["bound"] == pytest.approx(factor * GUARD_STEPS_CAP * guard["median"])


def test_guard_scale_survives_a_checkpoint() -> None:
    core = make_core(K=2)
    _honest_rounds(core, 4)
    tensors, meta = core.state_dict()
    resumed = make_core(K=2)
    resumed.load_state_dict(tensors, meta)
    assert list(resumed.frags[0].norms) == list(core.frags[0].norms) and len(core.frags[0].norms) == 8
    assert list(resumed.frags[0].norm_steps) == list(core.frags[0].norm_steps) == [8] * 8
    assert resumed.frags[0].norm_scale == core.frags[0].norm_scale is not None


def test_guard_scale_from_a_checkpoint_written_before_the_growth_cap() -> None:
    core = make_core(K=2)
    _honest_rounds(core, 4)
    tensors, meta = core.state_dict()
    raw = meta.to_json()  # as the file holds it, upgraded on read as format 1 was
    del raw["norm_scale"], raw["scale_history"], raw["format"]
    resumed = make_core(K=2)
    resumed.load_state_dict(tensors, CheckpointMeta.from_json(raw))
    window = sorted(core.frags[0].norms)
    assert resumed.frags[0].norm_scale == window[(len(window) - 1) // 2]
    del raw["norms"], raw["norm_steps"], raw["norm_learners"]  # older still: no guard state at all
    bare = make_core(K=2)
    bare.load_state_dict(tensors, CheckpointMeta.from_json(raw))
    assert bare.frags[0].norm_scale is None and len(bare.frags[0].norms) == 0


def _norm_of(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()


@pytest.mark.parametrize("rounds", ["one_round", "round_per_burst"])
def test_guard_cannot_be_ratcheted_by_bursts_from_one_learner(rounds: str) -> None:
    # The reported attack: 7 bursts of 40 same-step sends from one learner, each burst 8x
    # the last, then one send 1e6x the usual. When every accepted send entered the
    # window, each burst filled it and raised the bound 8x; the 1e6x send merged unclipped.
    core = make_core(K=2)
    step = _honest_rounds(core, 4)
    usual = torch.full((N,), 0.01)
    before = _norm_of(core.frags[0].theta[0])
    seq = itertools.count(1)

    def b_sends(scale: float, count: int, at: float) -> list:
        out: list = []
        for _ in range(count):
            out += core.handle(contrib("b", usual * scale, base=core.versions[0], step=step + 8, session=1,
                                       seq=next(seq)), at)
        return out

    def close_round(at: float) -> list:
        return core.handle(contrib("a", usual, base=core.versions[0], step=step + 8), at)

    guards: list[dict] = []
    for burst in range(1, 8):
        guards += events(b_sends(8.0**burst, 40, 10.0 + burst), Guarded)
        if rounds == "round_per_burst":
            assert events(close_round(10.5 + burst), Merged)
            step += 8
    final = b_sends(1e6, 1, 20.0)
    assert events(close_round(20.5), Merged)
    (last,) = events(final, Guarded)
    assert last["learner"] == "b" and last["norm"] == pytest.approx(1e6 * _norm_of(usual))
    # The scale is still the honest sends' (norm ~0.02), not b's.
    assert last["median"] <= 2 * _norm_of(usual) and last["bound"] == pytest.approx(30 * last["median"]), last
    # Bursts from the second on (64x and more) were clipped too: b never moved the scale.
    assert len(guards) == 6 * 40
    assert all(g["learner"] == "b" for g in guards)
    # Each merge moves the fragment by at most its bound (weights are a convex mix).
    merges = 1 if rounds == "one_round" else 8
    assert _norm_of(core.frags[0].theta[0]) <= before + merges * last["bound"] * 1.01


def test_one_learner_adds_at_most_one_norm_per_merge() -> None:
    core = make_core(K=2)
    step = _honest_rounds(core, 4)
    n = len(core.frags[0].norms)
    for i in range(50):  # repeats, then cumulative sends: one pending send
        core.handle(contrib("b", torch.full((N,), 0.01), base=core.versions[0], step=step + 8 + i), 10.0)
    assert len(core.frags[0].norms) == n, "norms enter the window at merge time only"
    core.handle(contrib("a", torch.full((N,), 0.01), base=core.versions[0], step=step + 8), 10.5)
    assert len(core.frags[0].norms) == n + 2
    # Disjoint work of one learner (an older send re-based after a merge in between)
    # merges combined: still one norm.
    step += 8 + 49
    core.handle(contrib("b", torch.full((N,), 0.01), base=core.versions[0], step=step + 8), 11.0)
    core.handle(contrib("b", torch.full((N,), 0.01), base=core.versions[0] - 1, step=step + 4, steps=4), 11.0)
    actions = core.handle(contrib("a", torch.full((N,), 0.01), base=core.versions[0], step=step + 8), 11.5)
    assert events(actions, Merged) and len(core.frags[0].norms) == n + 4


def _adversary_bound(core: SyncerCore, c: Contribution, now: float) -> float:
    """The bound the guard would hold ``c`` to: what an adversary that reads the
    syncer's state aims just under."""
    frag = core.frags[c.fragment]
    scale = frag.scale_for(c.learner_id)
    assert scale is not None
    usual = frag.guard_usual_steps()
    behind = frag.version - c.base_version
    credited, _ = core._credited(c, usual, now)
    return core.config.syncer.norm_guard * scale * min(GUARD_STEPS_CAP, max(1.0, credited / usual) + behind)


@pytest.mark.parametrize("fleet", ["with honest learners", "alone"])
@pytest.mark.parametrize("lie", ["steps", "steps and counter"])
def test_an_adversary_sending_just_under_its_bound_every_merge_cannot_ratchet_it(fleet: str, lie: str) -> None:
    """The reported attack, and the ways it adapts: an admitted learner claims 64x its
    real steps (also advancing its step counter 64x as fast, in the second form) and
    sends just under its bound at every merge, reading the bound from the syncer's state.
    It once grew its bound 19 248x in 57 merges and then merged a 1e6x contribution
    unclipped. Now its bound comes from the other learners' norms (leave-one-out), its
    claimed steps are credited only as its counter and the clock allow, and the scale
    cannot outgrow its own history: with honest learners its bound stays where theirs
    puts it; alone it grows in proportion to the merges, not exponentially, and the 1e6x
    send is clipped and named either way."""
    ids = ("a", "b", "c", "mallory") if fleet != "alone" else ("mallory",)
    core = make_core(learners=ids, K=1)
    g = torch.Generator().manual_seed(3)
    step, t = 0, 0.0
    honest = torch.linalg.vector_norm(torch.full((N,), 0.01)).item()
    for r in range(6):  # everybody honest at first: the guard learns the scale
        step += 8
        for lid in ids:
            core.handle(contrib(lid, torch.full((N,), 0.01) * (1 + 0.1 * torch.rand(N, generator=g)),
                                base=core.versions[0], step=step), t)
            t += 0.25
    start = core.frags[0].scale_for("mallory")
    assert start is not None
    counter = step
    for r in range(57):
        step += 8
        counter += 8 * 64 if lie == "steps and counter" else 8
        for lid in ids:
            if lid == "mallory":
                c = Contribution("mallory", 0, core.versions[0], counter, 8 * 64, 64.0 * 64, 0.01, (torch.ones(N),))
                size = 0.99 * _adversary_bound(core, c, t) / _norm_of(torch.ones(N))
                actions = core.handle(ContributionArrived(replace(c, tensors=(torch.ones(N) * size,))), t)
                assert not events(actions, Guarded), "the adversary misread its bound"
            else:
                core.handle(contrib(lid, torch.full((N,), 0.01) * (1 + 0.1 * torch.rand(N, generator=g)),
                                    base=core.versions[0], step=step), t)
            t += 0.25
    grown = core.frags[0].scale_for("mallory") / start  # type: ignore[operator]
    if fleet == "alone":
        # In proportion to the merges: the history's median is the scale of half of them ago.
        assert grown <= GUARD_LONG_GROWTH * (57 + 6) / 6, grown
    else:
        assert grown <= 2.0, grown  # the honest learners' norms set it
    counter += 8 * 64 if lie == "steps and counter" else 8
    huge = Contribution("mallory", 0, core.versions[0], counter, 8 * 64, 64.0 * 64, 0.01,
                        (torch.ones(N) * 1e6 * honest / _norm_of(torch.ones(N)),))
    (guard,) = events(core.handle(ContributionArrived(huge), t + 1.0), Guarded)
    assert guard["learner"] == "mallory" and guard["bound"] < 1e6 * honest / 10, guard
    if fleet != "alone":  # at most the steps cap over the honest learners' norms
        assert guard["bound"] <= 30 * GUARD_STEPS_CAP * 2 * honest, guard
    if lie == "steps and counter":  # a counter running 64x as fast is not believed
        assert guard["bound"] <= 30 * 2 * honest * (GUARD_LONG_GROWTH * 63 / 6 if fleet == "alone" else 1), guard


def test_guard_scale_grows_at_most_guard_growth_per_merge() -> None:
    # A learner alone in its rounds owns the whole window; sending just under the bound
    # every round, it raises its bound by at most GUARD_GROWTH per merge.
    from rackmend.core.syncer_fragment import GUARD_GROWTH

    core = make_core(learners=("a",))
    step = 0
    for r in range(5):
        step += 8
        core.handle(contrib("a", torch.full((N,), 0.01), base=core.versions[0], step=step), float(r))
    start = core.frags[0].norm_scale
    assert start is not None
    scales = [start]
    for r in range(20):
        step += 8
        just_under = torch.full((N,), 1.0) * (0.99 * 30 * scales[-1] / _norm_of(torch.ones(N)))
        actions = core.handle(contrib("a", just_under, base=core.versions[0], step=step), 10.0 + r)
        assert not events(actions, Guarded) and events(actions, Merged)
        scales.append(core.frags[0].norm_scale)  # type: ignore[arg-type]
    growth = [b / a for a, b in zip(scales, scales[1:])]
    assert max(growth) <= GUARD_GROWTH * (1 + 1e-12) and scales[-1] > scales[0]
    assert scales[-1] <= start * GUARD_GROWTH**20


@pytest.mark.parametrize("growth", ["warm-up", "5%"])
def test_honest_norms_growing_are_never_clipped(growth: str) -> None:
    # Norms growing as a learning-rate warm-up from 1 % of the peak makes them (linear,
    # 100-fold over 60 rounds), or 5 % per round (19-fold), 2 learners, 150 rounds: the
    # window and the long-horizon cap follow, and nobody is clipped. (Exponential growth
    # of 25 % per round is not honest training: the long-horizon cap holds it back.)
    core = make_core(K=2)
    g = torch.Generator().manual_seed(0)
    step = 0
    clipped: list[dict] = []
    for r in range(150):
        step += 8
        size = min(r + 1, 100) * 0.0001 if growth == "warm-up" else 0.01 * 1.05 ** min(r, 60)
        for who in ("a", "b"):
            noise = 1 + 0.2 * torch.rand(N, generator=g)
            clipped += events(core.handle(contrib(who, size * noise, base=core.versions[0], step=step), float(r)),
                              Guarded)
    assert clipped == [] and core.versions[0] == 150


def test_guard_waits_for_enough_norms_and_zero_disables_it() -> None:
    core = make_core(learners=("a",))
    # The very first contributions set the scale: no guard yet, however large.
    assert not events(core.handle(contrib("a", torch.full((N,), 1e6)), 0.0), Guarded)
    off = make_core(learners=("a",), norm_guard=0.0)
    for i in range(8):
        off.handle(contrib("a", torch.full((N,), 0.01), base=off.versions[0], step=8 * (i + 1)), float(i))
    assert not events(off.handle(contrib("a", torch.full((N,), 1e6), base=off.versions[0], step=80), 9.0), Guarded)


def test_honest_demo_run_never_trips_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    from rackmend.demo import threads
    from rackmend.demo.spec import arm_specs
    from rackmend.demo.threads import thread_settings, train_arm
    from rackmend.workloads import ByteCorpus, GPTConfig

    torch.set_num_threads(1)
    hubs = []
    original = threads.InProcessSyncer.for_model

    def capture(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        hubs.append(original(*args, **kwargs))  # type: ignore[arg-type]
        return hubs[-1]

    monkeypatch.setattr(threads.InProcessSyncer, "for_model", capture)
    s = thread_settings(learners=3, steps=64, batch_size=8, sync_every=8, fragments=2, overlap=1, evals=1,
                     model=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
    train_arm("rackmend", arm_specs(s)["rackmend"].config, s, ByteCorpus())
    (hub,) = hubs
    merges = hub.merges()
    assert len(merges) >= 10
    assert [r for r in hub.records if isinstance(r, Guarded)] == []


# ------------------------------------------------------------------ 3: replays (core)
def test_core_refuses_a_replayed_or_older_sequence_number() -> None:
    core = make_core(learners=("a",))
    one = contrib("a", torch.full((N,), 0.01), session=7, seq=1)
    assert events(core.handle(one, 0.0), Merged)
    (rej,) = events(core.handle(one, 1.0), Rejected)
    assert "replay" in rej["reason"]
    # A new session (the learner process restarted) starts its own numbering.
    fresh = contrib("a", torch.full((N,), 0.01), base=1, step=4, session=8, seq=1)
    assert events(core.handle(fresh, 2.0), Merged)
    (old,) = events(core.handle(one, 3.0), Rejected)  # the first session's message, replayed
    assert "earlier session" in old["reason"]
    assert core.versions[0] == 2


@pytest.mark.parametrize("sessions", [RETIRED_SESSIONS + 2, 20, 3 * RETIRED_SESSIONS])
def test_a_replay_of_a_session_older_than_those_remembered_is_refused(sessions: int) -> None:
    """After 20 sessions of a learner, session 1's contribution replayed byte for byte
    merged: only the last RETIRED_SESSIONS were remembered. Sessions below the floor
    (the newest one forgotten) are refused however many there were, also after the
    syncer's checkpoint; a new session (later on the clock) still merges. Staleness is
    off, so only the replay check decides."""
    core = make_core(learners=("a",), max_staleness=10_000)
    sent = []
    for i in range(sessions):  # each restart numbers its sends anew, in a later session
        c = contrib("a", torch.full((N,), 0.01), base=core.versions[0], step=8, session=1000 + i, seq=1)
        assert events(core.handle(c, float(i)), Merged)
        sent.append(c)
    version = core.versions[0]
    forgotten = sessions - 1 - RETIRED_SESSIONS  # the current one and RETIRED_SESSIONS before it are remembered
    for c in sent[:forgotten]:  # older than those remembered: each refused
        (rej,) = events(core.handle(c, 100.0), Rejected)
        assert rej["code"] == "replay" and "older than the 16 sessions" in rej["reason"], rej
    for c in sent[forgotten:]:  # remembered: refused by their seq
        (rej,) = events(core.handle(c, 101.0), Rejected)
        assert rej["code"] == "replay", rej
    assert core.versions[0] == version
    restored = make_core(learners=("a",), max_staleness=10_000)
    restored.load_state_dict(*core.state_dict())
    (rej,) = events(restored.handle(sent[0], 102.0), Rejected)
    assert rej["code"] == "replay", "a checkpoint forgot the floor"
    fresh = contrib("a", torch.full((N,), 0.01), base=restored.versions[0], step=8, session=5000, seq=1)
    assert events(restored.handle(fresh, 103.0), Merged)


def test_links_number_their_sessions_later_than_any_before() -> None:
    first = new_session()
    time.sleep(0.001)
    assert first < new_session() < 2**63 - 1


def test_a_session_that_another_one_replaced_goes_on_where_it_left_off() -> None:
    """A takeover without Curve: another connection spoke as 'a' (session 9) while the
    real 'a' (session 7) was stopped. When 'a' comes back, its next sends merge; its
    old ones stay replays. Before, session 7 was retired for good: 'a' never merged again."""
    core = make_core(learners=("a",))
    for seq in (1, 2, 3):
        assert events(core.handle(contrib("a", torch.full((N,), 0.01), base=seq - 1, step=8 * seq, session=7,
                                          seq=seq), float(seq)), Merged)
    assert events(core.handle(contrib("a", torch.full((N,), 0.01), base=3, step=8, session=9, seq=1), 4.0), Merged)
    back = contrib("a", torch.full((N,), 0.01), base=4, step=32, session=7, seq=4)
    assert events(core.handle(back, 5.0), Merged), "the returning session was locked out"
    (again,) = events(core.handle(back, 6.0), Rejected)
    assert "replay" in again["reason"]
    (old,) = events(core.handle(contrib("a", torch.full((N,), 0.01), base=5, step=8, session=9, seq=1), 7.0),
                    Rejected)
    assert "earlier session" in old["reason"]
    restored = make_core(learners=("a",))
    restored.load_state_dict(*core.state_dict())
    (kept,) = events(restored.handle(contrib("a", torch.full((N,), 0.01), base=5, step=8, session=9, seq=1), 8.0),
                     Rejected)
    assert "earlier session" in kept["reason"], "a checkpoint forgot the earlier session's last seq"
    assert events(restored.handle(contrib("a", torch.full((N,), 0.01), base=5, step=8, session=9, seq=2), 9.0),
                  Merged)


# ------------------------------------------------------------------ live syncer, raw ZeroMQ client
CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                        syncer=SyncerConfig(min_quorum=1, grace_max=0.05))
_SEQ = itertools.count(1)


class Raw:
    """A learner speaking the protocol by hand over a DEALER socket."""

    def __init__(self, endpoint: str, learner: str = "mallory") -> None:
        self.learner = learner
        self.epoch = 0
        """The syncer's epoch, from the updates that answered the hello."""
        self.frags = pack_fragments(make_model(), 2, 4)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout: float) -> tuple[dict, list] | None:
        if not self.sock.poll(max(1, int(timeout * 1000))):
            return None
        frames = self.sock.recv_multipart()
        header = msgpack.unpackb(frames[0])
        if header.get("type") == "update":  # as a link does: the next value waits for it
            self.send(wire.ack_frames(header["fragment"], self.learner, 0))
        return header, frames[1:]

    def hello(self) -> None:
        self.send(wire.hello_frames(self.learner, 0, 1, self.frags, RunRules.from_config(CONFIG)))
        end = time.monotonic() + 20
        got = set()
        while time.monotonic() < end and len(got) < len(self.frags):
            reply = self.recv(end - time.monotonic())
            if reply is None:
                break
            header, _ = reply
            if header["type"] == "init_request":
                for spec in self.frags:
                    values = [torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors]
                    self.send(wire.init_frames(self.learner, 0, spec.index, values))
            elif header["type"] == "update":
                got.add(header["fragment"])
                self.epoch = header["epoch"]
            elif header["type"] == "error":
                raise AssertionError(f"hello refused: {header}")
        assert len(got) == len(self.frags), "never joined"

    def contribution(self, frag: int = 0, base: int = 0, **over: object) -> list:
        tensors = [torch.full(t.shape, 0.01, dtype=t.dtype) for t in self.frags[frag].tensors]
        header = {"type": "contrib", "learner": self.learner, "rank": 0, "fragment": frag, "base_version": base,
                  "step": 4, "c_steps": 4, "c_tokens": 16.0, "step_time": 0.01, "session": 7, "seq": next(_SEQ), "base_epoch": self.epoch,
                  "codec": 0, "tensors": wire._tensor_meta(tensors), **over}
        return wire.encode(header, tensors)

    def errors(self, timeout: float) -> list[dict]:
        end = time.monotonic() + timeout
        out = []
        while time.monotonic() < end:
            reply = self.recv(end - time.monotonic())
            if reply is None:
                break
            if reply[0]["type"] == "error":
                out.append(reply[0])
                break
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def live():
    torch.set_num_threads(1)
    svc, records, thread = serving(CONFIG, heartbeat_timeout=60)
    end = time.monotonic() + 20
    while not of(records, Listening) and time.monotonic() < end:
        time.sleep(0.02)
    raw = Raw(svc.endpoint)
    yield svc, records, raw
    raw.close()
    svc.stop()
    thread.join(20)


def _wait(records: list[SyncerRecord], pred, timeout: float = 10.0, start: int = 0) -> bool:  # type: ignore[no-untyped-def]
    """Whether a record from index ``start`` on satisfies ``pred`` within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(pred(r) for r in records[start:]):
            return True
        time.sleep(0.02)
    return False


def test_replayed_contribution_is_merged_once(live) -> None:  # type: ignore[no-untyped-def]
    svc, records, raw = live
    raw.hello()
    frames = [bytes(f) for f in raw.contribution()]  # every element 0.01: each merge moves theta by -0.01
    raw.send(frames)
    assert _wait(records, lambda r: isinstance(r, Merged) and "mallory" in r.merged)
    before = len(records)
    raw.send(frames)
    raw.send(frames)
    _wait(records, lambda r: isinstance(r, Rejected) and "replay" in r.reason, timeout=3.0, start=before + 1)
    # A fresh contribution closes the next round; replays still pending would ride along with it.
    raw.send(raw.contribution(base=svc.core.versions[0], step=8))
    assert _wait(records, lambda r: isinstance(r, Merged) and "mallory" in r.merged, start=before)
    time.sleep(0.2)
    theta = svc.core.frags[0].theta[0]
    assert torch.allclose(theta, torch.full_like(theta, -0.02)), (
        f"two distinct contributions should move theta to -0.02, got {theta.flatten()[0].item():.4f}: "
        "a replay was merged too")
    replays = [r for r in of(records, Rejected) if "replay" in r.reason]
    assert len(replays) == 2 and {r.code for r in replays} == {"replay"}


@pytest.mark.parametrize("field,value", [("c_tokens", 1e200), ("c_tokens", float(2**63 - 1)),
                                         ("c_steps", 2**62), ("step_time", 1e300)])
def test_out_of_bounds_counters_are_rejected_live(live, field: str, value: float) -> None:  # type: ignore[no-untyped-def]
    svc, records, raw = live
    raw.hello()
    raw.send(raw.contribution(**{field: value}))
    errors = raw.errors(5.0)
    assert errors and errors[0]["code"] == "rejected" and "bound" in errors[0]["reason"], errors
    assert any("bound" in r.reason for r in of(records, Rejected))
    assert all(torch.isfinite(t).all() for t in svc.core.frags[0].theta)
    # A sane contribution after it still merges.
    raw.send(raw.contribution(base=svc.core.versions[0], step=8))
    assert _wait(records, lambda r: isinstance(r, Merged) and "mallory" in r.merged)
    assert all(torch.isfinite(t).all() for t in svc.core.frags[0].theta)


# ------------------------------------------------------------------ 4: learner ids are matched whole
@pytest.mark.parametrize("lid", ["l0\n", "mallory\n"])
def test_learner_id_with_trailing_newline_is_refused(live, lid: str) -> None:  # type: ignore[no-untyped-def]
    svc, records, raw = live
    Raw(svc.endpoint, "seed").hello()  # a started core: a bad hello is not answered with init_request
    raw.learner = lid
    raw.send(wire.hello_frames(lid, 0, 1, raw.frags, RunRules.from_config(CONFIG)))
    errors = raw.errors(5.0)
    assert errors and errors[0]["code"] == "bad_message" and "learner id" in errors[0]["reason"], errors
    assert not any(r.learner == lid for r in of(records, Joined))


def test_learners_option_is_the_list_of_ids_that_may_join() -> None:
    """With --learners given, an id outside it is refused by name (fatal, logged), and
    the listed ones still join."""
    config = CONFIG.replace(syncer=SyncerConfig(min_quorum=1, grace_max=0.05, learners=("l0",)))
    svc, records, thread = serving(config)
    stranger, member = Raw(svc.endpoint, "mallory"), Raw(svc.endpoint, "l0")
    try:
        stranger.send(wire.hello_frames("mallory", 0, 1, stranger.frags, RunRules.from_config(config)))
        errors = stranger.errors(10.0)
        assert errors and errors[0]["code"] == "fatal" and "--learners" in errors[0]["reason"], errors
        member.hello()  # raises if refused
    finally:
        stranger.close()
        member.close()
        svc.stop()
        thread.join(20)
    refused = of(records, SettingsRefused)
    assert [(r.learner, r.setting) for r in refused] == [("mallory", "learner_id")]
    assert [r.learner for r in of(records, Joined)] == ["l0"]


def test_decode_header_matches_the_whole_id() -> None:
    frames = wire.encode({"type": "heartbeat", "learner": "l0\n", "rank": 0})
    with pytest.raises(wire.WireError, match="learner id"):
        wire.decode_header(frames, wire.LEARNER_TYPES, 1 << 20)


# ------------------------------------------------------------------ 5: checkpoint temp files
def test_leftover_checkpoint_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    leftover = tmp_path / ".syncer.safetensors.tmp-4242"
    leftover.write_bytes(b"half a checkpoint")
    keep = tmp_path / "notes.txt"
    keep.write_text("not ours")
    svc, records, thread = serving(CONFIG, checkpoint_dir=str(tmp_path))
    try:
        assert _wait(records, lambda r: isinstance(r, Listening))
        assert not leftover.exists(), "an interrupted checkpoint write was left behind"
        assert keep.exists()
        (removed,) = of(records, CheckpointTempsRemoved)
        assert removed.paths == (str(leftover),)
    finally:
        svc.stop()
        thread.join(20)


# ------------------------------------------------------------------ 8: a crash never reissues a version
def test_epoch_lineage_across_two_crashes() -> None:
    """Run 1 makes versions 1-3 but checkpoints at 2; run 2 resumes there, makes its own
    3 and 4 and checkpoints at 4; run 3 resumes from that. Work based on run 1's
    version 2 or run 2's version 4 is sound; run 1's version 3 and anything run 2 made
    after its checkpoint were lost, and are refused with a reset."""
    def run(epoch: int, state: tuple | None) -> SyncerCore:
        core = make_core(learners=("a",))
        core.epoch = epoch
        if state is not None:
            core.load_state_dict(*state)
        return core

    def step(core: SyncerCore, base: int, epoch: int) -> list:
        return core.handle(contrib("a", torch.full((N,), 0.01), base=base, step=8 * (base + 1), seq=0,
                                   base_epoch=epoch), 0.0)

    one = run(11, None)
    for v in range(2):
        assert events(step(one, v, 11), Merged)
    ckpt1 = one.state_dict()
    assert events(step(one, 2, 11), Merged) and one.versions[0] == 3  # lost in the crash
    two = run(22, ckpt1)
    for v in range(2, 4):
        assert events(step(two, v, 22), Merged)
    ckpt2 = two.state_dict()
    three = run(33, ckpt2)
    assert three.lineage == [(11, [2]), (22, [4])]
    for epoch, base, sound in [(11, 2, True), (11, 3, False), (22, 4, True), (22, 5, False), (44, 1, False)]:
        acts = step(three, base, epoch)
        rejected = events(acts, Rejected)
        resets = [a for a in acts if isinstance(a, SendUpdate) and a.reset]
        if sound:
            assert not rejected and not resets, (epoch, base, rejected)
        else:
            assert rejected and "another syncer run" in rejected[0]["reason"] and resets, (epoch, base, rejected)


def _updates(raw: Raw, fragment: int, timeout: float, version: int | None = None) -> list[dict]:
    """Update headers of ``fragment`` that reach ``raw`` within ``timeout`` (others
    skipped), or until one of ``version`` arrives."""
    out, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        reply = raw.recv(end - time.monotonic())
        if reply is None:
            break
        if reply[0]["type"] == "update" and reply[0]["fragment"] == fragment:
            out.append(reply[0])
            if reply[0]["version"] == version:
                break
    return out


def test_work_based_on_a_version_lost_in_a_crash_is_refused_and_the_learner_reset(procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A syncer killed after sending version 3 but before checkpointing it resumes at
    version 2 and makes another version 3. A learner still holding the lost one (its
    link resends an unacknowledged contribution based on it) must not be merged as if
    based on the new one: refused by epoch, logged, and sent the current value."""
    from procs import events as log_events

    flags = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--min-quorum", "1",
             "--grace-max", "0.05", "--overlap", "1")
    s1, endpoint = procs.syncer(*flags)
    a = Raw(endpoint, "l0")
    a.hello()
    lost_epoch = a.epoch
    for v in range(3):
        a.send(a.contribution(base=v, step=4 * (v + 1)))
        assert any(u["version"] == v + 1 for u in _updates(a, 0, 60.0, v + 1)), f"no merge to version {v + 1}"
    a.close()
    s1.kill()
    s1.wait(10)
    _, endpoint2 = procs.syncer(*flags, "--resume", name="syncer2")
    resumed = log_events(tmp_path, Resumed)[-1]
    b, a2 = Raw(endpoint2, "l1"), Raw(endpoint2, "l0")
    try:
        b.hello()
        assert b.epoch != lost_epoch
        kept = resumed.versions[0]
        assert kept < 3, "the test needs version 3 of fragment 0 to be lost"
        v = kept
        while v < 3:  # the resumed run makes its own versions up to 3, with other values
            b.send(b.contribution(base=v, step=4 * (v + 1), c_tokens=32.0))
            assert any(u["version"] == v + 1 for u in _updates(b, 0, 60.0, v + 1))
            v += 1
        a2.hello()
        before = len(log_events(tmp_path))
        a2.epoch = lost_epoch  # its resend of work based on the lost version 3
        a2.send(a2.contribution(base=3, step=16))
        errors = a2.errors(10.0)
        assert errors and errors[0]["code"] == "rejected" and "another syncer run" in errors[0]["reason"], errors
        resets = [u for u in _updates(a2, 0, 30.0, 3) if u["reset"]]
        assert resets and resets[0]["epoch"] == b.epoch and resets[0]["version"] == 3
        later = log_events(tmp_path)[before:]
        assert any(e.learner == "l0" and "epoch" in e.reason for e in of(later, Rejected))
        assert not any("l0" in e.merged for e in of(later, Merged))
    finally:
        b.close()
        a2.close()


# ------------------------------------------------------------------ 6: nobody inflates the grace window
def test_one_absurd_step_time_does_not_stretch_the_grace_window() -> None:
    core = make_core(learners=("a", "b", "c"), K=1)
    for lid in ("a", "b"):
        core.handle(contrib(lid, torch.full((N,), 0.01), step_time=0.05), 0.0)
    honest = core.grace()
    assert 0 < honest < core.config.syncer.grace_max
    core.handle(contrib("c", torch.full((N,), 0.01), step_time=80_000.0), 0.0)  # within MAX_STEP_TIME
    assert core.grace() == pytest.approx(honest), "one learner's report moved the fleet's step time"
    assert core.step_time_estimate() == pytest.approx(0.05)
    # A checkpoint keeps the per-learner estimates, so a restart does not fall back to grace_max.
    restored = make_core(learners=("a", "b", "c"), K=1)
    restored.load_state_dict(*core.state_dict())
    assert restored.grace() == pytest.approx(honest)


def test_absurd_step_time_does_not_pin_live_rounds_at_grace_max(live) -> None:  # type: ignore[no-untyped-def]
    svc, records, raw = live
    honest = [Raw(svc.endpoint, f"h{i}") for i in range(2)]
    try:
        for h in honest:
            h.hello()
        raw.hello()
        raw.send(raw.contribution(step_time=80_000.0))
        for rnd in range(4):
            for h in honest:
                h.send(h.contribution(base=svc.core.versions[0], step=4 * (rnd + 1), step_time=0.001))
                _updates(h, 0, 0.3)
        merges = [r for r in of(records, Merged) if r.fragment == 0 and r.grace_s is not None]
        assert merges, "no merge"
        assert max(r.grace_s for r in merges[1:] or merges) < 0.05, [r.grace_s for r in merges]
    finally:
        for h in honest:
            h.close()
