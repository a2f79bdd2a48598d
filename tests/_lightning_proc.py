"""A rack that trains with PyTorch Lightning through ``RackmendCallback`` (test helper).

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_lightning_proc.py \\
    --endpoint tcp://127.0.0.1:PORT --id l0 --learners l0,l1 --strategy ddp --out DIR

Each rank runs two fits in one process, with one ``RackmendCallback``: fit A trains
``--steps-a`` optimizer steps (2 micro-batches each) and Lightning's ``ModelCheckpoint``
saves at step ``--ckpt-at``; once every learner of ``--learners`` has finished fit A
(a file barrier in ``DIR``, so that no round mixes one rack's fit A with another's fit
B), fit B resumes from that checkpoint and trains to ``--steps-b``; fit C resumes from it
once more with ``RackmendCallback(restore=False)`` for one step. ``--strategy``:
``ddp`` or ``fsdp`` (``ModelParallelStrategy`` with FSDP2's ``fully_shard`` in
``configure_model``). Batches are sequences of varying length padded per batch; the
collator puts each batch's real token count (the items' lengths, not the mask) in it.

Writes, per rank r, into DIR: ``<id>.tokens.<r>.json`` (per fit, the real tokens of
each micro-batch trained), ``<id>.saved.<r>.safetensors`` and ``.json`` (at the save:
this rank's held values, model values and counters), ``<id>.resumed.<r>.safetensors``
and ``.json`` (the same after fit B restored them), ``<id>.held.<r>`` (``save_held``
at the end of fit B), ``<id>.rejoined.<r>.safetensors`` and ``.json`` (when fit C starts
training).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from rackstate import save_held  # noqa: E402

from rackmend import LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig, ZmqLink  # noqa: E402
from rackmend.core.fragments import fragment_tensors  # noqa: E402
from rackmend.learner.lightning import RackmendCallback  # noqa: E402

VOCAB, SEQ, BATCH = 17, 12, 4


class Ragged(Dataset):
    """Progressions t_i = (a + b*i) mod VOCAB of lengths 3..SEQ."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(0, VOCAB, (n, 1), generator=g)
        b = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (a + b * torch.arange(SEQ)) % VOCAB
        self.lengths = torch.randint(3, SEQ + 1, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i][: self.lengths[i]]


def pad(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded ids and attention mask; ``real``: the tokens counted from the items'
    lengths, independently of the mask rackmend's default counter reads."""
    width = max(len(it) for it in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, it in enumerate(items):
        ids[row, : len(it)] = it
        mask[row, : len(it)] = 1
    return {"input_ids": ids, "attention_mask": mask, "real": torch.tensor(sum(len(it) for it in items))}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)])
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](torch.tanh(self.blocks[0](self.emb(ids)))))


class RaggedLM(pl.LightningModule):
    """An ordinary LightningModule: a plain AdamW and an LR schedule, nothing of rackmend."""

    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.fsdp = fsdp

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.net(ids[:, :-1])
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)

    def configure_optimizers(self) -> dict:
        inner = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": inner, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.97**s)}


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class Probe(pl.Callback):
    """Test scaffolding: records what the rank trained on and its rackmend state at the
    save and after the resume, for the test to compare."""

    def __init__(self, rack: RackmendCallback, out: Path, lid: str, fit: str, learners: list[str]) -> None:
        self.rack, self.out, self.lid, self.fit, self.learners = rack, out, lid, fit, learners
        self.rank = int(os.environ.get("RANK", "0"))  # torchrun's: the process group comes later
        self.tokens: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: dict, i: int) -> None:
        self.tokens.append(int(batch["real"]))

    def _record(self, what: str) -> None:
        opt = self.rack.optimizer
        assert opt is not None
        tensors = {}
        for p, ts in enumerate(fragment_tensors(opt.model, opt.fragments)):
            for i, t in enumerate(ts):
                tensors[f"model/{p}/{i}"] = local(t)
                tensors[f"held/{p}/{i}"] = opt.held[p][i].clone()
        save_file(tensors, str(self.out / f"{self.lid}.{what}.{self.rank}.safetensors"))
        (self.out / f"{self.lid}.{what}.{self.rank}.json").write_text(json.dumps({
            "step": opt.step_count, "versions": opt.versions, "c_steps": opt.c_steps, "c_tokens": opt.c_tokens,
            "c_time": opt.c_time}))

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict) -> None:
        if self.fit == "a":
            self._record("saved")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.fit == "b":  # the callback restored rackmend's state by now
            self._record("resumed")
        elif self.fit == "c":  # restore=False: the rack joined after Lightning restored the model
            self._record("rejoined")
        if self.fit != "a":
            # Deterministic rounds expect the learners that have joined: a rack that left
            # fit A and is not back yet is not waited for, and a round that the other rack
            # merged alone meanwhile would leave the two out of step for good. Every rank
            # of every rack has joined (the callback ran first) before any step of this fit.
            barrier(self.out, self.learners, self.lid, self.rank, f"fit-{self.fit}-joined")

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        path = self.out / f"{self.lid}.tokens.{self.rank}.json"
        done = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**done, self.fit: self.tokens}))


def trainer(a: argparse.Namespace, rack: RackmendCallback, fit: str, steps: int, save: bool = True) -> pl.Trainer:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if a.strategy == "fsdp" \
        else DDPStrategy(process_group_backend="gloo")
    ckpt = ModelCheckpoint(dirpath=a.out / f"ckpt-{a.id}", filename="{step}", every_n_train_steps=a.ckpt_at,
                           save_top_k=-1)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=2,
                      callbacks=[rack, Probe(rack, a.out, a.id, fit, a.learners.split(",")), *([ckpt] if save else [])],
                      logger=False,
                      enable_checkpointing=save,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def barrier(out: Path, learners: list[str], lid: str, rank: int, what: str = "fit-a") -> None:
    """Wait (bounded) until every rank of every learner has reached ``what`` (default:
    finished fit A)."""
    (out / f"{lid}.{what}.{rank}").touch()
    end = time.monotonic() + 120
    while not all((out / f"{other}.{what}.{r}").exists() for other in learners for r in range(2)):
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for the other racks' ranks to reach {what}")
        time.sleep(0.05)


def misuse(endpoint: str) -> int:
    """Each way of setting a rack up wrong, and one right, in one process with one
    device; prints one JSON line per case: the exception's type and message, if any."""
    from lightning.pytorch.strategies import FSDPStrategy

    from rackmend import RackmendOptimizer

    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2), syncer=SyncerConfig(min_quorum=1))

    class Built(RaggedLM):  # builds the RackmendOptimizer itself, as the first try did
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return RackmendOptimizer(self, torch.optim.AdamW(self.parameters()), config, ZmqLink(endpoint),
                                     learner_id="built")

    class Two(RaggedLM):  # Lightning takes several optimizers under manual optimization only
        def __init__(self, fsdp: bool) -> None:
            super().__init__(fsdp)
            self.automatic_optimization = False

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.AdamW(self.net.emb.parameters()), torch.optim.AdamW(self.net.head.parameters())]

    class Tuples(RaggedLM):  # (input, target) batches: nothing the default counter can read
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return super().training_step({"input_ids": batch[0], "attention_mask": torch.ones_like(batch[0])}, 0)

    class CpuFSDP(FSDPStrategy):
        """Test scaffolding: Lightning refuses FSDPStrategy on the CPU when the strategy's
        type is FSDPStrategy itself; a subclass gets as far as RackmendCallback."""

    ids = torch.randint(0, VOCAB, (16, SEQ))
    padded = DataLoader(Ragged(16, 0), batch_size=BATCH, collate_fn=pad)
    tuples = DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=BATCH)
    cases = [("single_device", RaggedLM(False), padded, "auto", "single"),  # set up right: trains, merges, leaves
             ("returned_rackmend", Built(False), padded, "auto", "built"),
             ("two_optimizers", Two(False), padded, "auto", "two"),
             ("tuple_batches", Tuples(False), tuples, "auto", "tuples"),
             ("fsdp1", RaggedLM(False), padded, CpuFSDP(), "fsdp1")]  # last: it starts a process group
    try:  # a checkpoint of a rack of 2 ranks, resumed by one: Lightning would call this with it
        RackmendCallback(config, endpoint, learner_id="resized").load_state_dict(
            {"world_size": 2, "ranks": ["{}", "{}"], "tensors": {}})
        print(json.dumps({"case": "resized", "error": None}), flush=True)
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"case": "resized", "error": type(exc).__name__, "message": str(exc)}), flush=True)
    for case, module, data, strategy, lid in cases:
        rack = RackmendCallback(config, endpoint, learner_id=lid)
        run = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, callbacks=[rack],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
        try:
            run.fit(module, data)
            print(json.dumps({"case": case, "error": None}), flush=True)
        except Exception as exc:  # noqa: BLE001 - the test reads what each case raised
            print(json.dumps({"case": case, "error": type(exc).__name__, "message": str(exc)}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--misuse", action="store_true", help="run the misuse cases (one process, no torchrun)")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id")
    p.add_argument("--learners")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps-a", type=int, default=8)
    p.add_argument("--ckpt-at", type=int, default=6)
    p.add_argument("--steps-b", type=int, default=12)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.misuse:
        return misuse(a.endpoint)
    ids = tuple(a.learners.split(","))
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
        syncer=SyncerConfig(min_quorum=len(ids), learners=ids),
        learner=LearnerConfig(wait_timeout=60),
        deterministic=True,
    )
    rack = RackmendCallback(config, lambda: ZmqLink(a.endpoint, heartbeat_s=0.2), learner_id=a.id)
    seed = int(a.id.lstrip("l"))
    data = DataLoader(Ragged(512, seed), batch_size=BATCH, collate_fn=pad, shuffle=False)

    pl.seed_everything(seed, verbose=False)
    trainer(a, rack, "a", a.steps_a).fit(RaggedLM(a.strategy == "fsdp"), data)
    rank = torch.distributed.get_rank()
    barrier(a.out, list(ids), a.id, rank)
    ckpt = sorted((a.out / f"ckpt-{a.id}").glob("*.ckpt"))
    assert len(ckpt) == 1, ckpt
    trainer(a, rack, "b", a.steps_b).fit(RaggedLM(a.strategy == "fsdp"), data, ckpt_path=str(ckpt[0]))
    assert rack.optimizer is not None
    save_held(rack.optimizer, a.out / f"{a.id}.held.{rank}")
    # Fit C, one step: the same checkpoint without rackmend's state (restore=False).
    again = RackmendCallback(config, lambda: ZmqLink(a.endpoint, heartbeat_s=0.2), learner_id=a.id, restore=False)
    trainer(a, again, "c", a.ckpt_at + 1, save=False).fit(RaggedLM(a.strategy == "fsdp"), data,
                                                          ckpt_path=str(ckpt[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
