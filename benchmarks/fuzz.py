"""Mutated wire messages against a live syncer while a healthy learner trains.

Runbook: ``python benchmarks/fuzz.py`` (100 000 messages) or ``--quick`` (5 000).
A real ``rackmend syncer`` process, a healthy learner process (``l0``, a small MLP,
plain ``RackmendOptimizer`` over ``ZmqLink``) and, in this process, a joined raw client
``mallory`` plus two connections that never join. Each message is a valid one (a
contribution, hello, heartbeat, leave, fetch, ack or init) put through one mutation:
bit flips, truncation, swapped header fields, wrong dtypes or shapes, extra or missing
frames, counters past their bounds, NaN/inf in header or tensors, replays of earlier
contributions, another learner's id (the live ``l0``), another protocol version,
another message type, plain garbage, or a hello from a connection that never joined
with one of its fields (``world`` and ``rank`` included) mutated (``HELLO_MUTATIONS``). After each one a sentinel message follows
on the same connection, whose error reply marks the end of the replies to the
mutated message (the syncer answers one connection in order), so each reply is
attributed to its message exactly.

Counted (all must be 0):
- crashes: the syncer or the healthy learner exited;
- hangs: no sentinel answer within 10 s;
- bad inputs accepted: a message that must be refused (every mutation class except bit
  flips, swaps and type changes, which may yield another valid message) was received
  (a receipt without a rejection, a join answer, a ``bye``), plus what the syncer's log
  shows was let through: a second join or a leave of ``l0``, a takeover, a fetch or a
  merge naming ``l0`` that its process did not send, a merged id other than the two;
- global-model corruption: a non-finite element in the syncer's final checkpoint, or a
  fragment whose norm grew past 10x its initial norm.
Reported: the healthy learner's merges per second before the fuzz and during it (on a
2-core machine the fuzz client and the syncer take CPU from the learner, so some drop
is contention, not protocol).

The test suite runs a slice (``run``, a few thousand messages) in tests/test_wire_fuzz.py.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq

from rackmend.core.fragments import fingerprint, layout_from_wire, pack_fragments
from rackmend.core.records import Joined, Left, Merged, SyncerRecord
from rackmend.core.settings import RunRules
from rackmend.core.syncer_fragment import global_values
from rackmend.service.events import Fetched, Stopped, TakenOver, read_log
from rackmend.transport import wire

H, P, TAU = 4, 2, 1
LEARNER = "l0"
SENTINEL = "fuzz-sentinel"
HANG_S = 10.0
# Mutations that may turn a valid message into another valid one: not counted as must-refuse.
MAY_PASS = {"valid", "bitflip", "swap", "type"}


HELLO_MUTATIONS: list[tuple[tuple[str, Any], ...]] = [
    # world and rank: the syncer sizes per-rank tables by them
    (("world", 2**63),), (("world", 2**64 - 1),), (("world", 30_000_000),), (("world", wire.MAX_WORLD + 1),),
    (("world", 0),), (("world", -1),), (("world", 1.5),), (("world", "2"),), (("world", None),), (("world", True),),
    (("rank", 2**63),), (("rank", 1),), (("rank", -1),), (("rank", wire.MAX_WORLD),),
    (("learner", ""),), (("learner", "x" * 200),), (("learner", 7),), (("learner", "a b"),),
    (("fingerprint", "0" * 16),), (("fingerprint", 5),), (("fingerprint", None),),
    # settings: every key, out of range, of the wrong type, missing or extra
    (("settings", None),), (("settings", {}),), (("settings", []),),
    (("settings.sync_every", 2**62),), (("settings.sync_every", 0),), (("settings.sync_every", 2**64 - 1),),
    (("settings.sync_every", H + 1),), (("settings.sync_every", "4"),),
    (("settings.num_fragments", 2**62),), (("settings.num_fragments", P + 1),), (("settings.num_fragments", 0),),
    (("settings.overlap", 2**62),), (("settings.overlap", -1),), (("settings.overlap", H),),
    (("settings.deterministic", 2),), (("settings.deterministic", None),),
    (("settings.apply", "x"),), (("settings.apply", "auto"),), (("settings.apply", 3),),
    (("settings.uplink", "int99"),), (("settings.uplink", "x" * 300),), (("settings.uplink", 5),),
    (("settings.downlink", "powersgd:rank=-1"),),
    (("settings.extra", 1),), (("settings.sync_every", None),),
    (("settings.desloc", True),),  # its periods missing
    (("settings.desloc", True), ("settings.desloc_ku", 2**62), ("settings.desloc_kv", 2**62),
     ("settings.moments", "none")),
    (("settings.desloc", False), ("settings.desloc_ku", H), ("settings.desloc_kv", H), ("settings.moments", "none")),
    # the layout: structure, bounds, and a well-formed one that is not this run's model
    (("layout", []),), (("layout", None),), (("layout", "x"),), (("layout.0", 5),), (("layout.0.index", 7),),
    (("layout.0.offset", 2**63),), (("layout.0.offset", -1),), (("layout.0.tensors", 3),),
    (("layout.0.tensors.0.1", [2**61, 2**61]),), (("layout.0.tensors.0.1", [1] * 100),),
    (("layout.0.tensors.0.1", [-3]),), (("layout.0.tensors.0.1", [3, 5]),), (("layout.0.tensors.0.2", "complex128"),),
    (("layout.0.tensors.0.2", "float16"),), (("layout.0.tensors.0", []),),
    # pieces: junk, out of bounds, not this layout's
    (("pieces", "x"),), (("pieces", [[[0, [0], [2**62]]]]),), (("pieces", [[[99, [0, 0], [1, 1]]], []]),),
    (("pieces", [[[0, [0, 0], [1, 1]]]]),), (("pieces", [[[0, [0] * 9, [1] * 9]], []]),),
    # the resume token: not 32 lowercase hex characters (a well-formed unknown one is ignored, not refused)
    (("token", 5),), (("token", None),), (("token", "g" * 32),), (("token", "0" * 31),), (("token", "A" * 32),),
    (("token", "0" * 10_000),),
]
"""Mutations of a valid hello, one or more (path, value) pairs each (a path walks maps
by key and lists by index; a layout edited to a well-formed one gets its matching
fingerprint, so the check behind the fingerprint is reached). Every one must be refused."""


def mutate_hello(header: dict[str, Any], mutation: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """A copy of a hello's ``header`` with ``mutation`` applied (see ``HELLO_MUTATIONS``)."""
    h = msgpack.unpackb(msgpack.packb(header))  # a deep copy of plain values
    for path, value in mutation:
        *parents, last = path.split(".")
        node: Any = h
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    if any(path.startswith("layout") for path, _ in mutation):
        try:
            h["fingerprint"] = fingerprint(layout_from_wire(h["layout"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # malformed: refused before the fingerprint is compared
    return h


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _config() -> Any:
    from rackmend import RackmendConfig, ScheduleConfig

    return RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=TAU))


# ---------------------------------------------------------------- the healthy learner (a child process)
def learner_main(endpoint: str, stop_file: Path) -> int:
    from rackmend import RackmendOptimizer
    from rackmend.transport.zmq_link import ZmqLink

    torch.set_num_threads(1)
    model = make_model()
    opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _config(),
                            ZmqLink(endpoint, heartbeat_s=0.2), learner_id=LEARNER)
    g = torch.Generator().manual_seed(1)
    target = torch.randn(16, 4, generator=g)
    try:
        while not stop_file.exists():
            x = torch.randn(32, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step(tokens=32)
            time.sleep(0.01)
    finally:
        opt.close()
    return 0


# ---------------------------------------------------------------- messages and mutations
@dataclass
class Peer:
    """A raw DEALER connection; ``lid`` is the id it joined as (None: never joined)."""

    sock: zmq.Socket
    lid: str | None
    versions: list[int] = field(default_factory=lambda: [0] * P)
    epoch: int = 0


class Fuzzer:
    def __init__(self, endpoint: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.frags = pack_fragments(make_model(), P, H)
        self.settings = RunRules.from_config(_config())
        ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.peers = []
        for lid in ("mallory", None, None):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.peers.append(Peer(sock, lid))
        self.seq = itertools.count(1)
        self.session = 77
        self.sent_valid: list[list[bytes]] = []
        self.stats: dict[str, int] = {"sent": 0, "hangs": 0, "bad_accepted": 0, "must_refuse": 0, "accepted": 0,
                                      "refused": 0, "silent": 0}
        self.by_mutation: dict[str, dict[str, int]] = {}
        self.accepted_examples: list[str] = []
        self.join(self.peers[0])

    # -- talking
    def _read(self, peer: Peer, timeout: float) -> dict | None:
        if not peer.sock.poll(max(1, int(timeout * 1000))):
            return None
        frames = peer.sock.recv_multipart()
        header = msgpack.unpackb(frames[0])
        if header.get("type") == "update":
            p = header["fragment"]
            peer.versions[p] = max(peer.versions[p], header["version"])
            peer.epoch = header["epoch"]
            peer.sock.send_multipart(wire.ack_frames(p, peer.lid or "x", 0))
        return header

    def join(self, peer: Peer) -> None:
        assert peer.lid is not None
        peer.sock.send_multipart(wire.hello_frames(peer.lid, 0, 1, self.frags, self.settings))
        got, end = set(), time.monotonic() + 30
        while len(got) < P and time.monotonic() < end:
            h = self._read(peer, end - time.monotonic())
            if h is None:
                continue
            if h["type"] == "update":
                got.add(h["fragment"])
            elif h["type"] == "error":
                raise RuntimeError(f"{peer.lid} could not join: {h}")
        if len(got) < P:
            raise RuntimeError(f"{peer.lid} could not join within 30 s")

    def exchange(self, peer: Peer, frames: list[bytes]) -> list[dict] | None:
        """Send ``frames`` then the sentinel; the replies in between (None: a hang)."""
        peer.sock.send_multipart(frames, copy=False)
        peer.sock.send_multipart(wire.encode({"type": SENTINEL}))
        replies, end = [], time.monotonic() + HANG_S
        while time.monotonic() < end:
            h = self._read(peer, end - time.monotonic())
            if h is None:
                continue
            if h.get("type") == "error" and SENTINEL in str(h.get("reason", "")):
                return replies
            replies.append(h)
        return None

    # -- valid messages
    def _tensors(self, p: int) -> list[torch.Tensor]:
        return [torch.randn(t.shape, generator=self.gen) * 1e-3 for t in self.frags[p].tensors]

    def contrib(self, peer: Peer, lid: str) -> tuple[dict, list]:
        p = self.rng.randrange(P)
        tensors = self._tensors(p)
        header = {"type": "contrib", "learner": lid, "rank": 0, "fragment": p, "base_version": peer.versions[p],
                  "step": 4 * next(self.seq), "c_steps": 4, "c_tokens": 128.0, "step_time": 0.01, "session": self.session,
                  "seq": next(self.seq), "base_epoch": peer.epoch, "codec": 0, "tensors": wire._tensor_meta(tensors)}
        return header, tensors

    def base(self, peer: Peer, lid: str) -> tuple[dict, list]:
        kind = self.rng.choices(["contrib", "hello", "heartbeat", "leave", "fetch", "ack", "init"],
                                [60, 8, 8, 6, 6, 6, 6])[0]
        if kind == "contrib":
            return self.contrib(peer, lid)
        if kind == "hello":
            frames = wire.hello_frames(lid, 0, 1, self.frags, self.settings)
            return msgpack.unpackb(frames[0]), []
        if kind in ("heartbeat", "leave"):
            return {"type": kind, "learner": lid, "rank": 0}, []
        p = self.rng.randrange(P)
        if kind == "init":
            tensors = self._tensors(p)
            return {"type": "init", "learner": lid, "rank": 0, "fragment": p, "codec": 0,
                    "tensors": wire._tensor_meta(tensors)}, tensors
        return {"type": kind, "learner": lid, "rank": 0, "fragment": p}, []

    # -- one fuzz message
    def mutate(self, peer: Peer) -> tuple[str, str, list[bytes]]:
        """(mutation, message type, frames)."""
        r = self.rng
        mutation = r.choices(
            ["valid", "bitflip", "truncate", "swap", "dtype", "shape", "frames", "counter", "nonfinite", "replay",
             "spoof", "proto", "type", "garbage", "hello"],
            [4, 14, 8, 6, 6, 6, 6, 10, 8, 6, 12, 4, 5, 5, 8])[0]
        if peer.lid is None and mutation in ("valid", "replay"):
            mutation = "spoof"
        if mutation == "replay" and not self.sent_valid:
            mutation = "counter"
        if mutation == "replay":
            return mutation, "contrib", r.choice(self.sent_valid[-50:])
        if mutation == "garbage":
            return mutation, "?", [r.randbytes(r.randrange(1, 64)) for _ in range(r.randrange(1, 4))]
        if mutation == "hello":  # a fresh id: the refusal comes from the field, not from 'busy'
            valid = msgpack.unpackb(wire.hello_frames(f"fz{r.randrange(10**6)}", 0, 1, self.frags, self.settings)[0])
            return mutation, "hello", [msgpack.packb(mutate_hello(valid, r.choice(HELLO_MUTATIONS)))]
        lid = LEARNER if mutation == "spoof" or peer.lid is None else peer.lid
        header, tensors = self.base(peer, lid)
        kind = header["type"]
        if mutation in ("dtype", "shape", "frames", "nonfinite", "counter") and kind != "contrib":
            header, tensors = self.contrib(peer, lid)
            kind = "contrib"
        if mutation == "valid" and kind in ("leave", "hello", "init"):
            header, tensors = self.contrib(peer, lid)  # keep mallory joined: its valid sends are contributions
            kind = "contrib"
        if mutation == "dtype":
            m = r.choice(header["tensors"])
            m["dtype"] = r.choice(["float64", "float16", "int8", "bfloat16", "complex64", "", 7])
        elif mutation == "shape":
            m = r.choice(header["tensors"])
            m["shape"] = r.choice([[], [0], [1, 2, 3], [2**31], m["shape"][::-1] + [1], [-1]])
        elif mutation == "counter":
            key, value = r.choice([("c_tokens", 1e200), ("c_tokens", 1e300), ("c_tokens", float(2**63 - 1)),
                                   ("c_steps", 2**62), ("c_steps", -1), ("step_time", 1e300), ("step_time", -1.0),
                                   ("session", 2**64 - 1), ("base_epoch", 2**60), ("seq", 0), ("seq", 2**64 - 1),
                                   ("base_version", 2**40), ("fragment", P), ("fragment", 2**63), ("rank", 2**40),
                                   ("rank", 2**64 - 1), ("step", 2**64 - 1), ("base_version", 2**64 - 1)])
            header[key] = value
        elif mutation == "nonfinite":
            bad = r.choice([math.nan, math.inf, -math.inf])
            if r.random() < 0.5:
                header[r.choice(["c_tokens", "step_time", "merge_gain"])] = bad
            else:
                t = r.choice(tensors)
                t.view(-1)[r.randrange(t.numel())] = bad
        elif mutation == "proto":
            v = wire.PROTOCOL_VERSION  # every other version, and this one in the wrong type
            header["proto"] = r.choice([0, 1, 2, v - 1, v + 1, -1, str(v), None, 2**40])
        elif mutation == "type":
            header["type"] = r.choice([*wire.LEARNER_TYPES, *wire.SYNCER_TYPES, "", "contrib ", 0])
        elif mutation == "swap" and len(header) > 2:
            a, b = r.sample(sorted(k for k in header if k != "proto"), 2)
            header[a], header[b] = header[b], header[a]
        frames = wire.encode(header, tensors)
        if "proto" in header and mutation == "proto":
            h = msgpack.unpackb(frames[0])
            h["proto"] = header["proto"]
            frames[0] = msgpack.packb(h)
        frames = [bytes(f) for f in frames]
        if mutation == "bitflip":
            i = r.randrange(len(frames))
            buf = bytearray(frames[i]) or bytearray(b"\0")
            for _ in range(r.randint(1, 8)):
                buf[r.randrange(len(buf))] ^= 1 << r.randrange(8)
            frames[i] = bytes(buf)
        elif mutation == "truncate":
            i = r.randrange(len(frames))
            if not frames[i]:  # an empty frame has nothing to cut: cut the header
                i = 0
            frames[i] = frames[i][: r.randrange(len(frames[i]))]
        elif mutation == "frames":
            frames = frames[:-1] if r.random() < 0.5 else [*frames, r.randbytes(r.randrange(0, 64))]
        return mutation, str(kind), frames

    def step(self) -> None:
        peer = self.peers[0] if self.rng.random() < 0.7 else self.rng.choice(self.peers[1:])
        mutation, kind, frames = self.mutate(peer)
        if mutation == "hello":  # from a connection that never joined: one that holds an id keeps it
            peer = self.rng.choice(self.peers[1:])
        must = mutation not in MAY_PASS
        replies = self.exchange(peer, frames)
        st = self.by_mutation.setdefault(mutation, {"sent": 0, "accepted": 0, "refused": 0})
        st["sent"] += 1
        self.stats["sent"] += 1
        self.stats["must_refuse"] += must
        if replies is None:
            self.stats["hangs"] += 1
            return
        errors = [h for h in replies if h.get("type") == "error"]
        accepted = (
            (kind == "contrib" and any(h.get("type") == "ack" for h in replies)
             and not any(h.get("code") == "rejected" for h in errors))
            or (kind == "hello" and not errors and any(h.get("type") in ("update", "init_request") for h in replies))
            or (kind == "leave" and any(h.get("type") == "bye" for h in replies))
        )
        outcome = "accepted" if accepted else "refused" if errors else "silent"
        self.stats[outcome] += 1
        if outcome != "silent":
            st[outcome] += 1
        if accepted and must:
            self.stats["bad_accepted"] += 1
            if len(self.accepted_examples) < 10:
                self.accepted_examples.append(f"{mutation} {kind} {frames[0][:200]!r}")
        if mutation == "valid" and kind == "contrib" and accepted:
            self.sent_valid.append(frames)
        if mutation == "valid" and any("replay" in h.get("reason", "") for h in errors):
            # A bit flip raised the session's seq, or made a new session, and was merged (a
            # valid message: as a restarted learner's would be): the valid sends after it read
            # as replays. A new session, as a restarted link would draw.
            self.session = self.rng.randrange(1, 2**62)
        if peer.lid is not None and any(h.get("code") == "rejoin" and "send hello first" in h.get("reason", "")
                                        for h in errors):
            self.join(peer)  # a valid leave or a heartbeat gap made mallory a stranger: back in
        if kind == "leave" and accepted and peer.lid is not None:
            self.join(peer)

    def close(self) -> None:
        for peer in self.peers:
            peer.sock.close()


# ---------------------------------------------------------------- the run
def _merges_of(ev: list[SyncerRecord], lid: str, t0: float, t1: float) -> int:
    return sum(1 for e in ev if isinstance(e, Merged) and lid in e.merged and t0 <= e.t < t1)


def run(messages: int, *, seed: int = 0, warmup_s: float = 5.0, workdir: Path | None = None,
        progress: bool = False) -> dict[str, Any]:
    """One fuzz run; returns the counts (see the module docstring)."""
    tmp = Path(workdir or tempfile.mkdtemp(prefix="rackmend-fuzz-"))
    log, ck, ready, stop = tmp / "events.jsonl", tmp / "ck", tmp / "endpoint", tmp / "stop"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    syncer = subprocess.Popen([sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0",
                               "--ready-file", str(ready), "--log", str(log), "--checkpoint-dir", str(ck),
                               "--overlap", str(TAU), "--grace-max", "0.05"],
                              stdout=open(tmp / "syncer.out", "wb"), stderr=subprocess.STDOUT, env=env)
    learner = None
    fuzzer = None
    try:
        end = time.monotonic() + 60
        while not ready.exists():
            if syncer.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the syncer did not start: {(tmp / 'syncer.out').read_text()[-2000:]}")
            time.sleep(0.05)
        endpoint = ready.read_text()
        learner = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--learner", endpoint, str(stop)],
                                   stdout=open(tmp / "learner.out", "wb"), stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + 60
        while not any(isinstance(e, Merged) and LEARNER in e.merged for e in read_log(log)):
            if learner.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the learner never merged: {(tmp / 'learner.out').read_text()[-2000:]}")
            time.sleep(0.05)
        t_warm = max(e.t for e in read_log(log))
        time.sleep(warmup_s)
        fuzzer = Fuzzer(endpoint, seed)
        t_start = max(e.t for e in read_log(log))
        wall = time.monotonic()
        for i in range(messages):
            fuzzer.step()
            if syncer.poll() is not None:
                break
            if progress and (i + 1) % 5000 == 0:
                print(f"  {i + 1} messages, {time.monotonic() - wall:.0f}s, {fuzzer.stats}", flush=True)
        fuzz_s = time.monotonic() - wall
        t_end = max(e.t for e in read_log(log))
        crashed_syncer = syncer.poll() is not None
        crashed_learner = learner.poll() is not None
        stop.touch()
        learner_rc = learner.wait(60)
        if not crashed_syncer:
            syncer.send_signal(signal.SIGTERM)
        syncer_rc = syncer.wait(60)
    finally:
        if fuzzer is not None:
            fuzzer.close()
        for proc in (learner, syncer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    ev = read_log(log)
    # What the log shows was let through.
    joins = [e for e in ev if isinstance(e, Joined) and e.learner == LEARNER]
    fuzz_window = [e for e in ev if t_start <= e.t <= t_end]
    log_anomalies = (
        max(0, len(joins) - 1)
        + sum(1 for e in fuzz_window if isinstance(e, Left) and e.learner == LEARNER)
        + sum(1 for e in ev if isinstance(e, TakenOver))
        + sum(1 for e in ev if isinstance(e, Fetched) and e.learner == LEARNER)
        + sum(1 for e in ev if isinstance(e, Merged) and not set(e.merged) <= {LEARNER, "mallory"})
    )
    corruption = 0
    from safetensors.torch import load_file

    layout = pack_fragments(make_model(), P, H)
    for spec, value in zip(layout, global_values(load_file(str(ck / "syncer.safetensors")), layout)):
        now = torch.cat([t.flatten().float() for t in value])
        was = torch.cat([t.flatten().float() for t in _initial_values(spec)])
        corruption += int(not torch.isfinite(now).all() or now.norm() > 10 * was.norm())
    before = _merges_of(ev, LEARNER, t_warm, t_start) / max(t_start - t_warm, 1e-9)
    during = _merges_of(ev, LEARNER, t_start, t_end) / max(t_end - t_start, 1e-9)
    stopped = [e for e in ev if isinstance(e, Stopped)]
    return {
        "messages": fuzzer.stats["sent"], "seconds": round(fuzz_s, 1),
        "crashes": int(crashed_syncer) + int(crashed_learner) + int(syncer_rc != 0) + int(learner_rc != 0),
        "hangs": fuzzer.stats["hangs"],
        "bad_accepted": fuzzer.stats["bad_accepted"] + log_anomalies,
        "bad_accepted_replies": fuzzer.stats["bad_accepted"], "bad_accepted_log": log_anomalies,
        "corruption": corruption,
        "must_refuse": fuzzer.stats["must_refuse"], "accepted": fuzzer.stats["accepted"],
        "refused": fuzzer.stats["refused"], "silent": fuzzer.stats["silent"],
        "merge_rate_before": round(before, 2), "merge_rate_during": round(during, 2),
        "by_mutation": fuzzer.by_mutation, "accepted_examples": fuzzer.accepted_examples,
        "syncer_counters": stopped[-1].to_record() if stopped else None, "workdir": str(tmp),
    }


def _initial_values(spec: Any) -> list[torch.Tensor]:
    params = dict(make_model().named_parameters())
    return [params[t.name].detach() for t in spec.tensors]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--learner":
        sys.exit(learner_main(sys.argv[2], Path(sys.argv[3])))
    from _common import finish, parser

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=None, help="default 100000, --quick 5000")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    n = a.messages or (5_000 if a.quick else 100_000)
    torch.set_num_threads(1)
    r = run(n, seed=a.seed, progress=True)
    print(f"\n{'mutation':<10} {'sent':>8} {'accepted':>9} {'refused':>8}")
    for name, st in sorted(r["by_mutation"].items()):
        print(f"{name:<10} {st['sent']:>8} {st['accepted']:>9} {st['refused']:>8}")
    print(f"\n{'messages':<28} {r['messages']}\n{'seconds':<28} {r['seconds']}")
    for key in ("crashes", "hangs", "bad_accepted", "corruption", "merge_rate_before", "merge_rate_during"):
        print(f"{key:<28} {r[key]}")
    finish("fuzz", a.out, {"inputs": {"messages": n, "seed": a.seed, "quick": a.quick}, "run": r}, {
        "messages": r["messages"], "crashes": r["crashes"], "hangs": r["hangs"], "bad_accepted": r["bad_accepted"],
        "corruption": r["corruption"], "merges_per_s_before": float(r["merge_rate_before"]),
        "merges_per_s_during": float(r["merge_rate_during"]),
    })


if __name__ == "__main__":
    main()
