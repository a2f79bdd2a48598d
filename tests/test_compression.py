"""Compression wired end to end, in process: lossy uplink (learner error feedback) and
downlink (syncer residual, decoded value applied on the syncer) equal the plain
reference bit for bit, every learner's held copy equals the syncer's, residuals
survive learner and syncer checkpoints, and bad specs fail at configuration time."""

from __future__ import annotations


import pytest
import torch

from rackmend import (
    CompressionConfig,
    InProcessSyncer,
    LearnerConfig,
    RackmendConfig,
    RackmendOptimizer,
    ScheduleConfig,
    SyncerConfig,
)
from rackmend.codecs import Int4Codec
from rackmend.config import ConfigError
from rackmend.core import SyncerCore
from rackmend.core.fragments import pack_fragments
from rackmend.core.messages import Contribution

from helpers import assert_equal_to_reference, batch, make_inner, make_model, run_inprocess, train
from reference import reference_run

H = 3
STEPS = 3 * H + 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(P: int, tau: int, M: int, uplink: str = "none", downlink: str = "none") -> RackmendConfig:
    return RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau),
        syncer=SyncerConfig(min_quorum=M, learners=tuple(f"l{i}" for i in range(M))),
        learner=LearnerConfig(wait_timeout=30),
        compression=CompressionConfig(uplink=uplink, downlink=downlink),
        deterministic=True,
    )


def _run_and_compare(config: RackmendConfig, ids: list[str]) -> tuple[dict, InProcessSyncer, dict]:
    opts: dict[str, RackmendOptimizer] = {}
    models, hub = run_inprocess(config, ids, STEPS, optimizers=opts)
    ref_models, ref_theta = reference_run(make_model, make_inner, batch, config, ids, STEPS)
    assert_equal_to_reference(models, hub, ref_models, ref_theta)
    # Every learner's held copy is the syncer's value of the version it holds (the
    # history keeps recent versions; sends in the last tau steps are merged unapplied).
    current = 0
    for lid, opt in opts.items():
        for p, held in enumerate(opt.held):
            v = opt.versions[p]
            assert v >= 3, f"{lid} fragment {p} applied only {v} merges"
            for a, b in zip(held, hub.core.frags[p].history[v]):
                assert torch.equal(a, b), f"{lid} holds a value of fragment {p} v{v} that is not the syncer's"
            current += v == hub.core.versions[p]
    if config.schedule.overlap == 0:  # every send was applied: held is the syncer's theta itself
        assert current == len(opts) * len(opt.held), "a learner does not hold the syncer's latest version"
    return models, hub, opts


@pytest.mark.parametrize("M,P,tau", [(2, 1, 0), (3, 1, 2), (2, 4, 2), (3, 4, 0)])
def test_int4_uplink_int8_downlink_equal_the_reference(M: int, P: int, tau: int) -> None:
    _run_and_compare(_config(P, tau, M, "int4", "int8"), [f"l{i}" for i in range(M)])


def test_powersgd_uplink_equals_the_reference() -> None:
    _, hub, _ = _run_and_compare(_config(2, 1, 2, "powersgd:rank=2", "int8:block_size=32"), ["l0", "l1"])
    assert {c for e in hub.merges() for c in e.codecs.values()} == {"powersgd"}


def test_compression_actually_happens() -> None:
    """Guard against a vacuous comparison: the lossy run differs from the lossless one,
    and int4 sends exactly the bytes its layout implies, several times fewer."""
    ids = ["l0", "l1"]
    plain_opts: dict[str, RackmendOptimizer] = {}
    lossy_opts: dict[str, RackmendOptimizer] = {}
    plain, _ = run_inprocess(_config(2, 1, 2), ids, STEPS, optimizers=plain_opts)
    lossy, hub = run_inprocess(_config(2, 1, 2, "int4", "int8"), ids, STEPS, optimizers=lossy_opts)
    a = dict(plain["l0"].named_parameters())
    b = dict(lossy["l0"].named_parameters())
    assert any(not torch.equal(a[n], b[n]) for n in a), "int4/int8 changed nothing: is the codec wired in?"
    frags = pack_fragments(make_model(), 2, H)
    codec = Int4Codec()
    ratio = sum(4 * t.numel for f in frags for t in f.tensors) / sum(
        codec.expected_ratio(t.shape) ** -1 * 4 * t.numel for f in frags for t in f.tensors)
    got = plain_opts["l0"].bytes_sent / lossy_opts["l0"].bytes_sent
    assert got == pytest.approx(ratio, rel=1e-9) and got > 5, f"int4 sent {got:.2f}x fewer bytes"
    merges = hub.merges()
    assert all(set(e.codecs.values()) == {"int4"} for e in merges)
    assert all(e.bytes_in < sum(f.nbytes for f in frags) for e in merges)


def test_learner_state_dict_keeps_uplink_residuals() -> None:
    """A learner saved at a period boundary and restored continues bit-identically to
    one that never stopped; restored without its residuals it does not."""
    config = _config(1, 0, 1, "int4", "none")
    k, steps = 2 * H, 4 * H

    def run(drop_residuals: bool | None) -> dict[str, torch.Tensor]:
        with InProcessSyncer.for_model(config, make_model()) as hub:
            model = make_model()
            opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
            if drop_residuals is None:
                train(opt, model, "l0", range(1, steps + 1))
            else:
                train(opt, model, "l0", range(1, k + 1))
                saved, weights = opt.state_dict(), {n: v.clone() for n, v in model.state_dict().items()}
                assert saved["rackmend"]["uplink"], "no residuals in the learner's state_dict"
                if drop_residuals:
                    saved["rackmend"]["uplink"] = {}
                opt.close()
                model = make_model(seed=1)  # a fresh process: other weights until restored
                opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
                model.load_state_dict(weights)
                opt.load_state_dict(saved)
                train(opt, model, "l0", range(k + 1, steps + 1))
            opt.close()
            return {n: v.detach().clone() for n, v in model.named_parameters()}

    straight, restored, forgetful = run(None), run(False), run(True)
    assert all(torch.equal(straight[n], restored[n]) for n in straight), "restored learner diverged"
    assert any(not torch.equal(straight[n], forgetful[n]) for n in straight), \
        "dropping the residuals changed nothing: the round trip test would pass vacuously"


def _contribution(core: SyncerCore, lid: str, p: int, scale: float, step: int) -> Contribution:
    g = torch.Generator().manual_seed(step * 10 + p)
    tensors = tuple(torch.randn(t.shape, generator=g) * scale for t in core.fragments[p].tensors)
    return Contribution(lid, p, core.versions[p], step, 3, 30.0, 0.0, tensors)


def test_syncer_checkpoint_keeps_downlink_residual() -> None:
    """A syncer core restored from state_dict() merges on bit-identically; one restored
    without the downlink residual does not."""
    from rackmend.core.syncer import ContributionArrived, LearnerJoined

    model = make_model()
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=2, overlap=0),
                            syncer=SyncerConfig(min_quorum=1, learners=("a",)),
                            compression=CompressionConfig(downlink="int4"), deterministic=True)
    frags = pack_fragments(model, 2, H)
    named = dict(model.named_parameters())
    init = [[named[n].detach() for n in f.names] for f in frags]

    def fresh() -> SyncerCore:
        core = SyncerCore(config, frags, init)
        core.handle(LearnerJoined("a"), 0.0)
        return core

    def rounds(core: SyncerCore, start: int, stop: int) -> None:
        for step in range(start, stop):
            for p in range(2):
                core.handle(ContributionArrived(_contribution(core, "a", p, 0.1, step)), float(step))

    straight = fresh()
    rounds(straight, 0, 6)
    first = fresh()
    rounds(first, 0, 3)
    tensors, meta = first.state_dict()
    assert any(k.startswith("downlink/residual/") for k in tensors)
    results = []
    for keep in (True, False):
        core = fresh()
        core.load_state_dict({k: v for k, v in tensors.items() if keep or not k.startswith("downlink/")}, meta)
        rounds(core, 3, 6)
        results.append(all(torch.equal(a, b) for p in range(2) for a, b in zip(core.frags[p].theta, straight.frags[p].theta)))
    assert results == [True, False], f"resume with residual equal: {results[0]}, without: {results[1]}"
    assert straight.versions == [6, 6]


@pytest.mark.parametrize("spec,fragment", [
    ("int5", "none, bf16, int8, int4, powersgd"),
    ("int4:block_size=0", "1 <= block_size <= 65536"),
    ("int4:bs=3", "it takes block_size"),
    ("powersgd:rank=two", "must be an int"),
    ("int8:block_size", "not key=value"),
])
def test_bad_codec_specs_name_the_choices(spec: str, fragment: str) -> None:
    for field in ("uplink", "downlink"):
        with pytest.raises(ConfigError, match=f"compression.{field}") as err:
            CompressionConfig(**{field: spec})
        assert fragment in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lossy_codec_on_a_low_precision_model_fails_at_construction(dtype: torch.dtype) -> None:
    model = make_model().to(dtype)
    config = _config(2, 1, 1, "int4")
    with InProcessSyncer.for_model(_config(2, 1, 1), model) as hub, \
            pytest.raises(ConfigError, match=r"emb\.weight is torch\.(float16|bfloat16)"):
        RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id="l0")
    with pytest.raises(ConfigError, match="downlink"):
        InProcessSyncer.for_model(_config(2, 1, 1, downlink="int8"), model)
    # Lossless stays allowed for any dtype.
    with InProcessSyncer.for_model(_config(2, 1, 1), model) as hub:
        RackmendOptimizer(model, make_inner(model), _config(2, 1, 1), hub.connect(), learner_id="l0").close()


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4:block_size=16", "powersgd:rank=2"])
def test_encode_decoded_is_what_the_receiver_decodes(spec: str) -> None:
    """The decoded tensor a sender applies equals, bit for bit, what a receiver decodes
    from the wire bytes; and ``encode`` is ``encode_decoded``'s first half."""
    from rackmend.codecs import ErrorFeedback, codec_by_id, parse_codec_spec
    from rackmend.transport import wire

    codec = parse_codec_spec(spec)
    fb, fb2 = ErrorFeedback(), ErrorFeedback()
    state, state2 = {}, {}
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(12, 9, generator=g)
        enc, dec = fb.encode_decoded("k", x, codec, state)
        enc2 = fb2.encode("k", x, codec, state2)
        assert all(torch.equal(a, b) for a, b in zip(enc.frames, enc2.frames))
        receiver = codec_by_id(codec.codec_id)
        rebuilt = receiver.from_wire(enc.shape, enc.params, [bytes(f) for f in wire.encode({}, enc.frames)[1:]])
        assert torch.equal(receiver.decode(rebuilt), dec)
        assert not torch.equal(dec, x)  # lossy: the residual is not trivially zero
        assert torch.equal(fb.residual("k"), fb2.residual("k"))
