"""PyTorch Lightning racks through ``rackmend.learner.lightning.RackmendCallback``: torchrun
jobs of gloo ranks on the CPU against a real ``rackmend syncer`` (skipped when
``lightning`` is absent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from procs import HERE, TORCHRUN, Procs, events, finish  # noqa: E402
from rackmend.core.fragments import fragment_offsets  # noqa: E402
from rackmend.core.records import Incomplete, Left, Merged, Rejected  # noqa: E402
from rackmend.service.events import BadMessage  # noqa: E402
from rackstate import assert_held_equal_syncer  # noqa: E402

pytestmark = pytest.mark.integration  # a third-party trainer stack (pyproject.toml markers)

PROC = str(HERE / "_lightning_proc.py")
EXAMPLE = HERE.parent / "examples" / "lightning_rack.py"
H, P, TAU = 4, 2, 1  # the helper's schedule
STEPS_A, CKPT_AT, STEPS_B = 8, 6, 12


def _sent_in_fit_a(step_tokens: list[float], offset: int) -> list[float]:
    """Per send of one fragment in fit A whose merged value fit A applied (t + tau <=
    STEPS_A), the tokens it reports in deterministic mode: the rack's tokens since the
    previous merged value was applied (at t_send + tau, the counters reset after that
    step's count), the first send counting from step 1."""
    out, start = [], 1
    for t in range(1, STEPS_A + 1):
        if (t - offset) % H == 0 and t + TAU <= STEPS_A:
            out.append(sum(step_tokens[start - 1:t]))
            start = t + TAU + 1
    return out


def test_ddp_and_fsdp2_racks_train_checkpoint_resume_and_leave(procs: Procs, tmp_path: Path) -> None:
    """Two Lightning racks of 2 ranks, one DDP and one FSDP2 (``ModelParallelStrategy``,
    ``fully_shard`` in ``configure_model``), deterministic, through a checkpointing
    syncer. Each rank runs two fits in one process: fit A (8 steps of 2 micro-batches of
    ragged, padded sequences; Lightning's ModelCheckpoint saves at step 6), then, once
    both racks are done with it, fit B resuming from that checkpoint to step 12.

    - tokens: every merge of fit A carries exactly the real tokens the rack's two ranks
      trained on since the previous applied merge (counted by the collator from the
      items' lengths), so a count of 1 per step, or of one rank's batches, would fail;
    - each fit leaves cleanly: the syncer logs three ``Left`` (reason ``leave``) per rack,
      and the second fit in the same process joins and merges again;
    - resume: every rank gets its own rackmend state back from Lightning's checkpoint
      (its own step timings, which differ between the ranks), and its model is the
      checkpoint's rebased onto the syncer's newer value,
      theta = theta_ckpt + (Theta_now - Theta_ckpt), bit for bit;
    - at the end every rank holds, of each fragment, exactly its blocks of the syncer's
      value of the version it holds;
    - a third fit from the same checkpoint with ``restore=False`` starts from the
      global value it joined with, on both strategies."""
    ids = ["l0", "l1"]
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                                    "--overlap", str(TAU), "--checkpoint-dir", str(ck))
    strategies = {"l0": "ddp", "l1": "fsdp"}
    racks = {lid: procs.start([*TORCHRUN, PROC, "--endpoint", endpoint, "--id", lid, "--learners", ",".join(ids),
                               "--strategy", strategies[lid], "--steps-a", str(STEPS_A), "--ckpt-at", str(CKPT_AT),
                               "--steps-b", str(STEPS_B), "--out", str(tmp_path)], lid)
             for lid in ids}
    for lid, proc in racks.items():
        finish(proc, procs, lid, timeout=240)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0

    merges = events(tmp_path, Merged)
    assert not events(tmp_path, Incomplete, Rejected, BadMessage)
    for p, offset in enumerate(fragment_offsets(P, H)):
        got = [e for e in merges if e.fragment == p]
        for lid in ids:
            micro = [json.loads((tmp_path / f"{lid}.tokens.{r}.json").read_text())["a"] for r in range(2)]
            assert all(len(m) == 2 * STEPS_A for m in micro), [len(m) for m in micro]
            step_tokens = [float(sum(m[2 * t] + m[2 * t + 1] for m in micro)) for t in range(STEPS_A)]
            assert len(set(step_tokens)) > 1 and micro[0] != micro[1], "batches were not ragged"
            expected = _sent_in_fit_a(step_tokens, offset)
            assert expected and all(list(e.merged) == ids for e in got[:len(expected)])
            assert [e.tokens[lid] for e in got[:len(expected)]] == expected, (lid, p)
    for lid in ids:
        left = [e for e in events(tmp_path, Left) if e.learner == lid]
        assert [e.reason for e in left] == ["leave"] * 3, left
        assert any(lid in e.merged and e.t > left[0].t for e in merges), f"{lid}'s second fit merged nothing"

    for lid in ids:
        timings = []
        for rank in range(2):
            saved = json.loads((tmp_path / f"{lid}.saved.{rank}.json").read_text())
            resumed = json.loads((tmp_path / f"{lid}.resumed.{rank}.json").read_text())
            assert saved["step"] == resumed["step"] == CKPT_AT
            for key in ("c_steps", "c_tokens", "c_time"):
                assert resumed[key] == saved[key], f"{lid} rank {rank}: {key} not restored"
            assert all(n > t for t, n in zip(saved["versions"], resumed["versions"])), \
                f"{lid} rank {rank}: the syncer did not move on ({saved['versions']} -> {resumed['versions']})"
            timings.append(saved["c_time"])
            then = load_file(str(tmp_path / f"{lid}.saved.{rank}.safetensors"))
            now = load_file(str(tmp_path / f"{lid}.resumed.{rank}.safetensors"))
            blocks = sorted(k.split("/", 1)[1] for k in then if k.startswith("model/"))
            assert blocks
            for b in blocks:
                expected = then[f"model/{b}"].clone()
                expected.add_(now[f"held/{b}"] - then[f"held/{b}"])
                assert torch.equal(now[f"model/{b}"], expected), f"{lid} rank {rank} {b}: not rebased"
            assert any(not torch.equal(now[f"model/{b}"], then[f"model/{b}"]) for b in blocks)
        assert timings[0] != timings[1], "the ranks' states are alike: the test could not tell them apart"
        for rank in range(2):
            rejoined = load_file(str(tmp_path / f"{lid}.rejoined.{rank}.safetensors"))
            blocks = sorted(k.split("/", 1)[1] for k in rejoined if k.startswith("model/"))
            assert blocks and all(torch.equal(rejoined[f"model/{b}"], rejoined[f"held/{b}"]) for b in blocks), \
                f"{lid} rank {rank}: restore=False did not leave the model at the joined global value"
        assert_held_equal_syncer([tmp_path / f"{lid}.held.{r}" for r in range(2)],
                                 load_file(str(ck / "syncer.safetensors")))


def test_racks_set_up_wrong_are_refused_naming_the_fix(procs: Procs, tmp_path: Path) -> None:
    """One process, one device, a real syncer: each misuse raises ConfigError naming what
    to do instead, and a rack that had joined leaves (``Left``, not a silent learner);
    the same process set up right trains a single-process rack whose work is merged."""
    _, endpoint = procs.syncer("--min-quorum", "1")
    out = subprocess.run([sys.executable, PROC, "--misuse", "--endpoint", endpoint], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    cases = {c["case"]: c for c in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    fixes = {
        "fsdp1": "use Trainer(strategy=ModelParallelStrategy()) and shard the model with FSDP2 in configure_model",
        "returned_rackmend": "RackmendCallback builds it: return the plain optimizer",
        "two_optimizers": "configure_optimizers returned 2; return a single optimizer",
        "tuple_batches": "Pass RackmendCallback(..., tokens_fn=f)",
        "resized": "Resume with 2 ranks, or pass RackmendCallback(..., restore=False)",
    }
    assert sorted(cases) == sorted([*fixes, "single_device"]), out.stdout
    assert cases["single_device"]["error"] is None, cases["single_device"]
    assert [e for e in events(tmp_path, Merged) if list(e.merged) == ["single"]]
    for case, fix in fixes.items():
        assert cases[case]["error"] == "ConfigError" and fix in cases[case]["message"], cases[case]
    assert sorted((e.learner, e.reason) for e in events(tmp_path, Left)) == [
        ("built", "leave"), ("single", "leave"), ("tuples", "leave")]


def test_example_trains_a_rack_of_two_through_a_syncer(procs: Procs, tmp_path: Path) -> None:
    """``examples/lightning_rack.py`` as its header launches it (Lightning's own launcher
    starts the second rank), at toy size: the rack's merges reach the syncer, it leaves
    cleanly, and its held-out loss falls."""
    _, endpoint = procs.syncer("--learners", "rack0", "--min-quorum", "1")
    example = procs.start([sys.executable, str(EXAMPLE), "--connect", endpoint, "--devices", "2", "--steps", "24",
                           "--out", str(tmp_path / "example.json")], "example",
                          env={"RACKMEND_LEARNER_ID": "rack0", "OMP_NUM_THREADS": "1"})
    finish(example, procs, "example", timeout=180)
    merges = events(tmp_path, Merged)
    assert {e.fragment for e in merges} == set(range(2)) and all(list(e.merged) == ["rack0"] for e in merges)
    assert [(e.learner, e.reason) for e in events(tmp_path, Left)] == [("rack0", "leave")]
    result = json.loads((tmp_path / "example.json").read_text())
    assert result["versions"] and min(result["versions"]) >= 2
    assert result["end_loss"] < result["start_loss"], result


def test_lightning_stays_optional() -> None:
    """``import rackmend`` does not load lightning, and the Lightning module without it
    fails at import with what to install."""
    probe = ("import sys; import rackmend, rackmend.learner; assert 'lightning' not in sys.modules; "
             "sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
             "try:\n    import rackmend.learner.lightning\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs PyTorch Lightning 2.x: pip install lightning" in out.stdout
