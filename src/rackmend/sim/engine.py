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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

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
    LogRecord,
    SendUpdate,
    SyncerCore,
    Tick,
    WARNING_EVENTS,
)
from rackmend.sim.config import SimConfig

__all__ = ["SimulationError", "LearnerReport", "SimReport", "Simulation", "simulate"]


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
    """The syncer's warning records (``WARNING_EVENTS``) and learner warnings, in order."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Event kinds. Events at one instant run in the order they were pushed, whatever their kind.
_STEP, _ARRIVE, _DELIVER, _JOIN, _SILENT, _TICK, _KILL, _REJOIN, _WAIT_TIMEOUT = range(9)


@dataclass
class _Learner:
    index: int
    lid: str
    target: list[torch.Tensor]
    """Per fragment, this learner's optimum."""
    core: LearnerCore | None = None
    local: list[list[torch.Tensor]] = field(default_factory=list)
    """Per fragment, the local value of its tensors (one)."""
    alive: bool = False
    life: int = 0
    """Incarnation: events of an earlier life are dropped."""
    joining: dict[int, Update] | None = None
    inbox: list[Update] = field(default_factory=list)
    waiting: WaitForVersion | None = None
    blocked_since: float = 0.0
    up_free: float = 0.0
    down_free: float = 0.0
    died_at: float | None = None
    steps: int = 0
    idle: float = 0.0
    down: float = 0.0
    sent: int = 0
    merged: int = 0
    stale: int = 0
    rejected: int = 0


class Simulation:
    """One run of ``config``; ``run()`` returns its ``SimReport``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
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
        self.learners = [
            _Learner(i, lid, [c + config.target_spread * torch.randn(size, generator=gen) for c in centre])
            for i, lid in enumerate(config.learner_ids)]
        self.rngs = [random.Random(config.seed * 1_000_003 + i) for i in range(n)]
        self.syncer = SyncerCore(run, self.specs, [[t.clone()] for t in self.start])
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
        self.warnings: list[str] = []
        self.syncer_records: list[dict] = []
        """Every record the syncer core logged, in order."""

    # ---------------------------------------------------------------- public
    def run(self) -> SimReport:
        if self._ran:
            raise SimulationError("this Simulation has run already; make a new one to run again")
        self._ran = True
        cfg = self.config
        for lr in self.learners:
            self._start(lr, 0.0)
        for k in cfg.kills:
            self._push(k.at, _KILL, (k.learner,))
            if k.rejoin_at is not None:
                self._push(k.rejoin_at, _REJOIN, (k.learner,))
        handlers: dict[int, Callable[..., None]] = {
            _STEP: self._on_step, _ARRIVE: self._on_arrive, _DELIVER: self._on_deliver, _JOIN: self._on_join,
            _SILENT: self._on_silent, _TICK: self._on_tick, _KILL: self._on_kill, _REJOIN: self._on_rejoin,
            _WAIT_TIMEOUT: self._on_wait_timeout,
        }
        while self._heap and self._heap[0][0] <= cfg.duration:
            t, _, kind, args = heapq.heappop(self._heap)
            self.now = t
            handlers[kind](*args)
        self.now = cfg.duration
        return self._report()

    # ---------------------------------------------------------------- the model
    def loss(self, values: Sequence[torch.Tensor], target: Sequence[torch.Tensor] | None = None) -> float:
        """A learner's quadratic (``target`` its optimum) at ``values`` (one tensor per
        fragment); without ``target``, the global objective: the mean over all learners'."""
        if target is not None:
            return math.fsum(0.5 * float((h * (v.double() - c.double()) ** 2).sum())
                             for v, c, h in zip(values, target, self.curvature))
        return statistics.fmean(self.loss(values, lr.target) for lr in self.learners)

    def _train(self, lr: _Learner) -> None:
        with torch.no_grad():
            for (x,), c, h in zip(lr.local, lr.target, self.curvature):
                x.sub_(self.config.lr * h * (x - c))

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, args: tuple) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, args))

    def _start(self, lr: _Learner, now: float) -> None:
        """A (new) process of learner ``lr`` starts and joins."""
        lr.life += 1
        lr.alive = True
        lr.core = LearnerCore(self.config.run, self.specs, learner_id=lr.lid)
        # A fresh process's own init, overwritten by the join answer (SetValue); NaN so
        # that a value the join failed to set shows as a rejected contribution.
        lr.local = [[torch.full_like(t, math.nan)] for t in self.start]
        lr.joining, lr.inbox, lr.waiting = {}, [], None
        lr.blocked_since = now
        lr.up_free = lr.down_free = now
        self._push(now + self.config.racks[lr.index].uplink_latency, _JOIN, (lr.lid,))

    def _step_time(self, lr: _Learner, now: float) -> float:
        spec = self.config.racks[lr.index]
        factor = 1.0
        for s in self.config.slowdowns:
            if s.learner == lr.index and s.start <= now < s.end:
                factor *= s.factor
        u = self.rngs[lr.index].uniform(-1.0, 1.0) if spec.jitter else 0.0
        return spec.step_time * factor * (1.0 + spec.jitter * u)

    def _resume(self, lr: _Learner) -> None:
        assert lr.core is not None
        lr.idle += self.now - lr.blocked_since
        lr.core.handle(TrainingResumed(), self.now)
        self._push(self.now + self._step_time(lr, self.now), _STEP, (lr.index, lr.life))

    def _on_step(self, i: int, life: int) -> None:
        lr = self.learners[i]
        if not lr.alive or lr.life != life:
            return
        assert lr.core is not None
        self._train(lr)
        lr.steps += 1
        arrived, lr.inbox = tuple(lr.inbox), []
        lr.blocked_since = self.now
        self._carry(lr, lr.core.handle(InnerStepDone(self.config.racks[i].tokens, arrived), self.now))
        self._carry(lr, lr.core.handle(ApplyDue(), self.now))
        if lr.waiting is None:
            self._resume(lr)
        else:
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
                snap = [t.clone() for t in lr.local[a.fragment]]
                self._carry(lr, lr.core.handle(SnapshotTaken(a.fragment, snap), self.now))
            elif isinstance(a, (SetValue, Rebase, ApplyValue)):
                a.apply_to(lr.local[a.fragment])
            elif isinstance(a, SendFragment):
                lr.sent += 1
                spec = self.config.racks[lr.index]
                contribution, nbytes = a.build()
                lr.up_free = self._transfer(lr.up_free, nbytes, spec.uplink_bandwidth)
                self._push(lr.up_free + spec.uplink_latency, _ARRIVE, (contribution,))
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

    # ---------------------------------------------------------------- syncer side
    def _drive(self, event: Event) -> None:
        self._syncer_actions(self.syncer.handle(event, self.now))
        deadline = self.syncer.next_deadline()
        if deadline is not None and deadline not in self._ticks:
            self._ticks.add(deadline)
            self._push(max(deadline, self.now), _TICK, (deadline,))

    def _on_tick(self, deadline: float) -> None:
        self._ticks.discard(deadline)
        self._drive(Tick())

    def _on_join(self, lid: str) -> None:
        self._drive(LearnerJoined(lid))

    def _on_silent(self, i: int, life: int) -> None:
        lr = self.learners[i]
        if not lr.alive and lr.life == life:
            self._drive(LearnerLeft(lr.lid, "silent"))

    def _on_arrive(self, c: Contribution) -> None:
        key = (c.learner_id, c.fragment)
        prior = self._bases.get(key)
        self._bases[key] = c.base_version if prior is None else min(prior, c.base_version)
        rejected = self.syncer.rejected
        self._drive(ContributionArrived(c))
        if self.syncer.rejected > rejected:
            # Refused: its base is no merged work's (a refusal never merges in the same call).
            if prior is None:
                self._bases.pop(key, None)
            else:
                self._bases[key] = prior

    def _syncer_actions(self, actions: Sequence[Action]) -> None:
        by_id = {lr.lid: lr for lr in self.learners}
        for a in actions:
            if isinstance(a, SendUpdate):
                upd = replace(a.update, reset=True) if a.reset else a.update
                nbytes = self.specs[upd.fragment].nbytes
                for lid in a.to:
                    lr = by_id[lid]
                    if not lr.alive:
                        continue  # connected in the syncer's eyes until declared silent; nobody receives
                    spec = self.config.racks[lr.index]
                    lr.down_free = self._transfer(lr.down_free, nbytes, spec.downlink_bandwidth)
                    self._push(lr.down_free + spec.downlink_latency, _DELIVER, (lr.index, lr.life, upd))
            elif isinstance(a, LogRecord):
                self._record(a.record, by_id)
            # Fail-slow actions: the core applied their effect on membership already; their
            # advice to the learner is a log line, recorded with the warnings.

    def _record(self, rec: dict, by_id: dict[str, _Learner]) -> None:
        self.syncer_records.append(rec)
        event = rec["event"]
        if event == "merge":
            p = rec["fragment"]
            self._merge_times[p].append(self.now)
            stale = set(rec["stale"])
            for lid in rec["merged"]:
                lr = by_id[lid]
                lr.merged += 1
                lr.stale += lid in stale
                base = self._bases.pop((lid, p), rec["round"])
                self._lags.append(rec["round"] - base)
        elif event == "reject" and rec.get("learner") in by_id:
            by_id[rec["learner"]].rejected += 1
        if event in WARNING_EVENTS:
            self.warnings.append(f"t={self.now:g} syncer {event}: {rec.get('reason', rec)}")

    # ---------------------------------------------------------------- faults
    def _on_kill(self, i: int) -> None:
        lr = self.learners[i]
        if not lr.alive:
            return
        if lr.waiting is not None or lr.joining is not None:
            lr.idle += self.now - lr.blocked_since
        lr.alive, lr.waiting, lr.joining, lr.inbox = False, None, None, []
        lr.died_at = self.now
        if self.config.silence_timeout is not None:
            self._push(self.now + self.config.silence_timeout, _SILENT, (i, lr.life))

    def _on_rejoin(self, i: int) -> None:
        lr = self.learners[i]
        if lr.alive:
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
            values = self.start if lr.joining is not None else [x for (x,) in lr.local]
            out.append(LearnerReport(
                learner=lr.lid, steps=lr.steps, idle_s=idle, down_s=down, sent=lr.sent, merged=lr.merged,
                merged_stale=lr.stale, rejected=lr.rejected, loss=self.loss(values),
                own_loss=self.loss(values, lr.target)))
        gaps: list[float | None] = []
        for times in self._merge_times:
            points = [0.0] + times
            gaps.append(max((b - a for a, b in zip(points, points[1:])), default=None))
        known = [g for g in gaps if g is not None]
        # With one curvature for all learners the mean of quadratics is least at the mean optimum.
        centre = [torch.stack(ts).mean(0) for ts in zip(*(lr.target for lr in self.learners))]
        return SimReport(
            duration=cfg.duration, seed=cfg.seed, learners=tuple(out),
            merges=tuple(len(t) for t in self._merge_times),
            version_lag_median=statistics.median(self._lags) if self._lags else None,
            version_lag_max=max(self._lags) if self._lags else None,
            max_merge_gap=max(known) if known else None, max_merge_gap_per_fragment=tuple(gaps),
            global_loss=self.loss([theta for (theta,) in self.syncer.theta]),
            optimum_loss=self.loss(centre),
            initial_loss=self.loss(self.start), warnings=tuple(self.warnings))


def simulate(config: SimConfig) -> SimReport:
    """Run ``config`` to its end and report (``Simulation(config).run()``)."""
    return Simulation(config).run()
