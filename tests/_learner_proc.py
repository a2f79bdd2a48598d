"""A learner process for the service tests: TinyLM through a ZmqLink to a syncer.

python tests/_learner_proc.py --endpoint tcp://127.0.0.1:PORT --id l0 --steps 12 ...
Writes the final parameters (safetensors) to --out and its step count to --progress
after every step, so tests can watch it without sharing memory; --held-out saves the
global values it holds (``held/<p>/<i>``) and their versions (``versions``).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import batch, make_inner, make_model  # noqa: E402

from rackmend import (  # noqa: E402
    CompressionConfig,
    LearnerConfig,
    RackmendConfig,
    RackmendOptimizer,
    ScheduleConfig,
    SyncerConfig,
)
from rackmend.transport.sharded import connect  # noqa: E402
from rackmend.transport.zmq_link import CurveClientKeys, ZmqLink  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--H", type=int, default=3)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--tau", type=int, default=2, help="default: the syncer's default --overlap")
    p.add_argument("--learners", default="")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-from", type=int, default=0, help="from this step on, sleep --slow-factor x as long")
    p.add_argument("--slow-until", type=int, default=0, help="... until this step (0: to the end)")
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--progress", type=Path)
    p.add_argument("--keys", nargs=3, metavar=("PUBLIC_FILE", "SECRET_FILE", "SERVER_PUBLIC_FILE"))
    p.add_argument("--join-timeout", type=float, default=30.0)
    p.add_argument("--uplink-codec", default="none")
    p.add_argument("--downlink-codec", default="none", help="only the syncer uses it; kept so configs are equal")
    p.add_argument("--held-out", type=Path)
    p.add_argument("--desloc", action="store_true", help="DES-LOC: average Adam's moments too")
    p.add_argument("--desloc-ku", type=int, default=None)
    p.add_argument("--desloc-kv", type=int, default=None)
    p.add_argument("--moments-codec", default="none")
    p.add_argument("--wrap", choices=("none", "ddp"), default="none", help="ddp: wrap the model in DDP (torchrun)")
    p.add_argument("--link", choices=("env", "plain"), default="env",
                   help="plain: ZmqLink(endpoint) as docs/multinode.md shows; env: ZmqLink.from_env")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1)  # tests dump a stuck learner's stacks with SIGUSR1
    # Tests stop a learner with SIGINT, as Ctrl-C would. A process started from a shell's
    # background job inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the learner would train on through the signal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # launched by torchrun: one learner, several ranks
        torch.distributed.init_process_group("gloo")
    ids = tuple(x for x in a.learners.split(",") if x)
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=a.H, num_fragments=a.P, overlap=a.tau, desloc=a.desloc,
                                desloc_ku=a.desloc_ku, desloc_kv=a.desloc_kv),
        syncer=SyncerConfig(min_quorum=max(1, len(ids)) if a.deterministic else 1, learners=ids),
        learner=LearnerConfig(wait_timeout=a.join_timeout, join_timeout=a.join_timeout),
        compression=CompressionConfig(uplink=a.uplink_codec, downlink=a.downlink_codec, moments=a.moments_codec),
        deterministic=a.deterministic,
    )
    curve = None
    if a.keys:
        import zmq.auth

        pub, sec = zmq.auth.load_certificate(a.keys[1])
        server_pub, _ = zmq.auth.load_certificate(a.keys[2])
        curve = CurveClientKeys(public=pub, secret=sec, server_public=server_pub)
    raw = make_model()
    model = torch.nn.parallel.DistributedDataParallel(raw) if a.wrap == "ddp" else raw
    link = (ZmqLink(a.endpoint, curve=curve, heartbeat_s=0.2) if a.link == "plain"
            else connect(a.endpoint, curve=curve, heartbeat_s=0.2))  # comma-separated: a sharded syncer
    opt = RackmendOptimizer(model, make_inner(model), config, link, learner_id=a.id)
    try:
        for t in range(1, a.steps + 1):
            x, y, tokens = batch(a.id, t)  # every rank the same batch: stays equal to a 1-rank learner
            tokens //= world  # tokens of this rank; the wrapper counts the learner's total
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step(tokens=tokens)
            if a.progress and rank == 0:
                a.progress.write_text(f"{t} {' '.join(map(str, opt.versions))}")
            if a.step_sleep:
                slow = a.slow_from and t >= a.slow_from and (not a.slow_until or t < a.slow_until)
                time.sleep(a.step_sleep * (a.slow_factor if slow else 1.0))
    except KeyboardInterrupt:
        print("interrupted: leaving", flush=True)
        return 130
    finally:
        opt.close()  # a graceful leave: rounds stop expecting this learner at once
    if world > 1:
        torch.distributed.destroy_process_group()
    if a.out and rank == 0:
        save_file({k: v.detach().contiguous() for k, v in raw.state_dict().items()}, str(a.out))
    if a.held_out and world == 1:
        held = {f"held/{p}/{i}": t.contiguous().clone() for p, ts in enumerate(opt.held) for i, t in enumerate(ts)}
        save_file({**held, "versions": torch.tensor(opt.versions)}, str(a.held_out))
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        # Not SystemExit: with torch 2.13 (CPU) a gloo job sometimes aborts in the
        # interpreter's teardown after destroy_process_group ("terminate called without an
        # active exception"; seen once in a CI run of the DDP test); everything this process
        # had to do is done and written by now.
        os._exit(code)
    sys.exit(code)
