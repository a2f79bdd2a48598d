"""The in-process variant of the demo: M learner threads of one process train the
byte-level GPT through the in-process transport (nothing crosses a network).

Used by the training test (``tests/test_training.py``) and by ``benchmarks/anchoring.py``
and ``benchmarks/quality.py``; ``rackmend demo`` runs the multi-process version
(``rackmend.demo.orchestrate``). The run is described by the demo's own
``RunSettings`` (``thread_settings`` fills in what threads do not have: a step count
instead of a deadline, no faults), the arms by its ``arm_specs``, and each learner
runs the process worker's loop (``rackmend.demo.worker.train_steps``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tqdm import tqdm

from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.records import Guarded, Merged
from rackmend.demo.spec import FaultPlan, RunSettings
from rackmend.demo.worker import StepDone, train_steps
from rackmend.learner.optimizer import RackmendOptimizer
from rackmend.transport.inprocess import InProcessSyncer
from rackmend.workloads import GPT, ByteCorpus, evaluate

__all__ = ["ArmResult", "thread_settings", "train_arm"]


def thread_settings(*, steps: int, **fields: Any) -> RunSettings:
    """``RunSettings`` of a thread run: ``steps`` inner steps per learner, no deadline
    and no faults (a thread cannot be killed); ``fields`` as in ``RunSettings``."""
    return RunSettings(duration_s=None, max_steps=steps, faults=FaultPlan.none(), **fields)


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


def train_arm(name: str, config: RackmendConfig, s: RunSettings, corpus: ByteCorpus,
              progress: tqdm | None = None, step_delay: Callable[[int, int], float] | None = None) -> ArmResult:
    """Run M learner threads against an in-process syncer for ``s.max_steps`` steps
    each and measure. ``step_delay(idx, t)``: seconds learner ``idx`` sleeps after its
    step ``t``, counted as compute, to emulate slow or jittery racks
    (benchmarks/quality.py); None: no sleep."""
    if s.max_steps is None or s.duration_s is not None or s.faults != FaultPlan.none():
        raise ConfigError("a thread run stops by max_steps only and has no faults: build its settings "
                          "with thread_settings()")
    steps = s.max_steps
    torch.manual_seed(s.seed)
    init = GPT(s.model)
    hub = InProcessSyncer.for_model(config, init)
    eval_model = GPT(s.model)
    eval_batches = corpus.eval_batches(8, 16, s.model.block_size)
    tokens_per_step = s.batch_size * s.model.block_size
    eval_at = {max(1, round(steps * (i + 1) / (s.evals + 1))) for i in range(s.evals)}
    ids = s.learner_ids
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
        def after(d: StepDone) -> None:
            compute[lid] += d.compute
            with lock:
                done_steps[lid] = d.step
                if progress is not None:
                    progress.update(1)
                    if idx == 0:
                        progress.set_postfix(arm=name, loss=f"{d.loss:.3f}", refresh=False)
            if idx == 0 and d.step in eval_at:
                tokens = sum(done_steps.values()) * tokens_per_step
                points.append((tokens, time.perf_counter() - t_start, global_loss()))

        try:
            model = GPT(s.model)
            inner = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
            opt = RackmendOptimizer(model, inner, config, hub.connect(), learner_id=lid, fragments=hub.core.fragments)
            g = torch.Generator().manual_seed(s.seed * 1000 + idx)
            delay = None if step_delay is None else (lambda t: step_delay(idx, t))
            train_steps(model, inner, opt, lambda: corpus.batch(g, s.batch_size, s.model.block_size),
                        tokens_per_step, max_steps=steps, min_step_s=s.min_step_s, delay=delay,
                        schedule=s.scheduler(inner), on_step=after)
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
    points.append((s.learners * steps * tokens_per_step, wall, global_loss()))
    return ArmResult(name, points, wall, compute, blocked, sum(sent.values()),
                     sum(isinstance(r, Merged) for r in hub.records), sum(isinstance(r, Guarded) for r in hub.records))
