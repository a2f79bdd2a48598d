"""Bad input against a live syncer service: every malformed, oversized, non-finite,
stale or unauthenticated message gets a clear logged rejection, the syncer keeps
running and a healthy learner's rounds keep completing meanwhile."""

from __future__ import annotations

import itertools
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
from rackmend.codecs import make_codec
from rackmend.core.fragments import pack_fragments
from rackmend.core.messages import Contribution
from rackmend.core.records import Joined, Merged, Rejected
from rackmend.core.settings import RunRules
from rackmend.service import ServiceConfig, SyncerService
from rackmend.service.events import BadMessage, InternalError, Stopped, UnknownPeer
from rackmend.transport import wire
from rackmend.transport.zmq_link import ZmqLink

from helpers import batch, make_inner, make_model, watch_log
from procs import of
from service_rig import Rig as CoreRig
from test_fuzz_live import _fuzz_module

MAX_BYTES = 1 << 20
CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                        syncer=SyncerConfig(min_quorum=1, grace_max=0.05))


class Rig:
    def __init__(self) -> None:
        self.svc = SyncerService(CONFIG, ServiceConfig(bind="tcp://127.0.0.1:0", max_message_bytes=MAX_BYTES,
                                                       heartbeat_timeout=30, log_burst=10**9))
        self.records = watch_log(self.svc)
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
        self.send(wire.hello_frames("mallory", 0, 1, self.frags, RunRules.from_config(CONFIG)))
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
        return sum(1 for r in of(list(self.records), Merged) if "l0" in r.merged)

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


_SEQ = itertools.count(1)
"""Every message numbered afresh: the syncer refuses a sequence number it has seen (a replay)."""


def _contrib_header(frag: int = 0, **over) -> dict:
    return {"type": "contrib", "learner": "mallory", "rank": 0, "fragment": frag, "base_version": 0, "step": 4,
            "c_steps": 4, "c_tokens": 16.0, "step_time": 0.01, "session": 1, "seq": next(_SEQ), "base_epoch": 0, "codec": 0, **over}


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
    st.tuples(st.just("codec_id"), st.integers(-3, 300).filter(lambda v: v not in range(5))),
    st.tuples(st.just("block_size"), st.sampled_from([0, -1, 2**17, "x", 1.5, None])),
    st.tuples(st.just("frame_count"), st.integers(0, 5).filter(lambda v: v != 2)),
)


def _encoded(rig: Rig, codec: str, frag: int = 0, **over) -> tuple[dict, list]:
    """Header (as a dict) and frames of a valid contribution compressed with ``codec``."""
    g = torch.Generator().manual_seed(7)
    encs = tuple(make_codec(codec).encode(torch.randn(t.shape, generator=g) * 0.01) for t in rig.frags[frag].tensors)
    c = Contribution("mallory", frag, rig.svc.core.versions[frag], 4, 4, 16.0, 0.01,
                     tensors=tuple(torch.zeros(e.shape) for e in encs), encoded=encs, session=1, seq=next(_SEQ),
                     base_epoch=rig.svc.epoch)
    frames = wire.contribution_frames(c, 0)
    return {**msgpack.unpackb(frames[0]), **over}, list(frames[1:])


def _frames(rig: Rig, case: tuple) -> list:
    kind, arg = case
    if kind in ("codec_id", "block_size", "frame_count"):
        header, frames = _encoded(rig, "int4")
        if kind == "codec_id":
            header["codec"] = arg
        elif kind == "block_size":
            header["tensors"][0]["params"] = {"block_size": arg}
        else:
            header["tensors"][0]["frames"] = arg
        return [msgpack.packb(header), *frames]
    tensors = _valid_tensors(rig, 0)
    header = _contrib_header(base_epoch=rig.svc.epoch)
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
    header = _contrib_header(base_version=rig.svc.core.versions[0], base_epoch=rig.svc.epoch)
    rig.send(wire.encode({**header, "tensors": wire._tensor_meta(tensors)}, tensors))
    assert rig.drain(0.5) == []
    # Only mallory sends malformed input here (the healthy learner's messages are valid).
    assert not [r for r in of(rig.records[before:], Rejected) if r.learner == "mallory"]
    assert not of(rig.records[before:], BadMessage)


def _bad_codec_message(rig: Rig, kind: str) -> list:
    """A compressed contribution broken in one way (see the parametrisation below)."""
    if kind == "huge_rank":
        header, frames = _encoded(rig, "powersgd")
        lowrank = next(m for m in header["tensors"] if m["params"].get("mode") == "lowrank")
        lowrank["params"]["rank"] = 10**6
        return [msgpack.packb(header), *frames]
    if kind == "rank_too_big_for_shape":
        header, frames = _encoded(rig, "powersgd")
        lowrank = next(m for m in header["tensors"] if m["params"].get("mode") == "lowrank")
        lowrank["params"]["rank"] = 64
        return [msgpack.packb(header), *frames]
    header, frames = _encoded(rig, "int8" if kind == "overflow_scale" else "int4")
    if kind == "short_frame":
        frames[1] = bytes(frames[1])[:-1]
    elif kind == "extra_frame":
        frames.append(b"\0" * 4)
    elif kind == "missing_params":
        header["tensors"][0]["params"] = {}
    elif kind == "dtype":
        header["tensors"][0]["dtype"] = "float16"
    elif kind == "negative_scale":
        frames[0] = torch.full((len(bytes(frames[0])) // 4,), -1.0).numpy().tobytes()
    elif kind == "overflow_scale":  # finite scales, but 127 * 1e38 decodes to Inf
        frames[0] = torch.full((len(bytes(frames[0])) // 4,), 1e38).numpy().tobytes()
        frames[1] = torch.full((len(bytes(frames[1])),), 127, dtype=torch.int8).numpy().tobytes()
    elif kind == "bf16_nan":
        header, frames = _encoded(rig, "bf16")
        nan = torch.full((len(bytes(frames[0])) // 2,), math.nan, dtype=torch.bfloat16)
        frames[0] = nan.view(torch.int16).numpy().tobytes()
    return [msgpack.packb(header), *frames]


@pytest.mark.parametrize("codec", ["int4", "int8:block_size=16", "bf16", "powersgd:rank=2"])
def test_valid_compressed_contribution_is_accepted(rig: Rig, codec: str) -> None:
    """The syncer takes any registered uplink codec (messages name theirs) and logs it."""
    name, _, param = codec.partition(":")
    header, frames = _encoded(rig, name)
    if param:
        key, value = param.split("=")
        g = torch.Generator().manual_seed(7)
        encs = [make_codec(name, **{key: int(value)}).encode(torch.randn(t.shape, generator=g))
                for t in rig.frags[0].tensors]
        header["tensors"] = [{"dtype": "float32", "shape": list(e.shape), "params": e.params,
                              "frames": len(e.frames)} for e in encs]
        frames = [f for e in encs for f in wire.encode({}, e.frames)[1:]]
    for _ in range(5):  # the healthy learner's merges may make the message stale in flight; then again
        header["base_version"] = rig.svc.core.versions[0]
        before = len(rig.records)
        rig.send([msgpack.packb(header), *frames])
        errors = rig.drain(0.5)
        if not (errors and "stale" in errors[0]["reason"]):
            break
    assert errors == []
    assert not of(rig.records[before:], Rejected, BadMessage)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        merged = [r for r in of(rig.records[before:], Merged) if "mallory" in r.merged]
        if merged:
            assert merged[0].codecs["mallory"] == name
            return
        time.sleep(0.05)
    raise AssertionError(f"a valid {codec} contribution was never merged")


@pytest.mark.parametrize("kind,code,reason", [
    ("huge_rank", "bad_message", "out of range"),
    ("rank_too_big_for_shape", "bad_message", "not smaller than"),
    ("short_frame", "bad_message", "bytes, expected"),
    ("extra_frame", "bad_message", "declare"),
    ("missing_params", "bad_message", "missing"),
    ("dtype", "bad_message", "expected float32"),
    ("negative_scale", "bad_message", "scales must be finite and >= 0"),
    ("overflow_scale", "rejected", "non-finite"),
    ("bf16_nan", "rejected", "non-finite"),
])
def test_bad_compressed_contribution_is_rejected_and_logged(rig: Rig, kind: str, code: str, reason: str) -> None:
    merges_before = rig.merges_of_l0()
    for _ in range(5):  # the healthy learner's merges may make the message stale in flight; then again
        before = len(rig.records)
        rig.send(_bad_codec_message(rig, kind))
        errors = rig.drain(5.0)
        if not (errors and "stale" in errors[0]["reason"]):
            break
    assert errors and errors[0]["code"] == code and reason in errors[0]["reason"], errors
    logged = of(rig.records[before:], BadMessage, Rejected)
    assert logged and reason in logged[0].reason
    end = time.monotonic() + 20
    while rig.merges_of_l0() <= merges_before and time.monotonic() < end:
        time.sleep(0.05)
    assert rig.merges_of_l0() > merges_before, "healthy rounds stopped completing"


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
    logged = of(rig.records[before:], BadMessage, Rejected, UnknownPeer)
    assert logged, f"{case[0]} was not logged"
    assert rig.thread.is_alive()


def test_every_hello_field_mutated_is_refused_quickly_and_the_syncer_serves_on(rig: Rig) -> None:
    """Every entry of benchmarks/fuzz.py's HELLO_MUTATIONS from a connection that never
    joined: an error reply within a bound, nothing joined, the service alive. Before the
    bounds, world=2**63 raised OverflowError out of serve() (the syncer exited) and
    world=30_000_000 stalled it for seconds."""
    fuzz = _fuzz_module()
    valid = msgpack.unpackb(wire.hello_frames("hz", 0, 1, rig.frags, RunRules.from_config(CONFIG))[0])
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(rig.svc.endpoint)
    slowest = 0.0
    try:
        for mutation in fuzz.HELLO_MUTATIONS:
            t0 = time.monotonic()
            stranger.send_multipart([msgpack.packb(fuzz.mutate_hello(valid, mutation))])
            assert stranger.poll(5000), f"no answer to the hello mutated by {mutation}"
            header = msgpack.unpackb(stranger.recv_multipart()[0])
            slowest = max(slowest, time.monotonic() - t0)
            assert header["type"] == "error" and header["code"] in ("bad_message", "fatal"), (mutation, header)
            assert rig.thread.is_alive(), f"the syncer stopped after the hello mutated by {mutation}"
    finally:
        stranger.close()
    assert not any(r.learner == "hz" for r in of(rig.records, Joined))
    assert slowest < 2.0, f"a mutated hello took {slowest:.2f}s to refuse"


def test_a_message_whose_handling_raises_is_dropped_and_the_syncer_serves_on() -> None:
    """A fault that validation missed (here: a handler that raises for one learner id)
    is logged with its peer and dropped; the syncer answers, serves the others, and stops
    cleanly. Before, any exception left serve() and ended the process."""
    rig = CoreRig(CONFIG, heartbeat_timeout=30)
    handle = rig.node._handle

    def faulty(ident: bytes, msg: wire.FromLearner) -> None:
        if msg.learner == "boom":
            raise OverflowError("injected: a fault past validation")
        handle(ident, msg)

    rig.node._handle = faulty  # type: ignore[method-assign]
    for lid in ("boom", "boom", "ok"):
        (reply,) = rig.learner(lid).hello()
        if lid == "boom":
            assert isinstance(reply, wire.ErrorIn) and "internal error" in reply.reason, reply
        else:
            assert isinstance(reply, wire.InitRequestIn), reply  # the next learner is served as usual
    errors = rig.of(InternalError)
    assert len(errors) == 2 and "OverflowError" in errors[0].reason and errors[0].learner == "boom"
    rig.node.finish()
    assert rig.of(Stopped)


def test_oversized_message_is_refused_and_service_keeps_serving(rig: Rig) -> None:
    merges_before = rig.merges_of_l0()
    before = len(rig.records)
    rig.send([wire.encode(_contrib_header())[0], b"\0" * (MAX_BYTES + 1024)])
    (error,) = rig.drain(5.0)
    assert "exceeds the limit" in error["reason"]
    assert any("exceeds the limit" in r.reason for r in of(rig.records[before:], BadMessage))
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
    merges = of(rig.records, Merged)
    assert len(merges) > 10 and all(m.merged for m in merges)
    assert any("l0" in m.merged for m in merges[-5:])
    print(f"fuzz cases run: {N_CASES}, rejections logged: "
          f"{len(of(rig.records, BadMessage, Rejected, UnknownPeer))}")


def test_each_side_types_what_it_receives_in_one_place() -> None:
    """``parse_from_learner`` / ``parse_from_syncer``: every message type a side takes
    becomes its own class (the services dispatch on the class, never on the header's
    string); anything else, and a message sent the wrong way, is refused by name."""
    frags = pack_fragments(make_model(), 2, 4)
    settings = RunRules.from_config(CONFIG)
    values = [torch.zeros(t.shape, dtype=t.dtype) for t in frags[0].tensors]
    from_learner = {
        wire.HelloIn: wire.hello_frames("l0", 0, 1, frags, settings),
        wire.InitIn: wire.init_frames("l0", 0, 0, values),
        wire.ContribIn: wire.encode(_contrib_header(learner="l0")),
        wire.HeartbeatIn: wire.encode({"type": "heartbeat", "learner": "l0", "rank": 0}),
        wire.LeaveIn: wire.encode({"type": "leave", "learner": "l0", "rank": 0}),
        wire.FetchIn: wire.fetch_frames("l0", 0, 1),
        wire.AckIn: wire.ack_frames(1, "l0", 0),
        wire.MomentsIn: wire.encode({"type": "moments", "learner": "l0", "rank": 0}),
    }
    for kind, frames in from_learner.items():
        msg = wire.parse_from_learner(frames, 1 << 24)
        assert type(msg) is kind and (msg.learner, msg.rank) == ("l0", 0), (kind, msg)
    assert wire.parse_from_learner(wire.status_request_frames(42), 1 << 20) == wire.StatusIn(42)
    from_syncer = {
        wire.InitRequestIn: wire.encode({"type": "init_request"}),
        wire.WelcomeIn: wire.welcome_frames("l0", 0, "ab" * wire.TOKEN_BYTES),
        wire.ByeIn: wire.encode({"type": "bye"}),
        wire.SyncerAckIn: wire.ack_frames(1),
        wire.ErrorIn: wire.encode({"type": "error", "code": "busy", "reason": "held"}),
    }
    for kind, frames in from_syncer.items():
        assert type(wire.parse_from_syncer(frames, 1 << 20)) is kind, kind
    err = wire.parse_from_syncer(from_syncer[wire.ErrorIn], 1 << 20)
    assert isinstance(err, wire.ErrorIn) and (err.code, err.reason) == ("busy", "held")
    for wrong_way in (lambda: wire.parse_from_syncer(from_learner[wire.HelloIn], 1 << 24),
                      lambda: wire.parse_from_learner(from_syncer[wire.WelcomeIn], 1 << 20),
                      lambda: wire.parse_from_learner(wire.encode({"type": "nonsense", "learner": "l0", "rank": 0}),
                                                      1 << 20)):
        with pytest.raises(wire.WireError, match="unknown message type"):
            wrong_way()
