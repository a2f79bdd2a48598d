"""The discrete-event loop: one ``SyncerCore`` and M ``LearnerCore`` drivers in virtual time.

An event heap ordered by (virtual time, insertion order) holds what happens next: a
learner's inner step ends, a contribution reaches the syncer, a merged value reaches a
learner, a grace window expires (the syncer's ``next_deadline`` becomes a ``Tick``), a
learner dies, rejoins or is declared silent. Each event is handed to the real core it
concerns with ``now`` = the event's time, and the actions the core returns are carried
out here: a send becomes a later arrival (latency plus bytes over bandwidth, FIFO per
link), a wait blocks the learner until the value it waits for arrives.

What lives here: the driving, the toy model (one quadratic per learner, a gradient
step per inner step), the counting behind ``SimReport``. What does not: any rule of
the algorithm (when to send, how to merge, when to apply): those are the cores', in
``rackmend.core``. No sockets, threads, clocks or sleeping: one seed, one run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rackmend.core.fragments import FragmentSpec, TensorSpec, fragment_offsets
from rackmend.core.learner import (
    ApplyDue,
    ApplyValue,
    InnerStepDone,
    JoinedValue,
    LearnerAction,
    LearnerCore,
    Log,
    Rebase,
    SendFragment,
    SetValue,
    SnapshotTaken,
    TakeSnapshot,
    TrainingResumed,
    WaitAnswered,
    WaitForVersion,
)
from rackmend.core.messages import Contribution, Update
from rackmend.core.syncer import (
    Action,
    ContributionArrived,
    Event,
    LearnerJoined,
    LearnerLeft,
    SendUpdate,
    SyncerCore,
    Tick,
)
from rackmend.core.records import Dropped, Merged, Rejected, SyncerRecord
from rackmend.core.syncer_runner import SyncerRunner
from rackmend.sim.config import SimConfig

__all__ = ["SimulationError", "Goodput", "LearnerReport", "SimReport", "Simulation", "simulate"]


class SimulationError(RuntimeError):
    """The simulated run cannot go on (e.g. a deterministic-mode wait timed out)."""


@dataclass(frozen=True)
class LearnerReport:
    """What one learner did over the run."""

    learner: str
    steps: int
    """Inner steps finished (over all its lives)."""
    idle_s: float
    """Virtual seconds blocked waiting for a merged value (deterministic mode) or for the
    join answer; the time it was dead is not counted."""
    down_s: float
    """Virtual seconds it was dead."""
    sent: int
    """Contributions sent."""
    merged: int
    """Contributions of it that went into a merge (a combined pair counts once)."""
    merged_stale: int
    """Of those, merged into a later round than the one they were based on."""
    rejected: int
    """Contributions the syncer refused (a ``reject`` record names it)."""
    loss: float
    """The global objective (mean of all learners' quadratics) at its final local value."""
    own_loss: float
    """Its own quadratic at its final local value."""
    chips: int = 1
    """Chips allocated to it (``SimConfig.chips``)."""
    failures: int = 0
    """Chip failures it had (``SimConfig.failures``)."""


@dataclass(frozen=True)
class Goodput:
    """Where the allocated chip-time went, in chip-seconds; the shares add up to 1.

    ``useful``: steps whose work reached the global model (merged, or sent and not yet
    merged when the run ended), at the rack's normal speed; ``slow``: the time a slowed
    rack's steps took beyond its normal step time (a rack at 4x puts 3/4 of its
    chip-time here); ``lost``: steps computed and then thrown away (the step a failure
    interrupted, work not yet sent when a learner died, contributions the syncer refused
    or dropped), at normal speed; ``down``: learners restarting (every chip of a
    non-elastic data-parallel job); ``dead``: learners killed that never came back;
    ``paused``: elastic reshapes (downscale, upscale); ``failed``: chips waiting for
    repair; ``blocked``: learners waiting (for the join answer, or a merged value in
    deterministic mode)."""

    allocated: float
    useful: float
    lost: float
    down: float
    paused: float
    failed: float
    blocked: float
    uptime: float
    """Share of the run during which the global model could advance: some learner (the
    data-parallel job) was training."""
    failures: int
    """Chip failures over the run."""
    slow: float = 0.0
    dead: float = 0.0

    @property
    def goodput(self) -> float:
        """Useful chip-time / allocated chip-time."""
        return self.useful / self.allocated if self.allocated else 0.0

    def shares(self) -> dict[str, float]:
        """Each part as a share of the allocated chip-time."""
        a = self.allocated or 1.0
        return {k: getattr(self, k) / a
                for k in ("useful", "slow", "lost", "down", "dead", "paused", "failed", "blocked")}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": self.goodput, "shares": self.shares()}


@dataclass(frozen=True)
class SimReport:
    """The outcome of one simulated run (``to_dict`` for JSON)."""

    duration: float
    seed: int
    learners: tuple[LearnerReport, ...]
    merges: tuple[int, ...]
    """Merges per fragment."""
    version_lag_median: float | None
    """Median over merged contributions of (the round they went into - their base
    version): 0 for a fresh one; None without merges."""
    version_lag_max: int | None
    max_merge_gap: float | None
    """Longest time between two consecutive merges of one fragment (its first merge counts
    from time 0); None without merges."""
    max_merge_gap_per_fragment: tuple[float | None, ...]
    global_loss: float
    """The global objective at the syncer's final value."""
    optimum_loss: float
    """The global objective's minimum (what no run can beat)."""
    initial_loss: float
    """The global objective at the start value."""
    warnings: tuple[str, ...]
    """The syncer's records at WARNING level and learner warnings, in order."""
    goodput: Goodput | None = None
    """Where the chip-time went (``Goodput``)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.goodput is not None:
            out["goodput"] = self.goodput.to_dict()
        return out


# Event kinds. Events at one instant run in the order they were pushed, whatever their kind.
(_STEP, _ARRIVE, _DELIVER, _JOIN, _SILENT, _TICK, _KILL, _REJOIN, _WAIT_TIMEOUT, _FAIL, _RESUME,
 _REPAIR) = range(12)

_RESUMED = TrainingResumed()  # carries nothing: one for every step

# What a learner's chips are doing, for the goodput accounting.
_TRAIN, _PAUSED, _DOWN, _DEAD, _BLOCKED = "train", "paused", "down", "dead", "blocked"


@dataclass
class _Learner:
    index: int
    lid: str
    target: list[torch.Tensor]
    """Per fragment, this learner's optimum."""
    chips: int = 1
    """Chips allocated to it (``SimConfig.chips``)."""
    active: int = 1
    """Chips it trains on now (fewer than ``chips`` while failed ones wait for repair)."""
    core: LearnerCore | None = None
    local: list[list[torch.Tensor]] = field(default_factory=list)
    """Per fragment, the local value of its tensors (one), exact as of ``at[p]`` steps into this life."""
    trained: int = 0
    """Inner steps trained in this life."""
    at: list[int] = field(default_factory=list)
    """Per fragment, the value of ``trained`` its ``local`` value is exact for (the toy model
    is computed in closed form when something reads or changes a value)."""
    local_np: list[np.ndarray] = field(default_factory=list)
    """Per fragment, ``local``'s tensor as a NumPy array (the same memory): the closed form
    runs on these, a tenth of torch's cost per operator on a small fragment."""
    target64: list[np.ndarray] = field(default_factory=list)
    alive: bool = False
    life: int = 0
    """Incarnation: events of an earlier life are dropped."""
    gen: int = 0
    """Bumped whenever the scheduled wake-up (a step end, a resume) is no longer valid."""
    wake_at: float | None = None
    ends: deque = field(default_factory=deque)
    """End times of the step in progress and of the steps drawn after it."""
    jitter: deque = field(default_factory=deque)
    """With step jitter, the draw u of each step in ``ends`` (empty without jitter)."""
    undrawn: list[float] = field(default_factory=list)
    """Draws of steps planned and then dropped before they started, reversed: the next
    steps take them first, so that how far ahead steps were planned changes nothing."""
    step_start: float = 0.0
    """When the step in progress (``ends[0]``) started."""
    state: str = _BLOCKED
    since: float = 0.0
    """When ``state`` or ``active`` last changed (accounting)."""
    paused_until: float = 0.0
    pause_debt: float = 0.0
    """Seconds of pause owed by failures that hit while it was blocked (joining, waiting)."""
    fgen: int = 0
    """Bumped when the next failure drawn is no longer valid (active chips changed, death)."""
    joining: dict[int, Update] | None = None
    inbox: list[Update] = field(default_factory=list)
    waiting: WaitForVersion | None = None
    blocked_since: float = 0.0
    up_free: float = 0.0
    down_free: float = 0.0
    died_at: float | None = None
    kill_token: int = 0
    done_cs: float = 0.0
    """Chip-seconds of the steps finished in this life."""
    sent_cs: list[float] = field(default_factory=list)
    """Per fragment, ``done_cs`` at its last send in this life."""
    steps: int = 0
    idle: float = 0.0
    down: float = 0.0
    sent: int = 0
    merged: int = 0
    stale: int = 0
    rejected: int = 0
    failures: int = 0
    acct: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_BUCKETS, 0.0))


_BUCKETS = ("computing", "slow", "lost", "down", "dead", "paused", "failed", "blocked")


class Simulation:
    """One run of ``config``; ``run()`` returns its ``SimReport``.

    ``every_step``: wake each learner at every inner step and hand its core every event a
    training loop would (``ApplyDue`` included), instead of only at the steps where the
    core can act. The same run, several times slower: it checks that skipping changes
    nothing."""

    def __init__(self, config: SimConfig, *, every_step: bool = False) -> None:
        self.config = config
        self.every_step = every_step
        self._each_step = every_step or config.run.deterministic
        """Wake every learner at every step: asked for, or in deterministic mode (every
        step hands the core ``ApplyDue``, which blocks the learner at a value not arrived)."""
        run = config.run
        sch = run.schedule
        gen = torch.Generator().manual_seed(config.seed)
        n, size = len(config.racks), config.fragment_size
        offsets = fragment_offsets(sch.num_fragments, sch.sync_every)
        self.specs = [FragmentSpec(p, offsets[p], (TensorSpec(f"w{p}", (size,), torch.float32),))
                      for p in range(sch.num_fragments)]
        lo, hi = config.curvature
        self.curvature = [lo + (hi - lo) * torch.rand(size, generator=gen) for _ in self.specs]
        centre = [torch.randn(size, generator=gen) for _ in self.specs]
        self.start = [torch.zeros(size) for _ in self.specs]
        chips = config.chips()
        self.learners = [
            _Learner(i, lid, [c + config.target_spread * torch.randn(size, generator=gen) for c in centre],
                     chips=chips[i], active=chips[i])
            for i, lid in enumerate(config.learner_ids)]
        self.rngs = [random.Random(config.seed * 1_000_003 + i) for i in range(n)]
        self.fail_rngs = [random.Random(f"failures/{config.seed}/{i}") for i in range(n)]
        self.syncer = SyncerCore(run, self.specs, [[t.clone()] for t in self.start])
        # Virtual time stands still while the core merges: no merge time is fed back.
        self._runner = SyncerRunner(self.syncer, lambda: self.now, send_update=self._send_update,
                                    record=self._record, time_merges=False)
        self.now = 0.0
        self._ran = False
        self._heap: list[tuple[float, int, int, tuple]] = []
        self._order = itertools.count()
        self._ticks: set[float] = set()
        self._merge_times: list[list[float]] = [[] for _ in self.specs]
        self._lags: list[int] = []
        self._bases: dict[tuple[str, int], int] = {}
        """(learner, fragment) -> oldest base version among its contributions pending since
        the fragment's last merge (what its merged work was based on)."""
        self._pending_cs: dict[tuple[str, int], float] = {}
        """(learner, fragment) -> chip-seconds of work in its contributions to the fragment
        that arrived since they last went into a merge (lost if dropped)."""
        self._by_id = {lr.lid: lr for lr in self.learners}
        self.warnings: list[str] = []
        self.syncer_records: list[SyncerRecord] = []
        """Every record the syncer core returned, in order (``rackmend.core.records``)."""
        # The toy model in closed form: k gradient steps on 0.5*h*(x-c)^2 take x to
        # c + (1 - lr*h)^k (x - c), so a learner's value is computed only when something
        # reads or changes it (a send, an apply), not at each of its steps.
        self._decay = [(1.0 - config.lr * h.double()) for h in self.curvature]
        self._powers: dict[int, list[np.ndarray]] = {}
        # When each fragment is due: step s sends the fragments whose offset is s mod H, so
        # the steps to the next send depend only on s mod H (looked up, not searched).
        H = sch.sync_every
        due = {(o % H) for o in offsets}
        self._due_gap = [min((r0 - r) % H for r0 in due) for r in range(H)]
        self._slowdowns = [tuple(s for s in config.slowdowns if s.learner == i) for i in range(n)]
        self._training = 0
        """Learners training now; the time with at least one is the system's uptime."""
        self._up_since: float | None = None
        self._uptime = 0.0

    # ---------------------------------------------------------------- public
    def run(self) -> SimReport:
        if self._ran:
            raise SimulationError("this Simulation has run already; make a new one to run again")
        self._ran = True
        cfg = self.config
        for lr in self.learners:
            self._start(lr, 0.0)
        for k in sorted(cfg.kills, key=lambda k: k.at):
            self._push(k.at, _KILL, (k.learner, k.rejoin_at))
        handlers: dict[int, Callable[..., None]] = {
            _STEP: self._on_step, _ARRIVE: self._on_arrive, _DELIVER: self._on_deliver, _JOIN: self._on_join,
            _SILENT: self._on_silent, _TICK: self._on_tick, _KILL: self._on_kill, _REJOIN: self._on_rejoin,
            _WAIT_TIMEOUT: self._on_wait_timeout, _FAIL: self._on_fail, _RESUME: self._on_resume,
            _REPAIR: self._on_repair,
        }
        heap, pop, end = self._heap, heapq.heappop, cfg.duration
        while heap and heap[0][0] <= end:
            t, _, kind, args = pop(heap)
            self.now = t
            handlers[kind](*args)
        self.now = end
        for lr in self.learners:
            if lr.state == _TRAIN:
                self._catch_up(lr, end)
            self._set_state(lr, lr.state)
        self._count_training(0)
        return self._report()

    # ---------------------------------------------------------------- the model
    def loss(self, values: Sequence[torch.Tensor], target: Sequence[torch.Tensor] | None = None) -> float:
        """A learner's quadratic (``target`` its optimum) at ``values`` (one tensor per
        fragment); without ``target``, the global objective: the mean over all learners'."""
        if target is not None:
            return math.fsum(0.5 * float((h * (v.double() - c.double()) ** 2).sum())
                             for v, c, h in zip(values, target, self.curvature))
        return statistics.fmean(self.loss(values, lr.target) for lr in self.learners)

    def _materialize(self, lr: _Learner, p: int) -> None:
        """Bring fragment ``p`` of ``lr.local`` up to date with the steps trained since it
        was last (closed form; a NaN value of a failed join stays NaN)."""
        k = lr.trained - lr.at[p]
        if not k:
            return
        lr.at[p] = lr.trained
        powers = self._powers.get(k)
        if powers is None:
            powers = [d.pow(k).numpy() for d in self._decay]
            if len(self._powers) < 4096:  # k is mostly a few values near H; bounded anyway
                self._powers[k] = powers
        c = lr.target64[p]
        x = lr.local_np[p]
        np.copyto(x, c + powers[p] * (x - c))  # in float64, rounded to x's float32 as torch's copy_ does

    # ---------------------------------------------------------------- accounting
    def _set_state(self, lr: _Learner, state: str) -> None:
        """Close the accounting interval since ``lr.since`` (at the old state and chips)
        and enter ``state``."""
        dt = self.now - lr.since
        if dt > 0:
            a, acct = lr.active, lr.acct
            if lr.state in (_DOWN, _DEAD):
                acct[lr.state] += dt * lr.chips
            else:
                acct["failed"] += dt * (lr.chips - a)
                acct["computing" if lr.state == _TRAIN else "paused" if lr.state == _PAUSED else "blocked"] += dt * a
        lr.since = self.now
        if (state == _TRAIN) != (lr.state == _TRAIN):
            self._count_training(1 if state == _TRAIN else -1)
        lr.state = state

    def _count_training(self, change: int) -> None:
        if self._up_since is not None:
            self._uptime += self.now - self._up_since
        self._training += change
        self._up_since = self.now if self._training > 0 else None

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, args: tuple) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, args))

    def _start(self, lr: _Learner, now: float) -> None:
        """A (new) process of learner ``lr`` starts and joins."""
        lr.life += 1
        lr.gen += 1
        lr.alive = True
        lr.core = LearnerCore(self.config.run, self.specs, learner_id=lr.lid)
        # A fresh process's own init, overwritten by the join answer (SetValue); NaN so
        # that a value the join failed to set shows as a rejected contribution.
        lr.local = [[torch.full_like(t, math.nan)] for t in self.start]
        lr.trained, lr.at = 0, [0] * len(self.specs)
        lr.local_np = [x.numpy() for (x,) in lr.local]
        lr.target64 = [c.double().numpy() for c in lr.target]
        lr.joining, lr.inbox, lr.waiting = {}, [], None
        lr.ends.clear()
        lr.wake_at = None
        lr.active = lr.chips
        lr.pause_debt = 0.0
        lr.done_cs, lr.sent_cs = 0.0, [0.0] * len(self.specs)
        self._set_state(lr, _BLOCKED)
        lr.blocked_since = now
        lr.up_free = lr.down_free = now
        self._push(now + self.config.racks[lr.index].uplink_latency, _JOIN, (lr.lid,))
        self._draw_failure(lr)

    def _slowdown(self, lr: _Learner, start: float) -> float:
        """How many times its normal time a step of ``lr`` starting at ``start`` takes."""
        factor = 1.0
        for s in self._slowdowns[lr.index]:
            if s.start <= start < s.end:
                factor *= s.factor
        return factor

    def _computed(self, lr: _Learner, start: float, end: float) -> float:
        """Chip-seconds of the step (or part of one) from ``start`` to ``end``, at the rack's
        normal speed; the rest of that chip-time, when the step was slowed, goes to the
        ``slow`` bucket here."""
        cs = (end - start) * lr.active
        factor = self._slowdown(lr, start) if self._slowdowns[lr.index] else 1.0
        if factor <= 1.0:
            return cs
        lr.acct["slow"] += cs * (1.0 - 1.0 / factor)
        return cs / factor

    def _step_time(self, lr: _Learner, start: float) -> float:
        """The time of the learner's next step planned (it starts at ``start``)."""
        spec = self.config.racks[lr.index]
        factor = self._slowdown(lr, start)
        if not spec.jitter:
            return spec.step_time * factor
        u = lr.undrawn.pop() if lr.undrawn else self.rngs[lr.index].uniform(-1.0, 1.0)
        lr.jitter.append(u)
        return spec.step_time * factor * (1.0 + spec.jitter * u)

    def _unplan(self, lr: _Learner) -> None:
        """Drop the steps planned: the one in progress is over (lost), the later ones
        never started and give their jitter draws back."""
        if lr.jitter:
            lr.jitter.popleft()
            lr.undrawn.extend(reversed(lr.jitter))
            lr.jitter.clear()
        lr.ends.clear()
        lr.gen += 1
        lr.wake_at = None

    def _tokens(self, lr: _Learner) -> float:
        """Tokens of one step: the rack's, scaled by the share of its chips training."""
        tokens = self.config.racks[lr.index].tokens
        return tokens if lr.active == lr.chips else tokens * lr.active / lr.chips

    def _resume(self, lr: _Learner) -> None:
        """Hand control back to the training loop (after a join or a wait)."""
        assert lr.core is not None
        lr.idle += self.now - lr.blocked_since
        if lr.pause_debt > 0:
            debt, lr.pause_debt = lr.pause_debt, 0.0
            self._set_state(lr, _PAUSED)
            lr.paused_until = self.now
            self._extend_pause(lr, debt)
            return
        self._set_state(lr, _TRAIN)
        lr.core.handle(TrainingResumed(), self.now)
        lr.step_start = self.now
        lr.ends.clear()
        self._plan(lr)

    def _plan(self, lr: _Learner) -> None:
        """Schedule the learner's next wake-up: the end of its next step that matters: a
        fragment is due, a value held or arrived can be applied (at t_send + tau of the
        fragment's own send, or the first step after it arrives if later: the learner
        core's rule), or a rejoin answer arrived. The steps before it only count; they
        run when it wakes (``_catch_up``), and what arrived meanwhile is handed to the
        core at that step: a merged value is only held until it is applied, so taking it
        in a few steps later changes nothing."""
        core = lr.core
        assert core is not None
        step, inbox = core.step, lr.inbox
        if self._each_step or (inbox and any(u.reset for u in inbox)):
            j = 0
        else:
            j = self._due_gap[(step + 1) % len(self._due_gap)]
            if j:
                last = step + 1 - self.config.run.schedule.overlap  # a send at or before it is due next step
                for f in core.fragments:
                    sent = f.in_flight
                    if sent is not None and (f.arrived is not None or
                                             (inbox and any(u.fragment == f.index for u in inbox))):
                        j = min(j, max(0, sent.step - last))
        ends = lr.ends
        while len(ends) <= j:
            start = ends[-1] if ends else lr.step_start
            ends.append(start + self._step_time(lr, start))
        t = ends[j]
        if lr.wake_at != t:
            lr.gen += 1
            lr.wake_at = t
            self._push(t, _STEP, (lr.index, lr.life, lr.gen))

    def _catch_up(self, lr: _Learner, until: float) -> None:
        """Run the steps that end before ``until``: steps with nothing due or to apply,
        where the core only counts (its actions are none, checked); what arrived meanwhile
        waits for the wake-up step (``_plan``)."""
        core = lr.core
        assert core is not None
        ends, handle, jitter = lr.ends, core.handle, lr.jitter
        if not ends or ends[0] >= until:
            return
        done = InnerStepDone(self._tokens(lr))  # one event for all of them: the core keeps none
        start, done_cs, n = lr.step_start, lr.done_cs, 0
        while ends and ends[0] < until:
            t = ends.popleft()
            if jitter:
                jitter.popleft()
            done_cs += self._computed(lr, start, t)
            n += 1
            if handle(done, t):
                raise SimulationError(f"learner {lr.lid}: step {core.step} at t={t:g} was taken for one with nothing "
                                      "to do, but the core acted on it (a simulator bug)")
            handle(_RESUMED, t)
            start = t
        lr.step_start, lr.done_cs = start, done_cs
        lr.steps += n
        lr.trained += n

    def _on_step(self, i: int, life: int, gen: int) -> None:
        lr = self.learners[i]
        if not lr.alive or lr.life != life or lr.gen != gen or lr.state != _TRAIN:
            return
        core = lr.core
        assert core is not None
        lr.wake_at = None
        self._catch_up(lr, self.now)
        t = lr.ends.popleft()
        if lr.jitter:
            lr.jitter.popleft()
        assert t == self.now, (t, self.now)
        lr.done_cs += self._computed(lr, lr.step_start, t)
        lr.steps += 1
        lr.trained += 1
        arrived, lr.inbox = tuple(lr.inbox), []
        lr.blocked_since = self.now
        self._carry(lr, core.handle(InnerStepDone(self._tokens(lr), arrived), self.now))
        # ApplyDue acts only on a value held (or, deterministic, on a wait); without one it
        # returns nothing, so it is skipped (the same decisions, less work).
        if self._each_step or any(f.arrived is not None for f in core.fragments):
            self._carry(lr, core.handle(ApplyDue(), self.now))
        lr.step_start = self.now
        if lr.waiting is None:
            core.handle(_RESUMED, self.now)
            self._plan(lr)
        else:
            self._set_state(lr, _BLOCKED)
            self._answer_wait(lr)  # what it waits for may have come in with this step's arrivals

    def _on_deliver(self, i: int, life: int, upd: Update) -> None:
        lr = self.learners[i]
        if not lr.alive or lr.life != life:
            return  # the process it was sent to is gone
        assert lr.core is not None
        if lr.joining is not None:
            if upd.fragment in lr.joining:
                lr.inbox.append(upd)  # a merge after the join answer: absorbed at the first step
                return
            lr.joining[upd.fragment] = upd
            if len(lr.joining) == len(self.specs):
                for p in range(len(self.specs)):
                    self._carry(lr, lr.core.handle(JoinedValue(lr.joining[p]), self.now))
                lr.joining = None
                self._resume(lr)
            return
        lr.inbox.append(upd)
        if lr.waiting is not None:
            self._answer_wait(lr)
        elif lr.state == _TRAIN:
            # It may be applied earlier than the planned wake-up: run the steps before, plan again.
            self._catch_up(lr, self.now)
            self._plan(lr)

    def _answer_wait(self, lr: _Learner) -> None:
        """A blocked learner: answer its wait from what arrived, as ``Link.wait`` does
        (other values stay for the next step); resume it once no wait is left."""
        assert lr.core is not None
        while lr.waiting is not None:
            w = lr.waiting
            hit = next((u for u in lr.inbox if u.fragment == w.fragment and (u.reset or u.version > w.after_version)),
                       None)
            if hit is None:
                return
            lr.inbox.remove(hit)
            lr.waiting = None
            self._carry(lr, lr.core.handle(WaitAnswered(w.fragment, hit), self.now))
        self._resume(lr)

    def _on_wait_timeout(self, i: int, life: int, wait: WaitForVersion) -> None:
        lr = self.learners[i]
        if lr.alive and lr.life == life and lr.waiting is wait:
            raise SimulationError(
                f"t={self.now:g}: learner {lr.lid} waited {self.config.run.learner.wait_timeout:g}s for fragment "
                f"{wait.fragment} newer than version {wait.after_version} (deterministic mode): every expected "
                "learner must send before a round merges, so a dead or very slow one stalls all; lower "
                "silence_timeout, or raise run.learner.wait_timeout")

    def _carry(self, lr: _Learner, actions: Sequence[LearnerAction]) -> None:
        """Carry out a learner core's actions at ``self.now``."""
        assert lr.core is not None
        for a in actions:
            if isinstance(a, TakeSnapshot):
                self._materialize(lr, a.fragment)
                snap = [t.clone() for t in lr.local[a.fragment]]
                self._carry(lr, lr.core.handle(SnapshotTaken(a.fragment, snap), self.now))
            elif isinstance(a, (SetValue, Rebase, ApplyValue)):
                self._materialize(lr, a.fragment)
                a.apply_to(lr.local[a.fragment])
            elif isinstance(a, SendFragment):
                lr.sent += 1
                p = a.draft.fragment
                work, lr.sent_cs[p] = lr.done_cs - lr.sent_cs[p], lr.done_cs
                spec = self.config.racks[lr.index]
                contribution, nbytes = a.build()
                lr.up_free = self._transfer(lr.up_free, nbytes, spec.uplink_bandwidth)
                self._push(lr.up_free + spec.uplink_latency, _ARRIVE, (contribution, work / len(self.specs)))
            elif isinstance(a, WaitForVersion):
                lr.waiting = a
                self._push(a.deadline, _WAIT_TIMEOUT, (lr.index, lr.life, a))
            elif isinstance(a, Log):
                if a.level >= logging.WARNING:
                    self.warnings.append(f"t={self.now:g} {lr.lid}: {a.message}")
            else:
                raise SimulationError(f"learner {lr.lid}: the simulator does not carry out {type(a).__name__} "
                                      "(multi-rank and DES-LOC actions need a driver with ranks and Adam)")

    def _transfer(self, free: float, nbytes: int, bandwidth: float | None) -> float:
        """When a transfer of ``nbytes`` started now on a FIFO link busy until ``free`` ends."""
        start = max(self.now, free)
        return start if bandwidth is None else start + nbytes / bandwidth

    # ---------------------------------------------------------------- failures
    def _draw_failure(self, lr: _Learner) -> None:
        """The learner's next chip failure, at rate (active chips) / MTBI (memoryless, so
        re-drawing whenever the rate changes is exact)."""
        f = self.config.failures
        lr.fgen += 1
        if not f.enabled or not lr.alive or lr.active <= 0:
            return
        at = self.now + self.fail_rngs[lr.index].expovariate(lr.active / f.mtbi_s)
        if at <= self.config.duration:
            self._push(at, _FAIL, (lr.index, lr.fgen))

    def _on_fail(self, i: int, fgen: int) -> None:
        lr = self.learners[i]
        if lr.fgen != fgen or not lr.alive:
            return
        lr.failures += 1
        f = self.config.failures
        if f.failure_mode == "restart":
            self._die(lr)
            self._push(self.now + f.restart_time, _REJOIN, (i, lr.kill_token))
            return
        lost = min(f.chips_per_failure, lr.active)
        self._push(self.now + f.repair_time, _REPAIR, (i, lr.life, lost))
        self._pause(lr, f.downscale_time, lr.active - lost)
        self._draw_failure(lr)

    def _on_repair(self, i: int, life: int, chips: int) -> None:
        lr = self.learners[i]
        if not lr.alive or lr.life != life:
            return  # a restart brought the learner back whole already
        self._pause(lr, self.config.failures.upscale_time, min(lr.chips, lr.active + chips))
        self._draw_failure(lr)

    def _pause(self, lr: _Learner, seconds: float, active: int) -> None:
        """An elastic reshape to ``active`` chips: the step in progress is lost, no step
        runs for ``seconds``. What happened before counts at the chips it ran on."""
        was = lr.state
        if was == _TRAIN:
            self._catch_up(lr, self.now)
            lr.acct["lost"] += self._computed(lr, lr.step_start, self.now)
            self._unplan(lr)
            lr.paused_until = self.now
        self._set_state(lr, _PAUSED if was == _TRAIN else was)  # closes the interval at the old chip count
        lr.active = active
        if was == _PAUSED and lr.paused_until > self.now and self.config.failures.reshape_overlap == "absorb":
            pass  # the reshape under way takes the new chip count in and ends as planned
        elif was in (_TRAIN, _PAUSED):
            self._extend_pause(lr, seconds)
        else:
            lr.pause_debt += seconds  # joining or waiting: served when it would train again

    def _extend_pause(self, lr: _Learner, seconds: float) -> None:
        # A pause that starts now, or (``reshape_overlap="restart"``) a reshape under way
        # that starts over: it ends ``seconds`` after the latest event, not after each in turn.
        lr.paused_until = max(lr.paused_until, self.now + seconds)
        lr.gen += 1
        self._push(lr.paused_until, _RESUME, (lr.index, lr.life, lr.gen))

    def _on_resume(self, i: int, life: int, gen: int) -> None:
        lr = self.learners[i]
        if not lr.alive or lr.life != life or lr.gen != gen or lr.state != _PAUSED:
            return
        if lr.active <= 0:
            return  # every chip failed: it waits for a repair (which pauses and resumes it)
        # No TrainingResumed: the training loop was inside the step all along, so the
        # pause shows in the step time the core measures (as fail-slow would see it).
        self._set_state(lr, _TRAIN)
        lr.step_start = self.now
        lr.ends.clear()
        self._plan(lr)

    # ---------------------------------------------------------------- syncer side
    def _drive(self, event: Event) -> list[Action]:
        """Feed ``event`` to the syncer core through the runner (``_send_update`` and
        ``_record`` carry out its actions) and plan a tick for its next deadline; returns
        the actions."""
        actions = self._runner.run(event)
        deadline = self.syncer.next_deadline()
        if deadline is not None and deadline not in self._ticks:
            self._ticks.add(deadline)
            self._push(max(deadline, self.now), _TICK, (deadline,))
        return actions

    def _on_tick(self, deadline: float) -> None:
        self._ticks.discard(deadline)
        self._drive(Tick())

    def _on_join(self, lid: str) -> None:
        self._drive(LearnerJoined(lid))

    def _on_silent(self, i: int, life: int) -> None:
        lr = self.learners[i]
        if not lr.alive and lr.life == life:
            self._drive(LearnerLeft(lr.lid, "silent"))

    def _on_arrive(self, c: Contribution, work: float) -> None:
        key = (c.learner_id, c.fragment)
        prior = self._bases.get(key)
        self._bases[key] = c.base_version if prior is None else min(prior, c.base_version)
        self._pending_cs[key] = self._pending_cs.get(key, 0.0) + work
        actions = self._drive(ContributionArrived(c))
        # The core refuses a contribution with one ``Rejected`` (for it: the event has
        # no other contribution to refuse).
        if any(isinstance(a, Rejected) for a in actions):
            # Refused: its base is no merged work's (a refusal never merges in the same call),
            # and its work is lost.
            if prior is None:
                self._bases.pop(key, None)
            else:
                self._bases[key] = prior
            self._pending_cs[key] -= work
            self._by_id[c.learner_id].acct["lost"] += work

    def _send_update(self, a: SendUpdate) -> None:
        upd = replace(a.update, reset=True) if a.reset else a.update
        nbytes = self.specs[upd.fragment].nbytes
        for lid in a.to:
            lr = self._by_id[lid]
            if not lr.alive:
                continue  # connected in the syncer's eyes until declared silent; nobody receives
            spec = self.config.racks[lr.index]
            lr.down_free = self._transfer(lr.down_free, nbytes, spec.downlink_bandwidth)
            self._push(lr.down_free + spec.downlink_latency, _DELIVER, (lr.index, lr.life, upd))

    def _record(self, rec: SyncerRecord) -> None:
        # Fail-slow actions are not passed on: the core applied their effect on membership
        # already, and their advice to the learner is a log line, kept with the warnings.
        by_id = self._by_id
        self.syncer_records.append(rec)
        if isinstance(rec, Merged):
            p = rec.fragment
            self._merge_times[p].append(self.now)
            stale = set(rec.stale)
            for lid in rec.merged:
                lr = by_id[lid]
                lr.merged += 1
                lr.stale += lid in stale
                base = self._bases.pop((lid, p), rec.round)
                self._lags.append(rec.round - base)
                self._pending_cs.pop((lid, p), None)
        elif isinstance(rec, Dropped):
            p = rec.fragment
            for lid in rec.dropped or ():  # the simulator runs no DES-LOC moments (``dropped`` None)
                by_id[lid].acct["lost"] += self._pending_cs.pop((lid, p), 0.0)
                self._bases.pop((lid, p), None)
        elif isinstance(rec, Rejected) and rec.learner in by_id:
            by_id[rec.learner].rejected += 1
        if rec.level >= logging.WARNING:
            self.warnings.append(f"t={self.now:g} syncer {rec.event}: {getattr(rec, 'reason', rec.to_record())}")

    # ---------------------------------------------------------------- faults
    def _die(self, lr: _Learner) -> None:
        """The learner's process dies now: the step in progress and the work not yet sent
        are lost; what is on the wire still arrives."""
        if lr.state == _TRAIN:
            self._catch_up(lr, self.now)
            lr.acct["lost"] += self._computed(lr, lr.step_start, self.now)
        self._unplan(lr)
        lr.acct["lost"] += math.fsum(lr.done_cs - s for s in lr.sent_cs) / len(self.specs)
        lr.done_cs, lr.sent_cs = 0.0, [0.0] * len(self.specs)
        if lr.waiting is not None or lr.joining is not None:
            lr.idle += self.now - lr.blocked_since
        self._set_state(lr, _DOWN)
        lr.alive, lr.waiting, lr.joining, lr.inbox = False, None, None, []
        lr.fgen += 1
        lr.kill_token += 1
        lr.died_at = self.now
        if self.config.silence_timeout is not None:
            self._push(self.now + self.config.silence_timeout, _SILENT, (lr.index, lr.life))

    def _on_kill(self, i: int, rejoin_at: float | None) -> None:
        lr = self.learners[i]
        if not lr.alive:
            return
        self._die(lr)
        if rejoin_at is not None:
            self._push(rejoin_at, _REJOIN, (i, lr.kill_token))
        else:
            self._set_state(lr, _DEAD)  # not restarting: its chips are not coming back

    def _on_rejoin(self, i: int, token: int) -> None:
        lr = self.learners[i]
        if lr.alive or token != lr.kill_token:
            return
        assert lr.died_at is not None
        lr.down += self.now - lr.died_at
        lr.died_at = None
        self._start(lr, self.now)

    # ---------------------------------------------------------------- report
    def _report(self) -> SimReport:
        cfg = self.config
        out = []
        for lr in self.learners:
            idle, down = lr.idle, lr.down
            if lr.alive and (lr.waiting is not None or lr.joining is not None):
                idle += self.now - lr.blocked_since
            if not lr.alive and lr.died_at is not None:
                down += self.now - lr.died_at
            if lr.alive:
                for p in range(len(self.specs)):
                    self._materialize(lr, p)
            values = self.start if (lr.joining is not None or not lr.local) else [x for (x,) in lr.local]
            out.append(LearnerReport(
                learner=lr.lid, steps=lr.steps, idle_s=idle, down_s=down, sent=lr.sent, merged=lr.merged,
                merged_stale=lr.stale, rejected=lr.rejected, loss=self.loss(values),
                own_loss=self.loss(values, lr.target), chips=lr.chips, failures=lr.failures))
        gaps: list[float | None] = []
        for times in self._merge_times:
            points = [0.0] + times
            gaps.append(max((b - a for a, b in zip(points, points[1:])), default=None))
        known = [g for g in gaps if g is not None]
        # With one curvature for all learners the mean of quadratics is least at the mean optimum.
        centre = [torch.stack(ts).mean(0) for ts in zip(*(lr.target for lr in self.learners))]
        buckets = {k: math.fsum(lr.acct[k] for lr in self.learners) for k in _BUCKETS}
        goodput = Goodput(
            allocated=math.fsum(lr.chips for lr in self.learners) * cfg.duration,
            useful=buckets["computing"] - buckets["lost"] - buckets["slow"], slow=buckets["slow"],
            lost=buckets["lost"], down=buckets["down"], dead=buckets["dead"],
            paused=buckets["paused"], failed=buckets["failed"], blocked=buckets["blocked"],
            uptime=self._uptime / cfg.duration, failures=sum(lr.failures for lr in self.learners))
        return SimReport(
            duration=cfg.duration, seed=cfg.seed, learners=tuple(out),
            merges=tuple(len(t) for t in self._merge_times),
            version_lag_median=statistics.median(self._lags) if self._lags else None,
            version_lag_max=max(self._lags) if self._lags else None,
            max_merge_gap=max(known) if known else None, max_merge_gap_per_fragment=tuple(gaps),
            global_loss=self.loss([theta for (theta,) in (f.theta for f in self.syncer.frags)]),
            optimum_loss=self.loss(centre),
            initial_loss=self.loss(self.start), warnings=tuple(self.warnings), goodput=goodput)


def simulate(config: SimConfig) -> SimReport:
    """Run ``config`` to its end and report (``Simulation(config).run()``)."""
    return Simulation(config).run()
