"""Conventions every benchmark here follows: ``--quick``, a table, JSON under
``benchmarks/results/``, and a last line ``RESULT k=v ...`` for easy comparison."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

RESULTS = Path(__file__).parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes, for a smoke run")
    p.add_argument("--out", type=Path, default=None, help="JSON output path (default: benchmarks/results/<name>.json)")
    return p


def summary(samples: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def finish(name: str, out: Path | None, payload: dict[str, Any], result: dict[str, float]) -> None:
    """Write the JSON (machine, inputs, samples) and print the RESULT line last."""
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), **payload, "result": result}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


@contextlib.contextmanager
def running_syncer(workdir: Path, threads: int | None = None, flags: tuple[str, ...] = ()) -> Iterator[str]:
    """A ``rackmend syncer`` with default settings but ``flags`` on 127.0.0.1 (port chosen
    by the OS), its log and output in ``workdir`` (created); yields its endpoint once it
    listens and stops it (SIGTERM, then SIGKILL after 30 s) on the way out. ``threads``:
    its torch threads (``OMP_NUM_THREADS``); None leaves torch's default, every core."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    ready = workdir / "syncer.endpoint"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready),
         "--log", str(workdir / "events.jsonl"), *flags],
        stdout=open(workdir / "syncer.out", "wb"), stderr=subprocess.STDOUT, env=env)
    try:
        end = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"the syncer did not start: {(workdir / 'syncer.out').read_text()[-2000:]}")
            time.sleep(0.05)
        yield ready.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
