"""rackmend inside PyTorch Lightning (``lightning.pytorch`` 2.x): ``RackmendCallback``.

How it is built: the LightningModule stays an ordinary one. ``configure_optimizers``
returns the plain optimizer (and LR schedulers) it always did, and
``Trainer(callbacks=[RackmendCallback(config, endpoint)])`` makes the rack. When each
``fit`` starts training (``on_train_start``: after Lightning restored any checkpoint,
whatever the strategy) the callback wraps the module and that optimizer in a
``RackmendOptimizer``, which joins the syncer, and runs rackmend's per-step bookkeeping
from the optimizer's step post-hook (``RackmendOptimizer.after_inner_step``). Lightning
keeps stepping, scaling, clipping, scheduling and checkpointing the plain optimizer
it knows. That is why the callback builds the wrapper instead of taking one from
``configure_optimizers``: precision plugins (a ``GradScaler`` that skips a step skips
rackmend's too), LR schedulers and the strategies' checkpoint code
(``ModelParallelStrategy`` hands the optimizer to ``torch.distributed.checkpoint``,
which cannot take a ``RackmendOptimizer``) see exactly the objects they expect.

What the callback adds to Lightning:

- tokens: ``tokens_fn(batch)`` of every training batch (micro-batches of gradient
  accumulation add up); the learner sums its ranks' counts at each optimizer step, so
  each merge weighs the tokens the whole rack trained on;
- a clean leave: the optimizer is closed when ``fit`` ends or fails (the syncer logs a
  ``Left`` record and stops waiting for the rack at once); the next ``fit`` joins again;
- checkpoints: each rank's own rackmend state (counters, versions, held global values,
  uplink residuals) goes into Lightning's checkpoint and each rank gets its own back on
  resume. Lightning writes the checkpoint's metadata from rank 0 only, so at each save
  the ranks gather their states to rank 0 over a gloo group: the structure as JSON,
  the tensors as raw bytes by point-to-point sends, never a pickle; a tensor equal to
  one already gathered (a DDP rack's replicated held values) travels and is stored
  once (rank 0 holds what it gathered while the checkpoint is written: under FSDP2,
  the held values of the whole model). The model's parameters are not stored again:
  the model state Lightning restores is the local progress rackmend rebases onto the
  syncer's newer value.

Strategies: a single process, ``DDPStrategy`` and ``ModelParallelStrategy`` with
FSDP2's ``fully_shard`` (and tensor parallelism) in ``configure_model``.
``FSDPStrategy`` is FSDP1, whose flat parameters rackmend cannot place, and DeepSpeed
owns its optimizer: both are refused, naming the alternative.
Nothing about rounds or merges lives here: that is ``RackmendOptimizer``'s.

``lightning`` stays an optional dependency: ``import rackmend`` does not import this
module; importing it without ``lightning`` raises an ImportError saying what to install.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.fragments import model_tensors
from rackmend.learner.batches import count_batch_tokens
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.base import LearnerLink

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )
except ImportError as exc:  # pragma: no cover - exercised only where lightning is absent
    raise ImportError("rackmend.learner.lightning needs PyTorch Lightning 2.x: pip install lightning "
                      "(or pip install 'rackmend[lightning]')") from exc

__all__ = ["RackmendCallback"]

log = logging.getLogger("rackmend.learner")

_TENSOR = "$tensor"
"""Key of a tensor's place-holder in a gathered state's JSON structure."""


class RackmendCallback(pl.Callback):
    """Makes a Lightning ``fit`` a rackmend rack (see the module docstring).

    ``link``: the syncer's endpoint (a ``ZmqLink`` is built for each fit, after the
    process group exists, so it reads rank and world size from it) or a callable
    returning a ``LearnerLink`` (under ``ddp_spawn`` a module-level function, since
    the callback is pickled). ``learner_id``: the rack's id, the same on every rank
    and across restarts (default: ``RACKMEND_LEARNER_ID``). ``tokens_fn(batch)``: the
    tokens of one training batch on this rank; the default counts ``attention_mask``
    (else ``input_ids``) of a dict batch. ``restore``: whether resuming from a
    checkpoint restores rackmend's state (False: the rack joins with the current
    global value, e.g. after a change in the number of ranks).

    ``optimizer``: the current fit's ``RackmendOptimizer`` (None before the first
    fit; closed after a fit, still readable: versions, held values, counters).
    """

    def __init__(
        self,
        config: RackmendConfig,
        link: str | Callable[[], LearnerLink],
        *,
        learner_id: str | None = None,
        tokens_fn: Callable[[Any], int | float | None] = count_batch_tokens,
        restore: bool = True,
    ) -> None:
        self.config = config
        self.link = link
        self.learner_id = learner_id
        self.tokens_fn = tokens_fn
        self.restore = restore
        self.optimizer: RackmendOptimizer | None = None
        self._open = False
        """The current fit's optimizer has not been closed."""
        self._hook: Any = None
        self._pending_tokens = 0.0
        self._in_batch = False
        """Inside a training batch, where the optimizer's steps are training steps."""
        self._pending_state: dict[str, Any] | None = None
        """This rank's state from the checkpoint being resumed; loaded once the rack joined."""
        self._group: Any = None
        """The gloo group the states are gathered over (None: the default group)."""
        self._per_batch = 1
        """How many ranks of the rack train on each batch (a tensor-parallel group's)."""

    # ------------------------------------------------------------------ the fit's life
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _check_strategy(trainer.strategy)
            self._pending_state = None  # a fit that failed before training leaves none for the next

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ConfigError(
                f"RackmendCallback wraps one optimizer, but configure_optimizers returned {len(optimizers)}; return "
                "a single optimizer (several parameter groups if parts need their own settings)")
        if isinstance(optimizers[0], RackmendOptimizer):
            optimizers[0].close()  # it joined when configure_optimizers built it: leave, not go silent
            raise ConfigError(
                "configure_optimizers returned a RackmendOptimizer, but RackmendCallback builds it: return the plain "
                "optimizer (e.g. torch.optim.AdamW(self.parameters())) and its LR schedulers; the callback wraps it at "
                "each fit, so Lightning's precision plugins, schedulers and checkpoints keep handling a plain "
                "optimizer")
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._group = None
        if several and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # state gathering moves host tensors
        strategy = trainer.strategy
        self._per_batch = 1
        if isinstance(strategy, ModelParallelStrategy) and "tensor_parallel" in (
                strategy.device_mesh.mesh_dim_names or ()):
            self._per_batch = strategy.device_mesh["tensor_parallel"].size()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Built only now, once Lightning has restored a checkpoint whatever the strategy
        # (DDP restores before its setup, ModelParallelStrategy after it), so joining
        # comes after the restore on every strategy, and the optimizer is stepped only
        # by training (restoring through torch.distributed.checkpoint may step it once
        # with zero gradients to create its state).
        inner = trainer.optimizers[0]
        state, self._pending_state = self._pending_state, None
        restored = _local_values(pl_module) if state is not None else None  # what joining will overwrite
        self.optimizer = RackmendOptimizer(pl_module, inner, self.config, _build_link(self.link),
                                           learner_id=self.learner_id)
        self._open = True
        self._pending_tokens, self._in_batch = 0.0, False
        self._hook = inner.register_step_post_hook(self._after_step)
        if state is not None:
            assert restored is not None
            _load(self.optimizer, state, restored)
        elif trainer.ckpt_path is not None and self.restore:
            log.warning("learner %s: resumed from %s, which holds no rackmend state (saved weights only, or without "
                        "RackmendCallback): the rack joined with the current global value, and the local progress "
                        "the checkpoint held since its last applied merge is lost", self.optimizer.learner_id,
                        trainer.ckpt_path)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            self._close()
        except Exception:  # the fit's own exception is what the user must see
            log.exception("learner %s: closing rackmend after the fit failed", self.learner_id)

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.optimizer is not None and self._open:
            self._open = False
            self.optimizer.close()

    # ------------------------------------------------------------------ token counting
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        n = self.tokens_fn(batch)
        if n is None:
            raise ConfigError(
                f"RackmendCallback cannot count the tokens of a {type(batch).__name__} batch: the default tokens_fn "
                "counts attention_mask or input_ids of a dict batch. Pass RackmendCallback(..., tokens_fn=f) with "
                "f(batch) returning the tokens (or samples) this rank trains on in the batch")
        self._pending_tokens += float(n)
        self._in_batch = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._in_batch = False

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The inner optimizer's step post-hook: rackmend's bookkeeping for the step."""
        assert self.optimizer is not None
        if not self._in_batch:
            # Not a training step: torch.distributed.checkpoint steps an optimizer
            # without state once, with zero gradients and learning rate, to create it.
            return
        tokens, self._pending_tokens = self._pending_tokens, 0.0
        # The learner sums its ranks' counts; ranks of a tensor-parallel group train on
        # one batch, so each passes its share of it.
        self.optimizer.after_inner_step(tokens / self._per_batch)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every rank's rackmend state, gathered on rank 0 (a collective: Lightning
        builds a checkpoint on every rank). Empty before the first fit."""
        opt = self.optimizer
        if opt is None:
            return {}
        opt.flush()  # the uplink codec's residuals include every send made
        mine = {"learner_id": opt.learner_id, **opt.core.state_dict()}
        return _gather(mine, opt.rank, opt.world_size, self._group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.restore or not state_dict:
            return
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        saved = int(state_dict["world_size"])
        if saved != world:
            raise ConfigError(
                f"this checkpoint holds rackmend's state of {saved} ranks, this rack has {world}: each rank restores "
                f"its own. Resume with {saved} ranks, or pass RackmendCallback(..., restore=False) to resume the model "
                "without it (the rack then joins with the current global value and loses the local progress since "
                "its last applied merge)")
        self._pending_state = _unpack(state_dict, rank)  # loaded once the rack has joined, at on_train_start


def _check_strategy(strategy: Any) -> None:
    """ConfigError for the strategies rackmend cannot run under, naming what to use."""
    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "Lightning's FSDPStrategy is FSDP1, whose flat parameters rackmend cannot place in the global tensors; "
            "use Trainer(strategy=ModelParallelStrategy()) and shard the model with FSDP2 in configure_model "
            "(torch.distributed.fsdp.fully_shard over self.device_mesh['data_parallel'])")
    if isinstance(strategy, DeepSpeedStrategy):
        raise ConfigError("DeepSpeed runs its own optimizer and parameter partitions, which rackmend cannot wrap; use "
                          "DDPStrategy, or ModelParallelStrategy with FSDP2's fully_shard in configure_model")
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        raise ConfigError(f"RackmendCallback runs under a single device, DDPStrategy or ModelParallelStrategy, not "
                          f"{type(strategy).__name__}")


def _build_link(link: str | Callable[[], LearnerLink]) -> LearnerLink:
    if isinstance(link, str):
        from rackmend.transport.zmq_link import ZmqLink

        return ZmqLink(link)
    return link()


def _local_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of the tensors rackmend synchronises, by canonical name (of a
    DTensor, this rank's shard)."""
    out = {}
    for name, t, _ in model_tensors(model):
        local = t.to_local() if hasattr(t, "to_local") else t
        out[name] = local.detach().to("cpu", copy=True)
    return out


def _load(opt: RackmendOptimizer, state: dict[str, Any], restored: dict[str, torch.Tensor]) -> None:
    """Load this rank's saved state into ``opt``, the model's values as the checkpoint
    restored them being the local progress (rebased onto a newer global value)."""
    if state.get("learner_id") != opt.learner_id:
        raise ConfigError(f"this checkpoint's rackmend state is learner {state.get('learner_id')!r}'s, this rack is "
                          f"{opt.learner_id!r}: resume a rack from its own checkpoints, or pass "
                          "RackmendCallback(..., restore=False)")
    params = [[restored[n] for n in f.names] for f in opt.fragments]
    opt.load_state_dict({"rackmend": {**state, "params": params}})


# ---------------------------------------------------------------------- gathering
def _split(value: Any, store: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON-able data, each tensor replaced by a place-holder naming its
    bytes' digest, dtype and shape; the bytes go into ``store``."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.sha256(raw.numpy()).hexdigest()
        store.setdefault(digest, raw)
        return {_TENSOR: digest, "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    if isinstance(value, dict):
        if any(not isinstance(k, str) for k in value):
            raise TypeError("rackmend's learner state has a non-string key; it cannot be gathered as JSON")
        return {k: _split(v, store) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, store) for v in value]
    return value


def _join(value: Any, store: dict[str, torch.Tensor]) -> Any:
    """``_split``'s inverse: the place-holders replaced by tensors (copies)."""
    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype) or value[_TENSOR] not in store:
                raise ValueError(f"the checkpoint's rackmend state is damaged: tensor {value[_TENSOR][:12]} "
                                 f"({value['dtype']}) is missing")
            return store[value[_TENSOR]].view(dtype).reshape(value["shape"]).clone()
        return {k: _join(v, store) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, store) for v in value]
    return value


def _gather(state: dict[str, Any], rank: int, world: int, group: Any) -> dict[str, Any]:
    """Every rank's ``state`` on rank 0 as ``{"world_size", "ranks": [JSON text per
    rank], "tensors": {digest: bytes}}`` (other ranks: the texts, no tensors). The JSON
    texts travel as byte tensors, the tensors' bytes by send/recv in an order every
    rank derives from the texts: nothing received is unpickled."""
    store: dict[str, torch.Tensor] = {}
    text = json.dumps(_split(state, store))
    if world == 1:
        return {"world_size": 1, "ranks": [text], "tensors": store}
    encoded = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([encoded.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: encoded.numel()] = encoded
    texts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(texts, padded, group=group)
    skeletons = [bytes(t[: int(n)].numpy()).decode() for t, n in zip(texts, sizes)]
    # Each digest travels from the first rank that has it; rank 0 has its own.
    first: dict[str, int] = {}
    sizes_of: dict[str, int] = {}
    for r, skeleton in enumerate(skeletons):
        for node in _placeholders(json.loads(skeleton)):
            first.setdefault(node[_TENSOR], r)
            sizes_of[node[_TENSOR]] = _nbytes(node)
    to_zero = {r: sorted(d for d, owner in first.items() if owner == r) for r in range(1, world)}
    if rank == 0:
        for r, digests in to_zero.items():
            for d in digests:
                buf = torch.empty(sizes_of[d], dtype=torch.uint8)
                if buf.numel():  # nothing is sent for an empty tensor (a rank holding no block of it)
                    dist.recv(buf, src=r, group=group)
                if hashlib.sha256(buf.numpy()).hexdigest() != d:
                    raise RuntimeError(f"rank {r}'s rackmend state arrived damaged while gathering a checkpoint")
                store[d] = buf
        return {"world_size": world, "ranks": skeletons, "tensors": store}
    for d in to_zero.get(rank, ()):
        if store[d].numel():
            dist.send(store[d], dst=0, group=group)
    return {"world_size": world, "ranks": skeletons, "tensors": {}}


def _placeholders(value: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if _TENSOR in v:
                out.append(v)
            else:
                stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _nbytes(node: dict[str, Any]) -> int:
    dtype = getattr(torch, str(node["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a rank's rackmend state names an unknown dtype {node['dtype']!r}")
    n = dtype.itemsize
    for s in node["shape"]:
        n *= int(s)
    return n


def _unpack(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state out of ``_gather``'s result (as read from a checkpoint)."""
    return _join(json.loads(state["ranks"][rank]), state["tensors"])
