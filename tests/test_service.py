"""The syncer service with real processes on 127.0.0.1: deterministic equality with
the reference, a SIGKILLed learner, a SIGKILLed and resumed syncer, Curve keys."""

from __future__ import annotations

import dataclasses
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rackmend import CompressionConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig

from rackmend.config import ConfigError, RunConfig
from rackmend.core.fragments import fingerprint, layout_to_wire, pack_fragments
from rackmend.core.records import FinalMerged, Joined, Left, Merged, Rejected, Superseded
from rackmend.service import ServiceConfig, SyncerService
from rackmend.service.events import (
    AuthDenied,
    BadMessage,
    CheckpointWritten,
    Fetched,
    Initialised,
    InitRequested,
    InitTimedOut,
    Resumed,
    SettingsRefused,
    Silent,
    Stopped,
    UplinkCodecDiffers,
)
from rackmend.core.messages import Contribution
from rackmend.core.settings import RunRules
from rackmend.transport import wire
from rackmend.transport.base import TransportError
from rackmend.transport.zmq_link import ZmqLink

from helpers import (Dealer, assert_files_equal_reference, batch, free_port, keygen, make_inner, make_model, serving,
                     train, watch_log)
from reference import reference_run
from service_rig import Rig as CoreRig
from service_rig import errors_in

from procs import LEARNER, TORCHRUN, Procs, events, finish, of, progress, wait_for
from test_trust import CONFIG as RAW_CONFIG

# Two cases over processes: tau=0 with one fragment, and several fragments on torchrun
# ranks. Schedules in between are checked bit for bit in-process
# (test_deterministic.py: M x P x tau x weighting x merge); the wire path is the same.
@pytest.mark.parametrize("P,tau,ranks", [(1, 0, 1), (4, 1, 2)])
def test_three_learner_processes_equal_the_reference(procs: Procs, tmp_path: Path, P: int, tau: int,
                                                     ranks: int) -> None:
    """ranks=2: each learner is a torchrun job of 2 gloo ranks, fragments striped over them."""
    ids = ["l0", "l1", "l2"]
    H, steps = 3, 12
    _, endpoint = procs.syncer("--deterministic", "--min-quorum", "3", "--learners", ",".join(ids),
                               "--overlap", str(tau))
    launcher = LEARNER if ranks == 1 else [*TORCHRUN, *LEARNER[1:]]
    learners = {lid: procs.start([*launcher, "--endpoint", endpoint, "--id", lid, "--steps", str(steps),
                                  "--H", str(H), "--P", str(P), "--tau", str(tau), "--deterministic",
                                  "--learners", ",".join(ids), "--out", str(tmp_path / f"{lid}.safetensors")], lid)
                for lid in ids}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau),
                            syncer=SyncerConfig(min_quorum=3, learners=tuple(ids)), deterministic=True)
    torch.set_num_threads(1)
    ref_models, _ = reference_run(make_model, make_inner, batch, config, ids, steps)
    assert_files_equal_reference(tmp_path, ids, ref_models)
    merges = events(tmp_path, Merged)
    assert len(merges) >= P * 3 and all(list(e.merged) == ids for e in merges)
    if ranks > 1:  # every fragment came from its owner rank: p mod 2
        hellos = events(tmp_path, Joined)
        assert sorted((e.learner, e.rank, e.world) for e in hellos) == sorted(
            (lid, r, ranks) for lid in ids for r in range(ranks)), "each rank's join names it"
        assert not events(tmp_path, Superseded), "a fragment was sent twice"


def test_compressed_learner_processes_equal_the_reference(procs: Procs, tmp_path: Path) -> None:
    """int4 uplink, int8 downlink through the wire and ZmqLink's delta reconstruction:
    models equal the reference with the same codecs, every learner's held values are
    the syncer's (checkpointed history) bit for bit."""
    ids, H, P, tau, steps = ["l0", "l1", "l2"], 3, 2, 1, 12
    codecs = ("--uplink-codec", "int4", "--downlink-codec", "int8")
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "3", "--learners", ",".join(ids),
                                    "--overlap", str(tau), "--checkpoint-dir", str(ck), "--anchoring", "syncer",
                                    *codecs)
    learners = {lid: procs.learner(endpoint, lid, "--steps", str(steps), "--H", str(H), "--P", str(P),
                                   "--tau", str(tau), "--deterministic", "--learners", ",".join(ids), *codecs,
                                   "--out", str(tmp_path / f"{lid}.safetensors"),
                                   "--held-out", str(tmp_path / f"{lid}.held.safetensors"))
                for lid in ids}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(20) == 0
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau),
                            syncer=SyncerConfig(min_quorum=3, learners=tuple(ids)),
                            compression=CompressionConfig(uplink="int4", downlink="int8"), deterministic=True)
    torch.set_num_threads(1)
    ref_models, ref_theta = reference_run(make_model, make_inner, batch, config, ids, steps)
    checkpoint = load_file(str(ck / "syncer.safetensors"))
    for p, values in enumerate(ref_theta):
        for i, value in enumerate(values):
            assert torch.equal(checkpoint[f"theta/{p}/{i}"], value), f"syncer fragment {p} differs from the reference"
    assert any(k.startswith("downlink/residual/") for k in checkpoint), "the checkpoint lacks the downlink residual"
    assert_files_equal_reference(tmp_path, ids, ref_models)
    for lid in ids:
        held = load_file(str(tmp_path / f"{lid}.held.safetensors"))
        for p, v in enumerate(held["versions"].tolist()):
            assert v >= 3
            for i in range(len(ref_theta[p])):
                assert torch.equal(held[f"held/{p}/{i}"], checkpoint[f"history/{p}/{v}/{i}"]), \
                    f"{lid} holds fragment {p} v{v} unlike the syncer"
    merges = events(tmp_path, Merged)
    assert len(merges) >= P * 3 and all(e.codecs == {lid: "int4" for lid in ids} for e in merges)
    full = [f.nbytes for f in pack_fragments(make_model(), P, H)]
    assert all(e.bytes_out < full[e.fragment] * len(ids) / 3 for e in merges), "updates were not compressed"
    assert not events(tmp_path, Fetched, BadMessage, Rejected)


def test_sigkilled_learner_stalls_nobody_and_rejoins(procs: Procs, tmp_path: Path) -> None:
    _, endpoint = procs.syncer("--min-quorum", "1", "--learners", "l0,l1", "--grace-max", "0.5",
                               "--heartbeat-timeout", "1.5")
    pa, pb = tmp_path / "l0.progress", tmp_path / "l1.progress"
    a = procs.learner(endpoint, "l0", "--steps", "400", "--step-sleep", "0.02", "--progress", str(pa))
    b = procs.learner(endpoint, "l1", "--steps", "100000", "--step-sleep", "0.02", "--progress", str(pb))
    wait_for(lambda: progress(pb)[0] >= 30, 60, "learner l1 to take 30 steps", (a, b))
    b.send_signal(signal.SIGKILL)
    b.wait(10)
    step_a = progress(pa)[0]
    wait_for(lambda: progress(pa)[0] >= step_a + 40, 30, "learner l0 to keep stepping after l1 died", (a,))
    wait_for(lambda: any(e.learner == "l1" for e in events(tmp_path, Silent)), 10,
             "the syncer to notice l1 went silent")
    # Restart b under the same id: it joins with the current global value.
    b2 = procs.learner(endpoint, "l1", "--steps", "60", "--step-sleep", "0.01", "--progress", str(pb), name="b2")
    finish(b2, procs, "b2")
    finish(a, procs, "l0", timeout=90)
    ev = events(tmp_path)
    grace = [e.wait_s for e in of(ev, Merged)]
    assert max(grace) <= 0.5 + 0.5, f"a round waited {max(grace):.2f}s, beyond the grace bound"
    joins_b = [e for e in of(ev, Joined) if e.learner == "l1"]
    assert len(joins_b) >= 2
    rejoin_t = joins_b[-1].t
    assert any("l1" in e.merged and e.t > rejoin_t for e in of(ev, Merged)), \
        "b's contributions did not merge again after it rejoined"


def test_sigkilled_syncer_resumes_and_learners_catch_up(procs: Procs, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    flags = ("--min-quorum", "1", "--learners", "l0,l1", "--grace-max", "0.3", "--checkpoint-dir", str(ck),
             "--checkpoint-every", "4")
    s1, endpoint = procs.syncer(*flags)
    port = endpoint.rsplit(":", 1)[1]
    pa, pb = tmp_path / "l0.progress", tmp_path / "l1.progress"
    # Open-ended learners (ended by SIGINT below): a fixed step count can run out while a
    # loaded machine takes its time to restart the syncer, and then nobody is left to rejoin.
    a = procs.learner(endpoint, "l0", "--steps", "100000", "--step-sleep", "0.02", "--progress", str(pa))
    b = procs.learner(endpoint, "l1", "--steps", "100000", "--step-sleep", "0.02", "--progress", str(pb))
    # Both must have joined (a learner still joining does block, up to its join timeout).
    wait_for(lambda: min(progress(pa)[0], progress(pb)[0]) >= 10, 60, "both learners to step", (a, b))
    wait_for(lambda: bool(events(tmp_path, CheckpointWritten)), 60, "a first checkpoint", (a, b))
    s1.send_signal(signal.SIGKILL)
    s1.wait(10)
    saved = events(tmp_path, CheckpointWritten)[-1].versions
    step_a = progress(pa)[0]
    wait_for(lambda: progress(pa)[0] >= step_a + 20, 30, "learner l0 to keep stepping without a syncer", (a,))
    s2, _ = procs.syncer(*flags, "--resume", "--bind", f"tcp://127.0.0.1:{port}", name="syncer2")
    resumed = events(tmp_path, Resumed)[-1]
    # A checkpoint may have landed between its log line and the kill: never older, maybe newer.
    assert all(r >= v for r, v in zip(resumed.versions, saved)), "a checkpointed merge was lost"
    saved = resumed.versions
    t_resume = resumed.t
    wait_for(lambda: {lid for e in events(tmp_path, Merged) if e.t > t_resume
                      for lid in e.merged} >= {"l0", "l1"}, 60, "both learners to merge with the resumed syncer")
    after = [e for e in events(tmp_path, Merged) if e.t > t_resume]
    assert all(e.version > saved[e.fragment] for e in after)
    s2.send_signal(signal.SIGTERM)
    assert s2.wait(20) == 0
    assert events(tmp_path, Stopped), "no clean stop after SIGTERM"
    for proc, name in ((a, "l0"), (b, "l1")):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130, procs.output(name)[-3000:]  # "interrupted: leaving"


def test_syncer_restarted_without_its_checkpoint_goes_on_from_the_newest_global_value(procs: Procs) -> None:
    """A syncer restarted without --resume asks a learner for initial values. The learner
    used to answer with the values it had joined with, so every learner then adopted that
    old model and the run's progress since was silently gone; it answers with the newest
    merged value it holds."""
    s1, endpoint = procs.syncer("--min-quorum", "1", "--learners", "l0", "--overlap", "1", "--grace-max", "0.2")
    port = endpoint.rsplit(":", 1)[1]
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1))
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(endpoint, heartbeat_s=0.2), learner_id="l0")
    try:
        joined = [[t.clone() for t in held] for held in opt.held]
        t = 0
        end = time.monotonic() + 60
        while min(opt.versions) < 3:  # a few merges of every fragment
            assert time.monotonic() < end, f"no merges: versions {opt.versions}"
            t += 1
            train(opt, model, "l0", range(t, t + 1), sleep=0.01)
        s1.send_signal(signal.SIGKILL)
        s1.wait(10)
        newest = [[x.clone() for x in held] for held in opt.held]
        epochs = opt.epochs
        assert any(not torch.equal(a, b) for ja, na in zip(joined, newest) for a, b in zip(ja, na))
        # Quorum 2 with l0 alone: the fresh syncer merges nothing, so the value the learner
        # adopts from it is exactly what seeded it.
        procs.syncer("--min-quorum", "2", "--learners", "l0,l1", "--overlap", "1", "--bind",
                     f"tcp://127.0.0.1:{port}", name="syncer2")
        end = time.monotonic() + 60
        while opt.epochs == epochs or any(e == epochs[0] for e in opt.epochs):
            assert time.monotonic() < end, "the learner never adopted the fresh syncer's values"
            t += 1
            train(opt, model, "l0", range(t, t + 1), sleep=0.01)
        for p, (held, want) in enumerate(zip(opt.held, newest)):
            assert all(torch.equal(a, b) for a, b in zip(held, want)), f"fragment {p}: not the newest global value"
    finally:
        opt.close()


def test_curve_admits_only_allowed_learner_keys(procs: Procs, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("syncer", "l0", "intruder"):
        keygen(keys, name)
    allowed.mkdir()
    (allowed / "l0.key").write_bytes((keys / "l0.key").read_bytes())
    _, endpoint = procs.syncer("--secret-key", str(keys / "syncer.key_secret"), "--allowed-keys", str(allowed),
                               "--learners", "l0", "--grace-max", "0.2")
    ok = procs.learner(endpoint, "l0", "--steps", "24", "--keys", str(keys / "l0.key"),
                       str(keys / "l0.key_secret"), str(keys / "syncer.key"))
    bad = procs.learner(endpoint, "l1", "--steps", "24", "--join-timeout", "4", "--keys", str(keys / "intruder.key"),
                        str(keys / "intruder.key_secret"), str(keys / "syncer.key"), name="intruder")
    plain = procs.learner(endpoint, "l2", "--steps", "24", "--join-timeout", "4", name="plain")
    finish(ok, procs, "l0")
    assert bad.wait(60) != 0 and "no answer from the syncer" in procs.output("intruder")
    assert plain.wait(60) != 0 and "no answer from the syncer" in procs.output("plain")
    ev = events(tmp_path)
    assert of(ev, AuthDenied), "the refused key was not logged"
    assert {e.learner for e in of(ev, Joined)} == {"l0"}
    assert any(e.merged == ("l0",) for e in of(ev, Merged))


def test_ctrl_c_ends_learner_and_syncer_cleanly(procs: Procs, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--learners", "l0", "--grace-max", "0.2", "--checkpoint-dir", str(ck))
    pl = tmp_path / "l0.progress"
    learner = procs.learner(endpoint, "l0", "--steps", "100000", "--step-sleep", "0.01", "--progress", str(pl))
    wait_for(lambda: progress(pl)[0] >= 20, 60, "the learner to step", (learner,))
    learner.send_signal(signal.SIGINT)
    assert learner.wait(15) == 130 and "interrupted: leaving" in procs.output("l0")
    wait_for(lambda: any(e.learner == "l0" and e.reason == "leave" for e in events(tmp_path, Left)), 10,
             "the syncer to log the graceful leave")
    syncer.send_signal(signal.SIGINT)
    assert syncer.wait(15) == 0
    assert (ck / "syncer.safetensors").exists()
    assert events(tmp_path, Stopped)


# ---------------------------------------------------------------- "no silent wrongness"
H_DEFAULT, P_DEFAULT = 3, 2  # _learner_proc.py's defaults


def _settings(tau: int, *, H: int = H_DEFAULT, P: int = P_DEFAULT, deterministic: bool = False,
              uplink: str = "none", downlink: str = "none", apply: str = "keep_local") -> dict:
    return {"sync_every": H, "num_fragments": P, "overlap": tau, "deterministic": deterministic,
            "uplink": uplink, "downlink": downlink, "apply": apply}


def _hello(lid: str, settings: dict, *, H: int = H_DEFAULT, P: int = P_DEFAULT) -> list:
    frags = pack_fragments(make_model(), P, H)
    return wire.encode({"type": "hello", "learner": lid, "rank": 0, "world": 1, "layout": layout_to_wire(frags),
                        "fingerprint": fingerprint(frags), "settings": settings})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_join_without_a_syncer_says_what_it_waits_for_and_fails_clearly(procs: Procs) -> None:
    """Trap 7: nothing listens at the endpoint. The learner logs (unconfigured logging
    included) what it waits for, every few seconds, and fails naming what to check."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    lone = procs.learner(endpoint, "l0", "--steps", "3", "--join-timeout", "7")
    assert lone.wait(90) != 0
    out = procs.output("l0")
    waiting = [line for line in out.splitlines() if "waiting for the syncer" in line]
    assert waiting, f"no progress line while joining:\n{out[-3000:]}"
    assert endpoint in waiting[0] and "l0" in waiting[0] and "5s" in waiting[0]
    assert "join_timeout" in out and "rackmend syncer" in out and endpoint in out
    assert "connection: connection refused or unreachable, retrying" in waiting[0], waiting[0]
    assert time.monotonic() - t0 < 60


def test_a_join_that_hears_nothing_says_what_the_connection_does() -> None:
    """Nothing listens: the join's error says the connection is refused and retried. A
    peer that accepts TCP but never speaks ZeroMQ: the connection is up at the TCP level
    and its handshake is pending, which points at the port, not at the syncer's rules."""
    frags = pack_fragments(make_model(), 2, 4)
    initial = [[torch.zeros(t.shape) for t in f.tensors] for f in frags]
    settings = RunRules.from_config(RAW_CONFIG)

    def join_error(endpoint: str) -> str:
        link = ZmqLink(endpoint, rank=0, world_size=1)
        try:
            with pytest.raises(TransportError) as err:
                link.join("l0", frags, initial, 2.0, settings=settings)
            return str(err.value)
        finally:
            link.leave()

    assert "connection refused or unreachable, retrying" in join_error(f"tcp://127.0.0.1:{_free_port()}")
    with socket.socket() as mute:  # listens, accepts, never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        text = join_error(f"tcp://127.0.0.1:{mute.getsockname()[1]}")
    assert "TCP connected, ZeroMQ handshake pending" in text, text


def test_join_timeout_default_fits_a_person_at_a_terminal() -> None:
    from rackmend.config import LearnerConfig

    assert 30 <= LearnerConfig().join_timeout <= 180
    assert LearnerConfig().wait_timeout == 600  # merges may legitimately be slow; joining should not
    with pytest.raises(ConfigError, match="join_timeout"):
        LearnerConfig(join_timeout=0)


def test_first_learner_dying_mid_init_hands_seeding_to_the_next(procs: Procs, tmp_path: Path) -> None:
    """Trap 8: the first learner says hello, gets init_request and dies before any init.
    After --init-timeout the next learner seeds the model and trains to the end."""
    # Through the environment: the option's RACKMEND_ name must reach the service too.
    _, endpoint = procs.syncer("--overlap", "1", env={"RACKMEND_INIT_TIMEOUT": "4"})
    ghost = Dealer(endpoint)
    try:
        ghost.send(_hello("ghost", _settings(1)))
        assert ghost.recv_type("init_request", 20) is not None, "the first learner was not asked for init"
    finally:
        ghost.close()  # dies without sending init
    learner = procs.learner(endpoint, "l0", "--steps", "12", "--tau", "1", "--join-timeout", "20")
    finish(learner, procs, "l0", timeout=90)
    ev = events(tmp_path)
    kinds = [(type(e), getattr(e, "learner", None)) for e in ev]
    assert (InitRequested, "ghost") in kinds and (InitTimedOut, "ghost") in kinds
    assert (InitRequested, "l0") in kinds and (Initialised, "l0") in kinds
    assert kinds.index((InitTimedOut, "ghost")) < kinds.index((Initialised, "l0"))
    assert any("l0" in e.merged for e in of(ev, Merged))


def test_init_request_passes_to_a_waiting_learner_after_init_timeout() -> None:
    """Trap 8, the hand-over itself: two learners wait, the seeder never sends init; the
    other one is asked after init_timeout (not before), and both steps are logged."""
    rig = CoreRig(RackmendConfig(schedule=ScheduleConfig(sync_every=3, num_fragments=2, overlap=1)),
                  init_timeout=0.5)
    first, second = rig.learner("a"), rig.learner("b")
    assert [type(m) for m in first.send(_hello("a", _settings(1)))] == [wire.InitRequestIn]
    assert second.send(_hello("b", _settings(1))) == []
    rig.advance(0.4)
    assert second.read() == [], "seeding passed on before init_timeout"
    rig.advance(0.2)
    assert [type(m) for m in second.read()] == [wire.InitRequestIn], "seeding did not pass to the waiting learner"
    timeout = rig.of(InitTimedOut)
    assert timeout and timeout[0].learner == "a" and timeout[0].next == "b"
    assert [e.learner for e in rig.of(InitRequested)] == ["a", "b"]


def test_learner_with_another_overlap_is_refused_by_name(procs: Procs, tmp_path: Path) -> None:
    """Trap 11: a syncer for tau=2 refuses a tau=1 learner with a fatal error naming the
    setting, both values and the fix; the learner exits non-zero saying so."""
    _, endpoint = procs.syncer("--overlap", "2")
    wrong = procs.learner(endpoint, "l0", "--steps", "6", "--tau", "1", "--join-timeout", "30")
    assert wrong.wait(90) != 0, "a learner with tau=1 trained against a syncer with --overlap 2"
    out = procs.output("l0")
    assert "overlap" in out and "--overlap 1" in out, out[-3000:]
    refused = events(tmp_path, SettingsRefused)
    assert refused and refused[0].setting == "overlap" and refused[0].learner == "l0"
    assert (refused[0].learner_value, refused[0].syncer_value) == (1, 2)


def test_hello_settings_are_checked_against_the_syncer_and_the_other_learners() -> None:
    """deterministic and the downlink codec must equal the syncer's; H, P and tau must
    equal the first learner's (the syncer has no schedule of its own); another uplink
    codec is fine but logged once per learner."""
    down = CompressionConfig(downlink="int8")
    rig = CoreRig(RackmendConfig(schedule=ScheduleConfig(sync_every=3, num_fragments=2, overlap=1), compression=down),
                  syncer=RunConfig(compression=down))

    def hello(lid: str, settings: dict, **layout: int) -> wire.ErrorIn | None:
        errors = errors_in(rig.learner(lid).send(_hello(lid, settings, **layout)))
        return errors[0] if errors else None

    seeder = rig.learner("seed")
    assert [type(m) for m in seeder.send(_hello("seed", _settings(1, downlink="int8", uplink="int4")))] == [
        wire.InitRequestIn]
    for p, spec in enumerate(pack_fragments(make_model(), 2, 3)):
        seeder.send(wire.init_frames("seed", 0, p, [torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors]))
    assert len(seeder.versions) == 2, "the seeder did not join"
    err = hello("det", _settings(1, downlink="int8", deterministic=True))
    assert err and err.code == "fatal" and "deterministic" in err.reason and "--deterministic" in err.reason
    err = hello("down", _settings(1, downlink="none"))
    assert err and err.code == "fatal" and "downlink" in err.reason and "int8" in err.reason
    err = hello("h4", _settings(1, H=4, downlink="int8"), H=4)
    assert err and err.code == "fatal" and "sync_every" in err.reason and "4" in err.reason
    err = hello("p1", _settings(1, P=1, downlink="int8"), P=1)
    assert err and err.code == "fatal" and "num_fragments" in err.reason
    err = hello("tau0", _settings(0, downlink="int8"))
    assert err and err.code == "fatal" and "overlap (tau) differs" in err.reason and "the first to join" in err.reason
    assert rig.node.core is not None
    sch = rig.node.core.config.schedule
    assert (sch.sync_every, sch.num_fragments, sch.overlap) == (3, 2, 1), "the syncer runs the first learner's rules"
    err = hello("ow", _settings(1, downlink="int8", apply="overwrite"))
    assert err and err.code == "fatal" and "apply" in err.reason and "'keep_local'" in err.reason
    assert hello("up", _settings(1, downlink="int8:block_size=256")) is None  # the same codec, spelt out
    refused = {e.learner: e.setting for e in rig.of(SettingsRefused)}
    assert refused == {"det": "deterministic", "down": "downlink", "h4": "sync_every", "p1": "num_fragments",
                       "tau0": "overlap", "ow": "apply"}
    uplink = rig.of(UplinkCodecDiffers)
    assert [(e.learner, e.learner_codec, e.syncer_codec) for e in uplink] == [("seed", "int4", "none")]
    assert {e.learner for e in rig.of(Joined)} == {"seed", "up"}


def test_work_sent_before_a_graceful_leave_is_merged(procs: Procs, tmp_path: Path) -> None:
    """Roster l0,l1 with K=2 and only l0 running: no round ever reaches quorum. l0 sends
    and leaves; its last contribution is merged at the leave and is in the syncer's
    value. Outer SGD lr 1 without momentum makes that value l0's model at its send."""
    ck = tmp_path / "ck"
    H, steps = 3, 6  # the last step is a send: l0's final model is what it last sent
    syncer, endpoint = procs.syncer("--min-quorum", "2", "--learners", "l0,l1", "--grace-max", "30",
                                    "--overlap", "0", "--outer-lr", "1", "--outer-kwargs", "{}",
                                    "--checkpoint-dir", str(ck))
    l0 = procs.learner(endpoint, "l0", "--steps", str(steps), "--H", str(H), "--P", "1", "--tau", "0",
                       "--out", str(tmp_path / "l0.safetensors"))
    finish(l0, procs, "l0")
    wait_for(lambda: bool(events(tmp_path, Merged)), 30, "a merge after l0's leave", (syncer,))
    (merge,) = events(tmp_path, Merged)
    assert merge.merged == ("l0",) and merge.cause == "leave"
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0
    theta = load_file(str(ck / "syncer.safetensors"))
    final = load_file(str(tmp_path / "l0.safetensors"))
    init = make_model()
    (frag,) = pack_fragments(init, 1, H, ScheduleConfig().packing)
    initial = dict(init.named_parameters())
    for i, name in enumerate(frag.names):
        assert not torch.equal(final[name], initial[name].detach()), "vacuous: l0 did not move"
        assert torch.allclose(theta[f"theta/0/{i}"], final[name], rtol=0, atol=1e-6), f"{name}: l0's work is missing"


def test_graceful_stop_merges_pending_work_before_its_checkpoint(tmp_path: Path) -> None:
    """A learner's send waits for a quorum (K=2) that never comes and the learner has
    not left; the service's graceful stop merges it and checkpoints the result."""
    H = 3
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=1, overlap=1),
                            syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1"), grace_max=30.0,
                                                outer_lr=1.0, outer_kwargs={}))
    svc, records, server = serving(config, checkpoint_dir=str(tmp_path / "ck"))
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(svc.endpoint, leave_timeout_s=1.0),
                            learner_id="l0")
    try:
        train(opt, model, "l0", range(1, H + 1))  # sends at step H, the last one
        wait_for(lambda: svc.core is not None and bool(svc.core.frags[0].round.pending), 20, "l0's send at the syncer")
    finally:
        svc.stop()
        server.join(20)
        opt.close()
    assert not server.is_alive()
    kinds = [type(r) for r in records]
    assert FinalMerged in kinds and kinds.index(FinalMerged) < kinds.index(CheckpointWritten)
    (merge,) = of(records, Merged)
    assert merge.cause == "final" and merge.merged == ("l0",)
    theta = load_file(str(tmp_path / "ck" / "syncer.safetensors"))
    named = dict(model.named_parameters())
    for i, name in enumerate(svc.core.fragments[0].names):  # type: ignore[union-attr]
        assert torch.allclose(theta[f"theta/0/{i}"], named[name].detach(), rtol=0, atol=1e-6), \
            f"{name}: l0's work is missing"


def test_syncer_console_shows_progress_lines(procs: Procs, tmp_path: Path) -> None:
    """Merges go to the --log file; the console sums them up every --progress-every
    seconds (a new user watching the syncer sees training move): each line's count adds
    up to no more than the merges logged, and it names only learners that merged."""
    syncer, endpoint = procs.syncer("--overlap", "1", "--progress-every", "0.5")
    learners = {lid: procs.learner(endpoint, lid, "--steps", "40", "--H", "2", "--P", "2", "--tau", "1",
                                   "--step-sleep", "0.05") for lid in ("l0", "l1")}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0
    lines = re.findall(r"progress: (\d+) merges in the last [\d.]+ s \(latest versions ([^)]*)\); learners merged: (.*)",
                       procs.output("syncer"))
    merges = events(tmp_path, Merged)
    assert len(lines) >= 2, procs.output("syncer")[-2000:]
    assert sum(int(n) for n, _, _ in lines) <= len(merges)
    assert {lid for _, _, named in lines for lid in named.split(", ")} <= {lid for e in merges for lid in e.merged}
    top = {int(f): int(v) for _, versions, _ in lines for f, v in re.findall(r"(\d+): v(\d+)", versions)}
    assert all(v <= max(e.version for e in merges if e.fragment == f) for f, v in top.items())


def test_a_contribution_a_restarted_syncer_did_not_take_in_goes_again_after_the_hello(tmp_path: Path) -> None:
    """A restarted syncer (or a shard resumed from its checkpoint) knows no connection:
    what a learner sent meanwhile was refused (``unknown_peer``) and, before, lost (8
    contributions after one shard restart). The link now queues every contribution the
    syncer did not acknowledge again after its hello, and it merges as a stale one."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    service = ServiceConfig(bind=bind, checkpoint_dir=str(tmp_path / "ck"), heartbeat_timeout=60)
    first = SyncerService(RAW_CONFIG, service)
    thread = threading.Thread(target=first.serve, daemon=True)
    thread.start()
    frags = pack_fragments(make_model(), 2, 4)
    link = ZmqLink(bind)
    resumed = None
    try:
        joined = link.join("l0", frags, [[torch.zeros(t.shape, dtype=t.dtype) for t in f.tensors] for f in frags],
                           20.0, settings=RunRules.from_config(RAW_CONFIG))
        epoch = joined[0].epoch
        first.stop()
        thread.join(20)  # its checkpoint holds version 0 of both fragments
        link.send(Contribution("l0", 0, 0, 4, 4, 16.0, 0.01, tuple(torch.full(t.shape, 0.01) for t in frags[0].tensors),
                               base_epoch=epoch))
        resumed = SyncerService(RAW_CONFIG, dataclasses.replace(service, resume=True))
        records = watch_log(resumed)
        thread = threading.Thread(target=resumed.serve, daemon=True)
        thread.start()
        end = time.monotonic() + 30
        while not any(isinstance(r, Merged) and r.fragment == 0 and "l0" in r.merged for r in records):
            assert time.monotonic() < end, f"the contribution sent while the syncer was down never merged: {records}"
            time.sleep(0.05)
    finally:
        link.close()
        if resumed is not None:
            resumed.stop()
        thread.join(20)
