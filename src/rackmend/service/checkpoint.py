"""Atomic syncer checkpoints: one safetensors file whose metadata carries the JSON part.

Write to a temporary file in the same directory, fsync it, rename it over the old
one, fsync the directory: a crash at any point leaves either the old or the new
checkpoint, never a torn one. Loading never runs code (safetensors, json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

__all__ = ["CHECKPOINT_NAME", "save_checkpoint", "load_checkpoint", "remove_stale_temps"]

CHECKPOINT_NAME = "syncer.safetensors"
_TMP_PREFIX = f".{CHECKPOINT_NAME}.tmp-"


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
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The latest checkpoint in ``directory``, or None when there is none."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["rackmend"])
    return load_file(str(path)), meta
