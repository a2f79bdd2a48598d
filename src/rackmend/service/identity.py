"""Who may speak as which learner, and how much a misbehaving peer may cost the syncer.

- ``load_key_ids``: with Curve, the learner ids each allowed public key may use, read
  from the allowed-keys directory (a key file's ``learners`` metadata, else its name).
- ``EventLimiter``: per-peer rate limit of the log lines that bad input produces, with
  a count of what was left out, so a junk flood cannot grow the log without bound.

Nothing here touches sockets; ``service.membership`` and ``service.syncer`` ask these
before they act.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable

from rackmend.config import ConfigError

__all__ = ["ANY_ID", "load_key_ids", "EventLimiter"]

ANY_ID = "*"
"""In a key file's ``learners`` metadata: the key may speak as any learner id."""


def _metadata_learners(path: Path) -> str | None:
    """The ``learners`` entry of a ZeroMQ certificate's ``metadata`` section, if any
    (``rackmend keygen --learners`` writes it)."""
    section = None
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            section = line.strip()
            continue
        if section == "metadata" and "=" in line:
            key, value = line.split("=", 1)
            if key.strip() == "learners":
                return value.strip().strip("'\"")
    return None


def load_key_ids(directory: str | Path) -> dict[str, frozenset[str] | None]:
    """Z85 public key -> the learner ids it may use (None: any id), for every ``*.key``
    file in ``directory``: its ``learners`` metadata (comma-separated, ``*`` for any)
    when present, else the file's name without ``.key`` (``rackmend keygen DIR l0``
    makes ``l0.key``, the key of learner ``l0``)."""
    import zmq.auth

    out: dict[str, frozenset[str] | None] = {}
    for path in sorted(Path(directory).glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except ValueError as exc:
            raise ConfigError(f"allowed key file {path}: {exc}") from None
        listed = _metadata_learners(path)
        ids = [x.strip() for x in (listed if listed is not None else path.stem).split(",") if x.strip()]
        if not ids:
            raise ConfigError(f"allowed key file {path}: its 'learners' metadata names no learner id; list the ids "
                              f"this key may use (e.g. learners = l0,l1) or {ANY_ID!r} for any")
        key = public.decode("ascii")
        before = out.get(key, frozenset())
        # One key in two files: the union of what both grant.
        out[key] = None if ANY_ID in ids or before is None else before | frozenset(ids)
    return out


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    fields: dict[str, Any] = field(default_factory=dict)


class EventLimiter:
    """At most ``burst`` records per key and ``window`` seconds; the rest are counted
    and reported by ``expired`` as one summary per key once its window has passed.
    Thread-safe: the authenticator's thread counts its refusals here too."""

    def __init__(self, burst: int = 5, window: float = 10.0) -> None:
        self.burst = burst
        self.window = window
        self._windows: dict[Hashable, _Window] = {}
        self._due: list[tuple[Hashable, int, dict[str, Any]]] = []
        self.suppressed_total = 0
        self._lock = threading.Lock()

    def allow(self, key: Hashable, now: float, *, burst: int | None = None, **summary_fields: Any) -> bool:
        """Whether a record for ``key`` may be written now (at most ``burst`` per window,
        this limiter's by default); ``summary_fields`` describe the key in the summary of
        what was left out."""
        with self._lock:
            return self._allow(key, now, self.burst if burst is None else burst, summary_fields)

    def _allow(self, key: Hashable, now: float, burst: int, summary_fields: dict[str, Any]) -> bool:
        w = self._windows.get(key)
        if w is None or now - w.start >= self.window:
            if w is not None and w.suppressed:
                self._due.append((key, w.suppressed, w.fields))
            w = self._windows[key] = _Window(now, fields=summary_fields)
        if w.logged < burst:
            w.logged += 1
            return True
        w.suppressed += 1
        self.suppressed_total += 1
        return False

    def expired(self, now: float) -> list[tuple[Hashable, int, dict[str, Any]]]:
        """(key, records left out, fields) of each window that has passed with some left
        out; windows that passed are forgotten (so idle peers cost nothing)."""
        with self._lock:
            out, self._due = self._due, []
            for key, w in list(self._windows.items()):
                if now - w.start >= self.window:
                    if w.suppressed:
                        out.append((key, w.suppressed, w.fields))
                    del self._windows[key]
            return out

    def flush(self) -> list[tuple[Hashable, int, dict[str, Any]]]:
        """Every pending summary, windows passed or not (at shutdown)."""
        out = self.expired(float("inf"))
        return out
