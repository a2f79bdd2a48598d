"""``rackmend status``: a read-only view of a live syncer. The JSON lists every learner
(ranks, state, bytes, step time) and every fragment with the versions the syncer's log
shows; Curve keys apply to it as to learners; bad requests are answered and logged
while learners keep being served; the asker never counts as a learner."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from safetensors.torch import load_file

from rackmend.cli import main as cli_main
from rackmend import RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.core.records import Merged
from rackmend.service.events import AuthDenied, BadMessage
from rackmend.transport import wire
from rackmend.transport.status import StatusClient, StatusRefused, StatusTimeout
from rackmend.transport.zmq_link import ZmqLink

from helpers import Dealer, keygen, make_inner, make_model, serving, train
from procs import LEARNER, TORCHRUN, Procs, events, finish, of, progress, wait_for

STATUS = [sys.executable, "-m", "rackmend.cli", "status"]


def status_json(endpoint: str, *flags: str, timeout: float = 10.0) -> tuple[int, dict | None, str]:
    """``rackmend status --once --json``, the command's own code run in this process (a
    Python start-up per call cost seconds): (exit code, document, stderr). The tests below
    that need a process of its own (a pipe closed early) start one."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["status", endpoint, "--once", "--json", "--timeout", str(timeout), *flags])
    return rc, json.loads(out.getvalue()) if rc == 0 else None, err.getvalue()


def last_versions(tmp: Path, fragments: int) -> list[int]:
    merges = events(tmp, Merged)
    return [max([e.version for e in merges if e.fragment == p], default=0) for p in range(fragments)]


def test_status_lists_every_learner_and_fragment_with_the_logged_versions(procs: Procs, tmp_path: Path) -> None:
    P = 2
    _, endpoint = procs.syncer("--learners", "l0,l1", "--grace-max", "0.3", "--heartbeat-timeout", "30")
    common = ("--step-sleep", "0.02", "--H", "3", "--P", str(P), "--learners", "l0,l1")
    pa, pb = tmp_path / "l0.progress", tmp_path / "l1.progress"
    held = tmp_path / "l0.held.safetensors"
    # l1 is a torchrun job of two ranks: each carries the fragments p = rank (mod 2). Both
    # start at once; l1 runs longer (a torchrun job also starts slower), so both are
    # connected while the status is asked.
    b = procs.start([*TORCHRUN, *LEARNER[1:], "--endpoint", endpoint, "--id", "l1", "--steps", "400", *common,
                     "--progress", str(pb)], "l1")
    a = procs.learner(endpoint, "l0", "--steps", "150", *common, "--progress", str(pa), "--held-out", str(held))
    wait_for(lambda: progress(pb)[0] >= 5 and progress(pa)[0] >= 20, 90, "l1 to take 5 steps and l0 20", (a, b))
    assert progress(pb)[0] < 300, "l1 nearly done before the status was asked: the test checks too little"

    before = last_versions(tmp_path, P)
    rc, doc, err = status_json(endpoint)
    after = last_versions(tmp_path, P)
    assert rc == 0, err
    assert doc is not None
    by_id = {ln["id"]: ln for ln in doc["learners"]}
    assert set(by_id) == {"l0", "l1"}
    assert by_id["l0"]["ranks"] == [0] and by_id["l0"]["world"] == 1
    assert by_id["l1"]["ranks"] == [0, 1] and by_id["l1"]["world"] == 2
    for ln in by_id.values():
        assert ln["state"] == "connected" and ln["expected"], ln
        assert ln["bytes_in"] > 0 and ln["bytes_out"] > 0 and ln["contributions"] > 0, ln
        assert ln["step"] >= 3 and 0 < ln["step_time_s"] < 5 and ln["last_seen_s"] < 30, ln
        assert ln["version_lag"] is not None and ln["version_lag"] >= 0
    assert [f["fragment"] for f in doc["fragments"]] == list(range(P))
    for f in doc["fragments"]:
        # Merges go on while the request crosses: the answer lies between the log before and after.
        assert before[f["fragment"]] <= f["version"] <= after[f["fragment"]], (before, f, after)
        # The round's phase agrees with what it holds: open until fresh work is in.
        assert f["phase"] == "open" if not f["fresh"] else f["phase"] in ("gathering", "grace"), f
        assert (f["phase"] == "grace") == (f["grace_left_s"] is not None), f
    assert doc["syncer"]["state"] == "running" and doc["syncer"]["merges"] >= sum(before)

    finish(a, procs, "l0", timeout=120)
    finish(b, procs, "l1", timeout=120)
    rc, doc, err = status_json(endpoint)
    assert rc == 0, err
    assert doc is not None
    final = last_versions(tmp_path, P)  # nobody trains now: the answer must equal the log exactly
    assert [f["version"] for f in doc["fragments"]] == final
    assert all(f["phase"] == "open" and not f["waiting"] for f in doc["fragments"]), doc["fragments"]
    assert doc["syncer"]["merges"] == len(events(tmp_path, Merged))
    by_id = {ln["id"]: ln for ln in doc["learners"]}
    assert {ln["state"] for ln in by_id.values()} == {"left"} and not any(ln["ranks"] for ln in by_id.values())
    # l0's newest work was based on a version it held; it holds at most what the syncer has.
    held_versions = load_file(str(held))["versions"].tolist()
    for entry in by_id["l0"]["based_on"]:
        p = entry["fragment"]
        assert entry["base_version"] <= held_versions[p] <= final[p], (entry, held_versions, final)
    assert [e["fragment"] for e in by_id["l0"]["based_on"]] == list(range(P))
    assert by_id["l0"]["step"] == 150  # its last send: fragment 0 at step 150
    assert by_id["l1"]["step"] in (398, 400)  # rank 1's last send (fragment 1) or rank 0's (fragment 0)

def test_status_obeys_the_syncers_curve_keys(procs: Procs, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("syncer", "l0", "ops", "intruder"):
        keygen(keys, name)
    allowed.mkdir()
    for name in ("l0", "ops"):
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    _, endpoint = procs.syncer("--secret-key", str(keys / "syncer.key_secret"), "--allowed-keys", str(allowed),
                               "--learners", "l0", "--grace-max", "0.2")
    learner = procs.learner(endpoint, "l0", "--steps", "100000", "--step-sleep", "0.02", "--progress",
                            str(tmp_path / "l0.progress"), "--keys", str(keys / "l0.key"),
                            str(keys / "l0.key_secret"), str(keys / "syncer.key"))
    wait_for(lambda: progress(tmp_path / "l0.progress")[0] >= 5, 60, "l0 to train", (learner,))

    rc, doc, err = status_json(endpoint, "--key", str(keys / "ops.key_secret"), "--server-key",
                               str(keys / "syncer.key"))
    assert rc == 0, err
    assert doc is not None and doc["syncer"]["curve"] is True
    assert [ln["id"] for ln in doc["learners"]] == ["l0"], "the status client must not show up as a learner"

    for flags, name in (((), "no key"), (("--key", str(keys / "intruder.key_secret"), "--server-key",
                                          str(keys / "syncer.key")), "a key not allowed")):
        rc, doc, err = status_json(endpoint, *flags, timeout=2.0)
        assert rc == 1 and doc is None, f"{name}: answered"
        assert "no answer from the syncer" in err and "within 2s" in err and "--key" in err, err
        assert "Traceback" not in err
    assert events(tmp_path, AuthDenied), "the refused key was not logged"
    step = progress(tmp_path / "l0.progress")[0]
    wait_for(lambda: progress(tmp_path / "l0.progress")[0] >= step + 5, 30, "l0 to train on", (learner,))


def test_bad_status_requests_are_answered_and_the_asker_is_no_learner(tmp_path: Path) -> None:
    H = 3
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=1, overlap=1),
                            syncer=SyncerConfig(min_quorum=1, grace_max=0.1))
    svc, records, server = serving(config)
    model = make_model()
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(svc.endpoint, leave_timeout_s=1.0),
                            learner_id="l0")
    raw = Dealer(svc.endpoint)
    try:
        train(opt, model, "l0", range(1, H + 1))
        for header in ({"type": "status"}, {"type": "status", "nonce": -1}, {"type": "status", "nonce": "x"},
                       {"type": "status", "nonce": 2**64 - 1}, {"type": "hello"}):
            raw.send(wire.encode(header))
            reply = raw.recv_type("error", 10)
            assert reply is not None and reply["code"] == "bad_message", header
            assert "nonce" in reply["reason"] or "learner" in reply["reason"], reply
        raw.send(wire.status_request_frames(41))
        reply = raw.recv_type("status_reply", 10)
        assert reply is not None and reply["nonce"] == 41
        assert [ln["id"] for ln in reply["status"]["learners"]] == ["l0"]
        train(opt, model, "l0", range(H + 1, 2 * H + 1))  # still served after the bad requests
        with StatusClient(svc.endpoint) as client:
            # The link sends on its own thread: the step-6 send reaches the syncer a moment later.
            wait_for(lambda: client.query(10).learners[0].step == 2 * H, 20, "l0's step-6 send in the status")
            assert client.query(10).learners[0].state == "connected"
        assert svc.core is not None and set(svc.core.members) == {"l0"} and len(svc.peers) == 1
    finally:
        raw.close()
        opt.close()
        svc.stop()
        server.join(20)
    bad = of(records, BadMessage)
    assert len(bad) == 5, bad
    assert svc.node.status_requests >= 3


def test_a_syncer_that_refuses_status_and_one_that_is_silent_fail_clearly() -> None:
    """An older syncer answers the unknown type with ``error bad_message``; no syncer
    at all gives a timeout: both surface as errors that say what happened."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with StatusClient(f"tcp://127.0.0.1:{port}") as client:
            with pytest.raises(StatusTimeout, match="no answer from the syncer"):
                client.query(0.5)
            assert router.poll(5000)
            ident, *_ = router.recv_multipart()
            router.send_multipart([ident, *wire.encode({"type": "error", "code": "bad_message",
                                                        "reason": "unknown message type 'status'"})])
            with pytest.raises(StatusRefused, match="older rackmend"):
                client.query(5)
    finally:
        router.close()


def test_interactive_view_redraws_a_bounded_number_of_times(tmp_path: Path) -> None:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=3, num_fragments=1, overlap=1))
    svc, _, server = serving(config)
    try:
        done = subprocess.run([*STATUS, svc.endpoint, "--iterations", "3", "--interval", "0.1"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        svc.stop()
        server.join(20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\x1b[H\x1b[2J") == 3 and done.stdout.count("LEARNER") == 3
    assert "waiting for a learner" in done.stdout


def test_status_into_a_pipe_closed_early_ends_quietly(procs: Procs, tmp_path: Path) -> None:
    """`rackmend status ... | head -1`: the reader leaves after one line while frames keep
    coming; that is a normal end, not a traceback."""
    _, endpoint = procs.syncer()
    cmd = f"{shlex.join(STATUS)} {endpoint} --iterations 40 --interval 0 --no-clear | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip(), done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def test_the_status_answer_is_typed_round_trips_and_names_a_bad_field() -> None:
    """``SyncerStatus`` crosses the wire as ``to_json()`` and comes back equal; a field of
    the wrong type is refused by name, and what an older syncer did not send takes its
    default (issue 35: typed status)."""
    from rackmend.core.status import (BasedOn, FragmentStatus, LearnerStatus, StatusError, SyncerPart,
                                      SyncerStatus)
    from rackmend.service.status import combine, render

    def shard(s: int, merges: int, step: int) -> SyncerStatus:
        return SyncerStatus(
            syncer=SyncerPart(endpoint=f"tcp://127.0.0.1:{5000 + s}", shard=f"{s}/2", state="running", merges=merges,
                              min_quorum=1, uptime_s=3.0),
            fragments=(FragmentStatus(fragment=s, version=merges, waiting=("a", "b"), fresh=("a",)),),
            learners=(LearnerStatus(id="a", state="connected", ranks=(0,), step=step, contributions=merges,
                                    based_on=(BasedOn(fragment=s, base_version=merges - 1, lag=1),)),))

    one = shard(0, 3, 12)
    doc = json.loads(json.dumps(one.to_json()))
    assert "shards" not in doc["syncer"] and "error" not in doc["syncer"]
    assert SyncerStatus.from_json(doc) == one
    bad = json.loads(json.dumps(doc))
    bad["learners"][0]["step"] = "twelve"
    with pytest.raises(StatusError, match=r"learners\[\]\.step must be int \| None"):
        SyncerStatus.from_json(bad)
    old = {"syncer": {"state": "running"}, "fragments": [{"fragment": 0, "version": 2}], "learners": [{"id": "a"}]}
    parsed = SyncerStatus.from_json(old)
    assert parsed.learners[0].ranks == () and parsed.syncer.merges == 0 and parsed.fragments[0].waiting == ()
    both = combine([one, shard(1, 5, 20)], [SyncerPart(shard="2/3", endpoint="tcp://x:1", state="unreachable",
                                                       error="no answer")])
    assert both.syncer.merges == 8 and both.syncer.state == "degraded" and both.syncer.shard == "2 of 3 shards"
    assert [x.shard for x in both.syncer.shards] == ["0/2", "1/2", "2/3"]
    (a,) = both.learners
    assert a.contributions == 8 and a.step == 20 and [b.fragment for b in a.based_on] == [0, 1]
    assert SyncerStatus.from_json(json.loads(json.dumps(both.to_json()))) == both
    text = render(both, "tcp://127.0.0.1:5000,tcp://127.0.0.1:5001")
    assert "UNREACHABLE (no answer)" in text and "a,b*" in text
