"""Sharded racks (FSDP2, tensor parallel) with a real ``rackmend syncer``: torchrun
jobs of gloo ranks on the CPU, each rank sending and receiving its own pieces; racks
sharded differently training one model; pieces that cannot be right refused at hello."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.fragments import pack_fragments
from rackmend.core.pieces import Piece, whole_pieces
from rackmend.core.settings import LearnerSettings
from rackmend.transport import wire

from helpers import Dealer, assert_files_equal_reference, batch, make_inner, make_model
from procs import LEARNER, Procs, events, finish, wait_for
from reference import reference_run

SHARDED = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
PROC = str(Path(__file__).parent / "_sharded_proc.py")
H, P, TAU, STEPS = 3, 2, 1, 12


def _rack(procs: Procs, endpoint: str, lid: str, ranks: int, mode: str, ids: list[str], tmp: Path,
          *extra: str) -> object:
    """A torchrun job of ``ranks`` ranks training ``lid`` sharded as ``mode``."""
    return procs.start([*SHARDED, "--nproc-per-node", str(ranks), PROC, "--mode", mode, "--endpoint", endpoint,
                        "--id", lid, "--steps", str(STEPS), "--H", str(H), "--P", str(P), "--tau", str(TAU),
                        "--learners", ",".join(ids), "--out", str(tmp / f"{lid}.safetensors"), *extra], lid)


def _plain(procs: Procs, endpoint: str, lid: str, ids: list[str], tmp: Path, *extra: str) -> object:
    return procs.learner(endpoint, lid, "--steps", str(STEPS), "--H", str(H), "--P", str(P), "--tau", str(TAU),
                         "--learners", ",".join(ids), "--out", str(tmp / f"{lid}.safetensors"), *extra)


def _reference(ids: list[str]) -> dict[str, torch.nn.Module]:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU),
                            syncer=SyncerConfig(min_quorum=len(ids), learners=tuple(ids)), deterministic=True)
    torch.set_num_threads(1)
    return reference_run(make_model, make_inner, batch, config, ids, STEPS)[0]


def _merges(tmp: Path, ids: list[str]) -> list[dict]:
    merges = [e for e in events(tmp) if e["event"] == "merge"]
    assert sorted({e["fragment"] for e in merges}) == list(range(P)), "some fragments never merged"
    assert all(e["merged"] == ids for e in merges), [e["merged"] for e in merges]
    assert not [e for e in events(tmp) if e["event"] in ("incomplete", "piece_dropped", "reject", "bad_message")]
    return merges


def test_two_fsdp2_racks_equal_the_single_process_reference(procs: Procs, tmp_path: Path) -> None:
    """Two FSDP2 racks of 2 ranks each, deterministic: every rank sends only its shard of
    every tensor, the syncer assembles them, and the final parameters equal the plain
    single-process reference bit for bit (the shards' reductions are elementwise)."""
    ids = ["l0", "l1"]
    _, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                               "--overlap", str(TAU))
    racks = {lid: _rack(procs, endpoint, lid, 2, "fsdp", ids, tmp_path, "--deterministic") for lid in ids}
    for lid, proc in racks.items():
        finish(proc, procs, lid, timeout=240)
    merges = _merges(tmp_path, ids)
    assert len(merges) >= P * 3
    assert_files_equal_reference(tmp_path, ids, _reference(ids))
