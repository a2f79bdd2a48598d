"""``rackmend export``: the global model of a syncer checkpoint as a plain safetensors file.

A syncer checkpoint stores the global value Θ as ``theta/{p}/{i}`` (fragment p, its
i-th tensor) next to the outer optimizer's state, history and counters; the layout in
its metadata names every one of those tensors by the model's own (canonical) name.
This module reads only the Θ entries, puts the names back and writes a file that
``model.load_state_dict(safetensors.torch.load_file(path))`` accepts.

What rackmend does not synchronise is not in a checkpoint: tied-weight aliases (the
second name of one tensor), frozen parameters, integer buffers (BatchNorm's
``num_batches_tracked``) and floating buffers when ``sync_buffers=False``. Given the
model (``model=`` here, ``--model MODULE:FACTORY`` on the command line) the export
sees ties by tensor identity, fills the rest from the model or from a ``base`` state
file, lists what it filled, and the file then loads with ``strict=True``. Nothing
here opens sockets; reading never runs code from the checkpoint (safetensors, JSON).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from rackmend.core.fragments import (
    FragmentSpec,
    canonical_name,
    dtype_name,
    layout_from_wire,
    model_tensors,
    unwrap_model,
)
from rackmend.core.shards import Shard, parse_shard
from rackmend.core.syncer_fragment import named_global_values
from rackmend.core.checkpoint_meta import CheckpointMeta
from rackmend.service.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME, CheckpointError, non_finite, open_checkpoint

__all__ = ["ExportError", "ExportResult", "export_model", "read_global_model", "add_arguments", "main"]


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to do."""


@dataclass(kw_only=True)
class ExportResult:
    """What ``export_model`` wrote."""

    path: Path
    """The safetensors file written."""
    checkpoint: Path
    """The syncer checkpoint file read."""
    synced: list[str]
    """Names whose values are the syncer's global Θ (parameters and floating buffers)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied names written with the global value of the tensor they share: alias -> synced name."""
    filled: dict[str, str] = field(default_factory=dict)
    """Names rackmend does not synchronise, filled from the model or ``base``: name -> why
    and from where. Empty without ``model``."""
    versions: list[int] = field(default_factory=list)
    """Per fragment, the version of Θ the checkpoint holds."""
    merges: int = 0
    """Merges the syncer had done when it wrote the checkpoint."""
    checked_against_model: bool = False
    """True when the key set, shapes and dtypes were checked against ``model``'s
    ``state_dict`` (then ``load_state_dict(strict=True)`` accepts the file)."""


def _checkpoint_file(checkpoint: str | os.PathLike[str]) -> Path:
    path = Path(checkpoint)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
        if not path.exists():
            raise ExportError(f"{checkpoint} holds no {CHECKPOINT_NAME}: is it the syncer's --checkpoint-dir? "
                              "The syncer writes one every --checkpoint-every merges and when it stops")
    elif not path.exists():
        raise ExportError(f"{checkpoint} does not exist; pass the syncer's --checkpoint-dir or its "
                          f"{CHECKPOINT_NAME}")
    return path


def read_global_model(checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    """The global Θ of a syncer checkpoint by canonical name (model order), its metadata
    and the file read. Raises ``ExportError`` for a missing, foreign or corrupt file.
    Only the Θ entries are read (optimizer state and history stay on disk).

    A sharded syncer (``--shard s/S``) writes one checkpoint per shard, each holding its
    own fragments: pass every shard's (any order). The metadata returned then has the
    model's ``layout``, ``versions`` per fragment in the model's numbering, the shards'
    ``merges`` added up, and ``checkpoints``: every file read."""
    paths = [checkpoint] if isinstance(checkpoint, (str, os.PathLike)) else list(checkpoint)
    if not paths:
        raise ExportError("no checkpoint given")
    parts = [_read_checkpoint(p) for p in paths]
    count = {shard.count for _, _, _, shard in parts}
    if len(count) > 1:
        raise ExportError(f"the checkpoints are of syncers split {sorted(count)} ways: pass the checkpoints of the "
                          "shards of one run")
    total = count.pop()
    have = {shard.index: path for _, _, path, shard in parts}
    if len(have) < len(parts):
        raise ExportError(f"two of the checkpoints are the same shard's: {[str(p) for _, _, p, _ in parts]}")
    if len(have) < total:
        missing = [f"{s}/{total}" for s in range(total) if s not in have]
        raise ExportError(f"the syncer ran as {total} shards, and the checkpoints of shards {', '.join(missing)} are "
                          "missing: pass every shard's --checkpoint-dir (each holds only its own fragments)")
    layouts = {json.dumps(meta.layout) for _, meta, _, _ in parts}
    if len(layouts) > 1:
        raise ExportError("the shards' checkpoints hold different models' layouts: pass the shards of one run")
    layout = layout_from_wire(parts[0][1].layout)
    theta: dict[str, torch.Tensor] = {}
    versions = [0] * len(layout)
    for values, meta, _, shard in sorted(parts, key=lambda x: x[3].index):
        theta.update(values)
        for local, v in enumerate(meta.versions):
            versions[shard.to_global(local)] = v
    theta = {t.name: theta[t.name] for f in layout for t in f.tensors}  # the model's order
    summary = {"layout": parts[0][1].layout, "versions": versions, "merges": sum(m.merges for _, m, _, _ in parts),
               "checkpoints": [str(p) for _, _, p, _ in parts]}
    return theta, summary, parts[0][2]


def _read_checkpoint(checkpoint: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], CheckpointMeta, Path,
                                                                    Shard]:
    """One checkpoint's Θ by canonical name (its shard's fragments), metadata, file and shard."""
    path = _checkpoint_file(checkpoint)
    try:
        with open_checkpoint(path) as (meta, f):
            try:
                layout: list[FragmentSpec] = layout_from_wire(meta.layout)
                shard = parse_shard(meta.shard)
                out = named_global_values(f, shard.fragments(layout))
            except (ValueError, AttributeError) as exc:
                raise ExportError(f"{path}: the checkpoint's metadata is corrupt ({exc}); use an earlier copy "
                                  "of the checkpoint") from None
    except CheckpointError as exc:
        raise ExportError(f"{exc}; use an earlier copy of the checkpoint") from None
    problem = non_finite(out)
    if problem:
        previous = path.parent / PREVIOUS_NAME
        raise ExportError(f"{path}: {problem}" + (f"; the previous checkpoint {previous} may be good: "
                                                   "export that one" if previous.exists() else ""))
    return out, meta, path, shard


def _why_not_synced(model: nn.Module, name: str, tensor: torch.Tensor) -> str:
    params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return "frozen parameter (requires_grad=False)" if not params[name].requires_grad else "parameter"
    if not tensor.is_floating_point():
        return f"{dtype_name(tensor.dtype)} buffer (each rack's own)"
    return "floating buffer not synchronised (sync_buffers=False)"


def _state_from_model(theta: dict[str, torch.Tensor], model: nn.Module,
                      base: Mapping[str, torch.Tensor] | None, base_name: str
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """``model``'s full state dict with Θ where rackmend synchronises, aliases of tied
    tensors set to their global value, and the rest from ``base`` or the model."""
    inner = unwrap_model(model)
    state = inner.state_dict(keep_vars=True)
    # Synchronised tensors by identity: a tied weight is one tensor under two names.
    synced_by_id = {id(t): n for n, t, _ in model_tensors(inner) if n in theta}
    names = {canonical_name(k) for k in state}
    extra = [n for n in theta if n not in names]
    if extra:
        raise ExportError(f"the checkpoint holds {len(extra)} tensor(s) the model lacks, e.g. {extra[:3]}: "
                          "a different model (or a different version of it) than the one trained")
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    filled: dict[str, str] = {}
    for key, tensor in state.items():
        name = canonical_name(key)
        if name in theta:
            value, source = theta[name], name
        elif id(tensor) in synced_by_id:
            source = synced_by_id[id(tensor)]
            value = theta[source]
            aliases[key] = source
        else:
            why = _why_not_synced(inner, key, tensor)
            if base is not None and key in base:
                value, filled[key] = base[key], f"{why}: from {base_name}"
            else:
                value, filled[key] = tensor.detach(), f"{why}: from the model"
            if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
                raise ExportError(f"{key} in {base_name} is {dtype_name(value.dtype)} {list(value.shape)}, the model's "
                                  f"is {dtype_name(tensor.dtype)} {list(tensor.shape)}")
            out[key] = value.detach().to("cpu")
            continue
        if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
            raise ExportError(f"{key}: the checkpoint holds {dtype_name(value.dtype)} {list(value.shape)} (as {source}), "
                              f"the model has {dtype_name(tensor.dtype)} {list(tensor.shape)}: a different model, "
                              "or convert the model's dtype after loading")
        out[key] = value
    return out, aliases, filled


def export_model(
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    base: str | os.PathLike[str] | Mapping[str, torch.Tensor] | None = None,
) -> ExportResult:
    """Write the global model of a syncer checkpoint to ``out`` (safetensors) under the
    model's own parameter and buffer names.

    ``checkpoint``: the syncer's ``--checkpoint-dir`` or its ``syncer.safetensors``; for
    a sharded syncer, every shard's (a list).
    Without ``model`` the file holds what rackmend synchronises (trainable parameters and
    floating buffers), which ``load_state_dict(strict=True)`` accepts when the model has
    no tied weights, frozen parameters or integer buffers. With ``model`` (not modified)
    the file holds exactly the keys of its ``state_dict()``: tied aliases get the global
    value of the tensor they share, the entries rackmend does not synchronise come from
    ``base`` (a state file or dict, e.g. a learner's saved ``state_dict``) where it has
    them and from ``model`` otherwise; ``ExportResult.filled`` lists them.
    """
    if base is not None and model is None:
        raise ExportError("base fills entries the syncer does not hold, which needs the model to know them "
                          "(tied names, frozen parameters, integer buffers): pass model= as well (--model)")
    theta, meta, path = read_global_model(checkpoint)
    out_path = Path(out)
    if any(out_path.resolve() == Path(p).resolve() for p in meta["checkpoints"]):
        raise ExportError(f"--out {out} is the checkpoint itself; choose another file")
    aliases: dict[str, str] = {}
    filled: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = dict(theta)
    if model is not None:
        base_map: Mapping[str, torch.Tensor] | None
        base_name = "base"
        if base is None or isinstance(base, Mapping):
            base_map = base
        else:
            base_name = str(base)
            try:
                base_map = load_file(str(base))
            except (SafetensorError, OSError) as exc:
                raise ExportError(f"cannot read the base state file {base}: {exc}") from None
        tensors, aliases, filled = _state_from_model(theta, model, base_map, base_name)
    versions = meta["versions"]
    provenance = {"checkpoint": str(path), "checkpoints": meta["checkpoints"], "versions": versions,
                  "merges": meta["merges"], "aliases": aliases, "filled": filled}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        # Clones: safetensors refuses tensors sharing storage (tied aliases share theirs).
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
                  metadata={"format": "pt", "rackmend": json.dumps(provenance)})
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(path=out_path, checkpoint=path, synced=list(theta), aliases=aliases, filled=filled,
                        versions=versions, merges=provenance["merges"], checked_against_model=model is not None)


def _load_factory(spec: str) -> Callable[[], nn.Module]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ExportError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:build_model")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory import
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExportError(f"--model {spec!r}: cannot import {module_name}: {exc} (run from the directory that "
                          "holds it, or set PYTHONPATH)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExportError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, nargs="+",
                   help="the syncer's --checkpoint-dir, or its syncer.safetensors; for a sharded syncer, every "
                        "shard's (each holds its own fragments)")
    p.add_argument("--out", type=Path, required=True, help="safetensors file to write (e.g. model.safetensors)")
    p.add_argument("--model", metavar="MODULE:CALLABLE", default=None,
                   help="a function building the model (called without arguments, imported from the current "
                        "directory or PYTHONPATH): ties, frozen parameters and integer buffers are then filled "
                        "and the file loads with load_state_dict(strict=True)")
    p.add_argument("--base", type=Path, default=None,
                   help="with --model: a safetensors state file of the model (e.g. a learner's saved state_dict) "
                        "to take the entries rackmend does not synchronise from, instead of the built model")


def main(args: argparse.Namespace) -> int:
    try:
        model = None
        if args.model is not None:
            model = _load_factory(args.model)()
            if not isinstance(model, nn.Module):
                raise ExportError(f"--model {args.model!r} returned {type(model).__name__}, not a torch.nn.Module")
        elif args.base is not None:
            raise ExportError("--base needs --model (the model says which entries are missing and how they are tied)")
        print(f"reading {', '.join(str(c) for c in args.checkpoint)}", file=sys.stderr, flush=True)
        result = export_model(args.checkpoint if len(args.checkpoint) > 1 else args.checkpoint[0], args.out,
                              model=model, base=args.base)
    except ExportError as exc:
        print(f"rackmend export: {exc}", file=sys.stderr)
        return 2
    nbytes = result.path.stat().st_size
    versions = ", ".join(str(v) for v in result.versions)
    print(f"wrote {result.path}: {len(result.synced)} synchronised tensors (global model at fragment versions "
          f"[{versions}], {result.merges} merges), {nbytes / 2**20:.1f} MiB")
    for alias, source in result.aliases.items():
        print(f"  {alias}: tied to {source} (its global value)")
    for key, why in result.filled.items():
        print(f"  {key}: {why}")
    if result.checked_against_model:
        print(f"checked against {args.model}: the file has exactly its state_dict keys, shapes and dtypes "
              "(load_state_dict(strict=True) accepts it)")
    else:
        print("note: the file holds what rackmend synchronises (trainable parameters, floating buffers). If the "
              "model also has tied weights or frozen parameters, load_state_dict(strict=True) reports them "
              "missing; integer buffers (BatchNorm's num_batches_tracked) are not synchronised either (BatchNorm "
              "sets a missing one to 0). Pass --model MODULE:CALLABLE to fill and check them, or load with "
              "strict=False and check the missing keys.")
    return 0
