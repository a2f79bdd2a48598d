"""Fragments: which tensors travel together, and at which step each fragment leaves.

Pure functions over parameter names, shapes and dtypes. A fragment's identity
(its index, its tensors in model order, their shapes) is the same on every learner
and on the syncer because it depends only on the model's structure.

Names are canonical: wrappers that only add a prefix (DDP and DataParallel's
``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1's ``_fsdp_wrapped_module.``,
activation checkpointing's ``_checkpoint_wrapped_module.``) are seen through, so a
DDP rack, a compiled rack and a plain rack of one model have one layout.

What travels: trainable parameters, and (``buffers=True``, the default) persistent
floating-point buffers such as BatchNorm's running statistics, which the syncer
merges by weighted mean without an outer step; a ``<prefix>.running_var`` whose
``<prefix>.running_mean`` is in the same fragment merges as a pooled variance
(``FragmentSpec.variance_of``), and packing keeps such a pair in one fragment.
Integer buffers (BatchNorm's ``num_batches_tracked``) and non-persistent buffers
(rotary tables, masks) stay local: a counter of batches seen is each rack's own, and
a constant needs no merge.

A tensor may be a ``DTensor`` (FSDP2, tensor parallel): its spec has the global shape;
which block of it a rank holds is ``rackmend.core.pieces``'s business.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from rackmend.config import ConfigError, PACKINGS, check_choice

__all__ = [
    "TensorSpec",
    "FragmentSpec",
    "pack_fragments",
    "fragment_offsets",
    "fragment_problem",
    "fragments_due",
    "fingerprint",
    "layout_difference",
    "canonical_name",
    "unwrap_model",
    "model_tensors",
    "fragment_tensors",
    "variance_pairs",
    "dtype_name",
    "layout_to_wire",
    "layout_from_wire",
    "MAX_DIMS",
]

MAX_DIMS = 32
"""The most dimensions a tensor of a layout received may have (torch itself allows 25
on some backends; a declared shape past this is junk, refused before it is used)."""


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor as the wire and the syncer see it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_embedding: bool = False
    is_buffer: bool = False
    """A floating-point buffer: merged by weighted mean, no outer step."""

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

    @property
    def variance_of(self) -> tuple[int | None, ...]:
        """Per tensor: for a buffer ``<prefix>.running_var``, the index of the buffer
        ``<prefix>.running_mean`` of the same shape in this fragment, else None. The
        syncer merges such a variance with the spread of the means (pooled variance)."""
        return variance_pairs(self.tensors)


def variance_pairs(tensors: Sequence[TensorSpec]) -> tuple[int | None, ...]:
    """``FragmentSpec.variance_of`` for a list of tensors (by canonical name: the
    BatchNorm family names its statistics ``running_mean`` and ``running_var``)."""
    index = {t.name: i for i, t in enumerate(tensors) if t.is_buffer}
    out: list[int | None] = []
    for t in tensors:
        mean = _mean_name(t.name) if t.is_buffer else None
        i = index.get(mean) if mean is not None else None
        out.append(i if i is not None and tensors[i].shape == t.shape else None)
    return tuple(out)


def _mean_name(name: str) -> str | None:
    """``<prefix>.running_mean`` for ``<prefix>.running_var``, else None."""
    prefix, _, leaf = name.rpartition(".")
    if leaf != "running_var":
        return None
    return f"{prefix}.running_mean" if prefix else "running_mean"


def fragment_problem(p: object, count: int) -> str | None:
    """Why ``p`` is not the number of a fragment of a layout of ``count`` fragments, or
    None. Every check of a fragment number (from the wire, or handed to a core) is this one."""
    if not isinstance(p, int) or isinstance(p, bool):
        return f"a fragment number must be an int, got {type(p).__name__}"
    if not 0 <= p < count:
        return f"unknown fragment {str(p)[:20]} (the layout has {count})"
    return None


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


_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""Name components that only wrappers add (compile, FSDP1, activation checkpointing)."""


def canonical_name(name: str) -> str:
    """``name`` without the components wrappers insert (``_orig_mod`` and the like)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel / ``torch.compile`` wrappers (the same
    parameter objects, without the ``module.`` or ``_orig_mod.`` prefix)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def model_tensors(model: nn.Module, buffers: bool = True) -> list[tuple[str, torch.Tensor, bool]]:
    """What rackmend synchronises, as (canonical name, tensor, is_buffer) in model order:
    trainable parameters, then (``buffers``) persistent floating-point buffers. The one
    place that decides which tensors travel; learners and the syncer's layout use it."""
    model = unwrap_model(model)
    out: list[tuple[str, torch.Tensor, bool]] = [
        (canonical_name(n), p, False) for n, p in model.named_parameters() if p.requires_grad]
    if buffers:
        for n, b in model.named_buffers():
            owner, _, leaf = n.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if b.is_floating_point() and leaf not in module._non_persistent_buffers_set:
                out.append((canonical_name(n), b, True))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"two tensors share the canonical name {dup!r} once wrapper prefixes are removed; "
                          "rename one of the modules")
    return out


def fragment_tensors(model: nn.Module, fragments: Sequence["FragmentSpec"], buffers: bool = True
                     ) -> list[list[torch.Tensor]]:
    """``model``'s tensors of each fragment, in the fragment's order (found by canonical name)."""
    by_name = {n: t for n, t, _ in model_tensors(model, buffers)}
    missing = [n for f in fragments for n in f.names if n not in by_name]
    if missing:
        raise ConfigError(f"the model has no tensor named {missing[0]!r} (of {len(missing)} missing); "
                          f"it has e.g. {sorted(by_name)[:5]}")
    return [[by_name[n] for n in f.names] for f in fragments]


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
    *,
    buffers: bool = True,
) -> list[FragmentSpec]:
    """Split ``model``'s trainable parameters into ``num_fragments`` fragments.

    ``balanced``: whole tensors, largest first, each into the currently lightest
    fragment (greedy bin-packing by bytes). ``strided``: parameters under
    ``<blocks>.<i>.`` go to fragment i mod P (``blocks`` defaults to the model's
    largest ``nn.ModuleList``); other parameters then fill the lightest fragments.
    Within a fragment, tensors keep the model's order. ``buffers``: include persistent
    floating-point buffers (see the module docstring); a ``running_var`` goes where its
    ``running_mean`` goes, as one unit, unless that would leave a fragment empty.
    """
    check_choice("packing", packing, PACKINGS)
    emb = _embedding_param_ids(unwrap_model(model))
    named = model_tensors(model, buffers)
    if not any(not is_buffer for _, _, is_buffer in named):
        raise ConfigError("the model has no trainable parameters to synchronise")
    if num_fragments > len(named):
        raise ConfigError(
            f"num_fragments (P)={num_fragments} exceeds the model's {len(named)} tensors: "
            "a fragment would be empty; lower num_fragments"
        )
    specs = [
        TensorSpec(n, tuple(p.shape), p.dtype, id(p) in emb, is_buffer) for n, p, is_buffer in named
    ]
    order = {s.name: i for i, s in enumerate(specs)}
    bins: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments

    def place(spec: TensorSpec, p: int) -> None:
        bins[p].append(spec)
        loads[p] += spec.nbytes

    rest: list[TensorSpec] = specs
    if packing == "strided":
        prefix = blocks if blocks is not None else _largest_block_list(unwrap_model(model))
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
    # A variance merges with its mean's spread only where both are in one fragment.
    pairs = variance_pairs(rest)
    units = [[spec] + [rest[j] for j, i in enumerate(pairs) if i == k] for k, spec in enumerate(rest)
             if pairs[k] is None]
    if len(units) < sum(not b for b in bins):
        units = [[spec] for spec in rest]  # a tiny model with P near its tensor count: no empty fragment
    for unit in sorted(units, key=lambda u: (-sum(t.nbytes for t in u), order[u[0].name])):
        p = min(range(num_fragments), key=lambda p: (loads[p], p))
        for spec in unit:
            place(spec, p)
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
            h.update(f"{t.name}|{t.shape}|{t.dtype}|{int(t.is_embedding)}|{int(t.is_buffer)};".encode())
    return h.hexdigest()[:16]


def layout_difference(mine: Sequence[FragmentSpec], theirs: Sequence[FragmentSpec]) -> str | None:
    """The first way ``theirs`` differs from ``mine`` (a tensor by name with both shapes,
    a fragment count, an offset), or None when the two are the same layout."""
    def describe(t: TensorSpec) -> str:
        kind = "buffer" if t.is_buffer else "parameter"
        return f"{kind} {t.name} {dtype_name(t.dtype)} {list(t.shape)}"

    if len(mine) != len(theirs):
        return (f"{len(theirs)} fragments against {len(mine)}: num_fragments (P) differs, or the model "
                "has a different number of tensors")
    for a, b in zip(mine, theirs):
        if a.offset != b.offset:
            return (f"fragment {a.index} leaves at offset {b.offset} against {a.offset}: sync_every (H) "
                    "or num_fragments (P) differs")
        for i in range(max(len(a.tensors), len(b.tensors))):
            ta = a.tensors[i] if i < len(a.tensors) else None
            tb = b.tensors[i] if i < len(b.tensors) else None
            if ta != tb:
                return (f"fragment {a.index}, tensor {i}: {describe(tb) if tb else 'nothing'} against "
                        f"{describe(ta) if ta else 'nothing'} (different models, packing or sync_buffers)")
    return None


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_to_wire(fragments: Sequence[FragmentSpec]) -> list[dict[str, Any]]:
    """The layout as plain lists and maps (for msgpack headers and checkpoint JSON)."""
    return [{"index": f.index, "offset": f.offset,
             "tensors": [[t.name, list(t.shape), dtype_name(t.dtype), t.is_embedding, t.is_buffer]
                         for t in f.tensors]}
            for f in fragments]


def layout_from_wire(raw: Any) -> list[FragmentSpec]:
    """Inverse of ``layout_to_wire``; raises ValueError on anything malformed. Entries
    without the buffer flag (checkpoints written before buffers travelled) are parameters."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("layout: expected a non-empty list of fragments")
    out = []
    for i, f in enumerate(raw):
        offset = f.get("offset") if isinstance(f, dict) else None
        if (not isinstance(f, dict) or f.get("index") != i or not isinstance(offset, int) or isinstance(offset, bool)
                or not 0 <= offset < 2**62 or not isinstance(f.get("tensors", ()), (list, tuple))):
            raise ValueError(f"layout: fragment {i} is malformed")
        tensors = []
        for t in f.get("tensors", ()):
            if (not isinstance(t, list) or len(t) not in (4, 5) or not isinstance(t[0], str)
                    or not isinstance(t[1], list) or len(t[1]) > MAX_DIMS
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in t[1])
                    or math.prod(t[1]) >= 2**62
                    or t[2] not in _DTYPES or not all(isinstance(flag, bool) for flag in t[3:])):
                raise ValueError(f"layout: a tensor of fragment {i} is malformed: {str(t)[:80]}")
            tensors.append(TensorSpec(t[0], tuple(t[1]), _DTYPES[t[2]], *t[3:]))
        out.append(FragmentSpec(i, f["offset"], tuple(tensors)))
    return out
