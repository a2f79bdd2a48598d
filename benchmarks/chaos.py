"""Chaos run: a seeded random fault schedule against real processes on 127.0.0.1.

Runbook: ``python benchmarks/chaos.py --quick`` (about 3 minutes; without ``--quick``
about 10), ``--seed N`` for another schedule. Not part of the test suite (too long).

Processes, all started here and all killed here (also on an exception or Ctrl-C): one
``rackmend syncer`` (``--checkpoint-dir``, ``--log`` JSONL), three learners
(``benchmarks/_chaos_learner.py``: the public API, ``RackmendOptimizer`` over a
``ZmqLink``), each behind its own ``rackmend link`` proxy. Faults, drawn from
``random.Random(seed)`` before the run:

- ``learner_kill``: SIGKILL a learner, start it again a moment later (same id);
- ``learner_stop``: SIGSTOP a learner for 2-12 s, then SIGCONT (past the syncer's
  10 s heartbeat timeout it is declared silent and must rejoin);
- ``syncer_kill``: SIGKILL the syncer, start it again with ``--resume`` on the same
  port (a checkpoint write may be cut short);
- ``link_drop`` / ``link_stall`` / ``bandwidth_drop``: a ``drop``, ``blackhole`` or
  ``throttle=RATE`` outage of a learner's link (scheduled in the ``rackmend link``
  process at its start, so link faults happen at their drawn times without a control
  channel).

Checked while it runs (from the syncer's event log, read as it grows as typed records:
a complete line that is no record of this version is itself a violation) and at the end:

- versions monotonic per epoch: every ``merge`` of a fragment is the previous
  version + 1 within a syncer epoch (the ``listening`` event names it), starting from
  the ``resumed`` event's versions after a restart, and each ``checkpoint`` event
  names the versions merged so far;
- nothing merged is lost beyond the last checkpoint: a resumed version lies between
  the last logged checkpoint's version and the last merged one (merges after the
  checkpoint are lost by design and counted; epochs keep their numbers from naming
  two values); the final checkpoint holds the last merged versions; every ``reject``
  and ``merge_dropped`` has a reason;
- no (fragment, epoch, version) names two values: each learner logs a SHA-1 of every
  value its link delivered, and all learners' logs together must hold one hash per name;
- every learner's copy equals the syncer's after catch-up: after the faults stop and
  every learner merged again, the learners stand still, the syncer is stopped with
  SIGTERM (final checkpoint), the learners apply what they received; each learner's
  held values and the latest value its link rebuilt must have the final epoch and
  versions and be bit-equal to the checkpoint's ``theta/{p}/{i}``;
- no round waits past its bound: with ``min_quorum`` 1 a round closes at most
  ``grace_max`` after its first fresh contribution; a merge's ``wait_s`` may exceed
  that by ``WAIT_SLACK_S`` (the loop's tick and a descheduled process on a busy
  machine), no more;
- no leaked processes or fds: the syncer's and each link's open fds (``/proc/PID/fd``)
  sampled every second; with all learners connected after the run the count is the
  one before the faults (``FD_SLACK`` allowed); at the end no child of this process is
  left and every one was reaped.

Reported: faults injected and survived by kind (survived: the target learner, or for
the syncer every live learner, merged again afterwards; recovery time = from the
fault's end to that merge), the longest gap between merges while at least one learner
ran (``max_stall_s``), the norm guard's events (right after a learner restart, right
after an outage, or otherwise), catch-up after each syncer restart (from its ``listening`` event
to the first merge holding each learner that no fault touched meanwhile). Writes
``benchmarks/results/chaos.json``; the working folder (logs, checkpoint, learners'
outputs) is kept and printed. The last line: ``RESULT faults=... survived=...
max_stall_s=... catchup_s_median=... violations=0``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from _common import finish, parser
from rackmend.core.fragments import layout_from_wire
from rackmend.core.records import Dropped, Guarded, Merged, Rejected, SyncerRecord
from rackmend.core.syncer_fragment import global_values
from rackmend.service.checkpoint import load_checkpoint
from rackmend.service.events import CheckpointWritten, Listening, Resumed, read_event

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PY = sys.executable
N_LEARNERS = 3
IDS = [f"l{i}" for i in range(N_LEARNERS)]
H, P, TAU = 5, 2, 2
GRACE_MAX = 2.0
"""The syncer's --grace-max (its default)."""
WAIT_SLACK_S = 1.0
"""What a merge's wait_s may exceed grace_max by: the syncer's loop ticks every 0.1 s at
most, and on a machine shared with other jobs a process is sometimes not scheduled for
a few hundred ms (a checkpoint's fsync runs inside the loop too)."""
HEARTBEAT_TIMEOUT = 10.0
CHECKPOINT_EVERY = 10
GUARD_AFTER_START_S = 30.0
"""A norm-guard event this soon after its learner's process started counts as "after a
restart" (fresh AdamW state), reported apart from any other."""
GUARD_AFTER_OUTAGE_S = 15.0
"""... and this soon after a fault on its learner, its link or the syncer ended, as
"after an outage" (its first send then holds all the steps made meanwhile)."""
FD_SLACK = 2
"""Open fds a process may hold above its count before the faults, once the same
learners are connected again (a socket of a connection being torn down)."""
START_TIMEOUT = 60.0
"""Bound on a process start (python + torch import on a busy machine)."""
KINDS = ("learner_kill", "learner_stop", "syncer_kill", "link_drop", "link_stall", "bandwidth_drop")
WEIGHTS = (3, 3, 3, 2, 2, 2)
RATES = (16e3, 64e3, 256e3)
"""bandwidth_drop caps (bit/s): a fragment of the model (4 kB) takes 2 s, 0.5 s, 0.13 s."""


class Abort(RuntimeError):
    """The run cannot go on (a process would not start); reported, everything killed."""


@dataclass
class Fault:
    kind: str
    target: str
    """``syncer`` or a learner id (its link for the link kinds)."""
    at: float
    """Seconds after the fault phase began (as drawn)."""
    duration: float
    rate_bps: float | None = None
    start: float = 0.0
    """time.monotonic() it began (link faults: when its link scheduled it)."""
    end: float = 0.0
    recovered_at: float | None = None
    skipped: str | None = None


def draw_schedule(rng: random.Random, phase_s: float) -> list[Fault]:
    """Faults over ``phase_s`` seconds; a target is not hit again until it had time to
    come back (a restart imports torch: seconds), but different targets overlap."""
    busy: dict[str, float] = {}
    faults: list[Fault] = []
    t = rng.uniform(2.0, 5.0)
    while t < phase_s - 4.0:
        kind = rng.choices(KINDS, WEIGHTS)[0]
        if kind == "syncer_kill":
            key, target, dur, cool = "syncer", "syncer", rng.uniform(0.3, 2.0), 10.0
        else:
            prefix = "learner" if kind.startswith("learner") else "link"
            free = [i for i in IDS if busy.get(f"{prefix}:{i}", 0.0) <= t]
            if not free:
                t += rng.uniform(2.5, 7.0)
                continue
            target = rng.choice(free)
            key = f"{prefix}:{target}"
            dur = {"learner_kill": rng.uniform(0.5, 3.0), "learner_stop": rng.uniform(2.0, 12.0),
                   "link_drop": rng.uniform(0.5, 5.0), "link_stall": rng.uniform(1.0, 8.0),
                   "bandwidth_drop": rng.uniform(4.0, 12.0)}[kind]
            cool = 10.0 if kind == "learner_kill" else 3.0
        if busy.get(key, 0.0) > t:
            t += rng.uniform(2.5, 7.0)
            continue
        dur = round(min(dur, phase_s - 1.0 - t), 2)
        rate = rng.choice(RATES) if kind == "bandwidth_drop" else None
        faults.append(Fault(kind, target, round(t, 2), dur, rate))
        busy[key] = t + dur + cool
        t += rng.uniform(2.5, 7.0)
    return faults


# ------------------------------------------------------------------ processes


class Proc:
    """One child process; its output goes to a file in the working folder."""

    def __init__(self, name: str, cmd: list[str], workdir: Path) -> None:
        self.name = name
        self.out_path = workdir / f"{name}.out"
        with open(self.out_path, "ab") as out:
            # Own session: a Ctrl-C at the terminal reaches this script, which kills the
            # children itself, rather than every process at once.
            self.popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])})
        self.started = time.monotonic()
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)  # SIGKILL also ends a stopped process
        self.popen.wait(30)

    def tail(self, n: int = 2000) -> str:
        try:
            return self.out_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def fds(self) -> int | None:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return None


def wait_for(cond: Callable[[], bool], timeout: float, what: str, tick: Callable[[], None] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if tick is not None:
            tick()
        if cond():
            return
        time.sleep(0.05)
    raise Abort(f"timed out after {timeout:.0f}s waiting for {what}")


# ------------------------------------------------------------------ the event log


class LogTail:
    """The syncer's JSONL log as it grows, typed (``read_event``). A syncer killed
    mid-write can leave a line without its newline, and the next one appends to it: such
    lines are split, and a piece that is not JSON is counted as torn. A piece that is JSON
    but no record of this version goes to ``unreadable`` (the checker's violation)."""

    def __init__(self, path: Path, unreadable: Callable[[str], None]) -> None:
        self.path = path
        self.unreadable = unreadable
        self.offset = 0
        self.rest = b""
        self.torn = 0

    def read(self) -> list[SyncerRecord]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.rest + data
        *lines, self.rest = data.split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                pieces = [json.loads(line)]
            except json.JSONDecodeError:
                pieces = []
                for piece in re.split(rb'(?<=\})(?=\{"event")', line):
                    try:
                        pieces.append(json.loads(piece))
                    except json.JSONDecodeError:
                        self.torn += 1
            for piece in pieces:
                try:
                    out.append(read_event(piece))
                except ValueError as exc:
                    self.unreadable(f"{exc}: {json.dumps(piece)[:300]}")
        return out


@dataclass
class Incarnation:
    epoch: int
    listening_t: float
    resumed: list[int] | None
    last: list[int] = field(default_factory=list)
    """Versions merged so far in this epoch."""
    merges: int = 0


class Checker:
    """The invariants of the event log, fed events in order (see the module docstring)."""

    def __init__(self, violate: Callable[[str, str], None]) -> None:
        self.violate = violate
        self.incarnations: list[Incarnation] = []
        self.current: Incarnation | None = None
        self.pending_resume: list[int] | None = None
        self.last_checkpoint: list[int] | None = None
        self.merges: list[tuple[float, int, list[str], float]] = []
        """(t, fragment, learners merged, wait_s) of every merge."""
        self.lost_merges = 0
        self.unlogged_checkpoints = 0
        self.rejects: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.max_wait = 0.0
        self.epochs: set[int] = set()
        self.guards: list[tuple[float, str]] = []

    def feed(self, ev: SyncerRecord) -> None:
        self.counts[ev.event] = self.counts.get(ev.event, 0) + 1
        if isinstance(ev, Resumed):
            self.pending_resume = list(ev.versions)
        elif isinstance(ev, Listening):
            self._listening(ev)
        elif isinstance(ev, Merged):
            self._merge(ev)
        elif isinstance(ev, CheckpointWritten):
            cur = self.current
            if cur is not None and cur.last and list(ev.versions) != cur.last:
                self.violate("checkpoint_versions", f"checkpoint at t={ev.t:.2f} names versions "
                             f"{list(ev.versions)}, the log merged {cur.last} (epoch {cur.epoch})")
            self.last_checkpoint = list(ev.versions)
        elif isinstance(ev, Guarded):
            self.guards.append((ev.t, ev.learner))
        elif isinstance(ev, (Rejected, Dropped)):
            reason = ev.reason.strip()
            if not reason:
                self.violate("no_reason", f"{ev.event} without a reason: {ev}")
            key = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", reason.split(":")[0])[:60]
            self.rejects[key] = self.rejects.get(key, 0) + 1

    def _listening(self, ev: Listening) -> None:
        epoch = ev.epoch
        if epoch in self.epochs:
            self.violate("epoch_reused", f"epoch {epoch} drawn by two syncer starts")
        self.epochs.add(epoch)
        prev = self.current
        resumed = self.pending_resume if ev.resumed else None
        self.pending_resume = None
        if resumed is not None and prev is not None:
            floor = self.last_checkpoint or [0] * len(resumed)
            ceiling = prev.last or floor
            for p, (r, lo, hi) in enumerate(zip(resumed, floor, ceiling)):
                if r < lo:
                    self.violate("merge_lost", f"fragment {p}: resumed at version {r}, but the last checkpoint "
                                 f"logged before the crash holds {lo}")
                if r > max(hi, lo):
                    self.violate("resume_ahead", f"fragment {p}: resumed at version {r}, beyond the last "
                                 f"merged {hi}")
            self.lost_merges += sum(max(0, h - r) for h, r in zip(ceiling, resumed))
            if resumed != floor:
                self.unlogged_checkpoints += 1  # killed between the checkpoint's rename and its log line
        elif resumed is None and prev is not None:
            self.violate("fresh_restart", f"a syncer started without resuming at t={ev.t:.2f}")
        inc = Incarnation(epoch, ev.t, resumed, list(resumed) if resumed is not None else [0] * P)
        self.incarnations.append(inc)
        self.current = inc

    def _merge(self, ev: Merged) -> None:
        cur = self.current
        if cur is None:
            self.violate("merge_before_listening", f"{ev}")
            return
        p, v = ev.fragment, ev.version
        while len(cur.last) <= p:
            cur.last.append(0)
        if v != cur.last[p] + 1:
            self.violate("version_not_monotonic", f"epoch {cur.epoch} fragment {p}: merge made version {v} "
                         f"after {cur.last[p]} (t={ev.t:.2f})")
        cur.last[p] = v
        cur.merges += 1
        wait = ev.wait_s
        self.max_wait = max(self.max_wait, wait)
        if wait > GRACE_MAX + WAIT_SLACK_S:
            self.violate("wait_bound", f"fragment {p} version {v}: the round waited {wait:.2f}s > grace_max "
                         f"{GRACE_MAX} + {WAIT_SLACK_S} s (t={ev.t:.2f})")
        self.merges.append((ev.t, p, list(ev.merged), wait))


# ------------------------------------------------------------------ the run


class Chaos:
    def __init__(self, args: Any, workdir: Path) -> None:
        self.args = args
        self.dir = workdir
        self.phase_s = args.phase or (110.0 if args.quick else 480.0)
        self.warmup_s = args.warmup
        self.catchup_s = 30.0
        self.rng = random.Random(args.seed)
        self.faults = draw_schedule(self.rng, self.phase_s)
        self.violations: list[dict[str, Any]] = []
        self.checker = Checker(self._violate)
        self.log = LogTail(workdir / "events.jsonl", lambda text: self._violate("unreadable_log_line", text))
        self.procs: list[Proc] = []
        self.syncer: Proc | None = None
        self.syncer_port = 0
        self.links: dict[str, Proc] = {}
        self.link_ports: dict[str, int] = {}
        self.learners: dict[str, Proc | None] = {}
        self.starts: dict[str, int] = {}
        self.down: list[tuple[str, float, float]] = []
        """(learner, from, to): not running or stopped, for the stall and catch-up figures."""
        self.down_since: dict[str, float] = {}
        self.syncer_down: list[tuple[float, float]] = []
        self.fd_samples: dict[str, list[tuple[float, int]]] = {}
        self.fd_before: dict[str, int] = {}
        self.fd_after: dict[str, int] = {}
        self.next_fd_sample = 0.0
        self.expect_exit: set[int] = set()
        self.t_faults = 0.0
        self.t_faults_end = 0.0
        self.catchup_end = 0.0

    # ---------------------------------------------------------------- bookkeeping
    def _violate(self, kind: str, message: str) -> None:
        self.violations.append({"kind": kind, "message": message, "t": round(time.monotonic(), 3)})
        print(f"  VIOLATION {kind}: {message}", flush=True)

    def start(self, name: str, cmd: list[str]) -> Proc:
        proc = Proc(name, cmd, self.dir)
        self.procs.append(proc)
        return proc

    def monitor(self) -> None:
        """One pass of the continuous checks: new log events, unexpected exits, fds."""
        for ev in self.log.read():
            self.checker.feed(ev)
        now = time.monotonic()
        for name, proc in [("syncer", self.syncer), *self.learners.items(), *self.links.items()]:
            if proc is None or proc.alive() or proc.pid in self.expect_exit:
                continue
            self.expect_exit.add(proc.pid)
            self._violate("unexpected_exit", f"{proc.name} (pid {proc.pid}) exited with {proc.popen.returncode}: "
                          f"{proc.tail(1500)}")
            if name == "syncer":
                self.start_syncer(resume=True)
            elif name in self.learners:
                self.start_learner(name)
        if now >= self.next_fd_sample:
            self.next_fd_sample = now + 1.0
            for name, proc in [("syncer", self.syncer), *[(f"link-{k}", v) for k, v in self.links.items()]]:
                n = proc.fds() if proc is not None and proc.alive() else None
                if n is not None:
                    self.fd_samples.setdefault(name, []).append((round(now, 2), n))

    def sleep_until(self, t: float) -> None:
        while True:
            self.monitor()
            left = t - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    # ---------------------------------------------------------------- processes
    def start_syncer(self, resume: bool) -> None:
        ready = self.dir / "syncer.endpoint"
        ready.unlink(missing_ok=True)
        n = self.starts["syncer"] = self.starts.get("syncer", 0) + 1
        cmd = [PY, "-m", "rackmend.cli", "syncer", "--bind", f"tcp://127.0.0.1:{self.syncer_port}",
               "--ready-file", str(ready), "--log", str(self.dir / "events.jsonl"),
               "--checkpoint-dir", str(self.dir / "checkpoint"), "--checkpoint-every", str(CHECKPOINT_EVERY),
               "--learners", ",".join(IDS), "--overlap", str(TAU), "--grace-max", str(GRACE_MAX),
               "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--downlink-codec", self.args.downlink_codec]
        if resume:
            cmd.append("--resume")
        for attempt in range(3):
            proc = self.start(f"syncer.{n}.{attempt}", cmd)
            self.syncer = proc
            end = time.monotonic() + START_TIMEOUT
            while time.monotonic() < end and proc.alive() and not ready.exists():
                time.sleep(0.05)
            if ready.exists():
                endpoint = ready.read_text()
                self.syncer_port = int(endpoint.rsplit(":", 1)[1])
                return
            self.expect_exit.add(proc.pid)
            proc.kill()
            self._violate("syncer_start", f"syncer start {n} attempt {attempt} failed: {proc.tail(1500)}")
            time.sleep(1.0)
        raise Abort("the syncer did not start in three attempts")

    def start_links(self) -> None:
        t_plan = {i: [f for f in self.faults if f.target == i and f.kind.startswith(("link", "bandwidth"))]
                  for i in IDS}
        for lid in IDS:
            cmd = [PY, "-m", "rackmend.cli", "link", "--listen", "127.0.0.1:0",
                   "--target", f"127.0.0.1:{self.syncer_port}", "--name", f"link-{lid}", "--stats-every", "10",
                   "--seed", str(self.args.seed)]
            for f in t_plan[lid]:
                mode = (f"throttle={f.rate_bps:g}" if f.kind == "bandwidth_drop"
                        else {"link_drop": "drop", "link_stall": "blackhole"}[f.kind])
                cmd += ["--outage", f"{self.warmup_s + f.at:.2f}:{f.duration:.2f}:{mode}"]
            self.links[lid] = self.start(f"link-{lid}", cmd)
        pattern = re.compile(r"listening on [\d.]+:(\d+)")
        t0: dict[str, float] = {}

        def seen() -> bool:
            for lid, proc in self.links.items():
                if lid not in t0:
                    m = pattern.search(proc.tail(4000))
                    if m:
                        self.link_ports[lid], t0[lid] = int(m.group(1)), time.monotonic()
                    elif not proc.alive():
                        raise Abort(f"link {lid} exited: {proc.tail()}")
            return len(t0) == len(IDS)

        wait_for(seen, START_TIMEOUT, "the links to listen")
        # Link outages count from each link's start; the fault phase from the first one's.
        self.link_t0 = t0
        self.t_faults = min(t0.values()) + self.warmup_s
        for f in self.faults:
            if f.target in t0 and f.kind.startswith(("link", "bandwidth")):
                f.start = t0[f.target] + self.warmup_s + f.at
                f.end = f.start + f.duration

    def start_learner(self, lid: str) -> None:
        n = self.starts[lid] = self.starts.get(lid, 0) + 1
        cmd = [PY, str(HERE / "_chaos_learner.py"), "--endpoint", f"tcp://127.0.0.1:{self.link_ports[lid]}",
               "--id", lid, "--H", str(H), "--P", str(P), "--tau", str(TAU),
               "--downlink-codec", self.args.downlink_codec, "--step-sleep", str(self.args.step_sleep),
               "--status", str(self.dir / f"{lid}.status"), "--stop-file", str(self.dir / "STOP"),
               "--final-file", str(self.dir / "FINAL"), "--out", str(self.dir / f"{lid}.final.safetensors"),
               "--values-log", str(self.dir / f"{lid}.values.jsonl")]
        self.learners[lid] = self.start(f"{lid}.{n}", cmd)
        self._up(lid)

    def _down(self, lid: str) -> None:
        self.down_since.setdefault(lid, time.monotonic())

    def _up(self, lid: str) -> None:
        since = self.down_since.pop(lid, None)
        if since is not None:
            self.down.append((lid, since, time.monotonic()))

    # ---------------------------------------------------------------- faults
    def actions(self) -> list[tuple[float, str, Fault]]:
        out = []
        for f in self.faults:
            if f.kind.startswith(("link", "bandwidth")):
                continue
            t = self.t_faults + f.at
            out.append((t, "begin", f))
            out.append((t + f.duration, "end", f))
        return sorted(out, key=lambda a: (a[0], a[1] == "begin"))

    def begin(self, f: Fault) -> None:
        f.start = time.monotonic()
        if f.kind == "syncer_kill":
            assert self.syncer is not None
            self.expect_exit.add(self.syncer.pid)
            self.syncer.kill()
            self.syncer_down.append((f.start, f.start))
            return
        proc = self.learners[f.target]
        if proc is None or not proc.alive():
            f.skipped = "learner not running"
            return
        if f.kind == "learner_kill":
            self.expect_exit.add(proc.pid)
            proc.kill()
            self.learners[f.target] = None
        else:
            proc.signal(signal.SIGSTOP)
        self._down(f.target)

    def end(self, f: Fault) -> None:
        if f.skipped:
            f.end = f.start
            return
        if f.kind == "syncer_kill":
            self.start_syncer(resume=True)
            f.end = time.monotonic()
            self.syncer_down[-1] = (f.start, f.end)
        elif f.kind == "learner_kill":
            self.start_learner(f.target)
            f.end = time.monotonic()
        else:
            proc = self.learners[f.target]
            if proc is not None:
                proc.signal(signal.SIGCONT)
            self._up(f.target)
            f.end = time.monotonic()

    # ---------------------------------------------------------------- phases
    def merged_since(self, lid: str, t: float) -> int:
        return sum(1 for tm, _, who, _ in self.checker.merges if tm >= t and lid in who)

    def fd_snapshot(self) -> dict[str, int]:
        out = {}
        for name, proc in [("syncer", self.syncer), *[(f"link-{k}", v) for k, v in self.links.items()]]:
            n = proc.fds() if proc is not None else None
            if n is not None:
                out[name] = n
        return out

    def run(self) -> None:
        print(f"working folder {self.dir}; {len(self.faults)} faults drawn (seed {self.args.seed}); "
              f"warm-up {self.warmup_s:.0f}s, faults {self.phase_s:.0f}s", flush=True)
        self.start_syncer(resume=False)
        self.start_links()
        for lid in IDS:
            self.start_learner(lid)
        t_warm = time.monotonic()
        wait_for(lambda: all(self.merged_since(i, t_warm) for i in IDS) and self.checker.last_checkpoint is not None,
                 max(1.0, self.t_faults - time.monotonic()),
                 f"every learner to merge and a first checkpoint before the faults begin (--warmup {self.warmup_s})",
                 tick=self.monitor)
        print(f"warm-up done in {time.monotonic() - t_warm:.1f}s; {len(self.checker.merges)} merges", flush=True)
        self.sleep_until(self.t_faults - 0.5)
        self.fd_before = self.fd_snapshot()
        for t, what, f in self.actions():
            self.sleep_until(t)
            if what == "begin":
                print(f"  t={t - self.t_faults:6.1f}s {f.kind} {f.target} for {f.duration:.1f}s", flush=True)
                self.begin(f)
            else:
                self.end(f)
        self.t_faults_end = self.t_faults + self.phase_s
        self.sleep_until(self.t_faults_end)
        for f in self.faults:
            if f.kind.startswith(("link", "bandwidth")):
                print(f"  (link) {f.kind} {f.target} at {f.at:.1f}s for {f.duration:.1f}s"
                      + (f" at {f.rate_bps / 1e3:g} kbit/s" if f.rate_bps else ""), flush=True)
        # Catch-up: no more faults; every learner must merge a few more times.
        print("faults over; catch-up", flush=True)
        wait_for(lambda: all(self.merged_since(i, self.t_faults_end + 1.0) >= 3 for i in IDS), self.catchup_s,
                 "every learner to merge 3 times after the faults", tick=self.monitor)
        self.sleep_until(time.monotonic() + 3.0)
        self.fd_after = self.fd_snapshot()
        self.catchup_end = time.monotonic()
        self.finish_run()

    def finish_run(self) -> None:
        (self.dir / "STOP").touch()
        wait_for(lambda: all(self._phase(i) == "quiet" for i in IDS), 30, "the learners to stand still",
                 tick=self.monitor)
        self.sleep_until(time.monotonic() + GRACE_MAX + 1.5)  # open rounds close and are sent
        assert self.syncer is not None
        self.syncer.signal(signal.SIGTERM)
        self.expect_exit.add(self.syncer.pid)
        try:
            rc = self.syncer.popen.wait(60)
        except subprocess.TimeoutExpired:
            raise Abort(f"the syncer did not stop within 60s of SIGTERM: {self.syncer.tail()}") from None
        if rc != 0:
            self._violate("exit_code", f"syncer exited {rc} after SIGTERM: {self.syncer.tail()}")
        for ev in self.log.read():
            self.checker.feed(ev)
        (self.dir / "FINAL").touch()
        for lid in IDS:
            proc = self.learners[lid]
            assert proc is not None
            self.expect_exit.add(proc.pid)
            try:
                rc = proc.popen.wait(90)
            except subprocess.TimeoutExpired:
                raise Abort(f"learner {lid} did not finish within 90s: {proc.tail()}") from None
            if rc != 0:
                self._violate("exit_code", f"learner {lid} exited {rc}: {proc.tail()}")
        for lid, proc in self.links.items():
            self.expect_exit.add(proc.pid)
            proc.signal(signal.SIGTERM)
            try:
                rc = proc.popen.wait(30)
            except subprocess.TimeoutExpired:
                raise Abort(f"link {lid} did not stop within 30s of SIGTERM") from None
            if rc != 0:
                self._violate("exit_code", f"link {lid} exited {rc}: {proc.tail()}")

    def _phase(self, lid: str) -> str:
        try:
            return json.loads((self.dir / f"{lid}.status").read_text())["phase"]
        except (OSError, ValueError, KeyError):
            return "?"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                try:
                    proc.kill()
                except (OSError, subprocess.TimeoutExpired) as exc:
                    print(f"could not kill {proc.name} (pid {proc.pid}): {exc}", file=sys.stderr)

    # ---------------------------------------------------------------- verdicts
    def compare_learners(self) -> dict[str, Any]:
        loaded = load_checkpoint(self.dir / "checkpoint")
        if loaded is None:
            self._violate("final_checkpoint", "no checkpoint after the syncer's SIGTERM")
            return {}
        tensors, meta = loaded.tensors, loaded.meta
        versions = meta.versions
        values = global_values(tensors, layout_from_wire(meta.layout))
        final = self.checker.current
        epoch = final.epoch if final is not None else -1
        if final is not None and final.last != versions:
            self._violate("final_versions", f"the final checkpoint holds versions {versions}, the log's last "
                          f"merges made {final.last}")
        out: dict[str, Any] = {"versions": versions, "epoch": epoch, "learners": {}}
        for lid in IDS:
            path = self.dir / f"{lid}.final.safetensors"
            if not path.exists():
                self._violate("learner_copy", f"{lid} wrote no final state")
                continue
            with safe_open(str(path), framework="pt") as f:
                lm = json.loads((f.metadata() or {})["chaos"])
                mine = {k: f.get_tensor(k) for k in f.keys()}
            row: dict[str, Any] = {}
            for which in ("held", "latest"):
                equal = 0
                for p, value in enumerate(values):
                    v, e = lm[f"{which}_versions"][p], lm[f"{which}_epochs"][p]
                    theirs = [mine.get(f"{which}/{p}/{i}") for i in range(len(value))]
                    if v == versions[p] and e == epoch and all(
                            t is not None and torch.equal(t, s) for t, s in zip(theirs, value)):
                        equal += 1
                        continue
                    diff = [float((t - s).abs().max()) for t, s in zip(theirs, value)
                            if t is not None and t.shape == s.shape]
                    self._violate("learner_copy", f"{lid} {which} fragment {p}: (epoch {e}, version {v}) vs the "
                                  f"syncer's (epoch {epoch}, version {versions[p]}); max |diff| "
                                  f"{max(diff) if diff else 'n/a'}")
                row[which] = f"{equal}/{len(versions)} equal"
            out["learners"][lid] = row
        return out

    def stall_and_recovery(self) -> dict[str, Any]:
        merges = sorted(self.checker.merges)
        t_lo, t_hi = self.t_faults, self.catchup_end
        down = list(self.down) + [(lid, s, t_hi) for lid, s in self.down_since.items()]

        def learners_up(a: float, b: float) -> float:
            """Seconds of [a, b] during which at least one learner ran (not killed or stopped)."""
            cuts = sorted({a, b, *[x for _, s, e in down for x in (s, e) if a < x < b]})
            total = 0.0
            for x, y in zip(cuts, cuts[1:]):
                mid = (x + y) / 2
                if any(not any(l == lid and s <= mid < e for l, s, e in down) for lid in IDS):
                    total += y - x
            return total

        times = [t for t, *_ in merges if t_lo <= t <= t_hi]
        gaps = [(learners_up(a, b), a, b) for a, b in zip([t_lo, *times], [*times, t_hi])]
        stall, s_a, s_b = max(gaps) if gaps else (0.0, t_lo, t_lo)
        during = [f"{f.kind}:{f.target}" for f in self.faults if f.start < s_b and f.end > s_a]

        def first_merge(lid: str | None, after: float) -> float | None:
            return next((t for t, _, who, _ in merges if t >= after and (lid is None or lid in who)), None)

        def touched(lid: str, a: float, b: float) -> bool:
            hit = [f for f in self.faults if not f.skipped and f.target == lid and f.start <= b and f.end + 1.0 >= a]
            return bool(hit) or any(l == lid and s <= b and e >= a for l, s, e in down)

        for f in self.faults:
            if f.skipped:
                continue
            if f.kind == "syncer_kill":
                inc = next((i for i in self.checker.incarnations if i.listening_t >= f.start), None)
                f.recovered_at = first_merge(None, inc.listening_t) if inc else None
            else:
                f.recovered_at = first_merge(f.target, f.end)
        catchups = []
        for inc in self.checker.incarnations[1:]:
            t_r = inc.listening_t
            nxt = next((s for s, _ in self.syncer_down if s > t_r), t_hi)
            firsts = {lid: first_merge(lid, t_r) for lid in IDS}
            live = [lid for lid in IDS if firsts[lid] is not None and firsts[lid] <= nxt  # type: ignore[operator]
                    and not touched(lid, t_r - 1.0, firsts[lid])]  # type: ignore[arg-type]
            if live:
                catchups.append(round(max(firsts[lid] for lid in live) - t_r, 3))  # type: ignore[operator]
            for lid in IDS:
                if firsts[lid] is None or firsts[lid] > nxt:  # type: ignore[operator]
                    if not touched(lid, t_r - 1.0, nxt) and nxt - t_r > 30:
                        self._violate("not_caught_up", f"{lid} never merged in the {nxt - t_r:.0f}s after the "
                                      f"syncer resumed at t={t_r - self.t_faults:.1f}s")
        outages = [round(f.end - f.start, 3) for f in self.faults if f.kind == "syncer_kill" and not f.skipped]
        return {"max_stall_s": round(stall, 3), "stall_window": [round(s_a - t_lo, 2), round(s_b - t_lo, 2)],
                "stall_during": during, "catchup_s": catchups, "syncer_outage_s": outages}

    def values_verdict(self) -> dict[str, int]:
        """No (fragment, epoch, version) was delivered to two learners (or to one learner
        twice) with different contents."""
        seen: dict[tuple[int, int, int], dict[str, set[str]]] = {}
        for lid in IDS:
            path = self.dir / f"{lid}.values.jsonl"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line of a learner killed mid-write
                seen.setdefault((r["f"], r["e"], r["v"]), {}).setdefault(r["h"], set()).add(lid)
        for (f, e, v), hashes in sorted(seen.items()):
            if len(hashes) > 1:
                self._violate("version_names_two_values", f"fragment {f} epoch {e} version {v} was delivered "
                              f"with {len(hashes)} different values: {[sorted(w) for w in hashes.values()]}")
        shared = sum(1 for h in seen.values() if len({lid for w in h.values() for lid in w}) > 1)
        return {"names": len(seen), "seen_by_several": shared}

    def guard_figures(self) -> dict[str, int]:
        """The norm guard's events: right after a learner process started (a fresh inner
        optimizer takes large first steps, docs/reliability.md) or otherwise."""
        starts: dict[str, list[float]] = {}
        for proc in self.procs:
            lid = proc.name.split(".")[0]
            if lid in IDS:
                starts.setdefault(lid, []).append(proc.started)
        after, outage, other = 0, 0, 0
        for t, lid in self.checker.guards:
            if any(0 <= t - s <= GUARD_AFTER_START_S for s in starts.get(lid, [])):
                after += 1
            elif any(f.target in (lid, "syncer") and not f.skipped and 0 <= t - f.end <= GUARD_AFTER_OUTAGE_S
                     for f in self.faults):
                outage += 1  # the first send after an outage holds every step made during it
            else:
                other += 1
        return {"guard_after_restart": after, "guard_after_outage": outage, "guard_other": other}

    def fd_verdict(self) -> None:
        for name, before in self.fd_before.items():
            after = self.fd_after.get(name)
            if after is None:
                continue
            if after > before + FD_SLACK:
                self._violate("fd_leak", f"{name}: {after} open fds after the faults, {before} before "
                              f"(all learners connected both times)")

    def process_verdict(self) -> list[int]:
        me = os.getpid()
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == me:
                left.append(int(entry))
        unreaped = [p.name for p in self.procs if p.popen.returncode is None]
        if left or unreaped:
            self._violate("process_leak", f"children left: {left}; never reaped: {unreaped}")
        return left


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def main() -> int:
    p = parser("chaos run: a seeded random fault schedule against a real syncer, learners and links")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    p.add_argument("--warmup", type=float, default=40.0,
                   help="seconds from the links' start to the first fault: the processes start and a first "
                   "checkpoint is written meanwhile (default 40; raise it on a slow machine)")
    p.add_argument("--phase", type=float, default=None,
                   help="seconds of faults (default 110 with --quick, else 480)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="learners' pause per step (default 0.05 s)")
    p.add_argument("--downlink-codec", default="int8",
                   help="the syncer's update codec (default int8: learners rebuild values from deltas, which "
                   "the final comparison then checks bit for bit)")
    p.add_argument("--workdir", type=Path, default=None, help="working folder (default: a new temporary one)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rackmend-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fds_at_start = len(os.listdir("/proc/self/fd"))
    chaos = Chaos(args, workdir)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t_start = time.monotonic()
    aborted = None
    try:
        chaos.run()
    except (Abort, KeyboardInterrupt) as exc:
        aborted = f"{type(exc).__name__}: {exc}"
        print(f"ABORTED: {aborted}", flush=True)
    finally:
        chaos.kill_all()
        signal.signal(signal.SIGTERM, previous)
    wall = time.monotonic() - t_start
    for ev in chaos.log.read():
        chaos.checker.feed(ev)
    copies = chaos.compare_learners() if aborted is None else {}
    figures = chaos.stall_and_recovery() if aborted is None else {"max_stall_s": float("nan"), "catchup_s": []}
    values = chaos.values_verdict()
    guards = chaos.guard_figures()
    chaos.fd_verdict()
    chaos.process_verdict()
    own_fds = len(os.listdir("/proc/self/fd"))
    if own_fds > fds_at_start:
        chaos._violate("fd_leak", f"this script holds {own_fds} fds, {fds_at_start} at its start")
    if aborted:
        chaos._violate("aborted", aborted)

    by_kind: dict[str, list[Fault]] = {k: [] for k in KINDS}
    for f in chaos.faults:
        by_kind[f.kind].append(f)
    rows = [["fault", "injected", "survived", "recovery_s median", "max"]]
    injected = survived = 0
    for kind, fs in by_kind.items():
        done = [f for f in fs if not f.skipped]
        ok = [f for f in done if f.recovered_at is not None]
        rec = [f.recovered_at - f.end for f in ok]  # type: ignore[operator]
        injected += len(done)
        survived += len(ok)
        rows.append([kind, str(len(done)), str(len(ok)), f"{statistics.median(rec):.2f}" if rec else "-",
                     f"{max(rec):.2f}" if rec else "-"])
    rows.append(["total", str(injected), str(survived), "", ""])
    print()
    print(table(rows))
    c = chaos.checker
    catchups = figures["catchup_s"]
    fd_ranges = {k: [min(n for _, n in v), max(n for _, n in v)] for k, v in chaos.fd_samples.items()}
    print(f"\nmerges {len(c.merges)}, syncer epochs {len(c.incarnations)}, merges lost to syncer kills "
          f"(after the last checkpoint, by design) {c.lost_merges}, max wait_s {c.max_wait:.2f} "
          f"(bound {GRACE_MAX + WAIT_SLACK_S:.1f})")
    print(f"max stall {figures['max_stall_s']:.2f}s (window {figures.get('stall_window')}, during "
          f"{figures.get('stall_during')})")
    print(f"syncer outages, SIGKILL to listening again (s): {figures.get('syncer_outage_s')}; catch-up after "
          f"each restart, listening to a merge with every live learner (s): {catchups}")
    print(f"rejected contributions by reason: {c.rejects}")
    print(f"values delivered: {values['names']} (fragment, epoch, version) names, {values['seen_by_several']} "
          f"seen by several learners; norm guard: {guards}")
    print(f"fds before/after the faults: {chaos.fd_before} / {chaos.fd_after}; ranges {fd_ranges}")
    print(f"learners' copies vs the final checkpoint: {copies.get('learners')}")
    print(f"torn log lines {chaos.log.torn}; events {dict(sorted(c.counts.items()))}")
    print(f"working folder kept: {workdir}; wall {wall:.0f}s")
    for v in chaos.violations:
        print(f"violation {v['kind']}: {v['message'][:600]}")
    result = {
        "faults": injected,
        "survived": survived,
        "max_stall_s": float(figures["max_stall_s"]),
        "catchup_s_median": float(statistics.median(catchups)) if catchups else float("nan"),
        "violations": len(chaos.violations),
    }
    payload = {
        "inputs": {"seed": args.seed, "quick": args.quick, "warmup_s": args.warmup, "phase_s": chaos.phase_s,
                   "step_sleep": args.step_sleep, "downlink_codec": args.downlink_codec, "learners": IDS,
                   "H": H, "P": P, "tau": TAU, "grace_max": GRACE_MAX, "wait_slack_s": WAIT_SLACK_S,
                   "checkpoint_every": CHECKPOINT_EVERY, "heartbeat_timeout": HEARTBEAT_TIMEOUT},
        "wall_s": round(wall, 1),
        "faults": [{**asdict(f), "at": f.at, "start": round(f.start - chaos.t_faults, 3) if f.start else None,
                    "end": round(f.end - chaos.t_faults, 3) if f.end else None,
                    "recovery_s": round(f.recovered_at - f.end, 3) if f.recovered_at is not None else None,
                    "recovered_at": None} for f in chaos.faults],
        "table": rows,
        "merges": len(c.merges), "epochs": len(c.incarnations), "lost_merges": c.lost_merges,
        "unlogged_checkpoints": c.unlogged_checkpoints, "max_wait_s": c.max_wait, "rejects": c.rejects,
        "events": c.counts, "torn_log_lines": chaos.log.torn, **figures, "values": values, **guards,
        "fd_before": chaos.fd_before, "fd_after": chaos.fd_after, "fd_ranges": fd_ranges,
        "copies": copies, "violations": chaos.violations, "aborted": aborted, "workdir": str(workdir),
    }
    finish("chaos", args.out, payload, result)
    return 1 if chaos.violations else 0


if __name__ == "__main__":
    sys.exit(main())
