"""Resume tokens kept on the learner's host, so that a restarted learner process takes
its id back at once.

The syncer gives each learner rank a token when it joins (``welcome``). A hello that
presents it takes the rank back at once; any other hello for a live or recently silent
rank waits for ``--takeover-after`` (30 s by default): a stranger, or a learner paused
for a few seconds (a GC, a checkpoint write), no longer loses its id to the first hello
after 5 s. A process that restarts has lost its memory, so the link keeps the token in a
file of its own (mode 0600) named after the endpoint, learner id and rank, with the pid
of the process that wrote it. A new process uses a file only when that process is gone:
two live processes started with one id on one host still get the ``busy`` refusal that
says so, instead of taking the id from each other.

Without Curve keys the token travels in clear: it keeps out strangers who cannot read
the learner's traffic or its host's files, not an eavesdropper (docs/reliability.md).
Only the file and process table are touched here; nothing is sent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from rackmend.transport import wire

__all__ = ["TokenFile", "default_token_dir", "TOKEN_DIR_ENV"]

log = logging.getLogger("rackmend.link")

TOKEN_DIR_ENV = "RACKMEND_TOKEN_DIR"
"""Where links keep resume tokens; empty: nowhere (a restarted process then waits for
``--takeover-after``). Unset: ``$XDG_STATE_HOME/rackmend/tokens`` (``~/.local/state``)."""


def default_token_dir() -> Path | None:
    """The token folder ``TOKEN_DIR_ENV`` names, else the per-user state folder."""
    if TOKEN_DIR_ENV in os.environ:
        return Path(os.environ[TOKEN_DIR_ENV]) if os.environ[TOKEN_DIR_ENV] else None
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "rackmend" / "tokens"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a pid reused
    by another process; None where /proc cannot say. "" for a zombie (it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name in parentheses may hold spaces
    if len(fields) < 20:
        return None
    return "" if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, started: str | None) -> bool:
    if pid == os.getpid():
        return False  # our own earlier link: this process may take it back
    now = _start_time(pid)
    if now is not None:
        return now != "" and (started is None or now == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but belongs to another user
    return True


class TokenFile:
    """One learner rank's token for one syncer endpoint, in ``folder`` (None: kept in
    memory only)."""

    def __init__(self, folder: Path | None, endpoint: str, learner_id: str, rank: int) -> None:
        key = hashlib.sha256(f"{endpoint}\0{learner_id}\0{rank}".encode()).hexdigest()[:32]
        self.path = None if folder is None else folder / f"{key}.json"
        self._what = f"{learner_id} rank {rank} at {endpoint}"

    def load(self) -> str | None:
        """The token an earlier process left, where that process is gone; else None."""
        if self.path is None:
            return None
        try:
            raw = json.loads(self.path.read_text())
            token, pid, started = raw["token"], int(raw["pid"]), raw.get("started")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the resume token file %s (%s); this learner joins without it", self.path, exc)
            return None
        if not isinstance(token, str) or len(token) != wire.MAX_TOKEN_CHARS:
            log.warning("ignoring the resume token file %s (its token is not %d characters); this learner joins "
                        "without it", self.path, wire.MAX_TOKEN_CHARS)
            return None
        if _alive(pid, started if isinstance(started, str) else None):
            log.info("resume token of %s belongs to process %d, which still runs; joining without it", self._what,
                     pid)
            return None
        return token

    def save(self, token: str) -> None:
        """Keep ``token`` for a later process (written whole or not at all; a failure is
        logged once and the token kept in memory only)."""
        if self.path is None:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"token": token, "pid": os.getpid(), "started": _start_time(os.getpid())}, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the resume token of %s in %s (%s): a restarted process will wait for the "
                        "syncer's --takeover-after; set %s to a writable folder", self._what, self.path, exc,
                        TOKEN_DIR_ENV)
            self.path = None

    def forget(self) -> None:
        """The rank left cleanly: the syncer freed its id, the token means nothing now."""
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
