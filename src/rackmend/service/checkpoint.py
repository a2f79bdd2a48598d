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
import os
from pathlib import Path
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rackmend.core.checkpoint_meta import CheckpointMeta

__all__ = ["CHECKPOINT_NAME", "PREVIOUS_NAME", "Checkpoint", "CheckpointError", "open_checkpoint",
           "save_checkpoint", "load_checkpoint", "read_checkpoint", "non_finite", "remove_stale_temps"]

log = logging.getLogger("rackmend.syncer")

CHECKPOINT_NAME = "syncer.safetensors"
PREVIOUS_NAME = "syncer.previous.safetensors"
"""The checkpoint before the latest, kept so a bad latest one can be fallen back from
(a checkpoint directory holds two checkpoints' worth of disk)."""
_TMP_PREFIX = f".{CHECKPOINT_NAME}.tmp-"


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


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file read and checked."""

    path: Path
    meta: CheckpointMeta
    tensors: dict[str, torch.Tensor]


def save_checkpoint(directory: str | Path, tensors: dict[str, torch.Tensor], meta: CheckpointMeta) -> Path:
    """Write ``tensors`` and ``meta`` atomically; returns the file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = directory / f"{_TMP_PREFIX}{os.getpid()}"
    # safetensors refuses tensors that share storage; contiguous clones are cheap next to the disk write.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
              metadata={"rackmend": json.dumps(meta.to_json())})
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


def load_checkpoint(directory: str | Path) -> Checkpoint | None:
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


def _checkpoint_file(path: str | os.PathLike[str]) -> Path:
    """The checkpoint file of ``path``: the file itself, or the latest in a directory."""
    p = Path(path)
    return p / CHECKPOINT_NAME if p.is_dir() else p


@contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[tuple[CheckpointMeta, Any]]:
    """The checked and upgraded metadata of the checkpoint at ``path`` (a file, or a
    directory's latest) and the open safetensors file, whose tensors are read only when
    asked for (``get_tensor``): what export, the demo and the service all read a
    checkpoint with. ``CheckpointError`` naming the file and what is wrong."""
    file = _checkpoint_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            raw = (f.metadata() or {}).get("rackmend")
            if raw is None:
                raise CheckpointError(f"{file} is a safetensors file but not a rackmend syncer checkpoint "
                                      "(its metadata has no 'rackmend' entry)")
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"{file}: its metadata is not JSON ({exc})") from None
            try:
                meta = CheckpointMeta.from_json(parsed)
            except ValueError as exc:
                raise CheckpointError(f"{file}: {exc}") from None
            yield meta, f
    except SafetensorError as exc:
        raise CheckpointError(f"{file} cannot be read as safetensors ({exc}): it is truncated or corrupt") from None
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from None


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint file ``path`` with all its tensors, checked (``open_checkpoint``,
    ``non_finite``); ``CheckpointError`` naming the file and the field otherwise."""
    with open_checkpoint(path) as (meta, f):
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    problem = non_finite(tensors.items())
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return Checkpoint(Path(path), meta, tensors)


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> str | None:
    """The first (name, tensor) holding NaN or infinity, named, or None."""
    for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            count = int((~torch.isfinite(t)).sum())
            return f"tensor {name!r} holds {count} NaN or infinite value(s)"
    return None
