"""Everything that needs a GPU, in one command (``make gpu-check``): a few minutes.

1. every CUDA test (``pytest -m cuda``: codecs on the device, learners on the device
   against the reference, multi-GPU racks where there are GPUs for them);
2. the codecs on the device (``benchmarks/codecs.py --quick --device cuda``);
3. the learner-overhead benchmark on the device (``benchmarks/learner_overhead.py``):
   one process, every step synchronised, at torch's default threads and at 4, and timed
   per block with the host running ahead, on the 19 M-parameter GPT; an FSDP2 rack over
   two GPUs (over one where there is only one); and last, the 302 M-parameter GPT.

Each part prints its own table and ``RESULT`` line into its log (``--log-dir``), whose
last lines this script prints, with one ``RESULT`` line per part: its exit status
(``timeout``: killed after ``PART_TIMEOUT_S``; ``skipped``: the ``--budget-s`` for all
parts was spent) and wall time. It exits non-zero when any part failed.
CI has no GPU and never runs it; record the numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="wall time for all parts; parts that would start past it are skipped (default 520)")
    ap.add_argument("--log-dir", type=Path, default=HERE / "results" / "gpu-check",
                    help="each part's whole output goes to <log-dir>/<part>.log (stdout shows its tail)")
    args = ap.parse_args()
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
    args.log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    failed = 0
    for name, cmd in parts:
        left = deadline - time.monotonic()
        if left < 30:
            failed += 1
            print(f"RESULT part={name} rc=skipped wall_s=0.0 (budget spent)", flush=True)
            continue
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        log = args.log_dir / f"{name}.log"
        t0 = time.monotonic()
        rc = _run(cmd, min(PART_TIMEOUT_S, left), log)
        failed += rc != 0
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-TAIL_LINES:]), end="")
        print(f"RESULT part={name} rc={rc if rc is not None else 'timeout'} wall_s={time.monotonic() - t0:.1f} "
              f"log={log}", flush=True)
    return 1 if failed else 0


PART_TIMEOUT_S = 180.0
"""A part still running after this long is killed (with what it started), so one that
hangs cannot take the device time the parts after it need; each took under a minute
on an H200 (benchmarks/results/gpu-check.log)."""


TAIL_LINES = 40
"""Lines of each part's output printed (the device tool returns only the end of stdout;
the whole log is in ``--log-dir``)."""


def _run(cmd: list[str], timeout: float, log: Path) -> int | None:
    """``cmd``'s exit status, or None when it ran past ``timeout`` and was killed; its
    output goes to ``log``. In a session of its own, so a torchrun part's ranks go with it."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


if __name__ == "__main__":
    sys.exit(main())
