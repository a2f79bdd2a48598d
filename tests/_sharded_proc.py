"""A 2-rank rack whose parameters are DTensors (FSDP2 or tensor parallel), run under
torchrun with gloo on the CPU: building a RackmendOptimizer must refuse it by name.

python -m torch.distributed.run --nproc-per-node 2 tests/_sharded_proc.py --mode fsdp
Prints ``REFUSED: <message>`` and exits 0 when refused, exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_inner, make_model  # noqa: E402

from rackmend import ConfigError, RackmendConfig, RackmendOptimizer, ZmqLink  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("fsdp", "tp"), required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        linear = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        parallelize_module(model, mesh, {linear: ColwiseParallel()})
    try:
        # No syncer is listening: the refusal must come before any network traffic.
        RackmendOptimizer(model, make_inner(model), RackmendConfig(), ZmqLink("tcp://127.0.0.1:9"),
                          learner_id="sharded")
    except ConfigError as exc:
        print(f"REFUSED: {exc}", flush=True)
        dist.destroy_process_group()
        return 0
    print("ACCEPTED", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
