"""A Hugging Face ``Trainer`` rack (one process, or several ranks under torchrun) as a
rackmend learner, through ``rackmend.learner.hf.attach_to_trainer``.

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0,rack1
    RACKMEND_LEARNER_ID=rack0 torchrun --nproc-per-node 2 examples/hf_trainer_rack.py --connect tcp://127.0.0.1:5555

The Trainer keeps its own AdamW and LR schedule; rackmend counts each step's tokens from
the batches (attention_mask, else input_ids), logs its figures in the Trainer's logs,
saves each rank's state in the Trainer's checkpoints (resume with --resume) and leaves
the run when training ends. A small GPT-2 from a config, on Python's own docs as bytes.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers

import rackmend
from rackmend.learner.hf import attach_to_trainer
from rackmend.workloads import ByteCorpus

BLOCK = 64


class Windows(torch.utils.data.Dataset):
    """Byte windows of the pydoc corpus as causal-LM examples."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // BLOCK - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * BLOCK:(i + 1) * BLOCK]
        return {"input_ids": ids, "labels": ids}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"))
    p.add_argument("--id", default=os.environ.get("RACKMEND_LEARNER_ID", "rack0"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--output-dir", default="hf-trainer-rack")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --output-dir")
    a = p.parse_args()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64,
                                                                 n_layer=2, n_head=2))
    args = transformers.TrainingArguments(output_dir=f"{a.output_dir}/{a.id}", max_steps=a.steps,
                                          per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=20,
                                          save_steps=100, report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows(ByteCorpus().train))
    config = rackmend.RackmendConfig(schedule=rackmend.ScheduleConfig(sync_every=8, num_fragments=2))
    attach_to_trainer(trainer, config, rackmend.ZmqLink(a.connect), learner_id=a.id)
    trainer.train(resume_from_checkpoint=True if a.resume else None)  # leaves the run at the end
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
