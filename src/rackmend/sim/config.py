"""What a simulated run is made of: the racks, their links, the faults, the toy model.

Plain kw-only dataclasses, validated on construction with messages that say what to
change. The run's own rules (H, P, tau, quorum, grace, apply rule, codecs) are a
``RackmendConfig``, the same object the real learners and syncer take; nothing here
changes how the cores behave, only what happens around them. The engine that runs
them is ``rackmend.sim.engine``.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Literal

from rackmend.config import HEARTBEAT_TIMEOUT_S, ConfigError, RackmendConfig, check_choice

__all__ = ["RackSpec", "Kill", "Slowdown", "Failures", "FailureMode", "FAILURE_MODES", "ReshapeOverlap",
           "RESHAPE_OVERLAPS", "SimConfig", "HOUR", "YEAR",
           "SHORT_RUN_REPAIRS"]

FailureMode = Literal["restart", "elastic"]
FAILURE_MODES: tuple[str, ...] = typing.get_args(FailureMode)
ReshapeOverlap = Literal["absorb", "restart"]
RESHAPE_OVERLAPS: tuple[str, ...] = typing.get_args(ReshapeOverlap)
HOUR = 3600.0
YEAR = 365.0 * 24.0 * HOUR


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _finite_at_least(name: str, value: float, low: float, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > low if strict else value >= low)
    _check(ok, f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RackSpec:
    """One simulated learner (a rack): how fast it steps and how it is linked to the syncer."""

    step_time: float = 1.0
    """Virtual seconds per inner step."""
    jitter: float = 0.0
    """Relative spread of each step's time: a step takes ``step_time * (1 + jitter * u)``, u
    uniform in [-1, 1] from the run's seeded RNG. 0: every step takes exactly ``step_time``."""
    uplink_latency: float = 0.0
    """Seconds from a send to the syncer's receipt (learner -> syncer)."""
    downlink_latency: float = 0.0
    """Seconds from the syncer's send to the learner's receipt (syncer -> learner)."""
    uplink_bandwidth: float | None = None
    """Bytes per second of the uplink; sends queue behind each other (FIFO). None: unlimited."""
    downlink_bandwidth: float | None = None
    """Bytes per second of the downlink, FIFO like the uplink. None: unlimited."""
    tokens: float = 1.0
    """Tokens per inner step the learner reports (its merge weight under token weighting)."""

    def __post_init__(self) -> None:
        _finite_at_least("step_time", self.step_time, 0.0, strict=True)
        _check(isinstance(self.jitter, (int, float)) and 0.0 <= self.jitter < 1.0,
               f"jitter must be in [0, 1) (a share of step_time), got {self.jitter!r}")
        _finite_at_least("uplink_latency", self.uplink_latency, 0.0)
        _finite_at_least("downlink_latency", self.downlink_latency, 0.0)
        for name in ("uplink_bandwidth", "downlink_bandwidth"):
            bw = getattr(self, name)
            if bw is not None:
                _finite_at_least(name, bw, 0.0, strict=True)
        _finite_at_least("tokens", self.tokens, 0.0, strict=True)


@dataclass(frozen=True, kw_only=True)
class Kill:
    """Learner ``learner`` dies at ``at`` (no more steps, sends or receipts) and, when
    ``rejoin_at`` is set, comes back then as a fresh process that joins again."""

    learner: int
    """Index of the learner in ``SimConfig.racks``."""
    at: float
    """Virtual time of death (seconds)."""
    rejoin_at: float | None = None
    """Virtual time it starts again and joins; None: it stays dead."""

    def __post_init__(self) -> None:
        _finite_at_least("Kill.at", self.at, 0.0)
        _check(self.rejoin_at is None or (math.isfinite(self.rejoin_at) and self.rejoin_at > self.at),
               f"Kill.rejoin_at must be after Kill.at={self.at:g}, got {self.rejoin_at!r}")


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """Learner ``learner``'s steps take ``factor`` times as long from ``start`` to ``end``."""

    learner: int
    """Index of the learner in ``SimConfig.racks``."""
    factor: float
    """Multiplier of the step time while it lasts (4.0: a 4x slower rack)."""
    start: float = 0.0
    """Virtual time it begins (a step starting at or after it is slow)."""
    end: float = math.inf
    """Virtual time it ends (a step starting at or after it is at normal speed again)."""

    def __post_init__(self) -> None:
        _finite_at_least("Slowdown.factor", self.factor, 0.0, strict=True)
        _finite_at_least("Slowdown.start", self.start, 0.0)
        _check(self.end > self.start, f"Slowdown.end ({self.end:g}) must be after Slowdown.start ({self.start:g})")


SHORT_RUN_REPAIRS = 10.0
"""Runs shorter than this many repair times get a warning with their goodput."""


@dataclass(frozen=True, kw_only=True)
class Failures:
    """Chip failures as a Poisson process, and what a learner (or a data-parallel job) does
    about one. Every number here is an assumption of the goodput model; docs/simulate.md
    ("Goodput") says where each default comes from and how much the results depend on it."""

    chips: int = 0
    """N: chips of the whole run, split as evenly as possible over the learners (the first
    N mod M learners get one more). 0: no chip failures, and goodput counts each learner as
    one chip."""
    mtbi_hours: float = YEAR / HOUR
    """Mean time between interruptions of one chip, in hours (default 8760: one year). A
    learner fails at rate (its active chips) / MTBI, a Poisson process re-drawn whenever
    its active chips change."""
    failure_mode: FailureMode = "elastic"
    """What a learner does when one of its chips fails: ``restart`` (torchrun relaunch:
    the process dies, work not yet sent is lost, it is down for ``restart_time`` and then
    joins again with the syncer's current value and all its chips) or ``elastic`` (it
    pauses ``downscale_time``, trains on without the failed chips, tokens per step
    following its active chips, and pauses ``upscale_time`` to take them back once
    repaired after ``repair_time``)."""
    restart_time: float = 76.0
    """Seconds a restarted learner (or, non-elastic, the whole data-parallel job) is down
    after a failure, before it trains again (relaunch, initialisation, checkpoint or value
    load). Calibrated on the paper's non-elastic data-parallel row (docs/simulate.md)."""
    downscale_time: float = 4.0
    """Seconds an elastic learner (or data-parallel job) stands still after a failure
    while it reshapes onto the remaining chips. Calibrated with ``upscale_time`` on the
    paper's elastic data-parallel row (docs/simulate.md); mostly their sum is
    identifiable there."""
    upscale_time: float = 16.0
    """Seconds an elastic learner (or job) stands still to take repaired chips back."""
    reshape_overlap: ReshapeOverlap = "absorb"
    """A failure or repair while an elastic reshape is under way: ``absorb`` (the reshape
    takes the changed chip set in and ends when it would have, as a non-elastic restart
    absorbs failures during it) or ``restart`` (the reshape starts over: it ends
    ``downscale_time``, or ``upscale_time``, after that one). Chosen by the fit to the
    paper's elastic data-parallel row (docs/simulate.md, "Calibration")."""
    repair_time: float = 3600.0
    """Seconds from a chip's failure until it is back for an elastic learner to regrow
    onto (a restarted learner comes back whole: the relaunch takes spare chips)."""
    chips_per_failure: int = 1
    """Chips one failure takes out of an elastic learner (a host or a slice: its data-
    parallel replica stops with it)."""

    @property
    def enabled(self) -> bool:
        return self.chips > 0

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_hours * HOUR

    def short_run_warning(self, duration: float) -> str | None:
        """Why goodput over ``duration`` seconds overstates a long run's, or None: chips
        fail from the start, but the ones waiting for repair only pile up to their steady
        state after ``repair_time``, so a run not much longer than it is charged too little
        for them (1.2M chips, 8 elastic learners: 97.95 % over one hour, 91.2 % over 24)."""
        if not self.enabled or duration >= SHORT_RUN_REPAIRS * self.repair_time:
            return None
        return (f"the run ({duration:g} s) is shorter than {SHORT_RUN_REPAIRS:g}x repair_time ({self.repair_time:g} "
                "s): chips waiting for repair have not piled up to their steady state, so its goodput overstates "
                f"a long run's; simulate at least {SHORT_RUN_REPAIRS * self.repair_time:g} s (--duration)")

    def __post_init__(self) -> None:
        _check(isinstance(self.chips, int) and not isinstance(self.chips, bool) and self.chips >= 0,
               f"chips must be a whole number >= 0 (0: no failures), got {self.chips!r}")
        _finite_at_least("mtbi_hours", self.mtbi_hours, 0.0, strict=True)
        check_choice("failure_mode", self.failure_mode, FAILURE_MODES)
        check_choice("reshape_overlap", self.reshape_overlap, RESHAPE_OVERLAPS)
        for name in ("restart_time", "downscale_time", "upscale_time", "repair_time"):
            _finite_at_least(name, getattr(self, name), 0.0)
        _check(isinstance(self.chips_per_failure, int) and self.chips_per_failure >= 1,
               f"chips_per_failure must be a whole number >= 1, got {self.chips_per_failure!r}")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """A whole simulated run: the rules, the racks, the faults, the model, how long."""

    run: RackmendConfig = field(default_factory=RackmendConfig)
    """The run's rules, shared by the syncer core and every learner core (H, P, tau,
    quorum, grace, outer optimizer, apply rule, codecs, deterministic mode)."""
    racks: tuple[RackSpec, ...] = (RackSpec(),) * 4
    """One entry per learner, learner i is named ``L{i}`` (``rackmend simulate --racks``
    takes its default count from here)."""
    duration: float = 600.0
    """Virtual seconds simulated; events after it are not run."""
    seed: int = 0
    """Seeds the model's targets and the step-time jitter: one seed, one run."""
    kills: tuple[Kill, ...] = ()
    """Learners that die (and maybe rejoin); a learner may die any number of times, each
    death after its previous rejoin."""
    slowdowns: tuple[Slowdown, ...] = ()
    """Learners that slow down for a while."""
    silence_timeout: float | None = HEARTBEAT_TIMEOUT_S
    """Seconds after a learner's death until the syncer declares it gone (``LearnerLeft``
    with reason ``silent``, as ``ServiceConfig.heartbeat_timeout`` does); None: never,
    the dead learner stays connected and expected."""
    fragment_size: int = 8
    """Elements of the one tensor each fragment holds."""
    lr: float = 0.1
    """Inner learning rate of the gradient step on each learner's quadratic."""
    curvature: tuple[float, float] = (0.5, 2.0)
    """Range the quadratic's per-element curvature is drawn from (shared by all learners)."""
    target_spread: float = 1.0
    """Standard deviation of each learner's optimum around the common one (0: one
    optimum for all: no data heterogeneity)."""
    failures: Failures = field(default_factory=Failures)
    """Random chip failures and how learners recover (off by default: ``chips=0``)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.run, RackmendConfig), f"run must be a RackmendConfig, got {type(self.run).__name__}")
        _check(len(self.racks) >= 1, "racks must list at least one learner (RackSpec)")
        _check(all(isinstance(r, RackSpec) for r in self.racks), "racks must hold RackSpec entries")
        _finite_at_least("duration", self.duration, 0.0, strict=True)
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), f"seed must be an int, got {self.seed!r}")
        n = len(self.racks)
        for what, faults in (("kills", self.kills), ("slowdowns", self.slowdowns)):
            for f in faults:
                _check(isinstance(f.learner, int) and 0 <= f.learner < n,
                       f"{what}: learner {f.learner!r} is not one of the {n} racks (0..{n - 1})")
        for i in range(n):
            mine = sorted((k for k in self.kills if k.learner == i), key=lambda k: k.at)
            for a, b in zip(mine, mine[1:]):
                _check(a.rejoin_at is not None and b.at >= a.rejoin_at,
                       f"kills: learner {i} dies at {b.at:g} while still dead from its death at {a.at:g} "
                       f"(rejoin_at {a.rejoin_at}); give each Kill but the last a rejoin_at before the next Kill.at")
        _check(isinstance(self.failures, Failures), "failures must be a Failures")
        if self.failures.enabled:
            _check(self.failures.chips >= n, f"failures.chips={self.failures.chips} is fewer than the {n} learners; "
                                             "give every learner at least one chip")
            _check(not self.run.deterministic,
                   "random failures in deterministic mode would stall every learner at each failure (rounds wait "
                   "for the whole roster); set run.deterministic=False or failures.chips=0")
        if self.silence_timeout is not None:
            _finite_at_least("silence_timeout", self.silence_timeout, 0.0, strict=True)
        _check(isinstance(self.fragment_size, int) and self.fragment_size >= 1,
               f"fragment_size must be an int >= 1, got {self.fragment_size!r}")
        lo, hi = self.curvature
        _check(0 < lo <= hi and math.isfinite(hi), f"curvature must be a range 0 < low <= high, got {self.curvature}")
        _check(isinstance(self.lr, (int, float)) and 0 < self.lr * hi < 2,
               f"lr={self.lr!r} times the largest curvature {hi:g} must be in (0, 2), else the gradient step "
               "diverges; lower lr or curvature")
        _finite_at_least("target_spread", self.target_spread, 0.0)
        _check(not self.run.schedule.desloc,
               "the simulator trains by plain gradient steps, which have no Adam moments for DES-LOC to average: "
               "set run.schedule.desloc=False")
        unknown = [lid for lid in self.run.syncer.learners if lid not in self.learner_ids]
        _check(not unknown, f"run.syncer.learners names {unknown}, which are not simulated learners "
                            f"({', '.join(self.learner_ids)}): the syncer would wait for them forever")

    @property
    def learner_ids(self) -> tuple[str, ...]:
        return tuple(f"L{i}" for i in range(len(self.racks)))

    def chips(self) -> tuple[int, ...]:
        """Chips per learner: ``failures.chips`` split evenly (1 each without failures)."""
        n, total = len(self.racks), self.failures.chips
        if not total:
            return (1,) * n
        return tuple(total // n + (i < total % n) for i in range(n))
