"""Fail-slow detection and the mitigation ladder, sans I/O.

What lives here: a change-point detector on one stream of step times
(``StepTimeDetector``, one per learner rank) and the per-learner ladder built on it
(``FailSlowMonitor``), which turns the detector's verdicts into typed actions
(``FailSlowBlip``, ``StopExpecting``, ``AdviseLearner``, ``MarkForEviction``,
``RestoreLearner``). What does not: clocks, sockets, logging. The syncer core feeds
the monitor with accepted contributions and ``now``, applies the actions to its
membership and turns each into a log record; the service sends ``AdviseLearner``
reports to the learner.

The detector works on log step time, so a slowdown is a shift of the mean and one
threshold fits every model's step scale. Inputs are typical step times over a number
of steps (a contribution reports the sending rank's median step time since its
previous send: a median, so one x5 step in a window of six does not read as a window
67 % slower); a sample over n steps is treated as n steps at that level, its spread
sqrt(n) smaller, so a stream of windows and a stream of single steps give the same
statistics.

- **Baseline**: the weighted median and MAD (per-step scale) of the stream's own
  history, admitted with a lag of ``baseline_steps / 2`` steps: a slow ramp cannot
  drag the baseline up before it is caught, and samples of a confirmed slowdown are
  never admitted.
- **Change point**: one-sided CUSUMs on the standardised, clipped log step time, one
  per design shift (2, 4 and 8 times the smallest slowdown of interest), each with the
  threshold that gives the configured false-alarm rate (Siegmund's approximation of
  the in-control run length). Clipping at ``CLIP_SIGMA`` bounds what one spike adds.
- **Confirmation**: an alarm counts once ``min_steps`` steps since its onset were
  each at least ``min_slowdown`` slower than the baseline (a sample of n steps counts
  n), and the weighted median of the samples since the onset is at least
  ``min_slowdown`` above the baseline, on its own and also against the fleet (a
  slowdown the whole fleet shares is the workload, not a sick rack): over the same
  span of steps, the stream's trimmed-mean level above its baseline must exceed the
  fleet's by ``min_slowdown`` and by ``FLEET_Z`` standard errors (spans of a few dozen
  steps are noisy, and 10 % between two equally slowed racks is within their noise);
  see ``level_over`` and ``FLEET_TRIM`` for why not the median. The fleet is the
  other learners' median, those flagged slow left out unless they are all there is:
  with two learners, one flagged must not leave the other judged against nobody. An
  alarm that falls back before it is confirmed is a *blip*.
- **Recovery**: the mirror image: a CUSUM for the step back from the slow level to
  the baseline, confirmed like a slowdown (``min_steps`` steps back below
  ``min_slowdown``, and the median since its onset too).

Detection delay has a floor set by the noise, not by the code: to tell a shift of
delta (in units of the per-step log noise sigma) from noise at a false-alarm run
length A, any detector needs about ln(A) / (delta**2 / 2) steps (Lorden). With
per-step noise of coefficient of variation 0.3 (sigma ~ 0.29) a 1.2x slowdown has
delta ~ 0.62 and needs ~ 60 steps at A = 1e6; see docs/benchmarks.md.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

__all__ = [
    "StepTimeDetector",
    "FailSlowMonitor",
    "FailSlowReport",
    "FailSlowBlip",
    "StopExpecting",
    "AdviseLearner",
    "MarkForEviction",
    "RestoreLearner",
    "FailSlowAction",
    "REPORT_STATES",
    "CLIP_SIGMA",
    "BASELINE_MIN_SAMPLES",
    "MIN_SIGMA",
    "DESIGN_MULTIPLES",
    "FLEET_Z",
    "FleetView",
    "cusum_threshold",
]

CLIP_SIGMA = 3.0
"""Standardised samples are clipped to [-this, k + this] before they enter a CUSUM of
reference value k: a single x5 spike (~5.5 sigma at CV 0.3) adds at most this, so it
cannot raise an alarm alone."""

MIN_SIGMA = 0.01
"""Floor of the per-step log step-time scale (about 1 %): on a nearly noiseless
stream a 0.1 % wobble would otherwise be many sigma."""

DESIGN_MULTIPLES = (2.0, 4.0, 8.0)
"""Shifts the CUSUMs are tuned for, as multiples of log(1 + min_slowdown): with the
default 10 %, about 1.2x, 1.46x and 2.1x. Each catches shifts near its own size
fastest; the smallest slowdown itself is left to the 1.2x one (a CUSUM tuned to 1.1x
would need a far higher threshold and be slower on everything else)."""

BASELINE_MIN_SAMPLES = 128
"""The baseline keeps at least this many samples (or ``baseline_steps / 2``, when that
is fewer), even when they span more than ``baseline_steps`` steps: with windows of 6
steps, 256 steps are 43 samples, whose median and spread are off by enough to turn a
false alarm per 1e7 steps into one per 1e5 (benchmarks/failslow.py --window 6).
Detection starts at half of both. A short ``baseline_steps`` thus lowers this floor
too: whoever shortens the baseline (a one-minute demo) has chosen a noisier one."""

FLEET_Z = 3.0
"""Standard errors by which a slowdown must exceed the fleet's own shift to count.
Without it, two racks slowed alike by a shared CPU were flagged in turn on every shared
slowdown: the medians of 10-20 steps at CV 0.3 differ by more than 10 % a quarter of the
time. It costs a genuinely slow rack in a fleet a little delay on noisy steps (the gap
has to be measured over more steps), none when the steps are steady."""

FLEET_TRIM = 0.1
"""Share of the steps cut from each end before the fleet-relative comparison averages
a span (a trimmed mean, not the median): a span that straddles the end of a shared
slowdown is a mixture of two levels, whose median jumps from one to the other as the
mix passes one half, so two racks slowed alike differed by the whole slowdown there.
The trimmed mean moves smoothly with the mix and still drops rare x5 spikes."""

FLEET_SE = 1.06
"""Standard error of a ``FLEET_TRIM``-trimmed mean of n normal samples, in units of
sigma / sqrt(n)."""

FleetView = Callable[[int], "tuple[float, float] | None"]
"""The fleet as a detector sees it: given a span of steps, the fleet's log shift over its
last that many steps and the standard error of that shift; None when there is no fleet
to compare with (then the stream is judged on its own)."""

REPORT_STATES = ("blip", "slow", "evict", "restored", "alone")
"""What a ``FailSlowReport`` says happened."""


def cusum_threshold(k: float, arl0: float) -> float:
    """Threshold h (in sigma) of a one-sided CUSUM with reference value ``k`` (in sigma)
    whose mean run length without a change is about ``arl0`` samples (Siegmund:
    ARL0 = (exp(2kb) - 2kb - 1) / (2k^2), b = h + 1.166), by bisection."""
    def arl(h: float) -> float:
        b = 2 * k * (h + 1.166)
        return (math.expm1(b) - b) / (2 * k * k) if b < 700 else math.inf

    lo, hi = 0.0, 1.0
    while arl(hi) < arl0:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if arl(mid) < arl0 else (lo, mid)
    return hi


def _wmedian(samples: Sequence[tuple[float, int]]) -> float:
    """Median of ``(value, weight)`` pairs, each value counted ``weight`` times."""
    ordered = sorted(samples)
    half = sum(n for _, n in ordered) / 2
    acc = 0
    for x, n in ordered:
        acc += n
        if acc >= half:
            return x
    return ordered[-1][0]


def _trimmed_mean(samples: Sequence[tuple[float, int]], trim: float) -> float:
    """Mean of ``(value, weight)`` pairs after cutting ``trim`` of the total weight from
    each end (weights cut fractionally where the cut falls inside a pair)."""
    ordered = sorted(samples)
    total = sum(n for _, n in ordered)
    lo, hi = trim * total, (1 - trim) * total
    acc = kept = weight = 0.0
    for x, n in ordered:
        w = max(0.0, min(acc + n, hi) - max(acc, lo))
        kept += w * x
        weight += w
        acc += n
    return kept / weight if weight > 0 else _wmedian(ordered)


@dataclass
class _Cusum:
    k: float
    h: float
    s: float = 0.0
    onset: int = 0
    """Step count at which ``s`` last left zero: the change's estimated start."""


@dataclass(frozen=True)
class Verdict:
    """What one sample changed: ``kind`` in blip | slow | restored, with the evidence."""

    kind: str
    shift: float
    """Log step time above the baseline: median of the samples since the onset."""
    fleet_shift: float
    """The fleet's log shift over the same span, subtracted in the fleet-relative check."""
    steps: int
    """Steps from the change's onset to this sample."""


class StepTimeDetector:
    """Baseline and change-point detection on one stream of step times (one rank).

    ``add(seconds, steps, fleet_shift)`` takes the mean step time over ``steps`` steps
    and returns a ``Verdict`` when the stream's state changes (or a blip ends), else
    None. ``fleet_shift`` is the fleet's log shift, either a number (taken as exact; 0
    checks the stream against itself only) or a ``FleetView`` (``FailSlowMonitor``
    passes one over the other learners), asked for the span the verdict is about."""

    def __init__(self, *, min_slowdown: float = 0.10, min_steps: int = 10,
                 false_alarm_steps: float = 1e7, baseline_steps: int = 256) -> None:
        if not min_slowdown > 0 or min_steps < 1 or not false_alarm_steps > 1 or baseline_steps < 8:
            raise ValueError("min_slowdown > 0, min_steps >= 1, false_alarm_steps > 1 and baseline_steps >= 8 "
                             f"are needed, got {min_slowdown}, {min_steps}, {false_alarm_steps}, {baseline_steps}")
        self.min_shift = math.log1p(min_slowdown)
        self.min_steps = min_steps
        self.baseline_steps = baseline_steps
        self.lag_steps = baseline_steps // 2
        self.min_samples = min(BASELINE_MIN_SAMPLES, baseline_steps // 2)
        """Samples the baseline keeps at least (see ``BASELINE_MIN_SAMPLES``)."""
        self.arl0 = false_alarm_steps * len(DESIGN_MULTIPLES)  # the CUSUMs' alarm rates add up
        self.steps = 0
        """Steps seen (the sum of ``steps`` over every sample)."""
        self.slow = False
        self.mu: float | None = None
        """Baseline log step time; None while warming up."""
        self.sigma = MIN_SIGMA
        """Per-step scale of log step time around the baseline (robust)."""
        self.slow_level = 0.0
        self._base: deque[tuple[float, int]] = deque()
        self._base_level: float | None = None
        """Trimmed mean of ``_base`` (see ``level_over``); None: to be computed."""
        self._base_steps = 0
        self._probation: deque[tuple[int, float, int]] = deque()
        """(step count at the sample's end, log value, steps), waiting ``lag_steps`` to enter the baseline."""
        self._recent: deque[tuple[int, float, int]] = deque()
        """The last ``baseline_steps`` steps' samples, for the medians since an onset."""
        self._cusums: list[_Cusum] = []
        self._down = _Cusum(1.0, 1.0)
        """While slow: the CUSUM for the step back from the slow level to the baseline."""
        self._alarmed = 0
        """Samples in the current unconfirmed alarm."""
        self._blip_steps = 0
        self._blip_shift = 0.0
        self._dirty = 0
        self._ends: deque[int] = deque()
        """The end step of each sample in ``_recent`` (strictly increasing), for bisection."""
        self._shift: float | None = None
        self._shift_known = False
        """``current_shift()``, computed once per state (``_touch`` forgets it)."""
        self._levels: dict[tuple[int, int], tuple[float, float]] = {}
        """``level_over`` by the slice of ``_recent`` it averages, for the current state: every
        other learner asks for the fleet view, each with its own span, between two of this
        stream's samples; many spans cover the same samples."""

    # ------------------------------------------------------------------ public
    def add(self, seconds: float, steps: int = 1, fleet_shift: float | FleetView = 0.0) -> Verdict | None:
        if steps <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return None
        x = math.log(seconds)
        self.steps += steps
        self._touch()
        self._recent.append((self.steps, x, steps))
        self._ends.append(self.steps)
        while self._recent and self._recent[0][0] <= self.steps - self.baseline_steps:
            self._recent.popleft()
            self._ends.popleft()
        if self.mu is None or self._dirty * 8 >= len(self._base):
            self._refresh()
        if self.mu is None:
            self._admit(x, steps)
            return None
        return self._watch_recovery(x, steps, fleet_shift) if self.slow else self._watch_slowdown(x, steps, fleet_shift)

    def current_shift(self) -> float | None:
        """Log shift of the last ``min_steps`` steps above the baseline (None while warming up)."""
        if not self._shift_known:
            self._shift = (None if self.mu is None or not self._recent
                           else _wmedian(self._since(self.steps - self.min_steps)) - self.mu)
            self._shift_known = True
        return self._shift

    def level_over(self, span: int, skip_newest: bool = False) -> tuple[float, float] | None:
        """Log shift above the baseline of the last ``span`` steps (at least one sample,
        at most the last ``baseline_steps``) as their ``FLEET_TRIM``-trimmed mean, and its
        standard error (the baseline's own included: two racks' baselines differ by their
        noise too); None while warming up. ``skip_newest``: of the ``span`` steps that
        end with the previous sample instead. What the fleet-relative check compares, the
        stream's own and the fleet's over the same span.

        The baseline here is the trimmed mean of the admitted history, not ``mu``: after a
        long shared slowdown entered both racks' baselines, their medians jump back one
        refresh apart, and for a round or two the racks' shifts differed by the whole
        slowdown; the trimmed means move together, a sample at a time."""
        if self.mu is None or not self._recent or not self._base:
            return None
        # The samples averaged are a slice recent[lo:hi] (ends strictly increase), so the
        # answer depends on the span only through lo: cached by (lo, hi) until the next change.
        ends = self._ends
        hi = len(ends) - 1 if skip_newest and len(ends) > 1 else len(ends)
        lo = min(bisect_right(ends, ends[hi - 1] - span, 0, hi), hi - 1)
        level = self._levels.get((lo, hi))
        if level is None:
            if self._base_level is None:
                self._base_level = _trimmed_mean(list(self._base), FLEET_TRIM)
            recent = self._recent
            samples = [(recent[i][1], recent[i][2]) for i in range(lo, hi)]
            covered = sum(n for _, n in samples)
            se = self.sigma * FLEET_SE * math.hypot(1 / math.sqrt(covered),
                                                     1 / math.sqrt(max(self._base_steps, 1)))
            level = self._levels[(lo, hi)] = (_trimmed_mean(samples, FLEET_TRIM) - self._base_level, se)
        return level

    @property
    def baseline_seconds(self) -> float | None:
        return None if self.mu is None else math.exp(self.mu)

    def state_dict(self) -> dict[str, Any]:
        """Everything learnt so far, as JSON-able data (settings excluded: they come from
        the config the detector is built with)."""
        return {
            "steps": self.steps, "slow": self.slow, "mu": self.mu, "sigma": self.sigma,
            "slow_level": self.slow_level, "dirty": self._dirty, "alarmed": self._alarmed,
            "blip": [self._blip_steps, self._blip_shift],
            "base": [[x, n] for x, n in self._base],
            "probation": [list(e) for e in self._probation],
            "recent": [list(e) for e in self._recent],
            "cusums": [[c.k, c.h, c.s, c.onset] for c in self._cusums],
            "down": [self._down.k, self._down.h, self._down.s, self._down.onset],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output. The CUSUMs' running sums and onsets
        are kept; their reference values and thresholds follow this detector's settings."""
        self.steps = int(state["steps"])
        self.slow = bool(state["slow"])
        self.mu = None if state["mu"] is None else float(state["mu"])
        self.sigma = float(state["sigma"])
        self.slow_level = float(state["slow_level"])
        self._dirty, self._alarmed = int(state["dirty"]), int(state["alarmed"])
        self._blip_steps, self._blip_shift = int(state["blip"][0]), float(state["blip"][1])
        self._base = deque((float(x), int(n)) for x, n in state["base"])
        self._base_level = None
        self._base_steps = sum(n for _, n in self._base)
        self._probation = deque((int(e), float(x), int(n)) for e, x, n in state["probation"])
        self._recent = deque((int(e), float(x), int(n)) for e, x, n in state["recent"])
        self._ends = deque(e for e, _, _ in self._recent)
        self._touch()
        self._cusums = [_Cusum(float(k), float(h), float(v), int(o)) for k, h, v, o in state["cusums"]]
        k, h, v, o = state["down"]
        self._down = _Cusum(float(k), float(h), float(v), int(o))
        if self.mu is not None:
            self._design()  # settings may differ from the run that saved this

    # ------------------------------------------------------------------ internals
    def _touch(self) -> None:
        """Forget what ``current_shift`` and ``level_over`` computed: the state changed."""
        self._shift_known = False
        if self._levels:
            self._levels = {}

    def _since(self, step: int) -> list[tuple[float, int]]:
        """Samples ending after ``step`` (at least the newest one)."""
        out = [(x, n) for end, x, n in self._recent if end > step]
        return out or [(self._recent[-1][1], self._recent[-1][2])]

    def _steps_where(self, step: int, slow: bool) -> int:
        """Steps since ``step`` in samples at least ``min_shift`` above the baseline
        (``slow``), or below that (not ``slow``)."""
        assert self.mu is not None
        limit = self.mu + self.min_shift
        return sum(n for end, x, n in self._recent if end > step and (x >= limit) == slow)

    def _z(self, x: float, center: float) -> float:
        return (x - center) / self.sigma

    def _admit(self, x: float, steps: int) -> None:
        """Queue a sample for the baseline; those older than the lag enter it."""
        self._probation.append((self.steps, x, steps))
        warming = self.mu is None
        while self._probation and (warming or self._probation[0][0] <= self.steps - self.lag_steps):
            _, value, n = self._probation.popleft()
            self._base.append((value, n))
            self._base_level = None
            self._touch()
            self._base_steps += n
            self._dirty += 1
            while (self._base_steps - self._base[0][1] >= self.baseline_steps
                   and len(self._base) > self.min_samples):
                self._base_steps -= self._base.popleft()[1]

    def _refresh(self) -> None:
        """Baseline from the admitted history: weighted median, and 1.4826 x the weighted
        median absolute deviation scaled to one step (a mean of n steps varies sqrt(n) less)."""
        self._dirty = 0
        self._touch()
        if self._base_steps < self.baseline_steps // 2 or len(self._base) < self.min_samples // 2:
            return
        mu = _wmedian(list(self._base))
        mad = _wmedian([(abs(x - mu) * math.sqrt(n), n) for x, n in self._base])
        sigma = max(1.4826 * mad, MIN_SIGMA)
        if self.mu is None or abs(sigma - self.sigma) > 1e-12:
            self.sigma = sigma
            self._design()
        self.mu = mu

    def _design(self) -> None:
        """k and h of each CUSUM for the current sigma; running sums carry over (a new
        sigma from a baseline refresh is no reason to forget evidence gathered)."""
        old = self._cusums
        self._cusums = []
        for i, m in enumerate(DESIGN_MULTIPLES):
            k = m * self.min_shift / 2 / self.sigma
            c = _Cusum(k, cusum_threshold(k, self.arl0), 0.0, self.steps)
            if i < len(old):
                c.s, c.onset = old[i].s, old[i].onset
            self._cusums.append(c)

    def _step(self, cusums: list[_Cusum], z: float, steps: int) -> None:
        for c in cusums:
            if c.s == 0.0:
                c.onset = self.steps - steps
            # Clipped around k, so a CUSUM tuned to a shift larger than the clip still moves;
            # a sample of n steps varies sqrt(n) less, so its clip is that much tighter.
            clip = CLIP_SIGMA / math.sqrt(steps)
            c.s = max(0.0, c.s + steps * (max(-clip, min(c.k + clip, z)) - c.k))

    def _gap(self, fleet_shift: float | FleetView, span: int, shift: float) -> tuple[float, float, float]:
        """(fleet's shift, this stream's shift over it, the gap's standard error) over the
        last ``span`` steps. A number for the fleet is taken as exact and compared with
        ``shift``; a ``FleetView`` is compared level for level (see ``level_over``)."""
        seen = fleet_shift(span) if callable(fleet_shift) else None
        own = self.level_over(span) if seen is not None else None
        if seen is None or own is None:
            fleet = 0.0 if callable(fleet_shift) else fleet_shift
            return fleet, shift - fleet, 0.0
        # The fleet's newest sample may predate this one by up to a send (learners send in
        # turn): at a level change that alone is a gap of the change times send / span.
        # So this stream is compared as of its previous sample too, and the smaller gap counts.
        before = self.level_over(span, skip_newest=True) or own
        low = min(own, before)
        return seen[0], low[0] - seen[0], math.hypot(max(own[1], before[1]), seen[1])

    def _watch_slowdown(self, x: float, steps: int, fleet_shift: float | FleetView) -> Verdict | None:
        assert self.mu is not None
        self._step(self._cusums, self._z(x, self.mu), steps)
        self._admit(x, steps)
        alarms = [c for c in self._cusums if c.s > c.h]
        if not alarms:
            if self._alarmed and all(c.s == 0.0 for c in self._cusums):
                # One alarmed sample is a spike, not worth a log line; more is a blip.
                blip = self._alarmed > 1
                self._alarmed = 0
                if not blip:
                    return None
                fleet = self._gap(fleet_shift, self._blip_steps, self._blip_shift)[0]
                return Verdict("blip", self._blip_shift, fleet, self._blip_steps)
            return None
        self._alarmed += 1
        onset = min(c.onset for c in alarms)
        self._blip_steps = lasted = self.steps - onset
        self._blip_shift = _wmedian(self._since(onset)) - self.mu
        # "Lasting min_steps": that many steps since the onset were slow by min_shift,
        # not merely that many steps passed (a 5-step stall keeps the CUSUM up longer).
        if self._steps_where(onset, slow=True) < self.min_steps:
            return None
        shift = self._blip_shift
        if shift < self.min_shift:
            return None
        fleet, gap, noise = self._gap(fleet_shift, lasted, shift)
        if gap < self.min_shift or gap < FLEET_Z * noise:
            return None  # the fleet shares it, or it is not told apart from noise yet
        self.slow, self._alarmed = True, 0
        self.slow_level = self.mu + shift
        # Samples of the slowdown must never become baseline.
        self._probation.clear()
        gap = max(shift, self.min_shift)
        k = gap / 2 / self.sigma
        self._down = _Cusum(k, cusum_threshold(k, self.arl0 / len(DESIGN_MULTIPLES)), 0.0, self.steps)
        return Verdict("slow", shift, fleet, lasted)

    def _watch_recovery(self, x: float, steps: int, fleet_shift: float | FleetView) -> Verdict | None:
        assert self.mu is not None
        down = self._down
        self._step([down], -self._z(x, self.slow_level), steps)
        if down.s <= down.h:
            return None
        lasted = self.steps - down.onset
        if self._steps_where(down.onset, slow=False) < self.min_steps:
            return None
        shift = _wmedian(self._since(down.onset)) - self.mu
        # No noise margin here: the down CUSUM already said the stream stepped back.
        fleet, gap, _ = self._gap(fleet_shift, lasted, shift)
        if shift >= self.min_shift and gap >= self.min_shift:
            return None
        self.slow = False
        for c in self._cusums:
            c.s, c.onset = 0.0, self.steps
        return Verdict("restored", shift, fleet, lasted)


# ------------------------------------------------------------------ the ladder
@dataclass(frozen=True)
class FailSlowReport:
    """What the syncer found about one learner; sent to it with ``AdviseLearner``."""

    learner: str
    rank: int
    """The learner's slowest rank (the one the verdict is about)."""
    state: str
    """One of ``REPORT_STATES``."""
    ratio: float
    """Step time now over its own baseline (2.0: twice as slow)."""
    fleet_ratio: float
    """``ratio`` over the fleet's own change in the same time (1.0 when alone)."""
    baseline_s: float
    """Baseline seconds per step of that rank."""
    steps: int
    """Steps the slowdown has lasted (for ``restored``: the steps back at normal speed)."""
    cost_s: float = 0.0
    """Fleet-seconds the slowdown cost or would cost in lockstep (see ``MarkForEviction``)."""


@dataclass(frozen=True)
class FailSlowBlip:
    """Rung 0: a change that did not last or was too small; ignored, logged."""

    report: FailSlowReport


@dataclass(frozen=True)
class StopExpecting:
    """Rung 1: rounds stop waiting for this learner; its work still merges when it arrives."""

    report: FailSlowReport


@dataclass(frozen=True)
class AdviseLearner:
    """Rung 2 (and its follow-ups): send ``report`` to every rank of the learner, whose
    ``on_fail_slow`` hook decides (shrink the batch, rebalance, log)."""

    report: FailSlowReport


@dataclass(frozen=True)
class MarkForEviction:
    """Rung 3: the slowdown has cost more than ``failslow_evict_cost`` fleet-seconds.
    The syncer only marks it (an operator or orchestrator replaces the rack)."""

    report: FailSlowReport


@dataclass(frozen=True)
class RestoreLearner:
    """Back to normal speed: rounds wait for it again; any eviction mark is withdrawn."""

    report: FailSlowReport


FailSlowAction = Union[FailSlowBlip, StopExpecting, AdviseLearner, MarkForEviction, RestoreLearner]


@dataclass
class _Case:
    """A learner's place on the ladder while it is flagged slow."""

    slow_ranks: set[int] = field(default_factory=set)
    steps: int = 0
    cost_s: float = 0.0
    advised: bool = False
    evict: bool = False


class FailSlowMonitor:
    """Per learner and rank step-time detectors, and the ladder over them.

    ``observe(learner, rank, step, seconds, steps, fleet_size)`` feeds one
    contribution's timing and returns the ladder's typed actions. The caller applies
    them (membership) and logs them; ``forget`` drops a learner that left or rejoined.

    A contribution reads every other learner's detector (the fleet), but only what each
    computed once since its own last sample (``current_shift``, ``level_over``): the
    cost per other learner is a lookup, not a pass over its recent samples.
    """

    _detector = StepTimeDetector
    """The detector class (tests substitute a reference implementation)."""

    def __init__(self, *, min_slowdown: float = 0.10, min_steps: int = 10, false_alarm_steps: float = 1e7,
                 baseline_steps: int = 256, advise_after: int = 30, evict_cost: float = 3600.0) -> None:
        self._detector_args = dict(min_slowdown=min_slowdown, min_steps=min_steps,
                                   false_alarm_steps=false_alarm_steps, baseline_steps=baseline_steps)
        StepTimeDetector(**self._detector_args)  # type: ignore[arg-type]  # surfaces bad arguments now
        self.advise_after = advise_after
        self.evict_cost = evict_cost
        self.detectors: dict[tuple[str, int], StepTimeDetector] = {}
        self._order: list[tuple[str, StepTimeDetector]] | None = None
        """(learner, detector) of ``detectors`` in key order; None: to be rebuilt (the set changed)."""
        self.last_step: dict[tuple[str, int], int] = {}
        self.cases: dict[str, _Case] = {}
        """Learners flagged slow, by id."""

    def is_slow(self, learner: str) -> bool:
        return learner in self.cases

    def state_dict(self) -> dict[str, Any]:
        """Per-rank detectors and the learners flagged slow, as JSON-able data, so a
        restarted syncer neither relearns every baseline nor forgets whom it flagged."""
        return {
            "detectors": [[lid, rank, self.last_step.get((lid, rank)), det.state_dict()]
                          for (lid, rank), det in sorted(self.detectors.items())],
            "cases": {lid: {"slow_ranks": sorted(c.slow_ranks), "steps": c.steps, "cost_s": c.cost_s,
                            "advised": c.advised, "evict": c.evict} for lid, c in sorted(self.cases.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace everything with ``state_dict()``'s output."""
        self.detectors, self.last_step, self.cases = {}, {}, {}
        self._order = None
        for lid, rank, last, det_state in state["detectors"]:
            key = (str(lid), int(rank))
            det = self.detectors[key] = self._detector(**self._detector_args)  # type: ignore[arg-type]
            det.load_state_dict(det_state)
            if last is not None:
                self.last_step[key] = int(last)
        for lid, c in state["cases"].items():
            self.cases[str(lid)] = _Case(slow_ranks={int(r) for r in c["slow_ranks"]}, steps=int(c["steps"]),
                                         cost_s=float(c["cost_s"]), advised=bool(c["advised"]),
                                         evict=bool(c["evict"]))

    def forget(self, learner: str) -> None:
        for key in [k for k in self.detectors if k[0] == learner]:
            del self.detectors[key]
            self.last_step.pop(key, None)
            self._order = None
        self.cases.pop(learner, None)

    def observe(self, learner: str, rank: int, step: int, seconds: float, steps: int,
                fleet_size: int) -> list[FailSlowAction]:
        """One sample: the rank's mean ``seconds`` per step over ``steps`` steps ending
        at inner step ``step``. With ``steps`` 0 (a sender that does not report per-rank
        times) the steps since this rank's previous sample are used, ``seconds`` being
        the contribution's mean. ``fleet_size``: learners whose rounds count (for the cost)."""
        key = (learner, rank)
        last = self.last_step.get(key)
        if last is not None and step <= last:
            return []  # an older send arriving late, or a restart from a checkpoint: no new steps
        self.last_step[key] = step
        if steps <= 0:
            if last is None:
                return []  # nothing says how many steps the mean covers
            steps = step - last
        det = self.detectors.get(key)
        if det is None:
            det = self.detectors[key] = self._detector(**self._detector_args)  # type: ignore[arg-type]
            self._order = None
        verdict = det.add(seconds, steps, lambda span: self._fleet_view(learner, span))
        out: list[FailSlowAction] = []
        case = self.cases.get(learner)
        if not self._others(learner):
            # A fleet check needs a fleet: alone (the others left, or have no baseline yet)
            # a slowdown cannot be told from the workload or the host changing, and host
            # noise alone crossed min_slowdown 7 times in 20 s for a learner left alone.
            return self._alone(learner, rank, det, verdict, case)
        if verdict is not None and verdict.kind == "blip":
            out.append(FailSlowBlip(self._report(learner, rank, "blip", verdict.shift, verdict.fleet_shift,
                                                 verdict.steps)))
        elif verdict is not None and verdict.kind == "slow":
            fleet_s = self._fleet_seconds(learner)
            base = det.baseline_seconds or seconds
            extra = max(0.0, base * math.exp(verdict.shift) - (fleet_s or base))
            if case is None:
                case = self.cases[learner] = _Case()
                case.steps = verdict.steps
                case.cost_s = extra * verdict.steps * max(fleet_size - 1, 0)
                case.slow_ranks.add(rank)
                out.append(StopExpecting(self._report(learner, rank, "slow", verdict.shift, verdict.fleet_shift,
                                                      case.steps, case.cost_s)))
            case.slow_ranks.add(rank)
        elif verdict is not None and verdict.kind == "restored" and case is not None:
            case.slow_ranks.discard(rank)
            if not case.slow_ranks:
                del self.cases[learner]
                report = self._report(learner, rank, "restored", verdict.shift, verdict.fleet_shift,
                                      verdict.steps, case.cost_s)
                out.append(RestoreLearner(report))
                if case.advised or case.evict:
                    out.append(AdviseLearner(report))
                return out
        if case is None or rank not in case.slow_ranks:
            return out
        if verdict is None:  # one more step of a slowdown already counted
            case.steps += steps
            fleet_s = self._fleet_seconds(learner)
            base = det.baseline_seconds or seconds
            case.cost_s += max(0.0, seconds - (fleet_s or base)) * steps * max(fleet_size - 1, 0)
        slowest = self._slowest_rank(learner, case)
        shift = self.detectors[(learner, slowest)].current_shift() or 0.0
        if not case.advised and case.steps >= self.advise_after:
            case.advised = True
            out.append(AdviseLearner(self._report(learner, slowest, "slow", shift, self._fleet_shift(learner),
                                                  case.steps, case.cost_s)))
        if not case.evict and case.cost_s >= self.evict_cost:
            case.evict = True
            report = self._report(learner, slowest, "evict", shift, self._fleet_shift(learner), case.steps,
                                  case.cost_s)
            out += [MarkForEviction(report), AdviseLearner(report)]
        return out

    # ------------------------------------------------------------------ internals
    def _alone(self, learner: str, rank: int, det: StepTimeDetector, verdict: Verdict | None,
               case: _Case | None) -> list[FailSlowAction]:
        """The ladder for a learner with no fleet to compare with: a slowdown is only
        noted (a blip, state ``alone``), never flagged; a case opened while there was a
        fleet ends (restored, state ``alone``), so rounds wait for the learner again."""
        if case is not None:
            del self.cases[learner]
            shift = det.current_shift() or 0.0
            report = self._report(learner, rank, "alone", shift, shift, case.steps, case.cost_s)
            return [RestoreLearner(report), *([AdviseLearner(report)] if case.advised or case.evict else [])]
        if verdict is not None and verdict.kind == "slow":
            return [FailSlowBlip(self._report(learner, rank, "alone", verdict.shift, verdict.shift, verdict.steps))]
        return []

    def _slowest_rank(self, learner: str, case: _Case) -> int:
        return max(sorted(case.slow_ranks), key=lambda r: self.detectors[(learner, r)].current_shift() or 0.0)

    def _others(self, learner: str) -> list[StepTimeDetector]:
        """Detectors of the other learners that have a baseline: those not flagged, or,
        when every other one is flagged, all of them. A flagged learner is left out so
        that one sick rack does not move the reference of a fleet; but when it is the
        whole fleet (two learners, or all slowed together) leaving it out would judge the
        rest against nobody, and a shared slowdown would flag each learner in turn."""
        if self._order is None:
            self._order = [(key[0], d) for key, d in sorted(self.detectors.items(), key=lambda kv: kv[0])]
        others = [(lid, d) for lid, d in self._order if lid != learner and d.mu is not None]
        cases = self.cases
        healthy = [d for lid, d in others if lid not in cases]
        return healthy or [d for _, d in others]

    def _fleet_shift(self, learner: str, span: int | None = None) -> float:
        """Median log shift of the other learners' last ``span`` steps (default
        ``min_steps``; 0 alone)."""
        seen = self._fleet_view(learner, span)
        return 0.0 if seen is None else seen[0]

    def _fleet_view(self, learner: str, span: int | None) -> tuple[float, float] | None:
        """The other learners' median log shift over their last ``span`` steps
        (``level_over``) and its standard error, taken as the median learner's (one
        learner's error overstates that of a median over many, which only costs delay);
        None alone."""
        seen = sorted(lv for d in self._others(learner) if (lv := d.level_over(span or d.min_steps)) is not None)
        return seen[len(seen) // 2] if seen else None

    def _fleet_seconds(self, learner: str) -> float | None:
        """Median seconds per step of the other healthy learners' last steps."""
        levels = sorted(math.exp(d.mu + (d.current_shift() or 0.0)) for d in self._others(learner)
                        if d.mu is not None)
        return levels[len(levels) // 2] if levels else None

    def _report(self, learner: str, rank: int, state: str, shift: float, fleet_shift: float, steps: int,
                cost_s: float = 0.0) -> FailSlowReport:
        det = self.detectors[(learner, rank)]
        return FailSlowReport(learner=learner, rank=rank, state=state, ratio=math.exp(shift),
                              fleet_ratio=math.exp(shift - fleet_shift), baseline_s=det.baseline_seconds or 0.0,
                              steps=steps, cost_s=cost_s)
