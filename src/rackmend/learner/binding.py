"""Whether the model still holds the tensors ``RackmendOptimizer`` was built on, and what
to do when a launcher replaced them in between.

rackmend keeps views of the model's tensors (a DTensor's local shard), taken when the
optimizer is built. Launchers often touch the model after the user built the optimizers:
``accelerator.prepare(model)`` (and so the Hugging Face Trainer's ``train()``) moves it to
``accelerator.device``, which for several CPU ranks is ``cpu:0`` and gives every tensor new
memory; others cast it or shard it. ``compare`` sorts each tensor into unchanged, moved
(new memory, same device type, dtype, shape, sharding and values: the views can be taken
again) and changed (anything else: training would go on in tensors rackmend never reads or
writes, so it is refused). ``launcher`` names the trainer on the call stack, for the
refusal's message. Nothing here talks to the syncer or to other ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from rackmend.core.fragments import FragmentSpec, TensorSpec

__all__ = ["Mismatch", "compare", "launcher", "local_of", "sharding"]

_LAUNCHERS: tuple[tuple[str, str, str], ...] = (
    ("transformers.trainer", "the Hugging Face Trainer",
     "train() runs accelerator.prepare(model), which places the model on its device and may cast or shard it"),
    ("lightning", "Lightning", "the strategy's setup moves, casts or shards the model before configure_optimizers"),
    ("pytorch_lightning", "Lightning", "the strategy's setup moves, casts or shards the model"),
    ("torchtitan", "torchtitan", "its trainer shards the model before building the optimizers"),
    ("accelerate", "accelerate",
     "accelerator.prepare(model) places the model on accelerator.device and may cast or shard it: prepare the "
     "model first, then build the inner optimizer and RackmendOptimizer, then prepare the optimizer "
     "(rackmend.learner.accel.prepare does it in that order)"),
)
"""(module prefix, trainer, what it does to the model), most specific first: the
Trainer's frames sit above accelerate's."""


def launcher() -> str | None:
    """'<trainer> (<what it does to the model>)' for the outermost known trainer on the
    current call stack, or None in a hand-written loop."""
    frame = sys._getframe(1)
    found: tuple[str, str] | None = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        for prefix, name, does in _LAUNCHERS:
            if module == prefix or module.startswith(prefix + "."):
                found = (name, does)  # keep walking outwards: the outermost wins
                break
        frame = frame.f_back
    return None if found is None else f"{found[0]} ({found[1]})"


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t`` (a DTensor's local shard), detached."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


@dataclass(frozen=True)
class Mismatch:
    """A tensor of a fragment that is no longer the one rackmend holds a view of."""

    fragment: int
    index: int
    spec: TensorSpec
    changes: tuple[str, ...]
    """What differs ('dtype torch.float32 -> torch.float64', ...); empty when only the
    memory is new and the values are equal (a move that the views can follow)."""


def sharding(t: torch.Tensor) -> str:
    """How ``t`` is laid over the ranks: its DTensor placements, 'none' for a plain tensor."""
    placements = getattr(t, "placements", None)
    return "none" if placements is None else str(tuple(placements))


def compare(fragments: Sequence[FragmentSpec], views: Sequence[Sequence[torch.Tensor]],
            shardings: Sequence[Sequence[str]], current: Sequence[Sequence[torch.Tensor]],
            *, follow: bool = True) -> list[Mismatch]:
    """Every tensor of ``current`` (the model's now) whose local tensor is not the memory
    of its view in ``views`` (with ``shardings``, taken when the views were), with what
    changed. With ``follow``, a parameter whose values are equal and a buffer of the same
    layout (a forward since the move updated it in place) count as moved: no change
    listed. Values are compared only where nothing else changed."""
    out = []
    for f, (spec, held_f, how_f, now_f) in enumerate(zip(fragments, views, shardings, current)):
        for i, (t, held, how, tensor) in enumerate(zip(spec.tensors, held_f, how_f, now_f)):
            local = local_of(tensor)
            if local.data_ptr() == held.data_ptr() and local.shape == held.shape and local.dtype == held.dtype:
                continue
            changes = tuple(f"{what} {a} -> {b}" for what, a, b in (
                ("device", held.device, local.device), ("dtype", held.dtype, local.dtype),
                ("shape", list(held.shape), list(local.shape)), ("sharding", how, sharding(tensor))) if a != b)
            if not changes and not follow:
                changes = ("its memory (a tensor assigned anew)",)
            elif not changes and not t.is_buffer and not torch.equal(local, held):
                changes = ("its memory (a tensor assigned anew) and its values",)
            out.append(Mismatch(f, i, t, changes))
    return out
