"""No work lost without a trace: two pending contributions of one learner, a learner
that leaves with work pending, a syncer that closes with work pending.

The learner interleaving is driven in one thread: real ``RackmendOptimizer``s talk to
a real ``SyncerCore`` through ``StepLink``, which holds each contribution until the
test delivers it, so "arrives after the round closed" is an exact order of events,
not a race. Time is a plain number.
"""

from __future__ import annotations

import time
from typing import Sequence

import pytest
import torch

from rackmend import InProcessSyncer, LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core import (
    Contribution,
    ContributionArrived,
    FinalMerge,
    FragmentSpec,
    LearnerJoined,
    LearnerLeft,
    SendUpdate,
    SyncerCore,
    Tick,
    Update,
    pack_fragments,
)
from rackmend.core.merge import contribution_weight
from rackmend.core.records import Combined, FinalMerged, Merged, Superseded, SyncerRecord
from rackmend.transport.base import LearnerLink

from helpers import batch, make_inner, make_model, train
from test_syncer_core import contrib, events, make_core, merges, N

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ a stepped carrier
class StepHub:
    """A ``SyncerCore`` with a hand-set clock; updates reach learners at once,
    contributions when the test calls ``deliver``."""

    def __init__(self, core: SyncerCore) -> None:
        self.core = core
        self.now = 0.0
        self.links: dict[str, StepLink] = {}
        self.records: list[SyncerRecord] = []

    def handle(self, event: object) -> None:
        for action in self.core.handle(event, self.now):  # type: ignore[arg-type]
            if isinstance(action, SendUpdate):
                for lid in action.to:
                    self.links[lid].inbox.append(action.update)
            elif isinstance(action, SyncerRecord):
                self.records.append(action)

    def deliver(self, lid: str) -> Contribution:
        """Hand ``lid``'s oldest undelivered contribution to the core."""
        c = self.links[lid].outbox.pop(0)
        self.handle(ContributionArrived(c))
        return c

    def named(self, kind: type[SyncerRecord]) -> list[dict]:
        """The records of type ``kind``, as their log lines."""
        return [r.to_record() for r in self.records if isinstance(r, kind)]


class StepLink(LearnerLink):
    """``LearnerLink`` for one learner of a ``StepHub``. Nothing arrives while a
    learner waits (one thread), so ``wait`` answers from what is already there."""

    def __init__(self, hub: StepHub) -> None:
        self.hub = hub
        self.learner_id = ""
        self.inbox: list[Update] = []
        self.outbox: list[Contribution] = []

    def join(self, learner_id: str, fragments: Sequence[FragmentSpec],
             initial: Sequence[Sequence[torch.Tensor]], timeout: float, *, settings: object = None) -> list[Update]:
        self.learner_id = learner_id
        self.hub.links[learner_id] = self
        self.hub.handle(LearnerJoined(learner_id))
        return self.poll()

    def send(self, contribution: Contribution) -> None:
        self.outbox.append(contribution)

    def poll(self) -> list[Update]:
        out, self.inbox = self.inbox, []
        return out

    def wait(self, fragment: int, after_version: int, timeout: float) -> Update | None:
        for i, upd in enumerate(self.inbox):
            if upd.fragment == fragment and (upd.version > after_version or upd.reset):
                return self.inbox.pop(i)
        return None

    def leave(self) -> None:
        self.hub.handle(LearnerLeft(self.learner_id))


def _step(opt: RackmendOptimizer, lid: str, t: int) -> float:
    x, y, tokens = batch(lid, t)
    loss = opt.model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step(tokens=tokens)
    opt.flush()  # the test hands sends to the syncer by hand: this step's must be on the link
    return float(tokens)


# ------------------------------------------------------------------ trap 9: two pending sends
def test_late_contribution_and_the_next_one_both_merge() -> None:
    """l1's c1 (base 0) arrives after round 0 closed without it (l0 and l2 made it);
    l1 applies version 1 and sends c2 (base 1). Both pieces of l1's work are in the
    next merge (a, b, c below: l0, l1, l2)."""
    H, tau = 4, 1
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=1, overlap=tau),
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1", "l2"), grace_max=1.0,
                            outer_optimizer="SGD", outer_lr=1.0, outer_kwargs={},
                            count_absent=False),  # plain arithmetic over what merged
        learner=LearnerConfig(apply="overwrite"),  # the counters below restart at each apply
    )
    init = make_model()
    frags = pack_fragments(init, 1, H, config.schedule.packing)
    named = dict(init.named_parameters())
    hub = StepHub(SyncerCore(config, frags, [[named[n].detach() for n in frags[0].names]]))
    opts: dict[str, RackmendOptimizer] = {}
    for lid in ("l0", "l1", "l2"):
        model = make_model()
        opts[lid] = RackmendOptimizer(model, make_inner(model), config, StepLink(hub), learner_id=lid)

    tokens = {lid: [_step(opts[lid], lid, t) for t in range(1, H + 1)] for lid in ("l0", "l1", "l2")}
    hub.deliver("l0")
    hub.deliver("l2")  # quorum: the grace window runs
    hub.now = 5.0
    hub.handle(Tick())
    assert hub.core.versions[0] == 1 and hub.named(Merged)[-1]["merged"] == ["l0", "l2"]
    b1 = hub.deliver("l1")  # too late for round 0: pending, based on version 0
    theta1 = [t.clone() for t in hub.core.frags[0].theta]

    for lid in ("l0", "l1"):  # both apply version 1 at t_send + tau, then train to the next send
        tokens[lid] += [_step(opts[lid], lid, t) for t in range(H + 1, 2 * H + 1)]
        assert opts[lid].versions[0] == 1
    b2 = hub.deliver("l1")
    a2 = hub.deliver("l0")
    assert (b1.base_version, b2.base_version, a2.base_version) == (0, 1, 1)
    hub.now = 10.0
    hub.handle(Tick())
    assert hub.core.versions[0] == 2

    merge = hub.named(Merged)[-1]
    assert merge["merged"] == ["l0", "l1"]
    # Counters add up: b's c1 covers steps 1..H; c2 the steps after it applied version 1.
    assert (b1.c_steps, b2.c_steps) == (H, H - tau)
    steps_b, tokens_b = b1.c_steps + b2.c_steps, b1.c_tokens + b2.c_tokens
    assert tokens_b == sum(tokens["l1"][:H]) + sum(tokens["l1"][H + tau:])
    w_a = contribution_weight("tokens_sq_per_step", a2.c_tokens, a2.c_steps)
    w_b = contribution_weight("tokens_sq_per_step", tokens_b, steps_b)
    # Outer SGD, lr 1, no momentum: theta2 = theta1 - (w_a d_a2 + w_b (d_b1 + d_b2)) / (w_a + w_b).
    # b's combined gradient is based on version 1, the current one: no re-anchoring.
    lost = []
    for i, th1 in enumerate(theta1):
        d_b = b1.tensors[i].double() + b2.tensors[i].double()
        want = th1.double() - (w_a * a2.tensors[i].double() + w_b * d_b) / (w_a + w_b)
        got = hub.core.frags[0].theta[i].double()
        assert torch.allclose(got, want, rtol=0, atol=1e-6), f"tensor {i}: b's first contribution is missing"
        w_b2 = contribution_weight("tokens_sq_per_step", b2.c_tokens, b2.c_steps)
        lost.append(th1.double() - (w_a * a2.tensors[i].double() + w_b2 * b2.tensors[i].double()) / (w_a + w_b2))
    assert any(not torch.allclose(w, g.double(), rtol=0, atol=1e-4) for w, g in zip(lost, hub.core.frags[0].theta)), \
        "vacuous: the value without c1 equals the one with it"
    assert merge["weights"]["l1"] == pytest.approx(w_b / (w_a + w_b))
    (comb,) = hub.named(Combined)
    assert comb["learner"] == "l1" and comb["base_versions"] == [0, 1]


def test_combined_stale_pieces_are_anchored_once_from_the_newer_base() -> None:
    """c1 (base 0) and c2 (base 1) of b, both pending while the syncer is at version 2:
    combined into d1 + d2 based on version 1, re-anchored from there only."""
    core = make_core(learners=("a", "b"), K=1, grace_max=0.0, count_absent=False)  # plain arithmetic
    core.handle(contrib("a", 1.0), 0.0)  # v1: theta -1
    core.handle(contrib("b", 2.0, base=0, step=8, steps=8, tokens=8.0), 0.5)  # stale, pending
    # b applied version 1, then a's round 1 merged before b's next send arrived.
    acts = core.handle(contrib("a", 1.0, base=1, step=16), 1.0)  # v2 with a and b's c1 re-anchored
    assert merges(acts)[0]["merged"] == ["a", "b"]
    # theta2 = -1 - (1 + (2 + (-1 - 0)))/2 = -2
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -2.0))
    # Now the case at issue: both of b's sends pending at once.
    core.handle(contrib("b", 4.0, base=1, step=16, steps=6, tokens=6.0), 1.5)  # stale (v2 now)
    acts = core.handle(contrib("b", 3.0, base=2, step=24, steps=6, tokens=6.0), 2.0)
    (comb,) = events(acts, Combined)
    assert comb["base_versions"] == [1, 2]
    # Combined d = 4 + 3 = 7, based on version 2 = current: no anchoring term. Alone
    # (K=1, grace 0): theta3 = -2 - 7 = -9. Anchoring c1 from its own base 1 as well
    # would have given -2 - (7 + (-2 - -1)) = -8.
    (m,) = merges(acts)
    assert m["merged"] == ["b"]
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -9.0))


def test_cumulative_send_replaces_only_the_newest_piece() -> None:
    """After combining, a cumulative send (same base as the newest piece) replaces that
    piece; the older disjoint piece stays."""
    core = make_core(learners=("a", "b"), K=2, grace_max=30.0, anchoring="learner_base")
    core.handle(contrib("a", 1.0), 0.0)
    core.handle(contrib("b", 1.0), 0.0)  # v1: theta -1
    core.handle(contrib("a", 2.0, base=0, step=16, steps=16), 1.0)  # same base: cumulative... but stale
    core.handle(contrib("a", 5.0, base=1, step=24, steps=4), 1.5)  # applied v1 at 20: disjoint -> combined
    acts = core.handle(contrib("a", 6.0, base=1, step=28, steps=8), 2.0)  # same base as 24: holds its work
    (sup,) = events(acts, Superseded)
    assert (sup["step"], sup["by_step"]) == (24, 28)
    (m,) = merges(core.handle(contrib("b", 1.0, base=1, step=16), 2.5))  # all in: closes at once
    # a: 2 + 6 = 8 with 16 + 8 steps; b: 1 with 8 steps; weights tokens^2/steps, tokens 8 each:
    # w_a = 16^2/24, w_b = 8^2/8 -> theta2 = -1 - (w_a*8 + w_b*1)/(w_a + w_b)
    w_a, w_b = 16.0 ** 2 / 24, 8.0
    want = -1 - (w_a * 8 + w_b * 1) / (w_a + w_b)
    assert torch.allclose(core.frags[0].theta[0], torch.full((N,), want))
    assert m["merged"] == ["a", "b"]


def test_rejoin_send_that_kept_its_progress_replaces() -> None:
    """A learner that adopted a rejoin value keeps progress and counters: its newer
    send reaches back over the older one's and holds its work, so it replaces it."""
    core = make_core(learners=("a", "b"), K=2, grace_max=30.0)
    core.handle(contrib("a", 1.0), 0.0)
    core.handle(contrib("b", 1.0), 0.0)  # v1
    core.handle(contrib("a", 2.0, base=0, step=16, steps=16), 1.0)
    acts = core.handle(contrib("a", 3.0, base=1, step=24, steps=24), 1.5)
    assert events(acts, Superseded) and not events(acts, Combined)


# ------------------------------------------------------------------ trap 10: work pending at the end
def test_leave_merges_the_leavers_work_once_nobody_else_is_expected() -> None:
    core = make_core(learners=("a", "b"), K=2, grace_max=30.0)
    core.handle(contrib("a", 2.0), 0.0)
    assert merges(core.handle(LearnerLeft("a"), 0.1)) == []  # b is still expected: it may bring quorum
    (m,) = merges(core.handle(LearnerLeft("b"), 0.2))
    assert m["merged"] == ["a"] and m["cause"] == "leave"
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -2.0))


def test_leave_closes_a_round_all_remaining_learners_are_in() -> None:
    """K=3 can no longer be met once c is gone; a and b, all that remain, are in."""
    core = make_core(learners=("a", "b", "c"), K=3, grace_max=30.0)
    core.handle(contrib("a", 1.0), 0.0)
    core.handle(contrib("b", 3.0), 0.0)
    (m,) = merges(core.handle(LearnerLeft("c"), 0.1))
    assert m["merged"] == ["a", "b"] and m["cause"] == "leave"
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -2.0))


def test_leave_merges_a_stale_leftover() -> None:
    core = make_core(learners=("a", "b"), K=1, grace_max=0.0)
    core.handle(contrib("a", 1.0), 0.0)  # v1: theta -1
    core.handle(contrib("b", 4.0, base=0), 0.5)  # stale: waits for a fresh round
    assert merges(core.handle(LearnerLeft("b"), 0.6)) == []  # a is still expected
    (m,) = merges(core.handle(LearnerLeft("a"), 0.7))
    assert m["merged"] == ["b"] and m["stale"] == ["b"]
    # re-anchored: 4 + (-1 - 0) = 3 -> theta -1 - 3 = -4
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -4.0))


def test_silent_learner_work_stays_pending() -> None:
    """Declared silent is not a leave: it may return and resend its progress."""
    core = make_core(learners=("a",), K=1, grace_max=30.0)
    core.handle(LearnerJoined("b"), 0.0)
    core.handle(contrib("a", 2.0), 0.0)
    assert merges(core.handle(LearnerLeft("a", "silent"), 0.1) + core.handle(LearnerLeft("b", "silent"), 0.2)) == []
    assert "a" in core.frags[0].round.pending


def test_final_merge_merges_every_fragment_with_pending_work() -> None:
    core = make_core(learners=("a", "b"), K=2, grace_max=30.0, P=3)
    core.handle(contrib("a", 2.0, p=0), 0.0)
    core.handle(contrib("b", 1.0, p=2), 0.0)
    acts = core.handle(FinalMerge(), 1.0)
    (fin,) = events(acts, FinalMerged)
    assert fin["fragments"] == [0, 2]
    ms = merges(acts)
    assert [m["fragment"] for m in ms] == [0, 2] and all(m["cause"] == "final" for m in ms)
    assert core.versions == [1, 0, 1]
    # Neither learner's work has gone into the other's fragment yet, so neither counts
    # as absent there (count_absent counts only learners whose work arrives).
    assert torch.equal(core.frags[0].theta[0], torch.full((N,), -2.0))
    assert torch.equal(core.frags[2].theta[0], torch.full((N,), -1.0))


def _inprocess_one_sender(leave: bool) -> tuple[InProcessSyncer, torch.nn.Module, list[torch.Tensor]]:
    """l0 of roster (l0, l1), K=2, trains H steps, sends once and stops (leaving or
    not); l1 never comes, so no round can close by quorum. Outer SGD lr 1, no momentum:
    merging l0's contribution alone makes the global value l0's model at its send."""
    H = 3
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=1, overlap=1),
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1"), grace_max=30.0,
                            outer_optimizer="SGD", outer_lr=1.0, outer_kwargs={},
                            count_absent=False),  # plain arithmetic over what merged
    )
    hub = InProcessSyncer.for_model(config, make_model())
    theta0 = [t.clone() for t in hub.core.frags[0].theta]
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
    train(opt, model, "l0", range(1, H + 1))  # the send happens at step H, the last one
    if leave:
        opt.close()
    else:
        opt.flush()  # the last send has left the send thread; the learner never leaves
    return hub, model, theta0


def _assert_theta_is(hub: InProcessSyncer, model: torch.nn.Module, theta0: list[torch.Tensor]) -> None:
    named = dict(model.named_parameters())
    for name, got, before in zip(hub.core.fragments[0].names, hub.core.frags[0].theta, theta0):
        assert not torch.equal(named[name].detach(), before), "vacuous: the learner did not move"
        assert torch.allclose(got, named[name].detach(), rtol=0, atol=1e-6), f"{name}: the learner's work is missing"


def test_inprocess_leave_merges_the_leavers_work() -> None:
    hub, model, theta0 = _inprocess_one_sender(leave=True)
    try:
        end = time.monotonic() + 10.0
        while not hub.merges() and time.monotonic() < end:
            time.sleep(0.01)
        assert [m.cause for m in hub.merges()] == ["leave"], "no merge after the leave"
    finally:
        hub.close()
    _assert_theta_is(hub, model, theta0)


def test_inprocess_close_merges_pending_work() -> None:
    hub, model, theta0 = _inprocess_one_sender(leave=False)
    hub.close()
    assert [type(r) for r in hub.records if isinstance(r, (FinalMerged, Merged))] == [FinalMerged, Merged]
    assert hub.merges()[0].cause == "final"
    _assert_theta_is(hub, model, theta0)
