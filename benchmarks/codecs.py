"""Encode + decode throughput of every codec, against a plain tensor copy, and wire bytes.

Runbook: ``python benchmarks/codecs.py --quick`` (3 repeats) or without ``--quick``
(9 repeats); both use a 64 MB float32 tensor (4096 x 4096, so PowerSGD compresses it
as a matrix) unless ``--mb`` says otherwise. For each repeat and each codec, side by
side: (a) ``copy_`` of the same bytes into a preallocated tensor (the memory-bandwidth
yardstick, timed right before), (b) ``encode`` then ``decode``. GB/s counts fp32 input
bytes; "vs copy" is copy time / codec time per repeat (1.0 = as fast as a copy);
"wire" is fp32 bytes / encoded frame bytes. PowerSGD keeps its warm-start state across
repeats, as it would across steps. The first repeat warms up and is dropped.
``--device cuda`` times on a GPU (with synchronisation around each timed region).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from _common import finish, parser, summary
from rackmend.codecs import Codec, make_codec

CODEC_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("bf16", {}),
    ("int8", {"block_size": 256}),
    ("int4", {"block_size": 64}),
    ("powersgd", {"rank": 4}),
]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64.0, help="tensor size in MB of float32 (default 64)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args()
    repeats = 3 if args.quick else 9
    device = torch.device(args.device)
    side = int((args.mb * 2**20 / 4) ** 0.5)
    shape = (side, side)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e-3).to(device)
    nbytes = x.numel() * 4
    dst = torch.empty_like(x)
    dst.copy_(x)  # touch the pages once so the yardstick measures bandwidth, not page faults
    codecs: dict[str, Codec] = {name: make_codec(name, **kw) for name, kw in CODEC_SETTINGS}
    states: dict[str, dict[str, Any]] = {name: {} for name in codecs}

    copy_s: dict[str, list[float]] = {n: [] for n in codecs}
    enc_s: dict[str, list[float]] = {n: [] for n in codecs}
    dec_s: dict[str, list[float]] = {n: [] for n in codecs}
    wire: dict[str, int] = {}
    err_over_bound: dict[str, float] = {}
    for r in range(repeats + 1):
        for name, codec in codecs.items():
            tc, _ = timed(lambda: dst.copy_(x), device)
            te, enc = timed(lambda: codec.encode(x, states[name]), device)
            td, out = timed(lambda: codec.decode(enc), device)
            if r == 0:
                wire[name] = enc.nbytes()
                bound = codec.error_bound(x)
                err = (out - x).abs().max().item()
                err_over_bound[name] = err / bound if bound else (0.0 if err == 0 else float("inf"))
                continue
            copy_s[name].append(tc)
            enc_s[name].append(te)
            dec_s[name].append(td)

    gbps = lambda secs: [nbytes / s / 1e9 for s in secs]  # noqa: E731
    rows: dict[str, dict[str, Any]] = {}
    for name in codecs:
        total = [e + d for e, d in zip(enc_s[name], dec_s[name])]
        rows[name] = {
            "gbps": summary(gbps(total)),
            "encode_ms": summary([s * 1e3 for s in enc_s[name]]),
            "decode_ms": summary([s * 1e3 for s in dec_s[name]]),
            "ratio_to_copy": summary([c / t for c, t in zip(copy_s[name], total)]),
            "wire_bytes": wire[name],
            "wire_ratio": nbytes / wire[name],
            "err_over_bound": err_over_bound[name],
        }
    copy_all = [s for name in codecs for s in copy_s[name]]
    copy_row = summary(gbps(copy_all))

    print(f"{args.mb:.0f} MB float32 {shape} on {device}, {repeats} repeats, "
          f"{torch.get_num_threads()} threads; GB/s of fp32 input, encode+decode")
    print(f"{'codec':<9} {'enc ms':>8} {'dec ms':>8} {'GB/s':>7} {'min':>7} {'max':>7} {'vs copy':>8} "
          f"{'wire':>7} {'err/bound':>9}")
    print(f"{'copy':<9} {'':>8} {'':>8} {copy_row['median']:>7.2f} {copy_row['min']:>7.2f} {copy_row['max']:>7.2f} "
          f"{1.0:>8.2f} {1.0:>6.2f}x {'':>9}")
    for name, row in rows.items():
        g = row["gbps"]
        print(f"{name:<9} {row['encode_ms']['median']:>8.1f} {row['decode_ms']['median']:>8.1f} {g['median']:>7.2f} "
              f"{g['min']:>7.2f} {g['max']:>7.2f} {row['ratio_to_copy']['median']:>8.3f} "
              f"{row['wire_ratio']:>6.2f}x {row['err_over_bound']:>9.3f}")

    result: dict[str, float] = {"copy_gbps": copy_row["median"]}
    for name, row in rows.items():
        result[f"{name}_gbps"] = row["gbps"]["median"]
        result[f"{name}_ratio_to_copy"] = row["ratio_to_copy"]["median"]
        result[f"{name}_wire_ratio"] = row["wire_ratio"]
    finish("codecs", args.out,
           {"inputs": vars(args) | {"out": str(args.out), "repeats": repeats, "shape": list(shape), "bytes": nbytes,
                                    "codecs": {n: kw for n, kw in CODEC_SETTINGS}},
            "seconds": {"copy": copy_s, "encode": enc_s, "decode": dec_s}, "codecs": rows, "copy": copy_row},
           result)


if __name__ == "__main__":
    main()
