"""``rackmend link``: run one emulated WAN link (a TCP proxy) until interrupted.

Point a client at --listen instead of at --target; the bytes between them see the
bandwidth cap, the latency and jitter, and the outages given below. Every limit is
per direction. Stops on SIGINT or SIGTERM (exit status 0), or after --duration.

Example: a 50 Mbit/s link with 100 ms +-50 % one-way delay in front of a syncer on
port 7000, down (connections reset) from 30 s to 40 s after start:

  rackmend link --listen 127.0.0.1:7001 --target 127.0.0.1:7000 \\
      --bandwidth 50Mbit --latency 100ms --latency-jitter 0.5 --outage 30:10:drop
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable

from rackmend.cli import bandwidth_flag, refuse_renamed
from rackmend.config import ConfigError
from rackmend.netem.link import LinkConfig, LinkEmulator, Outage, parse_duration, parse_size

__all__ = ["add_arguments", "run", "main"]


def _host_port(text: str, *, allow_zero: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT; write e.g. 127.0.0.1:7001")
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: port {port!r} is not a number") from None
    if not (0 if allow_zero else 1) <= p <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: port must lie in {'0' if allow_zero else '1'}..65535" + (" (0 picks a free port)" if allow_zero else "")
        )
    return host, p


def _typed(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type whose error message is the parser's own, not 'invalid value'."""

    def convert(text: str) -> Any:
        try:
            return fn(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = fn.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``rackmend link``."""
    parser.add_argument(
        "--listen", type=lambda s: _host_port(s, allow_zero=True), default=("127.0.0.1", 0), metavar="HOST:PORT",
        help="where clients connect (default 127.0.0.1:0: a free port, printed at start)",
    )
    parser.add_argument(
        "--target", type=lambda s: _host_port(s, allow_zero=False), required=True, metavar="HOST:PORT",
        help="where the link leads, e.g. the syncer's endpoint 127.0.0.1:7000 (required)",
    )
    parser.add_argument(
        "--bandwidth", type=bandwidth_flag, default=None, metavar="RATE",
        help="cap per direction for the whole link, e.g. 50Mbit, 800kbit, 1Gbit, 10MB/s, or 'none' "
        "(default: no cap)",
    )
    parser.add_argument(
        "--latency", type=_typed(parse_duration), default=0.0, metavar="DURATION",
        help="one-way delay added to every byte, e.g. 100ms, 0.1 (seconds); the RTT grows by twice this (default 0)",
    )
    parser.add_argument(
        "--latency-jitter", type=float, default=0.0, metavar="FRACTION",
        help="each delay is latency*(1+U(-FRACTION, FRACTION)), FRACTION in [0, 1]; "
        "byte order is always kept (default 0)",
    )
    refuse_renamed(parser, {"--jitter": "--latency-jitter (one name for a latency spread in every command)"})
    parser.add_argument(
        "--burst", type=_typed(parse_size), default=64 * 1024, metavar="SIZE",
        help="token bucket depth: bytes that pass at line speed after idle, e.g. 64KiB (default 65536)",
    )
    parser.add_argument(
        "--outage", type=_typed(Outage.parse), action="append", default=[], metavar="START:DURATION[:MODE]",
        help="a scheduled outage, START and DURATION after the link starts (seconds or e.g. 30s, 500ms, 2m); "
        "MODE 'drop' (default) resets every connection and resets new ones until it ends, "
        "'blackhole' keeps connections open but moves nothing until it ends, then delivers "
        "everything held, 'throttle=RATE' (e.g. throttle=200kbit) caps the bandwidth at RATE "
        "until it ends. Repeat the flag for several outages",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter (default 0)")
    parser.add_argument("--name", default="link", help="name used in the stats lines (default 'link')")
    parser.add_argument(
        "--stats-every", type=_typed(parse_duration), default=5.0, metavar="DURATION",
        help="print a one-line stats summary this often (default 5s; 0: never)",
    )
    parser.add_argument(
        "--duration", type=_typed(parse_duration), default=0.0, metavar="DURATION",
        help="stop after this long (default 0: run until SIGINT/SIGTERM)",
    )


def _mbit(nbytes: float, seconds: float) -> str:
    return f"{nbytes * 8 / seconds / 1e6:.2f}" if seconds > 0 else "0.00"


def _stats_line(stats: dict[str, Any], prev: tuple[float, int, int]) -> str:
    t, up, down = stats["uptime_s"], stats["bytes_up"], stats["bytes_down"]
    dt = t - prev[0]
    return (
        f"{stats['name']}: t={t:.1f}s up={up / 1e6:.2f}MB ({_mbit(up - prev[1], dt)} Mbit/s) "
        f"down={down / 1e6:.2f}MB ({_mbit(down - prev[2], dt)} Mbit/s) "
        f"conns={stats['connections']} active={stats['active_connections']} "
        f"dropped={stats['dropped_connections']} refused={stats['refused_connections']}"
    )


def run(args: argparse.Namespace) -> int:
    """Run the link described by parsed ``args`` until a signal or ``--duration``."""
    try:
        config = LinkConfig(
            bandwidth_bps=args.bandwidth,
            latency_s=args.latency,
            jitter=args.latency_jitter,
            burst_bytes=args.burst,
            outages=tuple(args.outage),
            seed=args.seed,
        )
    except ConfigError as exc:
        print(f"rackmend link: error: {exc}", file=sys.stderr)
        return 2
    link = LinkEmulator(tuple(args.target), config, listen=tuple(args.listen), name=args.name)
    try:
        link.start()
    except OSError as exc:
        print(f"rackmend link: error: cannot listen on {args.listen[0]}:{args.listen[1]}: {exc}", file=sys.stderr)
        return 1

    stop = threading.Event()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        print(
            f"{args.name}: listening on {link.listen[0]}:{link.port} -> {link.target[0]}:{link.target[1]} "
            f"({config.describe()})",
            flush=True,
        )
        deadline = time.monotonic() + args.duration if args.duration > 0 else None
        prev = (0.0, 0, 0)
        while not stop.is_set():
            # Short waits so a signal is acted on promptly whatever --stats-every is.
            now = time.monotonic()
            step = 0.2
            if deadline is not None:
                if now >= deadline:
                    break
                step = min(step, deadline - now)
            stop.wait(step)
            stats = link.stats()
            if args.stats_every > 0 and stats["uptime_s"] - prev[0] >= args.stats_every:
                print(_stats_line(stats, prev), flush=True)
                prev = (stats["uptime_s"], stats["bytes_up"], stats["bytes_down"])
    finally:
        link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(_stats_line(link.stats(), (0.0, 0, 0)).replace(": t=", ": closed, t=", 1), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``rackmend link`` on its own; ``argv`` excludes the sub-command name."""
    parser = argparse.ArgumentParser(
        prog="rackmend link", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
