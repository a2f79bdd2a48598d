"""Hugging Face models and the ``Trainer`` through rackmend, with real processes and a
real ``rackmend syncer`` on 127.0.0.1 (skipped when ``transformers`` is absent)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from procs import HERE, TORCHRUN, Procs, events, finish  # noqa: E402
from trainer_racks import IDS, STEPS, STOP, StopResume, expected_tokens  # noqa: E402
from rackmend.core.records import Merged, Rejected, TokenUnits  # noqa: E402
from rackmend.service.events import BadMessage  # noqa: E402

pytestmark = pytest.mark.integration  # a third-party trainer stack (pyproject.toml markers)

TRAINER = [sys.executable, str(HERE / "_trainer_proc.py")]
ACCELERATE = str(HERE / "_accelerate_proc.py")
TOKENS_PER_STEP = 4 * 16  # the helper's batch x sequence length


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_trainer_racks_train_through_a_syncer_with_token_weights(procs: Procs, tmp_path: Path, arch: str) -> None:
    """Two racks, each a Trainer (RackmendOptimizer and a scheduler passed in, step()
    called bare): every merge takes both racks with their real token counts, the
    scheduler drives the inner learning rate, and the held-out loss falls."""
    ids, steps = ["l0", "l1"], 24
    _, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                               "--overlap", "1")
    racks = {lid: procs.start([*TRAINER, "--endpoint", endpoint, "--id", lid, "--learners", ",".join(ids),
                               "--steps", str(steps), "--arch", arch, "--out", str(tmp_path / f"{lid}.json")], lid)
             for lid in ids}
    for lid, proc in racks.items():
        finish(proc, procs, lid, timeout=240)
    merges = events(tmp_path, Merged)
    assert {e.fragment for e in merges} == {0, 1} and len(merges) >= 2 * (steps // 4 - 1)
    for e in merges:
        assert list(e.merged) == ids
        for lid in ids:
            k = e.tokens[lid] / TOKENS_PER_STEP
            assert k == int(k) and 1 <= k <= 4, f"{lid} reported {e.tokens[lid]} tokens"
        assert all(abs(w - 0.5) < 0.2 for w in e.weights.values()), e.weights
    assert not events(tmp_path, TokenUnits, Rejected, BadMessage)
    for lid in ids:
        result = json.loads((tmp_path / f"{lid}.json").read_text())
        assert result["step"] == steps and min(result["versions"]) >= steps // 4 - 1
        assert result["lr"] == pytest.approx(3e-3 * 0.95**steps), "the scheduler did not drive the inner optimizer"
        assert any("loss" in entry for entry in result["log_history"])
        assert result["end_loss"] < result["start_loss"] - 0.3, result


def test_attach_to_trainer_counts_batch_tokens_and_logs_merges(procs: Procs, tmp_path: Path) -> None:
    """A plain Trainer (its own AdamW and scheduler from TrainingArguments) with
    ``attach_to_trainer``, ragged batches padded per batch, 2 micro-batches a step: every
    merge reports exactly the non-padding tokens the collator saw in its window, and the
    Trainer's log history carries the merges."""
    from rackmend.core.fragments import fragment_offsets

    ids, steps, accumulate, H, P, tau = ["l0", "l1"], 16, 2, 4, 2, 1
    _, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                               "--overlap", str(tau))
    racks = {lid: procs.start([*TRAINER, "--endpoint", endpoint, "--id", lid, "--learners", ",".join(ids),
                               "--steps", str(steps), "--mode", "attach", "--accumulate", str(accumulate),
                               "--out", str(tmp_path / f"{lid}.json")], lid)
             for lid in ids}
    for lid, proc in racks.items():
        finish(proc, procs, lid, timeout=240)
    results = {lid: json.loads((tmp_path / f"{lid}.json").read_text()) for lid in ids}
    step_tokens = {}
    for lid, r in results.items():
        assert r["inner"] == "AdamW" and r["step"] == steps
        micro = r["collated"][: steps * accumulate]  # the loader may have collated one batch ahead
        step_tokens[lid] = [sum(micro[i:i + accumulate]) for i in range(0, len(micro), accumulate)]
        assert len(set(step_tokens[lid])) > 1, "batches were not ragged: the test would not tell counts apart"
    merges = events(tmp_path, Merged)
    for p, offset in enumerate(fragment_offsets(P, H)):
        got = [e for e in merges if e.fragment == p]
        assert got and all(list(e.merged) == ids for e in got)
        for lid in ids:
            assert [e.tokens[lid] for e in got] == expected_tokens(step_tokens[lid], offset, H, tau, steps)
    assert not events(tmp_path, TokenUnits, Rejected, BadMessage)
    for lid, r in results.items():
        logged = [entry for entry in r["log_history"] if "rackmend/merges" in entry]
        assert logged and all("loss" in e or "train_runtime" in e for e in logged), "figures outside Trainer logs"
        applied = sum(1 for p, o in enumerate(fragment_offsets(P, H))
                      for t in range(1, steps + 1) if (t - o) % H == 0 and t + tau <= steps)
        assert sum(e["rackmend/merges"] for e in logged) == applied
        assert logged[-1]["rackmend/merges_total"] == applied
        assert all(e["rackmend/staleness"] == 0 for e in logged)
        assert sum(e["rackmend/tokens"] for e in logged) == sum(step_tokens[lid])
        assert r["end_loss"] < r["start_loss"], r  # it trained (few steps, decaying LR: no margin asked)


def test_transformers_stays_optional() -> None:
    """``import rackmend`` does not load transformers, and the Trainer module without
    transformers fails at import with what to install."""
    import subprocess

    probe = ("import sys; import rackmend, rackmend.compat.tsugi; assert 'transformers' not in sys.modules; "
             "sys.modules['transformers'] = None\n"
             "try:\n    import rackmend.learner.hf\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs the Hugging Face transformers package: pip install transformers" in out.stdout


def test_a_trainer_rack_and_an_accelerate_rack_of_two_ranks_merge_resume_each_ranks_state_and_leave(
        procs: Procs, tmp_path: Path) -> None:
    """Two racks of 2 DDP ranks each (torchrun, gloo) training one GPT-2: l0 a Hugging Face
    Trainer with ``attach_to_trainer``, l1 an accelerate loop through
    ``rackmend.learner.accel.prepare`` with its inner optimizer built before the model was
    prepared (before: both refused at step 1, accelerate having copied the model to cpu:0
    after rackmend took its views). In ``trainer_racks.StopResume`` each stops after step 7
    with its trainer's own checkpoint (the Trainer's checkpoint-7, ``accelerator.save_state``)
    and resumes from it to step 14. Every merge reports exactly the non-padding tokens both
    ranks' collators saw in its window, across the resume too; each rank resumes its own
    rackmend state (rank 1's file is altered between the runs and only rank 1 sees it);
    every rank ends holding the syncer's values of the version it holds; each run ends
    with a clean leave of both racks."""
    scenario = StopResume(procs, tmp_path)
    common = ["--endpoint", scenario.endpoint, "--learners", ",".join(IDS), "--steps", str(STEPS)]
    rack = {"l0": [*TORCHRUN, TRAINER[-1], "--id", "l0", *common, "--mode", "attach", "--save-every", str(STOP)],
            "l1": [*TORCHRUN, ACCELERATE, "--id", "l1", *common, "--folder", str(tmp_path / "state-l1")]}
    scenario.run("first", lambda lid: [*rack[lid], "--stop-at", str(STOP)])
    saved = scenario.mark(tmp_path / "trainer-l0" / f"checkpoint-{STOP}")
    assert sorted(p.name for p in (tmp_path / "state-l1").glob("rackmend-*")) == [
        "rackmend-rank0-of-2.pt", "rackmend-rank1-of-2.pt"]
    scenario.run("second", lambda lid: [*rack[lid], "--resume"])
    scenario.check(saved)
