"""A rack that trains with Hugging Face accelerate through ``rackmend.learner.accel``
(test helper; run under torchrun for several ranks).

python -m torch.distributed.run --nproc-per-node 2 tests/_accelerate_proc.py --endpoint tcp://127.0.0.1:PORT \
    --id l0 --learners l0,l1 --steps 14 --stop-at 7 --folder ckpt --out result.json

The GPT-2 and the ragged, padded batches of ``_trainer_proc.py``; each micro-batch's
non-padding tokens go to ``RackmendOptimizer.add_tokens`` and are recorded by the
collator independently. ``--stop-at N``: ``accelerator.save_state(folder)`` after step N
and stop; ``--resume``: ``accelerator.load_state(folder)`` and go on from there. Writes
``<out>.<rank>`` (JSON: the collated counts, steps, versions, what was restored) and
``--held-out`` files (tests/rackstate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import accelerate
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_proc import BATCH, PadRecorder, Ragged, make_model  # noqa: E402
from rackstate import meet, save_held  # noqa: E402

from rackmend import LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig, ZmqLink  # noqa: E402
from rackmend.learner import accel  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--learners", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--held-out", type=Path)
    p.add_argument("--meet", type=Path, help="once joined, wait for every learner's rank 0 here (rackstate.meet)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    ids = tuple(a.learners.split(","))
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=len(ids), learners=ids),
                            learner=LearnerConfig(wait_timeout=60), deterministic=True)
    accelerator = accelerate.Accelerator(cpu=True)
    seed = int(a.id.lstrip("l"))
    model = make_model("gpt2")
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built before prepare: accel.prepare copes
    model, opt = accel.prepare(accelerator, model, inner, config, ZmqLink(a.endpoint, heartbeat_s=0.2),
                               learner_id=a.id)
    rm = opt.optimizer
    if a.meet:
        meet(a.meet, f"{a.id}.{rm.rank}", [f"{lid}.{r}" for lid in ids for r in range(rm.world_size)])
    collator = PadRecorder()
    loader = accelerator.prepare(DataLoader(Ragged(512, seed=seed), batch_size=BATCH, collate_fn=collator))
    first, resumed = 1, {}
    if a.resume:
        accelerator.load_state(str(a.folder))
        first = rm.step_count + 1
        resumed = {"step": rm.step_count, "c_time": rm.c_time, "versions": rm.versions}
        loader = accelerator.skip_first_batches(loader, rm.step_count)
    last = a.stop_at or a.steps
    batches = iter(loader)
    for step in range(first, last + 1):
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        rm.add_tokens(int(batch["attention_mask"].sum()))  # this rank's micro-batch
        opt.step()
        opt.zero_grad()
    if a.stop_at:
        accelerator.save_state(str(a.folder))
    rm.close()
    rank = rm.rank
    if a.held_out:
        save_held(rm, f"{a.held_out}.{rank}")
    Path(f"{a.out}.{rank}").write_text(json.dumps({
        "collated": collator.collated, "step": rm.step_count, "versions": rm.versions, "resumed": resumed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
