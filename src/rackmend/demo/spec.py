"""What a demo or benchmark run is made of: settings, faults, links, and the arms.

Plain data only (dataclasses and their JSON form); nothing here starts a process,
opens a socket or trains. ``orchestrate`` runs what is described here, ``worker`` is
one learner process, ``report`` turns the measurements into files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rackmend.config import (
    HEARTBEAT_TIMEOUT_S,
    CompressionConfig,
    ConfigError,
    LearnerConfig,
    RackmendConfig,
    ScheduleConfig,
    SyncerConfig,
)
from rackmend.netem import LinkConfig
from rackmend.workloads import GPTConfig

__all__ = [
    "ARMS",
    "DEMO_FAILSLOW",
    "ArmSpec",
    "FaultPlan",
    "LinkPlan",
    "RunSettings",
    "arm_specs",
    "config_to_dict",
    "config_from_dict",
]

LrSchedule = Literal["constant", "cosine"]

ARMS = ("data-parallel", "diloco", "rackmend", "rackmend-int4", "local")
"""Every arm, in the order they run and are reported."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _fraction(name: str, value: float) -> None:
    _check(0 <= value <= 1, f"{name}={value} must be a fraction of the arm's duration in [0, 1]")


@dataclass(kw_only=True)
class FaultPlan:
    """Faults injected into every arm at the same moments (fractions of the duration),
    so the arms face the same trouble. Learner indices count from 0."""

    kill_learner: int | None = 1
    """This learner's process is SIGKILLed and later started again with the same id.
    None: nobody is killed."""

    kill_at: float = 0.30
    """When the kill happens, as a fraction of the arm's duration."""

    restart_at: float = 0.45
    """When the killed learner is started again (a fresh process that rejoins)."""

    slow_learner: int | None = 2
    """This learner turns fail-slow: each of its steps takes ``slow_factor`` times as
    long (it sleeps after computing), as a throttled or degraded rack would. None: off."""

    slow_from: float = 0.50
    """Start of the fail-slow window (fraction of the duration)."""

    slow_until: float = 0.80
    """End of the fail-slow window (fraction of the duration)."""

    slow_factor: float = 4.0
    """How many times longer each step takes while fail-slow (> 1)."""

    worse_link_learner: int | None = 3
    """This learner's link has ``1 / worse_link_factor`` of the bandwidth and
    ``worse_link_factor`` times the latency of the others, for the whole run. None: off."""

    worse_link_factor: float = 4.0
    """How much worse that link is (>= 1)."""

    def validate(self, learners: int) -> None:
        for name in ("kill_learner", "slow_learner", "worse_link_learner"):
            idx = getattr(self, name)
            _check(idx is None or 0 <= idx < learners,
                   f"{name}={idx} is not a learner index; use 0..{learners - 1} or None to turn it off")
        for name in ("kill_at", "restart_at", "slow_from", "slow_until"):
            _fraction(name, getattr(self, name))
        _check(self.kill_at < self.restart_at, f"restart_at={self.restart_at} must come after kill_at={self.kill_at}")
        _check(self.slow_from < self.slow_until,
               f"slow_until={self.slow_until} must come after slow_from={self.slow_from}")
        _check(self.slow_factor > 1, f"slow_factor must be > 1, got {self.slow_factor}")
        _check(self.worse_link_factor >= 1, f"worse_link_factor must be >= 1, got {self.worse_link_factor}")

    @classmethod
    def none(cls) -> "FaultPlan":
        """No faults at all (the paired benchmark's clean comparison)."""
        return cls(kill_learner=None, slow_learner=None, worse_link_learner=None)


@dataclass(kw_only=True)
class LinkPlan:
    """The emulated WAN link between each learner and the syncer (each direction)."""

    bandwidth_mbit: float | None = 50.0
    """Cap per learner link and direction, in Mbit/s. None: no cap."""

    latency_ms: float = 100.0
    """One-way latency in milliseconds."""

    jitter: float = 0.5
    """Spread of the latency as a fraction of it (0.5: +-50 %)."""

    def link_config(self, factor: float = 1.0, seed: int = 0) -> LinkConfig:
        """The emulator's config, ``factor`` times worse (bandwidth / factor, latency x factor)."""
        bw = None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / factor
        return LinkConfig(bandwidth_bps=bw, latency_s=self.latency_ms * factor / 1e3, jitter=self.jitter, seed=seed)

    def validate(self) -> None:
        _check(self.bandwidth_mbit is None or self.bandwidth_mbit > 0,
               f"bandwidth_mbit must be > 0 or None for no cap, got {self.bandwidth_mbit}")
        _check(self.latency_ms >= 0, f"latency_ms must be >= 0, got {self.latency_ms}")
        self.link_config()  # the emulator's own checks (jitter range)


@dataclass(kw_only=True)
class RunSettings:
    """One run of one or more arms: workload, schedule, links, faults, stop rule."""

    learners: int = 4
    """M: learner processes per arm."""

    duration_s: float | None = 60.0
    """Wall seconds each arm trains for, counted from the moment every learner has
    joined. None: stop by ``max_steps`` only."""

    max_steps: int | None = None
    """Inner steps per learner after which it stops. None: stop by ``duration_s`` only."""

    batch_size: int = 8
    """Sequences per learner step."""

    lr: float = 3e-3
    """Inner AdamW learning rate (the peak of ``lr_schedule``)."""

    lr_schedule: LrSchedule = "constant"
    """The inner learning rate over each learner's steps: ``constant`` keeps ``lr``;
    ``cosine`` rises linearly over ``warmup_steps``, then falls along a half cosine to
    ``lr_final`` x ``lr`` at the learner's last step, so it needs ``max_steps`` (a
    learner process restarted by a fault starts it again)."""

    warmup_steps: int = 0
    """Steps of the ``cosine`` schedule's linear warm-up (0: none)."""

    lr_final: float = 0.1
    """The ``cosine`` schedule's learning rate at the last step, as a fraction of ``lr``."""

    seed: int = 0
    """Seed of the model initialisation, the data streams and the link jitter."""

    sync_every: int = 16
    """H of the diloco and rackmend arms."""

    fragments: int = 4
    """P of the rackmend arm."""

    overlap: int = 2
    """tau of the rackmend arm."""

    evals: int = 8
    """Held-out evaluations of the global model per arm (plus one at the start and one at the end)."""

    arms: tuple[str, ...] = ("data-parallel", "diloco", "rackmend")
    """Which arms to run, from ``ARMS``."""

    link: LinkPlan = field(default_factory=LinkPlan)
    """The emulated WAN link of every learner."""

    faults: FaultPlan = field(default_factory=FaultPlan)
    """Faults injected into every arm."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Shape of the GPT."""

    min_step_s: float = 0.0
    """Each learner step lasts at least this long (the learner sleeps the rest, before
    any fail-slow factor applies), as a rack of steady speed would; 0: as fast as the
    CPU allows. Tests pace tiny models with it so that the scheduling noise of a shared
    machine does not drown the injected fail-slow factor."""

    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    """Silence after which the syncer stops expecting a learner (a killed one). Keep it
    well above the time one message takes on the slowest link: heartbeats queue behind
    fragments on the same connection."""

    def validate(self) -> None:
        _check(self.learners >= 1, f"learners must be >= 1, got {self.learners}")
        _check(self.duration_s is not None or self.max_steps is not None,
               "give duration_s or max_steps (or both): otherwise an arm never stops")
        _check(self.duration_s is None or self.duration_s > 0, f"duration_s must be > 0, got {self.duration_s}")
        _check(self.max_steps is None or self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        for name in ("batch_size", "evals"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(self.lr_schedule in ("constant", "cosine"),
               f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        _check(self.lr_schedule == "constant" or self.max_steps is not None,
               "lr_schedule='cosine' decays over each learner's max_steps: set max_steps")
        _check(self.warmup_steps >= 0 and (self.max_steps is None or self.warmup_steps < self.max_steps),
               f"warmup_steps must be >= 0 and below max_steps ({self.max_steps}), got {self.warmup_steps}")
        _check(self.warmup_steps == 0 or self.lr_schedule == "cosine",
               f"warmup_steps={self.warmup_steps} is part of the cosine schedule: set lr_schedule='cosine' "
               "or leave warmup_steps at 0")
        _check(0 <= self.lr_final <= 1, f"lr_final is a fraction of lr, from 0 to 1; got {self.lr_final}")
        _check(self.min_step_s >= 0, f"min_step_s must be >= 0 seconds (0: unpaced), got {self.min_step_s}")
        unknown = [a for a in self.arms if a not in ARMS]
        _check(bool(self.arms) and not unknown, f"arms {unknown or '()'} not known; choose from {', '.join(ARMS)}")
        ScheduleConfig(sync_every=self.sync_every, num_fragments=self.fragments, overlap=self.overlap)
        self.link.validate()
        self.faults.validate(self.learners)
        if self.duration_s is None and self.faults.kill_learner is not None:
            raise ConfigError("faults are scheduled as fractions of duration_s; set duration_s or turn faults off")

    def __post_init__(self) -> None:
        self.arms = tuple(self.arms)
        self.validate()

    def lr_factor(self, done: int) -> float:
        """The inner learning rate of the step after ``done`` steps, as a fraction of
        ``lr`` (``torch.optim.lr_scheduler.LambdaLR``'s function)."""
        if self.lr_schedule == "constant":
            return 1.0
        if done < self.warmup_steps:
            return (done + 1) / self.warmup_steps
        assert self.max_steps is not None  # validate()
        progress = min(1.0, (done - self.warmup_steps) / max(1, self.max_steps - 1 - self.warmup_steps))
        return self.lr_final + (1 - self.lr_final) * 0.5 * (1 + math.cos(math.pi * progress))

    def scheduler(self, inner: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The scheduler that moves ``inner``'s rate along ``lr_schedule``; None for
        ``constant`` (nothing to move)."""
        if self.lr_schedule == "constant":
            return None
        return torch.optim.lr_scheduler.LambdaLR(inner, self.lr_factor)

    @property
    def learner_ids(self) -> list[str]:
        return [f"learner{i}" for i in range(self.learners)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSettings":
        d = dict(d)
        d["link"] = LinkPlan(**d["link"])
        d["faults"] = FaultPlan(**d["faults"])
        d["model"] = GPTConfig(**d["model"])
        return cls(**d)


@dataclass(kw_only=True)
class ArmSpec:
    """One way of training the same model on the same data through the same links."""

    name: str
    """One of ``ARMS``."""
    description: str
    """One line for the report."""
    config: RackmendConfig | None
    """rackmend's configuration; None for ``local`` (plain PyTorch, no syncer)."""
    checkpoint_every: int = 1
    """Syncer merges between checkpoints (the held-out evaluations read them)."""


DEMO_FAILSLOW: dict[str, Any] = {
    "failslow_baseline_steps": 64,
    "failslow_min_steps": 4,
    "failslow_min_slowdown": 1.0,
    "failslow_advise_after": 8,
}
"""Fail-slow settings of the demo's rackmend arms; the defaults are made for runs of
hours. A baseline of 256 steps (at least 64 contributions) would not be learnt before
the slow window of a one-minute demo opens, about 175 steps in with one contribution
per H/P = 4 steps: 64 steps (16 contributions to start) is noisier, which a x4
slowdown can afford. Confirming after 10 steps and telling the learner after 30 would
take most of the window at ~0.7 s per slow step: 4 steps is one contribution of slow
steps. On two shared cores, healthy learners' steps swing by x2-3 for seconds while a
restarted learner imports torch or another job runs, and relative to the fleet by up
to x1.7 (measured in a demo run): so the demo confirms only slowdowns of x2 or more,
where the default 10 % would flag that contention."""


def arm_specs(s: RunSettings) -> dict[str, ArmSpec]:
    """The arms of the issue, all with the same learners, seeds and links."""
    ids = tuple(s.learner_ids)
    lc = LearnerConfig(wait_timeout=60.0, join_timeout=60.0)
    specs = {
        "data-parallel": ArmSpec(
            name="data-parallel",
            description="exchange every step, blocking, all learners, plain average (H=1, P=1, tau=0)",
            config=RackmendConfig(
                schedule=ScheduleConfig(sync_every=1, num_fragments=1, overlap=0),
                syncer=SyncerConfig(min_quorum=s.learners, learners=ids, weighting="uniform",
                                    outer_lr=1.0, outer_kwargs={}),
                learner=lc, deterministic=True),
            checkpoint_every=2,
        ),
        "diloco": ArmSpec(
            name="diloco",
            description=f"classic DiLoCo: whole model every H={s.sync_every} steps, blocking, "
                        "quorum = all, Nesterov outer step (P=1, tau=0)",
            config=RackmendConfig(
                schedule=ScheduleConfig(sync_every=s.sync_every, num_fragments=1, overlap=0),
                syncer=SyncerConfig(min_quorum=s.learners, learners=ids, weighting="uniform", outer_lr=0.7,
                                    outer_kwargs={"momentum": 0.9, "nesterov": True}),  # DiLoCo's own
                learner=lc, deterministic=True),
            checkpoint_every=1,
        ),
        "rackmend": ArmSpec(
            name="rackmend",
            description=f"rackmend defaults: P={s.fragments} fragments every H={s.sync_every} steps, "
                        f"tau={s.overlap} overlap, K=1, adaptive grace, tokens^2/steps weights",
            config=RackmendConfig(
                schedule=ScheduleConfig(sync_every=s.sync_every, num_fragments=s.fragments, overlap=s.overlap),
                syncer=SyncerConfig(min_quorum=1, learners=ids, **DEMO_FAILSLOW),
                learner=lc),
            checkpoint_every=s.fragments,
        ),
        "rackmend-int4": ArmSpec(
            name="rackmend-int4",
            description="the rackmend arm with both directions compressed to int4 (block absmax, error "
                        "feedback on each learner and on the syncer)",
            config=RackmendConfig(
                schedule=ScheduleConfig(sync_every=s.sync_every, num_fragments=s.fragments, overlap=s.overlap),
                syncer=SyncerConfig(min_quorum=1, learners=ids, **DEMO_FAILSLOW),
                compression=CompressionConfig(uplink="int4", downlink="int4"),
                learner=lc),
            checkpoint_every=s.fragments,
        ),
        "local": ArmSpec(
            name="local",
            description="each learner alone with plain PyTorch, no rackmend, no link (the step-time baseline)",
            config=None,
        ),
    }
    return {name: specs[name] for name in s.arms}


def config_to_dict(config: RackmendConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(d: dict[str, Any]) -> RackmendConfig:
    """Inverse of ``config_to_dict`` for every section of ``RackmendConfig``."""
    defaults = RackmendConfig()
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(RackmendConfig):
        value = d[f.name]
        current = getattr(defaults, f.name)
        kwargs[f.name] = type(current)(**value) if dataclasses.is_dataclass(current) else value
    return RackmendConfig(**kwargs)
