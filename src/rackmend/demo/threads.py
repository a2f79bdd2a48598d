"""The in-process variant of the demo: M learner threads of one process train the
byte-level GPT, rackmend next to a data-parallel-equivalent arm, joined by the
in-process transport (nothing crosses a network).

Used by the training test (``tests/test_training.py``) and by
``benchmarks/anchoring.py``; ``rackmend demo`` runs the multi-process version
(``rackmend.demo.orchestrate``). Both arms use the same model initialisation, data
streams, inner optimizer and step count; they differ only in how learners synchronise:

- ``data-parallel``: every step, blocking, all learners, plain averaging
  (H=1, P=1, tau=0, outer SGD lr=1 without momentum: Theta <- mean theta_m).
- ``rackmend``: P fragments every H steps, tau-step overlap, quorum K=1,
  adaptive grace, tokens^2/steps weights, the default outer step (SGD lr 1).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from rackmend.config import LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.core.records import Guarded, Merged
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.inprocess import InProcessSyncer
from rackmend.workloads import GPT, ByteCorpus, GPTConfig, evaluate

__all__ = ["DemoSettings", "ArmResult", "arm_configs", "train_arm"]


@dataclass(kw_only=True)
class DemoSettings:
    """What the demo trains and for how long."""

    learners: int = 4
    """M: number of learners."""
    steps: int = 240
    """Inner steps per learner."""
    batch_size: int = 8
    """Sequences per learner step."""
    seed: int = 0
    """Seed of the model initialisation and of the data streams."""
    sync_every: int = 16
    """H of the rackmend arm."""
    fragments: int = 4
    """P of the rackmend arm."""
    overlap: int = 2
    """tau of the rackmend arm."""
    evals: int = 4
    """Held-out evaluations during the run (plus one at the start and one at the end)."""
    model: GPTConfig = field(default_factory=GPTConfig)
    """Shape of the GPT."""
    step_delay: Callable[[int, int], float] | None = None
    """Seconds learner ``idx`` sleeps after its step ``t`` (``step_delay(idx, t)``), to
    emulate slow or jittery racks (benchmarks/quality.py). None: no sleep."""

    def __post_init__(self) -> None:
        for name in ("learners", "steps", "batch_size", "evals"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ArmResult:
    """What one arm measured."""

    name: str
    points: list[tuple[int, float, float]]
    """(tokens trained by all learners, wall seconds, held-out loss of the global model)."""
    wall_s: float
    compute_s: dict[str, float]
    blocked_s: dict[str, float]
    bytes_up: int
    merges: int
    guard_events: int = 0
    """Contributions the syncer's norm guard clipped (honest training should have none)."""

    @property
    def utilization(self) -> float:
        """Mean over learners of time in inner steps / wall time."""
        return sum(self.compute_s.values()) / (len(self.compute_s) * self.wall_s)


def arm_configs(s: DemoSettings) -> dict[str, RackmendConfig]:
    ids = tuple(f"learner{i}" for i in range(s.learners))
    return {
        "data-parallel": RackmendConfig(
            schedule=ScheduleConfig(sync_every=1, num_fragments=1, overlap=0),
            syncer=SyncerConfig(min_quorum=s.learners, learners=ids, weighting="uniform",
                                outer_lr=1.0, outer_kwargs={}),
            deterministic=True,
        ),
        "rackmend": RackmendConfig(
            schedule=ScheduleConfig(sync_every=s.sync_every, num_fragments=s.fragments, overlap=s.overlap),
            syncer=SyncerConfig(min_quorum=1, learners=ids),
            learner=LearnerConfig(apply="overwrite"),
        ),
    }


def train_arm(name: str, config: RackmendConfig, s: DemoSettings, corpus: ByteCorpus,
              progress: tqdm | None = None) -> ArmResult:
    """Run M learner threads against an in-process syncer and measure."""
    torch.manual_seed(s.seed)
    init = GPT(s.model)
    hub = InProcessSyncer.for_model(config, init)
    eval_model = GPT(s.model)
    eval_batches = corpus.eval_batches(8, 16, s.model.block_size)
    tokens_per_step = s.batch_size * s.model.block_size
    eval_at = {max(1, round(s.steps * (i + 1) / (s.evals + 1))) for i in range(s.evals)}
    ids = [f"learner{i}" for i in range(s.learners)]
    compute = {lid: 0.0 for lid in ids}
    blocked = {lid: 0.0 for lid in ids}
    sent = {lid: 0 for lid in ids}
    done_steps = {lid: 0 for lid in ids}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def global_loss() -> float:
        eval_model.load_state_dict(hub.core.global_parameters(), strict=False)
        return evaluate(eval_model, eval_batches)

    t_start = time.perf_counter()
    points = [(0, 0.0, global_loss())]

    def learner(idx: int, lid: str) -> None:
        try:
            model = GPT(s.model)
            inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
            opt = RackmendOptimizer(model, inner, config, hub.connect(), learner_id=lid, fragments=hub.core.fragments)
            g = torch.Generator().manual_seed(s.seed * 1000 + idx)
            for t in range(1, s.steps + 1):
                x, y = corpus.batch(g, s.batch_size, s.model.block_size)
                t0, b0 = time.perf_counter(), opt.blocked_seconds
                loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step(tokens=tokens_per_step)
                compute[lid] += time.perf_counter() - t0 - (opt.blocked_seconds - b0)
                if s.step_delay is not None:
                    time.sleep(s.step_delay(idx, t))
                with lock:
                    done_steps[lid] = t
                    if progress is not None:
                        progress.update(1)
                        if idx == 0:
                            progress.set_postfix(arm=name, loss=f"{float(loss.detach()):.3f}", refresh=False)
                if idx == 0 and t in eval_at:
                    tokens = sum(done_steps.values()) * tokens_per_step
                    points.append((tokens, time.perf_counter() - t_start, global_loss()))
            opt.close()  # first: the sends still queued count in bytes_sent
            blocked[lid] = opt.blocked_seconds
            sent[lid] = opt.bytes_sent
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(i, lid), name=lid) for i, lid in enumerate(ids)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t_start
    hub.close()
    if errors:
        raise errors[0]
    points.append((s.learners * s.steps * tokens_per_step, wall, global_loss()))
    return ArmResult(name, points, wall, compute, blocked, sum(sent.values()),
                     sum(isinstance(r, Merged) for r in hub.records), sum(isinstance(r, Guarded) for r in hub.records))
