"""The syncer's round logic as a sans-I/O state machine.

Feed it events with the current time (``core.handle(event, now)``); it returns
actions (send this fragment value to these learners, log this record). It never
reads a clock, sleeps, opens a socket or starts a thread, so the same object runs
in-process for tests, behind the ZeroMQ service, or inside a discrete-event
simulator. A driver must call ``handle(Tick(), now)`` once ``now`` reaches
``next_deadline()``.

Per fragment, independently: wait for ``min_quorum`` fresh contributions (based on
the current version), then for the
adaptive grace window (or until every expected, healthy learner is in), merge in
canonical order, run the outer optimizer on the syncer's own copy, bump the
version and send the new value to every connected learner.

No contribution is lost without a logged reason. Two pending contributions of one
learner are combined when they hold disjoint work (it applied a merged value between
them) and the newer replaces the older only when it already contains the older's
work. A graceful leave closes rounds that no longer wait for anyone, and
``FinalMerge`` (a driver stopping) merges whatever is still pending.

With a lossy downlink codec the outer step's change is encoded (with a syncer-side
error-feedback residual per fragment tensor) and the syncer's own value becomes the
old value plus the *decoded* change, exactly what every learner reconstructs; the
update then carries that encoded change as ``delta`` next to the full value.
"""

from __future__ import annotations

import cmath
import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Sequence, Union

import torch

from rackmend.codecs.base import Encoded
from rackmend.codecs.feedback import FeedbackEncoder
from rackmend.config import RackmendConfig
from rackmend.core.checkpoint_meta import CheckpointMeta
from rackmend.core.failslow import (
    AdviseLearner,
    FailSlowAction,
    FailSlowBlip,
    FailSlowMonitor,
    MarkForEviction,
    RestoreLearner,
    StopExpecting,
)
from rackmend.core.fragments import FragmentSpec, fragment_problem
from rackmend.core.merge import merge_deltas, merge_weights, normalized_weights, staleness_scale
from rackmend.core.messages import Contribution, MomentContribution, MomentUpdate, Update
from rackmend.core.moments import MomentKey, MomentRounds
from rackmend.core.syncer_fragment import (
    Round,
    SyncerFragment,
    check_tensors,
    contains,
    contribution_norm,
)
from rackmend.core.records import (
    Combined,
    Dropped,
    ExpectationSet,
    FailSlowNoted,
    FinalMerged,
    Guarded,
    Joined,
    Left,
    Merged,
    MergeHarmful,
    MomentsMerged,
    RejectCode,
    Rejected,
    Superseded,
    SyncerRecord,
    TokenUnits,
)

__all__ = [
    "SyncerCore",
    "LearnerJoined",
    "LearnerLeft",
    "ExpectationChanged",
    "ContributionArrived",
    "SyncTimed",
    "Tick",
    "FinalMerge",
    "MomentsArrived",
    "SendUpdate",
    "SendMomentUpdate",
    "Event",
    "Action",
    "Ema",
    "TOKEN_UNITS_RATIO",
    "HARMFUL_STREAK",
    "HARMFUL_LOSS",
    "MAX_C_STEPS",
    "MAX_TOKENS_PER_STEP",
    "MAX_STEP_TIME",
    "GUARD_STEPS_CAP",
    "RETIRED_SESSIONS",
]

TOKEN_UNITS_RATIO = 10.0
"""A learner whose tokens per step differ from the other learners' median by this factor
or more probably counts in other units (e.g. 1 per step beside batch x sequence): under
``tokens_sq_per_step`` its weight is off by the square of it. Racks whose batches really
differ that much get the warning once and can ignore it."""


MAX_C_STEPS = 10_000_000
"""Most inner steps one contribution may claim since its learner last received the
fragment: 10 steps a second for 11 days without a merged value. A larger count is
refused (``reject``); under ``tokens_sq_per_step`` it would buy weight for free."""

MAX_TOKENS_PER_STEP = float(2**40)
"""Most tokens one inner step may claim (c_tokens <= this x max(c_steps, 1)): about 10^12,
a thousand times the largest batches trained today. Bounds c_tokens**2 far below
float64's range and refuses a counter of e.g. 1e200 or 2**63 - 1 meant to take the
whole merge weight."""

MAX_STEP_TIME = 86_400.0
"""Most seconds per inner step a contribution may report (a day). Step times feed the
grace window estimate; an absurd one would stretch every round to ``grace_max``."""

GUARD_STEPS_CAP = 64.0
"""Most the norm guard's bound grows for a contribution holding more work than usual:
the first send after an outage carries every step made during it (49x the usual in
``benchmarks/chaos.py``) and is honestly that much larger, but ``c_steps`` is the
sender's word, so what a lie can buy is capped at this multiple."""

GUARD_RATE_SLACK = 4.0
"""How many times the reference step rate (the other learners', else the learner's own
recent one) a learner's step counter may advance between two of its sends before the
guard credits it no more than the usual steps: a learner claiming 64x its steps and
stepping its counter to match would otherwise buy a 64x bound every time."""
STEP_RATES_KEPT = 32
"""Recent step rates remembered per learner (the reference of the check above)."""

MAX_SEQ = 2**63 - 1
"""The largest sequence number the wire carries."""
RETIRED_SESSIONS = 16
"""Per (learner, fragment), how many earlier sessions are remembered with their last
``seq`` (a stopped session may go on past it); an older session than those, at or below
the newest one forgotten (the floor), is refused whole. Learners number sessions from
the clock, so a restarted learner's session is above the floor."""


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class LearnerJoined:
    """A learner connected (first time or again); it is sent every fragment's value."""

    learner_id: str


@dataclass(frozen=True)
class LearnerLeft:
    """A learner left or was declared gone; rounds stop waiting for it at once."""

    learner_id: str
    reason: str = "leave"


@dataclass(frozen=True)
class ExpectationChanged:
    """Start or stop counting a connected learner as expected (slow, silent, back)."""

    learner_id: str
    expected: bool
    reason: str = ""


@dataclass(frozen=True)
class ContributionArrived:
    """A learner's outer gradient for one fragment."""

    contribution: Contribution


@dataclass(frozen=True)
class SyncTimed:
    """The driver measured how long merging and sending a fragment took."""

    fragment: int
    seconds: float


@dataclass(frozen=True)
class Tick:
    """Time passed; lets grace windows expire."""


@dataclass(frozen=True)
class FinalMerge:
    """The driver is stopping: merge every fragment's pending contributions now,
    whatever quorum or grace window they still wait for, so work that was sent is
    in the global value (and in the checkpoint written after this)."""


@dataclass(frozen=True)
class MomentsArrived:
    """DES-LOC: a learner's optimizer moments of one kind for one fragment."""

    contribution: MomentContribution


Event = Union[LearnerJoined, LearnerLeft, ExpectationChanged, ContributionArrived, SyncTimed, Tick, FinalMerge,
              MomentsArrived]


# ---------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class SendUpdate:
    """Send ``update`` to each learner in ``to``."""

    update: Update
    to: tuple[str, ...]
    reset: bool = False
    """Sent as a rejoin answer: adopted whatever the learner holds (its base was lost)."""


@dataclass(frozen=True)
class SendMomentUpdate:
    """DES-LOC: send the averaged moments ``update`` to each learner in ``to``."""

    update: MomentUpdate
    to: tuple[str, ...]


Action = Union[SendUpdate, SyncerRecord, FailSlowAction, SendMomentUpdate]
"""What ``handle`` returns. A ``SyncerRecord`` (``rackmend.core.records``: ``Merged``,
``Rejected``, ...) is typed: drivers dispatch on its type, and ``to_record()`` gives its
JSONL log line. Fail-slow actions come with a ``FailSlowNoted`` record; a driver that
only logs can ignore them (the core applied their effect on membership already), a
network driver sends ``AdviseLearner`` reports to the learner."""


HARMFUL_STREAK = 3
"""Consecutive merges of a fragment whose median reported merge gain is below
``-HARMFUL_LOSS`` before a ``merge_harmful`` warning: one probe batch is noisy, a
streak is not."""

HARMFUL_LOSS = 0.05
"""A merge that makes the probe loss more than 5 % worse counts as harmful. Overwriting
drops the tau local steps made since the send, so small negative gains are normal."""


def _share(absent: float, present: Sequence[float]) -> float:
    """The share of a round's weight given to absent learners (0 when none are)."""
    total = absent + math.fsum(present)
    return absent / total if absent > 0.0 and total > 0.0 else 0.0


def _finite(t: torch.Tensor) -> bool:
    """All elements finite. A finite sum proves it (any NaN/Inf poisons the sum) with a
    read-only reduction; only a non-finite sum (or an overflow) needs the exact check.
    The sum is tested as a Python number: ``torch.isfinite`` of it costs several
    operators, more than the sum itself for a small tensor."""
    if t.numel() == 0 or cmath.isfinite(t.sum().item()):
        return True
    return bool(torch.isfinite(t).all())


class Ema:
    """Exponential moving average; ``value`` is None until the first sample."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


class _Changes:
    """One core's count of changes to its members: its views of the membership
    (``connected_learners``, ``expected_learners``) are kept until it moves."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


@dataclass
class _Member:
    changes: _Changes = field(repr=False, compare=False)
    """Its core's counter, bumped by every change of this member, whoever makes it."""
    connected: bool
    expected: bool

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name != "changes":
            self.changes.n += 1


class SyncerCore:
    """Per-fragment quorum, grace, merge and outer step. See the module docstring."""

    def __init__(
        self,
        config: RackmendConfig,
        fragments: Sequence[FragmentSpec],
        initial: Sequence[Sequence[torch.Tensor]],
        epoch: int = 0,
    ) -> None:
        if len(initial) != len(fragments):
            raise ValueError(f"initial has {len(initial)} fragments, the layout has {len(fragments)}")
        self.config = config
        self.fragments = list(fragments)
        sc = config.syncer
        self.frags = [SyncerFragment(p, spec, values, sc.build_outer_optimizer, epoch,
                                     keep_history=sc.anchoring == "syncer")
                      for p, (spec, values) in enumerate(zip(self.fragments, initial))]
        """Each fragment's value, optimizer, version, round, history and guard window."""
        self.epoch = epoch
        """This run's epoch: stamped on every value sent (``Update.epoch``)."""
        self.lineage: list[tuple[int, list[int]]] = []
        """The earlier epochs this run's state descends from (through checkpoints), oldest
        first, each with the versions per fragment this run kept of it: its values up to
        those are this run's too; its later ones were lost in a crash. Set by
        ``load_state_dict``; empty for a new run."""
        self._changes = _Changes()
        self.members: dict[str, _Member] = {
            lid: _Member(self._changes, connected=False, expected=True) for lid in sc.learners
        }
        self.step_times: dict[str, Ema] = {}
        """Per learner, a moving average of its reported step time. The fleet's step
        time (``step_time_estimate``) is their lower median, so no single learner, by
        an absurd report or by being slow, can stretch every round's grace window."""
        self.xi_quorum = Ema(sc.ema_decay)
        self.xi_sync = Ema(sc.ema_decay)
        self.rejected = 0
        self.tokens_per_step: dict[str, float] = {}
        """Per learner, tokens per step of its latest contribution (for ``token_units``)."""
        self._rates: list[float] = []
        """``tokens_per_step``'s values, sorted (the median of the others without a sort per send)."""
        self._units_warned: set[str] = set()
        self._membership: tuple[tuple[int, int], tuple[str, ...], frozenset[str]] | None = None
        """``_members_view``'s (key, connected, expected): key is (``_changes.n``, the
        member count) when they were computed."""
        self.last_counts: dict[str, tuple[float, int]] = {}
        """Per learner, (c_tokens, c_steps) of its latest merged contribution: the weight
        it is counted with in a round it misses (``count_absent``)."""
        self._last_send: dict[tuple[str, int], tuple[float, int]] = {}
        """Per (learner, fragment), when its last accepted send arrived and the learner
        step it was of: how many steps the next one can honestly claim."""
        self._step_rates: dict[str, deque[float]] = {}
        """Per learner, its recent steps per second between accepted sends of a fragment."""
        self.last_merged: dict[tuple[str, int], int] = {}
        """Per (learner, fragment), the version its work last went into: only a learner
        whose work still arrives counts as absent (an idle peer must not damp every merge)."""
        self.sequences: dict[tuple[str, int], tuple[int, int]] = {}
        """Per (learner, fragment), the session and highest ``seq`` accepted (replay guard)."""
        self.session_floor: dict[tuple[str, int], int] = {}
        """Per (learner, fragment), the newest session dropped from ``retired_sessions``:
        a send of a session at or below it is a replay, however many sessions there were
        (before, session 1 replayed after 20 sessions merged)."""
        self.retired_sessions: dict[tuple[str, int], dict[int, int]] = {}
        """Per (learner, fragment), earlier sessions and the highest ``seq`` accepted of each,
        newest last (at most RETIRED_SESSIONS). An earlier session may go on past that seq:
        a learner whose id another connection used meanwhile (a takeover while it was
        stopped) comes back in its own session and must not be locked out."""
        downlink = config.compression.build_downlink()
        self.downlink: FeedbackEncoder | None = None if downlink.lossless else FeedbackEncoder(downlink)
        """Residual and codec state per (fragment, tensor) of a lossy downlink codec."""
        config.compression.require_float32(
            "downlink", ((t.name, t.dtype) for spec in self.fragments for t in spec.tensors))
        self.failslow: FailSlowMonitor | None = None if config.deterministic or not sc.failslow else FailSlowMonitor(
            min_slowdown=sc.failslow_min_slowdown, min_steps=sc.failslow_min_steps,
            false_alarm_steps=sc.failslow_false_alarm_steps, baseline_steps=sc.failslow_baseline_steps,
            advise_after=sc.failslow_advise_after, evict_cost=sc.failslow_evict_cost)
        """Step-time detectors and the fail-slow ladder (None: off, or deterministic mode)."""
        self._failslow_resumed: set[str] = set()
        """Learners whose fail-slow state came from a checkpoint and who have not sent
        since: their (re)join after a syncer restart keeps that state."""
        self.moments = MomentRounds(config, self.fragments, epoch)
        """DES-LOC's moment rounds (``rackmend.core.moments``); idle unless the run has it on."""

    # ------------------------------------------------------------------ public API
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event at time ``now`` (seconds, any monotonic origin)."""
        actions: list[Action] = []
        if isinstance(event, ContributionArrived):
            p = self._accept(event.contribution, now, actions)
            if p is not None:
                self._watch_step_time(event.contribution, now, actions)
                self._maybe_close(p, now, actions)
        elif isinstance(event, Tick):
            self._close_all_due(now, actions)
        elif isinstance(event, LearnerJoined):
            self._join(event.learner_id, now, actions)
        elif isinstance(event, LearnerLeft):
            m = self.members.get(event.learner_id)
            if self.failslow is not None:
                self.failslow.forget(event.learner_id)  # a rack that comes back may be another machine
                self._failslow_resumed.discard(event.learner_id)
            if m is not None:
                m.connected, m.expected = False, False
                actions.append(Left(t=now, learner=event.learner_id, reason=event.reason))
            if event.reason == "leave":
                # Only a graceful leave: a learner declared silent may come back, adopt
                # the value it missed while keeping its local progress, and send that
                # progress again; merging its pending work now would count it twice.
                self._close_after_leave(now, actions)
            self._close_all_due(now, actions)
        elif isinstance(event, ExpectationChanged):
            m = self.members.get(event.learner_id)
            if m is not None and m.expected != event.expected:
                m.expected = event.expected
                actions.append(
                    ExpectationSet(t=now, learner=event.learner_id, expected=event.expected, reason=event.reason)
                )
            self._close_all_due(now, actions)
        elif isinstance(event, SyncTimed):
            self.xi_sync.add(max(0.0, event.seconds))
        elif isinstance(event, FinalMerge):
            self._final_merge(now, actions)
        elif isinstance(event, MomentsArrived):
            self._accept_moments(event.contribution, now, actions)
        else:
            raise TypeError(f"unknown event {event!r}")
        return actions

    def next_deadline(self) -> float | None:
        """Earliest time a grace window expires, or None when nothing waits on time."""
        deadlines = [f.round.clock.deadline for f in self.frags if f.round.clock.deadline is not None]
        moments = self.moments.next_deadline()
        if moments is not None:
            deadlines.append(moments)
        return min(deadlines) if deadlines else None

    def grace(self) -> float:
        """clamp(gamma * (slack_steps * xi_step - xi_quorum - xi_sync), 0, grace_max),
        slack_steps = tau, or H - tau when learners keep late progress
        (``RackmendConfig.grace_slack_steps``)."""
        sc = self.config.syncer
        xi_step = self.step_time_estimate()
        if xi_step is None:
            return sc.grace_max
        slack = (
            self.config.grace_slack_steps() * xi_step
            - (self.xi_quorum.value or 0.0)
            - (self.xi_sync.value or 0.0)
        )
        return min(max(sc.grace_gamma * slack, 0.0), sc.grace_max)

    def step_time_estimate(self) -> float | None:
        """The fleet's inner-step time: the lower median of the connected learners'
        moving averages (all known learners' when none is connected), learners flagged
        fail-slow left out; None before any."""
        connected = set(self.connected_learners())
        # A learner flagged fail-slow would stretch every grace window: left out.
        known = {lid: e.value for lid, e in self.step_times.items()
                 if e.value is not None and not (self.failslow is not None and self.failslow.is_slow(lid))}
        values = sorted(v for lid, v in known.items() if lid in connected) or sorted(known.values())
        return values[(len(values) - 1) // 2] if values else None

    def expected_learners(self) -> frozenset[str]:
        """Learners a round waits for before ending early."""
        return self._members_view()[2]

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The current global value of every synchronised tensor (parameters and floating
        buffers), by canonical name (shared; do not modify)."""
        return {spec.name: t for f in self.frags for spec, t in zip(f.spec.tensors, f.current.tensors)}

    @property
    def versions(self) -> list[int]:
        """Each fragment's current version (a copy)."""
        return [f.version for f in self.frags]

    def connected_learners(self) -> tuple[str, ...]:
        return self._members_view()[1]

    def _members_view(self) -> tuple[tuple[int, int], tuple[str, ...], frozenset[str]]:
        """(key, connected learners sorted, expected learners), computed again only after
        a member changed (asked for at every contribution and merge)."""
        key = (self._changes.n, len(self.members))
        view = self._membership
        if view is None or view[0] != key:
            members = self.members
            deterministic = self.config.deterministic
            view = self._membership = (
                key, tuple(sorted(lid for lid, m in members.items() if m.connected)),
                frozenset(lid for lid, m in members.items() if m.expected and (m.connected or deterministic)))
        return view

    def state_dict(self) -> tuple[dict[str, torch.Tensor], CheckpointMeta]:
        """Everything a restarted syncer needs: (tensors by name, the rest, typed).
        Pending contributions are not kept: their senders send again next period."""
        tensors: dict[str, torch.Tensor] = {}
        per: list[dict[str, Any]] = []
        for f in self.frags:
            t, m = f.state_dict()
            tensors.update(t)
            per.append(m)
        meta = CheckpointMeta(
            fragments=per,
            ema={"step": self.step_time_estimate(), "quorum": self.xi_quorum.value, "sync": self.xi_sync.value},
            step_times={lid: e.value for lid, e in sorted(self.step_times.items()) if e.value is not None},
            rejected=self.rejected,
            learners=sorted(self.members),
            # A restarted syncer must still refuse replays of what it merged before, and
            # keep the guard's scale rather than start unguarded.
            sequences=[[lid, p, sess, seq, [list(r) for r in self.retired_sessions.get((lid, p), {}).items()]]
                       for (lid, p), (sess, seq) in sorted(self.sequences.items())],
            session_floors=[[lid, p, floor] for (lid, p), floor in sorted(self.session_floor.items())],
            last_counts={lid: [t, n] for lid, (t, n) in sorted(self.last_counts.items())},
            last_merged=[[lid, p, v] for (lid, p), v in sorted(self.last_merged.items())],
            epoch=self.epoch,
            lineage=[[e, list(kept)] for e, kept in self.lineage],
            failslow=None if self.failslow is None else self.failslow.state_dict(),
        )
        if self.downlink is not None:
            for name, t in self.downlink.state_dict().items():
                tensors[f"downlink/{name}"] = t
        if self.moments.enabled:
            moment_tensors, meta.moments = self.moments.state_dict()
            tensors.update(moment_tensors)
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: CheckpointMeta) -> None:
        """Restore from ``state_dict()``'s output (same layout and config); ``meta`` as
        ``CheckpointMeta.from_json`` upgraded it, whatever format it was saved in."""
        if len(meta.fragments) != len(self.fragments):
            raise ValueError(f"checkpoint has {len(meta.fragments)} fragments, the layout has {len(self.fragments)}")
        for f, part in zip(self.frags, meta.fragments):
            f.load_state_dict(tensors, part)
        for lid, value in meta.step_times.items():
            self.step_times.setdefault(lid, Ema(self.config.syncer.ema_decay)).value = float(value)
        self.xi_quorum.value = meta.ema["quorum"]
        self.xi_sync.value = meta.ema["sync"]
        self.rejected = int(meta.rejected)
        for lid in meta.learners:
            self.members.setdefault(lid, _Member(self._changes, connected=False, expected=True))
        for lid, p, sess, seq, retired in meta.sequences:
            self.sequences[(lid, int(p))] = (int(sess), int(seq))
            # Format 1 before the seq of retired sessions was kept: any send of one was refused.
            self.retired_sessions[(lid, int(p))] = {
                int(r[0]) if isinstance(r, list) else int(r): int(r[1]) if isinstance(r, list) else MAX_SEQ
                for r in retired}
        for lid, p, floor in meta.session_floors:
            self.session_floor[(lid, int(p))] = int(floor)
        for lid, (t, n) in meta.last_counts.items():
            self.last_counts[lid] = (float(t), int(n))
        for lid, p, v in meta.last_merged:
            self.last_merged[(lid, int(p))] = int(v)
        # The run that wrote the checkpoint made the values up to its versions; anything
        # it made after them is lost. (Checkpoints older than epochs have no lineage.)
        self.lineage = [(int(e), [int(v) for v in kept]) for e, kept in meta.lineage]
        if meta.epoch is not None:
            self.lineage.append((meta.epoch, meta.versions))
        if self.failslow is not None and meta.failslow is not None:
            # Baselines take hundreds of steps to learn, and a learner flagged slow stays
            # flagged (not waited for) until its steps are back, across the restart.
            self.failslow.load_state_dict(meta.failslow)
            self._failslow_resumed = {lid for lid, _ in self.failslow.detectors}
            for lid in self.failslow.cases:
                if lid in self.members:
                    self.members[lid].expected = False
        if self.downlink is not None:
            # Without the residual, what the codec held back before the checkpoint is lost.
            self.downlink.load_state_dict(
                {k.removeprefix("downlink/"): v for k, v in tensors.items() if k.startswith("downlink/")})
        if self.moments.enabled and meta.moments is not None:
            self.moments.load_state_dict(tensors, meta.moments)

    # ------------------------------------------------------------------ internals
    @torch.no_grad()
    def _compress_change(self, p: int, old: list[torch.Tensor]) -> tuple[Encoded, ...]:
        """Encode theta - old per tensor (with feedback) and set theta = old + decoded:
        the same sum, in the same order, that learners compute from what they hold."""
        assert self.downlink is not None
        out = []
        for i, (theta, base) in enumerate(zip(self.frags[p].theta, old)):
            enc, dec = self.downlink.encode_decoded((p, i), theta - base)
            theta.copy_(base + dec)
            out.append(enc)
        return tuple(out)

    def _join(self, lid: str, now: float, actions: list[Action]) -> None:
        if self.failslow is not None and lid not in self._failslow_resumed:
            self.failslow.forget(lid)  # expected again below; its baseline is learnt anew
        m = self.members.setdefault(lid, _Member(self._changes, connected=True, expected=True))
        # Only a learner flagged before a syncer restart is still slow here: not waited for.
        m.connected, m.expected = True, not (self.failslow is not None and self.failslow.is_slow(lid))
        actions.append(Joined(t=now, learner=lid, expected=m.expected))
        for f in self.frags:
            actions.append(SendUpdate(f.current, (lid,)))

    def _reject(self, c: Contribution, now: float, code: RejectCode, reason: str, actions: list[Action]) -> None:
        self.rejected += 1
        actions.append(Rejected(t=now, learner=c.learner_id, fragment=c.fragment, code=code, reason=reason))

    def _accept(self, c: Contribution, now: float, actions: list[Action]) -> int | None:
        p = c.fragment
        problem = fragment_problem(p, len(self.fragments))
        if problem:
            self._reject(c, now, "unknown_fragment", problem, actions)
            return None
        if c.learner_id not in self.members or not self.members[c.learner_id].connected:
            self._reject(c, now, "not_joined", "learner has not joined", actions)
            return None
        frag = self.frags[p]
        problem = check_tensors(frag.spec, c.tensors)
        if problem:
            self._reject(c, now, "layout", problem, actions)
            return None
        if c.c_steps < 0 or c.c_tokens < 0 or not c.step_time >= 0:
            self._reject(c, now, "counters", "negative or NaN counters", actions)
            return None
        problem = self._check_bounds(c)
        if problem:
            self._reject(c, now, "bounds", problem, actions)
            return None
        version = frag.version
        if not self._holds(c.base_epoch, p, c.base_version):
            self._reject(
                c, now, "epoch", f"based on version {c.base_version} of another syncer run (epoch {c.base_epoch}), "
                f"which this run (epoch {self.epoch}) does not hold: lost in a crash before a checkpoint, or from "
                f"another training run; the learner is sent the current value (version {version})", actions)
            actions.append(SendUpdate(frag.current, (c.learner_id,), reset=True))
            return None
        if c.base_version > version:
            self._reject(c, now, "ahead", f"base version {c.base_version} is ahead of the syncer's {version}",
                         actions)
            return None
        if version - c.base_version > self.config.syncer.max_staleness:
            self._reject(
                c, now, "stale", f"stale: base version {c.base_version}, current {version}, "
                f"max_staleness {self.config.syncer.max_staleness}", actions,
            )
            return None
        norm = contribution_norm(c.tensors)  # NaN: a value is not finite
        if math.isnan(norm):
            self._reject(c, now, "non_finite", "non-finite values (NaN or Inf)", actions)
            return None
        problem = self._check_sequence(c)
        if problem:
            self._reject(c, now, "replay", problem, actions)
            return None
        guarded = self._guard(c, norm, now, actions)
        if guarded is None:
            return None
        rnd = frag.round
        lid = c.learner_id
        if guarded is not c:
            rnd.clipped.add(lid)
        accepted_norm = norm if guarded is c else None
        c = guarded
        self._note_sequence(c)
        self._note_send(c, now)
        old = rnd.pending.get(lid)
        if old is None:
            rnd.pend(lid, c, accepted_norm)
        elif c.step <= old.step and (c.step == old.step or contains(old, c)):
            # A repeat, or an older send arriving late whose work the pending one holds.
            actions.append(Superseded(t=now, learner=lid, fragment=p, step=c.step, by_step=old.step,
                                      base_version=c.base_version, by_base_version=old.base_version))
            return p
        elif c.step > old.step and contains(c, old):
            # Cumulative: the new send holds all of the old one's work, so replacing
            # loses nothing (older disjoint work in ``carried`` stays).
            actions.append(Superseded(t=now, learner=lid, fragment=p, step=old.step, by_step=c.step,
                                      base_version=old.base_version, by_base_version=c.base_version))
            rnd.pend(lid, c, accepted_norm)
        else:
            # Disjoint work (the learner applied a merged value between the sends): both merge.
            older, newer = (old, c) if old.step < c.step else (c, old)
            rnd.carry(lid, older, self._bytes_in(p, older))
            if newer is c:
                rnd.pend(lid, c, accepted_norm)
            actions.append(Combined(
                t=now, learner=lid, fragment=p, steps=(older.step, newer.step),
                base_versions=(older.base_version, newer.base_version),
                c_steps=(older.c_steps, newer.c_steps), c_tokens=(older.c_tokens, newer.c_tokens)))
        if c.base_version == version:
            rnd.clock.arrived(now)
        if c.step_time > 0:
            self.step_times.setdefault(lid, Ema(self.config.syncer.ema_decay)).add(c.step_time)
        self._check_units(c, now, actions)
        return p

    def _holds(self, epoch: int, p: int, version: int) -> bool:
        """Whether the value ``version`` of fragment ``p`` as sent in ``epoch`` is the one
        this run has under that number (this epoch, or an ancestor up to what was kept)."""
        return epoch == self.epoch or any(e == epoch and version <= kept[p] for e, kept in self.lineage)

    @staticmethod
    def _check_bounds(c: Contribution) -> str | None:
        """Why ``c``'s counters are beyond what any honest learner reports, or None."""
        if c.c_steps > MAX_C_STEPS:
            return f"c_steps {c.c_steps} exceeds the bound MAX_C_STEPS={MAX_C_STEPS}"
        limit = MAX_TOKENS_PER_STEP * max(c.c_steps, 1)
        if not c.c_tokens <= limit:
            return (f"c_tokens {c.c_tokens:g} exceeds the bound of MAX_TOKENS_PER_STEP={MAX_TOKENS_PER_STEP:g} "
                    f"per step over {c.c_steps} steps")
        if not c.step_time <= MAX_STEP_TIME:
            return f"step_time {c.step_time:g} s exceeds the bound MAX_STEP_TIME={MAX_STEP_TIME:g} s"
        if not c.rank_step_time <= MAX_STEP_TIME or c.rank_step_time < 0 or not 0 <= c.rank_steps <= MAX_C_STEPS:
            return (f"rank_step_time {c.rank_step_time:g} s over rank_steps {c.rank_steps} is outside "
                    f"[0, MAX_STEP_TIME={MAX_STEP_TIME:g} s] x [0, MAX_C_STEPS={MAX_C_STEPS}]")
        return None

    def _check_sequence(self, c: Contribution) -> str | None:
        """Why ``c`` is a replay (or an older send than one accepted), or None."""
        if c.seq <= 0:
            return None
        key = (c.learner_id, c.fragment)
        current = self.sequences.get(key)
        if current is not None and current[0] == c.session:
            if c.seq <= current[1]:
                return (f"replay or older send: seq {c.seq} of session {c.session}, "
                        f"seq {current[1]} was accepted already")
        elif c.session in self.retired_sessions.get(key, {}):
            if c.seq <= self.retired_sessions[key][c.session]:
                return (f"replay: seq {c.seq} of the earlier session {c.session} of this learner, "
                        f"seq {self.retired_sessions[key][c.session]} of it was accepted already")
        elif c.session <= self.session_floor.get(key, -1):
            return (f"replay: session {c.session} is older than the {RETIRED_SESSIONS} sessions of this learner "
                    "remembered (a learner numbers its sessions from its clock; one whose clock went back past "
                    "them restarts with a new id)")
        return None

    def _note_sequence(self, c: Contribution) -> None:
        if c.seq <= 0:
            return
        key = (c.learner_id, c.fragment)
        current = self.sequences.get(key)
        if current is not None and current[0] != c.session:
            retired = self.retired_sessions.setdefault(key, {})
            retired.pop(c.session, None)  # current again
            retired[current[0]] = current[1]
            for old in list(retired)[:-RETIRED_SESSIONS]:
                del retired[old]
                self.session_floor[key] = max(self.session_floor.get(key, -1), old)
        self.sequences[key] = (c.session, c.seq)

    def _guard(self, c: Contribution, norm: float, now: float, actions: list[Action]) -> Contribution | None:
        """``c`` (of finite values, L2 norm ``norm``), clipped to its bound when above it;
        None (rejected) when its norm overflows float64. The bound is ``norm_guard`` x
        the scale for its sender (``SyncerFragment.scale_for``: the lower median of the
        recent merged norms the other learners sent, under growth caps) x the work ``c``
        holds in units of the usual: the steps credited to it (``_credited``) over the
        usual, plus one usual period per version its base is behind (a learner whose
        updates stopped arriving sends the drift since its base every time), at least 1
        and at most ``GUARD_STEPS_CAP``. Nothing here changes the scale: norms enter the
        window when they are merged (``SyncerFragment.note_norms``), so a burst of sends
        within a round cannot move it."""
        if not math.isfinite(norm):
            self._reject(c, now, "norm_overflow", "outer gradient norm overflows float64", actions)
            return None
        frag = self.frags[c.fragment]
        scale = frag.scale_for(c.learner_id)
        factor = self.config.syncer.norm_guard
        if factor > 0 and scale is not None:
            usual_steps = frag.guard_usual_steps()
            behind = frag.version - c.base_version  # <= max_staleness, checked before
            credited, doubt = self._credited(c, usual_steps, now)
            work = min(GUARD_STEPS_CAP, (max(1.0, credited / usual_steps) if usual_steps > 0 else 1.0) + behind)
            bound = factor * scale * work
            if norm > bound:
                actions.append(Guarded(
                    t=now, learner=c.learner_id, fragment=c.fragment, step=c.step, norm=norm, median=scale,
                    c_steps=c.c_steps, usual_steps=usual_steps, behind=behind, bound=bound, action="clipped",
                    reason=(f"learner {c.learner_id}'s outer gradient for fragment {c.fragment} has norm {norm:.4g}, "
                            f"more than norm_guard={factor:g} x the guard's scale {scale:.4g} (the median of recent "
                            "norms of the other learners, capped in its growth)"
                            + (f" x {work:.3g} for {credited:.4g} steps (usually {usual_steps}) on a base "
                               f"{behind} versions behind" if work > 1 else "")
                            + (f"; {doubt}" if doubt else "")
                            + f": clipped to {bound:.4g}. If this names honest learners, raise SyncerConfig.norm_guard")))
                return replace(c, tensors=tuple((t.to(torch.float64) * (bound / norm)).to(t.dtype) for t in c.tensors))
        return c

    def _credited(self, c: Contribution, usual: int, now: float) -> tuple[float, str | None]:
        """The steps of ``c`` the guard credits, and why fewer than it claims (None: all).
        ``c_steps`` is the sender's word, and honestly cumulative (a learner that adopted
        a rejoin answer, or whose merges do not arrive, sends all its progress since
        its last applied value every time), so it is not compared with the steps since
        the last send; but the step counter must advance at a believable rate: when it
        advanced faster than ``GUARD_RATE_SLACK`` x the reference step rate (the other
        learners' median, else the learner's own recent one) since the learner's last
        accepted send of the fragment, or went back, no more than the usual is
        credited."""
        claimed = float(c.c_steps)
        prev = self._last_send.get((c.learner_id, c.fragment))
        if prev is None or claimed <= usual:
            return claimed, None
        t0, step0 = prev
        advance = c.step - step0
        if advance <= 0:
            return float(usual), (f"its step counter did not advance since its last send ({step0} -> {c.step}): "
                                  f"credited the usual {usual} steps, not the {c.c_steps} it claims")
        reference = self._reference_rate(c.learner_id)
        elapsed = now - t0
        if reference is not None and advance > GUARD_RATE_SLACK * reference * elapsed + usual:
            return float(usual), (f"its step counter advanced {advance} steps in {elapsed:.3g} s, over "
                                  f"{GUARD_RATE_SLACK:g}x the reference rate of {reference:.3g} steps/s: credited the "
                                  f"usual {usual} steps, not the {c.c_steps} it claims")
        return claimed, None

    def _reference_rate(self, learner: str) -> float | None:
        """The median of the other learners' median step rates; the learner's own median
        when no other has one; None when neither has."""
        own = None
        medians = []
        for lid, rates in self._step_rates.items():
            if rates:
                m = sorted(rates)[len(rates) // 2]
                if lid == learner:
                    own = m
                else:
                    medians.append(m)
        return sorted(medians)[len(medians) // 2] if medians else own

    def _note_send(self, c: Contribution, now: float) -> None:
        """Remember an accepted send's time and step, and the learner's step rate since
        its previous one (for ``_credited``)."""
        key = (c.learner_id, c.fragment)
        prev = self._last_send.get(key)
        if prev is not None and c.step > prev[1] and now > prev[0]:
            rates = self._step_rates.setdefault(c.learner_id, deque(maxlen=STEP_RATES_KEPT))
            rates.append((c.step - prev[1]) / (now - prev[0]))
        # Also when the counter went back (a restart from a checkpoint): the next send is
        # measured from the new count; the time limit keeps a late old send from paying.
        self._last_send[key] = (now, c.step)

    def _check_units(self, c: Contribution, now: float, actions: list[Action]) -> None:
        """Warn once per learner whose tokens per step look like other units than the
        rest of the fleet's: its merge weight would be off by that factor, silently."""
        if c.c_steps <= 0:
            return
        rate = c.c_tokens / c.c_steps
        rates = self._rates
        old = self.tokens_per_step.get(c.learner_id)
        if old != rate:
            if old is not None:
                del rates[bisect_left(rates, old)]
            insort(rates, rate)
            self.tokens_per_step[c.learner_id] = rate
        if len(rates) < 2 or c.learner_id in self._units_warned:
            return
        # The others' median: the sorted rates without one entry equal to this learner's.
        k = (len(rates) - 1) // 2
        median = rates[k] if k < bisect_left(rates, rate) else rates[k + 1]
        if rate > 0 and median > 0 and max(rate / median, median / rate) < TOKEN_UNITS_RATIO:
            return
        self._units_warned.add(c.learner_id)
        actions.append(TokenUnits(
            t=now, learner=c.learner_id, tokens_per_step=rate, others_median=median,
            reason=(f"learner {c.learner_id} reports {rate:g} tokens per step, the others a median of "
                    f"{median:g}: its merges weigh {'almost nothing' if rate < median else 'almost everything'} unless its "
                    "batches really are that different. Pass step(tokens=...) in the same unit on every rack "
                    "(or set LearnerConfig.tokens_per_step where step() is called without tokens)")))

    def _bytes_in(self, p: int, c: Contribution) -> int:
        return self.fragments[p].nbytes if c.encoded is None else sum(e.nbytes() for e in c.encoded)

    def _close_after_leave(self, now: float, actions: list[Action]) -> None:
        """After a graceful leave, close each round with pending work that now waits
        for nobody: every remaining expected learner is in with fresh work, or nobody
        is expected at all. ``min_quorum`` is not awaited here: the learners that could
        still make it up are all in already, and without this close the leaver's last
        contribution would sit pending until someone joins, or forever."""
        expected = self.expected_learners()
        for p, frag in enumerate(self.frags):
            if not frag.round.pending:
                continue
            fresh = {lid for lid, c in frag.round.pending.items() if c.base_version == frag.version}
            if expected <= fresh:
                self._merge(p, now, actions, cause="leave")
        for key in self.moments.pending_keys():
            if self.moments.due(key, now, expected, self.grace, leave=True):
                self._merge_moments(key, now, actions)

    def _final_merge(self, now: float, actions: list[Action]) -> None:
        pending = {p: sorted(f.round.pending) for p, f in enumerate(self.frags) if f.round.pending}
        actions.append(FinalMerged(t=now, fragments=tuple(sorted(pending)),
                                   learners={str(p): tuple(ids) for p, ids in pending.items()}))
        for p in pending:
            self._merge(p, now, actions, cause="final")
        for key in self.moments.pending_keys():
            self._merge_moments(key, now, actions)

    def _close_all_due(self, now: float, actions: list[Action]) -> None:
        for p in range(len(self.fragments)):
            self._maybe_close(p, now, actions)
        for key in self.moments.pending_keys():
            if self.moments.due(key, now, self.expected_learners(), self.grace):
                self._merge_moments(key, now, actions)

    # ------------------------------------------------------------------ DES-LOC
    def _accept_moments(self, c: MomentContribution, now: float, actions: list[Action]) -> None:
        """Check a moment contribution like a parameter one, add it to its round and
        close the round if it is due."""
        problem = self._moment_problem(c)
        if problem is not None:
            code, reason = problem
            self.rejected += 1
            actions.append(Rejected(t=now, learner=c.learner_id, fragment=c.fragment, kind=c.kind, code=code,
                                    reason=reason))
            return
        for note in self.moments.accept(c, now):
            actions.append(Superseded(t=now, **note))
        key = (c.fragment, c.kind)
        if self.moments.due(key, now, self.expected_learners(), self.grace):
            self._merge_moments(key, now, actions)

    def _moment_problem(self, c: MomentContribution) -> tuple[RejectCode, str] | None:
        """(reject code, reason) when moment contribution ``c`` cannot be accepted."""
        mr = self.moments
        if not mr.enabled:
            return "moments_off", ("DES-LOC moments arrived, but this run has DES-LOC off (the first learner's "
                                   "ScheduleConfig.desloc); set the same desloc on every learner")
        problem = fragment_problem(c.fragment, len(self.fragments))
        if problem:
            return "unknown_fragment", problem
        if (c.fragment, c.kind) not in mr.versions:
            return "layout", f"moment kind {c.kind[:30]!r} is not exp_avg or exp_avg_sq"
        m = self.members.get(c.learner_id)
        if m is None or not m.connected:
            return "not_joined", "learner has not joined"
        problem = check_tensors(mr.specs[c.fragment], c.tensors)
        if problem:
            return "layout", f"{c.kind} moments: {problem}"
        if c.c_steps < 0 or not c.c_tokens >= 0:
            return "counters", "negative or NaN counters"
        if c.c_steps > MAX_C_STEPS or not c.c_tokens <= MAX_TOKENS_PER_STEP * max(c.c_steps, 1):
            return "bounds", (f"c_steps {c.c_steps} or c_tokens {c.c_tokens:g} beyond MAX_C_STEPS={MAX_C_STEPS} or "
                              f"MAX_TOKENS_PER_STEP={MAX_TOKENS_PER_STEP:g} per step")
        version = mr.versions[(c.fragment, c.kind)]
        if c.base_epoch == self.epoch and c.base_version > version:
            return "ahead", f"{c.kind} moments based on version {c.base_version}, the syncer's is {version}"
        if not all(_finite(t) for t in c.tensors):
            return "non_finite", f"non-finite {c.kind} moments (NaN or Inf)"
        if c.kind == "exp_avg_sq" and any(t.numel() and bool((t < 0).any()) for t in c.tensors):
            return "negative", "negative exp_avg_sq moments (a second moment is a mean of squares)"
        if c.seq > 0:
            last = mr.sequences.get((c.learner_id, c.fragment, c.kind))
            if last is not None and last[0] == c.session and c.seq <= last[1]:
                return "replay", f"replay or older send: {c.kind} seq {c.seq}, seq {last[1]} was accepted already"
        return None

    def _merge_moments(self, key: MomentKey, now: float, actions: list[Action]) -> None:
        merged = self.moments.merge(key, now)
        if merged is None:
            actions.append(Dropped(
                t=now, fragment=key[0], kind=key[1], version=self.moments.versions[key],
                reason=(f"fragment {key[0]}: the mean of the {key[1]} moments is not finite; the round was dropped "
                        "and the learners keep their own")))
            return
        upd, fields = merged
        factor = "norm_guard" + ("^2" if key[1] == "exp_avg_sq" else "") + f"={self.config.syncer.norm_guard:g}"
        for lid, clip in fields["clipped"].items():
            actions.append(Guarded(
                t=now, learner=lid, fragment=key[0], kind=key[1], version=upd.version, action="clipped", **clip,
                reason=(f"learner {lid}'s {key[1]} moments for fragment {key[0]} have norm {clip['norm']:.4g}, more "
                        f"than {factor} x the lower median of this round's: clipped to {clip['bound']:.4g}. If "
                        "this names honest learners, raise SyncerConfig.norm_guard")))
        to = self.connected_learners()
        actions.append(SendMomentUpdate(upd, to))
        actions.append(MomentsMerged(t=now, **fields, bytes_out=self.moments.update_nbytes(upd) * len(to)))

    def _maybe_close(self, p: int, now: float, actions: list[Action]) -> None:
        """Quorum and early finish count only fresh contributions (based on the current
        version, i.e. newer than the last merge); stale ones ride along with the next
        round, so a lagging learner never triggers an extra outer step of its own."""
        frag = self.frags[p]
        fresh = {lid for lid, c in frag.round.pending.items() if c.base_version == frag.version}
        if not fresh:
            return
        expected = self.expected_learners()
        if frag.round.clock.due(now, len(fresh), bool(expected) and expected <= fresh,
                                deterministic=self.config.deterministic, min_quorum=self.config.syncer.min_quorum,
                                grace=self.grace, on_quorum=self.xi_quorum.add):
            self._merge(p, now, actions)

    def _anchored(self, frag: SyncerFragment, c: Contribution) -> list[torch.Tensor]:
        if self.config.syncer.anchoring != "syncer" or c.base_version == frag.version:
            return list(c.tensors)
        return [d + (cur - b) for d, cur, b in zip(c.tensors, frag.theta, frag.value_at(c.base_version))]

    def _merge(self, p: int, now: float, actions: list[Action], cause: str | None = None) -> None:
        sc = self.config.syncer
        frag = self.frags[p]
        rnd = frag.round
        ids = sorted(rnd.pending)
        contribs = [rnd.effective(i) for i in ids]
        anchored = [self._anchored(frag, c) for c in contribs]
        # Each send was finite on arrival, but a combined sum or a re-anchored one can
        # overflow: those are checked again, a send merged as it arrived is not.
        bad = [i for i, c, a in zip(ids, contribs, anchored)
               if not (rnd.pending[i] is c and all(x is y for x, y in zip(a, c.tensors)))
               and not all(_finite(t) for t in a)]
        if bad:
            self._drop(p, now, bad, "non-finite after combining or re-anchoring", actions)
            keep = [k for k, i in enumerate(ids) if i not in bad]
            ids, contribs, anchored = [ids[k] for k in keep], [contribs[k] for k in keep], [anchored[k] for k in keep]
            if not ids:
                frag.round = Round()
                return
        spec = frag.spec
        # CGAD (staleness_decay, staleness_cutoff): a stale contribution's outer gradient is
        # scaled, its weight is not, so it moves the value less. Buffers are set to the
        # weighted mean of the learners' values below, so they are never scaled.
        scales = [staleness_scale(frag.version - c.base_version, sc.staleness_decay, sc.staleness_cutoff)
                  for c in contribs]
        anchored = [a if s == 1.0 else [x if t.is_buffer else x * s for x, t in zip(a, spec.tensors)]
                    for a, s in zip(anchored, scales)]
        cgad = sc.staleness_decay > 0 or sc.staleness_cutoff is not None
        stale_scales = {lid: s for lid, s, c in zip(ids, scales, contribs) if c.base_version < frag.version}
        absent_ids = self._absent(p, ids)
        counts = [(c.c_tokens, c.c_steps) for c in contribs] + [self.last_counts[a] for a in absent_ids]
        raw_all = merge_weights(sc.weighting, [t for t, _ in counts], [s for _, s in counts])
        raw, absent_weight = raw_all[: len(ids)], math.fsum(raw_all[len(ids):])
        gains = {lid: c.merge_gain for lid, c in zip(ids, contribs) if c.merge_gain is not None}
        merged = merge_deltas(
            anchored,
            raw,
            sc.merge,
            [t.is_embedding or t.is_buffer for t in spec.tensors],  # rda is for weights only
            absent_weight,
            spec.variance_of,  # BatchNorm variances pool with their means' spread
        )
        # The outer step runs on the live tensors (torch.optim has no out-of-place step),
        # so the previous value and optimizer state are kept to roll back a non-finite result.
        old, old_state = frag.keep()
        for theta, g, t in zip(frag.theta, merged, spec.tensors):
            theta.grad = None if t.is_buffer else g
        frag.optimizer.step()  # tensors without .grad (buffers) are left alone by torch.optim
        with torch.no_grad():
            for theta, g, t in zip(frag.theta, merged, spec.tensors):
                theta.grad = None
                if t.is_buffer:
                    # Theta_b - mean(Theta_b - b_m) = the weighted mean of the learners' b_m.
                    theta.sub_(g)
            if not all(_finite(t) for t in frag.theta):
                frag.roll_back(old, old_state)
                self._drop(p, now, ids, "the merge and outer step gave a non-finite value", actions)
                frag.round = Round()
                return
        delta = self._compress_change(p, old) if self.downlink is not None else None
        round_index = frag.version
        version = frag.advance(sc.max_staleness, delta)
        expected = self.expected_learners()
        to = self.connected_learners()
        clock = rnd.clock
        first = now if clock.first_arrival is None else clock.first_arrival
        actions.append(SendUpdate(frag.current, to))
        actions.append(
            Merged(
                t=now,
                fragment=p,
                round=round_index,
                version=version,
                merged=tuple(ids),
                absent=tuple(sorted(expected - set(ids))),
                stale=tuple(c.learner_id for c in contribs if c.base_version < round_index),
                stale_scales=stale_scales if cgad and stale_scales else None,
                weights=dict(zip(ids, normalized_weights(raw, absent_weight))),
                absent_share=_share(absent_weight, raw),
                tokens=dict(zip(ids, (c.c_tokens for c in contribs))),
                gains=gains,
                quorum_s=None if clock.quorum_at is None else clock.quorum_at - first,
                wait_s=now - first,
                grace_s=None if clock.deadline is None or clock.quorum_at is None else clock.deadline - clock.quorum_at,
                codecs={i: rnd.pending[i].encoded[0].codec if rnd.pending[i].encoded else "none" for i in ids},
                bytes_in=sum(self._bytes_in(p, rnd.pending[i]) + rnd.carried_bytes.get(i, 0) for i in ids),
                bytes_out=(spec.nbytes if delta is None else sum(e.nbytes() for e in delta)) * len(to),
                cause=cause,
            )
        )
        for lid, c in zip(ids, contribs):
            self.last_counts[lid] = (c.c_tokens, c.c_steps)
            self.last_merged[(lid, p)] = version
        frag.note_norms(ids, contribs)
        frag.round = Round()
        self._watch_gains(frag, gains, now, actions)

    def _absent(self, p: int, ids: Sequence[str]) -> list[str]:
        """Connected learners missing from fragment ``p``'s round of ``ids`` that count as
        sending zero: those whose work went into one of the last ``max_staleness``
        versions (a joined peer that never contributes, or stopped, is not counted)."""
        if not self.config.syncer.count_absent:
            return []
        recent = self.frags[p].version - self.config.syncer.max_staleness
        return sorted(lid for lid in set(self.connected_learners()) - set(ids)
                      if (lid, p) in self.last_merged and self.last_merged[(lid, p)] >= recent)

    def _drop(self, p: int, now: float, ids: list[str], reason: str, actions: list[Action]) -> None:
        """Drop the pending work of ``ids`` from fragment ``p``'s round, logged; the
        version is not bumped when nothing else merges (the learners send again)."""
        frag = self.frags[p]
        for lid in ids:
            frag.round.drop(lid)
        self.rejected += len(ids)
        actions.append(Dropped(
            t=now, fragment=p, dropped=tuple(ids), version=frag.version,
            reason=(f"fragment {p}: dropped the contributions of {', '.join(ids)}: {reason}; "
                    "the global value was not changed by them")))

    def _watch_gains(self, frag: SyncerFragment, gains: dict[str, float], now: float,
                     actions: list[Action]) -> None:
        """Warn when applying this fragment's merges keeps making the learners' models
        worse (a harmful outer step: e.g. an outer learning rate or momentum too high)."""
        if not gains:
            return
        values = sorted(gains.values())
        median = values[len(values) // 2]
        if frag.note_gain(median, HARMFUL_LOSS) == HARMFUL_STREAK:
            p = frag.index
            actions.append(MergeHarmful(
                t=now, fragment=p, streak=HARMFUL_STREAK, median_gain=median,
                reason=(f"fragment {p}: the last {HARMFUL_STREAK} merged values each made the learners' probe "
                        f"loss more than {HARMFUL_LOSS:.0%} worse (median gain {median:+.1%}); the outer step is "
                        "probably too large: lower outer_lr or the outer momentum (docs/tuning.md)")))

    # ------------------------------------------------------------------ fail-slow
    def _watch_step_time(self, c: Contribution, now: float, actions: list[Action]) -> None:
        """Feed ``c``'s timing to the fail-slow monitor; apply and log the ladder's actions."""
        if self.failslow is None:
            return
        self._failslow_resumed.discard(c.learner_id)  # sending again: a later join is a new start
        seconds, steps = (c.rank_step_time, c.rank_steps) if c.rank_steps > 0 else (c.step_time, 0)
        ladder = self.failslow.observe(c.learner_id, c.rank, c.step, seconds, steps, len(self.connected_learners()))
        changed = False
        for act in ladder:
            r = act.report
            m = self.members.get(r.learner)
            if isinstance(act, StopExpecting) and m is not None and m.expected:
                m.expected, changed = False, True
            elif isinstance(act, RestoreLearner) and m is not None and m.connected and not m.expected:
                m.expected, changed = True, True
            actions.append(act)
            actions.append(FailSlowNoted(t=now, action=act, reason=_failslow_reason(act)))
        if changed:
            self._close_all_due(now, actions)  # rounds that waited only for it can end now


def _failslow_reason(act: FailSlowAction) -> str:
    """The log line a person reads for one rung of the ladder."""
    r = act.report
    who = f"learner {r.learner} (rank {r.rank})"
    speed = (f"{r.ratio:.2f}x its baseline of {r.baseline_s * 1000:.3g} ms per step, {r.fleet_ratio:.2f}x relative "
             "to the fleet")
    if r.state == "alone":
        speed = f"{r.ratio:.2f}x its baseline of {r.baseline_s * 1000:.3g} ms per step"
        what = ("was slower for {r.steps} steps ({speed})" if isinstance(act, FailSlowBlip) else
                "was flagged slow; rounds wait for it again").format(r=r, speed=speed)
        return (f"{who} {what}, but it is the only learner with a step-time baseline: with no fleet to compare "
                "with, a slowdown cannot be told from a change of workload or host, so nobody is flagged")
    if isinstance(act, FailSlowBlip):
        return f"{who} was slower for {r.steps} steps ({speed}); too short or too small: ignored"
    if isinstance(act, StopExpecting):
        return (f"{who} is fail-slow: {speed} for {r.steps} steps; rounds stop waiting for it (its work still "
                "merges). If healthy racks get flagged, raise SyncerConfig.failslow_false_alarm_steps or "
                "failslow_min_steps")
    if isinstance(act, AdviseLearner):
        return f"told {who} that it is {r.state} ({speed}; {r.steps} steps)"
    if isinstance(act, MarkForEviction):
        return (f"{who} marked for eviction: its slowdown ({speed}) has cost the fleet {r.cost_s:.0f} s, more than "
                "SyncerConfig.failslow_evict_cost; replace the rack or restart it elsewhere")
    return f"{who} is back to normal speed ({speed}); rounds wait for it again"
