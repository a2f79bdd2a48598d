"""The WAN link emulator, measured over real sockets on 127.0.0.1: the bandwidth cap
holds, latency adds up, jitter keeps byte order, outages drop or stall, the config
can change at runtime, and ``rackmend link`` starts and stops cleanly."""

from __future__ import annotations

import queue
import re
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import pytest

from rackmend.config import ConfigError
from rackmend.netem import LinkConfig, LinkEmulator, Outage, parse_duration, parse_rate, parse_size
from rackmend.netem import cli

pytestmark = pytest.mark.timeout(60)

RATE_TOLERANCE = 0.10  # the requirement; not widened
SKIP_BYTES = 256 * 1024  # past the 64 KiB burst and the start-up transient


# --------------------------------------------------------------------------- helpers


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False


def _serve(handle: Callable[[socket.socket], None]) -> _Server:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.request.settimeout(15)
            try:
                handle(self.request)
            except OSError:
                pass  # the link reset us: expected in the outage tests

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def _echo(sock: socket.socket) -> None:
    while data := sock.recv(65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = _serve(_echo)
    yield server.server_address[:2]
    server.shutdown()
    server.server_close()


def _connect(link: LinkEmulator, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", link.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def _recv_all(sock: socket.socket, n: int, arrivals: list[tuple[float, int]]) -> bytes:
    """Read n bytes, noting (time, bytes so far) at every read."""
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
        arrivals.append((time.monotonic(), len(buf)))
    return bytes(buf)


def _rate_bps(arrivals: list[tuple[float, int]], skip: int = SKIP_BYTES) -> float:
    """Steady-state throughput: from the first read past `skip` bytes to the last."""
    first = next(a for a in arrivals if a[1] >= skip)
    last = arrivals[-1]
    return (last[1] - first[1]) * 8 / (last[0] - first[0])


def _rate_between(arrivals: list[tuple[float, int]], t0: float, t1: float) -> float:
    before = max((b for t, b in arrivals if t <= t0), default=0)
    upto = max((b for t, b in arrivals if t <= t1), default=0)
    return (upto - before) * 8 / (t1 - t0)


def _thread(target: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def _saturate(sock: socket.socket, stop: threading.Event,
              arrivals: list[tuple[float, int]]) -> tuple[threading.Thread, threading.Thread]:
    """Threads that keep ``sock`` full until ``stop`` and note (time, bytes so far) of
    every receive in ``arrivals``: the measured rate is what the link lets through."""
    def send() -> None:
        block = b"z" * 16384
        try:
            while not stop.is_set():
                sock.sendall(block)
        except OSError:
            pass

    def receive() -> None:
        got = 0
        try:
            while data := sock.recv(65536):
                got += len(data)
                arrivals.append((time.monotonic(), got))
        except OSError:
            pass

    return _thread(send), _thread(receive)


def _join(t: threading.Thread, timeout: float = 15.0) -> None:
    t.join(timeout)
    assert not t.is_alive(), "a helper thread did not finish in time"


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _is_dead(sock: socket.socket) -> bool:
    """True if the connection is reset or closed (an echo would answer otherwise)."""
    try:
        sock.sendall(b"?")
        return sock.recv(16) == b""
    except OSError:
        return True


def _records(n: int) -> bytes:
    return b"".join(b"%08d\n" % i for i in range(n))


# --------------------------------------------------------------------------- bandwidth


def test_rate_cap_holds_in_both_directions() -> None:
    cap = 8e6
    payload = bytes(range(256)) * 8000  # 2 s per direction at the cap, both directions at once
    n = len(payload)
    up_arrivals: list[tuple[float, int]] = []
    up_received: list[bytes] = []

    def source_sink(sock: socket.socket) -> None:
        sender = _thread(lambda: sock.sendall(payload))
        up_received.append(_recv_all(sock, n, up_arrivals))
        _join(sender)

    server = _serve(source_sink)
    try:
        with LinkEmulator(server.server_address[:2], LinkConfig(bandwidth_bps=cap)).start() as link:
            with _connect(link, timeout=15) as sock:
                sender = _thread(lambda: sock.sendall(payload))
                down_arrivals: list[tuple[float, int]] = []
                down = _recv_all(sock, n, down_arrivals)
                _join(sender)
            deadline = time.monotonic() + 5
            while not up_received and time.monotonic() < deadline:
                time.sleep(0.01)
            stats = link.stats()
    finally:
        server.shutdown()
        server.server_close()
    assert down == payload and up_received == [payload]
    assert stats["bytes_up"] == n and stats["bytes_down"] == n
    up, dn = _rate_bps(up_arrivals), _rate_bps(down_arrivals)
    print(f"configured {cap / 1e6:.2f} Mbit/s; measured up {up / 1e6:.3f}, down {dn / 1e6:.3f} Mbit/s")
    assert abs(up / cap - 1) <= RATE_TOLERANCE, f"up {up / 1e6:.3f} Mbit/s vs cap {cap / 1e6} Mbit/s"
    assert abs(dn / cap - 1) <= RATE_TOLERANCE, f"down {dn / 1e6:.3f} Mbit/s vs cap {cap / 1e6} Mbit/s"
    assert len(stats["timeline"]) >= 4 and stats["timeline"][-1][1] <= n


def test_rate_cap_is_shared_by_the_connections_of_a_link() -> None:
    n_each, cap = 1_000_000, 8e6  # the pipe, not each connection, carries 8 Mbit/s
    arrivals: list[tuple[float, int]] = []
    lock = threading.Lock()
    total = [0]

    def sink(sock: socket.socket) -> None:
        while data := sock.recv(65536):
            with lock:
                total[0] += len(data)
                arrivals.append((time.monotonic(), total[0]))

    server = _serve(sink)
    try:
        with LinkEmulator(server.server_address[:2], LinkConfig(bandwidth_bps=cap)).start() as link:
            socks = [_connect(link, timeout=15) for _ in range(2)]
            senders = [_thread(lambda s=s: s.sendall(b"x" * n_each)) for s in socks]
            for t in senders:
                _join(t)
            deadline = time.monotonic() + 10
            while total[0] < 2 * n_each and time.monotonic() < deadline:
                time.sleep(0.01)
            for s in socks:
                s.close()
    finally:
        server.shutdown()
        server.server_close()
    assert total[0] == 2 * n_each
    rate = _rate_bps(arrivals)
    print(f"two connections, configured {cap / 1e6:.2f} Mbit/s in all; measured {rate / 1e6:.3f} Mbit/s")
    assert abs(rate / cap - 1) <= RATE_TOLERANCE, f"{rate / 1e6:.3f} Mbit/s vs cap {cap / 1e6} Mbit/s"


def test_set_config_changes_the_rate_at_runtime(echo: tuple[str, int]) -> None:
    fast, slow = 16e6, 4e6
    arrivals: list[tuple[float, int]] = []
    stop = threading.Event()
    with LinkEmulator(echo, LinkConfig(bandwidth_bps=fast)).start() as link:
        sock = _connect(link, timeout=15)

        sender, receiver = _saturate(sock, stop, arrivals)
        t = time.monotonic()
        time.sleep(1.4)
        link.set_config(LinkConfig(bandwidth_bps=slow))
        t_change = time.monotonic()
        time.sleep(1.3)
        t_end = time.monotonic()
        stop.set()
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    _join(sender)
    _join(receiver)
    before = _rate_between(arrivals, t + 0.4, t_change)
    after = _rate_between(arrivals, t_change + 0.3, t_end)
    print(f"set_config: {fast / 1e6:g} -> {slow / 1e6:g} Mbit/s; measured {before / 1e6:.3f} -> {after / 1e6:.3f}")
    assert abs(before / fast - 1) <= RATE_TOLERANCE, f"before: {before / 1e6:.3f} Mbit/s vs {fast / 1e6}"
    assert abs(after / slow - 1) <= RATE_TOLERANCE, f"after: {after / 1e6:.3f} Mbit/s vs {slow / 1e6}"
    assert link.config.bandwidth_bps == slow


# --------------------------------------------------------------------------- latency


def _ping_rtts(sock: socket.socket, count: int) -> list[float]:
    rtts = []
    for i in range(count):
        msg = b"%063d" % i
        t = time.monotonic()
        sock.sendall(msg)
        assert _recv_exactly(sock, len(msg)) == msg
        rtts.append(time.monotonic() - t)
    return rtts


def test_latency_adds_to_the_round_trip(echo: tuple[str, int]) -> None:
    latency = 0.05
    with LinkEmulator(echo, LinkConfig(latency_s=latency)).start() as link, _connect(link) as sock:
        rtts = _ping_rtts(sock, 15)
    med = statistics.median(rtts)
    print(f"latency {latency * 1e3:g} ms one-way: RTT min {min(rtts) * 1e3:.1f}, median {med * 1e3:.1f}, "
          f"max {max(rtts) * 1e3:.1f} ms")
    # A byte cannot arrive before its delay: the floor is hard; the ceiling allows scheduling noise.
    assert min(rtts) >= 2 * latency - 0.002
    assert med <= 0.150


def test_jitter_varies_delay_but_keeps_order_and_content(echo: tuple[str, int]) -> None:
    latency, jitter = 0.04, 0.5
    cfg = LinkConfig(latency_s=latency, jitter=jitter, seed=1)
    with LinkEmulator(echo, cfg).start() as link, _connect(link, timeout=10) as sock:
        rtts = _ping_rtts(sock, 15)
        stream = _records(3000)
        batch = len(stream) // 300

        def send() -> None:
            for i in range(0, len(stream), batch):
                sock.sendall(stream[i : i + batch])
                time.sleep(0.002)  # separate chunks, each with its own random delay

        sender = _thread(send)
        echoed = _recv_exactly(sock, len(stream))
        _join(sender)
    spread = max(rtts) - min(rtts)
    print(f"jitter {jitter} on {latency * 1e3:g} ms: RTT {min(rtts) * 1e3:.1f}..{max(rtts) * 1e3:.1f} ms")
    assert min(rtts) >= 2 * latency * (1 - jitter) - 0.002
    assert spread >= 0.015, f"RTTs hardly vary ({spread * 1e3:.1f} ms): is the jitter applied?"
    assert echoed == stream


# --------------------------------------------------------------------------- outages


def test_drop_outage_resets_connections_then_recovers(echo: tuple[str, int]) -> None:
    start, duration = 1.0, 1.0
    cfg = LinkConfig(outages=(Outage(start=start, duration=duration, mode="drop"),))
    with LinkEmulator(echo, cfg).start() as link:
        t0 = link.started_at
        old = _connect(link)
        assert _ping_rtts(old, 1)
        assert time.monotonic() - t0 < start, "too slow to connect before the outage"
        _sleep_until(t0 + start + 0.2)
        assert _is_dead(old), "a connection survived a drop outage"
        old.close()
        try:
            during = _connect(link)
        except OSError:
            pass  # refused outright would do too
        else:
            with during:
                assert _is_dead(during), "a connection made during a drop outage carried data"
        assert time.monotonic() - t0 < start + duration, "too slow to probe inside the outage"
        _sleep_until(t0 + start + duration + 0.2)
        with _connect(link) as after:
            assert _ping_rtts(after, 3)
        stats = link.stats()
    assert stats["dropped_connections"] == 1
    assert stats["refused_connections"] >= 1
    assert stats["connections"] == 2 and stats["active_connections"] <= 1


def test_blackhole_outage_stalls_then_delivers_everything(echo: tuple[str, int]) -> None:
    start, duration = 0.5, 1.0
    cfg = LinkConfig(latency_s=0.01, outages=(Outage(start=start, duration=duration, mode="blackhole"),))
    stream = _records(200)
    arrivals: list[tuple[float, int]] = []
    with LinkEmulator(echo, cfg).start() as link:
        t0 = link.started_at
        with _connect(link, timeout=10) as sock:

            def send() -> None:
                for i in range(0, len(stream), 9):
                    _sleep_until(t0 + i / 9 * 0.01)  # 2 s of steady trickle
                    sock.sendall(stream[i : i + 9])

            sender = _thread(send)
            echoed = _recv_all(sock, len(stream), arrivals)
            _join(sender)
        stats = link.stats()
    assert echoed == stream
    rel = [(t - t0, b) for t, b in arrivals]
    assert any(t < start for t, _ in rel), "nothing arrived before the outage"
    inside = [(round(t, 3), b) for t, b in rel if start + 0.05 <= t < start + duration - 0.005]
    assert not inside, f"bytes arrived during the blackhole: {inside[:5]}"
    after = [t for t, _ in rel if t >= start + duration - 0.005]
    assert after and after[0] < start + duration + 0.25, "held bytes were not released after the outage"
    # What was sent during the outage came out promptly after it, not trickling later.
    sent_by_end = 9 * int((start + duration - 0.05) / 0.01)
    out_soon_after = max(b for t, b in rel if t <= start + duration + 0.25)
    assert out_soon_after >= sent_by_end, f"{out_soon_after} of {sent_by_end} held bytes released in 0.25 s"
    assert stats["dropped_connections"] == 0 and stats["refused_connections"] == 0


def test_throttle_outage_caps_the_rate_then_restores_it(echo: tuple[str, int]) -> None:
    fast, slow = 16e6, 4e6
    start, duration = 1.4, 1.4
    cfg = LinkConfig(bandwidth_bps=fast, outages=(Outage(start=start, duration=duration, mode="throttle",
                                                          rate_bps=slow),))
    arrivals: list[tuple[float, int]] = []
    stop = threading.Event()
    with LinkEmulator(echo, cfg).start() as link:
        t0 = link.started_at
        sock = _connect(link, timeout=15)

        sender, receiver = _saturate(sock, stop, arrivals)
        _sleep_until(t0 + start + duration + 1.3)
        stop.set()
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        stats = link.stats()
    _join(sender)
    _join(receiver)
    end = t0 + start + duration
    before = _rate_between(arrivals, t0 + 0.4, t0 + start)
    during = _rate_between(arrivals, t0 + start + 0.3, end)
    after = _rate_between(arrivals, end + 0.3, end + 1.2)
    print(f"throttle {fast / 1e6:g} -> {slow / 1e6:g} -> {fast / 1e6:g} Mbit/s; measured "
          f"{before / 1e6:.3f} -> {during / 1e6:.3f} -> {after / 1e6:.3f}")
    assert abs(before / fast - 1) <= RATE_TOLERANCE, f"before: {before / 1e6:.3f} Mbit/s vs {fast / 1e6}"
    assert abs(during / slow - 1) <= RATE_TOLERANCE, f"during: {during / 1e6:.3f} Mbit/s vs {slow / 1e6}"
    assert abs(after / fast - 1) <= RATE_TOLERANCE, f"after: {after / 1e6:.3f} Mbit/s vs {fast / 1e6}"
    assert stats["dropped_connections"] == 0 and stats["connections"] == 1


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "build,words",
    [
        (lambda: LinkConfig(bandwidth_bps=0), ["bandwidth_bps", "parse_rate"]),
        (lambda: LinkConfig(bandwidth_bps=float("inf")), ["bandwidth_bps", "None"]),
        (lambda: LinkConfig(latency_s=-0.1), ["latency_s", ">= 0"]),
        (lambda: LinkConfig(jitter=1.5), ["jitter", "[0, 1]"]),
        (lambda: LinkConfig(burst_bytes=100), ["burst_bytes", "1500"]),
        (lambda: LinkConfig(outages=("30:10",)), ["outages", "Outage("]),  # type: ignore[arg-type]
        (lambda: LinkConfig(seed="x"), ["seed"]),  # type: ignore[arg-type]
        (lambda: Outage(start=-1, duration=1), ["Outage.start", ">= 0"]),
        (lambda: Outage(start=0, duration=0), ["Outage.duration", "> 0"]),
        (lambda: Outage(start=0, duration=1, mode="stall"), ["Outage.mode", "drop", "blackhole", "throttle"]),
        (lambda: Outage(start=0, duration=1, mode="throttle"), ["Outage.rate_bps", "throttle=200kbit"]),
        (lambda: Outage(start=0, duration=1, rate_bps=1e6), ["Outage.rate_bps", "mode='throttle'"]),
        (lambda: Outage.parse("1:1:throttle"), ["throttle=200kbit"]),
        (lambda: Outage.parse("30"), ["START:DURATION"]),
        (lambda: parse_rate("50Mbps"), ["ambiguous", "50Mbit", "50MB/s"]),
        (lambda: parse_rate("10MB"), ["/s"]),
        (lambda: parse_rate("fast"), ["50Mbit"]),
        (lambda: parse_duration("soon"), ["100ms"]),
        (lambda: parse_size("1.5"), ["whole number"]),
    ],
)
def test_bad_config_names_the_field_and_the_fix(build: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_parsers() -> None:
    assert parse_rate("50Mbit") == 50e6
    assert parse_rate("1Gbit") == 1e9
    assert parse_rate("800kbit") == 800e3
    assert parse_rate("2.5mbit/s") == 2.5e6
    assert parse_rate("10MB/s") == 80e6
    assert parse_rate("1KiB/s") == 8192
    assert parse_rate("1000") == 1000 and parse_rate(1e6) == 1e6
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("1.5s") == 1.5 and parse_duration("2m") == 120 and parse_duration("30") == 30
    assert parse_size("64KiB") == 65536 and parse_size("1MB") == 1_000_000
    assert Outage.parse("30:10:drop") == Outage(start=30, duration=10, mode="drop")
    assert Outage.parse("1m:500ms:blackhole") == Outage(start=60, duration=0.5, mode="blackhole")
    assert Outage.parse("40:8:throttle=200kbit") == Outage(start=40, duration=8, mode="throttle", rate_bps=200e3)
    assert LinkConfig(outages=[Outage(start=1, duration=1)]).outages == (Outage(start=1, duration=1),)  # type: ignore[arg-type]
    assert LinkConfig.parse_rate is parse_rate or LinkConfig.parse_rate("1kbit") == 1000


def test_link_lifecycle(echo: tuple[str, int]) -> None:
    link = LinkEmulator(echo, LinkConfig())
    with pytest.raises(RuntimeError, match="start"):
        _ = link.port
    link.start()
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", link.address)
    with _connect(link) as sock:
        assert _ping_rtts(sock, 2)
    t = time.monotonic()
    link.close()
    link.close()  # idempotent
    assert time.monotonic() - t < 3
    assert link._thread is not None and not link._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", link.port), timeout=2).close()


# --------------------------------------------------------------------------- CLI


def test_cli_help_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--listen", "--target", "--bandwidth", "--latency", "--latency-jitter", "--burst", "--outage",
                 "--seed", "--stats-every", "--duration"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        cli.main(["--target", "127.0.0.1:1", "--bandwidth", "50Mbps"])
    assert info.value.code == 2
    assert "ambiguous" in capsys.readouterr().err
    assert cli.main(["--target", "127.0.0.1:1", "--latency-jitter", "2"]) == 2
    assert "jitter" in capsys.readouterr().err


def test_cli_runs_a_link_until_sigterm(echo: tuple[str, int]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rackmend.netem.cli", "--target", f"{echo[0]}:{echo[1]}",
         "--bandwidth", "20Mbit", "--latency", "5ms", "--stats-every", "0.2", "--name", "wan"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = _thread(lambda: [lines.put(line) for line in proc.stdout])  # type: ignore[union-attr]

    def next_line(pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"no line matching {pattern!r}; rc={proc.poll()}"
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if m := re.search(pattern, line):
                return m

    try:
        port = int(next_line(r"listening on 127\.0\.0\.1:(\d+) ->", timeout=30).group(1))
        payload = _records(10_000)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sender = _thread(lambda: sock.sendall(payload))
            assert _recv_exactly(sock, len(payload)) == payload
            _join(sender)
        next_line(rf"wan: t=.* up={len(payload) / 1e6:.2f}MB", timeout=5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()  # type: ignore[union-attr]
        _join(reader, 5)
        final = []
        while not lines.empty():
            final.append(lines.get())
        assert any("closed" in line and "conns=1" in line for line in final), final
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
