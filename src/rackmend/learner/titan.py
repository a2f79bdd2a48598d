"""rackmend inside torchtitan (0.3.0): a torchtitan job is one rack.

A config function returns ``with_rackmend(config)`` (a ``RackmendTrainer.Config``, the
``Trainer.Config`` it was given plus a ``rackmend`` section) and torchtitan's own
``torchtitan.train`` runs it: ``--module my_configs --config my_rack --rackmend.endpoint
tcp://sync:5555 --rackmend.learner-id rackA``. torchtitan builds the class a config's
``Config`` belongs to (``Configurable``), which is how its own experiments bring a trainer
of their own (torchft's ``FaultTolerantTrainer``); here the subclass overrides two methods,
not the loop, and torchtitan's LR schedulers, checkpointer and parallelisms stay its own.

What each part does, and why it sits where it does:

- ``RackmendOptimizersContainer`` is torchtitan's ``OptimizersContainer`` (the class it
  documents for subclassing) with ``step()`` routed through a ``RackmendOptimizer`` around
  the one inner optimizer, which stays ``optimizers[0]``: the LR schedulers and the
  checkpointer see the inner optimizer as before. The learner joins at the start of
  training, after torchtitan has loaded any checkpoint into the model (not when the
  optimizers are built, before that load): a new syncer takes its first values from the
  model the rack trains, not from its random initialisation.
- Tokens: torchtitan counts each step's valid tokens (labels that are not
  ``IGNORE_INDEX``, over the step's micro-batches, summed over the batch mesh) and hands
  the count to ``forward_backward_step`` only; it never reaches the optimizer, and the
  model's forward never sees the labels, so a forward hook (as in ``rackmend.learner.hf``)
  could count only inputs. ``RackmendTrainer.forward_backward_step`` passes that count on,
  and ``step`` gives rackmend this rank's share, ``count / world`` (the learner sums its
  ranks' counts; every rank of the rack is a rank of this job).
- Leaving: torchtitan calls ``Trainer.close()`` when training ends (and when it fails);
  ``RackmendTrainer.close`` closes rackmend after torchtitan's own parts, so the syncer
  logs a clean ``leave``.
- Checkpoints: rackmend's per-rank state goes into torchtitan's checkpoint (DCP) as part
  of the optimizer's state, under a key of its own per rank (``rackmend.rank<r>``): DCP
  keeps one copy of a plain tensor saved under the same key by several ranks, which
  would hand every rank rank 0's blocks. It is applied at the first ``zero_grad`` (or
  ``step``) after the load, before the first forward: torchtitan loads the model's
  parameters after the optimizer's state, and rackmend's rebase onto a newer global
  value must come last.

Refused with a ``ConfigError`` naming the fix: pipeline parallelism (its ranks hold
different layers, and every rank of a rack must hold the same fragment layout), several
model parts, and ``param_groups`` that build more than one inner optimizer.
torchtitan stays optional: ``import rackmend`` does not import this module, and importing
it without torchtitan raises an ImportError naming what to install. Nothing about rounds
or merges lives here: that is ``RackmendOptimizer``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rackmend.config import ConfigError, RackmendConfig
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.zmq_link import ZmqLink

try:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.override import derive
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - exercised only where torchtitan is absent
    raise ImportError("rackmend.learner.titan needs torchtitan 0.3: pip install 'rackmend[torchtitan]' "
                      f"({exc})") from exc

__all__ = ["RackmendOptimizersContainer", "RackmendSection", "RackmendTrainer", "with_rackmend"]


@dataclass(kw_only=True, slots=True)
class RackmendSection:
    """rackmend's part of a torchtitan config, ``--rackmend.*`` on the command line."""

    endpoint: str = ""
    """The syncer's endpoint, e.g. ``tcp://sync-host:5555`` (``rackmend syncer --bind``)."""

    learner_id: str = ""
    """This rack's id: the same on every rank of the job and across restarts. Empty: the
    ``RACKMEND_LEARNER_ID`` environment variable."""

    config: RackmendConfig = field(default_factory=RackmendConfig)
    """rackmend's settings, e.g. ``--rackmend.config.schedule.sync-every 8``; the syncer
    must run with the same overlap and deterministic mode (``rackmend syncer --help``)."""

    def __post_init__(self) -> None:
        # tyro builds no option for an optional dict without a value to start from; an
        # empty mapping is what None means (SyncerConfig.resolved_outer_kwargs).
        syncer = self.config.syncer
        if syncer.outer_kwargs is None:
            self.config = self.config.replace(syncer=dataclasses.replace(syncer, outer_kwargs={}))


class RackmendOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container whose ``step`` is a ``RackmendOptimizer``'s.

    The inner optimizer is the one the config's ``param_groups`` build, kept as
    ``optimizers[0]``. ``rackmend`` is the ``RackmendOptimizer`` around it, built (and
    joined to the syncer) at its first use: the first ``zero_grad`` of training, after
    torchtitan's checkpoint load, so that weights loaded from an initial checkpoint
    (``--checkpoint.initial-load-path``) are what the rack offers a new syncer and what
    its contributions start from; or, on a resume, when the checkpointer asks for the
    state to load into. ``build_rackmend`` builds it; override it to set
    ``on_fail_slow``, ``probe_loss`` or hooks (and swap the subclass in with torchtitan's
    ``--override.imports``, as tests/_titan_shims.py does). ``note_tokens`` takes the step's valid
    tokens of the whole rack (``RackmendTrainer`` passes them); without it a step counts
    what ``RackmendOptimizer`` falls back to (``LearnerConfig.tokens_per_step``, else 1).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        rackmend: RackmendSection = field(default_factory=RackmendSection)
        """The syncer, the rack's id and rackmend's settings."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ConfigError(
                f"rackmend takes one model per rank, but torchtitan built {len(model_parts)} model parts (pipeline "
                "stages): every rank of a rack must hold the same fragment layout; set "
                "--parallelism.pipeline-parallel-degree 1 and shard with FSDP, TP or HSDP instead")
        super().__init__(config, model_parts=model_parts)
        if len(self.optimizers) != 1:
            names = sorted({g.optimizer_name for g in config.param_groups})
            raise ConfigError(
                f"rackmend wraps one inner optimizer, but optimizer.param_groups build {len(self.optimizers)} "
                f"({', '.join(names)}); give every param group the same optimizer_name (their own lr and "
                "weight_decay stay per group)")
        if not config.rackmend.endpoint:
            raise ConfigError("no syncer endpoint: set --rackmend.endpoint tcp://HOST:PORT (rackmend syncer --bind)")
        self.section = config.rackmend
        self._rackmend: RackmendOptimizer | None = None
        self._tokens: torch.Tensor | None = None
        self._loaded: dict[str, Any] | None = None

    def build_rackmend(self) -> RackmendOptimizer:
        """The ``RackmendOptimizer`` of this rank; it joins the syncer."""
        section = self.section
        return RackmendOptimizer(self.model_parts[0], self.optimizers[0], section.config, ZmqLink(section.endpoint),
                                 learner_id=section.learner_id or None)

    @property
    def rackmend(self) -> RackmendOptimizer:
        if self._rackmend is None:
            self._rackmend = self.build_rackmend()
        return self._rackmend

    @property
    def _key(self) -> str:
        return f"rackmend.rank{self.rackmend.rank}"

    def note_tokens(self, rack_tokens: torch.Tensor) -> None:
        """This step's valid tokens over the whole rack (all its ranks' batches); the
        same count may be noted once per micro-batch group: the last one counts."""
        self._tokens = rack_tokens

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ConfigError("RackmendOptimizersContainer.step takes no closure (torchtitan passes none)")
        self._restore()
        tokens = None
        if self._tokens is not None:
            tokens = float(self._tokens) / self.rackmend.world_size
            self._tokens = None
        self.rackmend.step(tokens=tokens)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._restore()  # torchtitan's step begins here, before the forward
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._restore()
        out = super().state_dict()
        out[self._key] = self.rackmend.state_dict()["rackmend"]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._key not in state_dict:
            raise ValueError(
                f"this state holds no rackmend state for rank {self.rackmend.rank} ({self._key}): it was saved "
                "without rackmend or with another number of ranks")
        super().load_state_dict(state_dict)
        # Applied later: torchtitan loads the model's parameters once DCP is done with
        # every Stateful, which would undo the rebase (see the module docstring).
        self._loaded = state_dict[self._key]

    def _restore(self) -> None:
        """Join, if not yet done, and apply rackmend's loaded state, if any."""
        rackmend = self.rackmend
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            rackmend.load_state_dict({"rackmend": loaded})

    def close(self) -> None:
        """Leave the run (``RackmendOptimizer.close``), if this rank ever joined."""
        if self._rackmend is not None:
            self._rackmend.close()


class RackmendTrainer(Trainer):
    """torchtitan's ``Trainer`` with a rack's optimizer; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        rackmend: RackmendSection = field(default_factory=RackmendSection)
        """rackmend: the syncer, this rack's id and rackmend's settings."""

    def __init__(self, config: Config) -> None:
        if config.parallelism.pipeline_parallel_degree > 1:
            raise ConfigError(
                f"rackmend cannot run under pipeline parallelism (--parallelism.pipeline-parallel-degree "
                f"{config.parallelism.pipeline_parallel_degree}): its ranks hold different layers, and every rank "
                "of a rack must hold the same fragment layout; set it to 1 and shard with FSDP, TP or HSDP")
        if type(config.optimizer) is not OptimizersContainer.Config:
            raise ConfigError(
                f"rackmend wraps torchtitan's OptimizersContainer, but the config's optimizer is "
                f"{type(config.optimizer).__qualname__}; use OptimizersContainer.Config (e.g. default_adamw()) and "
                "set rackmend's part in the config's rackmend section")
        config.optimizer = derive(config.optimizer, RackmendOptimizersContainer.Config, rackmend=config.rackmend)
        super().__init__(config)

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        self.optimizers.note_tokens(global_valid_tokens)  # type: ignore[attr-defined]
        return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if isinstance(getattr(self, "optimizers", None), RackmendOptimizersContainer):
                self.optimizers.close()


def with_rackmend(config: Trainer.Config, section: RackmendSection | None = None) -> RackmendTrainer.Config:
    """``config`` as a ``RackmendTrainer.Config`` (every field kept), with ``section`` as
    its ``rackmend`` part; the command line sets the rest (``--rackmend.endpoint``)."""
    return derive(config, RackmendTrainer.Config, rackmend=section or RackmendSection())
