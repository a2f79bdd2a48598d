"""What a rack's ranks hold, written by a rank at the end of a run and compared by a
test with the syncer's checkpoint (test helpers shared by the trainer and sharded tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rackmend import RackmendOptimizer


def save_held(opt: RackmendOptimizer, path: str | Path) -> None:
    """This rank's held values and where its blocks lie: ``held/<p>/<i>``,
    ``place/<p>/<i>`` (offsets then shape; empty where the rank holds nothing of
    the tensor) and ``versions``, as safetensors at ``path``."""
    saved = {"versions": torch.tensor(opt.versions)}
    for f, held in zip(opt.fragments, opt.held):
        for i, value in enumerate(held):
            block = opt.core.fragments[f.index].pieces[i]
            saved[f"held/{f.index}/{i}"] = value.contiguous().clone()
            place = [*block.offsets, *block.shape] if block is not None else []
            saved[f"place/{f.index}/{i}"] = torch.tensor(place, dtype=torch.int64)
    save_file(saved, str(path))


def assert_held_equal_syncer(files: list[str | Path], checkpoint: dict[str, torch.Tensor],
                             min_version: int = 3) -> list[int]:
    """Every rank (one ``save_held`` file each) holds, of each fragment, its blocks of the
    syncer's value of the version it holds (the checkpoint's history), bit for bit; all
    ranks hold one version, at least ``min_version``. Returns the versions."""
    held = [load_file(str(f)) for f in files]
    versions = held[0]["versions"].tolist()
    assert all(f["versions"].tolist() == versions for f in held), "the ranks hold different versions"
    for p, v in enumerate(versions):
        assert v >= min_version, f"fragment {p} is held at version {v} only"
        i = 0
        while f"history/{p}/{v}/{i}" in checkpoint:
            whole = checkpoint[f"history/{p}/{v}/{i}"]
            for r, f in enumerate(held):
                place = f[f"place/{p}/{i}"].tolist()
                if not place:  # a rank may hold nothing of a small tensor (uneven shards)
                    continue
                nd = len(place) // 2
                block = whole[tuple(slice(o, o + s) for o, s in zip(place[:nd], place[nd:]))]
                assert torch.equal(f[f"held/{p}/{i}"], block), f"rank {r} holds fragment {p}.{i} unlike the syncer"
            i += 1
        assert i > 0, f"the checkpoint has no history of fragment {p} version {v}"
    return versions


def meet(folder: str | Path, me: str, everyone: list[str] | tuple[str, ...], timeout: float = 120.0) -> None:
    """A file barrier between racks: write ``folder/me`` and wait until every one of
    ``everyone`` has (bounded). Racks that resume call it once joined, before training:
    a deterministic syncer stops waiting for a listed learner that has left, so a rack
    starting late would miss the other's first rounds."""
    import time

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / me).touch()
    end = time.monotonic() + timeout
    while not all((folder / other).exists() for other in everyone):
        if time.monotonic() > end:
            raise TimeoutError(f"{me}: the other racks did not reach {folder} within {timeout}s")
        time.sleep(0.05)
