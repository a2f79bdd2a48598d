"""One learner of ``benchmarks/chaos.py``: a tiny language model trained with the public
API (``RackmendOptimizer`` over a ``ZmqLink``) until told to stop, then a catch-up that
the benchmark compares with the syncer's final checkpoint.

Not a test helper and not a general tool: the benchmark starts, kills, stops and
restarts it. The phases, each started by a file the benchmark creates:

1. train until ``--stop-file`` exists (one status line in ``--status`` per step);
2. stand still (no steps, no sends; the link keeps heartbeating and receiving) until
   ``--final-file`` exists: by then the syncer has merged what was pending, sent it,
   and written its final checkpoint;
3. run ``sync_every + overlap + 1`` steps without gradients (the weights do not
   move), so every merged value received is applied the way training applies it;
   then save the held global values and the latest value the link delivered, per
   fragment with its (epoch, version), to ``--out``, and leave.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from rackmend import (
    CompressionConfig,
    LearnerConfig,
    RackmendConfig,
    RackmendOptimizer,
    ScheduleConfig,
    ZmqLink,
)
from rackmend.core.messages import Update

VOCAB = 32


class Tiny(nn.Module):
    """Embedding -> MLP -> logits: float32 tensors of a few kB, so a throttled link
    still carries a fragment in about a second."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(self.emb(x))))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


class TappedLink(ZmqLink):
    """A ZmqLink that notes the newest value it delivered per fragment: the learner's
    copy of the global model as the link rebuilt it (deltas, epochs), before the
    optimizer's apply rule decides when to use it."""

    def __init__(self, *args: Any, values_log: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.latest: dict[int, Update] = {}
        self._values = open(values_log, "a", buffering=1, encoding="utf-8")

    def _note(self, updates: Sequence[Update]) -> None:
        for u in updates:
            # What this learner was given under (epoch, version): the benchmark checks
            # that no two learners were given different values under the same name.
            digest = hashlib.sha1()
            for t in u.tensors:
                digest.update(t.contiguous().numpy().tobytes())
            self._values.write(json.dumps({"f": u.fragment, "e": u.epoch, "v": u.version,
                                           "h": digest.hexdigest()}) + "\n")
            held = self.latest.get(u.fragment)
            # Epochs are random: a value of another epoch is newer by arrival.
            if held is None or held.epoch != u.epoch or u.version > held.version:
                self.latest[u.fragment] = u

    def join(self, *args: Any, **kwargs: Any) -> list[Update]:
        updates = super().join(*args, **kwargs)
        self._note(updates)
        return updates

    def poll(self) -> list[Update]:
        updates = super().poll()
        self._note(updates)
        return updates


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(0, VOCAB, (4, 8), generator=g)
    return x, (x * 5 + 3) % VOCAB, x.numel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--H", type=int, default=5)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--tau", type=int, default=2)
    p.add_argument("--downlink-codec", default="none")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--status", type=Path, required=True)
    p.add_argument("--stop-file", type=Path, required=True)
    p.add_argument("--final-file", type=Path, required=True)
    p.add_argument("--final-timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--values-log", type=Path, required=True,
                   help="JSONL: fragment, epoch, version and SHA-1 of every value the link delivered")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the seeder's initial values; later joins load the syncer's
    model = Tiny()
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=a.H, num_fragments=a.P, overlap=a.tau),
        learner=LearnerConfig(join_timeout=a.join_timeout, wait_timeout=a.join_timeout),
        compression=CompressionConfig(downlink=a.downlink_codec),
    )
    link = TappedLink(a.endpoint, heartbeat_s=0.2, values_log=a.values_log)
    opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, link, learner_id=a.id)
    seed = sum(map(ord, a.id)) * 7919 + int(time.time_ns() % 1_000_003)  # a restart trains on other batches

    def status(phase: str, step: int) -> None:
        tmp = a.status.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "step": step, "versions": opt.versions, "epochs": opt.epochs}))
        tmp.replace(a.status)

    step = 0
    while not a.stop_file.exists():
        step += 1
        x, y, tokens = batch(seed, step)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=tokens)
        status("train", step)
        time.sleep(a.step_sleep)
    status("quiet", step)
    end = time.monotonic() + a.final_timeout
    while not a.final_file.exists():
        if time.monotonic() > end:
            print(f"{a.id}: no {a.final_file} within {a.final_timeout}s", file=sys.stderr, flush=True)
            return 3
        time.sleep(0.05)
    opt.zero_grad()  # no gradients: AdamW leaves every weight as it is
    for _ in range(a.H + a.tau + 1):
        step += 1
        opt.step(tokens=1)
        time.sleep(0.02)
    tensors = {f"held/{f}/{i}": t.contiguous().clone() for f, ts in enumerate(opt.held) for i, t in enumerate(ts)}
    for f, u in link.latest.items():
        tensors.update({f"latest/{f}/{i}": t.contiguous().clone() for i, t in enumerate(u.tensors)})
    meta = {
        "learner": a.id, "steps": step,
        "held_versions": list(opt.versions), "held_epochs": list(opt.epochs),
        "latest_versions": [link.latest[f].version if f in link.latest else -1 for f in range(len(opt.held))],
        "latest_epochs": [link.latest[f].epoch if f in link.latest else -1 for f in range(len(opt.held))],
    }
    save_file(tensors, str(a.out), metadata={"chaos": json.dumps(meta)})
    status("done", step)
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
