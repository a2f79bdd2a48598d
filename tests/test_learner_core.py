"""The learner's sans-I/O core alone: a fake clock, no link, no torch.distributed.

A small driver below plays the part ``RackmendOptimizer`` plays: it holds one local
tensor per fragment, "trains" by subtracting 0.125 per step (exact in binary, so the
expected values are exact), carries out the core's actions and collects them, so the
tests assert on the typed actions and on the values they leave.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import NamedTuple, Sequence

import pytest
import torch

from rackmend.config import CompressionConfig, LearnerConfig, RackmendConfig, ScheduleConfig
from rackmend.core.fragments import FragmentSpec, TensorSpec, fragment_offsets
from rackmend.core.learner import (
    _TORCH_GRAIN,
    _difference,
    ApplyDue,
    ApplyValue,
    Change,
    ChangeAgreed,
    InnerStepDone,
    JoinedValue,
    LearnerAction,
    LearnerCore,
    Log,
    Offer,
    OffersShared,
    ProbeMeasured,
    Rebase,
    SendFragment,
    SetValue,
    ShareChanges,
    SnapshotTaken,
    SpreadValue,
    TakeSnapshot,
    TrainingResumed,
    WaitAnswered,
    WaitForVersion,
)
from rackmend.core.assembly import assemble
from rackmend.core.messages import Contribution, Update
from rackmend.core.pieces import Piece, RankLayout, cover_problem, plain_layout, rank_layout, whole_pieces

N = 3  # elements per fragment tensor
LR = 0.125  # local "training": every step subtracts this from every element
TOKENS = 8.0


def cfg(*, H: int = 4, P: int = 1, tau: int = 1, apply: str = "auto", deterministic: bool = False,
        uplink: str = "none") -> RackmendConfig:
    return RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau),
                          learner=LearnerConfig(apply=apply), deterministic=deterministic,
                          compression=CompressionConfig(uplink=uplink))


def full(x: float) -> torch.Tensor:
    return torch.full((N,), x)


class Sent(NamedTuple):
    """A send as the driver built it."""

    contribution: Contribution
    nbytes: int


class Rack:
    """A driver of one rank's core with a fake clock. By default each fragment is one
    tensor of N elements, all ``start``; ``specs``, ``layout`` (this rank's blocks) and
    ``values`` (the global value of each fragment's tensors at join) describe others."""

    def __init__(self, config: RackmendConfig, *, rank: int = 0, world_size: int = 1, start: float = 0.0,
                 specs: Sequence[FragmentSpec] | None = None, layout: RankLayout | None = None,
                 values: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        sch = config.schedule
        offsets = fragment_offsets(sch.num_fragments, sch.sync_every)
        self.specs = list(specs or [FragmentSpec(p, offsets[p], (TensorSpec(f"w{p}", (N,), torch.float32),))
                                    for p in range(sch.num_fragments)])
        self.core = LearnerCore(config, self.specs, learner_id="a", rank=rank, world_size=world_size, layout=layout)
        values = values or [[torch.full(t.shape, start) for t in spec.tensors] for spec in self.specs]
        self.local = [[v[b.slices()].clone() if b is not None else v.new_empty(0) for v, b in zip(vs, blocks)]
                      for vs, blocks in zip(values, self.core.layout.blocks)]
        """Per fragment, this rank's block of each tensor."""
        self.clock = 100.0
        self.sent: list[Sent] = []
        self.keep_elsewhere = False
        """Answer ``keep`` snapshots with a separate ``at_send`` copy (as a CUDA driver does)."""
        self.defer_builds = False
        """Keep sends unbuilt in ``deferred`` (as a driver building them on another thread)."""
        self.deferred: list[SendFragment] = []
        for p in range(len(self.specs)):
            joined = Update(p, 0, tuple(t.clone() for t in self.local[p]))
            acts = self.run(self.core.handle(JoinedValue(joined), self.clock))
            assert [type(a) for a in acts] == [SetValue]

    def train(self) -> None:
        """One inner step's change of the local values."""
        for pieces in self.local:
            for t in pieces:
                t.sub_(LR)

    def run(self, actions: Sequence[LearnerAction]) -> list[LearnerAction]:
        """Carry out ``actions``; returns them with those their answers produced, in order."""
        out: list[LearnerAction] = []
        for a in actions:
            out.append(a)
            if isinstance(a, TakeSnapshot):
                snap = [t.clone() for t in self.local[a.fragment]]
                at_send = [t.clone() for t in snap] if self.keep_elsewhere and a.keep else None
                out += self.run(self.core.handle(SnapshotTaken(a.fragment, snap, at_send), self.clock))
                if at_send is not None:
                    for t in snap:  # a reused (pinned) buffer: overwritten before the apply
                        t.fill_(math.nan)
            elif isinstance(a, (SetValue, Rebase, ApplyValue)):
                a.apply_to(self.local[a.fragment])
            elif isinstance(a, SendFragment):
                if self.defer_builds:
                    self.deferred.append(a)
                else:
                    self.sent.append(Sent(*a.build()))
        return out

    def step(self, arrived: Sequence[Update] = (), *, dt: float = 0.5, overhead: float = 0.0) -> list[LearnerAction]:
        """One inner step of ``dt`` seconds, then rackmend's bookkeeping taking ``overhead``."""
        self.clock += dt
        self.train()
        out = self.run(self.core.handle(InnerStepDone(TOKENS, tuple(arrived)), self.clock))
        out += self.run(self.core.handle(ApplyDue(), self.clock))
        if not any(isinstance(a, WaitForVersion) for a in out):
            self.resume(overhead)
        return out

    def resume(self, overhead: float = 0.0) -> None:
        self.clock += overhead
        assert self.core.handle(TrainingResumed(), self.clock) == []

    def steps(self, n: int) -> list[list[LearnerAction]]:
        return [self.step() for _ in range(n)]


def of(actions: Sequence[LearnerAction], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def shared(rack: Rack, share: ShareChanges, **others: tuple[Offer | None, ...]) -> list[SpreadValue]:
    """Answer ``share`` as the driver's all-gather would, the other ranks' offers given
    as ``r<rank>=...``; returns the changes the core decides on."""
    table = tuple(share.offers if r == rack.core.rank else others[f"r{r}"] for r in range(rack.core.world_size))
    acts = rack.core.handle(OffersShared(table), rack.clock)
    assert all(isinstance(a, (SpreadValue, Log)) for a in acts), acts
    return of(acts, SpreadValue)


# ---------------------------------------------------------------------- the schedule
def test_fragments_are_due_on_their_offsets() -> None:
    rack = Rack(cfg(H=4, P=2, tau=1))
    per_step = rack.steps(8)
    snapshots = {t + 1: [a.fragment for a in of(acts, TakeSnapshot)] for t, acts in enumerate(per_step)}
    # Offsets t_p = p * H / P = 0, 2: fragment 1 after steps 2 and 6, fragment 0 after 4 and 8.
    assert snapshots == {1: [], 2: [1], 3: [], 4: [0], 5: [], 6: [1], 7: [], 8: [0]}
    assert [(s.contribution.fragment, s.contribution.step) for s in rack.sent] == [(1, 2), (0, 4), (1, 6), (0, 8)]


def test_contribution_carries_outer_gradient_and_counters() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1), start=1.0)
    rack.steps(4)
    (send,) = rack.sent
    c = send.contribution
    # Delta = held - local = 1 - (1 - 4 * 0.125).
    assert torch.equal(c.tensors[0], full(4 * LR))
    assert (c.fragment, c.base_version, c.step, c.c_steps, c.c_tokens) == (0, 0, 4, 4, 4 * TOKENS)
    # The first step has no start to measure from: 0 + 3 x 0.5 s over 4 steps.
    assert c.step_time == pytest.approx(1.5 / 4)
    assert (c.rank_steps, c.rank_step_time) == (3, 0.5)
    assert send.nbytes == N * 4 and c.encoded is None


def test_step_time_excludes_rackmends_own_time() -> None:
    rack = Rack(cfg(H=2, P=1, tau=1))
    for dt, overhead in ((0.5, 9.0), (0.25, 9.0), (0.75, 9.0), (1.0, 9.0)):
        rack.step(dt=dt, overhead=overhead)
    first, second = (s.contribution for s in rack.sent)
    assert (first.rank_steps, first.rank_step_time) == (1, 0.25)
    # Rank step times restart after each contribution; the overhead never counts.
    assert (second.rank_steps, second.rank_step_time) == (2, pytest.approx(0.875))


# ---------------------------------------------------------------------- applying values
@pytest.mark.parametrize("rule,expected", [
    ("overwrite", 1.0),                           # theta <- merged
    ("keep_local", 1.0 + (-6 * LR - -4 * LR)),    # merged + progress since the send (steps 5, 6)
    ("mix", 0.5 * -6 * LR + 0.5 * 1.0),           # alpha * theta + (1 - alpha) * merged
])
def test_value_applies_at_t_send_plus_tau_by_rule(rule: str, expected: float) -> None:
    rack = Rack(cfg(H=4, P=1, tau=2, apply=rule))
    rack.steps(4)  # sent after step 4
    assert rack.core.in_flight() == (0,)
    merged = Update(0, 1, (full(1.0),))
    step5 = rack.step([merged])  # arrives now, applies only at t_send + tau = 6
    assert not of(step5, ApplyValue) and rack.core.fragments[0].arrived is merged
    (apply,) = of(rack.step(), ApplyValue)
    assert (apply.fragment, apply.rule, apply.update) == (0, rule, merged)
    if rule == "keep_local":
        assert apply.at_send is not None and torch.equal(apply.at_send[0], full(-4 * LR))
    else:
        assert apply.at_send is None
    assert torch.equal(rack.local[0][0], full(expected))
    f = rack.core.fragments[0]
    assert (f.version, f.in_flight, f.arrived, f.version_lag) == (1, None, None, 0)
    assert torch.equal(f.held[0], full(1.0))


def test_keep_local_applies_with_the_copy_kept_apart_from_the_snapshot() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1, apply="keep_local"))
    rack.keep_elsewhere = True  # the snapshot buffer is overwritten right after the send
    rack.steps(4)
    (apply,) = of(rack.step([Update(0, 1, (full(1.0),))]), ApplyValue)
    assert torch.equal(apply.at_send[0], full(-4 * LR))
    assert torch.equal(rack.local[0][0], full(1.0 + (-5 * LR - -4 * LR)))


def test_an_at_send_copy_of_another_shape_is_refused() -> None:
    rack = Rack(cfg(H=2, P=1, tau=1, apply="keep_local"))
    rack.step()
    rack.train()
    (take,) = of(rack.core.handle(InnerStepDone(TOKENS, ()), rack.clock), TakeSnapshot)
    snap = [t.clone() for t in rack.local[0]]
    with pytest.raises(ValueError, match="at_send has shapes"):
        rack.core.handle(SnapshotTaken(take.fragment, snap, [torch.zeros(N + 1)]), rack.clock)


@pytest.mark.parametrize("rule", ["overwrite", "keep_local"])
def test_counters_after_apply_and_in_the_next_send(rule: str) -> None:
    rack = Rack(cfg(H=4, P=1, tau=1, apply=rule))
    rack.steps(4)
    rack.step([Update(0, 1, (full(0.0),))])  # applied at step 5
    f = rack.core.fragments[0]
    # overwrite drops the step made since the send; keep_local keeps it and counts it.
    kept = 1 if rule == "keep_local" else 0
    assert (f.c_steps, f.c_tokens) == (kept, kept * TOKENS)
    rack.steps(3)
    c = rack.sent[-1].contribution
    assert (c.step, c.base_version, c.c_steps, c.c_tokens) == (8, 1, 3 + kept, (3 + kept) * TOKENS)


def test_late_value_applies_on_the_first_step_after_it_arrives() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1, apply="keep_local"))
    rack.steps(4)
    assert not of(rack.step(), ApplyValue) and not of(rack.step(), ApplyValue)  # t_send + tau passed, nothing here
    assert rack.core.in_flight() == (0,)
    (apply,) = of(rack.step([Update(0, 1, (full(2.0),))]), ApplyValue)  # step 7
    assert apply.fragment == 0 and rack.core.in_flight() == ()
    assert torch.equal(rack.local[0][0], full(2.0 + (-7 * LR - -4 * LR)))


def test_newest_value_wins_and_old_ones_are_ignored_with_a_log_line() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1))
    rack.steps(4)
    acts = rack.step([Update(0, 2, (full(2.0),)), Update(0, 1, (full(1.0),)), Update(0, 0, (full(9.0),))])
    (apply,) = of(acts, ApplyValue)
    assert apply.update.version == 2
    assert rack.core.fragments[0].version_lag == 1  # version 1 was skipped
    (line,) = of(acts, Log)
    assert line.level == logging.DEBUG and "version 0" in line.message


def test_value_for_a_fragment_not_sent_waits_for_its_send() -> None:
    rack = Rack(cfg(H=4, P=2, tau=1))
    early = Update(0, 1, (full(1.0),))
    assert not of(rack.step([early]), ApplyValue)  # fragment 0 leaves after step 4
    rack.steps(2)
    acts = rack.step()  # step 4: sent, based on version 0 (the syncer re-anchors it)
    assert rack.sent[-1].contribution.base_version == 0 and not of(acts, ApplyValue)
    (apply,) = of(rack.step(), ApplyValue)
    assert apply.update is early


# ---------------------------------------------------------------------- deterministic mode
def test_deterministic_mode_waits_at_t_send_plus_tau() -> None:
    config = cfg(H=4, P=1, tau=1, deterministic=True)
    rack = Rack(config)
    rack.steps(4)
    acts = rack.step()
    (wait,) = of(acts, WaitForVersion)
    assert acts[-1] is wait
    assert (wait.fragment, wait.after_version, wait.deadline) == (0, 0, rack.clock + config.learner.wait_timeout)
    with pytest.raises(RuntimeError, match="waits for fragment 0"):
        rack.core.handle(WaitAnswered(1, Update(1, 1, (full(1.0),))), rack.clock)
    # A wait the driver gave up on (it raised) is asked again at the next step.
    (again,) = of(rack.step(), WaitForVersion)
    assert (again.fragment, again.after_version, again.deadline) == (0, 0, rack.clock + config.learner.wait_timeout)
    rack.clock += 3.0
    merged = Update(0, 1, (full(1.0),))
    (apply,) = rack.run(rack.core.handle(WaitAnswered(0, merged), rack.clock))
    assert isinstance(apply, ApplyValue) and apply.rule == "overwrite" and apply.update is merged
    assert torch.equal(rack.local[0][0], full(1.0))
    rack.resume()
    assert rack.core.fragments[0].c_steps == 0 and rack.core.in_flight() == ()


def test_deterministic_wait_answered_by_a_rejoin_value_rebases() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1, deterministic=True))
    rack.steps(4)
    rack.step()
    reset = Update(0, 5, (full(3.0),), reset=True, epoch=7)
    (rebase,) = rack.run(rack.core.handle(WaitAnswered(0, reset), rack.clock))
    assert isinstance(rebase, Rebase)
    assert torch.equal(rack.local[0][0], full(3.0 - 5 * LR))
    f = rack.core.fragments[0]
    assert (f.version, f.epoch, f.in_flight) == (5, 7, None)


# ---------------------------------------------------------------------- rejoin
def test_reset_value_rebases_local_progress_before_the_send() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1))
    rack.steps(3)
    reset = Update(0, 6, (full(2.0),), reset=True, epoch=3)
    acts = rack.step([reset])  # step 4: adopted first, then the send is based on it
    assert [type(a) for a in acts] == [Rebase, TakeSnapshot, SendFragment]
    rebase = acts[0]
    assert torch.equal(rebase.old[0], full(0.0)) and torch.equal(rebase.new[0], full(2.0))
    assert torch.equal(rack.local[0][0], full(2.0 - 4 * LR))
    c = rack.sent[-1].contribution
    assert (c.base_version, c.base_epoch) == (6, 3)
    assert torch.equal(c.tensors[0], full(4 * LR))


def test_reset_with_the_value_held_changes_nothing_but_the_epoch() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1))
    rack.steps(4)
    acts = rack.step([Update(0, 0, (full(0.0),), reset=True, epoch=4)])
    assert not of(acts, Rebase) and not of(acts, ApplyValue)
    f = rack.core.fragments[0]
    assert (f.version, f.epoch, f.in_flight) == (0, 4, None)  # the send is forgotten by the syncer
    assert torch.equal(rack.local[0][0], full(-5 * LR))


def test_restored_state_rebases_onto_a_newer_joined_value() -> None:
    config = cfg(H=4, P=2, tau=1, uplink="int8")
    before = Rack(config)
    before.steps(6)
    saved = before.core.state_dict()
    assert saved["uplink"], "the int8 uplink's residuals are part of the state"
    # The learner restarts; meanwhile fragment 0 moved on at the syncer, fragment 1 did not.
    after = Rack(config)
    after.run(after.core.handle(JoinedValue(Update(0, 3, (full(1.0),))), after.clock))
    rebases = after.core.load_state_dict(saved)
    assert [(r.fragment, float(r.old[0][0]), float(r.new[0][0])) for r in rebases] == [(0, 0.0, 1.0)]
    f0, f1 = after.core.fragments
    assert (f0.version, f1.version, after.core.step, f0.c_steps) == (3, 0, 6, 6)
    assert after.core.in_flight() == ()
    with pytest.raises(ValueError, match="entries per fragment"):
        Rack(cfg(H=4, P=3, tau=1, uplink="int8")).core.load_state_dict(saved)


# ---------------------------------------------------------------------- what rides along
def test_merge_gain_rides_with_the_next_contribution_once() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1))
    rack.steps(4)
    rack.step([Update(0, 1, (full(1.0),))])
    assert rack.core.handle(ProbeMeasured(0, before=2.0, after=1.5), rack.clock) == []
    assert rack.core.fragments[0].merge_gain == 0.25
    rack.steps(3)
    rack.step([Update(0, 2, (full(1.0),))])
    rack.core.handle(ProbeMeasured(0, before=2.0, after=math.nan), rack.clock)  # not finite: kept, not sent
    rack.steps(3)
    assert [s.contribution.merge_gain for s in rack.sent] == [None, 0.25, None]
    assert math.isnan(rack.core.fragments[0].merge_gain)


def test_lossy_uplink_sends_what_the_syncer_will_merge() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1, uplink="int8"))
    rack.local[0][0].copy_(torch.tensor([0.3, -0.2, 0.01]))
    rack.steps(4)
    send = rack.sent[-1]
    (enc,) = send.contribution.encoded
    assert send.nbytes == enc.nbytes() < N * 4
    decoded = send.contribution.tensors[0]
    exact = -(torch.tensor([0.3, -0.2, 0.01]) - 4 * LR)
    assert not torch.equal(decoded, exact) and torch.allclose(decoded, exact, atol=0.01)


def test_a_send_built_later_equals_one_built_at_once() -> None:
    """A driver may build a send on another thread, after the core has moved on: new
    values applied (the held value replaced), later sends made. The build must give the
    bits of one made at once, error feedback of a lossy codec included; and only once."""
    config = cfg(H=2, P=2, tau=1, uplink="int8")
    now, later = Rack(config), Rack(config)
    later.defer_builds = True
    for rack in (now, later):
        rack.local[0][0].copy_(torch.tensor([0.3, -0.2, 0.01]))
        rack.local[1][0].copy_(torch.tensor([-0.7, 0.05, 0.4]))
    for t in range(1, 13):
        # A merged value of the fragment sent at the previous step (offsets 0 and 1).
        p = t % 2
        arrived = [Update(p, t, (full(0.1 * t) + torch.tensor([0.0, 0.3, -0.2]),))] if t > 2 else []
        for rack in (now, later):
            rack.step([Update(u.fragment, u.version, tuple(x.clone() for x in u.tensors)) for u in arrived])
    assert len(later.deferred) == len(now.sent) == 12 and later.core.fragments[0].version > 1
    for action, sent in zip(later.deferred, now.sent):
        got, nbytes = action.build()
        want = sent.contribution
        assert replace(got, tensors=(), encoded=None) == replace(want, tensors=(), encoded=None)
        assert nbytes == sent.nbytes
        assert all(torch.equal(x, y) for x, y in zip(got.tensors, want.tensors, strict=True))
        for x, y in zip(got.encoded or (), want.encoded or (), strict=True):
            assert (x.codec, x.shape, x.params) == (y.codec, y.shape, y.params)
            assert all(torch.equal(a, b) for a, b in zip(x.frames, y.frames, strict=True)), "the codec's output differs"
    with pytest.raises(RuntimeError, match="built twice"):
        later.deferred[0].build()


# ---------------------------------------------------------------------- several ranks
def test_ranks_split_fragments_and_agree_on_changes() -> None:
    rack = Rack(cfg(H=4, P=2, tau=1), rank=1, world_size=2)
    assert [rack.core.owns(p) for p in range(2)] == [False, True]
    acts = [a for _ in range(4) for a in rack.step()]
    # Rank 1 sends fragment 1 only; fragment 0 is tracked, for its owner's send.
    assert [a.draft.fragment for a in of(acts, SendFragment)] == [1]
    c = rack.sent[0].contribution
    assert (c.rank, c.c_tokens) == (1, 2 * 2 * TOKENS)  # the learner's tokens: x world size
    assert rack.core.in_flight() == (0, 1)
    mine = Update(1, 1, (full(1.0),))
    share = of(rack.step([mine]), ShareChanges)[-1]
    # Fragment 1 left after step 2, fragment 0 (rank 0's) after step 4: both due at 5.
    assert share.offers == (None, Offer(Change.APPLY, ((1, 0),)))
    spreads = shared(rack, share, r0=(Offer(Change.APPLY, ((1, 0),)), None))
    assert spreads == [SpreadValue(0, Change.APPLY, 1, 0, None), SpreadValue(1, Change.APPLY, 1, 0, mine)]
    theirs = Update(0, 1, (full(2.0),))
    (apply,) = rack.run(rack.core.handle(ChangeAgreed(0, Change.APPLY, theirs), rack.clock))
    assert apply.fragment == 0
    (apply,) = rack.run(rack.core.handle(ChangeAgreed(1, Change.APPLY, mine), rack.clock))
    assert isinstance(apply, ApplyValue) and torch.equal(rack.local[1][0], full(1.0 - 3 * LR))
    assert rack.core.in_flight() == ()
    # A newer value, not due: offered, but a lone owner has nobody to converge with.
    (share,) = of(rack.step([Update(1, 2, (full(3.0),))]), ShareChanges)
    assert share.offers == (None, Offer(Change.NONE, ((2, 0),)))
    assert shared(rack, share, r0=(Offer(Change.NONE), None)) == [] and rack.core.fragments[1].pin is None


def test_ranks_adopt_a_rejoin_value_together() -> None:
    rack = Rack(cfg(H=4, P=2, tau=1), rank=0, world_size=2)
    reset = Update(0, 4, (full(1.0),), reset=True, epoch=2)
    acts = rack.step([reset])
    assert not of(acts, Rebase)  # not on one rank alone
    (share,) = of(acts, ShareChanges)
    assert share.offers == (Offer(Change.ADOPT, ((4, 2),)), None)
    assert shared(rack, share, r1=(None, Offer(Change.NONE))) == [SpreadValue(0, Change.ADOPT, 4, 2, reset)]
    (rebase,) = rack.run(rack.core.handle(ChangeAgreed(0, Change.ADOPT, reset), rack.clock))
    assert isinstance(rebase, Rebase) and torch.equal(rack.local[0][0], full(1.0 - LR))


def test_ranks_in_deterministic_mode_wait_then_share() -> None:
    rack = Rack(cfg(H=4, P=2, tau=1, deterministic=True), rank=0, world_size=2)
    rack.steps(4)
    (wait,) = of(rack.step(), WaitForVersion)
    assert wait.fragment == 0
    mine = Update(0, 1, (full(1.0),))
    (share,) = rack.core.handle(WaitAnswered(0, mine), rack.clock)
    assert isinstance(share, ShareChanges) and share.offers == (Offer(Change.APPLY, ((1, 0),)), None)


# ---------------------------------------------------------------------- sharded ranks
def hsdp_rack(P: int) -> tuple[list[FragmentSpec], list[list[tuple[Piece, Piece]]]]:
    """Fragments of a (4, 3) weight and a (3,) bias, and the blocks each of 4 ranks holds
    under HSDP (2 shards x 2 replicas): ranks 0 and 2 hold rows 0-1 of the weight, ranks
    1 and 3 rows 2-3; every rank holds the whole bias."""
    offsets = fragment_offsets(P, 4)
    specs = [FragmentSpec(p, offsets[p], (TensorSpec(f"w{p}", (4, 3), torch.float32),
                                          TensorSpec(f"b{p}", (3,), torch.float32))) for p in range(P)]
    rows = [0, 2, 0, 2]
    rack = [[(Piece(0, (rows[r], 0), (2, 3)), Piece(1, (0,), (3,))) for _ in specs] for r in range(4)]
    return specs, rack


def global_values(specs: Sequence[FragmentSpec]) -> list[list[torch.Tensor]]:
    """A different integer in every element, so a misplaced block shows."""
    return [[torch.arange(t.numel, dtype=torch.float32).reshape(t.shape) + 100 * (spec.index * 2 + i)
             for i, t in enumerate(spec.tensors)] for spec in specs]


class Halving(Rack):
    """Local training that halves every element: the outer gradient differs per element."""

    def train(self) -> None:
        for pieces in self.local:
            for t in pieces:
                t.mul_(0.5)


def test_sharded_owner_rule_gives_each_block_exactly_one_owner() -> None:
    specs, rack = hsdp_rack(P=2)
    layouts = [rank_layout(specs, rack, r) for r in range(4)]
    w_top, w_bottom, b = Piece(0, (0, 0), (2, 3)), Piece(0, (2, 0), (2, 3)), Piece(1, (0,), (3,))
    # Of the ranks holding a block, the (p mod holders)-th owns it in fragment p: the
    # replicas take turns, as the ranks of a plain rack take turns with fragments.
    assert [lay.owned for lay in layouts] == [
        ((w_top, b), ()),
        ((w_bottom,), (b,)),
        ((), (w_top,)),
        ((), (w_bottom,)),
    ]
    assert all(lay.sharded for lay in layouts)
    assert layouts[1].blocks == ((w_bottom, b), (w_bottom, b))
    assert cover_problem(specs, [lay.owned for lay in layouts]) is None
    # A plain rack (every rank holds every tensor whole) is the same rule's striping.
    whole = [[tuple(Piece(i, (0,) * len(t.shape), t.shape) for i, t in enumerate(s.tensors)) for s in specs]] * 3
    for r in range(3):
        assert rank_layout(specs, whole, r) == plain_layout(specs, r, 3)
        assert plain_layout(specs, r, 3).owned == whole_pieces(specs, r, 3)
        assert not plain_layout(specs, r, 3).sharded


def test_sharded_ranks_send_owned_pieces_that_assemble_to_the_single_process_outer_gradient() -> None:
    specs, rack = hsdp_rack(P=2)
    config = cfg(H=4, P=2, tau=1)
    ranks = [Halving(config, rank=r, world_size=4, specs=specs, layout=rank_layout(specs, rack, r),
                     values=global_values(specs)) for r in range(4)]
    single = Halving(config, specs=specs, values=global_values(specs))
    for _ in range(4):
        for rank in [*ranks, single]:
            # Every rank takes part in ShareChanges (none is due to change here).
            assert all(o is None or o == Offer(Change.NONE) for a in of(rank.step(), ShareChanges) for o in a.offers)
    for p in range(2):
        sends = [(r, s) for r, rank in enumerate(ranks) for s in rank.sent if s.contribution.fragment == p]
        (whole,) = [s for s in single.sent if s.contribution.fragment == p]
        owners = [r for r in range(4) if ranks[r].core.layout.owned[p]]
        assert [r for r, _ in sends] == owners  # each owner once, nobody else
        for r, s in sends:
            c = s.contribution
            assert c.pieces == ranks[r].core.layout.owned[p] and c.rank == r
            assert s.nbytes == sum(pc.numel for pc in c.pieces) * 4
            assert (c.step, c.c_steps, c.base_version) == (whole.contribution.step, whole.contribution.c_steps, 0)
        assembled = assemble(specs[p], [(s.contribution.pieces, s.contribution.tensors) for _, s in sends])
        assert whole.contribution.pieces is None
        for got, want in zip(assembled, whole.contribution.tensors):
            assert torch.equal(got, want)
        # Not uniform: a block in the wrong place would differ.
        assert len(set(assembled[0].flatten().tolist())) == 12
    # A rank owning nothing of a fragment tracks its round for the owners' send.
    assert ranks[3].core.in_flight() == (0, 1) and not ranks[3].core.owns(0)


def test_sharded_change_waits_for_every_owner_and_keeps_the_offer() -> None:
    specs, rack = hsdp_rack(P=1)
    config = cfg(H=4, P=1, tau=1, apply="overwrite")
    rank = Rack(config, rank=1, world_size=4, specs=specs, layout=rank_layout(specs, rack, 1), start=1.0)
    rank.steps(4)
    (sent,) = rank.sent
    assert sent.contribution.pieces == (Piece(0, (2, 0), (2, 3)),)  # rank 0 owns the bias
    mine = Update(0, 1, (torch.full((2, 3), 5.0),))  # the syncer sends rank 1 its piece only
    (share,) = of(rank.step([mine]), ShareChanges)
    assert share.offers == (Offer(Change.APPLY, ((1, 0),)),)
    # Rank 0, another owner, has received nothing yet: nothing changes. The offer stays.
    assert shared(rank, share, r0=(Offer(Change.NONE),), r2=(None,), r3=(None,)) == []
    (share,) = of(rank.step(), ShareChanges)
    assert share.offers == (Offer(Change.APPLY, ((1, 0),)),)
    assert rank.core.fragments[0].version == 0
    (spread,) = shared(rank, share, r0=(Offer(Change.APPLY, ((1, 0),)),), r2=(None,), r3=(None,))
    assert spread == SpreadValue(0, Change.APPLY, 1, 0, mine)
    # Agreed: the owners' values as this rank holds them (its block of each tensor).
    agreed = Update(0, 1, (torch.full((2, 3), 5.0), torch.full((3,), 7.0)))
    (apply,) = rank.run(rank.core.handle(ChangeAgreed(0, Change.APPLY, agreed), rank.clock))
    assert isinstance(apply, ApplyValue)
    assert torch.equal(rank.local[0][0], torch.full((2, 3), 5.0)) and torch.equal(rank.local[0][1], full(7.0))
    assert rank.core.fragments[0].version == 1
    (share,) = of(rank.step(), ShareChanges)
    assert share.offers == (Offer(Change.NONE),)


def test_sharded_layout_mistakes_raise() -> None:
    specs, rack = hsdp_rack(P=1)
    layout = rank_layout(specs, rack, 1)
    with pytest.raises(ValueError, match="not this rank's block"):
        LearnerCore(cfg(H=4, P=1), specs, learner_id="a", rank=1, world_size=4,
                    layout=RankLayout(layout.blocks, rank_layout(specs, rack, 0).owned, True))
    with pytest.raises(ValueError, match="world_size >= 2"):
        LearnerCore(cfg(H=4, P=1), specs, learner_id="a", layout=layout)
    with pytest.raises(ValueError, match="blocks for"):
        LearnerCore(cfg(H=4, P=1), specs, learner_id="a", rank=1, world_size=4,
                    layout=RankLayout(((layout.blocks[0][0],),), ((),), True))
    rank = Rack(cfg(H=4, P=1, tau=1), rank=1, world_size=4, specs=specs, layout=layout)
    rank.steps(3)
    rank.clock += 1
    rank.train()
    (snap,) = of(rank.core.handle(InnerStepDone(TOKENS), rank.clock), TakeSnapshot)
    with pytest.raises(ValueError, match=r"shape \[4, 3\], this rank holds \[2, 3\]"):
        rank.core.handle(SnapshotTaken(0, [torch.zeros(4, 3), torch.zeros(3)]), rank.clock)


def test_a_saved_state_of_another_rank_or_sharding_is_refused() -> None:
    """A sharded rack's learner state is per rank. Under even sharding another rank's
    state has the same shapes and would put its blocks' values in this rank's places
    without an error: the saved blocks are compared, and a replica's state (the same
    blocks) is accepted, unless it carries an uplink codec's residuals for pieces this
    rank does not send. A state without blocks (saved before they were kept) is
    checked by its shapes."""
    specs, rack = hsdp_rack(P=1)
    ranks = [Rack(cfg(H=4, P=1), rank=r, world_size=4, specs=specs, layout=rank_layout(specs, rack, r),
                  values=global_values(specs)) for r in range(4)]
    saved = ranks[0].core.state_dict()
    with pytest.raises(ValueError, match=r"saved by rank 0 of 4: of w0 \(fragment 0\) it holds the block at \[0, 0\] "
                                         r"of shape \[2, 3\], this rank \(rank 1 of 4\) holds at \[2, 0\] of shape"):
        ranks[1].core.load_state_dict(saved)
    assert ranks[2].core.load_state_dict(saved) == []  # rank 2 holds rank 0's blocks (HSDP replicas)
    single = Rack(cfg(H=4, P=1), specs=specs, values=global_values(specs)).core.state_dict()
    with pytest.raises(ValueError, match=r"saved by rank 0 of 1: .* block at \[0, 0\] of shape \[4, 3\]"):
        ranks[3].core.load_state_dict(single)
    # A replica's state with an uplink codec's residuals: rank 0 sends the pieces of the
    # block it shares with rank 2, whose own residuals would be lost.
    lossy = [Rack(cfg(H=4, P=1, uplink="int8"), rank=r, world_size=4, specs=specs, layout=rank_layout(specs, rack, r),
                  values=global_values(specs)) for r in (0, 2)]
    lossy[0].steps(4)
    assert lossy[0].core.state_dict()["uplink"], "no residuals to check"
    with pytest.raises(ValueError, match=r"saved by rank 0 of 4, which sends other pieces than this rank \(rank 2\)"):
        lossy[1].core.load_state_dict(lossy[0].core.state_dict())
    older = {k: v for k, v in single.items() if k not in ("blocks", "owned", "rank", "world_size")}
    with pytest.raises(ValueError, match=r"saved by another rank or sharding: .* block of shape \[4, 3\], this rank "
                                         r"\(rank 3 of 4\) holds of shape \[2, 3\]"):
        ranks[3].core.load_state_dict(older)


# ---------------------------------------------------------------------- owners holding other versions
class Fsdp:
    """Both ranks of a rack holding one (4, 3) tensor as FSDP does (rank 0 rows 0-1, rank 1
    rows 2-3: each owns its block), stepped in lockstep. The test plays the driver's
    collectives: the all-gather of the offers, and the spread (a block with one holder:
    each rank's value is its own pieces)."""

    def __init__(self, config: RackmendConfig) -> None:
        specs = [FragmentSpec(0, 0, (TensorSpec("w", (4, 3), torch.float32),))]
        blocks = [[(Piece(0, (2 * r, 0), (2, 3)),)] for r in range(2)]
        self.ranks = [Rack(config, rank=r, world_size=2, specs=specs, layout=rank_layout(specs, blocks, r))
                      for r in range(2)]
        self.logs: list[list[Log]] = [[], []]

    def step(self, got0: Sequence[Update] = (), got1: Sequence[Update] = ()) -> list[tuple[Change, int, int]]:
        """One step; ``got<r>``: what rank r's link delivered. Returns what changed, the
        same on both ranks: (change, version, epoch)."""
        shares = [of(rank.step(got), ShareChanges) for rank, got in zip(self.ranks, (got0, got1))]
        assert [len(s) for s in shares] == [1, 1]
        table = tuple(s[0].offers for s in shares)
        changed = []
        for r, rank in enumerate(self.ranks):
            acts = rank.core.handle(OffersShared(table), rank.clock)
            self.logs[r] += of(acts, Log)
            spreads = of(acts, SpreadValue)
            changed.append([(a.change, a.version, a.epoch) for a in spreads])
            for a in spreads:
                upd = Update(0, a.version, a.update.tensors, reset=a.change == Change.ADOPT, epoch=a.epoch)
                rank.run(rank.core.handle(ChangeAgreed(0, a.change, upd), rank.clock))
        assert changed[0] == changed[1], changed
        assert all(len(o.values) <= 2 for row in table for o in row if o is not None)  # the memory bound
        return changed[0]

    def local(self) -> list[float]:
        """Each rank's value (uniform per rank here)."""
        return [float(rank.local[0][0][0, 0]) for rank in self.ranks]


def val(version: int, epoch: int = 0, reset: bool = False) -> Update:
    """A rank's block of the merged value of this version: every element = version."""
    return Update(0, version, (torch.full((2, 3), float(version)),), reset=reset, epoch=epoch)


def test_owners_polling_versions_apart_apply_the_pinned_value_together_at_t_send_plus_tau() -> None:
    """Rank 1 polls after rank 0, so its link has always delivered a version more. The
    owners pin the newest value either holds and apply it on both at t_send + tau (a rule
    of "the same newest value on every owner" would never apply anything here)."""
    rack = Fsdp(cfg(H=4, P=1, tau=2, apply="overwrite"))
    for _ in range(4):
        assert rack.step() == []
    assert [r.core.in_flight() for r in rack.ranks] == [(0,), (0,)]  # sent after step 4, due at 6
    assert rack.step([val(1)], [val(1), val(2)]) == []  # not due: version 2 pinned
    assert [r.core.fragments[0].pin for r in rack.ranks] == [(2, 0), (2, 0)]
    assert rack.step([val(2), val(3)], [val(3), val(4)]) == [(Change.APPLY, 2, 0)]
    assert rack.local() == [2.0, 2.0] and [r.core.fragments[0].version for r in rack.ranks] == [2, 2]
    # The newer values stay for the next send's round (sent after step 8, due at 10).
    assert [r.core.fragments[0].arrived.version for r in rack.ranks] == [3, 4]
    assert rack.step() == [] and rack.step() == []
    assert rack.step([val(4), val(5)], [val(5)]) == []
    assert rack.step() == [(Change.APPLY, 5, 0)]
    assert rack.local() == [5.0, 5.0]
    assert rack.logs == [[], []]


def test_a_pin_one_rank_skipped_is_replaced_by_the_newest() -> None:
    """A link that fell behind gets only the newest value (the syncer's outbox replaces
    unsent ones): a rank that received a version past the pin without it never will, so
    the owners pin the newest again (logged at debug level) and agree on it."""
    rack = Fsdp(cfg(H=4, P=1, tau=1, apply="overwrite"))
    for _ in range(4):
        rack.step()
    assert rack.step([val(1)], [val(2)]) == []  # due: no value in common, 2 pinned
    assert rack.step([val(3)], [val(4)]) == []  # rank 0 skipped 2: 4 pinned
    assert [r.core.fragments[0].pin for r in rack.ranks] == [(4, 0), (4, 0)]
    assert any("skipped" in log.message and log.level == logging.DEBUG for log in rack.logs[0])
    assert rack.step([val(4)], []) == [(Change.APPLY, 4, 0)]
    assert rack.local() == [4.0, 4.0]


def test_owners_split_for_a_whole_period_log_a_warning_naming_the_rank_behind() -> None:
    """A rank whose link delivers nothing holds the rack back (it cannot apply what that
    rank lacks); after sync_every steps due without a value in common, one rank of the
    rack logs a warning naming the ranks, their versions and the pin, and again only once
    the split has lasted three times as long."""
    rack = Fsdp(cfg(H=4, P=1, tau=1, apply="overwrite"))
    for _ in range(4):
        rack.step()
    assert rack.step([val(1)], []) == []  # due at 5: rank 1 holds nothing yet
    for _ in range(12):  # steps 6 to 17
        assert rack.step() == []
    assert rack.logs[1] == []  # one rank says it
    warnings = [log for log in rack.logs[0] if log.level == logging.WARNING]
    assert len(warnings) == 2  # at step 9 (5 + 4), and at 17 (5 + 3 x 4)
    for words in ("have not held one merged value in common for 4 steps", "rank 0 v1, rank 1 none",
                  "pinned version 1, not yet received by rank(s) [1]", "keeps version 0"):
        assert words in warnings[0].message, warnings[0].message
    assert "for 12 steps" in warnings[1].message
    assert rack.local() == [-17 * LR, -17 * LR]  # nothing applied
    assert rack.step([], [val(1)]) == [(Change.APPLY, 1, 0)]
    assert rack.local() == [1.0, 1.0]


def test_owners_rejoined_versions_apart_adopt_one_value() -> None:
    """The syncer answered the rack's ranks' rejoins versions apart: the owners pin the
    newer answer; the rank with the older one adopts the newer value of the same run as
    well when it arrives, and both rebase onto it at the same step."""
    rack = Fsdp(cfg(H=4, P=1, tau=1))
    assert rack.step([val(4, 2, reset=True)], [val(5, 2, reset=True)]) == []
    assert rack.step([val(5, 2)], [val(6, 2)]) == [(Change.ADOPT, 5, 2)]
    assert rack.local() == [5.0 - 2 * LR, 5.0 - 2 * LR]
    assert [(f.version, f.epoch) for f in (r.core.fragments[0] for r in rack.ranks)] == [(5, 2), (5, 2)]
    # Rank 1's newer value of the run stays, to be applied like any merged value.
    kept = rack.ranks[1].core.fragments[0].arrived
    assert kept is not None and (kept.version, kept.epoch, kept.reset) == (6, 2, False)


def test_a_rejoin_answer_drops_the_value_pinned_before() -> None:
    """A syncer resumed from an older checkpoint answers with a lower version of a new
    run: the value the owners had pinned (of the run before) is dropped, not adopted."""
    rack = Fsdp(cfg(H=4, P=1, tau=1))
    for _ in range(4):
        rack.step()
    assert rack.step([val(1)], [val(1), val(2)]) == []  # due: 2 pinned
    assert rack.step([val(2), val(1, 7, reset=True)], [val(1, 7, reset=True)]) == [(Change.ADOPT, 1, 7)]
    assert rack.local() == [1.0 - 6 * LR, 1.0 - 6 * LR]


def test_gathered_offers_that_cannot_be_this_steps_raise() -> None:
    rack = Fsdp(cfg(H=4, P=1, tau=1))
    rank = rack.ranks[0]
    (share,) = of(rank.step([val(1)]), ShareChanges)
    with pytest.raises(ValueError, match="expected 2 ranks x 1 fragments"):
        rank.core.handle(OffersShared((share.offers,)), rank.clock)
    with pytest.raises(RuntimeError, match="but it offered"):
        rank.core.handle(OffersShared(((Offer(Change.NONE),), share.offers)), rank.clock)


# ---------------------------------------------------------------------- misuse
def test_driver_mistakes_raise() -> None:
    rack = Rack(cfg(H=4, P=1, tau=1))
    with pytest.raises(RuntimeError, match="none was asked for"):
        rack.core.handle(SnapshotTaken(0, [full(0.0)]), rack.clock)
    with pytest.raises(ValueError, match="unknown fragment 5"):
        rack.core.handle(InnerStepDone(TOKENS, (Update(5, 1, (full(0.0),)),)), rack.clock)
    spec = FragmentSpec(1, 0, (TensorSpec("w", (N,), torch.float32),))
    with pytest.raises(ValueError, match="numbered 0..P-1"):
        LearnerCore(cfg(), [spec], learner_id="a")
    with pytest.raises(RuntimeError, match="has not sent"):
        Rack(cfg(H=4, P=2), world_size=2).core.handle(ChangeAgreed(1, Change.APPLY, Update(1, 1, (full(0.0),))), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_outer_gradient_subtraction_has_torchs_bits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    # Whole: NumPy's subtraction for float32/64; every third row and one element: under
    # _TORCH_GRAIN elements, torch's own.
    a = (torch.randn(400, 200, generator=g) * 1e3).to(dtype)
    b = torch.randn(400, 200, generator=g).to(dtype)
    assert a[::3].numel() < _TORCH_GRAIN <= a.numel()
    for x, y in ((a, b), (a.t(), b.t()), (a[::3], b[::3]), (a[0, 0], b[0, 0])):
        got = _difference(x, y)
        assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, x - y)
