"""Train rackmend's small byte-level GPT as one learner of a ``rackmend syncer``.

Runbook (one syncer and two learners; see docs/multinode.md for real machines):

    rackmend syncer --bind tcp://127.0.0.1:5555 --learners rack0,rack1 &
    RACKMEND_LEARNER_ID=rack0 python examples/train_gpt.py --connect tcp://127.0.0.1:5555 &
    RACKMEND_LEARNER_ID=rack1 python examples/train_gpt.py --connect tcp://127.0.0.1:5555

Compression: start the syncer with ``--uplink-codec int4 --downlink-codec int8`` and
pass the same two flags here (the learner encodes with the uplink codec; the downlink
one is the syncer's, kept here so both configs are equal).

Your own training script changes in the same three places: build a link
(``rackmend.transport.connect(endpoints)``: a ZmqLink, or a ShardedLink), wrap the
inner optimizer in RackmendOptimizer, pass tokens to step().
"""

from __future__ import annotations

import argparse
import os
import time
import zlib

import torch

from rackmend import CompressionConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig
from rackmend.transport import CurveClientKeys, connect
from rackmend.workloads import GPT, ByteCorpus, GPTConfig, evaluate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=os.environ.get("RACKMEND_CONNECT", "tcp://127.0.0.1:5555"),
                   help="syncer endpoint (env RACKMEND_CONNECT); a sharded syncer: every shard's endpoint, "
                        "comma-separated, shard 0 first")
    p.add_argument("--id", default=os.environ.get("RACKMEND_LEARNER_ID"),
                   help="learner id, stable across restarts (env RACKMEND_LEARNER_ID)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap", type=int, default=2)
    p.add_argument("--key", help="this learner's .key_secret file (CurveZMQ)")
    p.add_argument("--server-key", help="the syncer's public .key file (CurveZMQ)")
    p.add_argument("--uplink-codec", default=os.environ.get("RACKMEND_UPLINK_CODEC", "none"),
                   help="codec of outer gradients, e.g. int4 or powersgd:rank=4 (env RACKMEND_UPLINK_CODEC)")
    p.add_argument("--downlink-codec", default=os.environ.get("RACKMEND_DOWNLINK_CODEC", "none"),
                   help="the syncer's update codec, e.g. int8 (env RACKMEND_DOWNLINK_CODEC)")
    a = p.parse_args()
    if not a.id:
        p.error("give a learner id with --id or RACKMEND_LEARNER_ID")
    curve = None
    if a.key:
        import zmq.auth

        pub, sec = zmq.auth.load_certificate(a.key)
        server, _ = zmq.auth.load_certificate(a.server_key)
        curve = CurveClientKeys(public=pub, secret=sec, server_public=server)
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=a.sync_every, num_fragments=a.fragments,
                                                    overlap=a.overlap),
                            compression=CompressionConfig(uplink=a.uplink_codec, downlink=a.downlink_codec))
    torch.manual_seed(0)  # the first learner to join seeds the syncer with this initialisation
    model = GPT(GPTConfig())
    corpus = ByteCorpus()
    opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config,
                            connect(a.connect, curve=curve), learner_id=a.id)
    g = torch.Generator().manual_seed(zlib.crc32(a.id.encode()))
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        x, y = corpus.batch(g, 8, model.cfg.block_size)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step(tokens=x.numel())
        if step % 50 == 0:
            print(f"{a.id} step {step} loss {loss.item():.3f} versions {opt.versions} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    print(f"{a.id} held-out loss {evaluate(model, corpus.eval_batches(8, 16, model.cfg.block_size)):.3f}")
    opt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
