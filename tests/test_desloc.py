"""DES-LOC: averaging the inner optimizer's moments. Deterministic runs equal the
plain reference (extended with moment averaging) bit for bit; every learner's moments
equal the syncer's after each moment round; the syncer's checkpoint keeps them; the
settings are checked; a real ``rackmend syncer`` process with two learner processes."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rackmend import (CompressionConfig, InProcessSyncer, LearnerConfig, RackmendConfig, RackmendOptimizer,
                      ScheduleConfig, SyncerConfig)
from rackmend.config import ConfigError
from rackmend.core.fragments import fragment_tensors, pack_fragments
from rackmend.core.messages import MomentContribution, moment_spec
from rackmend.core.settings import RunRules, peer_mismatch, syncer_mismatch
from rackmend.core.records import Dropped, Guarded, MomentsMerged, Rejected, SyncerRecord
from rackmend.core.syncer import LearnerJoined, MomentsArrived, SendMomentUpdate, SyncerCore
from rackmend.service.checkpoint import load_checkpoint, save_checkpoint
from rackmend.service.events import BadMessage
from rackmend.transport import wire
from rackmend.transport.base import LearnerLink

from helpers import (assert_equal_to_reference, assert_files_equal_reference, batch, make_inner, make_model,
                     run_inprocess, train)
from procs import Procs, events, finish
from reference import reference_run

H = 3
STEPS = 6 * H + 3  # the default K_v = 6H: two rounds of exp_avg_sq for fragments with offset > 0

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(M: int, P: int, tau: int = 2, *, ku: int | None = None, kv: int | None = None, desloc: bool = True,
            moments: str = "none") -> RackmendConfig:
    return RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau, desloc=desloc, desloc_ku=ku,
                                desloc_kv=kv),
        syncer=SyncerConfig(min_quorum=M, learners=tuple(f"l{i}" for i in range(M))),
        compression=CompressionConfig(moments=moments),
        learner=LearnerConfig(wait_timeout=30),
        deterministic=True,
    )


def _ids(M: int) -> list[str]:
    return [f"l{i}" for i in range(M)]


@pytest.mark.parametrize("M,P", [(2, 1), (2, 4), (3, 1), (3, 4)])
@pytest.mark.parametrize("periods", [(None, None), (H, H)], ids=["default-3H-6H", "H-H"])
def test_bit_exact_against_reference(M: int, P: int, periods: tuple[int | None, int | None]) -> None:
    config = _config(M, P, ku=periods[0], kv=periods[1])
    models, hub = run_inprocess(config, _ids(M), STEPS)
    ref_moments: dict[tuple[int, str], list[torch.Tensor]] = {}
    ref_models, ref_theta = reference_run(make_model, make_inner, batch, config, _ids(M), STEPS, ref_moments)
    assert_equal_to_reference(models, hub, ref_models, ref_theta)
    rounds = [r for r in hub.records if isinstance(r, MomentsMerged)]
    assert {(r.fragment, r.kind) for r in rounds} == set(ref_moments) == {
        (p, k) for p in range(P) for k in ("exp_avg", "exp_avg_sq")}, "every fragment's moments were averaged"
    assert all(list(r.merged) == _ids(M) for r in rounds)
    for key, values in ref_moments.items():
        for a, b in zip(hub.core.moments.current[key].tensors, values):
            assert torch.equal(a, b), f"the syncer's {key} moments differ from the reference"


@pytest.mark.parametrize("tau,codec", [(0, "none"), (1, "bf16"), (2, "bf16")])
def test_overlap_and_codecs_bit_exact(tau: int, codec: str) -> None:
    config = _config(2, 2, tau, ku=H, kv=2 * H, moments=codec)
    models, hub = run_inprocess(config, _ids(2), STEPS)
    ref_moments: dict[tuple[int, str], list[torch.Tensor]] = {}
    ref_models, ref_theta = reference_run(make_model, make_inner, batch, config, _ids(2), STEPS, ref_moments)
    assert_equal_to_reference(models, hub, ref_models, ref_theta)
    for key, values in ref_moments.items():
        for a, b in zip(hub.core.moments.current[key].tensors, values):
            assert torch.equal(a, b)


def test_desloc_changes_the_result() -> None:
    """Guards the comparisons above against vacuity: averaging the moments changes the models."""
    on, _ = run_inprocess(_config(2, 1, ku=H, kv=2 * H), _ids(2), STEPS)
    off, _ = run_inprocess(_config(2, 1, desloc=False), _ids(2), STEPS)
    a, b = (dict(m["l0"].named_parameters())["head.weight"] for m in (on, off))
    assert not torch.equal(a, b)


def test_learner_moments_equal_the_syncers_after_each_round() -> None:
    """After each moment round a learner applies, its Adam moments of that fragment are
    the syncer's mean bit for bit (checked on the training thread right after the step)."""
    M, P, config = 2, 2, _config(2, 2, tau=1, ku=H, kv=2 * H)
    init = make_model()
    hub = InProcessSyncer.for_model(config, init)
    checked: dict[str, int] = {}
    errors: list[BaseException] = []

    def learner(lid: str) -> None:
        try:
            model = make_model()
            opt = RackmendOptimizer(model, make_inner(model), config, hub.connect(), learner_id=lid)
            params = [[t for t, s in zip(ts, f.tensors) if not s.is_buffer]
                      for ts, f in zip(fragment_tensors(model, opt.fragments), opt.fragments)]
            seen = {(p, k): 0 for p in range(P) for k in ("exp_avg", "exp_avg_sq")}
            for t in range(1, STEPS + 1):
                train(opt, model, lid, range(t, t + 1))
                for (p, kind), version in seen.items():
                    state = opt.core.moments[p][kind]
                    if state.version == version:
                        continue
                    seen[(p, kind)] = state.version
                    # The next version needs this learner's next send: the syncer holds this one still.
                    mean = hub.core.moments.current[(p, kind)]
                    assert mean.version == state.version
                    for param, value in zip(params[p], mean.tensors):
                        assert torch.equal(opt.inner.state[param][kind], value), f"{lid} {kind} of fragment {p}"
                    checked[lid] = checked.get(lid, 0) + 1
            opt.close()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(lid,)) for lid in _ids(M)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    hub.close()
    if errors:
        raise errors[0]
    # K_u = H: rounds after steps 3k+offset; K_v = 2H: half as many. At least 4 + 2 per fragment.
    assert all(checked.get(lid, 0) >= 6 * P for lid in _ids(M)), checked


def test_syncer_checkpoint_round_trips_the_moments(tmp_path: Path) -> None:
    config = _config(2, 2, ku=H, kv=2 * H, moments="bf16")
    _, hub = run_inprocess(config, _ids(2), STEPS)
    core = hub.core
    assert len(core.moments.current) == 4
    tensors, meta = core.state_dict()
    save_checkpoint(str(tmp_path), tensors, meta)  # through safetensors and JSON, as the service does
    loaded = load_checkpoint(str(tmp_path))
    assert loaded is not None
    fresh = SyncerCore(config, core.fragments, [f.theta for f in core.frags], epoch=7)
    fresh.load_state_dict(loaded.tensors, loaded.meta)
    assert fresh.moments.versions == core.moments.versions
    for key, upd in core.moments.current.items():
        got = fresh.moments.current[key]
        assert got.version == upd.version and got.epoch == 7
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, upd.tensors)), f"{key} changed on the round trip"


def _refusals(actions: list) -> list[str]:
    """The codes of the ``Rejected`` records among ``actions``; another record fails."""
    records = [a for a in actions if isinstance(a, SyncerRecord)]
    assert all(isinstance(r, Rejected) for r in records), records
    return [r.code for r in records]


def _core(desloc: bool = True) -> tuple[SyncerCore, list]:
    config = _config(2, 1, ku=H, kv=H, desloc=desloc)
    model = make_model()
    frags = pack_fragments(model, 1, H)
    core = SyncerCore(config, frags, [[t.detach() for t in ts] for ts in fragment_tensors(model, frags)])
    for lid in _ids(2):
        core.handle(LearnerJoined(lid), 0.0)
    return core, frags


def _moments(lid: str, frags: list, kind: str, value: float, step: int = 3, c_tokens: float = 12.0) -> MomentContribution:
    spec = moment_spec(frags[0])
    return MomentContribution(learner_id=lid, fragment=0, kind=kind, base_version=0, step=step, c_steps=step,
                              c_tokens=c_tokens, tensors=tuple(torch.full(t.shape, value) for t in spec.tensors))


def test_syncer_core_weighted_mean_and_refusals() -> None:
    core, frags = _core()
    assert not [a for a in core.handle(MomentsArrived(_moments("l0", frags, "exp_avg", 1.0)), 1.0)
                if isinstance(a, SendMomentUpdate)], "a deterministic round waits for every learner"
    out = core.handle(MomentsArrived(_moments("l1", frags, "exp_avg", 4.0, c_tokens=24.0)), 2.0)
    sends = [a for a in out if isinstance(a, SendMomentUpdate)]
    assert len(sends) == 1 and sends[0].to == ("l0", "l1") and sends[0].update.version == 1
    # tokens_sq_per_step: 12**2/3 = 48 and 24**2/3 = 192, i.e. 1/5 and 4/5
    assert torch.allclose(sends[0].update.tensors[0], torch.full_like(sends[0].update.tensors[0], 0.2 + 3.2))
    negative = core.handle(MomentsArrived(_moments("l0", frags, "exp_avg_sq", -1.0)), 3.0)
    assert _refusals(negative) == ["negative"]
    bad = _moments("l0", frags, "exp_avg", 1.0)
    wrong_shape = MomentContribution(**{**bad.__dict__, "tensors": bad.tensors[1:]})
    assert _refusals(core.handle(MomentsArrived(wrong_shape), 3.0)) == ["layout"]
    nan = MomentContribution(**{**bad.__dict__, "tensors": tuple(torch.full_like(t, float("nan")) for t in bad.tensors)})
    assert _refusals(core.handle(MomentsArrived(nan), 3.0)) == ["non_finite"]
    off, frags_off = _core(desloc=False)
    assert _refusals(off.handle(MomentsArrived(_moments("l0", frags_off, "exp_avg", 1.0)), 1.0)) \
        == ["moments_off"]


def test_a_huge_finite_moment_is_clipped_to_the_guard_bound() -> None:
    """One learner's finite but huge first moment, averaged into every learner's Adam,
    would move all their parameters: it is clipped to norm_guard x the lower median of
    the round's moment norms (logged as ``guard``); ordinary rounds are never clipped."""
    core, frags = _core()

    def round_(version: int, values: dict[str, float]) -> list:
        out: list = []
        for i, (lid, value) in enumerate(values.items()):
            c = replace(_moments(lid, frags, "exp_avg", value, step=3 * version + 3), base_version=version)
            out += core.handle(MomentsArrived(c), float(version) + 0.1 * i)
        return out

    def guards(out: list) -> list[dict]:
        return [a.to_record() for a in out if isinstance(a, Guarded)]

    for version, l1 in enumerate((1.5, 20.0)):  # honest learners differ, within the bound
        assert not guards(round_(version, {"l0": 1.0, "l1": l1}))
    out = round_(2, {"l0": 1.0, "l1": 1e6})
    (guard,) = guards(out)
    assert (guard["learner"], guard["kind"], guard["action"]) == ("l1", "exp_avg", "clipped")
    assert guard["norm"] > guard["bound"] == pytest.approx(30.0 * guard["bound"] / 30.0)
    (send,) = [a for a in out if isinstance(a, SendMomentUpdate)]
    # Equal weights: (1 + 30) / 2 per element, the clipped moment at the bound 30 x l0's norm.
    assert torch.allclose(send.update.tensors[0], torch.full_like(send.update.tensors[0], 15.5)), \
        "the huge moment reached the mean unclipped"


def test_moment_guard_has_no_window_to_ratchet() -> None:
    """The attack on the parameter guard's window (bursts of same-step sends, each 8x the
    last, then 1e6x) finds nothing to raise here: the moment guard's scale is each
    round's lower median, one contribution per learner, and nothing is carried over."""
    core, frags = _core()
    guards: list[dict] = []
    for version, value in enumerate([8.0**k for k in range(1, 8)] + [1e6]):
        for i in range(40):  # a burst: one pending contribution per learner, the rest superseded
            c = replace(_moments("l1", frags, "exp_avg", value, step=3 * version + 3), base_version=version)
            core.handle(MomentsArrived(c), float(version) + 0.001 * i)
        honest = replace(_moments("l0", frags, "exp_avg", 1.0, step=3 * version + 3), base_version=version)
        out = core.handle(MomentsArrived(honest), float(version) + 0.5)
        assert [a for a in out if isinstance(a, SendMomentUpdate)], "the round closed"
        guards += [a.to_record() for a in out if isinstance(a, Guarded)]
    assert [g["learner"] for g in guards] == ["l1"] * 7  # every burst from 64x on, and the 1e6x one
    assert guards[-1]["bound"] == pytest.approx(guards[0]["bound"]), "the bound did not grow"


def _learner(inner_fn, config: RackmendConfig) -> None:
    model = make_model()
    with InProcessSyncer.for_model(config, make_model()) as hub:
        RackmendOptimizer(model, inner_fn(model), config, hub.connect(), learner_id="l0")


@pytest.mark.parametrize("inner_fn,words", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "torch.optim.sgd.SGD"),
    (lambda m: torch.optim.RMSprop(m.parameters(), lr=0.1), "RMSprop"),
    (lambda m: torch.optim.Adam(m.parameters(), lr=0.1, amsgrad=True), "amsgrad"),
])
def test_other_inner_optimizers_are_refused(inner_fn, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _learner(inner_fn, _config(1, 1))


def test_adam_and_adamw_are_accepted() -> None:
    for inner_fn in (lambda m: torch.optim.Adam(m.parameters(), lr=0.1),
                     lambda m: torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)):
        _learner(inner_fn, _config(1, 1))


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="multiple of sync_every"):
        ScheduleConfig(sync_every=4, desloc=True, desloc_ku=6)
    with pytest.raises(ConfigError, match="desloc_kv must be a whole number"):
        ScheduleConfig(sync_every=4, desloc=True, desloc_kv=0)
    for codec in ("powersgd:rank=2", "int8", "int4"):
        with pytest.raises(ConfigError, match="not allowed for moments"):
            CompressionConfig(moments=codec)
    assert ScheduleConfig(sync_every=4).moment_periods() == (12, 24)
    with pytest.raises(ConfigError, match="float32"):
        bf16 = make_model().to(torch.bfloat16)
        frags = pack_fragments(bf16, 1, H)
        SyncerCore(_config(1, 1, moments="bf16"), frags, [[t.detach() for t in ts]
                                                          for ts in fragment_tensors(bf16, frags)])


def test_learners_must_agree_and_the_syncer_must_know_the_codec() -> None:
    on = RunRules.from_config(_config(2, 1))
    other_k = RunRules.from_config(_config(2, 1, ku=H))
    off = RunRules.from_config(_config(2, 1, desloc=False))
    assert (on.desloc_ku, on.desloc_kv) == (3 * H, 6 * H)
    assert peer_mismatch("b", other_k, "a", on).setting == "desloc"
    assert peer_mismatch("b", off, "a", on).setting == "desloc"
    assert peer_mismatch("b", on, "a", on) is None
    bf16 = RunRules.from_config(_config(2, 1, moments="bf16"))
    mismatch = syncer_mismatch("b", bf16, _config(2, 1))
    assert mismatch is not None and "--moments-codec bf16" in mismatch.reason
    # Off: the hello carries exactly the keys it did before DES-LOC; on, they parse back.
    assert "desloc" not in off.to_wire()
    frags = pack_fragments(make_model(), 1, H)
    for s in (on, off, bf16):
        msg = wire.decode_header(wire.hello_frames("a", 0, 1, frags, s), wire.LEARNER_TYPES, 1 << 24)
        assert wire.parse_hello(msg).settings == s


def test_wire_round_trip_and_checks() -> None:
    frags = pack_fragments(make_model(), 2, H)
    spec = moment_spec(frags[1])
    c = MomentContribution(learner_id="l0", fragment=1, kind="exp_avg_sq", base_version=2, step=9, c_steps=3,
                           c_tokens=36.0, tensors=tuple(torch.rand(t.shape) for t in spec.tensors), seq=4, session=5)
    msg = wire.decode_header(wire.moments_frames(c, 0), wire.LEARNER_TYPES, 1 << 24)
    got = wire.parse_moments(msg, frags)
    assert (got.kind, got.base_version, got.seq, got.c_tokens) == ("exp_avg_sq", 2, 4, 36.0)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, c.tensors))
    short = wire.decode_header(wire.moments_frames(MomentContribution(**{**c.__dict__, "tensors": c.tensors[:-1]}), 0),
                               wire.LEARNER_TYPES, 1 << 24)
    with pytest.raises(wire.WireError, match="tensors"):
        wire.parse_moments(short, frags)
    frames = wire.moments_frames(c, 0)
    header = wire.msgpack.unpackb(frames[0])
    for bad in ({"kind": "max_exp_avg_sq"}, {"fragment": 2}, {"c_tokens": -1.0}):
        frames[0] = wire.msgpack.packb({**header, **bad})
        with pytest.raises(wire.WireError):
            wire.parse_moments(wire.decode_header(frames, wire.LEARNER_TYPES, 1 << 24), frags)


def test_a_link_without_moments_is_refused() -> None:
    class PlainLink(LearnerLink):  # a transport that carries parameters only
        def refused(self, *args, **kwargs):
            raise AssertionError("must be refused before it is used")

        join = send = poll = wait = leave = refused

    model = make_model()
    with pytest.raises(ConfigError, match="send_moments"):
        RackmendOptimizer(model, make_inner(model), _config(1, 1), PlainLink(), learner_id="l0")


def test_syncer_and_learner_processes_equal_the_reference(procs: Procs, tmp_path: Path) -> None:
    """A real ``rackmend syncer`` and two learner processes over ZeroMQ, deterministic,
    DES-LOC on with a bf16 moments codec: models equal the reference bit for bit; the
    syncer's checkpoint holds the reference's last averaged moments."""
    ids, P, tau, steps = ["l0", "l1"], 2, 1, STEPS
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                                    "--overlap", str(tau), "--checkpoint-dir", str(ck), "--moments-codec", "bf16")
    learners = {lid: procs.learner(endpoint, lid, "--steps", str(steps), "--H", str(H), "--P", str(P),
                                   "--tau", str(tau), "--deterministic", "--learners", ",".join(ids), "--desloc",
                                   "--moments-codec", "bf16", "--out", str(tmp_path / f"{lid}.safetensors"))
                for lid in ids}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    syncer.send_signal(signal.SIGTERM)  # final merge, then the checkpoint
    assert syncer.wait(20) == 0
    config = _config(2, P, tau, moments="bf16")
    ref_moments: dict[tuple[int, str], list[torch.Tensor]] = {}
    ref_models, _ = reference_run(make_model, make_inner, batch, config, ids, steps, ref_moments)
    assert_files_equal_reference(tmp_path, ids, ref_models)
    rounds = events(tmp_path, MomentsMerged)
    assert {(e.fragment, e.kind) for e in rounds} == set(ref_moments) and len(ref_moments) == 2 * P
    loaded = load_checkpoint(str(ck))
    assert loaded is not None
    tensors = loaded.tensors
    for (p, kind), values in ref_moments.items():
        for i, value in enumerate(values):
            assert torch.equal(tensors[f"moments/{p}/{kind}/{i}"], value), f"checkpointed {kind} of fragment {p}"
    assert not events(tmp_path, BadMessage, Rejected)



def test_learner_core_schedule_counters_and_waits() -> None:
    """The core alone, fake clock: moments leave with the fragment's parameter send every
    K_u (K_v) steps with its counters, and in deterministic mode the learner waits for
    the mean at t_send + tau, after the parameter value, then overwrites its moments."""
    from rackmend.core.fragments import FragmentSpec, TensorSpec
    from rackmend.core.learner import (ApplyDue, ApplyMoments, ApplyValue, InnerStepDone, JoinedValue, LearnerCore,
                                       MomentsAnswered, MomentsTaken, SendFragment, SendMoments, SnapshotTaken,
                                       TakeMoments, TakeSnapshot, WaitAnswered, WaitForMoments, WaitForVersion)
    from rackmend.core.messages import MomentUpdate, Update

    config = RackmendConfig(schedule=ScheduleConfig(sync_every=2, num_fragments=1, overlap=1, desloc=True,
                                                    desloc_ku=2, desloc_kv=4), deterministic=True)
    spec = FragmentSpec(0, 0, (TensorSpec("w", (3,), torch.float32), TensorSpec("b", (3,), torch.float32,
                                                                                   is_buffer=True)))
    core = LearnerCore(config, [spec], learner_id="a")
    core.handle(JoinedValue(Update(0, 0, (torch.zeros(3), torch.zeros(3)))), 0.0)
    log: list = []

    def run(actions: list) -> None:
        for a in actions:
            log.append(a)
            if isinstance(a, TakeSnapshot):
                run(core.handle(SnapshotTaken(0, [torch.zeros(3), torch.zeros(3)]), 0.0))
            elif isinstance(a, TakeMoments):
                run(core.handle(MomentsTaken(0, a.kind, [torch.full((3,), float(core.step))]), 0.0))
            elif isinstance(a, WaitForVersion):
                run(core.handle(WaitAnswered(0, Update(0, a.after_version + 1, (torch.ones(3), torch.ones(3)))), 0.0))
            elif isinstance(a, WaitForMoments):
                mean = MomentUpdate(0, a.kind, a.after_version + 1, (torch.full((3,), 7.0),))
                run(core.handle(MomentsAnswered(0, a.kind, mean), 0.0))

    kinds: dict[int, list] = {}
    for t in range(1, 6):
        log.clear()
        run(core.handle(InnerStepDone(4.0), float(t)))
        run(core.handle(ApplyDue(), float(t)))
        kinds[t] = [(type(a).__name__, a.contribution.kind if isinstance(a, SendMoments) else getattr(a, "kind", None))
                    for a in log
                    if isinstance(a, (SendMoments, ApplyValue, ApplyMoments, WaitForMoments))]
        sends = [a for a in log if isinstance(a, (SendFragment, SendMoments))]
        counts = {(c.c_steps, c.c_tokens) for c in (a.draft if isinstance(a, SendFragment) else a.contribution
                                                    for a in sends)}
        assert len(counts) <= 1, f"step {t}: moments and parameters carry other counters: {counts}"
        for a in sends:
            if isinstance(a, SendMoments):
                assert len(a.contribution.tensors) == 1, "buffers have no moments"
                assert a.contribution.base_version == (0 if t <= 2 else 1 if a.contribution.kind == "exp_avg" else 0)
    assert kinds[1] == [] and kinds[2] == [("SendMoments", "exp_avg")]
    assert kinds[3] == [("ApplyValue", None), ("WaitForMoments", "exp_avg"), ("ApplyMoments", "exp_avg")]
    assert kinds[4] == [("SendMoments", "exp_avg"), ("SendMoments", "exp_avg_sq")]
    assert kinds[5] == [("ApplyValue", None), ("WaitForMoments", "exp_avg"), ("ApplyMoments", "exp_avg"),
                        ("WaitForMoments", "exp_avg_sq"), ("ApplyMoments", "exp_avg_sq")]
    assert {k: (m.version, m.in_flight) for k, m in core.moments[0].items()} == {"exp_avg": (2, None),
                                                                                 "exp_avg_sq": (1, None)}


def test_asynchronous_run_averages_and_applies_moments() -> None:
    """Without deterministic mode rounds close on quorum and grace; every learner still
    applies averaged moments, and its last applied ones are a mean the syncer sent."""
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=H, num_fragments=2, overlap=1, desloc=True, desloc_ku=H, desloc_kv=H),
        # Quorum 2: on a loaded machine one learner thread can start so late that the other
        # has run its moment rounds alone, and a joining learner is not sent the current
        # moments (a known gap, docs/algorithm.md): it would hold none at the end.
        syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1"), grace_max=0.5))
    optimizers: dict[str, RackmendOptimizer] = {}
    # 24 periods: the learner threads must overlap in time for rounds of two to close,
    # and on a loaded machine one can start seconds after the other.
    _, hub = run_inprocess(config, _ids(2), 24 * H, optimizers=optimizers)
    rounds = [r for r in hub.records if isinstance(r, MomentsMerged)]
    assert {(r.fragment, r.kind) for r in rounds} == {(p, k) for p in range(2) for k in ("exp_avg", "exp_avg_sq")}
    for lid, opt in optimizers.items():
        versions = {(p, k): m.version for p, ms in enumerate(opt.core.moments) for k, m in ms.items()}
        assert all(v >= 1 for v in versions.values()), f"{lid} applied no averaged moments: {versions}"
    assert not [r for r in hub.records if isinstance(r, (Rejected, Dropped))]


def test_multi_rank_learners_are_refused() -> None:
    from rackmend.core.learner import LearnerCore

    frags = pack_fragments(make_model(), 2, H)
    with pytest.raises(ConfigError, match="single-process learner"):
        LearnerCore(_config(1, 2), frags, learner_id="a", rank=0, world_size=2)
