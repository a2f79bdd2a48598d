"""What one syncer shard takes in per second, with 1 and 2 threads, against memory copy.

Runbook: ``python benchmarks/syncer_capacity.py --quick`` (3 repeats; 9 without). One
round of M = 8 learners x a 64 MB fragment (4 float32 tensors), each path timed side by
side with a plain copy of the same bytes at the same thread count (the yardstick this
machine's memory gives), GB/s of fragment bytes coming in (M x the float32 size):

- ``copy``: the learners' fragments copied once (``torch._foreach_copy_``);
- ``fp32 merge+outer``: ``merge_deltas`` + the Nesterov outer step (what a round costs
  beyond receiving);
- ``fp32 round``: the whole round through ``SyncerCore`` as the service runs it (finiteness,
  the norm guard's norms, merge, step, the rollback copy, history, the snapshot sent);
- ``int8``/``int4 decode+merge``: the learners' encoded messages parsed and decoded as the
  service receives them (``wire.parse_contribution``), then merge + step;
- ``int8``/``int4 round``: decode, then the whole round through ``SyncerCore``;
- ``int4 dequantize in merge (not taken)``: the learners' messages checked on arrival
  (``wire.parse_encoded_frames``) but not decoded; the merge dequantizes each learner's values
  chunk by chunk into one reused buffer inside its sums (``dequantize_range``), then the
  step: the decoded values are never written whole. The same bits as decode + merge
  (checked before timing); the service does not do this (``docs/capacity.md``);
- ``int4 decode next || merge`` (2 threads): the next round's messages decoded on another
  thread while this thread merges and steps the round decoded before:
  whether receiving the next contributions can overlap merging; GB/s of one round over
  the wall time of both;
- ``2 shards``: two shard processes side by side (one thread each, half the bytes each),
  started together; GB/s over both, against the 2-thread copy.

Threads are what ``rackmend syncer --threads N`` sets: torch's intra-op threads, which
split every operation of the round (the service keeps no worker pool: ``docs/capacity.md``
says why). With 2 threads the table also has ``pool`` rows: the same fp32 and int4 paths
with the merge's sums and the decode's chunks spread over a pool of 2 worker threads of
one torch thread each (``pool=`` of ``merge_deltas`` and ``wire.parse_contribution``),
the alternative that was measured and not taken. Targets (issue 23): fp32
merge+outer >= 0.6x copy with 2 threads, int4 decode+merge >= 0.3x copy. The table and
``docs/capacity.md`` say what they came out as. Last, a sizing table (``plan``): the shards
and syncer memory 7B and 70B models need at M=8, H=100, from the whole-round rates
measured here with one thread.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from _common import finish, parser, summary
from rackmend import RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.codecs import Encoded, make_codec
from rackmend.core import Contribution, ContributionArrived, FragmentSpec, LearnerJoined, SyncerCore, TensorSpec
from rackmend.core.merge import _CHUNK as MERGE_CHUNK  # the merge's own chunk: the sums run as its do
from rackmend.core.merge import contribution_weight, merge_deltas
from rackmend.transport import wire

N_TENSORS = 4
STEPS = 24


class DequantizedInMerge:
    """An int8/int4 tensor that ``merge_deltas`` reads as if decoded: its sums slice each
    tensor one ``MERGE_CHUNK`` at a time and add the slice at once, so a slice can be
    dequantized (``dequantize_range``) into a buffer shared by all learners, and the
    decoded tensor is never written whole. Relies on that reading order; the benchmark
    checks the bits against decode + merge before it times this path."""

    dtype = torch.float32

    def __init__(self, codec: Any, encoded: Encoded, buf: torch.Tensor) -> None:
        self.codec, self.encoded, self.buf = codec, encoded, buf
        self.shape, self.device = encoded.shape, buf.device

    def numel(self) -> int:
        return math.prod(self.shape)

    def reshape(self, *_: int) -> DequantizedInMerge:
        return self

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.codec.dequantize_range(self.encoded, s.start, s.stop, self.buf)


class Round:
    """M learners' contributions to one fragment, and a core and outer optimizer to take them."""

    def __init__(self, learners: int, fragment_mb: float, seed: int = 0) -> None:
        numel = int(fragment_mb * 2**20 / 4 / N_TENSORS)
        self.ids = tuple(f"l{i}" for i in range(learners))
        self.spec = FragmentSpec(0, 0, tuple(TensorSpec(f"t{i}", (numel,), torch.float32) for i in range(N_TENSORS)))
        self.nbytes = self.spec.nbytes * learners
        g = torch.Generator().manual_seed(seed)
        self.deltas = [[torch.randn(numel, generator=g) * 1e-3 for _ in range(N_TENSORS)] for _ in self.ids]
        self.copies = [[torch.empty_like(t) for t in d] for d in self.deltas]
        self.weights = [contribution_weight("tokens_sq_per_step", 1000.0 + 10 * i, STEPS) for i in range(learners)]
        self.pool: ThreadPoolExecutor | None = None
        """Workers for the merge's sums and the decode (the ``pool`` rows); None: torch's threads."""
        config = RackmendConfig(schedule=ScheduleConfig(sync_every=STEPS, num_fragments=1),
                                syncer=SyncerConfig(min_quorum=learners, learners=self.ids))
        self.theta = [torch.zeros(numel) for _ in range(N_TENSORS)]
        self.opt = config.syncer.build_outer_optimizer(self.theta)
        self.core = SyncerCore(config, [self.spec], [[torch.zeros(numel) for _ in range(N_TENSORS)]])
        for lid in self.ids:
            self.core.handle(LearnerJoined(lid), 0.0)
        self.frames: dict[str, list[list[Any]]] = {}
        self.round = 0

    def encode(self, codec: str) -> None:
        """Each learner's message as it arrives on the wire, encoded with ``codec``."""
        enc = make_codec(codec)
        self.frames[codec] = []
        for i, d in enumerate(self.deltas):
            encoded = tuple(enc.encode(t) for t in d)
            c = Contribution(self.ids[i], 0, 0, STEPS, STEPS, 1000.0, 0.1, tuple(d), encoded=encoded, session=1,
                             seq=1)
            self.frames[codec].append([bytes(f) if isinstance(f, (bytes, memoryview)) else f
                                       for f in wire.contribution_frames(c, 0)])

    def copy(self) -> None:
        for src, dst in zip(self.deltas, self.copies):
            torch._foreach_copy_(dst, src)

    def merge_outer(self, deltas: list[list[torch.Tensor]] | None = None) -> None:
        merged = merge_deltas(deltas or self.deltas, self.weights, "mean", pool=self.pool)
        for th, gr in zip(self.theta, merged):
            th.grad = gr
        self.opt.step()

    def decode(self, codec: str) -> list[list[torch.Tensor]]:
        out = []
        for frames in self.frames[codec]:
            msg = wire.decode_header(frames, wire.SYNCER_RECEIVES, 1 << 31)
            out.append(list(wire.parse_contribution(msg, [self.spec], self.pool).tensors))
        return out

    def in_merge(self, codec: str) -> list[list[Any]]:
        """Each learner's tensors as the syncer checks them on arrival
        (``wire.parse_encoded_frames``), not decoded, each wrapped to be dequantized piece
        by piece as ``merge_deltas`` reads it (``DequantizedInMerge``)."""
        buf = torch.empty(MERGE_CHUNK)  # one for all: the merge adds each piece before it reads the next
        out = []
        for frames in self.frames[codec]:
            msg = wire.decode_header(frames, wire.SYNCER_RECEIVES, 1 << 31)
            c, encoded = wire.parse_encoded_frames(msg, self.spec)
            out.append([DequantizedInMerge(c, e, buf) for e in encoded])
        return out

    def decode_overlapping(self, codec: str, decoded: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The next round decoded on another thread while ``decoded`` merges on this one."""
        out: list[list[list[torch.Tensor]]] = []
        receiver = threading.Thread(target=lambda: out.append(self.decode(codec)))
        receiver.start()
        self.merge_outer(decoded)
        receiver.join(600)
        assert out, "the decode did not finish"
        return out[0]

    def core_round(self, deltas: list[list[torch.Tensor]] | None = None) -> None:
        r = self.round
        for i, lid in enumerate(self.ids):
            self.core.handle(ContributionArrived(Contribution(
                lid, 0, r, STEPS * (r + 1), STEPS, 1000.0 + i, 0.1, tuple((deltas or self.deltas)[i]))), float(r))
        self.round += 1
        assert self.core.versions[0] == self.round, "the round did not merge"


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_torch_thread_pool(threads: int) -> ThreadPoolExecutor:
    """``threads`` workers that each compute on one torch thread (with torch's count per
    worker, N workers would run N x N threads on N cores). A thread's first use of torch
    sets its count from the process's, so each worker asks for it before lowering it."""
    def init() -> None:
        torch.get_num_threads()
        torch.set_num_threads(1)

    return ThreadPoolExecutor(threads, initializer=init)


def measure(threads: int, learners: int, fragment_mb: float, repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat of each path, side by side, at ``threads`` threads."""
    torch.set_num_threads(threads)
    pool = one_torch_thread_pool(threads) if threads > 1 else None
    try:
        rnd = Round(learners, fragment_mb)
        for codec in ("int8", "int4"):
            rnd.encode(codec)
        assert all(torch.equal(a, b) for a, b in zip(merge_deltas(rnd.in_merge("int4"), rnd.weights, "mean"),
                                                     merge_deltas(rnd.decode("int4"), rnd.weights, "mean"))), \
            "dequantizing inside the merge changed its bits"
        secs: dict[str, list[float]] = {}
        for r in range(repeats + 1):  # the first repeat warms up and is dropped
            row = {
                "copy": _timed(rnd.copy),
                "fp32 merge+outer": _timed(rnd.merge_outer),
                "fp32 round": _timed(rnd.core_round),
            }
            for codec in ("int8", "int4"):
                row[f"{codec} decode+merge"] = _timed(lambda: rnd.merge_outer(rnd.decode(codec)))
                row[f"{codec} round"] = _timed(lambda: rnd.core_round(rnd.decode(codec)))
            row["int4 dequantize in merge (not taken)"] = _timed(lambda: rnd.merge_outer(rnd.in_merge("int4")))
            if pool is not None:
                previous = rnd.decode("int4")
                row["int4 decode next || merge"] = _timed(lambda: rnd.decode_overlapping("int4", previous))
                del previous
                rnd.pool = pool
                row["fp32 merge+outer, pool"] = _timed(rnd.merge_outer)
                row["int4 decode+merge, pool"] = _timed(lambda: rnd.merge_outer(rnd.decode("int4")))
                rnd.pool = None
                torch.set_num_threads(threads)  # the workers' set_num_threads(1) lowered the process's
            if r:
                for k, v in row.items():
                    secs.setdefault(k, []).append(v)
        return secs
    finally:
        if pool is not None:
            pool.shutdown()


def _shard(seed: int, learners: int, fragment_mb: float, repeats: int, go: Any, done: Any, out: Any) -> None:
    """One shard process: ``repeats`` whole rounds on its half of the bytes, each started
    when the parent says so (both shards together)."""
    torch.set_num_threads(1)
    rnd = Round(learners, fragment_mb, seed)
    rnd.core_round()  # warm-up
    for _ in range(repeats):
        go.wait(timeout=600)
        rnd.core_round()
        done.wait(timeout=600)
    out.put(seed)


def two_shards(learners: int, fragment_mb: float, repeats: int) -> list[float]:
    """Wall seconds per round of two shard processes side by side (until the slower is done)."""
    ctx = mp.get_context("spawn")
    go, done, out = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_shard, args=(s, learners, fragment_mb / 2, repeats, go, done, out), daemon=True)
             for s in range(2)]
    for proc in procs:
        proc.start()
    try:
        walls = []
        for _ in range(repeats):
            go.wait(timeout=600)
            t0 = time.perf_counter()
            done.wait(timeout=600)
            walls.append(time.perf_counter() - t0)
        assert sorted(out.get(timeout=60) for _ in procs) == [0, 1]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return walls


BYTES_PER_PARAM_HELD = {"theta": 1, "outer momentum": 1, "history (max_staleness 4)": 5, "rollback copy": 2,
                        "snapshot sent": 1}
"""What a syncer holds per fp32 byte of its fragments (``SyncerCore``: Θ, the Nesterov
buffer, the last max_staleness + 1 values for re-anchoring, the value and momentum kept
to roll back a non-finite step, the value being sent); contributions in rounds come on top."""


def plan(measured: dict[str, float]) -> list[dict[str, Any]]:
    """Shards and syncer memory for 7B and 70B models at M=8, H=100, 1 s and 5 s steps,
    from the bytes per second one shard took in here (``measured``: GB/s per uplink)."""
    rows = []
    for params in (7e9, 70e9):
        for step_s in (1.0, 5.0):
            inbound = 8 * 4 * params / (100 * step_s) / 1e9  # GB/s of fp32 fragment bytes, M x 4N / (H T)
            held = 4 * params * sum(BYTES_PER_PARAM_HELD.values()) / 1e9
            row = {"params": params, "step_s": step_s, "inbound_gbps": inbound, "held_gb": held}
            for uplink, gbps in measured.items():
                row[f"shards_{uplink}"] = max(1, math.ceil(inbound / gbps))
            rows.append(row)
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=8)
    p.add_argument("--fragment-mb", type=float, default=64.0)
    a = p.parse_args()
    repeats = 3 if a.quick else 9
    rows: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    nbytes = a.learners * int(a.fragment_mb * 2**20 / 4 / N_TENSORS) * N_TENSORS * 4
    for threads in (1, 2):
        print(f"{threads} thread(s): {a.learners} learners x {a.fragment_mb:g} MB ...", flush=True)
        secs = measure(threads, a.learners, a.fragment_mb, repeats)
        raw[f"threads={threads}"] = secs
        for path, s in secs.items():
            ratios = [c / x for c, x in zip(secs["copy"], s)]
            rows[f"{path} ({threads}t)"] = {"gbps": summary([nbytes / x / 1e9 for x in s]), "ratio": summary(ratios)}
    print("2 shards side by side ...", flush=True)
    walls = two_shards(a.learners, a.fragment_mb, repeats)
    raw["two_shards"] = walls
    copy2 = statistics.median(raw["threads=2"]["copy"])
    rows["2 shards, 1t each"] = {"gbps": summary([nbytes / w / 1e9 for w in walls]),
                                 "ratio": summary([copy2 / w for w in walls])}
    print(f"\nGB/s of fragment bytes in ({repeats} repeats; ratio: copy time / path time, side by side)")
    print(f"{'path':<44} {'GB/s':>7} {'min':>7} {'max':>7} {'x copy':>7} {'min':>6} {'max':>6}")
    for name, r in rows.items():
        g, q = r["gbps"], r["ratio"]
        print(f"{name:<44} {g['median']:>7.2f} {g['min']:>7.2f} {g['max']:>7.2f} {q['median']:>7.2f} "
              f"{q['min']:>6.2f} {q['max']:>6.2f}")
    measured = {"fp32": rows["fp32 round (1t)"]["gbps"]["median"], "int4": rows["int4 round (1t)"]["gbps"]["median"]}
    sizing = plan(measured)
    print(f"\nsizing at M=8, H=100 from one shard's whole round here (fp32 {measured['fp32']:.2f} GB/s, "
          f"int4 {measured['int4']:.2f} GB/s):")
    print(f"{'model':<6} {'step':>5} {'in GB/s':>8} {'shards fp32':>12} {'shards int4':>12} {'held GB':>8}")
    for r in sizing:
        print(f"{r['params'] / 1e9:>4.0f}B {r['step_s']:>4.0f}s {r['inbound_gbps']:>8.2f} {r['shards_fp32']:>12} "
              f"{r['shards_int4']:>12} {r['held_gb']:>8.0f}")
    pick = lambda name: rows[name]["ratio"]["median"]  # noqa: E731
    finish("syncer_capacity", a.out,
           {"inputs": {"learners": a.learners, "fragment_mb": a.fragment_mb, "repeats": repeats, "bytes": nbytes},
            "seconds": raw, "rows": rows, "sizing": sizing},
           {"fp32_merge_2t_x_copy": pick("fp32 merge+outer (2t)"), "fp32_merge_1t_x_copy": pick("fp32 merge+outer (1t)"),
            "int4_decode_merge_2t_x_copy": pick("int4 decode+merge (2t)"),
            "int4_dequantize_in_merge_2t_x_copy": pick("int4 dequantize in merge (not taken) (2t)"),
            "int4_dequantize_in_merge_1t_x_copy": pick("int4 dequantize in merge (not taken) (1t)"),
            "int8_decode_merge_2t_x_copy": pick("int8 decode+merge (2t)"),
            "int4_decode_next_while_merging_2t_x_copy": pick("int4 decode next || merge (2t)"),
            "fp32_merge_2t_pool_x_copy": pick("fp32 merge+outer, pool (2t)"),
            "int4_decode_merge_2t_pool_x_copy": pick("int4 decode+merge, pool (2t)"),
            "fp32_round_2t_x_copy": pick("fp32 round (2t)"), "int4_round_2t_x_copy": pick("int4 round (2t)"),
            "two_shards_x_copy": pick("2 shards, 1t each"),
            "fp32_round_2t_gbps": rows["fp32 round (2t)"]["gbps"]["median"],
            "copy_2t_gbps": rows["copy (2t)"]["gbps"]["median"]})


if __name__ == "__main__":
    main()
