"""One rack of several data-parallel ranks (DDP under torchrun) as a rackmend learner.

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0,rack1
    RACKMEND_LEARNER_ID=rack0 torchrun --nproc-per-node 2 examples/ddp_rack.py --connect tcp://127.0.0.1:5555

(then the same for rack1). Every rank builds the model, wraps it in DDP and then the
inner optimizer in RackmendOptimizer with the same learner id; the link takes rank and
world size from torch.distributed. Each rank passes its own tokens to ``step``; the
rack counts the sum over its ranks.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist

import rackmend
from rackmend.workloads import GPT, ByteCorpus, GPTConfig, evaluate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"))
    p.add_argument("--id", default=os.environ.get("RACKMEND_LEARNER_ID", "rack0"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=8)
    a = p.parse_args()
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank (the join overwrites it anyway)
    model = torch.nn.parallel.DistributedDataParallel(GPT(GPTConfig(n_layer=2, n_embd=64)))
    config = rackmend.RackmendConfig(schedule=rackmend.ScheduleConfig(sync_every=a.sync_every, num_fragments=2))
    opt = rackmend.RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config,
                                     rackmend.ZmqLink(a.connect), learner_id=a.id)
    corpus = ByteCorpus()
    g = torch.Generator().manual_seed(zlib.crc32(f"{a.id}/{rank}".encode()))  # each rank its own batches
    for step in range(1, a.steps + 1):
        x, y = corpus.batch(g, 8, model.module.cfg.block_size)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=x.numel())  # this rank's tokens
    if rank == 0:
        held_out = evaluate(model.module, corpus.eval_batches(4, 8, model.module.cfg.block_size))
        print(f"{a.id}: {opt.step_count} steps, versions {opt.versions}, held-out loss {held_out:.3f}")
    opt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
