"""Real processes for the tests: a ``rackmend syncer``, learner processes, torchrun
jobs, each started by the test that needs it and killed at its teardown (the ``procs``
fixture in conftest.py), and the bounded waits around them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Union

from rackmend.core.records import SyncerRecord
from rackmend.service.events import read_event

TIME_SCALE_ENV = "RACKMEND_TEST_TIME_SCALE"


def _time_scale() -> float:
    raw = os.environ.get(TIME_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not 1 <= scale <= 100:
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r}: give a number from 1 to 100, the factor every bounded wait "
                         "of the tests is multiplied by on a loaded host (default 1)")
    return scale


TIME_SCALE = _time_scale()
"""Every bounded wait here (and pytest-timeout's per-test limit, conftest.py) is
multiplied by this: ``RACKMEND_TEST_TIME_SCALE=3 make test`` on a host where other jobs
take the cores. Only the bounds move: a test that passes waits as long as it needs."""

HERE = Path(__file__).parent
FRESH_ENV = "RACKMEND_TEST_FRESH_PYTHON"
"""``RACKMEND_TEST_FRESH_PYTHON=1``: every process a test starts is a fresh ``python``
instead of a fork of the launcher that has imported torch already (``_zygote.py``)."""
_STARTUP_ENV = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC", "TORCH_", "CUDA_", "KMP_")
"""Environment read while an interpreter and its libraries start: a command that sets
one of these differently from the launcher's gets a fresh ``python``."""


class Forked:
    """A process forked by the launcher, with the parts of ``subprocess.Popen`` the
    tests use (its exit status comes from the launcher, which reaps it)."""

    def __init__(self, launcher: "_Launcher", pid: int, args: list[str]) -> None:
        self._launcher = launcher
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Proc = Union[subprocess.Popen, Forked]


class _Launcher:
    """The one ``_zygote.py`` of this pytest process, started at its first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._startup: dict[str, str] = {}

    def _ensure(self) -> subprocess.Popen:
        """The launcher, started now if it is not running; the caller holds the lock."""
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self._startup = _startup(env)
            self._proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py")], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
        return self._proc

    def _ask(self, request: dict) -> dict:
        """One request and its answer; the caller holds the lock."""
        proc = self._ensure()
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the tests' process launcher (_zygote.py) ended (exit {proc.wait()}); "
                               f"{FRESH_ENV}=1 starts every process as a fresh python instead")
        return json.loads(line)

    def poll(self, pid: int) -> int | None:
        with self._lock:
            answer = self._ask({"op": "poll", "pid": pid})
        if "error" in answer:
            raise RuntimeError(f"the tests' process launcher: {answer['error']}")
        return answer["rc"]

    def start(self, cmd: list[str], out: Path, env: dict[str, str]) -> Forked | None:
        """``cmd`` forked from the launcher, or None when it must be a fresh process: not
        ``python -m module`` or ``python script``, or setting start-up environment."""
        argv = cmd[1:]
        if (os.environ.get(FRESH_ENV) == "1" or cmd[0] != sys.executable or not argv
                or argv[0].startswith("-") and (argv[0] != "-m" or len(argv) < 2)):
            return None
        with self._lock:
            self._ensure()
            if _startup(env) != self._startup:
                return None
            pid = self._ask({"op": "start", "argv": argv, "env": env, "cwd": os.getcwd(), "out": str(out)})["pid"]
        return Forked(self, pid, cmd)


def _startup(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_ENV)}


LAUNCHER = _Launcher()
LEARNER = [sys.executable, str(HERE / "_learner_proc.py")]
SYNCER = [sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0"]


def wait_for(cond: Callable[[], bool], timeout: float, what: str,
             alive: tuple[Proc, ...] = ()) -> None:
    timeout *= TIME_SCALE
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        dead = [p.args[-1] for p in alive if p.poll() is not None]
        assert not dead, f"a process exited while waiting for {what}"
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Procs:
    """Processes this test started; all killed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Proc] = []
        self.names: dict[str, Proc] = {}
        """The latest process started under each output name."""

    def start(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
        """``cmd`` with its output in ``{name}.out``: forked from the launcher that has
        imported torch already (``_zygote.py``) where it can be, else a fresh process."""
        out = self.tmp / f"{name}.out"
        out.touch()  # there on return, whoever starts the process
        full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc: Proc | None = LAUNCHER.start(cmd, out, full)
        if proc is None:
            with open(out, "ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full)
        self.started.append(proc)
        self.names[name] = proc
        return proc

    def syncer(self, *flags: str, name: str = "syncer",
               env: dict[str, str] | None = None) -> tuple[Proc, str]:
        ready = self.tmp / f"{name}.endpoint"
        ready.unlink(missing_ok=True)
        proc = self.start([*SYNCER, "--ready-file", str(ready), "--log", str(self.tmp / "events.jsonl"), *flags],
                          name, env)
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the syncer to listen")
        assert proc.poll() is None, (self.tmp / f"{name}.out").read_text()
        return proc, ready.read_text()

    def learner(self, endpoint: str, lid: str, *flags: str, name: str | None = None) -> Proc:
        return self.start([*LEARNER, "--endpoint", endpoint, "--id", lid, *flags], name or lid)

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text(errors="replace")

    def report(self) -> None:
        """For a failed test: stacks of the syncers still running, then the end of
        every process's output, on stdout."""
        names = {id(p): n for n, p in self.names.items()}  # a name restarted: its file holds every run
        running = [p for p in self.started if p.poll() is None and p.args[:len(SYNCER)] == SYNCER]
        for p in running:
            p.send_signal(signal.SIGUSR1)
        if running:
            time.sleep(1.0)
        for p in self.started:
            name = names.get(id(p))
            if name is not None:
                print(f"---- {name} (pid {p.pid}, {'running' if p.poll() is None else f'exit {p.returncode}'}), "
                      f"end of its output ----\n{self.output(name)[-6000:]}")
        self._report_sockets()

    def _report_sockets(self) -> None:
        """The kernel's view of the TCP sockets of the processes still running (``ss``):
        a connection that hears nothing shows whether its SYN is sent, refused or made."""
        pids = [f"pid={p.pid}," for p in self.started if p.poll() is None]
        try:
            table = subprocess.run(["ss", "-tanp"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return
        mine = [line for line in table.splitlines() if any(pid in line for pid in pids)]
        if mine:
            print("---- their TCP sockets (ss -tanp) ----\n" + "\n".join(mine[:200]))

    def kill_all(self) -> None:
        """Kill every process started here that still runs, and what it started: torchrun's
        workers run in sessions of their own (torch elastic starts them so), which a kill
        of torchrun or of its process group would leave running."""
        for p in self.started:
            if p.poll() is None:
                tree = descendants(p.pid)  # read while p lives: they are its children, not reused pids
                p.kill()
                for pid in tree:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            p.wait(10)


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from Linux's ``/proc/*/stat``)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after the command name, which may hold spaces
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        children = [c for c, pp in parent.items() if pp == p]
        out += children
        todo += children
    return out


def of(records: Iterable[SyncerRecord], *kinds: type[SyncerRecord]) -> list:
    """The records among ``records`` that are of one of ``kinds`` (all of them without kinds)."""
    return [r for r in records if isinstance(r, kinds or SyncerRecord)]


_READ: dict[Path, tuple[int, list[SyncerRecord]]] = {}
"""Per log file, the bytes read so far and their records: tests poll a log every 50 ms,
and reading it whole each time cost a core's worth of parsing on a long log. The files
read last only (``_KEEP``): a finished test's log is not read again."""
_KEEP = 8


def read_records(path: Path) -> list[SyncerRecord]:
    """Every record of the syncer log at ``path``, typed (``read_event``), parsing only
    the lines added since the last call for ``path``; a last line still being written is
    left for the next call."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return []
    done, records = _READ.get(path, (0, []))
    if size < done:  # written anew
        done, records = 0, []
    with open(path, "rb") as f:
        f.seek(done)
        complete = f.read(size - done).rpartition(b"\n")[0]
    if complete:
        records = records + [read_event(json.loads(line)) for line in complete.splitlines() if line.strip()]
        done += len(complete) + 1
    _READ.pop(path, None)
    _READ[path] = (done, records)  # the newest last: the oldest go first
    while len(_READ) > _KEEP:
        del _READ[next(iter(_READ))]
    return list(records)


def events(tmp: Path, *kinds: type[SyncerRecord]) -> list:
    """The syncer's log records so far (``tmp/events.jsonl``), typed, of ``kinds`` if given."""
    return of(read_records(tmp / "events.jsonl"), *kinds)


def progress(path: Path) -> tuple[int, list[int]]:
    try:
        step, *versions = path.read_text().split()
        return int(step), [int(v) for v in versions]
    except (FileNotFoundError, ValueError):
        return 0, []


def finish(proc: subprocess.Popen, procs: Procs, name: str, timeout: float = 60) -> None:
    timeout *= TIME_SCALE
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} did not finish in {timeout}s:\n{procs.output(name)[-3000:]}") from None
    assert rc == 0, f"{name} exited {rc}:\n{procs.output(name)[-3000:]}"


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
