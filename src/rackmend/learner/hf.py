"""rackmend inside a Hugging Face ``transformers.Trainer``.

``attach_to_trainer(trainer, config, link, learner_id=...)`` wraps the Trainer's
optimizer (the one ``TrainingArguments`` describe, or the one passed through
``optimizers=``) in a ``RackmendOptimizer``, counts each step's tokens from the batches
the model trains on, and adds rackmend's figures (merges applied, staleness, tokens,
blocked time, bytes) to every Trainer log, so they land in ``trainer.state.log_history``
and in the ``report_to`` loggers. The LR scheduler the Trainer builds then drives the
inner optimizer, as it would without rackmend.

Several ranks per rack (``torchrun --nproc-per-node N``): the Trainer's ``train()`` runs
``accelerator.prepare(model)``, which copies the model to ``cpu:0`` on CPU ranks after the
optimizer exists; ``RackmendOptimizer`` follows such a move at its first step
(``rackmend.learner.binding``). The Trainer writes ``optimizer.pt`` from rank 0 only and
loads it on every rank, so the optimizer's state there is the inner optimizer's, and
each rank writes its own rackmend state beside it (``RackmendOptimizer.save_rank_state``
in ``on_save``) and reads it back when training resumes from that checkpoint. At the end
of ``train()`` the callback closes the optimizer: the syncer logs a clean leave. An
FSDP or DeepSpeed Trainer shards the model inside ``train()``, after the optimizer was
built, so ``attach_to_trainer`` refuses it by name.

``transformers`` stays an optional dependency: ``import rackmend`` does not import this
module; importing it without ``transformers`` raises an ImportError saying what to
install. Nothing about rounds or merges lives here: that is ``RackmendOptimizer``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.messages import Update
from rackmend.learner.batches import count_batch_tokens
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.base import LearnerLink

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - exercised only where transformers is absent
    raise ImportError("rackmend.learner.hf needs the Hugging Face transformers package: pip install transformers "
                      "(or pip install 'rackmend[test]')") from exc

__all__ = ["RackmendCallback", "attach_to_trainer", "count_batch_tokens"]

log = logging.getLogger("rackmend.learner")

PREFIX = "rackmend/"
"""Prefix of the keys this module adds to the Trainer's logs."""


class RackmendCallback(transformers.TrainerCallback):
    """Counts tokens for ``optimizer`` and reports its merges in the Trainer's logs.

    Tokens: a forward pre-hook on ``optimizer.model`` adds up ``count_batch_tokens`` of
    every training forward (module in training mode, gradients on), so micro-batches of
    gradient accumulation add up to the step's tokens and evaluation or probe forwards
    do not count. The optimizer reads the sum at each ``step()`` (its ``count_tokens``).

    Logs (keys prefixed ``rackmend/``), added on each Trainer log: ``merges`` (merged
    values applied since the previous log), ``merges_total``, ``staleness`` (the largest
    ``version_lags`` value among those merges: 0 when each was the next version),
    ``tokens`` (counted since the previous log), ``blocked_s`` and ``bytes_sent`` (totals
    of the optimizer's ``blocked_seconds`` and ``bytes_sent``), ``version_min`` (the oldest
    global version held by any fragment).
    """

    def __init__(self, optimizer: RackmendOptimizer, *, save_rank_state: bool = False) -> None:
        if optimizer.count_tokens is not None:
            raise ConfigError("this RackmendOptimizer already has count_tokens set; RackmendCallback counts tokens "
                              "from the batches itself: build the optimizer without count_tokens")
        self.optimizer = optimizer
        self.save_rank_state = save_rank_state
        """Whether each rank writes its rackmend state into the Trainer's checkpoint folders
        and reads it back on resume (``attach_to_trainer`` sets it, with the optimizer's
        ``state_per_rank``)."""
        self._pending_tokens: int | None = None
        self._uncounted_warned = False
        self._merges = 0
        self._merges_total = 0
        self._staleness = 0
        self._tokens_since_log = 0.0
        self._chained: Callable[[int, Update], None] | None = optimizer.on_apply
        optimizer.on_apply = self._on_apply
        optimizer.count_tokens = self._take_tokens
        self._hook = optimizer.model.register_forward_pre_hook(self._count, with_kwargs=True)

    # ------------------------------------------------------------------ token counting
    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        batch = kwargs if kwargs else (args[0] if args and isinstance(args[0], Mapping) else {})
        n = count_batch_tokens(batch)
        if n is not None:
            self._pending_tokens = (self._pending_tokens or 0) + n

    def _take_tokens(self) -> float:
        pending, self._pending_tokens = self._pending_tokens, None
        if pending is not None:
            n = float(pending)
        else:
            fallback = self.optimizer.config.learner.tokens_per_step
            if fallback is None:
                raise ConfigError(
                    "RackmendCallback saw no input_ids or attention_mask in this step's batches, so it cannot count "
                    "tokens; set LearnerConfig.tokens_per_step to what one step is worth")
            if not self._uncounted_warned:
                self._uncounted_warned = True
                log.warning("batches carry no input_ids or attention_mask: each step counts "
                            "LearnerConfig.tokens_per_step=%s", fallback)
            n = float(fallback)
        self._tokens_since_log += n
        return n

    # ---------------------------------------------------------------------- reporting
    def _on_apply(self, p: int, upd: Update) -> None:
        self._merges += 1
        self._merges_total += 1
        self._staleness = max(self._staleness, self.optimizer.version_lags[p])
        if self._chained is not None:
            self._chained(p, upd)

    def figures(self) -> dict[str, float]:
        """The figures of the next log, and start a new interval."""
        opt = self.optimizer
        out = {
            f"{PREFIX}merges": float(self._merges),
            f"{PREFIX}merges_total": float(self._merges_total),
            f"{PREFIX}staleness": float(self._staleness),
            f"{PREFIX}tokens": float(self._tokens_since_log),
            f"{PREFIX}blocked_s": float(opt.blocked_seconds),
            f"{PREFIX}bytes_sent": float(opt.bytes_sent),
            f"{PREFIX}version_min": float(min(opt.versions)),
        }
        self._merges, self._staleness, self._tokens_since_log = 0, 0, 0.0
        return out

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        figures = self.figures()
        if logs is not None:
            logs.update(figures)  # callbacks after this one (report_to loggers) see them
        # The Trainer appended its copy of ``logs`` to the history just before this call.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    # ------------------------------------------------------------- checkpoints, the end
    @staticmethod
    def checkpoint_folder(args: Any, state: Any) -> Path:
        """The folder the Trainer saves the checkpoint of ``state.global_step`` in."""
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.save_rank_state:  # every rank, right after the Trainer wrote the checkpoint
            self.optimizer.save_rank_state(self.checkpoint_folder(args, state))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer restored the step and optimizer.pt (the inner state) before this call.
        if self.save_rank_state and state.global_step > 0:
            folder = self.checkpoint_folder(args, state)
            self.optimizer.load_rank_state(folder)
            log.info("learner %s: rank %d resumed its rackmend state from %s", self.optimizer.learner_id,
                     self.optimizer.rank, folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer.close()  # a clean leave; closing again (the script's own close) does nothing

    def remove(self) -> None:
        """Detach from the optimizer and the model."""
        self._hook.remove()
        self.optimizer.count_tokens = None
        self.optimizer.on_apply = self._chained


def attach_to_trainer(
    trainer: "transformers.Trainer",
    config: RackmendConfig,
    link: LearnerLink,
    *,
    learner_id: str | None = None,
    probe_loss: Callable[[], float] | None = None,
) -> RackmendOptimizer:
    """Put rackmend into ``trainer`` before ``trainer.train()``; returns the optimizer,
    which leaves the run when ``train()`` ends (attach again for another ``train()``).

    The inner optimizer is the Trainer's own (``trainer.create_optimizer()``: the one
    ``TrainingArguments`` describe, or the one given through ``optimizers=``); the
    learner joins through ``link`` now and loads the syncer's global value into the
    model. A ``RackmendCallback`` goes first in the Trainer's callbacks, so its figures
    are in the logs before any ``report_to`` logger sees them."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise ConfigError(
            f"attach_to_trainer: this Trainer runs {'FSDP' if trainer.is_fsdp_enabled else 'DeepSpeed'}, which "
            "shards the model inside train(), after the optimizer exists, so rackmend would hold tensors the "
            "training no longer uses. Use a DDP Trainer (torchrun, no fsdp/deepspeed in TrainingArguments), or "
            "shard the model yourself with fully_shard and train it with RackmendOptimizer in your own loop "
            "(docs/integration.md, 'Sharded models')")
    if isinstance(trainer.optimizer, RackmendOptimizer):
        raise ConfigError("the Trainer's optimizer is a RackmendOptimizer already; attach_to_trainer builds one "
                          "itself: pass the inner optimizer through optimizers=(inner, scheduler), or none")
    inner = trainer.create_optimizer()
    opt = RackmendOptimizer(trainer.model, inner, config, link, learner_id=learner_id, probe_loss=probe_loss)
    opt.state_per_rank = True  # optimizer.pt is rank 0's: each rank's rackmend state goes beside it
    trainer.optimizer = opt
    trainer.callback_handler.optimizer = opt
    trainer.callback_handler.callbacks.insert(0, RackmendCallback(opt, save_rank_state=True))
    return opt
