"""A Hugging Face ``accelerate`` rack (one process, or several ranks under torchrun) as
a rackmend learner, through ``rackmend.learner.accel.prepare``.

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0,rack1
    RACKMEND_LEARNER_ID=rack0 torchrun --nproc-per-node 2 examples/accelerate_rack.py --connect tcp://127.0.0.1:5555

``accel.prepare`` prepares the model, wraps the inner optimizer in RackmendOptimizer and
prepares that, in the order that works; tokens go to ``add_tokens`` (accelerate's
optimizer step takes none); ``accelerator.save_state`` / ``load_state`` carry each rank's
rackmend state. A small GPT-2 from a config, on Python's own docs as bytes.
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path

import accelerate
import torch
import transformers

import rackmend
from rackmend.learner import accel
from rackmend.workloads import ByteCorpus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"))
    p.add_argument("--id", default=os.environ.get("RACKMEND_LEARNER_ID", "rack0"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--state", type=Path, help="checkpoint folder: resumed from if it exists, saved at the end")
    a = p.parse_args()
    accelerator = accelerate.Accelerator()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64,
                                                                 n_layer=2, n_head=2))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = rackmend.RackmendConfig(schedule=rackmend.ScheduleConfig(sync_every=8, num_fragments=2))
    model, opt = accel.prepare(accelerator, model, inner, config, rackmend.ZmqLink(a.connect), learner_id=a.id)
    rm = opt.optimizer  # the RackmendOptimizer inside accelerate's wrapper
    if a.state and a.state.exists():
        accelerator.load_state(str(a.state))
    corpus = ByteCorpus()
    g = torch.Generator().manual_seed(zlib.crc32(f"{a.id}/{accelerator.process_index}".encode()))
    while rm.step_count < a.steps:
        x, _ = corpus.batch(g, 8, 64)
        x = x.to(accelerator.device)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        rm.add_tokens(x.numel())  # this rank's tokens; the rack counts the sum over its ranks
        opt.step()
        opt.zero_grad()
    if a.state:
        accelerator.save_state(str(a.state))
    accelerator.print(f"{a.id}: {rm.step_count} steps, versions {rm.versions}, last loss {loss.item():.3f}")
    rm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
