"""One learner process of a demo or benchmark arm (started by ``orchestrate``).

``python -m rackmend.demo.worker RUN_JSON INDEX`` trains the byte-level GPT as learner
INDEX: through a ``ZmqLink`` and ``RackmendOptimizer`` for the rackmend-driven arms,
or with plain PyTorch for the ``local`` arm. It writes one JSON line per step to its
metrics file (compute time, time spent in rackmend, blocked time, loss, tokens), waits
for the orchestrator's go file before the first step so every learner starts together,
and stops at the run's deadline or step limit. A restarted learner (same index) joins
again and appends to the same file.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

import torch

from rackmend.demo.spec import RunSettings, config_from_dict

if TYPE_CHECKING:
    from rackmend.learner.optimizer import RackmendOptimizer

__all__ = ["main", "metrics_path", "train_steps", "StepDone", "GO_FILE"]

GO_FILE = "go.json"
_GO_TIMEOUT_S = 300.0  # the orchestrator writes the go file once all learners joined
_FLUSH_S = 0.5


def metrics_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"learner{index}.jsonl"


class _Metrics:
    def __init__(self, path: Path) -> None:
        self._f: TextIO = open(path, "a", encoding="utf-8")
        self._last_flush = time.monotonic()

    def write(self, record: dict[str, Any], flush: bool = False) -> None:
        self._f.write(json.dumps(record) + "\n")
        if flush or time.monotonic() - self._last_flush > _FLUSH_S:
            self._f.flush()
            self._last_flush = time.monotonic()

    def close(self) -> None:
        self._f.close()


def _wait_for_go(run_dir: Path) -> dict[str, Any]:
    path = run_dir / GO_FILE
    end = time.monotonic() + _GO_TIMEOUT_S
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no go file {path} within {_GO_TIMEOUT_S:.0f}s: did the orchestrator die?")


def _lives(path: Path) -> int:
    """How many times this learner joined before (a restart continues a fresh data stream)."""
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"event": "joined"' in line)


@dataclass(frozen=True)
class StepDone:
    """What one step of ``train_steps`` measured."""

    step: int
    """Steps made so far, this one included."""
    loss: float
    """Training loss of the step's batch."""
    compute: float
    """Seconds of the inner step, pacing and emulated slowness included (the rack's compute)."""
    sync: float
    """Seconds spent in rackmend after the inner step."""
    blocked: float
    """Of ``sync``, seconds waiting on the syncer."""
    slow: bool
    """Whether the step fell in the fail-slow window."""


def train_steps(model: torch.nn.Module, inner: torch.optim.Optimizer, opt: RackmendOptimizer | None,
                batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], tokens: int, *,
                max_steps: int | None, stop_at: float | None = None, min_step_s: float = 0.0,
                slow: tuple[float, float, float] | None = None, delay: Callable[[int], float] | None = None,
                schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
                on_step: Callable[[StepDone], None] | None = None) -> int:
    """A learner's training loop, shared by the process worker and the thread runner
    (``rackmend.demo.threads``): inner step, pacing, rackmend's bookkeeping (none when
    ``opt`` is None). Stops after ``max_steps`` or at ``stop_at`` (``time.monotonic``);
    one of them must be set. Each step lasts at least ``min_step_s``; inside the
    ``slow`` window ``(from, until, factor)`` it takes ``factor`` times its compute;
    ``delay(step)`` seconds more are slept after it; ``schedule`` steps after each inner
    step. Returns the steps made."""
    if max_steps is None and stop_at is None:
        raise ValueError("give max_steps or stop_at: otherwise the loop never ends")
    step = 0
    while (stop_at is None or time.monotonic() < stop_at) and (max_steps is None or step < max_steps):
        a = time.perf_counter()
        x, y = batch()
        loss = model(x, y)
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()
        if schedule is not None:
            schedule.step()
        b = time.perf_counter()
        if b - a < min_step_s:
            time.sleep(min_step_s - (b - a))
            b = time.perf_counter()
        is_slow = slow is not None and slow[0] <= time.monotonic() < slow[1]
        if slow is not None and is_slow:
            time.sleep((slow[2] - 1) * (b - a))  # the rack computes, only slower
            b = time.perf_counter()
        if delay is not None:
            time.sleep(delay(step + 1))
            b = time.perf_counter()
        blocked = 0.0
        if opt is not None:
            before = opt.blocked_seconds
            opt.after_inner_step(tokens)
            blocked = opt.blocked_seconds - before
        c = time.perf_counter()
        step += 1
        if on_step is not None:
            on_step(StepDone(step=step, loss=float(loss.detach()), compute=b - a, sync=c - b, blocked=blocked,
                             slow=is_slow))
    return step


def run(run_dir: Path, index: int) -> int:
    from rackmend.learner.optimizer import RackmendOptimizer
    from rackmend.transport.zmq_link import ZmqLink
    from rackmend.workloads import GPT, ByteCorpus

    spec = json.loads((run_dir / "run.json").read_text())
    s = RunSettings.from_dict(spec["settings"])
    config = config_from_dict(spec["config"]) if spec["config"] is not None else None
    lid = s.learner_ids[index]
    torch.set_num_threads(1)  # M learners share the machine's cores, as racks would not
    path = metrics_path(run_dir, index)
    life = _lives(path)
    metrics = _Metrics(path)
    corpus = ByteCorpus()
    torch.manual_seed(s.seed)
    model = GPT(s.model)
    inner = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    link = opt = None
    if config is not None:
        link = ZmqLink(spec["endpoints"][index], heartbeat_s=0.5)
        opt = RackmendOptimizer(model, inner, config, link, learner_id=lid)
    metrics.write({"event": "joined", "t": time.monotonic(), "life": life}, flush=True)
    go = _wait_for_go(run_dir)
    t0, stop_at = go["t0"], go["stop_at"]
    slow = None
    f = s.faults
    if f.slow_learner == index and s.duration_s is not None:
        slow = (t0 + f.slow_from * s.duration_s, t0 + f.slow_until * s.duration_s, f.slow_factor)
    g = torch.Generator().manual_seed(s.seed * 1000 + index + 7919 * life)
    tokens = s.batch_size * s.model.block_size

    def write(d: StepDone) -> None:
        metrics.write({"t": time.monotonic(), "step": d.step, "loss": round(d.loss, 5), "compute": d.compute,
                       "sync": d.sync, "blocked": d.blocked, "tokens": tokens, "slow": d.slow})

    try:
        step = train_steps(model, inner, opt, lambda: corpus.batch(g, s.batch_size, s.model.block_size), tokens,
                           max_steps=s.max_steps, stop_at=stop_at, min_step_s=s.min_step_s, slow=slow,
                           schedule=s.scheduler(inner), on_step=write)
    finally:
        if opt is not None:
            opt.close()
    done: dict[str, Any] = {"event": "done", "t": time.monotonic(), "steps": step}
    if link is not None:
        done.update(bytes_sent=link.bytes_sent, bytes_received=link.bytes_received,
                    dropped_sends=link.dropped_sends, superseded_sends=link.superseded_sends)
    if config is None:
        from safetensors.torch import save_file

        final = run_dir / f"local{index}.safetensors"
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(final))
        done["model"] = str(final)
    metrics.write(done, flush=True)
    metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m rackmend.demo.worker RUN_DIR INDEX", file=sys.stderr)
        return 2
    return run(Path(argv[0]), int(argv[1]))


if __name__ == "__main__":
    sys.exit(main())
