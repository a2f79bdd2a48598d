"""Compressed updates through a real SyncerService (int8 downlink).

A lost delta: the service's send of one delta update to learner l0 is dropped; l0's
ZmqLink sees the next delta's base version ahead of what it holds, fetches the full
value and ends holding exactly the syncer's value, while l1 (nothing dropped) never
fetches. And a lossy downlink refuses a bfloat16 model with a clear reason at the
first join."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch

from rackmend import CompressionConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig
from rackmend.service import ServiceConfig, SyncerService
from rackmend.service.events import Fetched
from rackmend.transport.zmq_link import ZmqLink

from helpers import make_inner, make_model, train, watch_log
from procs import of

CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1),
                        syncer=SyncerConfig(min_quorum=1, grace_max=0.05, learners=("l0", "l1")),
                        compression=CompressionConfig(uplink="int4", downlink="int8"))
STEPS = 48


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.usefixtures("one_thread")
def test_lost_delta_is_fetched_and_the_learner_ends_equal_to_the_syncer() -> None:
    svc = SyncerService(CONFIG, ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_timeout=30))
    records, send = watch_log(svc), svc.node._send_update
    dropped: list[dict] = []

    def lossy_send(ident: bytes, upd, frames: list, reset: bool = False) -> None:
        """Drop the first delta update of fragment 0 (version >= 2) meant for l0."""
        peer = svc.peers.get(ident)
        header = msgpack.unpackb(bytes(frames[0]))
        if (not dropped and peer is not None and peer.learner_id == "l0" and header.get("type") == "update"
                and header.get("delta") and header["fragment"] == 0 and header["version"] >= 2):
            dropped.append(header)
            return
        send(ident, upd, frames, reset)

    svc.node._send_update = lossy_send  # type: ignore[method-assign]
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    opts: dict[str, RackmendOptimizer] = {}
    errors: list[BaseException] = []
    joined = threading.Barrier(2, timeout=30)

    def learner(lid: str) -> None:
        try:
            model = make_model()
            opts[lid] = opt = RackmendOptimizer(model, make_inner(model), CONFIG, ZmqLink(svc.endpoint),
                                                learner_id=lid)
            joined.wait()
            train(opt, model, lid, range(1, STEPS + 1), sleep=0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(lid,)) for lid in ("l0", "l1")]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        core = svc.core
        assert core is not None and dropped, "no delta update was dropped: the test exercised nothing"
        links = {lid: opt.link for lid, opt in opts.items()}
        # Training stopped; the last contributions merge within the grace window. Then every
        # link must hold the syncer's current version of every fragment, bit for bit.
        _wait(lambda: all(links[lid]._global[p][1] == core.versions[p] for lid in links for p in range(2)),
              15, "both links to catch up with the syncer")
        time.sleep(0.3)
        for lid, link in links.items():
            for p in range(2):
                _, version, held = link._global[p]
                assert version == core.versions[p]
                for a, b in zip(held, core.frags[p].theta):
                    assert torch.equal(a, b), f"{lid}'s link holds fragment {p} unlike the syncer"
        assert links["l0"].fetches_sent >= 1 and links["l1"].fetches_sent == 0
        fetches = of(records, Fetched)
        assert fetches and all(r.learner == "l0" and r.fragment == 0 for r in fetches)
        assert core.versions[0] > dropped[0]["version"], "no merge came after the dropped one"
        # l0 applied merged values after the fetch: the training thread saw full values again.
        assert opts["l0"].versions[0] > dropped[0]["version"]
    finally:
        for opt in opts.values():
            opt.close()
        svc.stop()
        thread.join(20)


def test_lossy_downlink_refuses_a_bfloat16_model_at_init() -> None:
    """The syncer cannot compress a bf16 model's updates: the first learner's join fails
    with the reason (a fatal error naming the tensor), and the syncer keeps serving."""
    from rackmend.transport.base import TransportError

    svc = SyncerService(CONFIG, ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_timeout=30))
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    try:
        model = make_model().to(torch.bfloat16)
        plain = CONFIG.replace(compression=CompressionConfig(downlink="int8"))  # the learner encodes nothing
        with pytest.raises(TransportError, match=r"compression\.downlink='int8' is lossy.*emb\.weight is torch\.bfloat16"):
            RackmendOptimizer(model, make_inner(model), plain, ZmqLink(svc.endpoint), learner_id="l0")
        assert thread.is_alive() and svc.core is None
    finally:
        svc.stop()
        thread.join(20)
