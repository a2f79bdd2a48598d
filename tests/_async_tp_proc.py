"""One rank of test_async_tp's GPU check: a sequence-parallel TP MLP, compiled with
async TP on, against the same module run eagerly; writes its findings as JSON.

``python tests/_async_tp_proc.py OUT_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK set (as torchrun sets them)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import rackmend


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def main(out: str) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    name = rackmend.enable_async_tp(mesh["tp"])
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    dim, hidden, batch, seq = 1024, 4096, 4, 256 * world
    # Sequence parallel: activations sharded on the sequence dimension enter with an
    # all-gather and leave with a reduce-scatter, the two patterns async TP decomposes.
    plan = {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
    eager = parallelize_module(MLP(dim, hidden).cuda(), mesh["tp"], plan)
    torch.manual_seed(0)
    compiled_mod = parallelize_module(MLP(dim, hidden).cuda(), mesh["tp"], plan)
    compiled = torch.compile(compiled_mod)
    x = torch.randn(batch, seq // world, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))

    def step(model: nn.Module, module: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        y = model(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                               for p in module.parameters()]

    (loss_c, grads_c), codes = run_and_get_code(lambda: step(compiled, compiled_mod))
    loss_e, grads_e = step(eager, eager)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step(compiled, compiled_mod)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 10 * 1e3
    code = "\n".join(codes)
    result = {
        "rank": rank, "world": world, "group": name, "torch": torch.__version__,
        "micro_pipeline_tp": bool(inductor_config._micro_pipeline_tp),
        "symm_mem_enabled": bool(is_symm_mem_enabled_for_group(name)),
        "fused_ops": sorted({op for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter") if op in code}),
        "max_abs_diff_loss": float((loss_c - loss_e).abs()),
        "max_abs_diff_grad": max(float((a - b).abs().max()) for a, b in zip(grads_c, grads_e)),
        "compiled_step_ms": ms,
    }
    with open(out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
