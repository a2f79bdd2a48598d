"""Bad input against a live syncer service: every malformed, oversized, non-finite,
stale or unauthenticated message gets a clear logged rejection, the syncer keeps
running and a healthy learner's rounds keep completing meanwhile."""

from __future__ import annotations

import math
import threading
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core.fragments import layout_to_wire, pack_fragments
from rackmend.service import ServiceConfig, SyncerService
from rackmend.transport import wire
from rackmend.transport.zmq_link import ZmqLink

from helpers import batch, make_inner, make_model

MAX_BYTES = 1 << 20
CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                        syncer=SyncerConfig(min_quorum=1, grace_max=0.05))


class Rig:
    def __init__(self) -> None:
        self.svc = SyncerService(CONFIG, ServiceConfig(bind="tcp://127.0.0.1:0", max_message_bytes=MAX_BYTES,
                                                       heartbeat_timeout=30))
        self.records: list[dict] = []
        record = self.svc._record
        self.svc._record = lambda r: (self.records.append(r), record(r))  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.svc.serve, daemon=True)
        self.thread.start()
        self.stop = threading.Event()
        self.healthy = threading.Thread(target=self._healthy, daemon=True)
        self.healthy.start()
        self.frags = pack_fragments(make_model(), 2, 4)
        end = time.monotonic() + 30
        while self.svc.core is None and time.monotonic() < end:
            time.sleep(0.02)
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.svc.endpoint)
        self.send(wire.encode({"type": "hello", "learner": "mallory", "rank": 0,
                               "layout": layout_to_wire(self.frags)}))
        self.drain(2.0)

    def _healthy(self) -> None:
        model = make_model()
        opt = RackmendOptimizer(model, make_inner(model), CONFIG, ZmqLink(self.svc.endpoint), learner_id="l0")
        t = 0
        while not self.stop.is_set() and t < 20000:
            t += 1
            x, y, tokens = batch("l0", t)
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step(tokens=tokens)
            time.sleep(0.002)
        opt.close()

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def drain(self, timeout: float) -> list[dict]:
        """Error replies that arrive within ``timeout`` (updates are skipped)."""
        errors = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
                break
            header = msgpack.unpackb(self.sock.recv_multipart()[0])
            if header["type"] == "error":
                errors.append(header)
                break
        return errors

    def merges_of_l0(self) -> int:
        return sum(1 for r in list(self.records) if r["event"] == "merge" and "l0" in r["merged"])

    def close(self) -> None:
        self.stop.set()
        self.healthy.join(20)
        self.svc.stop()
        self.thread.join(20)
        self.sock.close()


@pytest.fixture(scope="module")
def rig():
    torch.set_num_threads(1)
    r = Rig()
    yield r
    r.close()


def _contrib_header(frag: int = 0, **over) -> dict:
    return {"type": "contrib", "learner": "mallory", "rank": 0, "fragment": frag, "base_version": 0, "step": 4,
            "c_steps": 4, "c_tokens": 16.0, "step_time": 0.01, "codec": 0, **over}


def _valid_tensors(rig: Rig, frag: int) -> list[torch.Tensor]:
    return [torch.zeros(t.shape, dtype=t.dtype) for t in rig.frags[frag].tensors]


CASES = st.one_of(
    st.tuples(st.just("garbage"), st.lists(st.binary(max_size=64), min_size=1, max_size=3)),
    st.tuples(st.just("truncated"), st.integers(1, 40)),
    st.tuples(st.just("type"), st.text(max_size=12)),
    st.tuples(st.just("proto"), st.integers(-5, 50).filter(lambda v: v != wire.PROTOCOL_VERSION)),
    st.tuples(st.just("fragment"), st.integers(-3, 100).filter(lambda v: v not in (0, 1))),
    st.tuples(st.just("dtype"), st.sampled_from(["float64", "int8", "bfloat16", "complex64", ""])),
    st.tuples(st.just("shape"), st.lists(st.integers(0, 9), max_size=3)),
    st.tuples(st.just("nbytes"), st.integers(-1, 10_000)),
    st.tuples(st.just("short_frame"), st.integers(1, 8)),
    st.tuples(st.just("nonfinite"), st.sampled_from([math.nan, math.inf, -math.inf])),
    st.tuples(st.just("future"), st.integers(10_000, 2**40)),
    st.tuples(st.just("counters"), st.sampled_from([("c_steps", -1), ("c_tokens", math.nan), ("step_time", -2.0),
                                                    ("step", "x"), ("base_version", 1.5)])),
    st.tuples(st.just("stranger"), st.text(alphabet="abcdefgh", min_size=1, max_size=10)),
    st.tuples(st.just("badid"), st.text(alphabet=" /\\\n\x00!", min_size=1, max_size=5)),
)


def _frames(rig: Rig, case: tuple) -> list:
    kind, arg = case
    tensors = _valid_tensors(rig, 0)
    header = _contrib_header()
    if kind == "garbage":
        return list(arg)
    if kind == "truncated":
        full = wire.encode(header, tensors)
        head = bytes(full[0])
        return [head[: max(0, len(head) - arg)], *full[1:]]
    if kind == "type":
        header["type"] = arg or "nope"
        if header["type"] in wire.LEARNER_TYPES:
            header["type"] += "_"
    elif kind == "proto":
        frames = wire.encode(header, tensors)
        h = msgpack.unpackb(frames[0])
        h["proto"] = arg
        return [msgpack.packb(h), *frames[1:]]
    elif kind == "fragment":
        header["fragment"] = arg
    elif kind in ("dtype", "shape", "nbytes"):
        frames = wire.encode({**header, "tensors": wire._tensor_meta(tensors)}, tensors)
        h = msgpack.unpackb(frames[0])
        if h["tensors"][0][kind] == arg or (kind == "dtype" and arg == "float32"):
            arg = "float16" if kind == "dtype" else ([99] if kind == "shape" else -7)
        h["tensors"][0][kind] = arg
        return [msgpack.packb(h), *frames[1:]]
    elif kind == "short_frame":
        frames = wire.encode({**header, "tensors": wire._tensor_meta(tensors)}, tensors)
        return [frames[0], bytes(frames[1])[:-arg] if len(bytes(frames[1])) >= arg else b"", *frames[2:]]
    elif kind == "nonfinite":
        tensors[0].view(-1)[0] = arg
    elif kind == "future":
        header["base_version"] = arg
    elif kind == "counters":
        header[arg[0]] = arg[1]
    elif kind == "stranger":
        header["learner"] = "stranger-" + arg
    elif kind == "badid":
        header["learner"] = arg
    return wire.encode({**header, "tensors": wire._tensor_meta(tensors)}, tensors)


def test_valid_contribution_is_accepted(rig: Rig) -> None:
    """The fuzz cases below mutate this message; unmutated it must not be rejected."""
    before = len(rig.records)
    tensors = _valid_tensors(rig, 0)
    header = _contrib_header(base_version=rig.svc.core.versions[0])
    rig.send(wire.encode({**header, "tensors": wire._tensor_meta(tensors)}, tensors))
    assert rig.drain(0.5) == []
    assert not [r for r in rig.records[before:] if r["event"] in ("reject", "bad_message") and r.get("learner") == "mallory"]


N_CASES = 0


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
def test_bad_input_is_rejected_and_logged(rig: Rig, case: tuple) -> None:
    global N_CASES
    N_CASES += 1
    before = len(rig.records)
    rig.send(_frames(rig, case))
    errors = rig.drain(5.0)
    assert errors, f"no error reply for {case[0]}"
    assert errors[0]["code"] in ("bad_message", "rejected", "rejoin") and errors[0]["reason"]
    logged = [r for r in rig.records[before:] if r["event"] in ("bad_message", "reject", "unknown_peer")]
    assert logged, f"{case[0]} was not logged"
    assert rig.thread.is_alive()


def test_oversized_message_is_refused_and_service_keeps_serving(rig: Rig) -> None:
    merges_before = rig.merges_of_l0()
    before = len(rig.records)
    rig.send([wire.encode(_contrib_header())[0], b"\0" * (MAX_BYTES + 1024)])
    (error,) = rig.drain(5.0)
    assert "exceeds the limit" in error["reason"]
    assert any("exceeds the limit" in r.get("reason", "") for r in rig.records[before:])
    # Far beyond the limit ZeroMQ itself cuts the sender off; the syncer never sees it.
    rig.send([wire.encode(_contrib_header())[0], b"\0" * (3 * MAX_BYTES)])
    assert rig.drain(1.0) == []
    end = time.monotonic() + 20
    while rig.merges_of_l0() <= merges_before + 2 and time.monotonic() < end:
        time.sleep(0.05)
    assert rig.merges_of_l0() > merges_before + 2, "healthy rounds stopped completing"
    assert rig.thread.is_alive() and rig.healthy.is_alive()


def test_healthy_rounds_kept_completing_during_the_fuzz(rig: Rig) -> None:
    assert N_CASES >= 100, f"only {N_CASES} fuzz cases ran"
    merges = [r for r in rig.records if r["event"] == "merge"]
    assert len(merges) > 10 and all(m["merged"] for m in merges)
    assert any("l0" in m["merged"] for m in merges[-5:])
    print(f"fuzz cases run: {N_CASES}, rejections logged: "
          f"{sum(1 for r in rig.records if r['event'] in ('bad_message', 'reject', 'unknown_peer'))}")
