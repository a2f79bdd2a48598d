"""Everything that needs a GPU, in one command (``make gpu-check``): a few minutes.

1. every CUDA test (``pytest -m cuda``: codecs on the device, learners on the device
   against the reference, multi-GPU racks where there are GPUs for them);
2. the codecs on the device (``benchmarks/codecs.py --quick --device cuda``);
3. the learner-overhead benchmark on the device (``benchmarks/learner_overhead.py``):
   one process, every step synchronised, at torch's default threads and at 4, and timed
   per block with the host running ahead, on the 19 M-parameter GPT; an FSDP2 rack over
   two GPUs (over one where there is only one); and last, the 302 M-parameter GPT.

Each part prints its own table and ``RESULT`` line; this script adds one ``RESULT`` line
per part with its exit status (``timeout``: killed after ``PART_TIMEOUT_S``) and wall
time, and exits non-zero when any part failed.
CI has no GPU and never runs it; record the numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device; nothing to check here", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    py = sys.executable
    parts = [
        ("cuda_tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", str(HERE.parent / "tests")]),
        ("codecs", [py, str(HERE / "codecs.py"), "--quick", "--device", "cuda",
                    "--out", str(HERE / "results" / "codecs-cuda.json")]),
        ("learner_overhead_single", [py, str(HERE / "learner_overhead.py"), "--device", "cuda", "--profile", "12"]),
        # torch's CPU threads (every core by default) contend with rackmend's host work on a
        # GPU host; torchrun sets 1 per process, 4 is what docs/integration.md suggests.
        ("learner_overhead_single_threads4", [py, str(HERE / "learner_overhead.py"), "--device", "cuda",
                                              "--threads", "4", "--out",
                                              str(HERE / "results" / "learner_overhead-single-cuda-threads4.json")]),
        # No synchronisation inside a block: what a loop that lets the host run ahead sees.
        ("learner_overhead_single_block", [py, str(HERE / "learner_overhead.py"), "--device", "cuda",
                                           "--threads", "4", "--timing", "block", "--repeats", "12", "--block", "48",
                                           "--out", str(HERE / "results" / "learner_overhead-single-cuda-block.json")]),
    ]
    # An FSDP2 rack: over two GPUs where there are two; else over one (the same DTensor
    # parameters and collectives, NCCL with one rank), so one GPU still measures it.
    ranks = "2" if gpus >= 2 else "1"
    parts.append((f"learner_overhead_fsdp{ranks}", [py, str(HERE / "learner_overhead.py"), "--device", "cuda",
                                                   "--rack", "fsdp", "--ranks", ranks, "--threads", "4", "--out",
                                                   str(HERE / "results" / f"learner_overhead-fsdp{ranks}-cuda.json")]))
    # Last, the longest: a step as long as a real LLM's (302 M parameters); rackmend's
    # fixed host work per step is measured against a ~10 ms step above, a longer one here.
    parts.append(("learner_overhead_large", [py, str(HERE / "learner_overhead.py"), "--device", "cuda", "--large",
                                             "--threads", "4", "--timing", "block", "--repeats", "6", "--block", "24",
                                             "--out", str(HERE / "results" / "learner_overhead-large-cuda-block.json")]))
    failed = 0
    for name, cmd in parts:
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = _run(cmd, PART_TIMEOUT_S)
        failed += rc != 0
        print(f"RESULT part={name} rc={rc if rc is not None else 'timeout'} wall_s={time.monotonic() - t0:.1f}",
              flush=True)
    return 1 if failed else 0


PART_TIMEOUT_S = 180.0
"""A part still running after this long is killed (with what it started), so one that
hangs cannot take the device time the parts after it need; each took under a minute
on an H200 (benchmarks/results/gpu-check.log)."""


def _run(cmd: list[str], timeout: float) -> int | None:
    """``cmd``'s exit status, or None when it ran past ``timeout`` and was killed. In a
    session of its own, so a torchrun part's ranks go with it."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


if __name__ == "__main__":
    sys.exit(main())
