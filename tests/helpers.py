"""Shared pieces of the test suite: a tiny language model, its data, an in-process run,
a served syncer, a raw DEALER socket for protocol-level tests and a scrape of a
syncer's Prometheus metrics."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import msgpack
import torch
import torch.nn.functional as F
import zmq
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from torch import nn

from rackmend import InProcessSyncer, RackmendConfig, RackmendOptimizer
from rackmend.config import RunConfig
from rackmend.core.records import SyncerRecord
from rackmend.service import ServiceConfig, SyncerService
from rackmend.service.events import read_event

VOCAB = 17


class TinyLM(nn.Module):
    """Embedding -> MLP -> logits: enough tensors (incl. an embedding) for P=4."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 12), nn.Linear(12, 8)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.blocks[1](torch.tanh(self.blocks[0](h)))
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, VOCAB), y.reshape(-1))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLM()


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(lid: str, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Deterministic per (learner, step); learners differ in batch size so weights differ."""
    idx = int(lid.lstrip("l") or 0)
    g = torch.Generator().manual_seed(1000 * idx + step)
    bs = 2 + idx
    x = torch.randint(0, VOCAB, (bs, 6), generator=g)
    return x, (x * 3 + 1) % VOCAB, bs * 6


def train(opt: RackmendOptimizer, model: nn.Module, lid: str, steps: range, sleep: float = 0.0) -> None:
    """The plain training loop of the tests: ``batch(lid, t)`` for each t in ``steps``."""
    for t in steps:
        x, y, tokens = batch(lid, t)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=tokens)
        if sleep:
            time.sleep(sleep)


def assert_equal_to_reference(models: dict[str, nn.Module], hub: InProcessSyncer, ref_models: dict[str, nn.Module],
                              ref_theta: list[list[torch.Tensor]]) -> None:
    """Every learner's parameters and the syncer's global value equal the reference's."""
    for lid, model in models.items():
        got = dict(model.named_parameters())
        for name, ref in ref_models[lid].named_parameters():
            assert torch.equal(got[name], ref), f"{lid}.{name} differs from the reference"
    for p, ref in enumerate(ref_theta):
        for a, b in zip(hub.core.frags[p].theta, ref):
            assert torch.equal(a, b), f"syncer fragment {p} differs from the reference"


def assert_files_equal_reference(tmp_path: Path, ids: list[str], ref_models: dict[str, nn.Module]) -> None:
    """Each learner process's saved final parameters (``<tmp_path>/<id>.safetensors``)
    equal the reference run's, bit for bit."""
    for lid in ids:
        got = load_file(str(tmp_path / f"{lid}.safetensors"))
        for name, value in ref_models[lid].state_dict().items():
            assert torch.equal(got[name], value), f"{lid}.{name} differs from the reference"


def run_inprocess(
    config: RackmendConfig,
    learner_ids: list[str],
    steps: int,
    *,
    model_fn: Callable[[], nn.Module] = make_model,
    timeout: float = 120.0,
    optimizers: dict[str, RackmendOptimizer] | None = None,
) -> tuple[dict[str, nn.Module], InProcessSyncer]:
    """M learner threads + an in-process syncer, each learner stepping ``steps`` times.
    ``optimizers``, when given, receives each learner's RackmendOptimizer."""
    init = model_fn()
    hub = InProcessSyncer.for_model(config, init)
    models = {lid: model_fn() for lid in learner_ids}
    errors: list[BaseException] = []

    def learner(lid: str) -> None:
        try:
            model = models[lid]
            opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id=lid)
            if optimizers is not None:
                optimizers[lid] = opt
            train(opt, model, lid, range(1, steps + 1))
            opt.close()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(lid,)) for lid in learner_ids]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    alive = [th.name for th in threads if th.is_alive()]
    hub.close()
    if errors:
        raise errors[0]
    assert not alive, f"learner threads still running after {timeout}s: {alive}"
    return models, hub


def watch_log(svc: SyncerService) -> list[SyncerRecord]:
    """The list every line ``svc`` logs from now on is also appended to, read back typed
    (``read_event``: so each line is also checked to be a record of this version)."""
    records: list[SyncerRecord] = []
    record = svc._record
    svc._record = lambda r: (records.append(read_event(r)), record(r))  # type: ignore[method-assign]
    return records


def keygen(directory: Path, name: str, *extra: str) -> None:
    """``rackmend keygen DIRECTORY NAME [EXTRA]``, the command's own code run in this
    process: a Python start-up per key cost the Curve tests seconds each."""
    from rackmend.cli import main

    assert main(["keygen", str(directory), name, *extra]) == 0, f"keygen {name} failed"


def serving(config: RunConfig, **service: object) -> tuple[SyncerService, list[SyncerRecord], threading.Thread]:
    """A syncer service on 127.0.0.1 (any free port unless ``bind`` says) serving on a daemon
    thread, and the list its log records are also appended to, typed (``watch_log``). Stop
    it with ``svc.stop(); thread.join(20)``."""
    svc = SyncerService(config, ServiceConfig(**{"bind": "tcp://127.0.0.1:0", **service}))  # type: ignore[arg-type]
    records = watch_log(svc)
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    return svc, records, thread


def run_threads(target: Callable[..., None], argsets: list[tuple], timeout: float = 60.0) -> None:
    """Run ``target(*args)`` on one thread per argument tuple, join them all (bounded),
    and re-raise the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(*args: object) -> None:
        try:
            target(*args)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=args) for args in argsets]
    for th in threads:
        th.start()
    end = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(th.is_alive() for th in threads), f"threads still running after {timeout}s"


class Dealer:
    """A raw learner socket for protocol-level tests; closed by the test that opened it."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout: float) -> dict | None:
        """The next header from the syncer within ``timeout`` seconds, or None."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv_multipart()[0])

    def recv_type(self, kind: str, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            h = self.recv(left)
            if h is not None and h["type"] == kind:
                return h
        return None

    def close(self) -> None:
        self.sock.close()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""One scrape: (metric name, sorted labels) -> value."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for an option that takes a port number, not 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> Samples:
    """Every sample of one scrape of ``url``, read with prometheus-client's parser."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
