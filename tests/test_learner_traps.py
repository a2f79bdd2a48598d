"""Traps real training scripts fell into on the learner side, each of which once gave a
wrong model without an error: rank/world disagreement, missing token counts, buffers,
resume order, wrapper prefixes, the optimizer contract."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rackmend import (
    ConfigError,
    InProcessSyncer,
    LearnerConfig,
    RackmendConfig,
    RackmendOptimizer,
    ScheduleConfig,
    SyncerConfig,
    ZmqLink,
)
from rackmend.core.fragments import pack_fragments
from rackmend.core.records import Merged, TokenUnits
from rackmend.learner.optimizer import ResumeOrderError
from rackmend.transport.base import TransportError

from helpers import assert_equal_to_reference, assert_files_equal_reference, batch, make_inner, make_model, run_threads, train
from reference import reference_run
from procs import LEARNER, TORCHRUN, Procs, events, finish

pytestmark = pytest.mark.usefixtures("one_thread")

H = 3


def _config(P: int = 2, tau: int = 1, M: int = 2, **learner: object) -> RackmendConfig:
    return RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau),
        syncer=SyncerConfig(min_quorum=M, learners=tuple(f"l{i}" for i in range(M))),
        learner=LearnerConfig(wait_timeout=30, **learner),  # type: ignore[arg-type]
        deterministic=True,
    )


# ---------------------------------------------------------------- 1. ranks of the link
def test_link_whose_ranks_differ_from_the_process_group_is_refused() -> None:
    model = make_model()
    link = ZmqLink("tcp://127.0.0.1:9", rank=1, world_size=2)  # nothing is sent: refused before join
    with pytest.raises(ConfigError, match=r"rank 1 of 2.*rank 0 of 1"):
        RackmendOptimizer(model, make_inner(model), _config(), link, learner_id="l0")


def test_ddp_rack_with_the_documented_plain_link_equals_the_reference(procs: Procs, tmp_path: Path) -> None:
    """`ZmqLink(endpoint)` in a 2-rank DDP job (as docs/multinode.md shows): every fragment
    merges every round and the run equals the single-process reference bit for bit."""
    ids, P, tau, steps = ["l0", "l1"], 4, 1, 12
    _, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                               "--overlap", str(tau))
    learners = {lid: procs.start([*TORCHRUN, *LEARNER[1:], "--endpoint", endpoint, "--id", lid, "--steps",
                                  str(steps), "--H", str(H), "--P", str(P), "--tau", str(tau), "--deterministic",
                                  "--learners", ",".join(ids), "--wrap", "ddp", "--link", "plain",
                                  "--out", str(tmp_path / f"{lid}.safetensors")], lid)
                for lid in ids}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    merges = events(tmp_path, Merged)
    assert sorted({e.fragment for e in merges}) == list(range(P)), "some fragments never merged"
    assert all(list(e.merged) == ids for e in merges)
    config = _config(P, tau, M=2)
    ref_models, _ = reference_run(make_model, make_inner, batch, config, ids, steps)
    assert_files_equal_reference(tmp_path, ids, ref_models)


# ---------------------------------------------------------------- 2. tokens
def _two_racks(configs: dict[str, RackmendConfig], passes_tokens: dict[str, bool], steps: int = 2 * H
               ) -> InProcessSyncer:
    hub = InProcessSyncer.for_model(configs["l0"], make_model())

    def rack(lid: str) -> None:
        model = make_model()
        opt = RackmendOptimizer(model, make_inner(model), configs[lid], hub.connect(), learner_id=lid)
        for t in range(1, steps + 1):
            x, y, tokens = batch(lid, t)
            opt.zero_grad()
            model(x, y).backward()
            opt.step(tokens=tokens) if passes_tokens[lid] else opt.step()
        opt.close()

    run_threads(rack, [("l0",), ("l1",)])
    hub.close()
    return hub


def test_step_without_tokens_uses_tokens_per_step() -> None:
    """l1 calls step() bare (as the HF Trainer does) with tokens_per_step set: its merge
    weight is of the same order as l0's, which passes tokens=."""
    base = _config()
    tokens_l1 = batch("l1", 1)[2]
    configs = {"l0": base, "l1": base.replace(learner=LearnerConfig(wait_timeout=30, tokens_per_step=tokens_l1))}
    hub = _two_racks(configs, {"l0": True, "l1": False})
    merges = hub.merges()
    assert merges
    for e in merges:
        assert 0.2 < e.weights["l1"] < 0.8, e.weights
    assert not [r for r in hub.records if isinstance(r, TokenUnits)]


def test_rack_counting_steps_beside_racks_counting_tokens_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """Without tokens_per_step a bare step() counts 1: the learner warns, and the syncer
    logs a token_units warning naming the rack whose merges weigh almost nothing."""
    base = _config()
    caplog.set_level(logging.WARNING)
    hub = _two_racks({"l0": base, "l1": base}, {"l0": True, "l1": False})
    units = [r for r in hub.records if isinstance(r, TokenUnits)]
    assert units and {r.learner for r in units} <= {"l0", "l1"}
    assert "tokens_per_step" in caplog.text and "weigh" in caplog.text
    assert any("step() got no tokens" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- 3. buffers
class BNNet(nn.Module):
    """Linear -> BatchNorm -> Linear regression: the running statistics matter at eval."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.relu(self.bn(self.inp(x)))).squeeze(-1), y)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return BNNet()


def _bn_batch(lid: str, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Inputs far from zero mean and unit variance, so default statistics are wrong; each
    rack draws its own samples, so their running statistics differ."""
    idx = int(lid.lstrip("l"))
    g = torch.Generator().manual_seed(100 * idx + step)
    x = torch.randn(8, 6, generator=g) * 3 + 2
    return x, x.sum(-1), 8


def _run_bn(config: RackmendConfig, ids: list[str], steps: int) -> tuple[dict[str, nn.Module], InProcessSyncer]:
    hub = InProcessSyncer.for_model(config, _bn_model())
    models = {lid: _bn_model() for lid in ids}

    def rack(lid: str) -> None:
        model = models[lid]
        opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id=lid)
        for t in range(1, steps + 1):
            x, y, tokens = _bn_batch(lid, t)
            opt.zero_grad()
            model(x, y).backward()
            opt.step(tokens=tokens)
        opt.close()

    run_threads(rack, [(lid,) for lid in ids])
    hub.close()
    return models, hub


def test_batchnorm_statistics_are_merged_by_weighted_mean() -> None:
    """Running statistics travel with their fragment: the run (buffers included) equals the
    reference, where buffers merge by the weighted mean (running_var: pooled with the
    means' spread) without an outer step, and the
    syncer's global model and checkpoint state hold them."""
    config = _config(P=2, tau=1)
    ids, steps = ["l0", "l1"], 4 * H
    models, hub = _run_bn(config, ids, steps)
    ref_models, ref_theta = reference_run(_bn_model, make_inner, _bn_batch, config, ids, steps)
    assert_equal_to_reference(models, hub, ref_models, ref_theta)
    for lid in ids:
        for name, value in ref_models[lid].named_buffers():
            assert torch.equal(dict(models[lid].named_buffers())[name], value), f"{lid}.{name} differs"
    glob = hub.core.global_parameters()
    assert {"bn.running_mean", "bn.running_var"} <= set(glob)
    assert "bn.num_batches_tracked" not in glob, "integer buffers stay local"
    assert glob["bn.running_mean"].abs().max() > 0.1, "the statistics never left their initial value"
    tensors, _ = hub.core.state_dict()
    spec = next(f for f in hub.core.fragments if "bn.running_mean" in f.names)
    assert torch.equal(tensors[f"theta/{spec.index}/{spec.names.index('bn.running_mean')}"], glob["bn.running_mean"])


def test_global_model_with_merged_statistics_predicts_like_the_racks() -> None:
    """Evaluated with the syncer's global value (weights and statistics), the model does
    about as well as a rack's own; with default statistics it does much worse."""
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=1, overlap=0),
                            syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1"), outer_lr=1.0,
                                                outer_kwargs={"momentum": 0.0}),
                            learner=LearnerConfig(wait_timeout=30), deterministic=True)
    models, hub = _run_bn(config, ["l0", "l1"], 80)
    glob = _bn_model()
    glob.load_state_dict(hub.core.global_parameters(), strict=False)
    fresh_stats = copy.deepcopy(glob)
    fresh_stats.bn.reset_running_stats()
    xs = [_bn_batch(lid, 1000 + i) for lid in ("l0", "l1") for i in range(4)]

    def mse(m: nn.Module) -> float:
        m.eval()
        with torch.no_grad():
            return sum(float(m(x, y)) for x, y, _ in xs) / len(xs)

    rack = max(mse(models[lid]) for lid in ("l0", "l1"))
    assert mse(glob) < 1.5 * rack, (mse(glob), rack)
    assert mse(fresh_stats) > 3 * mse(glob), (mse(fresh_stats), mse(glob))


def test_sync_buffers_false_keeps_statistics_local() -> None:
    config = _config(P=2, tau=1)
    local = config.replace(schedule=ScheduleConfig(sync_every=H, num_fragments=2, overlap=1, sync_buffers=False))
    assert not any(t.is_buffer for f in pack_fragments(_bn_model(), 2, H, buffers=False) for t in f.tensors)
    models, hub = _run_bn(local, ["l0", "l1"], 2 * H)
    assert "bn.running_mean" not in hub.core.global_parameters()
    a, b = (dict(models[lid].named_buffers())["bn.running_mean"] for lid in ("l0", "l1"))
    assert not torch.equal(a, b), "each rack keeps its own statistics"


# ---------------------------------------------------------------- 4. resume order
def _resume(order: str) -> tuple[nn.Module, dict, dict, RackmendOptimizer]:
    """l0 trains, is checkpointed, trains on (the syncer moves ahead), and a fresh process
    restores the checkpoint in ``order``. Returns the restored model and what it was
    restored from (saved parameters, the optimizer state) and the new optimizer."""
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=2, overlap=0),
                            syncer=SyncerConfig(min_quorum=1), learner=LearnerConfig(wait_timeout=30))
    hub = InProcessSyncer.for_model(config, make_model())
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
    train(opt, model, "l0", range(1, 2 * H + 2))  # mid-period: local progress on top of the held value
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    train(opt, model, "l0", range(2 * H + 2, 5 * H))  # the syncer merges on
    opt.close()
    fresh = make_model(seed=7)
    if order == "model_first":
        fresh.load_state_dict(weights)
        opt2 = RackmendOptimizer(fresh, make_inner(fresh), config, hub.connect(), learner_id="l0")
        opt2.load_state_dict(saved)
    elif order == "optimizer_first":
        opt2 = RackmendOptimizer(fresh, make_inner(fresh), config, hub.connect(), learner_id="l0")
        fresh.load_state_dict(weights)
        opt2.load_state_dict(saved)
    else:  # model_last: undoes the rebase
        opt2 = RackmendOptimizer(fresh, make_inner(fresh), config, hub.connect(), learner_id="l0")
        opt2.load_state_dict(saved)
        fresh.load_state_dict(weights)
    hub.close()
    return fresh, weights, saved, opt2


@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
def test_resume_restores_local_progress_on_the_newer_global_value(order: str) -> None:
    model, weights, saved, opt = _resume(order)
    held_then = saved["rackmend"]["held"]
    assert any(v > int(s) for v, s in zip(opt.versions, saved["rackmend"]["versions"])), "the syncer did not move"
    for p, spec in enumerate(opt.fragments):
        for i, name in enumerate(spec.names):
            expected = weights[name].clone()
            expected.add_(opt.held[p][i] - held_then[p][i])  # theta_ckpt + (Theta_now - Theta_ckpt)
            assert torch.equal(dict(model.named_parameters())[name], expected), f"{order}: {name}"


def test_loading_the_model_after_the_optimizer_state_raises_at_the_next_step() -> None:
    model, _, _, opt = _resume("model_last")
    x, y, tokens = batch("l0", 99)
    model(x, y).backward()
    with pytest.raises(ResumeOrderError, match="model.load_state_dict"):
        opt.step(tokens=tokens)


def test_a_plain_optimizer_state_is_refused_with_the_recipe_and_rackmends_part_alone_loads() -> None:
    """A plain optimizer's state_dict (what torch.distributed.checkpoint's
    get_optimizer_state_dict gives) is refused with the documented recipe, not a
    KeyError; rackmend's part alone restores the learner and leaves the inner optimizer
    as it was (restored elsewhere)."""
    model, weights, saved, opt = _resume("model_first")
    with pytest.raises(ValueError, match="pass opt.inner to torch.distributed.checkpoint"):
        opt.load_state_dict(opt.inner.state_dict())
    inner_before = copy.deepcopy(opt.inner.state_dict())
    opt.load_state_dict({"rackmend": saved["rackmend"]})
    after = opt.inner.state_dict()
    assert all(torch.equal(a, b) for s1, s2 in zip(inner_before["state"].values(), after["state"].values())
               for a, b in zip(s1.values(), s2.values()))
    held_then = saved["rackmend"]["held"]
    for p, spec in enumerate(opt.fragments):
        for i, name in enumerate(spec.names):
            expected = weights[name].clone()
            expected.add_(opt.held[p][i] - held_then[p][i])
            assert torch.equal(dict(model.named_parameters())[name], expected), name
    opt.close()


# ---------------------------------------------------------------- 5. wrapper prefixes
def test_ddp_compiled_and_plain_racks_train_one_model(tmp_path: Path) -> None:
    """Three racks of one model, wrapped three ways, join one syncer and the deterministic
    run equals the reference (names are canonical: no 'module.' or '_orig_mod.')."""
    ids, steps = ["l0", "l1", "l2"], 3 * H
    config = _config(P=2, tau=1, M=3)
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrappers = {
            "l0": lambda m: m,
            "l1": lambda m: torch.compile(m, backend="eager"),
            "l2": lambda m: nn.parallel.DistributedDataParallel(m),
        }
        raw = {lid: make_model() for lid in ids}
        assert [t.name for f in pack_fragments(wrappers["l2"](make_model()), 2, H) for t in f.tensors] == \
            [t.name for f in pack_fragments(make_model(), 2, H) for t in f.tensors]
        models = {lid: wrappers[lid](raw[lid]) for lid in ids}
        # Dynamo traces on the first call; tracing while other threads train is not
        # thread-safe in torch, so trace here (a backward only fills .grad, which the
        # training loop clears before its own backward: parameters stay untouched).
        models["l1"](*batch("l1", 1)[:2]).backward()
        hub = InProcessSyncer.for_model(config, make_model())

        def rack(lid: str) -> None:
            model = models[lid]
            opt = RackmendOptimizer(model, make_inner(raw[lid]), config, hub.connect(), learner_id=lid)
            train(opt, model, lid, range(1, steps + 1))
            opt.close()

        run_threads(rack, [(lid,) for lid in ids])
        hub.close()
    finally:
        torch.distributed.destroy_process_group()
    ref_models, ref_theta = reference_run(make_model, make_inner, batch, config, ids, steps)
    assert_equal_to_reference(raw, hub, ref_models, ref_theta)


def test_a_real_layout_mismatch_names_the_tensor_and_both_shapes() -> None:
    config = _config(P=1, M=1)
    hub = InProcessSyncer.for_model(config, make_model())
    other = make_model()
    other.head = nn.Linear(8, 5)
    try:
        with pytest.raises(TransportError, match=r"head\.weight.*\[5, 8\].*\[17, 8\]"):
            RackmendOptimizer(other, make_inner(other), config, hub.connect(), learner_id="l0")
    finally:
        hub.close()


# ---------------------------------------------------------------- 6. optimizer contract
def test_hooks_schedulers_and_state_dict_hooks_work() -> None:
    config = _config(P=1, M=1)
    calls: list[str] = []
    with InProcessSyncer.for_model(config, make_model()) as hub:
        model = make_model()
        opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(f"pre:{kwargs.get('tokens')}"))
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        train(opt, model, "l0", range(1, 3))
        sched.step()
        assert opt.inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5)
        assert calls[:2] == ["pre:" + str(batch("l0", 1)[2]), "post"]
        sd = opt.state_dict()
        assert sd["extra"] == 1 and "sd_pre" in calls
        opt.load_state_dict(sd)
        assert calls[-2:] == ["load_pre", "load_post"]
        with pytest.raises(NotImplementedError, match="inner optimizer before"):
            opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
        opt.close()


# ---------------------------------------------------------------- 7. the model changed after building
class _WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.down = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x))).pow(2).mean()


def _changed(change: str, model: nn.Module) -> None:
    if change == "cast":  # model.half(), or model.cuda() on a GPU: every parameter's .data is swapped
        model.double()
    elif change == "assigned":  # the same dtype, shape and device, but another tensor
        model.up.weight = nn.Parameter(model.up.weight.detach().clone())
    elif change == "buffer":  # a module that assigns a buffer anew instead of updating it in place
        model.norm.running_mean = model.norm.running_mean.clone()


@pytest.mark.parametrize("change,says", [
    ("cast", r"parameter up\.weight is not the tensor RackmendOptimizer was built on \(dtype torch\.float32 -> "
             r"torch\.float64\)"),
    ("assigned", r"parameter up\.weight is not the tensor .* \(its memory \(a tensor assigned anew\)\), and the "
                 r"inner optimizer still steps the old tensor"),
    ("buffer", r"buffer norm\.running_mean is not the tensor .*sync_buffers=False"),
])
@pytest.mark.parametrize("caller", ["step", "after_inner_step"])
def test_a_model_changed_after_the_optimizer_was_built_is_refused_at_the_first_step(change: str, says: str,
                                                                                   caller: str) -> None:
    """rackmend works on the tensors the model held when it was built; a model cast,
    moved, sharded or given new tensors afterwards would train on tensors rackmend
    never reads or writes (before: a model cast to float64 after building trained on
    with its merges landing in the old float32 tensors, no error). The first step
    raises, whether ``step`` or the caller's own loop (``after_inner_step``) runs it; a
    buffer assigned anew at every forward is refused at the second step (at the first it
    may be a launcher's move, which a forward then updated)."""
    config = _config(P=1, M=1)
    with InProcessSyncer.for_model(config, _WithNorm()) as hub:
        model = _WithNorm()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = RackmendOptimizer(model, inner, config, hub.connect(), learner_id="l0")
        with pytest.raises(ConfigError, match=says):
            for step in range(2):
                if step == 0 or change == "buffer":
                    _changed(change, model)
                x = torch.randn(8, 4, dtype=next(model.parameters()).dtype)
                model(x).backward()
                if caller == "step":
                    opt.step(tokens=8)
                else:
                    inner.step()
                    opt.after_inner_step(8)
        assert step == (1 if change == "buffer" else 0)
        opt.close()


def test_a_model_moved_to_new_memory_after_the_optimizer_was_built_is_followed(caplog: pytest.LogCaptureFixture
                                                                               ) -> None:
    """A launcher that copies the model after the optimizer was built, with the same
    device, dtype, shape and values (accelerate places a model on ``cpu:0`` on several
    CPU ranks: every tensor gets new memory), is followed at the first step: the merges
    read and write the model's new memory (the syncer's value after a merge is what the
    model held at the send; with stale views it would be the joined value). Before, the
    first step raised ConfigError."""
    config = _config(P=1, M=1)
    with InProcessSyncer.for_model(config, _WithNorm()) as hub:
        model = _WithNorm()
        opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, hub.connect(),
                                learner_id="l0")
        joined = [t.clone() for t in opt.held[0]]
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()  # what module.to(torch.device("cpu", 0)) does to a CPU model
        caplog.set_level(logging.INFO, logger="rackmend.learner")
        at_send = {}
        for step in range(1, 2 * H + 2):
            model(torch.randn(8, 4)).backward()
            opt.step(tokens=8)
            opt.zero_grad()
            if step == 2 * H:
                at_send = {n: t.detach().clone() for n, t in model.named_parameters()}
        assert opt.versions == [2]
        names = [t.name for t in opt.fragments[0].tensors]
        for name, held, first in zip(names, opt.held[0], joined):
            if name in at_send:
                assert torch.allclose(held, at_send[name], atol=1e-6), name
                assert not torch.allclose(held, first), f"{name}: the merges read the model's old memory"
        assert [r for r in caplog.records if "moved to new memory" in r.getMessage()]
        opt.close()


def test_an_inner_optimizer_of_other_tensors_is_refused_and_tensors_outside_the_model_are_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """An inner optimizer built before the model's parameters were replaced (e.g. before
    fully_shard) steps none of them: refused. One that also steps tensors outside the
    model given to rackmend trains them on this learner alone: a warning says so."""
    config = _config(P=1, M=1)
    with InProcessSyncer.for_model(config, _WithNorm()) as hub:
        model = _WithNorm()
        stale = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
        opt = RackmendOptimizer(model, stale, config, hub.connect(), learner_id="l0")
        model(torch.randn(8, 4)).backward()
        with pytest.raises(ConfigError, match="the inner optimizer steps none of the model's parameters"):
            opt.step(tokens=8)
        opt.close()
    with InProcessSyncer.for_model(config, _WithNorm()) as hub:
        model = _WithNorm()
        head = nn.Linear(1, 3)
        inner = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-2)
        opt = RackmendOptimizer(model, inner, config, hub.connect(), learner_id="l0")
        caplog.set_level(logging.WARNING, logger="rackmend.learner")
        for _ in range(3):
            (model(torch.randn(8, 4)) + head(torch.ones(1)).sum()).backward()
            opt.step(tokens=8)
            opt.zero_grad()
        warned = [r.getMessage() for r in caplog.records if "not parameters of the model" in r.getMessage()]
        assert len(warned) == 1 and "steps 2 tensors" in warned[0] and "[[3, 1], [3]]" in warned[0], warned
        assert opt.step_count == 3
        opt.close()


def test_per_rank_state_files_round_trip_and_a_missing_one_is_named(tmp_path: Path) -> None:
    """``state_per_rank``: ``state_dict`` carries the inner optimizer and a marker only,
    loading it restores the inner optimizer alone; ``save_rank_state`` /
    ``load_rank_state`` carry rackmend's part in a file of the rank's own, and a
    missing file is named with what to do."""
    config = _config(P=1, M=1)
    with InProcessSyncer.for_model(config, _WithNorm()) as hub:
        model = _WithNorm()
        opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, hub.connect(),
                                learner_id="l0")
        opt.state_per_rank = True
        for _ in range(H + 2):
            model(torch.randn(8, 4)).backward()
            opt.step(tokens=8)
            opt.zero_grad()
        state = opt.state_dict()
        assert state["rackmend"] == {"per_rank": "rackmend-rank{rank}-of-{world}.pt"} and state["inner"]["state"]
        path = opt.save_rank_state(tmp_path / "ckpt")
        assert path == tmp_path / "ckpt" / "rackmend-rank0-of-1.pt" and not list((tmp_path / "ckpt").glob("*.tmp"))
        counters = (opt.step_count, opt.versions, opt.c_tokens)
        opt.close()
        model2 = _WithNorm()
        opt2 = RackmendOptimizer(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), config, hub.connect(),
                                 learner_id="l0")
        opt2.load_state_dict(state)  # the inner optimizer only
        assert opt2.step_count == 0 and opt2.inner.state_dict()["state"]
        with pytest.raises(FileNotFoundError, match=r"no rackmend state for rank 0 of 1 at .*elsewhere.*"
                                                    r"rackmend-rank0-of-1\.pt"):
            opt2.load_rank_state(tmp_path / "elsewhere")
        opt2.load_rank_state(tmp_path / "ckpt")
        assert (opt2.step_count, opt2.versions, opt2.c_tokens) == counters
        opt2.close()
