"""The syncer service's decisions tested in-process: a ``ServiceCore`` on a fake clock,
learners that speak the protocol by hand, and what the core sends them collected per
connection. No socket, thread or process: time moves only when a test moves it, so a
test of "taken over only after 1.5 s of silence" takes milliseconds and cannot fail on a
loaded machine. What the ZeroMQ loop adds (the socket, Curve handshakes, signals) keeps a
few end-to-end tests of its own."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import torch
import zmq

from rackmend.config import RackmendConfig, RunConfig, ScheduleConfig, SyncerConfig
from rackmend.core.fragments import FragmentSpec, pack_fragments
from rackmend.core.records import SyncerRecord
from rackmend.core.settings import RunRules
from rackmend.service.config import ServiceConfig
from rackmend.service.core import ServiceCore
from rackmend.service.events import read_event
from rackmend.transport import wire

from helpers import make_model

CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                        syncer=SyncerConfig(min_quorum=1, grace_max=0.05))
"""H=4, P=2, tau=1, a quorum of one and a 50 ms grace window: a contribution merges at the next tick past it."""
_IDENTS = itertools.count(1)
_SESSIONS = itertools.count(100)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _bytes(frames: list[Any]) -> list[bytes]:
    """Frames as the socket would deliver them: copied, so a later change to a tensor the
    sender still holds cannot show through."""
    return [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f)) for f in frames]


class Rig:
    """A ``ServiceCore`` with a fake clock; ``records`` is its log, typed."""

    def __init__(self, config: RackmendConfig = CONFIG, *, key_ids: dict[str, frozenset[str] | None] | None = None,
                 syncer: RunConfig | None = None, **service: Any) -> None:
        """``config``: the learners'; ``syncer``: the syncer's own (default ``config``)."""
        self.clock = FakeClock()
        self.config = config
        self.records: list[SyncerRecord] = []
        self.inbox: dict[bytes, list[wire.FromSyncer]] = defaultdict(list)
        """Per connection, what the core sent it that its learner has not read yet."""
        self.full: set[bytes] = set()
        """Connections whose transport queue is full (a peer that reads nothing): sends to
        them raise ``zmq.Again``, as ZeroMQ's do, and wait in the core's outbox."""
        self.node = ServiceCore(syncer or config, ServiceConfig(bind="tcp://127.0.0.1:0", **service), send=self._send,
                                clock=self.clock, emit=lambda line: self.records.append(read_event(line)),
                                epoch=11, key_ids=key_ids)

    def _send(self, ident: bytes, frames: list[Any]) -> None:
        if ident in self.full:
            raise zmq.Again()
        self.inbox[ident].append(wire.parse_from_syncer(_bytes(frames), 1 << 30))

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass, in steps no longer than the core would sleep."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + max(self.node.wake_in(), 0.01))
            self.node.tick()
            self.node.flush()

    def learner(self, learner: str, **kw: Any) -> Learner:
        return Learner(self, learner, **kw)

    def of(self, *kinds: type) -> list:
        return [r for r in self.records if isinstance(r, kinds)]


class Learner:
    """One learner rank on its own connection, speaking the protocol by hand (as
    ``tests.test_trust.Raw`` does over a socket): it reads what the core sent it, and
    acknowledges updates as a link does."""

    def __init__(self, rig: Rig, learner: str, *, key: str | None = None, settings: RunRules | None = None,
                 frags: list[FragmentSpec] | None = None) -> None:
        self.rig = rig
        self.learner = learner
        self.ident = b"conn-%d" % next(_IDENTS)
        self.key = key
        self.settings = settings or RunRules.from_config(rig.config)
        self.frags = frags or pack_fragments(make_model(), rig.config.schedule.num_fragments, 4)
        self.session = next(_SESSIONS)
        self.seq = itertools.count(1)
        self.token: str | None = None
        self.epoch = 0
        self.versions: dict[int, int] = {}

    def send(self, frames: list[Any]) -> list[wire.FromSyncer]:
        """Deliver ``frames``, let the core tick once, and return what it answered."""
        self.rig.node.receive(self.ident, _bytes(frames), self.key)
        self.rig.node.tick()
        self.rig.node.flush()
        return self.read()

    def read(self) -> list[wire.FromSyncer]:
        """What the core sent since the last read; updates are acknowledged and their
        versions kept, a welcome's token kept."""
        got, self.rig.inbox[self.ident] = self.rig.inbox[self.ident], []
        for msg in got:
            if isinstance(msg, wire.UpdateIn):
                h = msg.message.header
                self.versions[h["fragment"]], self.epoch = h["version"], h["epoch"]
                self.rig.node.receive(self.ident, _bytes(wire.ack_frames(h["fragment"], self.learner, 0)), self.key)
            elif isinstance(msg, wire.WelcomeIn):
                self.token = wire.parse_welcome(msg.message, self.learner, 0)
        return got

    def hello(self, token: str | None = None, *, rank: int = 0, world: int = 1) -> list[wire.FromSyncer]:
        return self.send(wire.hello_frames(self.learner, rank, world, self.frags, self.settings, token=token))

    def join(self, token: str | None = None) -> None:
        """Say hello (seeding the model with zeros when asked) and check the join answer:
        every fragment's value."""
        replies = self.hello(token)
        if any(isinstance(m, wire.InitRequestIn) for m in replies):
            for spec in self.frags:
                values = [torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors]
                replies += self.send(wire.init_frames(self.learner, 0, spec.index, values))
        errors = errors_in(replies)
        assert not errors, f"{self.learner}'s hello was refused: {errors}"
        assert len(self.versions) == len(self.frags), f"{self.learner} got no join answer: {replies}"

    def contribution(self, frag: int = 0, **over: Any) -> list[Any]:
        tensors = [torch.full(t.shape, 0.01, dtype=t.dtype) for t in self.frags[frag].tensors]
        header = {"type": "contrib", "learner": self.learner, "rank": 0, "fragment": frag,
                  "base_version": self.versions.get(frag, 0), "step": 4, "c_steps": 4, "c_tokens": 16.0,
                  "step_time": 0.01, "session": self.session, "seq": next(self.seq), "base_epoch": self.epoch,
                  "codec": 0, "tensors": wire._tensor_meta(tensors), **over}
        return wire.encode(header, tensors)

    def contribute(self, frag: int = 0) -> list[wire.FromSyncer]:
        """Send a contribution to ``frag`` and let the grace window pass (it merges)."""
        replies = self.send(self.contribution(frag))
        self.rig.advance(0.1)
        return replies + self.read()

    def heartbeat(self) -> list[wire.FromSyncer]:
        return self.send(wire.encode({"type": "heartbeat", "learner": self.learner, "rank": 0}))

    def leave(self) -> list[wire.FromSyncer]:
        return self.send(wire.encode({"type": "leave", "learner": self.learner, "rank": 0}))


def errors_in(replies: list[wire.FromSyncer]) -> list[wire.ErrorIn]:
    return [m for m in replies if isinstance(m, wire.ErrorIn)]


def first_error(replies: list[wire.FromSyncer]) -> wire.ErrorIn:
    errors = errors_in(replies)
    assert errors, f"no error among the replies {[type(m).__name__ for m in replies]}"
    return errors[0]
