"""One rackmend rack trained with PyTorch Lightning: a small byte-level language model.

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0
    RACKMEND_LEARNER_ID=rack0 python examples/lightning_rack.py --connect tcp://127.0.0.1:5555

Lightning starts the rack's ranks itself (``--devices 2``: DDP, gloo on the CPU; add
``--accelerator gpu`` for NCCL on GPUs). A second rack is the same command with another
``RACKMEND_LEARNER_ID``, listed in the syncer's ``--learners``. The LightningModule is an
ordinary one (``configure_optimizers`` returns AdamW and an LR schedule); rackmend is the
one callback, which wraps that optimizer at each fit, counts the non-padding tokens of
every batch, keeps each rank's rackmend state in Lightning's checkpoints and leaves the
run when the fit ends. The data are the lines of this file, padded per batch.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from rackmend import RackmendConfig, ScheduleConfig
from rackmend.learner.lightning import RackmendCallback

LINES = [line.encode()[:64] for line in Path(__file__).read_text().splitlines() if len(line) > 8]


def pad(lines: list[bytes]) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(lines), max(map(len, lines)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, line in enumerate(lines):
        ids[row, : len(line)] = torch.tensor(list(line))
        mask[row, : len(line)] = 1
    return {"input_ids": ids, "attention_mask": mask}


class ByteLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.rnn = torch.nn.GRU(32, 64, batch_first=True)
        self.head = torch.nn.Linear(64, 256)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.head(self.rnn(self.emb(ids[:, :-1]))[0])
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # no loss on padding
        return F.cross_entropy(logits.reshape(-1, 256), target.reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"),
                   help="the syncer (env RACKMEND_CONNECT)")
    p.add_argument("--devices", type=int, default=2, help="ranks of this rack")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", type=Path, help="write the result (versions, losses) here as JSON")
    a = p.parse_args()
    pl.seed_everything(0, verbose=False)
    model = ByteLM()
    held_out = pad(LINES[:32])
    with torch.no_grad():
        start_loss = float(model.loss(held_out))
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=8, num_fragments=2))
    rack = RackmendCallback(config, a.connect)  # the learner id comes from RACKMEND_LEARNER_ID
    trainer = pl.Trainer(accelerator=a.accelerator, devices=a.devices, strategy="ddp" if a.devices > 1 else "auto",
                         max_steps=a.steps, callbacks=[rack], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(LINES, batch_size=8, shuffle=True, collate_fn=pad))
    if trainer.is_global_zero:
        with torch.no_grad():
            end_loss = float(model.cpu().loss(held_out))
        assert rack.optimizer is not None
        result = {"versions": rack.optimizer.versions, "start_loss": start_loss, "end_loss": end_loss}
        print(f"rack {rack.optimizer.learner_id}: held-out loss {start_loss:.3f} -> {end_loss:.3f}, "
              f"global versions {result['versions']}")
        if a.out:
            a.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
