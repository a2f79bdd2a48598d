"""Atomic syncer checkpoints: one safetensors file whose metadata carries the JSON part.

Write to a temporary file in the same directory, fsync it, move the old one aside as the
previous checkpoint, rename the new one into place, fsync the directory: a crash at any
point leaves the old or the new checkpoint, never a torn one. Loading never runs code
(safetensors, json) and checks what it read before anything uses it (every tensor
finite, every number within what the wire carries, the guard's state sane); a bad
checkpoint falls back to the previous one, or is refused naming the file and the field.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

__all__ = ["CHECKPOINT_NAME", "PREVIOUS_NAME", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "read_checkpoint", "check_meta", "non_finite", "remove_stale_temps"]

log = logging.getLogger("rackmend.syncer")

CHECKPOINT_NAME = "syncer.safetensors"
PREVIOUS_NAME = "syncer.previous.safetensors"
"""The checkpoint before the latest, kept so a bad latest one can be fallen back from
(a checkpoint directory holds two checkpoints' worth of disk)."""
_TMP_PREFIX = f".{CHECKPOINT_NAME}.tmp-"
_WIRE_INT = 2**63 - 1
"""The largest integer the wire carries (msgpack int64): a larger version or count in a
checkpoint would start the syncer, then fail every join inside the encoder."""
_REQUIRED = {"versions": list, "optim": list, "ema": dict, "rejected": int, "learners": list}
"""Entries every checkpoint of the syncer core has (``SyncerCore.state_dict``), and their
JSON types; the service adds its own (``rackmend.service.checkpointing``)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete temporary files of checkpoint writes a crash interrupted; returns them.

    Only call this before this process writes a checkpoint: a syncer owns its directory,
    so at start no write of its own is under way, and any temporary file is a leftover
    (each one as large as a checkpoint)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.glob(f"{_TMP_PREFIX}*")):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def save_checkpoint(directory: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` and the JSON-able ``meta`` atomically; returns the file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = directory / f"{_TMP_PREFIX}{os.getpid()}"
    # safetensors refuses tensors that share storage; contiguous clones are cheap next to the disk write.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
              metadata={"rackmend": json.dumps(meta)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    if path.exists():  # a crash before the next line leaves only the previous one: load falls back to it
        os.replace(path, directory / PREVIOUS_NAME)
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The latest good checkpoint in ``directory`` (``read_checkpoint``), or None when there
    is none. When the latest is bad and the previous one good, the previous one, with a
    warning naming what is wrong with the latest; ``CheckpointError`` when neither is good."""
    directory = Path(directory)
    candidates = [p for p in (directory / CHECKPOINT_NAME, directory / PREVIOUS_NAME) if p.exists()]
    if not candidates:
        return None
    problems = []
    for path in candidates:
        try:
            loaded = read_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            log.warning("%s; using the previous checkpoint %s instead (its merges since are lost)", problems[0], path)
        return loaded
    raise CheckpointError("; ".join(problems) + (". No good checkpoint is left in " f"{directory}: start the syncer "
                                                 "without --resume (learners seed it anew), or restore a copy"))


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of the checkpoint file ``path``, checked (``check_meta``,
    ``non_finite``); ``CheckpointError`` naming the file and the field otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("rackmend")
        if raw is None:
            raise CheckpointError(f"{path} is a safetensors file but not a rackmend syncer checkpoint "
                                  "(its metadata has no 'rackmend' entry)")
        meta = json.loads(raw)
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise CheckpointError(f"{path} cannot be read as safetensors ({exc}): it is truncated or corrupt") from None
    except (ValueError, RecursionError) as exc:  # json's errors
        raise CheckpointError(f"{path}: its metadata is not JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    problem = check_meta(meta) or non_finite(tensors.items())
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return tensors, meta


def check_meta(meta: Any) -> str | None:
    """What is wrong with a checkpoint's metadata, naming the field, or None: an entry
    missing or of the wrong type, a number beyond the wire's integers or not finite, a
    negative version, epoch or count, a guard scale that is not positive."""
    if not isinstance(meta, dict):
        return f"the metadata is a JSON {type(meta).__name__}, not an object"
    for key, kind in _REQUIRED.items():
        if not isinstance(meta.get(key), kind):
            return f"'{key}' is {'missing' if key not in meta else type(meta[key]).__name__}, not a {kind.__name__}"
    bad = _bad_number(meta, "")
    if bad:
        return bad
    for key in ("versions", "rejected", "epoch", "merges", "rejected_messages"):
        values = meta.get(key, 0)
        for i, v in enumerate(values if isinstance(values, list) else [values]):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                return f"'{key}'{f'[{i}]' if isinstance(values, list) else ''} is {v!r}, not a count >= 0"
    for i, scale in enumerate(meta.get("norm_scale", [])):
        if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
            return f"'norm_scale'[{i}] is {scale!r}: the norm guard's scale must be a positive number"
    for i, norms in enumerate(meta.get("norms", [])):
        if not isinstance(norms, list) or any(not isinstance(n, (int, float)) or n < 0 for n in norms):
            return f"'norms'[{i}] must be a list of norms >= 0, got {str(norms)[:80]}"
    return None


def _bad_number(value: Any, where: str) -> str | None:
    """The first number in ``value`` (JSON, walked) beyond the wire's integers or not finite."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        if -_WIRE_INT - 1 <= value <= _WIRE_INT:
            return None
        return f"'{where}' is {value}, beyond the wire's 64-bit integers"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"'{where}' is {value}, not a finite number"
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return f"'{where}' holds a {type(value).__name__}"
    for k, v in items:
        bad = _bad_number(v, f"{where}.{k}" if where else str(k))
        if bad:
            return bad
    return None


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> str | None:
    """The first (name, tensor) holding NaN or infinity, named, or None."""
    for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            count = int((~torch.isfinite(t)).sum())
            return f"tensor {name!r} holds {count} NaN or infinite value(s)"
    return None
