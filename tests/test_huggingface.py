"""Hugging Face models and the ``Trainer`` through rackmend, with real processes and a
real ``rackmend syncer`` on 127.0.0.1 (skipped when ``transformers`` is absent)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from procs import HERE, Procs, events, finish  # noqa: E402

TRAINER = [sys.executable, str(HERE / "_trainer_proc.py")]
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
    merges = [e for e in events(tmp_path) if e["event"] == "merge"]
    assert {e["fragment"] for e in merges} == {0, 1} and len(merges) >= 2 * (steps // 4 - 1)
    for e in merges:
        assert e["merged"] == ids
        for lid in ids:
            k = e["tokens"][lid] / TOKENS_PER_STEP
            assert k == int(k) and 1 <= k <= 4, f"{lid} reported {e['tokens'][lid]} tokens"
        assert all(abs(w - 0.5) < 0.2 for w in e["weights"].values()), e["weights"]
    assert not [e for e in events(tmp_path) if e["event"] in ("token_units", "reject", "bad_message")]
    for lid in ids:
        result = json.loads((tmp_path / f"{lid}.json").read_text())
        assert result["step"] == steps and min(result["versions"]) >= steps // 4 - 1
        assert result["lr"] == pytest.approx(3e-3 * 0.95**steps), "the scheduler did not drive the inner optimizer"
        assert any("loss" in entry for entry in result["log_history"])
        assert result["end_loss"] < result["start_loss"] - 0.3, result
