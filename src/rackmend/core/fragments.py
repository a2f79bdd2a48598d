"""Fragments: which tensors travel together, and at which step each fragment leaves.

Pure functions over parameter names, shapes and dtypes. A fragment's identity
(its index, its tensors in model order, their shapes) is the same on every learner
and on the syncer because it depends only on the model's structure.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from rackmend.config import ConfigError, PACKINGS

__all__ = [
    "TensorSpec",
    "FragmentSpec",
    "pack_fragments",
    "fragment_offsets",
    "fragments_due",
    "fingerprint",
    "dtype_name",
    "layout_to_wire",
    "layout_from_wire",
]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor as the wire and the syncer see it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FragmentSpec:
    """A fragment: its index, its send offset t_p within the period, its tensors."""

    index: int
    offset: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


def fragment_offsets(num_fragments: int, sync_every: int) -> list[int]:
    """Offsets t_p = floor(p * H / P): evenly spread, so no step sends more than ceil(P/H)."""
    return [(p * sync_every) // num_fragments for p in range(num_fragments)]


def fragments_due(step: int, fragments: Sequence[FragmentSpec], sync_every: int) -> list[int]:
    """Indices of fragments sent after inner step ``step`` (1-based count of steps done)."""
    if step <= 0:
        return []
    return [f.index for f in fragments if (step - f.offset) % sync_every == 0]


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def _largest_block_list(model: nn.Module) -> str | None:
    """Name of the nn.ModuleList holding the most parameters (the repeated blocks)."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


def pack_fragments(
    model: nn.Module,
    num_fragments: int,
    sync_every: int,
    packing: str = "balanced",
    blocks: str | None = None,
) -> list[FragmentSpec]:
    """Split ``model``'s trainable parameters into ``num_fragments`` fragments.

    ``balanced``: whole tensors, largest first, each into the currently lightest
    fragment (greedy bin-packing by bytes). ``strided``: parameters under
    ``<blocks>.<i>.`` go to fragment i mod P (``blocks`` defaults to the model's
    largest ``nn.ModuleList``); other parameters then fill the lightest fragments.
    Within a fragment, tensors keep the model's parameter order.
    """
    if packing not in PACKINGS:
        raise ConfigError(f"packing={packing!r} is not known; use one of {', '.join(PACKINGS)}")
    emb = _embedding_param_ids(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("the model has no trainable parameters to synchronise")
    if num_fragments > len(named):
        raise ConfigError(
            f"num_fragments (P)={num_fragments} exceeds the model's {len(named)} parameter tensors: "
            "a fragment would be empty; lower num_fragments"
        )
    specs = [
        TensorSpec(n, tuple(p.shape), p.dtype, id(p) in emb) for n, p in named
    ]
    order = {s.name: i for i, s in enumerate(specs)}
    bins: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments

    def place(spec: TensorSpec, p: int) -> None:
        bins[p].append(spec)
        loads[p] += spec.nbytes

    rest: list[TensorSpec] = specs
    if packing == "strided":
        prefix = blocks if blocks is not None else _largest_block_list(model)
        if prefix is None:
            raise ConfigError(
                "packing='strided' needs a repeated block list (an nn.ModuleList); "
                "this model has none: use packing='balanced' or pass blocks=<module name>"
            )
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
        rest = []
        for spec in specs:
            m = pattern.match(spec.name)
            if m:
                place(spec, int(m.group(1)) % num_fragments)
            else:
                rest.append(spec)
    for spec in sorted(rest, key=lambda s: (-s.nbytes, order[s.name])):
        place(spec, min(range(num_fragments), key=lambda p: (loads[p], p)))
    empty = [p for p, b in enumerate(bins) if not b]
    if empty:
        raise ConfigError(
            f"fragments {empty} came out empty with packing={packing!r}; lower num_fragments "
            "or use packing='balanced'"
        )
    offsets = fragment_offsets(num_fragments, sync_every)
    return [
        FragmentSpec(p, offsets[p], tuple(sorted(b, key=lambda s: order[s.name])))
        for p, b in enumerate(bins)
    ]


def fingerprint(fragments: Iterable[FragmentSpec]) -> str:
    """A short hash of the fragment layout; learners and syncer must agree on it."""
    h = hashlib.sha256()
    for f in fragments:
        h.update(f"{f.index}:{f.offset};".encode())
        for t in f.tensors:
            h.update(f"{t.name}|{t.shape}|{t.dtype}|{int(t.is_embedding)};".encode())
    return h.hexdigest()[:16]


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_to_wire(fragments: Sequence[FragmentSpec]) -> list[dict[str, Any]]:
    """The layout as plain lists and maps (for msgpack headers and checkpoint JSON)."""
    return [{"index": f.index, "offset": f.offset,
             "tensors": [[t.name, list(t.shape), dtype_name(t.dtype), t.is_embedding] for t in f.tensors]}
            for f in fragments]


def layout_from_wire(raw: Any) -> list[FragmentSpec]:
    """Inverse of ``layout_to_wire``; raises ValueError on anything malformed."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("layout: expected a non-empty list of fragments")
    out = []
    for i, f in enumerate(raw):
        if not isinstance(f, dict) or f.get("index") != i or not isinstance(f.get("offset"), int):
            raise ValueError(f"layout: fragment {i} is malformed")
        tensors = []
        for t in f.get("tensors", ()):
            if (not isinstance(t, list) or len(t) != 4 or not isinstance(t[0], str)
                    or not isinstance(t[1], list) or not all(isinstance(d, int) and d >= 0 for d in t[1])
                    or t[2] not in _DTYPES or not isinstance(t[3], bool)):
                raise ValueError(f"layout: a tensor of fragment {i} is malformed: {str(t)[:80]}")
            tensors.append(TensorSpec(t[0], tuple(t[1]), _DTYPES[t[2]], t[3]))
        out.append(FragmentSpec(i, f["offset"], tuple(tensors)))
    return out
