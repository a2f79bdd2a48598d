"""A learner id is bound to something a stranger cannot borrow: with Curve, to the keys
allowed to use it; without, to the connection that said hello for it. Forged hellos,
leaves and contributions are refused and logged while the real learner keeps merging.
And the learner's link side: a rejoin request during the hello back-off is answered,
heartbeats go on while a contribution waits for its receipt."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import torch
import zmq
import zmq.auth

from rackmend.core.fragments import pack_fragments
from rackmend.core.messages import Contribution, Update
from rackmend.core.records import Joined, Left, Merged, Rejected
from rackmend.core.settings import RunRules
from rackmend.service.events import AuthDenied, IdentityRefused, Silent, Suppressed, TakenOver
from rackmend.transport import wire
from rackmend.transport.base import TransportError
from rackmend.transport.zmq_link import ZmqLink

from helpers import keygen, make_model, serving
from service_rig import Rig, errors_in, first_error
from procs import Procs, events, finish, of, wait_for
from test_trust import CONFIG, Raw

# The learner processes train with the raw clients' settings (test_trust.CONFIG): H=4, P=2, tau=1.
LEARNER_FLAGS = ("--H", "4", "--P", "2", "--tau", "1", "--steps", "100000", "--step-sleep", "0.01")
SYNCER_FLAGS = ("--overlap", "1", "--grace-max", "0.05")


def _fragment_merges(tmp: Path, lid: str, fragment: int, start: int) -> int:
    return sum(1 for e in of(events(tmp)[start:], Merged) if e.fragment == fragment and lid in e.merged)


def merges_of(tmp: Path, lid: str, start: int = 0) -> int:
    return sum(1 for e in of(events(tmp)[start:], Merged) if lid in e.merged)


def raw_error(raw: Raw, timeout: float) -> dict | None:
    """The first error reply within ``timeout`` (updates and receipts skipped)."""
    errors = raw.errors(timeout)
    return errors[0] if errors else None


def _merges(rig: Rig, lid: str, fragment: int | None = None, start: int = 0) -> int:
    return sum(1 for r in rig.of(Merged)[start:] if lid in r.merged and fragment in (None, r.fragment))


def test_forged_hello_leave_and_contribution_are_refused_and_a_storm_does_not_cut_merges() -> None:
    rig = Rig()
    real = rig.learner("l0")
    real.join()
    for p in (0, 1, 0):
        real.contribute(p)
    assert _merges(rig, "l0") == 3
    mallory = rig.learner("l0")
    err = first_error(mallory.hello())
    assert err.code == "busy" and "live on another connection" in err.reason, err
    err = first_error(mallory.leave())
    assert "held by another connection" in err.reason, err
    err = first_error(mallory.send(mallory.contribution()))
    assert "held by another connection" in err.reason, err
    # A claim on another rank of l0 with another world size is no way in either.
    err = first_error(mallory.hello(rank=1, world=2))
    assert err.code == "busy" and "ranks" in err.reason, err

    start, before = len(rig.records), _merges(rig, "l0")
    storm = [rig.learner("l0") for _ in range(4)]
    hello = wire.hello_frames("l0", 0, 1, real.frags, real.settings)
    leave = wire.encode({"type": "leave", "learner": "l0", "rank": 0})
    for i in range(150):  # 1200 forged messages, their replies never read, while l0 goes on
        for raw in storm:
            rig.node.receive(raw.ident, hello)
            rig.node.receive(raw.ident, leave)
        if i % 10 == 0:
            real.contribute(i // 10 % 2)
    assert _merges(rig, "l0") == before + 15, "l0 stopped merging in the storm"
    refused = rig.of(IdentityRefused)
    assert {e.type for e in refused} >= {"hello", "leave", "contrib"}
    assert not [e for e in rig.of(Left, Silent, TakenOver) if e.learner == "l0"]
    assert [e.learner for e in rig.of(Joined)] == ["l0"], "a forged hello joined"
    # The storm's log lines are bounded per connection (the rest counted, not written).
    assert len([e for e in rig.records[start:] if isinstance(e, IdentityRefused)]) <= 2 * 5 * len(storm)


def test_a_silent_learners_id_is_taken_over_only_after_takeover_after() -> None:
    """Without its token, a second connection gets the id only once the holder has been
    silent for --takeover-after (here 1.5 s; the holder stays a peer all along)."""
    rig = Rig(takeover_after=1.5)
    first, second = rig.learner("l5"), rig.learner("l5")
    first.join()
    assert first_error(second.hello()).code == "busy"
    rig.advance(1.2)
    err = first_error(second.hello())
    assert err.code == "busy" and "--takeover-after" in err.reason, err
    rig.advance(0.4)  # first says nothing more: silent past --takeover-after
    second.join()
    (take,) = rig.of(TakenOver)
    assert take.learner == "l5" and take.silent_s >= 1.5 and not take.token, take
    # The old connection lost the id: its contribution is refused now.
    err = first_error(first.send(first.contribution()))
    assert "held by another connection" in err.reason, err


def test_a_learner_whose_id_was_taken_while_it_was_stopped_merges_again_when_it_returns() -> None:
    """Without Curve, ids are first-come: a stranger saying hello as l0 takes the id once
    l0 has been silent for --takeover-after, and merges as l0. When l0 comes back (its
    link says hello on the refusal; the id is its again once the stranger is silent) it
    must be able to continue: before,
    the stranger's session retired l0's session for the fragment it sent, and every later
    send of l0 for it was refused as a replay."""
    rig = Rig(takeover_after=1.5)
    real = rig.learner("l0")
    real.join()
    for _ in range(3):
        real.contribute(0)
    mallory = rig.learner("l0")
    assert first_error(mallory.hello()).code == "busy"
    rig.advance(1.6)  # l0 is stopped: silent
    mallory.join()
    start = len(rig.of(Merged))
    mallory.contribute(0)
    assert _merges(rig, "l0", 0, start) == 1, "the stranger's send did not merge"
    # l0 resumes: its next send names an id another connection holds now.
    err = first_error(real.send(real.contribution(0)))
    assert err.code == "rejoin" and "held by another connection" in err.reason, err
    # Its token went with the id: the stranger holds the rank (live) until it is silent.
    assert first_error(real.hello(token=real.token)).code == "busy"
    rig.advance(1.6)  # the stranger went away
    real.join(token=real.token)
    back = len(rig.of(Merged))
    for _ in range(3):
        real.contribute(0)
    assert _merges(rig, "l0", 0, back) == 3, "l0 did not merge fragment 0 again after it came back"
    takes = [e for e in rig.of(TakenOver) if e.learner == "l0"]
    assert [e.token for e in takes] == [False, False], takes
    assert not [e for e in rig.of(Rejected) if e.learner == "l0" and "replay" in e.reason]


def test_a_paused_learner_keeps_its_id_against_a_stranger_and_takes_it_back_with_its_token() -> None:
    """Issue 33, item 8: at the default --takeover-after, a stranger saying hello as l0
    every 0.25 s while l0 is stopped for 5.5 s gets only 'busy', even after l0 was dropped
    as silent (--heartbeat-timeout 2): the rank stays reserved for its resume token.
    (Before: the id went to the stranger 5 s into the pause.) A made-up token does not
    help. When l0 resumes, it says hello with its token and is taken back at once."""
    rig = Rig(heartbeat_timeout=2)
    real = rig.learner("l0")
    real.join()
    real.contribute(0)
    mallory = rig.learner("l0")
    replies = []
    for _ in range(22):  # 5.5 s of hellos: past the old 5 s takeover and the 2 s silence bound
        replies += mallory.hello()
        rig.advance(0.25)
    replies += mallory.hello(token="0" * wire.MAX_TOKEN_CHARS)
    assert not [m for m in replies if not isinstance(m, wire.ErrorIn)], "the stranger was answered as l0"
    assert all(m.code == "busy" for m in errors_in(replies)), replies
    assert any("reserved for the process that held it" in m.reason for m in errors_in(replies)), replies
    assert [e.learner for e in rig.of(Silent)] == ["l0"], "l0 was dropped as silent during its pause"
    assert first_error(real.heartbeat()).code == "rejoin"
    real.join(token=real.token)
    back = len(rig.of(Merged))
    for _ in range(3):
        real.contribute(0)
    assert _merges(rig, "l0", 0, back) == 3, "l0 did not merge again"
    assert [e.learner for e in rig.of(Joined)] == ["l0", "l0"], "l0 joined again, nobody else did"
    assert not rig.of(TakenOver)


def test_a_restarted_learner_takes_its_id_back_at_once_with_its_token(
        procs: Procs, tmp_path: Path, token_dir: Path) -> None:
    """The link keeps the rank's token in a file; a process restarted after a SIGKILL finds
    it (its writer is gone) and is admitted with its first hello, before --takeover-after
    (12 s here; the killed connection stays a peer meanwhile: --heartbeat-timeout 30).
    Restarted where the file is not (another host), it waits --takeover-after:
    test_a_silent_learners_id_is_taken_over_only_after_takeover_after, on a fake clock."""
    _, endpoint = procs.syncer(*SYNCER_FLAGS, "--takeover-after", "12", "--heartbeat-timeout", "30")
    joins = lambda: len(of(events(tmp_path), Joined))  # noqa: E731
    first = procs.learner(endpoint, "l0", *LEARNER_FLAGS, name="l0-first")
    wait_for(lambda: _fragment_merges(tmp_path, "l0", 0, 0) >= 3, 60, "l0 to merge fragment 0", (first,))
    assert len(list(token_dir.glob("*.json"))) == 1, "the first process kept its token"
    first.kill()
    first.wait(10)
    second = procs.learner(endpoint, "l0", *LEARNER_FLAGS, name="l0-second")
    wait_for(lambda: joins() >= 2, 60, "the restarted l0 to join", (second,))
    (take,) = of(events(tmp_path), TakenOver)
    assert take.learner == "l0" and take.token and take.silent_s < 12, take  # its token, not the silence
    assert not of(events(tmp_path), IdentityRefused), "the restarted l0 was never refused"

    wait_for(lambda: _fragment_merges(tmp_path, "l0", 0, 0) >= 5, 60, "the restarted l0 to merge", (second,))


def test_with_curve_a_stopped_learners_id_cannot_be_taken() -> None:
    """The same attack with Curve keys bound to ids: the stranger's key may speak as
    itself only, so however long l0 is silent, its id stays l0's. (The keys are given
    as the ZeroMQ loop hands them over after the handshake; ``test_with_curve_a_key_
    speaks_only_as_its_learner_ids`` runs the handshake end to end.)"""
    rig = Rig(takeover_after=1.5, key_ids={"KEY-L0": frozenset({"l0"}), "KEY-M": frozenset({"mallory"})})
    real = rig.learner("l0", key="KEY-L0")
    real.join()
    real.contribute(0)
    mallory = rig.learner("l0", key="KEY-M")
    replies = []
    for _ in range(16):  # 4 s of hellos: well past --takeover-after
        replies += mallory.hello()
        rig.advance(0.25)
    assert replies and all(isinstance(m, wire.ErrorIn) and m.code == "fatal" for m in replies), replies
    assert all("may speak as ['mallory'] only" in m.reason for m in errors_in(replies)), replies
    back = len(rig.of(Merged))
    real.contribute(0)
    assert _merges(rig, "l0", 0, back) == 1, "l0 did not go on merging"
    assert not rig.of(TakenOver)
    assert [e.learner for e in rig.of(Joined)] == ["l0"]


def test_a_join_refused_as_busy_says_so_and_why() -> None:
    """A learner whose id is held live by another connection fails its join naming 'busy'
    and what it means (before: 'no answer from the syncer ... check that it is running')."""
    svc, _, thread = serving(CONFIG, takeover_after=30.0, heartbeat_timeout=60.0)
    holder = Raw(svc.endpoint, "l0")
    link = ZmqLink(svc.endpoint, heartbeat_s=0.2, leave_timeout_s=0.5)
    try:
        holder.hello()
        frags = holder.frags
        initial = [[torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors] for spec in frags]
        try:
            link.join("l0", frags, initial, 3.0, settings=RunRules.from_config(CONFIG))
        except TransportError as exc:
            text = str(exc)
        else:
            raise AssertionError("the join of a held id succeeded")
        assert "'busy'" in text and "live on another connection" in text and "first-come" in text, text
    finally:
        link.leave()
        holder.close()
        svc.stop()
        thread.join(20)


def _curve_run(procs: Procs, tmp_path: Path, learner: str, allowed_ids: tuple[str, ...],
               *syncer_flags: str) -> tuple[Path, str, subprocess.Popen]:
    """A syncer with Curve keys allowing ``allowed_ids`` (each its own key) and a learner
    process ``learner`` with its key: (the keys' directory, the endpoint, the learner)."""
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("syncer", *allowed_ids):
        keygen(keys, name)
    allowed.mkdir()
    for name in allowed_ids:
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    _, endpoint = procs.syncer(*SYNCER_FLAGS, *syncer_flags, "--secret-key", str(keys / "syncer.key_secret"),
                               "--allowed-keys", str(allowed))
    real = procs.learner(endpoint, learner, *LEARNER_FLAGS, "--keys", str(keys / f"{learner}.key"),
                         str(keys / f"{learner}.key_secret"), str(keys / "syncer.key"))
    return keys, endpoint, real


def _curve_raw(endpoint: str, lid: str, keys: Path, name: str) -> Raw:
    raw = Raw(endpoint, lid)
    raw.sock.close()
    pub, sec = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
    server, _ = zmq.auth.load_certificate(str(keys / "syncer.key"))
    raw.sock = zmq.Context.instance().socket(zmq.DEALER)
    raw.sock.setsockopt(zmq.LINGER, 0)
    raw.sock.curve_publickey, raw.sock.curve_secretkey, raw.sock.curve_serverkey = pub, sec, server
    raw.sock.connect(endpoint)
    return raw


def test_with_curve_a_key_speaks_only_as_its_learner_ids(procs: Procs, tmp_path: Path) -> None:
    keys, endpoint, real = _curve_run(procs, tmp_path, "l1", ("l0", "l1"))
    wait_for(lambda: merges_of(tmp_path, "l1") >= 3, 60, "l1 to merge", (real,))
    l0 = _curve_raw(endpoint, "l0", keys, "l0")
    try:
        l0.hello()  # its own id: fine
        # l0's key sending as l1, while the real l1 runs: a contribution, then a hello.
        l0.learner = "l1"
        l0.send(l0.contribution(base=0))
        err = raw_error(l0, 10.0)
        assert err is not None and err["code"] == "denied" and "may speak as ['l0'] only" in err["reason"], err
        l0.send(wire.hello_frames("l1", 0, 1, l0.frags, RunRules.from_config(CONFIG)))
        err = raw_error(l0, 10.0)
        assert err is not None and err["code"] == "fatal" and "not as 'l1'" in err["reason"], err
    finally:
        l0.close()
    ev = events(tmp_path)
    denied = [e for e in of(ev, AuthDenied) if e.learner is not None]
    assert [(e.learner, e.type) for e in denied] == [("l1", "contrib"), ("l1", "hello")]
    assert sorted(e.learner for e in of(ev, Joined)) == ["l0", "l1"]
    assert real.poll() is None and merges_of(tmp_path, "l1") >= 3


def test_refused_curve_handshakes_are_logged_rate_limited_with_a_count(procs: Procs, tmp_path: Path) -> None:
    # Anyone who can reach the port can open connections with keys of their own making:
    # the log must not grow with them.
    import signal

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("syncer", "l0", "eve"):
        keygen(keys, name)
    allowed.mkdir()
    (allowed / "l0.key").write_bytes((keys / "l0.key").read_bytes())
    syncer, endpoint = procs.syncer(*SYNCER_FLAGS, "--secret-key", str(keys / "syncer.key_secret"),
                                    "--allowed-keys", str(allowed), "--log-burst", "2")
    strangers = [_curve_raw(endpoint, "eve", keys, "eve") for _ in range(12)]  # one refusal each
    try:
        for raw in strangers:
            # The handshake starts at connect; a message is only a nudge. Never block on it:
            # a DEALER whose handshake was refused already has no peer to queue for.
            try:
                raw.sock.send(b"x", zmq.NOBLOCK)
            except zmq.Again:
                pass
        wait_for(lambda: len(events(tmp_path, AuthDenied)) >= 2, 30,
                 "the first refusals", (syncer,))
        time.sleep(2.0)
    finally:
        for raw in strangers:
            raw.close()
    syncer.send_signal(signal.SIGINT)
    finish(syncer, procs, "syncer")
    ev = events(tmp_path)
    denied = of(ev, AuthDenied)
    summaries = [e for e in of(ev, Suppressed) if e.of == AuthDenied.event]
    assert len(denied) <= 2 * len(summaries) + 2, (len(denied), summaries)
    assert len(denied) + sum(e.count for e in summaries) == 12, (len(denied), summaries)
    assert all("eve" not in (e.learner or "") for e in denied)


def test_keygen_learners_names_the_ids_a_key_may_use(tmp_path: Path) -> None:
    from rackmend.service.identity import load_key_ids

    keygen(tmp_path, "l0")
    keygen(tmp_path, "ops", "--learners", "l2,l3")  # one key for two learners, named in its metadata
    keygen(tmp_path, "any", "--learners", "*")
    ids = {next(k for k in load_key_ids(tmp_path) if k == zmq.auth.load_certificate(str(tmp_path / f"{n}.key"))[
        0].decode()): n for n in ("l0", "ops", "any")}
    got = {ids[k]: v for k, v in load_key_ids(tmp_path).items()}
    assert got == {"l0": frozenset({"l0"}), "ops": frozenset({"l2", "l3"}), "any": None}
    bad = subprocess.run([sys.executable, "-m", "rackmend.cli", "keygen", str(tmp_path), "x", "--learners", "l0\n"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--learners" in bad.stderr


# ------------------------------------------------------------------ the link's side
class FakeSyncer:
    """A ROUTER answering a link's hello by hand: the link's side of the protocol alone."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frags = pack_fragments(make_model(), 2, 4)

    def recv(self, timeout: float) -> tuple[bytes, dict] | None:
        if not self.sock.poll(max(1, int(timeout * 1000))):
            return None
        ident, head, *_ = self.sock.recv_multipart()
        return ident, msgpack.unpackb(head)

    def expect(self, kind: str, timeout: float) -> tuple[bytes, dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.recv(end - time.monotonic())
            if got is not None and got[1]["type"] == kind:
                return got
        raise AssertionError(f"no {kind} within {timeout}s")

    def count(self, kind: str, seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            got = self.recv(end - time.monotonic())
            n += got is not None and got[1]["type"] == kind
        return n

    def send(self, ident: bytes, frames: list) -> None:
        self.sock.send_multipart([ident, *frames], copy=False)

    def welcome(self, ident: bytes) -> None:
        for spec in self.frags:
            values = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors)
            self.send(ident, wire.update_frames(Update(spec.index, 0, values, epoch=1), reset=True))

    def close(self) -> None:
        self.sock.close()


def _link(endpoint: str) -> ZmqLink:
    return ZmqLink(endpoint, rank=0, world_size=1, heartbeat_s=0.2, leave_timeout_s=0.5)


def _join_in_thread(link: ZmqLink, frags: list) -> threading.Thread:
    """The link's join, on a thread (it returns once the fake syncer has welcomed it)."""
    initial = [[torch.zeros(t.shape, dtype=t.dtype) for t in spec.tensors] for spec in frags]
    th = threading.Thread(target=lambda: link.join("l0", frags, initial, 30.0,
                                                   settings=RunRules.from_config(CONFIG)), daemon=True)
    th.start()
    return th


def test_a_rejoin_during_the_hello_back_off_is_answered_when_it_ends() -> None:
    fake = FakeSyncer()
    link = _link(fake.endpoint)
    try:
        joining = _join_in_thread(link, fake.frags)
        ident, _ = fake.expect("hello", 10.0)
        # At once, so within the link's back-off: a syncer that lost the hello asks again.
        fake.send(ident, wire.encode({"type": "error", "code": "rejoin", "reason": "send hello first"}))
        ident, _ = fake.expect("hello", 10.0)  # the old link ignored it and never said hello again
        fake.welcome(ident)
        joining.join(10.0)
        assert not joining.is_alive()
    finally:
        link.leave()
        fake.close()


def test_heartbeats_go_on_while_a_contribution_waits_for_its_receipt() -> None:
    fake = FakeSyncer()
    link = _link(fake.endpoint)
    try:
        joining = _join_in_thread(link, fake.frags)
        ident, _ = fake.expect("hello", 10.0)
        fake.welcome(ident)
        joining.join(10.0)
        tensors = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in fake.frags[0].tensors)
        for step in (4, 8):  # the first goes out and is never acknowledged; the second waits behind it
            link.send(Contribution("l0", 0, 0, step, 4, 16.0, 0.01, tensors))
        fake.expect("contrib", 10.0)
        assert fake.count("heartbeat", 2.0) >= 4, "the link went silent while a contribution waited"
    finally:
        link.leave()
        fake.close()


def test_a_token_file_is_used_only_once_its_writer_is_gone(tmp_path: Path, caplog) -> None:
    """Two live processes with one id on one host must not take the id from each other
    through the file: a token whose writer still runs is not used; one whose writer
    exited (a zombie not yet reaped counts as gone) or whose pid now names another
    process is; a damaged file is ignored with a warning; a clean leave removes it."""
    from rackmend.transport.tokens import TokenFile, _start_time

    token = "ab" * wire.TOKEN_BYTES
    tf = TokenFile(tmp_path, "tcp://127.0.0.1:1", "l0", 0)
    assert tf.load() is None, "no file yet"
    tf.save(token)
    assert tf.path is not None and tf.path.stat().st_mode & 0o777 == 0o600
    assert tf.load() == token, "written by this process: an earlier link of ours"

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def written_by(pid: int, started: str | None) -> None:
            tf.path.write_text(json.dumps({"token": token, "pid": pid, "started": started}))

        written_by(child.pid, _start_time(child.pid))
        assert tf.load() is None, "its writer still runs"
        written_by(child.pid, "1")
        assert tf.load() == token, "the pid names another process now"
        written_by(child.pid, _start_time(child.pid))
        child.kill()
        wait_for(lambda: _start_time(child.pid) == "", 10, "the child to become a zombie")
        assert tf.load() == token, "a zombie is gone"
    finally:
        child.kill()
        child.wait(10)
    assert tf.load() == token, "reaped"
    other = TokenFile(tmp_path, "tcp://127.0.0.1:2", "l0", 0)
    assert other.load() is None, "another syncer's endpoint: another file"

    tf.path.write_text("{not json")
    with caplog.at_level("WARNING", logger="rackmend.link"):
        assert tf.load() is None
    assert "ignoring the resume token file" in caplog.text
    caplog.clear()
    tf.path.write_text(json.dumps({"token": "ab", "pid": 1}))
    with caplog.at_level("WARNING", logger="rackmend.link"):
        assert tf.load() is None
    assert "is not 32 characters" in caplog.text
    tf.forget()
    assert not tf.path.exists()
