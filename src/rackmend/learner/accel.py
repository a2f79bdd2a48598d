"""rackmend with Hugging Face ``accelerate``: the order of ``prepare``, per-rank state in
``save_state``/``load_state``, and tokens through ``AcceleratedOptimizer``.

``prepare(accelerator, model, inner, config, link, learner_id=...)`` does what a script
must do in this order: ``accelerator.prepare(model)`` first (it places the model on
``accelerator.device``, which gives its tensors new memory, and wraps it in DDP), then
``RackmendOptimizer`` around the inner optimizer, then ``accelerator.prepare`` of that
optimizer. It returns the prepared model and the ``AcceleratedOptimizer``; its
``.optimizer`` is the ``RackmendOptimizer``, whose ``add_tokens(n)`` counts a
micro-batch's tokens (``AcceleratedOptimizer.step`` takes no ``tokens=``) and whose
``close()`` leaves the run. ``accelerator.save_state(folder)`` then writes each rank's
rackmend state into ``folder`` beside accelerate's files (accelerate saves the
optimizer from the main process only), and ``load_state(folder)`` reads each rank's own
back after the model's weights are loaded.

Nothing about rounds or merges lives here: that is ``RackmendOptimizer``'s. A model
sharded by accelerate (FSDP, DeepSpeed, Megatron) is refused: it is sharded after the
optimizer exists; shard it with ``fully_shard`` yourself (docs/integration.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rackmend.config import ConfigError, RackmendConfig
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.base import LearnerLink

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - exercised only where accelerate is absent
    raise ImportError("rackmend.learner.accel needs Hugging Face accelerate: pip install accelerate "
                      "(or pip install 'rackmend[accelerate]')") from exc

__all__ = ["prepare"]

_SHARDING = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed",
             DistributedType.MEGATRON_LM: "Megatron-LM"}


def prepare(accelerator: "accelerate.Accelerator", model: nn.Module, inner: torch.optim.Optimizer,
            config: RackmendConfig, link: LearnerLink, *, learner_id: str | None = None,
            **kwargs: Any) -> tuple[nn.Module, AcceleratedOptimizer]:
    """``model`` prepared, and ``inner`` wrapped in ``RackmendOptimizer`` and prepared, in
    the order that works (the module docstring); ``kwargs`` go to ``RackmendOptimizer``.
    ``inner`` may be built on ``model``'s parameters before or after ``model`` was
    prepared. Joins the run through ``link`` (loading the syncer's global value into the
    model) and registers the per-rank checkpoint hooks on ``accelerator``."""
    if isinstance(inner, (RackmendOptimizer, AcceleratedOptimizer)):
        raise ConfigError(f"rackmend.learner.accel.prepare takes the inner optimizer (e.g. AdamW over "
                          f"model.parameters()), not a {type(inner).__name__}: it builds RackmendOptimizer and "
                          "prepares it itself")
    sharder = _SHARDING.get(accelerator.distributed_type)
    if sharder is not None:
        raise ConfigError(
            f"rackmend.learner.accel.prepare: this Accelerator runs {sharder}, which shards the model inside "
            "prepare(); rackmend takes DDP and single-process accelerators. Shard the model with fully_shard "
            "yourself and wrap the optimizer with RackmendOptimizer (docs/integration.md, 'Sharded models')")
    if not getattr(model, "_is_accelerate_prepared", False):
        model = accelerator.prepare(model)
    mine = {id(p) for p in model.parameters()}
    stale = [p for group in inner.param_groups for p in group["params"] if id(p) not in mine]
    if stale:
        raise ConfigError(f"the inner optimizer steps {len(stale)} tensors that are not parameters of the prepared "
                          "model (accelerator.prepare(model) replaced them): build the inner optimizer from "
                          "model.parameters() after preparing the model")
    opt = RackmendOptimizer(model, inner, config, link, learner_id=learner_id, **kwargs)
    opt.state_per_rank = True  # accelerate saves the optimizer from the main process only
    resume: list[Path] = []

    def save_rank_state(models: list, weights: list, folder: str) -> None:
        opt.save_rank_state(folder)  # every process runs save_state's hooks

    def note_folder(models: list, folder: str) -> None:
        # Loaded with the optimizer, after the model's weights: loading rackmend's part
        # (which may rebase the parameters onto a newer global value) before them would
        # see it overwritten.
        resume[:] = [Path(folder)]

    def load_rank_state(o: RackmendOptimizer) -> None:
        if resume:
            opt.load_rank_state(resume.pop())

    accelerator.register_save_state_pre_hook(save_rank_state)
    accelerator.register_load_state_pre_hook(note_folder)
    opt.register_load_state_dict_post_hook(load_rank_state)
    return model, accelerator.prepare(opt)
