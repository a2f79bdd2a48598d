"""The tsugi-mend 0.1.x API (``MendConfig``, ``mend_init``, ``get_runtime``, ...) over
rackmend's engine, so a training loop written for that SDK runs unchanged while it is
ported.

Every call lands on a ``RackmendOptimizer`` (built by ``mend_init`` around the caller's
optimizer) and its link to a ``rackmend syncer``; nothing here merges, schedules or
applies on its own. Where that SDK's semantics were wrong, rackmend's hold:

- the syncer runs an outer optimizer on its own copy of the model and sends the new
  global value; the runtime applies it itself (at t_send + tau), so
  ``MergeResult.merged_delta`` is empty and a caller's ``apply_merged_delta`` applies
  nothing (indexing it by name raises, saying so);
- the outer gradient is computed by the runtime against the global value it holds, so
  the ``fragment_provider`` is checked (names and shapes against the model) but its
  values are not sent;
- fragments leave on rackmend's schedule (each at its own offset every
  ``sync_period_steps``): ``step_end`` sends whatever is due even when the caller skipped
  ``outer_step_begin`` because an earlier round was still in flight.

Settings rackmend cannot honour raise a ``ConfigError`` naming the alternative. The
settings that govern rounds are the syncer's in rackmend (``syncer_flags()``); a learner
whose values differ from those the syncer states at join gets a warning naming the
syncer's value.
docs/migration.md has the setting-by-setting table and a before/after sample.
What does not live here: the algorithm (``rackmend.core``), the optimizer wrapper
(``rackmend.learner``), the transport.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO, Union

import torch
from torch import nn

from rackmend.config import (
    ConfigError,
    CompressionConfig,
    LearnerConfig,
    RackmendConfig,
    ScheduleConfig,
    SyncerConfig,
    frozen_config,
)
from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import canonical_name, fragments_due, model_tensors
from rackmend.core.messages import Update
from rackmend.core.settings import SyncerSettings
from rackmend.learner import RackmendOptimizer
from rackmend.transport.base import LearnerLink

__all__ = [
    "MendConfig",
    "MergeResult",
    "OuterSchedule",
    "MendRuntime",
    "mend_init",
    "mend_shutdown",
    "get_runtime",
]

log = logging.getLogger("rackmend.compat")

FragmentProvider = Union[Callable[[], Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
"""What ``outer_step_begin`` accepts: a mapping of parameter name to tensor, or a
callable returning one."""

DEFAULT_OVERLAP = 2
"""tau used for ``concurrent_outer_step=True`` when ``overlap_steps`` is not set: the
syncer's own default (``rackmend syncer --overlap``)."""


@frozen_config
@dataclass(frozen=True, kw_only=True)
class MendConfig:
    """tsugi-mend's configuration, field for field, plus the few settings rackmend needs
    that the SDK did not have (marked below). ``to_rackmend()`` gives the equivalent
    ``RackmendConfig``; ``syncer_flags()`` the matching ``rackmend syncer`` flags."""

    # -- the SDK's fields ---------------------------------------------------------
    quorum_min_learners: int = 1
    """Minimum quorum K: contributions from distinct learners a round needs before it may
    close. A syncer setting in rackmend (``SyncerConfig.min_quorum``, ``--min-quorum``)."""

    grace_window_ms: float = 2000.0
    """Upper bound of the adaptive grace window after quorum, in milliseconds. A syncer
    setting (``SyncerConfig.grace_max`` in seconds, ``--grace-max``)."""

    token_weighted_merge: bool = True
    """Weight contributions by the work behind them: True gives rackmend's
    ``tokens_sq_per_step`` weighting (tokens x tokens per step), False ``uniform``. A syncer
    setting (``--weighting``). Token counts come from ``step_end(step, tokens=n)`` or
    ``tokens_per_step``."""

    sync_period_steps: int = 128
    """H: inner steps between two sends of one fragment (``ScheduleConfig.sync_every``)."""

    concurrent_outer_step: bool = True
    """Overlap the wait for a merge with inner steps. True: the merged value is applied
    ``overlap_steps`` (tau) steps after the send, and training never waits for it outside
    deterministic mode. False: tau = 0, the value is applied at the first step after it
    arrives (rackmend never blocks a learner on its peers outside deterministic mode)."""

    diagnostics_dir: str | None = None
    """Directory for the runtime's diagnostics: one JSONL file per learner
    (``<learner_id>.jsonl``), a record per applied merge. The per-merge facts of the whole
    run (who merged, weights, quorum and grace times) are in the syncer's ``--log``."""

    compression: str = "none"
    """Outer-gradient codec (the SDK validated ``none``, ``int8``, ``powersgd`` but never
    used them); rackmend encodes with it (``CompressionConfig.uplink``), error feedback
    included. Any rackmend codec spec, e.g. ``int8`` or ``powersgd:rank=4``."""

    des_loc: bool = False
    """DES-LOC: also average the inner optimizer's Adam moments across learners
    (``ScheduleConfig.desloc`` with rackmend's periods, ``exp_avg`` every 3 x
    ``sync_period_steps`` and ``exp_avg_sq`` every 6 x). Needs ``optimizer=`` (a
    ``torch.optim.Adam`` or ``AdamW``) in ``mend_init`` and the same value on every learner;
    the syncer follows the first learner to join, no flag needed. Off by default, as its
    measurements advise (``ScheduleConfig.desloc``)."""

    async_tp: bool = False
    """Async tensor parallelism inside the rack: not rackmend's to switch on; True raises."""

    fail_slow_detection: bool = False
    """FALCON-style fail-slow detection. It runs on the syncer, from the step times every
    learner reports (``SyncerConfig.failslow``): ``syncer_flags()`` gives ``--failslow``
    for True and ``--no-failslow`` for False (the SDK detected nothing by default; plain
    rackmend detects by default). Where it runs, rounds stop waiting for a rack found slow
    and that rack's learner is told: a warning in its log and, with True and
    ``diagnostics_dir``, a ``fail_slow`` record in its diagnostics file. A learner with
    True that joins a syncer running without it is warned at join. Off in deterministic
    mode, whose rounds wait for every learner by definition, so True with
    ``deterministic`` raises."""

    # -- rackmend's additions -----------------------------------------------------
    num_fragments: int = 1
    """P (rackmend addition): the model is sent in P fragments with offsets spread over
    the period, so the link carries one fragment at a time. 1 is the SDK's whole-model
    sync."""

    overlap_steps: int | None = None
    """tau (rackmend addition): steps between a send and applying its merged value. None:
    2 with ``concurrent_outer_step`` (capped below ``sync_period_steps``), else 0.
    Learners and syncer must agree (``--overlap``)."""

    deterministic: bool = False
    """Bit-reproducible mode (rackmend addition): every round waits for the whole roster
    and each learner waits at t_send + tau for the merged value. Syncer: ``--deterministic``."""

    tokens_per_step: float | None = None
    """What one step is worth when ``step_end`` gets no ``tokens`` (rackmend addition;
    ``LearnerConfig.tokens_per_step``). None: 1 per step, with a warning, and a rack
    counting steps beside racks counting tokens weighs almost nothing."""

    wait_timeout_s: float = 600.0
    """Seconds a deterministic-mode wait for a merged value may take before it fails
    (rackmend addition; ``LearnerConfig.wait_timeout``)."""

    def validate(self) -> None:
        unsupported = (
            ("async_tp", "async tensor parallelism lives inside the rack; rackmend leaves intra-rack "
             "parallelism to PyTorch: set async_tp=False and enable it in your own TP setup "
             "(torch.distributed._symmetric_memory / torchtitan's async TP setting)"),
        )
        for name, why in unsupported:
            if getattr(self, name):
                raise ConfigError(f"MendConfig.{name}=True: {why}")
        _need(self.quorum_min_learners >= 1,
              f"MendConfig.quorum_min_learners must be >= 1, got {self.quorum_min_learners}")
        _need(self.grace_window_ms >= 0,
              f"MendConfig.grace_window_ms must be >= 0 milliseconds, got {self.grace_window_ms}")
        _need(self.sync_period_steps >= 1,
              f"MendConfig.sync_period_steps must be >= 1, got {self.sync_period_steps}")
        if self.fail_slow_detection and self.deterministic:
            raise ConfigError(
                "MendConfig.fail_slow_detection=True with deterministic=True: deterministic rounds wait for every "
                "learner by definition, so the syncer detects no fail-slow rack; drop one of the two")
        if not self.concurrent_outer_step and self.overlap_steps:
            raise ConfigError(
                f"MendConfig.concurrent_outer_step=False asks for no overlap but overlap_steps="
                f"{self.overlap_steps}; set concurrent_outer_step=True or overlap_steps=0")
        try:
            self.to_rackmend()
        except ConfigError as exc:
            raise ConfigError(f"MendConfig: {exc} (here sync_every is sync_period_steps, overlap is "
                              "overlap_steps, uplink is compression)") from None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def overlap(self) -> int:
        """tau as resolved from ``overlap_steps`` and ``concurrent_outer_step``."""
        if self.overlap_steps is not None:
            return self.overlap_steps
        return min(DEFAULT_OVERLAP, self.sync_period_steps - 1) if self.concurrent_outer_step else 0

    def to_rackmend(self, learners: tuple[str, ...] = ()) -> RackmendConfig:
        """The equivalent ``RackmendConfig``; ``learners`` is the expected roster."""
        return RackmendConfig(
            schedule=ScheduleConfig(sync_every=self.sync_period_steps, num_fragments=self.num_fragments,
                                    overlap=self.overlap, desloc=self.des_loc),
            syncer=SyncerConfig(min_quorum=self.quorum_min_learners, learners=tuple(learners),
                                grace_max=self.grace_window_ms / 1000.0,
                                weighting="tokens_sq_per_step" if self.token_weighted_merge else "uniform",
                                failslow=self.fail_slow_detection),
            learner=LearnerConfig(tokens_per_step=self.tokens_per_step, wait_timeout=self.wait_timeout_s),
            compression=CompressionConfig(uplink=self.compression),
            deterministic=self.deterministic,
        )

    def syncer_flags(self, learners: tuple[str, ...] | list[str] = ()) -> list[str]:
        """``rackmend syncer`` flags that run the syncer side of this configuration (add
        ``--bind``, ``--log``, keys, checkpoints). ``learners``: the expected roster,
        which deterministic mode needs."""
        config = self.to_rackmend(tuple(learners))
        sc = config.syncer
        flags = ["--min-quorum", str(sc.min_quorum), "--grace-max", f"{sc.grace_max:g}",
                 "--weighting", sc.weighting, "--overlap", str(config.schedule.overlap),
                 "--failslow" if sc.failslow else "--no-failslow"]
        if learners:
            flags += ["--learners", ",".join(learners)]
        if config.deterministic:
            flags.append("--deterministic")
        return flags


def syncer_differences(config: MendConfig, learner_id: str, syncer: SyncerSettings) -> list[str]:
    """A sentence for each of ``config``'s round settings that the syncer (stating
    ``syncer`` at join) runs with another value of, in the SDK's words: in rackmend these
    are the syncer's settings, and a learner's value is never sent."""
    weighting = {"tokens_sq_per_step": "True", "uniform": "False"}.get(syncer.weighting)
    theirs = {
        "quorum_min_learners": (config.quorum_min_learners == syncer.min_quorum,
                                f"min_quorum={syncer.min_quorum} (--min-quorum)",
                                f"quorum_min_learners={syncer.min_quorum}"),
        "grace_window_ms": (config.grace_window_ms / 1000.0 == syncer.grace_max,
                            f"grace_max={syncer.grace_max:g} s (--grace-max)",
                            f"grace_window_ms={syncer.grace_max * 1000:g}"),
        "token_weighted_merge": (weighting == str(config.token_weighted_merge),
                                 f"weighting={syncer.weighting!r} (--weighting)",
                                 f"token_weighted_merge={weighting}" if weighting else None),
        # False beside a syncer that detects loses nothing: the learner only hears more.
        "fail_slow_detection": (not config.fail_slow_detection or syncer.failslow,
                                "fail-slow detection off (--no-failslow, or --deterministic)",
                                "fail_slow_detection=False"),
    }
    return [f"learner {learner_id}: MendConfig.{name}={getattr(config, name)!r} is not what this run uses: the "
            f"syncer runs with {have}, and the syncer's value rules (in rackmend it is a syncer setting; a "
            f"learner's is never sent). Start the syncer with the flags config.syncer_flags() gives"
            + (f", or set {fix} to match" if fix else " (no MendConfig value gives the syncer's)")
            for name, (same, have, fix) in theirs.items() if not same]


class _MendOptimizer(RackmendOptimizer):
    """``RackmendOptimizer`` whose warnings about the syncer's settings name the
    ``MendConfig`` fields the caller set."""

    def __init__(self, *args: Any, mend: MendConfig, **kwargs: Any) -> None:
        self._mend = mend  # before the join, which compares settings
        super().__init__(*args, **kwargs)

    def _syncer_differences(self, syncer: SyncerSettings) -> list[str]:
        return syncer_differences(self._mend, self.learner_id, syncer)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class OuterSchedule:
    """What happens after inner step ``step`` (0-based, as the SDK counted)."""

    step: int
    should_sync_params: bool
    """Some fragment leaves after this step: call ``outer_step_begin`` now."""
    fragments: tuple[int, ...]
    """The fragments that leave after this step."""


class _AppliedDelta(Mapping[str, torch.Tensor]):
    """``MergeResult.merged_delta``: empty, because the runtime has applied the merge.
    Iterating it (the usual ``apply_merged_delta``) applies nothing; looking a name up
    raises, saying why, instead of handing out a delta to add a second time."""

    def __getitem__(self, name: str) -> torch.Tensor:
        raise KeyError(f"{name!r}: merged_delta is empty because rackmend already applied the merged value "
                       "(its outer step runs on the syncer); remove apply_merged_delta from the loop")

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "merged_delta(applied by rackmend; empty)"


@dataclass(frozen=True)
class MergeResult:
    """The merges the runtime applied since the previous ``outer_step_collect``."""

    round_id: int
    """The ``round_id`` given to ``outer_step_begin`` for the latest send these merges
    answer (the send's 0-based step when ``outer_step_begin`` was skipped)."""
    merged_delta: Mapping[str, torch.Tensor]
    """Always empty: rackmend applies the merged value itself, so there is nothing left
    for the caller to apply (see the module docstring)."""
    fragments: tuple[int, ...]
    """Fragments whose new global value was applied, in order of application."""
    versions: tuple[int, ...]
    """The global version now held for each of ``fragments``."""
    staleness: int
    """Largest version lag among them (``RackmendOptimizer.version_lags``): 0 when each
    applied value is the next version after the one held before."""
    step: int
    """The 0-based step at whose ``step_end`` the latest of them was applied."""


@dataclass
class _Applied:
    fragment: int
    version: int
    lag: int
    round_id: int
    step: int


@dataclass
class MendRuntime:
    """The per-model runtime ``mend_init`` builds; ``get_runtime(model)`` returns it."""

    optimizer: RackmendOptimizer
    """The rackmend engine: the caller's optimizer wrapped. Its ``versions``,
    ``blocked_seconds`` and ``bytes_sent`` are this learner's numbers."""
    config: MendConfig
    """The configuration ``mend_init`` was given."""
    diagnostics: TextIO | None = None
    """The open ``diagnostics_dir`` file, if any."""
    _step: int | None = field(default=None, init=False, repr=False)
    _begun: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """Step -> round_id given to ``outer_step_begin`` in that step."""
    _round_of: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """Fragment -> round_id of its latest send."""
    _applied: list[_Applied] = field(default_factory=list, init=False, repr=False)
    _names: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._names = {n: tuple(t.shape) for n, t, _ in model_tensors(self.optimizer.model)}
        self.optimizer.on_apply = self._on_apply
        if self.config.fail_slow_detection:
            warn = self.optimizer.on_fail_slow
            self.optimizer.on_fail_slow = lambda report: (warn(report), self._on_fail_slow(report))

    # ---------------------------------------------------------------- the SDK's calls
    def step_begin(self, step: int) -> None:
        """Start inner step ``step`` (0-based, consecutive)."""
        expected = self.optimizer.step_count
        if step != expected:
            raise RuntimeError(f"step_begin({step}) but the runtime is at step {expected}: steps are counted "
                               "from 0 and each needs step_begin and step_end once, in order")
        if self._step is not None:
            raise RuntimeError(f"step_begin({step}) before step_end({self._step})")
        self._step = step

    def schedule_for(self, step: int) -> OuterSchedule:
        """Which fragments leave after inner step ``step``."""
        due = tuple(fragments_due(step + 1, self.optimizer.fragments, self.config.sync_period_steps))
        return OuterSchedule(step=step, should_sync_params=bool(due), fragments=due)

    def outer_step_in_flight(self) -> bool:
        """Whether a fragment sent earlier still waits for its merged value."""
        return bool(self.optimizer.fragments_in_flight)

    def outer_step_begin(self, round_id: int, fragment_provider: FragmentProvider) -> None:
        """Mark the fragments due after this step as round ``round_id``; they are sent at
        ``step_end``. ``fragment_provider`` (a mapping of parameter name to tensor, or a
        callable returning one) is checked against the model; its values are not sent,
        the runtime computes the outer gradient against the global value it holds."""
        step = self._current("outer_step_begin")
        due = self.schedule_for(step).fragments
        if not due:
            raise RuntimeError(
                f"outer_step_begin at step {step}, but no fragment leaves after it: rackmend sends each fragment "
                f"at its own offset every {self.config.sync_period_steps} steps; call it when "
                "schedule_for(step).should_sync_params")
        if step in self._begun:
            raise RuntimeError(f"outer_step_begin called twice at step {step}")
        self._check_provider(fragment_provider)
        self._begun[step] = round_id

    def outer_step_collect(self) -> MergeResult | None:
        """The merges applied since the last call, or None when there were none."""
        if not self._applied:
            return None
        done, self._applied = self._applied, []
        return MergeResult(round_id=done[-1].round_id, merged_delta=_AppliedDelta(),
                           fragments=tuple(a.fragment for a in done), versions=tuple(a.version for a in done),
                           staleness=max(a.lag for a in done), step=done[-1].step)

    def step_end(self, step: int, *, tokens: float | None = None) -> None:
        """End inner step ``step``: count it (``tokens``: what this rank trained on; see
        ``MendConfig.tokens_per_step``), send the fragments due, apply merged values due."""
        current = self._current("step_end")
        if step != current:
            raise RuntimeError(f"step_end({step}) but step_begin was for step {current}")
        opt = self.optimizer
        for p in self.schedule_for(step).fragments:
            # Skipped begin (a round still in flight): rackmend sends anyway, since
            # skipping a send would leave this learner's work out of the next merge.
            self._round_of[p] = self._begun.get(step, step)
        self._begun.pop(step, None)
        opt.after_inner_step(opt._tokens(tokens))
        self._step = None

    def close(self) -> None:
        self.optimizer.close()
        if self.diagnostics is not None:
            self.diagnostics.close()
            self.diagnostics = None

    # ---------------------------------------------------------------------- internals
    def _current(self, what: str) -> int:
        if self._step is None:
            raise RuntimeError(f"{what} outside a step: call step_begin(step) first")
        return self._step

    def _check_provider(self, provider: FragmentProvider) -> None:
        got = provider() if callable(provider) else provider
        if not isinstance(got, Mapping) or not got:
            raise TypeError("fragment_provider must be (or return) a non-empty mapping of parameter name to "
                            f"tensor, got {type(got).__name__}")
        for name, tensor in got.items():
            canon = canonical_name(name)
            if canon not in self._names:
                raise ValueError(f"fragment_provider gave {name!r}, which the model does not synchronise; it has "
                                 f"e.g. {sorted(self._names)[:5]}")
            if tuple(tensor.shape) != self._names[canon]:
                raise ValueError(f"fragment_provider gave {name!r} with shape {list(tensor.shape)}, the model's "
                                 f"is {list(self._names[canon])}")

    def _on_fail_slow(self, report: FailSlowReport) -> None:
        if self.diagnostics is not None:
            # Heard before the step is counted: step_count is this step's 0-based index.
            self.diagnostics.write(json.dumps({"event": "fail_slow", "step": self.optimizer.step_count,
                                               "rank": report.rank, "state": report.state,
                                               "ratio": report.ratio, "fleet_ratio": report.fleet_ratio,
                                               "steps": report.steps, "cost_s": report.cost_s}) + "\n")
            self.diagnostics.flush()

    def _on_apply(self, p: int, upd: Update) -> None:
        step = self.optimizer.step_count - 1
        applied = _Applied(p, upd.version, self.optimizer.version_lags[p], self._round_of.get(p, step), step)
        self._applied.append(applied)
        if self.diagnostics is not None:
            self.diagnostics.write(json.dumps({"event": "merge_applied", "step": step, "fragment": p,
                                               "version": upd.version, "round_id": applied.round_id,
                                               "staleness": applied.lag}) + "\n")
            self.diagnostics.flush()


class _CallerSteps(torch.optim.Optimizer):
    """The inner optimizer when ``mend_init`` gets none: in the SDK's loop the caller steps
    its own optimizer, so this one only holds the parameter list."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("this runtime was built without the caller's optimizer; step your own optimizer and "
                           "call runtime.step_end(step), or pass optimizer= to mend_init")


_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, MendRuntime]" = weakref.WeakKeyDictionary()


def mend_init(
    model: nn.Module,
    config: MendConfig,
    *,
    endpoint: str | None = None,
    learner_id: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    learners: tuple[str, ...] = (),
    link: LearnerLink | None = None,
) -> MendRuntime:
    """Join the run: connect to the syncer at ``endpoint`` (or ``RACKMEND_CONNECT``) as
    ``learner_id`` (or ``RACKMEND_LEARNER_ID``), load the current global value into
    ``model`` and build its runtime (``get_runtime(model)``).

    ``optimizer``: the caller's inner optimizer; passing it puts its state into
    ``runtime.optimizer.state_dict()`` (checkpoints). ``learners``: the expected roster
    (as given to the syncer). ``link``: another transport (tests, notebooks), instead of
    ZeroMQ to ``endpoint``.
    """
    if model in _RUNTIMES:
        raise RuntimeError("mend_init was already called for this model; call mend_shutdown(model) first")
    if config.des_loc and optimizer is None:
        raise ConfigError("MendConfig.des_loc=True averages the inner optimizer's Adam moments, so rackmend needs that "
                          "optimizer: pass optimizer= (a torch.optim.Adam or AdamW) to mend_init")
    rconfig = config.to_rackmend(tuple(learners))
    if link is None:
        from rackmend.transport.sharded import connect

        link = connect(endpoint)  # RACKMEND_CONNECT when None; several endpoints: a sharded syncer
    inner = optimizer if optimizer is not None else _CallerSteps(p for p in model.parameters() if p.requires_grad)
    opt = _MendOptimizer(model, inner, rconfig, link, learner_id=learner_id, mend=config)
    diagnostics = None
    if config.diagnostics_dir is not None:
        directory = Path(config.diagnostics_dir)
        directory.mkdir(parents=True, exist_ok=True)
        diagnostics = open(directory / f"{opt.learner_id}.jsonl", "a", encoding="utf-8")
    runtime = MendRuntime(optimizer=opt, config=config, diagnostics=diagnostics)
    _RUNTIMES[model] = runtime
    return runtime


def get_runtime(model: nn.Module) -> MendRuntime:
    """The runtime ``mend_init`` built for ``model``."""
    try:
        return _RUNTIMES[model]
    except KeyError:
        raise RuntimeError("no runtime for this model: call mend_init(model, config) first") from None


def mend_shutdown(model: nn.Module) -> None:
    """Leave the run (the syncer stops expecting this learner at once) and drop the
    runtime. Calling it for a model without a runtime does nothing."""
    runtime = _RUNTIMES.pop(model, None)
    if runtime is not None:
        runtime.close()
