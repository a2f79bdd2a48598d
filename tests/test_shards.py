"""Syncer shards (``rackmend syncer --shard s/S``): each shard owns the fragments p with
p mod S == s and nothing else; a learner routes each fragment to its shard. Two shards
with three learner processes equal the single-process reference bit for bit; a SIGKILLed
shard pauses only its own fragments and resumes from its own checkpoint; a learner that
gives the shards' endpoints in the wrong order, or one endpoint only, is refused by name."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.config import ConfigError
from rackmend.core.fragments import pack_fragments
from rackmend.core.records import Left, Merged, Rejected, SyncerRecord
from rackmend.core.shards import Shard, owner, parse_shard
from rackmend.core.settings import RunRules
from rackmend.service.events import CheckpointWritten, Resumed
from rackmend.service.export import ExportError, export_model
from rackmend.transport import wire

from helpers import assert_files_equal_reference, batch, make_inner, make_model, serving
from procs import LEARNER, Procs, finish, of, progress, read_records, wait_for
from reference import reference_run
from test_status import status_json
from test_trust import CONFIG, Raw


def shard_events(tmp: Path, s: int, *kinds: type[SyncerRecord]) -> list:
    """Shard ``s``'s log records so far, typed, of ``kinds`` if given."""
    return of(read_records(tmp / f"shard{s}.jsonl"), *kinds)


def start_shard(procs: Procs, tmp: Path, s: int, count: int, *flags: str, name: str | None = None) -> tuple:
    return procs.syncer("--shard", f"{s}/{count}", "--log", str(tmp / f"shard{s}.jsonl"), *flags,
                        name=name or f"shard{s}")


# ------------------------------------------------------------------ the rule
def test_shard_numbering_and_refusals() -> None:
    two = [Shard(0, 2), Shard(1, 2)]
    assert [owner(p, 2) for p in range(5)] == [0, 1, 0, 1, 0]
    assert [two[1].local(p) for p in (1, 3, 5)] == [0, 1, 2]
    assert [two[1].to_global(i) for i in range(3)] == [1, 3, 5]
    frags = pack_fragments(make_model(), 4, 4)
    mine = two[1].fragments(frags)
    assert [f.index for f in mine] == [0, 1] and [f.tensors for f in mine] == [frags[1].tensors, frags[3].tensors]
    assert two[0].select("abcd") == ("a", "c")
    assert two[1].record(Left(t=0.0, learner="a", reason="leave")) == Left(t=0.0, learner="a", reason="leave")
    assert two[1].record(Rejected(t=0.0, learner="a", fragment=1, code="stale", reason="")).fragment == 3
    assert parse_shard("1/3") == Shard(1, 3)
    for bad in ("2/2", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(ConfigError, match="shard"):
            parse_shard(bad)


def test_a_hello_for_another_shard_or_an_unsharded_learner_is_refused_by_name() -> None:
    svc, records, thread = serving(CONFIG, shard="1/2")
    try:
        for shard, expect in ((Shard(0, 2), "meant for syncer shard 0/2, but it is shard 1/2"),
                              (Shard(), "meant for syncer shard 0/1, but it is shard 1/2")):
            raw = Raw(svc.endpoint, "l0")
            try:
                raw.send(wire.hello_frames("l0", 0, 1, raw.frags, RunRules.from_config(CONFIG), shard=shard))
                reply = raw.recv(10.0)
            finally:
                raw.close()
            assert reply is not None and reply[0]["code"] == "fatal" and expect in reply[0]["reason"], reply
            assert "every shard's endpoint, in shard order" in reply[0]["reason"]
        # The right one joins; a message about the other shard's fragment is refused, naming it.
        raw = Raw(svc.endpoint, "l1")
        try:
            raw.send(wire.hello_frames("l1", 0, 1, raw.frags, RunRules.from_config(CONFIG),
                                       shard=Shard(1, 2)))
            assert raw.recv(10.0)[0]["type"] == "init_request"
            raw.send(wire.init_frames("l1", 0, 0, [torch.zeros(t.shape) for t in raw.frags[0].tensors]))
            err = next(h for h, _ in iter(lambda: raw.recv(10.0), None) if h["type"] == "error")
            assert "fragment 0 belongs to syncer shard 0 of 2" in err["reason"], err
            # A fragment the model does not have is named as the model numbers it (3, of 2),
            # not as the shard does (its fragment 1).
            raw.send(raw.contribution(frag=1, fragment=3))
            err = next(h for h, _ in iter(lambda: raw.recv(10.0), None) if h["type"] == "error")
            assert "unknown fragment 3 (the layout has 2)" in err["reason"], err
        finally:
            raw.close()
    finally:
        svc.stop()
        thread.join(20)


# ------------------------------------------------------------------ real processes
def test_two_shards_and_three_learner_processes_equal_the_reference(procs: Procs, tmp_path: Path) -> None:
    ids, H, P, tau, steps = ["l0", "l1", "l2"], 3, 4, 1, 12
    flags = ("--deterministic", "--min-quorum", "3", "--learners", ",".join(ids), "--overlap", str(tau))
    endpoints = [start_shard(procs, tmp_path, s, 2, *flags)[1] for s in range(2)]
    learners = {lid: procs.start([*LEARNER, "--endpoint", ",".join(endpoints), "--id", lid, "--steps", str(steps),
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
    for s in range(2):  # each shard merged its own fragments, named as the model numbers them
        merges = shard_events(tmp_path, s, Merged)
        assert {e.fragment for e in merges} == {p for p in range(P) if p % 2 == s}
        assert len(merges) >= 2 * 3 and all(list(e.merged) == ids for e in merges)


def test_a_killed_shard_pauses_only_its_fragments_and_resumes_from_its_checkpoint(
        procs: Procs, tmp_path: Path) -> None:
    flags = ("--min-quorum", "1", "--learners", "l0,l1", "--grace-max", "0.3", "--checkpoint-every", "4")
    shards = [start_shard(procs, tmp_path, s, 2, *flags, "--checkpoint-dir", str(tmp_path / f"ck{s}"))
              for s in range(2)]
    endpoints = ",".join(e for _, e in shards)
    # A join may wait long on a loaded host: once in a full suite run a shard answered
    # nothing for 30 s after its first checkpoint (not reproduced alone; see the closing
    # note of 2026-12-07). 120 s tells a slow shard from a stalled one.
    learner_flags = ("--steps", "100000", "--step-sleep", "0.02", "--P", "4", "--H", "4", "--tau", "2",
                     "--join-timeout", "120")
    pa, pb = tmp_path / "l0.progress", tmp_path / "l1.progress"
    a = procs.learner(endpoints, "l0", *learner_flags, "--progress", str(pa))
    b = procs.learner(endpoints, "l1", *learner_flags, "--progress", str(pb))
    wait_for(lambda: bool(shard_events(tmp_path, 1, CheckpointWritten)), 90,
             "shard 1's first checkpoint", (a, b))
    # `rackmend status` over both shards: one view, every fragment, each learner once.
    rc, status, err = status_json(endpoints)
    assert rc == 0 and status is not None, err
    assert [f["fragment"] for f in status["fragments"]] == [0, 1, 2, 3]
    assert [x["shard"] for x in status["syncer"]["shards"]] == ["0/2", "1/2"]
    assert [ln["id"] for ln in status["learners"]] == ["l0", "l1"]
    assert status["syncer"]["merges"] == sum(x["merges"] for x in status["syncer"]["shards"]) > 0
    killed, _ = shards[1]
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    saved = shard_events(tmp_path, 1, CheckpointWritten)[-1].versions
    before = len(shard_events(tmp_path, 0))
    step = progress(pa)[0]

    def during() -> list[Merged]:
        return of(shard_events(tmp_path, 0)[before:], Merged)

    # Waited for, not timed: on a loaded host the learners can step faster than the
    # shard merges (CI once saw 2 merges in l0's next 40 steps).
    wait_for(lambda: progress(pa)[0] >= step + 40 and len(during()) >= 4 and {e.fragment for e in during()} == {0, 2},
             90, "l0 to keep stepping and shard 0 to keep merging both its fragments with shard 1 down", (a, b))
    # `rackmend status` with a shard down shows the live one and marks the dead one.
    rc, status, err = status_json(endpoints, timeout=2.0)
    assert rc == 0 and status is not None, err
    assert status["syncer"]["state"] == "degraded" and status["syncer"]["shard"] == "1 of 2 shards"
    assert [(x["shard"], x["state"]) for x in status["syncer"]["shards"]] == [("0/2", "running"),
                                                                              ("1/2", "unreachable")]
    assert [f["fragment"] for f in status["fragments"]] == [0, 2]
    port = shards[1][1].rsplit(":", 1)[1]
    start_shard(procs, tmp_path, 1, 2, *flags, "--checkpoint-dir", str(tmp_path / "ck1"), "--resume", "--bind",
                f"tcp://127.0.0.1:{port}", name="shard1-resumed")
    resumed = shard_events(tmp_path, 1, Resumed)[-1]
    assert resumed.shard == "1/2" and all(r >= v for r, v in zip(resumed.versions, saved)), \
        "a checkpointed merge of the killed shard was lost"
    wait_for(lambda: {lid for e in shard_events(tmp_path, 1, Merged) if e.t > resumed.t
                      for lid in e.merged} >= {"l0", "l1"}, 90, "both learners to merge on the resumed shard",
             (a, b))
    after = [e for e in shard_events(tmp_path, 1, Merged) if e.t > resumed.t]
    assert all(e.fragment in (1, 3) for e in after)
    assert all(e.version > resumed.versions[Shard(1, 2).local(e.fragment)] for e in after)
    for proc, name in ((a, "l0"), (b, "l1")):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, procs.output(name)[-3000:]
    for proc in (shards[0][0], procs.started[-1]):  # shard 0 and the resumed shard 1: a final checkpoint each
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # The global model is every shard's checkpoint together; one shard's alone is refused by name.
    out = tmp_path / "model.safetensors"
    result = export_model([tmp_path / "ck1", tmp_path / "ck0"], out)
    model = make_model()
    assert sorted(result.synced) == sorted(n for n, _ in model.named_parameters())
    model.load_state_dict(load_file(str(out)))
    last = {s: shard_events(tmp_path, s, CheckpointWritten)[-1].versions for s in (0, 1)}
    assert result.versions == [last[p % 2][p // 2] for p in range(4)]
    with pytest.raises(ExportError, match="shards 1/2 are missing"):
        export_model(tmp_path / "ck0", tmp_path / "half.safetensors")
