"""Learner -> syncer -> learner round trip over ZeroMQ on loopback, against a plain send.

Runbook: ``python benchmarks/transport.py --quick``. Two processes: this one plays a
learner (DEALER), a child plays the syncer (ROUTER). Per fragment size, interleaved
repeat by repeat:

- ``plain``: the fragment's tensors go up as raw ZeroMQ frames (the same frames a
  contribution carries, without header) and come straight back;
- ``rackmend``: a full contribution goes up (msgpack header + tensor frames), the
  child validates it exactly as the syncer does (header schema, layout, sizes,
  finiteness) and answers with an update message, which this side validates too.

Throughput counts fragment bytes per round trip (up + down = 2x fragment bytes).
Target: rackmend / plain >= 0.8 for 16 and 128 MB. For 4 KB fragments the report is
the added per-message cost in microseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch
import zmq

from _common import finish, parser, summary
from rackmend.core.fragments import FragmentSpec, TensorSpec
from rackmend.core.messages import Contribution, Update
from rackmend.core.syncer import _finite
from rackmend.transport import wire


def _layout(nbytes: int) -> list[FragmentSpec]:
    n_tensors = 4 if nbytes >= 1 << 20 else 1
    numel = nbytes // 4 // n_tensors
    return [FragmentSpec(0, 0, tuple(TensorSpec(f"t{i}", (numel,), torch.float32) for i in range(n_tensors)))]


def _server(endpoint: str, sizes: list[int]) -> None:
    torch.set_num_threads(1)
    layouts = {n: _layout(n) for n in sizes}
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, body = frames[0], frames[1:]
        if body[0].bytes == b"STOP":
            return
        if body[0].bytes.startswith(b"PLAIN"):
            sock.send_multipart([ident, *body], copy=False)
            continue
        msg = wire.decode_header(body, wire.LEARNER_TYPES, 1 << 31)
        size = sum(f.nbytes for f in msg.frames)
        c = wire.parse_contribution(msg, layouts[size])
        assert all(_finite(t) for t in c.tensors)
        sock.send_multipart([ident, *wire.update_frames(Update(0, 1, c.tensors))], copy=False)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    repeats = 5 if args.quick else 15
    sizes = [16 << 20, 128 << 20]
    small = 4 << 10
    ctx = mp.get_context("spawn")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close()
    endpoint = f"tcp://127.0.0.1:{port}"
    child = ctx.Process(target=_server, args=(endpoint, [*sizes, small]), daemon=True)
    child.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    g = torch.Generator().manual_seed(0)

    def plain(tensors: tuple[torch.Tensor, ...]) -> float:
        # Same bytes in the same frames as the contribution, minus header and checks.
        t0 = time.perf_counter()
        sock.send_multipart([b"PLAIN", *(memoryview(t.numpy()).cast("B") for t in tensors)], copy=False)
        sock.recv_multipart(copy=False)
        return time.perf_counter() - t0

    def rackmend(spec: FragmentSpec, tensors: tuple[torch.Tensor, ...]) -> float:
        t0 = time.perf_counter()
        c = Contribution("bench", 0, 0, 1, 1, 1.0, 0.0, tensors, session=1, seq=1)
        sock.send_multipart(wire.contribution_frames(c, 0), copy=False)
        reply = sock.recv_multipart(copy=False)
        msg = wire.decode_header(reply, wire.SYNCER_TYPES, 1 << 31)
        wire.parse_tensors(msg, spec)
        return time.perf_counter() - t0

    rows: dict[str, dict] = {}
    seconds: dict[str, dict[str, list[float]]] = {}
    end = time.monotonic() + 600  # bounded whatever the machine does
    for nbytes in [*sizes, small]:
        spec = _layout(nbytes)[0]
        tensors = tuple(torch.randn(s.shape, generator=g) for s in spec.tensors)
        reps = repeats if nbytes >= 1 << 20 else 2000 if not args.quick else 500
        pl, rm = [], []
        for r in range(reps + 1):
            if r % 2:  # alternate the order so neither path always runs on a warmer cache
                a, b = plain(tensors), rackmend(spec, tensors)
            else:
                b, a = rackmend(spec, tensors), plain(tensors)
            if r:  # the first pair warms up the connection and the allocator
                pl.append(a)
                rm.append(b)
            if time.monotonic() > end:
                break
        key = f"{nbytes >> 20}MB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KB"
        seconds[key] = {"plain": pl, "rackmend": rm}
        gb = 2 * nbytes / 1e9
        rows[key] = {
            "plain_gbps": summary([gb / s for s in pl]),
            "rackmend_gbps": summary([gb / s for s in rm]),
            "ratio": summary([a / b for a, b in zip(pl, rm)]),
            "overhead_us": summary([(b - a) * 1e6 for a, b in zip(pl, rm)]),
        }
    sock.send_multipart([b"STOP"])
    child.join(10)
    print(f"round trip learner -> syncer -> learner on loopback, {repeats} repeats (4 KB: many more)")
    print(f"{'fragment':<9} {'plain GB/s':>11} {'rackmend GB/s':>14} {'ratio':>6} {'[min, max]':>14} {'overhead us':>12}")
    for key, row in rows.items():
        print(f"{key:<9} {row['plain_gbps']['median']:>11.2f} {row['rackmend_gbps']['median']:>14.2f} "
              f"{row['ratio']['median']:>6.2f} [{row['ratio']['min']:.2f}, {row['ratio']['max']:.2f}]".ljust(62)
              + f"{row['overhead_us']['median']:>12.1f}")
    finish("transport", args.out, {"inputs": {"quick": args.quick, "repeats": repeats}, "seconds": seconds,
                                   "rows": rows},
           {"ratio_16mb": rows["16MB"]["ratio"]["median"], "ratio_128mb": rows["128MB"]["ratio"]["median"],
            "gbps_128mb": rows["128MB"]["rackmend_gbps"]["median"],
            "overhead_4kb_us": rows["4KB"]["overhead_us"]["median"]})


if __name__ == "__main__":
    main()
