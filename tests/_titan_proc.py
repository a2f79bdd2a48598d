"""A rank of a torchtitan rack for the tests: the CPU shims of ``_titan_shims`` (test
scaffolding), then ``examples/torchtitan_rack.py`` exactly as torchrun would run it, with
the arguments given here.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_titan_proc.py \\
    --rackmend.endpoint tcp://127.0.0.1:PORT --rackmend.learner-id l0 ... \\
    --override.imports _titan_shims.sdpa_on_cpu _titan_shims.recording_loader _titan_shims.recording_optimizer
"""

from __future__ import annotations

import runpy
from pathlib import Path

import _titan_shims  # noqa: F401  (applies the CPU shims on import, before torchtitan loads)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchtitan_rack.py"

if __name__ == "__main__":
    runpy.run_path(str(EXAMPLE), run_name="__main__")
