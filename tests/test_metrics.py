"""Metrics of a live run: the syncer's Prometheus endpoint (``--metrics-port``) scraped
while two learner processes train, counters moving and agreeing with the JSONL log, a
contribution refused by the core counted under its reason, a malformed message under
its own; the port's errors; the learner's TensorBoard scalars read back from the event
file (skipped without the ``tensorboard`` package)."""

from __future__ import annotations

import argparse
import math
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.config import ConfigError
from rackmend.core.fragments import pack_fragments
from rackmend.core.messages import Contribution
from rackmend.core.records import Merged, Rejected
from rackmend.core.settings import RunRules
from rackmend.service.cli import add_syncer_arguments, build, resolve
from rackmend.service.metrics import SyncerMetrics, is_loopback_host
from rackmend.service.config import ServiceConfig
from rackmend.service.syncer import SyncerService
from rackmend.transport import wire
from rackmend.transport.zmq_link import ZmqLink

from helpers import Dealer, free_port, make_inner, make_model, metric, scrape, serving, train
from procs import Procs, events, progress, wait_for

def merges_logged(tmp: Path) -> int:
    return len(events(tmp, Merged))


def join_raw(endpoint: str, lid: str, H: int, P: int, tau: int) -> tuple[Dealer, list, int]:
    """A learner speaking the protocol by hand: hello with the run's settings and layout,
    every fragment's value received (and acknowledged). Returns (socket, layout, epoch)."""
    sch = ScheduleConfig(sync_every=H, num_fragments=P, overlap=tau)
    layout = pack_fragments(make_model(), P, H, sch.packing, buffers=sch.sync_buffers)
    raw = Dealer(endpoint)
    raw.send(wire.hello_frames(lid, 0, 1, layout, RunRules.from_config(RackmendConfig(schedule=sch))))
    got: dict[int, int] = {}
    while len(got) < P:
        header = raw.recv(20)
        assert header is not None, f"{lid} was not sent every fragment after its hello (got {sorted(got)})"
        assert header["type"] != "error", header
        if header["type"] == "update":
            got[header["fragment"]] = header["epoch"]
            raw.send(wire.ack_frames(header["fragment"], lid, 0))
    return raw, layout, got[0]


def test_metrics_move_during_a_live_run_and_count_refusals_by_reason(procs: Procs, tmp_path: Path) -> None:
    H, P, tau = 3, 2, 2  # the learner process's defaults
    port = free_port()
    proc, endpoint = procs.syncer("--metrics-port", str(port), "--grace-max", "0.3", "--heartbeat-timeout", "30",
                                  "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4")
    url = f"http://127.0.0.1:{port}/metrics"
    assert url in procs.output("syncer"), procs.output("syncer")
    learners = {lid: procs.learner(endpoint, lid, "--steps", "100000", "--step-sleep", "0.03", "--H", str(H),
                                   "--P", str(P), "--tau", str(tau), "--progress", str(tmp_path / f"{lid}.progress"))
                for lid in ("l0", "l1")}
    for lid in learners:
        wait_for(lambda: progress(tmp_path / f"{lid}.progress")[0] >= 2 * H, 90, f"{lid} to train",
                 (proc, *learners.values()))

    logged_before = merges_logged(tmp_path)
    first = scrape(url)
    logged_after = merges_logged(tmp_path)
    # Merges go on while the scrape crosses: the counter lies between the log before and after.
    assert logged_before <= metric(first, "rackmend_merges_total") <= logged_after
    assert logged_after > 0
    for lid in learners:
        assert metric(first, "rackmend_learner_connected", learner=lid) == 1
        assert metric(first, "rackmend_contributions_total", learner=lid) > 0
        assert 0 < metric(first, "rackmend_learner_step_seconds", learner=lid) < 5
        assert metric(first, "rackmend_learner_version_lag", learner=lid) >= 0
        assert metric(first, "rackmend_learner_failslow_state", learner=lid) == 0
        assert metric(first, "rackmend_received_bytes_total", learner=lid) > 0
        assert metric(first, "rackmend_sent_bytes_total", learner=lid) > 0
    # Each merge observes these once (read apart from the counter: merges go on in between).
    for name in ("rackmend_round_duration_seconds_count", "rackmend_merge_participants_count",
                 "rackmend_merge_compute_seconds_count"):
        assert metric(first, name) > 0, name

    wait_for(lambda: metric(scrape(url), "rackmend_merges_total") > metric(first, "rackmend_merges_total") + 4, 60,
             "more merges in the metrics", (proc, *learners.values()))
    second = scrape(url)
    for name in ("rackmend_received_bytes_total", "rackmend_sent_bytes_total"):
        for lid in learners:
            assert metric(second, name, learner=lid) > metric(first, name, learner=lid), (name, lid)
    for p in range(P):
        assert metric(second, "rackmend_fragment_version", fragment=str(p)) >= \
            metric(first, "rackmend_fragment_version", fragment=str(p)) > 0
    assert metric(second, "rackmend_checkpoints_total") >= 1
    assert 0 <= metric(second, "rackmend_checkpoint_age_seconds") < 60

    # A learner that joins properly, then claims 1e200 tokens for one contribution (under
    # tokens_sq_per_step it would take the whole merge weight): refused by the core's bounds.
    raw, layout, epoch = join_raw(endpoint, "mallory", H, P, tau)
    try:
        zeros = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in layout[0].tensors)
        # Its step time (123 s, within bounds) must not reach the learner's gauge: the
        # contribution is refused, so nothing it says describes the learner.
        raw.send(wire.contribution_frames(Contribution("mallory", 0, 0, H, H, 1e200, 123.0, zeros, session=1, seq=1,
                                                       base_epoch=epoch), 0))
        reply = raw.recv_type("error", 20)
        assert reply is not None and reply["code"] == "rejected" and "bound" in reply["reason"], reply
        raw.send([b"\xc1 not msgpack"])
        reply = raw.recv_type("error", 20)
        assert reply is not None and reply["code"] == "bad_message", reply
    finally:
        raw.close()
    rejects = [e for e in events(tmp_path, Rejected) if e.learner == "mallory"]
    assert [e.code for e in rejects] == ["bounds"], rejects
    third = scrape(url)
    assert metric(third, "rackmend_contributions_rejected_total", reason="bounds") == 1
    assert metric(third, "rackmend_messages_rejected_total", reason="bad_message") == 1
    assert metric(third, "rackmend_learner_connected", learner="mallory") == 1
    assert metric(third, "rackmend_learner_step_seconds", learner="mallory") != 123.0


def test_metrics_port_in_use_fails_at_start_and_two_syncers_keep_their_own_counts() -> None:
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=3, num_fragments=1, overlap=1))
    port = free_port()
    first, _, first_thread = serving(config, metrics_port=port)
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*--metrics-port"):
            SyncerService(config, ServiceConfig(bind="tcp://127.0.0.1:0", metrics_port=port))
        # One process, two syncers: each has a registry of its own (the default one would
        # refuse the second set of names) and counts only its own traffic.
        second, _, second_thread = serving(config, metrics_port=free_port())
        try:
            bad = Dealer(second.endpoint)
            bad.send([b"\xc1 not msgpack"])
            reply = bad.recv_type("error", 20)
            bad.close()
            assert reply is not None and reply["code"] == "bad_message", reply
            assert metric(scrape(str(second.metrics_url)), "rackmend_messages_rejected_total", reason="bad_message") == 1
            assert metric(scrape(str(first.metrics_url)), "rackmend_messages_rejected_total") == 0
        finally:
            second.stop()
            second_thread.join(20)
    finally:
        first.stop()
        first_thread.join(20)
    with pytest.raises(OSError):  # the shutdown released the port: nothing answers there now
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    for bad_port in (-1, 70000):
        with pytest.raises(ConfigError, match="metrics_port"):
            ServiceConfig(metrics_port=bad_port)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass  # an answer, then the close
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def test_the_metrics_port_caps_its_connections_and_cuts_off_slow_requests() -> None:
    """800 held half-sent requests once gave the syncer 800 threads and descriptors. Now
    connections past the cap are closed unread, a held request is cut off after the
    request timeout (even one sent a byte at a time), and scraping works again then."""
    metrics = SyncerMetrics(time.monotonic)
    cap, timeout = 4, 1.0
    url = metrics.serve("127.0.0.1", 0, max_connections=cap, request_timeout=timeout)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    threads_before = threading.active_count()
    held = []
    try:
        for _ in range(30):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metr")  # never finished
            held.append(sock)
        time.sleep(0.3)
        # Two threads per served connection at most: its handler and its cut-off timer.
        assert threading.active_count() - threads_before <= 2 * cap, threading.active_count() - threads_before
        refused = [s for s in held[cap:] if _closed_by_server(s, 0.5)]
        assert len(refused) >= len(held) - 2 * cap, f"only {len(refused)} of {len(held) - cap} past the cap closed"
        assert all(_closed_by_server(s, timeout + 2.0) for s in held[:cap]), "a held request was never cut off"
        # A request sent a byte at a time (each within the read timeout) is cut off too.
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(slow)
        start, cut = time.monotonic(), False
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            time.sleep(timeout / 4)
            if time.monotonic() - start > 3 * timeout:
                break
        assert cut or _closed_by_server(slow, 0.1), "a byte-at-a-time request held its connection"
        assert time.monotonic() - start < 3 * timeout
        assert metric(scrape(url), "rackmend_merges_total") == 0  # served again
    finally:
        for sock in held:
            sock.close()
        metrics.close()


def test_metrics_options_come_from_flags_environment_and_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_syncer_arguments(parser)
    toml = tmp_path / "syncer.toml"
    toml.write_text('metrics_port = 9100\nmetrics_host = "::1"\n')
    _, service = build(resolve(parser.parse_args(["--config", str(toml)]), {}))
    assert (service.metrics_port, service.metrics_host) == (9100, "::1")
    _, service = build(resolve(parser.parse_args(["--config", str(toml), "--metrics-port", "9200"]),
                               {"RACKMEND_METRICS_PORT": "9300", "RACKMEND_METRICS_HOST": "localhost"}))
    assert (service.metrics_port, service.metrics_host) == (9200, "localhost")
    _, service = build(resolve(parser.parse_args([]), {}))
    assert (service.metrics_port, service.metrics_host) == (0, "127.0.0.1")  # off by default
    with pytest.raises(ConfigError, match="RACKMEND_METRICS_PORT"):
        resolve(parser.parse_args([]), {"RACKMEND_METRICS_PORT": "ninety"})
    # Addresses warned about when metrics are served on them (served without authentication).
    assert [is_loopback_host(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", "", "host.example")] \
        == [True, True, True, True, False, False, False]


def test_learner_tensorboard_scalars_match_what_the_optimizer_did(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rackmend.learner.tensorboard import TAGS

    logdir = tmp_path / "tb"
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=3, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=1, grace_max=0.1),
                            learner=LearnerConfig(tensorboard_dir=str(logdir)))
    svc, _, server = serving(config)
    model = make_model()
    link = ZmqLink(svc.endpoint)
    opt = RackmendOptimizer(model, make_inner(model), config, link, learner_id="l0")
    seen: list[dict[str, float]] = []  # what the optimizer reported at each applied merge

    def on_apply(p: int, upd: object) -> None:
        seen.append({"step": opt.step_count, "merges_applied": len(seen) + 1,
                     "staleness": opt.version_lags[p], "blocked_s": opt.blocked_seconds,
                     "bytes_sent": opt.bytes_sent, "bytes_received": link.bytes_received})

    opt.on_apply = on_apply
    try:
        train(opt, model, "l0", range(1, 40), sleep=0.01)
    finally:
        opt.close()
        svc.stop()
        server.join(20)
    assert len(seen) >= 4, "too few merges applied to compare"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    for key in ("merges_applied", "staleness", "blocked_s", "bytes_sent", "bytes_received"):
        got = [(e.step, e.value) for e in acc.Scalars(TAGS[key])]
        want = [(int(s["step"]), float(torch.tensor(s[key], dtype=torch.float32))) for s in seen]
        assert got == want, key
    assert TAGS["merge_gain"] not in acc.Tags()["scalars"], "no probe_loss: no merge gain is measured"


def test_tensorboard_dir_without_the_package_says_what_to_install(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from rackmend.learner.tensorboard import LearnerScalars

    # As if it were not installed: a None entry makes Python's import fail.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        LearnerScalars(str(tmp_path))
    with pytest.raises(ConfigError, match="tensorboard_dir"):
        LearnerConfig(tensorboard_dir=" ")
    assert math.isfinite(LearnerConfig().wait_timeout) and LearnerConfig().tensorboard_dir is None


def test_every_reason_and_event_label_the_metrics_use_is_in_the_operations_guide() -> None:
    """The label values a live syncer's metrics start with (every one exists at 0 from the
    start) each have a line in docs/operations.md, so an operator seeing one can look it
    up; ``moments_off`` and ``negative`` were missing."""
    from rackmend.service.metrics import SyncerMetrics

    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text(encoding="utf-8")
    families = {"rackmend_contributions_rejected": "reason", "rackmend_messages_rejected": "reason",
                "rackmend_failslow_events": "event"}
    labels = {(fam.name, s.labels[families[fam.name]]) for fam in SyncerMetrics(lambda: 0.0).registry.collect()
              if fam.name in families for s in fam.samples if families[fam.name] in s.labels}
    assert {name for name, _ in labels} == set(families), "a metric family was renamed: update this test"
    missing = sorted(f"{name}{{{value}}}" for name, value in labels if f"`{value}`" not in doc)
    assert not missing, f"docs/operations.md does not explain {missing}"
