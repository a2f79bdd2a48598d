"""A rack that trains with the Hugging Face ``Trainer`` through rackmend (test helper).

python tests/_trainer_proc.py --endpoint tcp://127.0.0.1:PORT --id l0 --steps 24 --out result.json

A small random-init causal LM (GPT-2 with tied embeddings, or Llama) from a config; no
download. ``--mode manual``: ``RackmendOptimizer`` and an LR scheduler go in through
``optimizers=``; the Trainer calls ``step()`` without tokens, so
``LearnerConfig.tokens_per_step`` says what a step is worth. ``--mode attach``:
``rackmend.learner.hf.attach_to_trainer`` on a plain Trainer, with sequences of varying
length padded per batch and gradient accumulation; the collator records each
micro-batch's non-padding tokens (``collated``) for the test to check the counts
against. Writes the Trainer's log history and the final held-out loss as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig, ZmqLink

sys.path.insert(0, str(Path(__file__).parent))
from rackstate import meet, save_held  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4


class Progressions(Dataset):
    """Sequences t_i = (a + b*i) mod VOCAB: learnable next-token structure, no files."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(0, VOCAB, (n, 1), generator=g)
        b = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (a + b * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Ragged(Dataset):
    """Progressions of lengths 4..SEQ: batches need padding, so tokens per step vary."""

    def __init__(self, n: int, seed: int) -> None:
        self.full = Progressions(n, seed)
        g = torch.Generator().manual_seed(seed + 7)
        self.lengths = torch.randint(4, SEQ + 1, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.full)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.full.ids[i][: self.lengths[i]]}


class PadRecorder:
    """Right-pads a batch (attention_mask 0, labels -100 on padding) and records its
    non-padding tokens, counted here independently of rackmend."""

    def __init__(self) -> None:
        self.collated: list[int] = []

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(it["input_ids"]) for it in items)
        ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for row, it in enumerate(items):
            n = len(it["input_ids"])
            ids[row, :n] = it["input_ids"]
            mask[row, :n] = 1
        self.collated.append(sum(len(it["input_ids"]) for it in items))
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class StopAt(transformers.TrainerCallback):
    """Stops training after step ``at`` (a run cut short, to be resumed)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: object, state: transformers.TrainerState, control: transformers.TrainerControl,
                    **kwargs: object) -> None:
        if state.global_step >= self.at:
            control.should_training_stop = True


def make_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      tie_word_embeddings=True)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def held_out_loss(model: torch.nn.Module) -> float:
    data = Progressions(64, seed=999)
    model.eval()
    with torch.no_grad():
        ids = data.ids
        return float(model(input_ids=ids, labels=ids).loss)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--learners", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("manual", "attach"), default="manual")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps (attach mode)")
    p.add_argument("--save-every", type=int, default=0, help="attach mode: a Trainer checkpoint every N steps")
    p.add_argument("--stop-at", type=int, default=0, help="attach mode: the Trainer stops after step N")
    p.add_argument("--resume", action="store_true", help="attach mode: train(resume_from_checkpoint=True)")
    p.add_argument("--held-out", type=Path, help="attach mode: each rank's held values (tests/rackstate.py)")
    p.add_argument("--meet", type=Path, help="attach mode: once joined, wait for every learner here (rackstate.meet)")
    a = p.parse_args()
    torch.set_num_threads(1)
    ids = tuple(a.learners.split(","))
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
        syncer=SyncerConfig(min_quorum=len(ids), learners=ids),
        learner=LearnerConfig(wait_timeout=60, tokens_per_step=BATCH * SEQ),
        deterministic=True,
    )
    model = make_model(a.arch)
    start_loss = held_out_loss(model)
    if a.mode == "attach":
        return attach_mode(a, ids, model, start_loss)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = RackmendOptimizer(model, inner, config, ZmqLink(a.endpoint, heartbeat_s=0.2), learner_id=a.id)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.95**s)
    args = transformers.TrainingArguments(
        output_dir=str(a.out.parent / f"trainer-{a.id}"), max_steps=a.steps, per_device_train_batch_size=BATCH,
        logging_steps=4, report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=int(a.id.lstrip("l")))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Progressions(512, seed=int(a.id.lstrip("l"))),
                                   optimizers=(opt, sched))
    trainer.train()
    opt.close()
    a.out.write_text(json.dumps({
        "log_history": trainer.state.log_history, "start_loss": start_loss, "end_loss": held_out_loss(model),
        "versions": opt.versions, "step": opt.step_count, "lr": inner.param_groups[0]["lr"],
    }))
    return 0


def attach_mode(a: argparse.Namespace, ids: tuple[str, ...], model: torch.nn.Module, start_loss: float) -> int:
    from rackmend.learner.hf import attach_to_trainer

    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
        syncer=SyncerConfig(min_quorum=len(ids), learners=ids),
        learner=LearnerConfig(wait_timeout=60),
        deterministic=True,
    )
    seed = int(a.id.lstrip("l"))
    collator = PadRecorder()
    args = transformers.TrainingArguments(
        output_dir=str(a.out.parent / f"trainer-{a.id}"), max_steps=a.steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=a.accumulate, learning_rate=3e-3, logging_steps=4, report_to="none",
        save_strategy="steps" if a.save_every else "no", save_steps=a.save_every or 500, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=seed)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Ragged(512, seed=seed),
                                   data_collator=collator)
    opt = attach_to_trainer(trainer, config, ZmqLink(a.endpoint, heartbeat_s=0.2), learner_id=a.id)
    if a.meet:
        meet(a.meet, f"{a.id}.{opt.rank}", [f"{lid}.{r}" for lid in ids for r in range(opt.world_size)])
    if a.stop_at:
        trainer.add_callback(StopAt(a.stop_at))
    resumed: dict = {}
    if a.resume:
        def restored(o: RackmendOptimizer, *_: object) -> None:  # what the Trainer and rackmend restored
            if not resumed:
                resumed.update(step=o.step_count, c_time=o.c_time, c_tokens=o.c_tokens, versions=o.versions)
        opt.register_step_pre_hook(restored)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    opt.close()  # the callback closed it at the end of train(): closing again does nothing
    rank = opt.rank
    if a.held_out:
        save_held(opt, f"{a.held_out}.{rank}")
    out = a.out if opt.world_size == 1 else Path(f"{a.out}.{rank}")
    out.write_text(json.dumps({
        "log_history": trainer.state.log_history, "start_loss": start_loss, "end_loss": held_out_loss(model),
        "versions": opt.versions, "step": opt.step_count, "collated": collator.collated,
        "inner": type(opt.inner).__name__, "resumed": resumed,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
