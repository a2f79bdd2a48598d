"""``rackmend.enable_async_tp``: the documented error where async TP cannot run (a real
gloo process group on CPU), and, where CUDA is present, a compiled TP MLP step with it
on (ranks as real processes, one per GPU, up to two)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import rackmend
from rackmend import AsyncTPUnavailable


@pytest.fixture
def gloo_world(tmp_path: Path):
    """A one-rank gloo process group, torn down after the test."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_cpu_mesh_is_refused_with_what_is_missing(gloo_world: None) -> None:
    import torch._inductor.config as inductor_config

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    with pytest.raises(AsyncTPUnavailable) as err:
        rackmend.enable_async_tp(mesh["tp"])
    text = str(err.value)
    assert "rackmend.enable_async_tp needs" in text
    assert "the TP mesh is on 'cpu'" in text and "init_device_mesh('cuda'" in text
    if dist.is_nccl_available():  # a CUDA build: the group itself is the problem
        assert "backend is 'gloo'" in text
    else:
        assert "NCCL" in text
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in text
    # Nothing was half turned on: inductor compiles as before.
    assert inductor_config._micro_pipeline_tp is False


def test_two_dimensional_mesh_is_refused(gloo_world: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(AsyncTPUnavailable, match=r"one mesh dimension: the mesh given has 2; pass the TP dimension"):
        rackmend.enable_async_tp(mesh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(600)
def test_compiled_tp_mlp_step_with_async_tp_on_gpu(tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "PYTHONPATH": os.pathsep.join(sys.path)}
    script = Path(__file__).parent / "_async_tp_proc.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"rank{r}.json")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=540)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outputs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert r["micro_pipeline_tp"] and r["symm_mem_enabled"]
        # The compiled async-TP step computes what the eager TP step does.
        assert r["max_abs_diff_loss"] < 1e-3 and r["max_abs_diff_grad"] < 1e-3, r
        if world > 1:
            # Inductor really fused the TP collectives into symmetric-memory matmuls.
            assert r["fused_ops"], r
