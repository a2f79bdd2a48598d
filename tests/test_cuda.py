"""The CUDA paths of the learner: parameters on a GPU, snapshots copied to pinned host
buffers on a side stream, updates written back to the device. Skipped without CUDA
(CI has none); ``make gpu-check`` runs them with the other CUDA tests.

A GPU's kernels round differently from the CPU's, so these compare a CUDA run with the
plain reference run *on the same device* (``tests/reference.py``), which computes the
outer gradients on the device while rackmend computes them on its host snapshot:
subtraction is exact on both, so the learners' parameters must agree to float32
rounding of the outer optimizer's foreach kernels (asserted to 1e-6 relative). A
snapshot copied before the step's kernels finished, or after the next step's, would
hold another model and miss by far more.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rackmend import ConfigError, LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.transport.inprocess import InProcessSyncer

from helpers import VOCAB, batch, make_inner, make_model, train
from reference import reference_run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class OnDevice(nn.Module):
    """The tests' TinyLM on a device; batches (made on the host) follow it there."""

    def __init__(self, inner: nn.Module, device: str) -> None:
        super().__init__()
        self.lm = inner.to(device)
        self.device = device

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lm(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))


def _cuda_model() -> nn.Module:
    return OnDevice(make_model(), "cuda")


# keep_local keeps the copy taken at the send on the device (not in host memory): the
# apply must still give the reference's merged + (local - at send).
@pytest.mark.parametrize("apply", ["overwrite", "keep_local"])
def test_cuda_learners_match_the_reference_on_the_device(apply: str) -> None:
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=3, num_fragments=2, overlap=1),
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1")),
        learner=LearnerConfig(wait_timeout=60, apply=apply),
        deterministic=True,
    )
    ids, steps = ["l0", "l1"], 12
    init = OnDevice(make_model(), "cpu")  # the syncer holds host tensors, as in the service
    hub = InProcessSyncer.for_model(config, init)
    models = {lid: _cuda_model() for lid in ids}
    errors: list[BaseException] = []

    def learner(lid: str) -> None:
        try:
            opt = RackmendOptimizer(models[lid], make_inner(models[lid]), config, hub.connect(), learner_id=lid)
            train(opt, models[lid], lid, range(1, steps + 1))
            opt.close()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(lid,)) for lid in ids]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    hub.close()
    assert not errors, errors
    assert len(hub.merges()) >= 6
    ref_models, _ = reference_run(_cuda_model, make_inner, batch, config, ids, steps)
    for lid in ids:
        got = dict(models[lid].named_parameters())
        for name, ref in ref_models[lid].named_parameters():
            assert got[name].is_cuda, f"{lid}.{name} left the device"
            torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-7, msg=f"{lid}.{name}")


class NormLM(nn.Module):
    """TinyLM with a BatchNorm after the embedding: its running statistics are buffers
    (synced: ``sync_buffers``) that every forward pass writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        h = self.bn(lm.emb(x).transpose(1, 2)).transpose(1, 2)
        h = lm.blocks[1](torch.tanh(lm.blocks[0](h)))
        return F.cross_entropy(lm.head(lm.norm(h)).reshape(-1, VOCAB), y.reshape(-1))


MODELS: dict[str, Callable[[], nn.Module]] = {"tiny": make_model, "batchnorm": NormLM}

HOST_STEP_S = 0.05
"""The host sleeps this long after each step (so merged values come back within a step)."""


def _cycles(seconds: float) -> int:
    """GPU cycles ``torch.cuda._sleep`` spins for about ``seconds`` (measured: clocks vary)."""
    n = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return max(1, int(n * seconds * 1000.0 / start.elapsed_time(end)))


def _held_back_run(apply: str, model: str, hold: str, guard: bool = True) -> tuple[nn.Module, Any, RackmendConfig]:
    """One deterministic learner whose ``hold`` side stream (``snapshot`` or ``staging``)
    spins on the device before each of its copies for longer than the host's step, so
    that a write or read not ordered after a copy happens before it. ``guard`` False
    disables ``guard_writes`` (the negative control). Returns the model, its
    ``CudaCopies`` and the config."""
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=2),
        syncer=SyncerConfig(min_quorum=1, learners=("l0",)),
        learner=LearnerConfig(wait_timeout=60, apply=apply),
        deterministic=True,
    )
    hub = InProcessSyncer.for_model(config, OnDevice(MODELS[model](), "cpu"))
    net = OnDevice(MODELS[model](), "cuda")
    opt = RackmendOptimizer(net, make_inner(net), config, hub.connect(), learner_id="l0")
    copies = opt._cuda
    assert copies is not None
    # The snapshot stream: the next inner step is queued HOST_STEP_S after the copy,
    # which spins 0.12 s first. Staging: a value staged at the step after its send is
    # applied HOST_STEP_S later, while its copy still spins (0.08 s).
    delay = _cycles(0.12 if hold == "snapshot" else 0.08)
    if hold == "snapshot":
        snapshot = copies.snapshot

        def late_snapshot(*args, **kwargs):  # type: ignore[no-untyped-def]
            with torch.cuda.stream(copies._copy_stream):
                torch.cuda._sleep(delay)
            return snapshot(*args, **kwargs)

        copies.snapshot = late_snapshot  # type: ignore[method-assign]
    else:
        to_device = copies._to_device

        def late_staging(*args, **kwargs):  # type: ignore[no-untyped-def]
            with torch.cuda.device(copies.device), torch.cuda.stream(copies._stage_stream):
                torch.cuda._sleep(delay)
            return to_device(*args, **kwargs)

        copies._to_device = late_staging  # type: ignore[method-assign]
    if not guard:
        copies.guard_writes = lambda: None  # type: ignore[method-assign]
    try:
        train(opt, net, "l0", range(1, 17), sleep=HOST_STEP_S)
    finally:
        opt.close()
        hub.close()
    return net, copies, config


def _matches_reference(net: nn.Module, model: str, config: RackmendConfig) -> None:
    ref_models, _ = reference_run(lambda: OnDevice(MODELS[model](), "cuda"), make_inner, batch, config, ["l0"], 16)
    got = dict(net.named_parameters())
    for name, ref in ref_models["l0"].named_parameters():
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-7, msg=name)
    got_buffers = dict(net.named_buffers())
    for name, ref in ref_models["l0"].named_buffers():
        if ref.is_floating_point():
            torch.testing.assert_close(got_buffers[name], ref, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("model", ["tiny", "batchnorm"])
@pytest.mark.parametrize("apply", ["overwrite", "keep_local"])
def test_cuda_snapshots_held_back_on_the_device_still_read_the_step(apply: str, model: str) -> None:
    """The snapshot copy runs on a side stream held back past the next step: the next
    inner step's writes to the parameters wait for it on the device (``guard_writes``),
    and buffers, which the next forward writes, are copied from a clone. The learner
    equals the reference."""
    net, _, config = _held_back_run(apply, model, "snapshot")
    _matches_reference(net, model, config)


def test_cuda_snapshot_race_shows_without_the_write_guard() -> None:
    """Negative control of the test above: with ``guard_writes`` disabled, the held-back
    copies read parameters the next step already changed, and the run misses the
    reference (so the test above can fail)."""
    net, _, config = _held_back_run("overwrite", "tiny", "snapshot", guard=False)
    with pytest.raises(AssertionError):
        _matches_reference(net, "tiny", config)


@pytest.mark.parametrize("apply", ["overwrite", "keep_local"])
def test_cuda_values_that_arrive_early_apply_from_their_staged_device_copy(apply: str) -> None:
    """A merged value that arrives before t_send + tau is copied to the device on a side
    stream as it arrives, held back here past the apply; the apply reads that copy
    after the stream's event, on the device. The learner equals the reference."""
    net, copies, config = _held_back_run(apply, "tiny", "staging")
    assert copies.staged_applies >= 4, copies.staged_applies
    _matches_reference(net, "tiny", config)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_spread_over_two_gpus_in_one_process_is_refused() -> None:
    """Snapshot copies and their events are made on one device's streams: a model split
    over GPUs in one process (``device_map="auto"``) is refused by name."""
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2),
                            syncer=SyncerConfig(min_quorum=1))
    net = make_model()
    net.emb.to("cuda:0")
    net.head.to("cuda:1")
    with InProcessSyncer.for_model(config, make_model()) as hub:
        with pytest.raises(ConfigError, match=r"on 2 GPUs \(cuda:0, cuda:1\)"):
            RackmendOptimizer(net, make_inner(net), config, hub.connect(), learner_id="l0")


def test_keep_local_copies_in_device_memory_stay_bounded_while_no_value_comes() -> None:
    """With no merge coming back (quorum never met), fragments stay in flight: the at-send
    copies kept on the device stop at what the schedule keeps in flight plus one (here
    ceil(tau * P / H) + 1 = 2), later ones go to host memory, so an outage cannot fill the
    GPU with copies of the model."""
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=4, overlap=1),
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1")),  # l1 never comes: no merge
        learner=LearnerConfig(apply="keep_local"),
    )
    hub = InProcessSyncer.for_model(config, OnDevice(make_model(), "cpu"))
    model = _cuda_model()
    opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")

    def kept() -> list[torch.Tensor]:
        return [f.in_flight.at_send[0] for f in opt.core.fragments if f.in_flight is not None]

    try:
        # Offsets 0..3: fragments 1, 2, 3 leave after steps 1, 2, 3; the first two with
        # 0 and 1 others in flight (on the device), the third with 2 (to the host).
        train(opt, model, "l0", range(1, 4))
        assert [t.is_cuda for t in kept()] == [True, True, False], [t.device for t in kept()]
        # Every later send finds the others in flight: all copies end on the host.
        train(opt, model, "l0", range(4, 21))
        assert len(kept()) == 4 and not any(t.is_cuda for t in kept()), [t.device for t in kept()]
    finally:
        opt.close()
        hub.close()
