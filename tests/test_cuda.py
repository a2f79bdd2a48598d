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

import pytest
import torch
from torch import nn

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.transport.inprocess import InProcessSyncer

from helpers import batch, make_inner, make_model, train
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


@pytest.mark.parametrize("apply", ["overwrite", "keep_local"])
def test_cuda_values_that_arrive_early_apply_from_their_staged_device_copy(apply: str) -> None:
    """A merged value that arrives before t_send + tau is copied to the device on a side
    stream as it arrives; the apply reads that copy after the stream's event. Both side
    streams are held back by a sleep on the device before each copy, so an apply that
    read the staged copy before it completed, or an inner step that wrote parameters
    before the snapshot copy had read them, would miss the reference."""
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=2),
        syncer=SyncerConfig(min_quorum=1, learners=("l0",)),
        learner=LearnerConfig(wait_timeout=60, apply=apply),
        deterministic=True,
    )
    steps = 16
    hub = InProcessSyncer.for_model(config, OnDevice(make_model(), "cpu"))
    model = _cuda_model()
    opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
    copies = opt._cuda
    assert copies is not None
    snapshot, to_device = copies.snapshot, copies._to_device
    delay = 20_000_000  # GPU cycles: milliseconds, longer than a step of this model

    def late_snapshot(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.cuda.stream(copies._copy_stream):
            torch.cuda._sleep(delay)
        return snapshot(*args, **kwargs)

    def late_staging(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.cuda.device(copies.device), torch.cuda.stream(copies._stage_stream):
            torch.cuda._sleep(delay)
        return to_device(*args, **kwargs)

    copies.snapshot, copies._to_device = late_snapshot, late_staging  # type: ignore[method-assign]
    try:
        train(opt, model, "l0", range(1, steps + 1), sleep=0.05)  # merges come back within a step
    finally:
        opt.close()
        hub.close()
    assert copies.staged_applies >= steps // 4, copies.staged_applies
    ref_models, _ = reference_run(_cuda_model, make_inner, batch, config, ["l0"], steps)
    got = dict(model.named_parameters())
    for name, ref in ref_models["l0"].named_parameters():
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-7, msg=name)


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
