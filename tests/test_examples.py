"""Every script in ``examples/`` runs, at toy size, as a rack of a real ``rackmend syncer``
process, launched the way its docstring's two-line launch command says (plain python
or torchrun with 2 gloo ranks): it exits 0, its work is merged and it leaves cleanly."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from procs import TORCHRUN, Procs, events, finish
from rackmend.core.records import Joined, Left, Merged

EXAMPLES = Path(__file__).parent.parent / "examples"

RUNS = {
    # example: (the launcher its docstring names, extra flags for a toy-size run)
    "train_gpt.py": ("python", ["--steps", "16", "--sync-every", "4", "--fragments", "2"]),
    "ddp_rack.py": ("torchrun", ["--steps", "16", "--sync-every", "4"]),
    "fsdp2_rack.py": ("torchrun", ["--steps", "16", "--sync-every", "4"]),
    "hf_trainer_rack.py": ("torchrun", ["--steps", "16", "--output-dir", "{tmp}/hf"]),
    "accelerate_rack.py": ("torchrun", ["--steps", "16", "--state", "{tmp}/state"]),
}
NEEDS = {"hf_trainer_rack.py": "transformers", "accelerate_rack.py": "accelerate"}
ELSEWHERE = {
    # examples whose test checks more of what they do (it runs the example itself)
    "lightning_rack.py": ("python", "test_lightning.py", "test_example_trains_a_rack_of_two_through_a_syncer"),
    "torchtitan_rack.py": ("torchrun", "test_torchtitan.py",
                           "test_fsdp2_and_tp_racks_count_tokens_leave_and_resume_from_torchtitans_checkpoint"),
}
CONNECT = {"torchtitan_rack.py": "--rackmend.endpoint"}
"""How an example takes the syncer's address where it is not --connect (torchtitan's own CLI)."""


def test_every_example_is_run_by_a_test() -> None:
    """A new example needs a line in RUNS (or a test of its own, in ELSEWHERE), and every
    example documents its two-line launch."""
    found = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert found == sorted([*RUNS, *ELSEWHERE]), f"examples without a test, or tests of missing ones: {found}"
    for name, (test_file, test) in ((n, e[1:]) for n, e in ELSEWHERE.items()):
        assert f"def {test}(" in (Path(__file__).parent / test_file).read_text(), f"{name}: {test} is gone"
    for name, launcher in [*((n, r[0]) for n, r in RUNS.items()), *((n, e[0]) for n, e in ELSEWHERE.items())]:
        doc = (EXAMPLES / name).read_text()
        assert re.search(r"rackmend syncer --bind tcp://\S+", doc), f"{name}: no syncer command in its docstring"
        assert f"{'torchrun --nproc-per-node 2' if launcher == 'torchrun' else 'python'} examples/{name}" in doc, name
        assert CONNECT.get(name, "--connect") in doc, f"{name}: examples take the syncer's address as --connect"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_trains_as_a_rack_of_a_real_syncer(procs: Procs, tmp_path: Path, name: str) -> None:
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{NEEDS[name]} is not installed")
    launcher, flags = RUNS[name]
    _, endpoint = procs.syncer("--min-quorum", "1")
    cmd = [*(TORCHRUN if launcher == "torchrun" else [sys.executable]), str(EXAMPLES / name),
           "--connect", endpoint, "--id", "rack0", *(f.format(tmp=tmp_path) for f in flags)]
    proc = procs.start(cmd, "rack0")
    finish(proc, procs, "rack0", timeout=240)
    joined = events(tmp_path, Joined)
    assert joined and {e.world for e in joined} == {2 if launcher == "torchrun" else 1}, joined
    assert len([e for e in events(tmp_path, Merged) if "rack0" in e.merged]) >= 4
    assert [(e.learner, e.reason) for e in events(tmp_path, Left)] == [("rack0", "leave")]
