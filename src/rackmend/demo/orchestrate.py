"""Run one arm for real: a ``rackmend syncer`` process, M learner processes, each behind
its own emulated WAN link, faults on a schedule, and the measurements collected.

What runs where:

- the syncer is ``python -m rackmend.cli syncer`` (the real service), logging every
  event to JSONL and checkpointing every few merges;
- each learner is ``python -m rackmend.demo.worker`` talking to the syncer through a
  ``LinkEmulator`` (bandwidth cap, latency, jitter) that this process hosts;
- held-out loss is measured on the *global* model: while the arm runs, the syncer's
  checkpoint is hard-linked aside every so often (no extra CPU during training) and
  every snapshot is evaluated after the arm ends, stamped with the time the syncer
  wrote it and the tokens the learners had trained on by then.

Every wait here is bounded, and every process started here is killed on the way out.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rackmend.core.fragments import layout_from_wire
from rackmend.core.records import Merged, SyncerRecord, from_record
from rackmend.core.syncer_fragment import named_global_values
from rackmend.demo.spec import ArmSpec, RunSettings, config_to_dict
from rackmend.demo.worker import GO_FILE, metrics_path
from rackmend.netem import LinkEmulator
from rackmend.service.checkpoint import CHECKPOINT_NAME, open_checkpoint
from rackmend.service.events import CheckpointWritten, read_event
from rackmend.workloads import GPT, ByteCorpus, evaluate

__all__ = ["ArmRun", "LearnerStats", "run_arm", "syncer_flags", "Progress"]

_TICK_S = 0.25
_START_TIMEOUT_S = 240.0  # importing torch in M processes at once on two cores is slow
_FINISH_GRACE_S = 75.0  # after the deadline: the last blocked round (wait_timeout 60 s), a leave, the exit
_STEPS_TIMEOUT_S = 3600.0  # a step-limited arm that takes longer than this is stuck


@dataclass
class LearnerStats:
    """One learner's measurements over the whole arm (all its lives)."""

    learner: str
    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    """Time in inner steps (data, forward, backward, inner optimizer; fail-slow sleep included)."""
    sync_s: float = 0.0
    """Time in rackmend's per-step work (snapshot, send, apply), blocked waits included."""
    blocked_s: float = 0.0
    """Time blocked waiting for the syncer (deterministic arms)."""
    lives: int = 0
    """Times the process joined (2 for a killed and restarted learner)."""
    fault: str = ""
    """The fault injected into this learner, if any."""
    step_times: list[float] = field(default_factory=list)
    """compute + sync per step, seconds."""


@dataclass
class ArmRun:
    """Everything one arm measured; ``report`` turns a list of these into files."""

    name: str
    description: str
    wall_s: float
    learners: list[LearnerStats]
    points: list[tuple[int, float, float]]
    """(tokens by all learners, seconds since start, held-out loss of the global model)."""
    steps: dict[str, list[dict[str, Any]]]
    """Each learner's per-step records (``t`` in seconds since the start)."""
    events: list[dict[str, Any]]
    """Syncer and orchestrator events, ``t`` in seconds since the start, ordered."""
    links: dict[str, dict[str, Any]]
    """Per learner link: ``bytes_up``, ``bytes_down``, ``timeline`` [(t, up, down)]."""

    @property
    def tokens(self) -> int:
        return sum(ls.tokens for ls in self.learners)

    @property
    def wan_bytes(self) -> int:
        return sum(link["bytes_up"] + link["bytes_down"] for link in self.links.values())

    def utilization(self, ls: LearnerStats) -> float:
        return ls.compute_s / self.wall_s if self.wall_s > 0 else 0.0

    def healthy(self) -> list[LearnerStats]:
        """Learners without an injected fault (all of them when none is healthy)."""
        return [ls for ls in self.learners if not ls.fault] or self.learners

    def records(self) -> list[SyncerRecord]:
        """The syncer core's records among ``events``, typed (``records.from_record``)."""
        return [r for r in map(from_record, self.events) if r is not None]

    def merges(self) -> list[Merged]:
        return [r for r in self.records() if isinstance(r, Merged)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "wall_s": self.wall_s,
            "tokens": self.tokens, "wan_bytes": self.wan_bytes, "points": self.points,
            "learners": [{k: v for k, v in vars(ls).items() if k != "step_times"} for ls in self.learners],
            "links": {k: {kk: vv for kk, vv in v.items() if kk != "timeline"} for k, v in self.links.items()},
        }


Progress = Callable[[float, dict[str, Any]], None]
"""Called about every quarter second with (seconds since start, status fields)."""


def syncer_flags(spec: ArmSpec) -> list[str]:
    """``rackmend syncer`` flags that reproduce the arm's syncer config."""
    from rackmend.service.cli import config_flags

    assert spec.config is not None
    return config_flags(spec.config)


class _Tail:
    """Reads the complete JSON lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._partial = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


class _Arm:
    """The processes, links and tails of one running arm."""

    def __init__(self, spec: ArmSpec, s: RunSettings, run_dir: Path) -> None:
        self.spec, self.s, self.dir = spec, s, run_dir
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[int, subprocess.Popen] = {}
        self.killed: list[subprocess.Popen] = []
        """Processes the fault plan SIGKILLed (their exit is expected)."""
        self.syncer: subprocess.Popen | None = None
        self.links: list[LinkEmulator] = []
        self.tails = {i: _Tail(metrics_path(run_dir, i)) for i in range(s.learners)}
        self.records: dict[int, list[dict[str, Any]]] = {i: [] for i in range(s.learners)}
        self.joined: dict[int, int] = {i: 0 for i in range(s.learners)}
        self.done: dict[int, list[dict[str, Any]]] = {i: [] for i in range(s.learners)}
        self.events: list[dict[str, Any]] = []
        self.syncer_tail = _Tail(run_dir / "syncer.jsonl")
        self.syncer_events: list[dict[str, Any]] = []
        self.ckpt = run_dir / "checkpoint"
        self.snapshots: list[Path] = []

    # ---------------------------------------------------------------- processes
    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.dir / f"{name}.out", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs.append(proc)
        return proc

    def output(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.out").read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    def start_syncer(self) -> int:
        ready = self.dir / "syncer.endpoint"
        cmd = [sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0",
               "--ready-file", str(ready), "--log", str(self.dir / "syncer.jsonl"),
               "--checkpoint-dir", str(self.ckpt), "--checkpoint-every", str(self.spec.checkpoint_every),
               "--heartbeat-timeout", str(self.s.heartbeat_timeout_s), *syncer_flags(self.spec)]
        self.syncer = self._start(cmd, "syncer")
        end = time.monotonic() + 60
        while not ready.exists():
            if self.syncer.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the syncer did not start:\n{self.output('syncer')}")
            time.sleep(0.05)
        return int(ready.read_text().rsplit(":", 1)[1])

    def start_links(self, port: int) -> list[str]:
        f = self.s.faults
        for i, lid in enumerate(self.s.learner_ids):
            factor = f.worse_link_factor if f.worse_link_learner == i else 1.0
            link = LinkEmulator(("127.0.0.1", port), self.s.link.link_config(factor, seed=self.s.seed * 100 + i),
                                name=lid, sample_interval=0.5)
            self.links.append(link.start())
        return [link.address for link in self.links]

    def start_worker(self, i: int) -> None:
        self.workers[i] = self._start([sys.executable, "-m", "rackmend.demo.worker", str(self.dir), str(i)],
                                      f"learner{i}")

    def write_run(self, endpoints: list[str]) -> None:
        run = {"settings": self.s.to_dict(), "arm": self.spec.name,
               "config": config_to_dict(self.spec.config) if self.spec.config is not None else None,
               "endpoints": endpoints}
        (self.dir / "run.json").write_text(json.dumps(run, indent=1))

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for link in self.links:
            link.close()

    # ---------------------------------------------------------------- observing
    def poll(self) -> None:
        for i, tail in self.tails.items():
            for r in tail.read():
                if r.get("event") == "joined":
                    self.joined[i] += 1
                elif r.get("event") == "done":
                    self.done[i].append(r)
                else:
                    self.records[i].append(r)
        self.syncer_events.extend(self.syncer_tail.read())

    def check_alive(self, what: str) -> None:
        for i, p in self.workers.items():
            if p.poll() not in (None, 0) and p not in self.killed:
                raise RuntimeError(f"learner{i} exited with {p.returncode} while {what}:\n{self.output(f'learner{i}')}")
        if self.syncer is not None and self.syncer.poll() is not None:
            raise RuntimeError(f"the syncer exited while {what}:\n{self.output('syncer')}")

    def snapshot(self) -> None:
        """Keep the syncer's current checkpoint aside (a hard link: the syncer replaces
        the file by rename, so the linked inode stays as it was)."""
        src = self.ckpt / CHECKPOINT_NAME
        if not src.exists():
            return
        dst = self.dir / "snapshots" / f"{len(self.snapshots):04d}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        try:
            os.link(src, dst)
        except FileNotFoundError:
            return  # replaced between the check and the link; the next tick takes one
        except OSError:
            shutil.copyfile(src, dst)  # a filesystem without hard links
        self.snapshots.append(dst)


def _stop(proc: subprocess.Popen | None, sig: int, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_arm(spec: ArmSpec, s: RunSettings, run_dir: Path, progress: Progress | None = None) -> ArmRun:
    """Train one arm to its deadline or step limit and return what it measured.
    ``run_dir`` receives the raw files (process output, JSONL, snapshots)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    arm = _Arm(spec, s, run_dir)
    try:
        endpoints = [""] * s.learners
        if spec.config is not None:
            endpoints = arm.start_links(arm.start_syncer())
        arm.write_run(endpoints)
        for i in range(s.learners):
            arm.start_worker(i)
        end = time.monotonic() + _START_TIMEOUT_S
        while min(arm.joined.values()) < 1:
            arm.poll()
            arm.check_alive("joining")
            if time.monotonic() > end:
                raise RuntimeError(f"not every learner joined within {_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        t0 = time.monotonic()
        stop_at = t0 + s.duration_s if s.duration_s is not None else None
        # Written aside and renamed: learners poll for the file and must never read it half-written.
        tmp = run_dir / (GO_FILE + ".tmp")
        tmp.write_text(json.dumps({"t0": t0, "stop_at": stop_at}))
        tmp.replace(run_dir / GO_FILE)
        _drive(arm, t0, stop_at, progress)
        wall = max([r["t"] for recs in arm.records.values() for r in recs[-1:]] + [t0]) - t0
        _stop(arm.syncer, signal.SIGTERM, 30)  # writes the final checkpoint
        arm.poll()
        if spec.config is not None:
            arm.snapshot()
        links = {link.name: link.stats() for link in arm.links}
    finally:
        arm.kill_all()
    return _collect(arm, spec, s, t0, wall, links)


def _drive(arm: _Arm, t0: float, stop_at: float | None, progress: Progress | None) -> None:
    s, f = arm.s, arm.s.faults
    D = s.duration_s or 0.0
    faulted = s.duration_s is not None
    kill_at = t0 + f.kill_at * D if faulted and f.kill_learner is not None else None
    restart_at = t0 + f.restart_at * D if kill_at is not None else None
    eval_every = (D / (s.evals + 1)) if s.duration_s else 1.0
    next_eval = t0 + eval_every
    hard_end = (stop_at + _FINISH_GRACE_S) if stop_at is not None else t0 + _STEPS_TIMEOUT_S
    slow_logged = False
    while True:
        now = time.monotonic()
        arm.poll()
        if kill_at is not None and now >= kill_at:
            kill_at = None
            proc = arm.workers[f.kill_learner]  # type: ignore[index]
            arm.killed.append(proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            arm.events.append({"event": "fault_kill", "t": now, "learner": f"learner{f.kill_learner}"})
        if restart_at is not None and kill_at is None and now >= restart_at and (stop_at is None or now < stop_at):
            restart_at = None
            arm.start_worker(f.kill_learner)  # type: ignore[arg-type]
            arm.events.append({"event": "fault_restart", "t": now, "learner": f"learner{f.kill_learner}"})
        if faulted and f.slow_learner is not None and not slow_logged:
            slow_logged = True
            arm.events.append({"event": "fault_slow", "t": t0 + f.slow_from * D, "until": t0 + f.slow_until * D,
                               "learner": f"learner{f.slow_learner}", "factor": f.slow_factor})
        if now >= next_eval:
            next_eval += eval_every
            arm.snapshot()
        arm.check_alive("training")
        if all(p.poll() is not None for p in arm.workers.values()) and restart_at is None:
            return
        if now > hard_end:
            # A learner blocked past every timeout: record it and report what was measured.
            for i, proc in arm.workers.items():
                if proc.poll() is None:
                    arm.killed.append(proc)
                    proc.kill()
                    proc.wait(10)
                    arm.events.append({"event": "stuck_killed", "t": now, "learner": f"learner{i}"})
            return
        if progress is not None:
            progress(now - t0, _status(arm, t0))
        time.sleep(_TICK_S)


def _status(arm: _Arm, t0: float) -> dict[str, Any]:
    losses = [recs[-1]["loss"] for recs in arm.records.values() if recs]
    last = next((r for r in map(from_record, reversed(arm.syncer_events[-50:])) if isinstance(r, Merged)), None)
    status: dict[str, Any] = {
        "steps": sum(len(r) for r in arm.records.values()),
        "loss": sum(losses) / len(losses) if losses else float("nan"),
    }
    if last is not None:
        status["merged"] = ",".join(m.removeprefix("learner") for m in last.merged)
    return status


def _relative(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    out = []
    for e in events:
        e = dict(e)
        for key in ("t", "until"):
            if isinstance(e.get(key), (int, float)):
                e[key] = e[key] - t0
        out.append(e)
    return sorted(out, key=lambda e: e.get("t", 0.0))


def _collect(arm: _Arm, spec: ArmSpec, s: RunSettings, t0: float, wall: float,
             links: dict[str, dict[str, Any]]) -> ArmRun:
    f = s.faults
    learners = []
    steps: dict[str, list[dict[str, Any]]] = {}
    for i, lid in enumerate(s.learner_ids):
        recs = [{**r, "t": r["t"] - t0} for r in arm.records[i]]
        steps[lid] = recs
        fault = []
        if f.kill_learner == i and s.duration_s is not None:
            fault.append("killed+restarted")
        if f.slow_learner == i and s.duration_s is not None:
            fault.append(f"fail-slow x{f.slow_factor:g}")
        if f.worse_link_learner == i and spec.config is not None:
            fault.append(f"link /{f.worse_link_factor:g}")
        learners.append(LearnerStats(
            learner=lid, steps=len(recs), tokens=sum(r["tokens"] for r in recs),
            compute_s=sum(r["compute"] for r in recs), sync_s=sum(r["sync"] for r in recs),
            blocked_s=sum(r["blocked"] for r in recs), lives=arm.joined[i], fault=", ".join(fault),
            step_times=[r["compute"] + r["sync"] for r in recs]))
    syncer_lines = _relative(arm.syncer_events, t0)
    events = syncer_lines + _relative(arm.events, t0)
    events.sort(key=lambda e: e.get("t", 0.0))
    link_stats = {}
    for name, st in links.items():
        started = next(link.started_at for link in arm.links if link.name == name)
        link_stats[name] = {"bytes_up": st["bytes_up"], "bytes_down": st["bytes_down"],
                            "timeline": [(t + started - t0, up, down) for t, up, down in st["timeline"]]}
    points = _evaluate(arm, s, t0, steps, [read_event(line) for line in syncer_lines])
    return ArmRun(name=spec.name, description=spec.description, wall_s=wall, learners=learners,
                  points=points, steps=steps, events=events, links=link_stats)


def _evaluate(arm: _Arm, s: RunSettings, t0: float, steps: dict[str, list[dict[str, Any]]],
              records: list[SyncerRecord]) -> list[tuple[int, float, float]]:
    """Held-out loss of every kept snapshot (and of the start), at the tokens trained
    on when the syncer wrote it."""
    corpus = ByteCorpus()
    batches = corpus.eval_batches(8, 16, s.model.block_size)
    torch.manual_seed(s.seed)
    model = GPT(s.model)
    points = [(0, 0.0, evaluate(model, batches))]
    # Cumulative tokens over time, all learners together.
    stamps = sorted((r["t"], r["tokens"]) for recs in steps.values() for r in recs)
    times = [t for t, _ in stamps]
    cumulative = []
    total = 0
    for _, n in stamps:
        total += n
        cumulative.append(total)

    def tokens_at(t: float) -> int:
        k = bisect.bisect_right(times, t)
        return cumulative[k - 1] if k else 0

    written = {r.versions: r.t for r in reversed(records) if isinstance(r, CheckpointWritten)}
    if arm.spec.config is None:
        finals = [Path(d["model"]) for recs in arm.done.values() for d in recs[-1:] if "model" in d]
        if finals:
            from safetensors.torch import load_file

            model.load_state_dict(load_file(str(finals[0])))
            points.append((tokens_at(float("inf")), times[-1] if times else 0.0, evaluate(model, batches)))
        return points
    seen: set[tuple[int, ...]] = set()
    for k, snap in enumerate(arm.snapshots):
        final = k == len(arm.snapshots) - 1  # taken after the syncer stopped: the end of the run
        with open_checkpoint(snap) as (meta, fh):
            versions = tuple(meta.versions)
            if not final and (versions in seen or versions not in written):
                continue
            seen.add(versions)
            state = named_global_values(fh, layout_from_wire(meta.layout))
        model.load_state_dict(state, strict=True)
        # The final global model is what all the training produced: it stands at every
        # token trained (equal-step arms then compare at exactly equal tokens).
        t = times[-1] if final and times else written.get(versions, 0.0)
        points.append((tokens_at(t), t, evaluate(model, batches)))
    for snap in arm.snapshots:
        snap.unlink(missing_ok=True)
    return sorted(points)


def temporary_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="rackmend-demo-"))
