"""One rack whose model is sharded with FSDP2 (``fully_shard``) under torchrun, as a
rackmend learner: each rank sends and receives only its own shards.

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0,rack1
    RACKMEND_LEARNER_ID=rack0 torchrun --nproc-per-node 2 examples/fsdp2_rack.py --connect tcp://127.0.0.1:5555

Shard first, then build the inner optimizer from ``model.parameters()``, then
RackmendOptimizer (as torch asks for FSDP2). Racks sharded differently, or not at all,
train one model through the same syncer.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import rackmend
from rackmend.workloads import GPT, ByteCorpus, GPTConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"))
    p.add_argument("--id", default=os.environ.get("RACKMEND_LEARNER_ID", "rack0"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=8)
    a = p.parse_args()
    dist.init_process_group("gloo")  # "nccl" and a "cuda" mesh on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = rackmend.RackmendConfig(schedule=rackmend.ScheduleConfig(sync_every=a.sync_every, num_fragments=2))
    opt = rackmend.RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config,
                                     rackmend.ZmqLink(a.connect), learner_id=a.id)
    corpus = ByteCorpus()
    g = torch.Generator().manual_seed(zlib.crc32(f"{a.id}/{rank}".encode()))
    for step in range(1, a.steps + 1):
        x, y = corpus.batch(g, 8, model.cfg.block_size)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=x.numel())  # this rank's tokens; the rack counts the sum over its ranks
    if rank == 0:
        print(f"{a.id}: {opt.step_count} steps, versions {opt.versions}, last loss {loss.item():.3f}")
    opt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
