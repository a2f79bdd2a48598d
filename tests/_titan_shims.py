"""Test scaffolding, not rackmend: what lets torchtitan 0.3.0 train on this CPU-only,
gloo, torch 2.13 machine, and what the torchtitan tests record in a rank.

Importing this module applies these, before torchtitan's other modules load (they copy
the device module when imported):
- device: torchtitan takes ``cuda`` when no accelerator is found and calls device-module
  functions ``torch.cpu`` lacks (``get_device_name``, ``memory_stats``...); here the
  device is ``cpu`` and those functions answer for it;
- gloo has no ``PREMUL_SUM``, which FSDP2 uses once torchtitan turns its gradient division
  off: FSDP modules reduce with plain sums instead (``set_force_sum_reduction_for_comms``);
- ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step,
  is newer than torch 2.13: the same call under its older private name.

Overrides (torchtitan's ``--override.imports``, applied to the config before anything is
built):
- ``sdpa_on_cpu``: FlexAttention has no backward on the CPU; SDPA (causal) on each rank's
  heads instead (DTensor has no sharding rule for the CPU's SDPA, which TP would need);
- ``recording_loader``: the chat loader, also writing each batch's valid tokens (labels
  that are not ``IGNORE_INDEX``) to ``$TITAN_RECORD.tokens.<rank>``, one line a batch;
- ``recording_optimizer``: rackmend's container, also writing what rackmend's state holds
  when saved (``$TITAN_RECORD.saved.<rank>.<step>.pt``) and when loaded
  (``$TITAN_RECORD.loaded.<rank>.pt``), and each rank's held values at close
  (``$TITAN_RECORD.held.<rank>``, tests/rackstate.py).
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed import distributed_c10d
from torch.distributed.fsdp import FSDPModule

from torchtitan.tools import utils

torch.set_num_threads(1)
utils.device_type = "cpu"
utils.device_module = types.SimpleNamespace(
    set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
    get_device_name=lambda device=None: "cpu", synchronize=lambda device=None: None,
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
    reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
    memory_stats=lambda device=None: {})

import torchtitan.distributed.fsdp as fsdp  # noqa: E402

_division_off = fsdp.disable_fsdp_gradient_division


def _sums_only(model: torch.nn.Module) -> None:
    _division_off(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


fsdp.disable_fsdp_gradient_division = _sums_only
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)


# ------------------------------------------------------------------ overrides
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.config.override import derive, override  # noqa: E402
from torchtitan.hf_datasets.text_datasets import ChatDataLoader  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402

from rackmend import RackmendOptimizer  # noqa: E402
from rackmend.learner.titan import RackmendOptimizersContainer  # noqa: E402
from rackstate import meet, save_held  # noqa: E402


def _record(suffix: str) -> str:
    return f"{os.environ['TITAN_RECORD']}.{suffix}.{dist.get_rank()}"


class MathAttention(ScaledDotProductAttention):
    """SDPA on each rank's heads (tensor parallelism shards the heads): DTensor has no
    sharding rule for the CPU's SDPA kernels, and attention never mixes heads."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not isinstance(q, DTensor):
            return super().forward(q, k, v, **kwargs)
        out = super().forward(q.to_local(), k.to_local(), v.to_local(), **kwargs)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


@override(target=FlexAttention.Config, description="CPU: FlexAttention has no backward on the CPU")
def sdpa_on_cpu(cfg: FlexAttention.Config) -> MathAttention.Config:
    return MathAttention.Config()


class RecordingChatLoader(ChatDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(ChatDataLoader.Config):
        pass

    def __iter__(self) -> Iterator[Any]:
        path = _record("tokens")
        for input_dict, labels in super().__iter__():
            with open(path, "a") as f:
                f.write(f"{int((labels != IGNORE_INDEX).sum())} {labels.numel()}\n")
            yield input_dict, labels


@override(target=ChatDataLoader.Config, exact=True, description="test: record each batch's valid tokens")
def recording_loader(cfg: ChatDataLoader.Config) -> RecordingChatLoader.Config:
    return derive(cfg, RecordingChatLoader.Config)


def _summary(part: dict[str, Any]) -> dict[str, Any]:
    return {key: part[key] for key in ("rank", "step", "versions", "c_steps", "c_tokens", "held", "blocks")}


class RecordingContainer(RackmendOptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(RackmendOptimizersContainer.Config):
        pass

    def build_rackmend(self) -> RackmendOptimizer:
        opt = super().build_rackmend()
        if os.environ.get("TITAN_MEET"):  # once joined, wait for the other racks (rackstate.meet)
            meet(os.environ["TITAN_MEET"], f"{opt.learner_id}.{opt.rank}", os.environ["TITAN_MEET_ALL"].split(","))
        opt.register_state_dict_post_hook(
            lambda _, sd: torch.save(_summary(sd["rackmend"]), _record("saved") + f".{sd['rackmend']['step']}.pt"))
        opt.register_load_state_dict_pre_hook(lambda _, sd: torch.save(_summary(sd["rackmend"]), _record("loaded") + ".pt"))
        return opt

    def close(self) -> None:
        save_held(self.rackmend, _record("held"))
        super().close()


@override(target=RackmendOptimizersContainer.Config, exact=True, description="test: record rackmend's state")
def recording_optimizer(cfg: RackmendOptimizersContainer.Config) -> RecordingContainer.Config:
    return derive(cfg, RecordingContainer.Config)
