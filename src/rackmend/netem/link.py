"""A userspace TCP proxy that behaves like a slow, jittery, unreliable WAN link.

Model of one direction of a link (client -> target is "up", target -> client "down"):

1. read a chunk from the sending socket (at most about 5 ms worth of bandwidth, so
   a chunk behaves like a burst of packets, not like a whole message);
2. serialise it through the direction's token bucket, which every connection through
   the link shares (the cap is for the pipe, not per connection);
3. propagate it: it is released ``latency * (1 + U(-jitter, jitter))`` after its
   serialisation finished, but never before the chunk ahead of it (TCP keeps order);
4. write it to the receiving socket and wait for the socket to drain.

Bandwidth comes before latency so that latency stays additive under load, as on a real
pipe (a chunk waits for its turn on the wire, then flies); throughput is the same
either way. While more than ``max_buffer_bytes`` of a connection's direction is in
flight (a receiver that does not read), the proxy stops reading from the sender, so
back-pressure reaches it through TCP and memory stays bounded.

Outages, scheduled relative to :meth:`LinkEmulator.start`:

- ``drop``: every connection through the link is reset (both the client's and the
  target's side see the connection die, ``ECONNRESET``) when the outage begins, and a
  connection made during the outage is accepted and reset at once. After the outage,
  new connections work; nothing is reconnected by the link itself.
- ``blackhole``: connections stay open but nothing moves in either direction; bytes
  already in flight are held, the senders' sockets fill up, and everything is
  delivered, in order and intact, once the outage ends. This is what an application
  sees when a path silently discards packets for a while: TCP cannot lose bytes
  without breaking the stream, so it retransmits and the stream stalls. (A stall
  longer than the peers' TCP retransmission limit, minutes, would break connections on
  a real path; here it never does.) At the end of a blackhole the bytes that were in
  flight (at most about ``latency`` times the bandwidth) are released at once.
- ``throttle``: connections stay open and bytes keep moving, but at most at the
  outage's ``rate_bps`` (the lower of it and the link's own cap): a shared path that
  congests for a while. The link's own cap is back in force when it ends.

Overlapping outages combine: ``drop`` wins over ``blackhole`` while both are active,
and the lowest rate of the active throttles applies.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rackmend.config import ConfigError

__all__ = [
    "OUTAGE_MODES",
    "Outage",
    "LinkConfig",
    "LinkEmulator",
    "parse_rate",
    "parse_duration",
    "parse_size",
]

OUTAGE_MODES = ("drop", "blackhole", "throttle")

log = logging.getLogger(__name__)

# Timeline samples kept by stats(): at the default 0.25 s this is a bit over 8 hours,
# so a long CLI run cannot grow memory without bound.
_TIMELINE_MAX = 120_000
_MAX_CHUNK = 64 * 1024
_MIN_CHUNK = 1500
# About this much wire time per chunk: small enough that a chunk is not a visible
# lump at the receiver, large enough that a fast link does not cost a task switch per
# packet.
_CHUNK_SECONDS = 0.005
_CONNECT_TIMEOUT_S = 10.0
_CALL_TIMEOUT_S = 5.0


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- parsing

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def _prefix(p: str) -> float | None:
    p = p.lower()
    return _SI.get(p, _BIN.get(p))


def parse_rate(text: str | float) -> float:
    """A bandwidth in bits per second.

    Accepts a plain number (bits/s), bit units ``bit``, ``kbit``, ``Mbit``, ``Gbit``,
    ``Tbit`` (decimal, as ``tc`` counts; case does not matter; an optional ``/s``),
    binary ``Kibit``/``Mibit``/``Gibit``, and byte units ``B/s``, ``kB/s``, ``MB/s``,
    ``GB/s``, ``KiB/s``, ``MiB/s`` (capital ``B``). ``Mbps``-style spellings are
    refused because ``tc`` reads them as bytes and most people as bits.
    """
    if _finite_number(text):
        value = float(text)  # type: ignore[arg-type]
    else:
        s = str(text).strip()
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)(?:/s)?", s)
        if m is None:
            raise ConfigError(
                f"bandwidth {text!r} is not a rate; write e.g. '50Mbit', '800kbit', '1Gbit' or '10MB/s'"
            )
        number, unit = float(m.group(1)), m.group(2)
        if unit.lower().endswith("bps"):
            raise ConfigError(
                f"bandwidth {text!r} is ambiguous (bits or bytes?); write '{m.group(1)}{unit[:-3]}bit' "
                f"for bits/s or '{m.group(1)}{unit[:-3]}B/s' for bytes/s"
            )
        if unit == "" or unit.lower().endswith("bit"):
            scale = _prefix(unit[:-3] if unit else "")
            per = 1.0
        elif unit.endswith("B"):
            scale = _prefix(unit[:-1])
            per = 8.0
            if "/s" not in s:
                raise ConfigError(f"bandwidth {text!r} needs '/s' after the byte unit, e.g. '{s}/s'")
        else:
            scale = None
            per = 1.0
        if scale is None:
            raise ConfigError(
                f"bandwidth {text!r} has an unknown unit {unit!r}; use bit, kbit, Mbit, Gbit or B/s, kB/s, MB/s"
            )
        value = number * scale * per
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"bandwidth {text!r} must be a positive rate")
    return value


_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float) -> float:
    """A duration in seconds: a plain number (seconds) or a number with ``us``,
    ``ms``, ``s``, ``m``/``min`` or ``h``, e.g. ``'100ms'``, ``'1.5s'``, ``'2m'``."""
    if _finite_number(text):
        value = float(text)  # type: ignore[arg-type]
    else:
        m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
        if m is None or m.group(2) not in _DURATION_UNITS:
            raise ConfigError(f"duration {text!r} is not a duration; write e.g. '100ms', '1.5s', '2m' or '30'")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"duration {text!r} must be >= 0 seconds")
    return value


def parse_size(text: str | int) -> int:
    """A byte count: a plain number or ``kB``/``MB``/``GB`` (decimal) or
    ``KiB``/``MiB``/``GiB`` (binary), e.g. ``'64KiB'``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", str(text).strip())
        unit = m.group(2) if m else ""
        scale = _prefix(unit[:-1]) if unit.upper().endswith("B") else (1.0 if unit == "" else None)
        if m is None or scale is None:
            raise ConfigError(f"size {text!r} is not a byte count; write e.g. '65536', '64KiB' or '1MB'")
        value = float(m.group(1)) * scale
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise ConfigError(f"size {text!r} must be a whole number of bytes >= 1")
    return int(value)


# --------------------------------------------------------------------------- config


@dataclass(kw_only=True, frozen=True)
class Outage:
    """A window during which the link is down (see the module docstring)."""

    start: float
    """Seconds after :meth:`LinkEmulator.start` at which the outage begins."""

    duration: float
    """How long the outage lasts, in seconds (> 0)."""

    mode: str = "drop"
    """``drop``: reset every connection and reset new ones for the duration.
    ``blackhole``: keep connections open but move no byte either way for the
    duration; held bytes are delivered afterwards, in order (a stall).
    ``throttle``: cap each direction at ``rate_bps`` for the duration."""

    rate_bps: float | None = None
    """The cap of a ``throttle`` outage in bits per second (required for it, and only
    for it); the link's own ``bandwidth_bps``, if lower, still applies."""

    def __post_init__(self) -> None:
        _check(
            _finite_number(self.start) and self.start >= 0,
            f"Outage.start must be a number of seconds >= 0 after the link starts, got {self.start!r}",
        )
        _check(
            _finite_number(self.duration) and self.duration > 0,
            f"Outage.duration must be a number of seconds > 0, got {self.duration!r}; "
            "leave the outage out instead of giving it no length",
        )
        _check(
            self.mode in OUTAGE_MODES,
            f"Outage.mode={self.mode!r} is not known; use one of {', '.join(OUTAGE_MODES)}",
        )
        if self.mode == "throttle":
            _check(
                _finite_number(self.rate_bps) and self.rate_bps is not None and self.rate_bps > 0,
                f"Outage.rate_bps must be a positive number of bits/s for a throttle, got {self.rate_bps!r}; "
                "write e.g. '30:10:throttle=200kbit'",
            )
        else:
            _check(
                self.rate_bps is None,
                f"Outage.rate_bps={self.rate_bps!r} is only for mode='throttle' (mode is {self.mode!r}); "
                "leave it out, or use mode='throttle' to slow the link down",
            )

    @property
    def end(self) -> float:
        """Seconds after the link starts at which the outage is over."""
        return self.start + self.duration

    @classmethod
    def parse(cls, text: str) -> Outage:
        """``START:DURATION[:MODE]``, e.g. ``'30:10:drop'``, ``'1m:500ms:blackhole'``,
        ``'40:8:throttle=200kbit'`` (see :func:`parse_rate` for the rate)."""
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(
                f"outage {text!r} is not START:DURATION[:MODE]; write e.g. '30:10:drop', '5s:2s:blackhole' "
                "or '40:8:throttle=200kbit'"
            )
        mode = parts[2] if len(parts) == 3 else "drop"
        rate = None
        if mode.startswith("throttle"):
            name, eq, value = mode.partition("=")
            if name != "throttle" or not eq:
                raise ConfigError(f"outage {text!r}: a throttle needs its rate, e.g. 'throttle=200kbit'")
            mode, rate = name, parse_rate(value)
        return cls(start=parse_duration(parts[0]), duration=parse_duration(parts[1]), mode=mode, rate_bps=rate)


@dataclass(kw_only=True, frozen=True)
class LinkConfig:
    """How a :class:`LinkEmulator` treats the bytes it carries. Every limit applies to
    each direction separately (a link is a pair of pipes)."""

    bandwidth_bps: float | None = None
    """Cap in bits per second, per direction, for the whole link (all connections
    through it share it). None: no cap. See :func:`parse_rate` for ``'50Mbit'``."""

    latency_s: float = 0.0
    """One-way delay added to every byte, in seconds (the RTT grows by twice this)."""

    jitter: float = 0.0
    """Spread of the delay as a fraction of ``latency_s``, in [0, 1]: each chunk's delay
    is ``latency_s * (1 + U(-jitter, jitter))``. Order is kept: a chunk is never
    released before the one ahead of it, so a late chunk holds up the ones behind."""

    burst_bytes: int = 64 * 1024
    """Depth of the token bucket: how many bytes may pass at line speed after the
    link has been idle. Also the largest chunk the link moves at once."""

    outages: tuple[Outage, ...] = ()
    """Scheduled outages, relative to :meth:`LinkEmulator.start`."""

    seed: int = 0
    """Seed of the jitter; the same seed gives each connection the same delays."""

    def __post_init__(self) -> None:
        # A list is the natural thing to pass; keep the frozen config hashable anyway.
        object.__setattr__(self, "outages", tuple(self.outages))
        if self.bandwidth_bps is not None:
            _check(
                _finite_number(self.bandwidth_bps) and self.bandwidth_bps > 0,
                f"bandwidth_bps must be a positive number of bits/s or None for no cap, got {self.bandwidth_bps!r}; "
                "LinkConfig.parse_rate('50Mbit') converts a rate written with units",
            )
        _check(
            _finite_number(self.latency_s) and self.latency_s >= 0,
            f"latency_s must be a number of seconds >= 0, got {self.latency_s!r}; "
            "LinkConfig.parse_duration('100ms') converts a duration written with units",
        )
        _check(
            _finite_number(self.jitter) and 0 <= self.jitter <= 1,
            f"jitter must be a fraction of latency_s in [0, 1], got {self.jitter!r}; "
            "0.5 lets each delay vary by +-50 %",
        )
        _check(
            isinstance(self.burst_bytes, int) and not isinstance(self.burst_bytes, bool) and self.burst_bytes >= _MIN_CHUNK,
            f"burst_bytes must be a whole number of bytes >= {_MIN_CHUNK} (one Ethernet frame), "
            f"got {self.burst_bytes!r}; 65536 is a sane default",
        )
        for o in self.outages:
            _check(isinstance(o, Outage), f"outages must hold Outage objects, got {o!r}; build them with Outage(...)")
        _check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            f"seed must be an int, got {self.seed!r}",
        )

    parse_rate = staticmethod(parse_rate)
    parse_duration = staticmethod(parse_duration)
    parse_size = staticmethod(parse_size)

    def describe(self) -> str:
        """One line for logs, e.g. ``'50 Mbit/s, 100 ms +-50 %, 1 outage'``."""
        bw = "unlimited" if self.bandwidth_bps is None else f"{self.bandwidth_bps / 1e6:g} Mbit/s"
        lat = f"{self.latency_s * 1e3:g} ms"
        if self.jitter:
            lat += f" +-{self.jitter * 100:g} %"
        parts = [bw, lat]
        if self.outages:
            parts.append(f"{len(self.outages)} outage{'s' if len(self.outages) > 1 else ''}")
        return ", ".join(parts)


# --------------------------------------------------------------------------- machinery


class _TokenBucket:
    """Serialisation of one direction of a link.

    Tokens may go negative: a chunk larger than the tokens at hand is admitted and the
    debt is paid by waiting. Debt accumulates across callers, so concurrent
    connections queue behind each other in arrival order without a lock.
    """

    def __init__(self, rate_bps: float | None, depth: int, now: float) -> None:
        self._rate: float | None = None if rate_bps is None else rate_bps / 8.0
        self._depth = float(depth)
        self._tokens = float(depth)
        self._last = now

    def _refill(self, now: float) -> None:
        if self._rate is not None:
            self._tokens = min(self._depth, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def configure(self, rate_bps: float | None, depth: int, now: float) -> None:
        self._refill(now)  # time so far counts at the old rate
        was_unlimited = self._rate is None
        self._rate = None if rate_bps is None else rate_bps / 8.0
        self._depth = float(depth)
        self._tokens = float(depth) if was_unlimited else min(self._tokens, self._depth)

    def reserve(self, n: int, now: float) -> float:
        """Take n bytes' worth of tokens; the time at which they have been sent."""
        if self._rate is None:
            return now
        self._refill(now)
        self._tokens -= n
        return now + max(0.0, -self._tokens) / self._rate

    def chunk_size(self) -> int:
        if self._rate is None:
            return _MAX_CHUNK
        return int(min(_MAX_CHUNK, self._depth, max(_MIN_CHUNK, self._rate * _CHUNK_SECONDS)))


def _first_error(tasks: set[asyncio.Task[None]]) -> BaseException | None:
    """The first failure among finished tasks; every one is retrieved so asyncio does
    not log 'exception was never retrieved' for the others."""
    errors = [t.exception() for t in tasks if not t.cancelled()]
    return next((e for e in errors if e is not None), None)


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with RST, as a broken path looks to both peers."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Conn:
    def __init__(self, cid: int, client: asyncio.StreamWriter) -> None:
        self.cid = cid
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.target)


class LinkEmulator:
    """A TCP proxy from ``listen`` to ``target`` that behaves like a WAN link.

    Runs its own asyncio loop on a daemon thread, so it fits next to blocking code
    (ZeroMQ sockets, training loops). Point the client at :attr:`address` instead of
    the target::

        with LinkEmulator(("127.0.0.1", 7000), LinkConfig(bandwidth_bps=50e6, latency_s=0.1)).start() as link:
            connect(link.address)
    """

    def __init__(
        self,
        target: tuple[str, int],
        config: LinkConfig,
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        name: str = "link",
        sample_interval: float = 0.25,
        max_buffer_bytes: int = 4 << 20,
    ) -> None:
        if not isinstance(config, LinkConfig):
            raise TypeError(f"config must be a LinkConfig, got {type(config).__name__}")
        _check(sample_interval > 0, f"sample_interval must be > 0 seconds, got {sample_interval!r}")
        _check(max_buffer_bytes >= _MAX_CHUNK, f"max_buffer_bytes must be >= {_MAX_CHUNK}, got {max_buffer_bytes!r}")
        self.target = (str(target[0]), int(target[1]))
        self.listen = (str(listen[0]), int(listen[1]))
        self.name = name
        self._config = config
        self._sample_interval = float(sample_interval)
        self._max_buffer = int(max_buffer_bytes)

        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._server: asyncio.AbstractServer | None = None
        self._port = 0
        self._t0 = 0.0
        self._closed = False

        # Loop-thread state.
        self._buckets: dict[str, _TokenBucket] = {}
        self._flowing: asyncio.Event | None = None
        self._dropping = False
        self._rate_in_force: float | None = None
        """The cap the token buckets use now: the config's, or an active throttle's."""
        self._conns: dict[int, _Conn] = {}
        self._next_cid = 0
        self._timers: list[asyncio.TimerHandle] = []
        self._ticker: asyncio.Task[None] | None = None

        # Counters: written only on the loop thread; ints read from another thread
        # are whole values under the GIL, the timeline deque is not, hence the lock.
        self._bytes = {"up": 0, "down": 0}
        self._connections = 0
        self._dropped = 0
        self._refused = 0
        self._timeline: deque[tuple[float, int, int]] = deque(maxlen=_TIMELINE_MAX)
        self._timeline_lock = threading.Lock()

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> LinkConfig:
        """The configuration in force."""
        return self._config

    @property
    def port(self) -> int:
        """The listening port (known once started)."""
        if not self._port:
            raise RuntimeError(f"{self.name}: not started; call start() first")
        return self._port

    @property
    def address(self) -> str:
        """The listening endpoint as a ZeroMQ address, ``tcp://HOST:PORT``."""
        return f"tcp://{self.listen[0]}:{self.port}"

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when the link started; outages count from here."""
        if not self._port:
            raise RuntimeError(f"{self.name}: not started; call start() first")
        return self._t0

    def start(self, timeout: float = 10.0) -> LinkEmulator:
        """Start listening on a daemon thread; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: start() was already called")
        self._thread = threading.Thread(target=self._thread_main, name=f"netem-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.close()
            raise RuntimeError(f"{self.name}: the link did not start within {timeout} s")
        if self._start_error is not None:
            self._thread.join(timeout)
            raise self._start_error
        return self

    def set_config(self, config: LinkConfig) -> None:
        """Replace the configuration while running (from any thread); returns once in force.

        Rate and burst apply to the next chunk, latency and jitter to chunks read from
        now on (order is still kept), and outages are rescheduled relative to the
        original start: an outage whose window includes now begins at once.
        """
        if not isinstance(config, LinkConfig):
            raise TypeError(f"config must be a LinkConfig, got {type(config).__name__}")
        if self._loop is None or not self._port:
            self._config = config
            return
        if self._closed:
            raise RuntimeError(f"{self.name}: the link is closed")
        fut = asyncio.run_coroutine_threadsafe(self._apply_config(config), self._loop)
        fut.result(_CALL_TIMEOUT_S)

    def stats(self) -> dict[str, Any]:
        """Counters since start.

        ``bytes_up``/``bytes_down``: bytes handed to the receiving socket,
        client->target / target->client;
        ``connections``: connections accepted and carried; ``active_connections``;
        ``dropped_connections``: connections reset by a ``drop`` outage;
        ``refused_connections``: connections reset on arrival during one;
        ``timeline``: ``(seconds since start, bytes_up, bytes_down)`` samples every
        ``sample_interval`` seconds (the newest ~8 hours at the default).
        """
        with self._timeline_lock:
            timeline = list(self._timeline)
        return {
            "name": self.name,
            "uptime_s": (time.monotonic() - self._t0) if self._port else 0.0,
            "bytes_up": self._bytes["up"],
            "bytes_down": self._bytes["down"],
            "connections": self._connections,
            "active_connections": len(self._conns),
            "dropped_connections": self._dropped,
            "refused_connections": self._refused,
            "timeline": timeline,
        }

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, reset every connection and join the thread (at most ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            try:
                fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
                fut.result(timeout)
            except Exception:
                pass  # the loop is stopped below regardless
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass  # loop already closed
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> LinkEmulator:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.listen[0]}:{self._port}" if self._port else "not started"
        return f"LinkEmulator({self.name!r}, {where} -> {self.target[0]}:{self.target[1]}, {self._config.describe()})"

    # ------------------------------------------------------------------ loop thread

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                loop.run_until_complete(self._startup())
            except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                self._start_error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.wait(pending, timeout=_CALL_TIMEOUT_S))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _startup(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        cfg = self._config
        self._buckets = {d: _TokenBucket(cfg.bandwidth_bps, cfg.burst_bytes, now) for d in ("up", "down")}
        self._rate_in_force = cfg.bandwidth_bps
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._on_client, self.listen[0], self.listen[1])
        self._port = self._server.sockets[0].getsockname()[1]
        # loop.time() is time.monotonic() for the default loop; started_at relies on it.
        self._t0 = loop.time()
        self._schedule_outages()
        self._ticker = asyncio.create_task(self._tick())

    async def _apply_config(self, config: LinkConfig) -> None:
        now = asyncio.get_running_loop().time()
        for bucket in self._buckets.values():
            bucket.configure(config.bandwidth_bps, config.burst_bytes, now)
        self._rate_in_force = config.bandwidth_bps
        self._config = config
        self._schedule_outages()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for h in self._timers:
            h.cancel()
        if self._ticker is not None:
            self._ticker.cancel()
        for conn in list(self._conns.values()):
            # Not a broken path: let the kernel close normally (RST only if unread data).
            conn.client.transport.abort()
            if conn.target is not None:
                conn.target.transport.abort()
            if conn.task is not None:
                conn.task.cancel()
        tasks = [c.task for c in self._conns.values() if c.task is not None]
        if self._ticker is not None:
            tasks.append(self._ticker)
        if tasks:
            await asyncio.wait(tasks, timeout=_CALL_TIMEOUT_S)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), _CALL_TIMEOUT_S)
            except (asyncio.TimeoutError, OSError):
                pass

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        k = 0
        while True:
            with self._timeline_lock:
                self._timeline.append((round(loop.time() - self._t0, 6), self._bytes["up"], self._bytes["down"]))
            k += 1
            # Absolute schedule: a late wake-up does not shift every later sample.
            await asyncio.sleep(max(0.0, self._t0 + k * self._sample_interval - loop.time()))

    # outages

    def _schedule_outages(self) -> None:
        loop = asyncio.get_running_loop()
        for h in self._timers:
            h.cancel()
        self._timers = []
        rel = loop.time() - self._t0
        for o in self._config.outages:
            for boundary in (o.start, o.end):
                if boundary > rel:
                    self._timers.append(loop.call_at(self._t0 + boundary, self._update_outages, boundary))
        self._update_outages(rel)

    def _update_outages(self, at: float) -> None:
        # `at` is the boundary the timer was set for: the loop may fire a timer a clock
        # tick early, and the state must be the one from the boundary on.
        active = [o for o in self._config.outages if o.start <= at < o.end]
        dropping = any(o.mode == "drop" for o in active)
        stalled = not dropping and any(o.mode == "blackhole" for o in active)
        caps = [o.rate_bps for o in active if o.mode == "throttle" and o.rate_bps is not None]
        base = self._config.bandwidth_bps
        rate = min(caps + ([base] if base is not None else [])) if caps else base
        if rate != self._rate_in_force:
            now = asyncio.get_running_loop().time()
            for bucket in self._buckets.values():
                bucket.configure(rate, self._config.burst_bytes, now)
            self._rate_in_force = rate
        assert self._flowing is not None
        if stalled:
            self._flowing.clear()
        else:
            self._flowing.set()
        if dropping and not self._dropping:
            for conn in list(self._conns.values()):
                self._dropped += 1
                conn.reset()
                if conn.task is not None:
                    conn.task.cancel()  # its pipes may be asleep on latency
        self._dropping = dropping

    # connections

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine: asyncio (3.11) logs an error when the task
        # it makes for a coroutine callback ends cancelled, and a drop cancels it.
        if self._dropping or self._closed:
            self._refused += 1
            _reset(writer)
            return
        cid = self._next_cid
        self._next_cid += 1
        conn = _Conn(cid, writer)
        self._conns[cid] = conn
        self._connections += 1
        conn.task = asyncio.get_running_loop().create_task(self._carry(conn, reader, writer))

    async def _carry(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = conn.cid
        tasks: list[asyncio.Task[None]] = []
        try:
            t_reader, t_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target[0], self.target[1]), _CONNECT_TIMEOUT_S
            )
            conn.target = t_writer
            seed = self._config.seed
            tasks = [
                asyncio.create_task(self._pipe(reader, t_writer, "up", random.Random(f"{seed}/{cid}/up"))),
                asyncio.create_task(self._pipe(t_reader, writer, "down", random.Random(f"{seed}/{cid}/down"))),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            error = _first_error(done)
            if error is not None:
                if not isinstance(error, OSError):
                    log.warning("%s: connection %d failed: %r", self.name, cid, error)
                conn.reset()  # one side broke: the other side sees it break too
            else:
                for w in (writer, t_writer):
                    w.close()
                for w in (writer, t_writer):
                    try:
                        await asyncio.wait_for(w.wait_closed(), _CALL_TIMEOUT_S)
                    except (OSError, asyncio.TimeoutError):
                        pass
        except (OSError, asyncio.TimeoutError):
            # Target unreachable: the client sees its connection fail, as it would
            # without the proxy (only later than a direct connect would).
            conn.reset()
        finally:
            self._conns.pop(cid, None)
            for t in tasks:
                t.cancel()
            for w in (writer, conn.target):
                if w is not None and not w.transport.is_closing():
                    w.transport.abort()
            if tasks:
                await asyncio.wait(tasks, timeout=_CALL_TIMEOUT_S)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str, rng: random.Random
    ) -> None:
        """One direction of one connection: an ingress and an egress stage joined by
        a queue of (release time, chunk)."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        room = asyncio.Event()
        room.set()
        inflight = 0
        loop = asyncio.get_running_loop()
        bucket = self._buckets[direction]
        flowing = self._flowing
        assert flowing is not None

        async def ingress() -> None:
            nonlocal inflight
            prev_release = 0.0
            while True:
                await flowing.wait()  # blackhole: stop reading so the sender's socket fills
                if inflight >= self._max_buffer:
                    room.clear()
                    await room.wait()
                    continue
                data = await src.read(bucket.chunk_size())
                if not data:
                    queue.put_nowait(None)
                    return
                sent_at = bucket.reserve(len(data), loop.time())
                wait = sent_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                cfg = self._config
                delay = cfg.latency_s * (1.0 + rng.uniform(-cfg.jitter, cfg.jitter)) if cfg.jitter else cfg.latency_s
                prev_release = max(prev_release, sent_at + delay)
                inflight += len(data)
                queue.put_nowait((prev_release, data))

        async def egress() -> None:
            nonlocal inflight
            while True:
                item = await queue.get()
                if item is None:
                    if dst.can_write_eof() and not dst.transport.is_closing():
                        dst.write_eof()  # half-close, as the sender did
                    return
                release, data = item
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await flowing.wait()
                # Counted first: write() may hand the bytes to the peer at once, and a
                # reader on another thread must not see them before the counter does.
                self._bytes[direction] += len(data)
                dst.write(data)
                await dst.drain()
                inflight -= len(data)
                if inflight < self._max_buffer:
                    room.set()

        stages = [asyncio.create_task(ingress()), asyncio.create_task(egress())]
        try:
            done, _ = await asyncio.wait(stages, return_when=asyncio.FIRST_EXCEPTION)
            error = _first_error(done)
            if error is not None:
                raise error
            # ingress finished cleanly (EOF); egress flushes the rest.
            await stages[1]
        finally:
            for t in stages:
                t.cancel()
            await asyncio.wait(stages, timeout=_CALL_TIMEOUT_S)

