"""The typed, versioned syncer checkpoint (issue 35, item 4): ``CheckpointMeta`` reads
every format (a checkpoint written by the code at a562e0f, format 1, is kept in
tests/data/checkpoint-a562e0f with the script that wrote it), writes the current one,
and ``open_checkpoint`` is what resume and export read with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rackmend.config import CompressionConfig, RackmendConfig, RunConfig, ScheduleConfig, SyncerConfig
from rackmend.core.checkpoint_meta import CHECKPOINT_FORMAT, CheckpointMeta
from rackmend.service.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint, open_checkpoint
from rackmend.service.events import Resumed
from rackmend.service.export import export_model

from service_rig import Rig

FIXTURE = Path(__file__).parent / "data" / "checkpoint-a562e0f"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
DOWN = CompressionConfig(downlink="int8")
LEARNERS_CONFIG = RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=2, overlap=1), compression=DOWN,
                                 syncer=SyncerConfig(min_quorum=1, grace_max=0.05))
"""The run that wrote the fixture (expected.json's config)."""


def _copy(tmp_path: Path) -> Path:
    directory = tmp_path / "ck"
    directory.mkdir()
    shutil.copy(FIXTURE / CHECKPOINT_NAME, directory / CHECKPOINT_NAME)
    return directory


def test_a_format_1_checkpoint_is_upgraded_on_read(tmp_path: Path) -> None:
    with open_checkpoint(FIXTURE / CHECKPOINT_NAME) as (meta, f):
        raw = json.loads(f.metadata()["rackmend"])
    assert "format" not in raw and "norm_learners" not in raw and "session_floors" not in raw  # what a562e0f wrote
    assert meta.format == 1 and meta.versions == EXPECTED["versions"] and meta.merges == EXPECTED["merges"]
    for entry, norms in zip(meta.fragments, raw["norms"]):
        assert entry["norms"] == norms and entry["norm_learners"] == [""] * len(norms)
        assert entry["scale_history"] == []
    assert meta.session_floors == [] and meta.first_learner is not None
    again = CheckpointMeta.from_json(json.loads(json.dumps(meta.to_json())))
    assert again.format == CHECKPOINT_FORMAT and again.to_json() == meta.to_json()


def test_the_a562e0f_checkpoint_resumes_and_exports_its_values(tmp_path: Path) -> None:
    directory = _copy(tmp_path)
    rig = Rig(LEARNERS_CONFIG, syncer=RunConfig(compression=DOWN, syncer=LEARNERS_CONFIG.syncer),
              checkpoint_dir=str(directory), resume=True)
    (resumed,) = rig.of(Resumed)
    assert list(resumed.versions) == EXPECTED["versions"]
    core = rig.node.core
    assert core is not None and core.versions == EXPECTED["versions"]
    for p, frag in enumerate(core.frags):
        for i, t in enumerate(frag.theta):
            assert float(t.double().sum()) == pytest.approx(EXPECTED["theta_sums"][f"theta/{p}/{i}"], abs=1e-5)
    assert core.downlink is not None and len(core.downlink.feedback) == 9  # the residuals came back
    learner = rig.learner("l0")
    learner.join(learner.token)
    assert learner.versions == dict(enumerate(EXPECTED["versions"]))
    out = export_model(directory, tmp_path / "model.safetensors")
    assert out.versions == EXPECTED["versions"]
    # The service writes the current format over it, and reads that back the same.
    rig.node.checkpoints.save(core, layout=rig.node._layout, merges=rig.node.merges,
                              rejected_messages=rig.node.rejected_messages, first=rig.node._first)
    loaded = load_checkpoint(directory)
    assert loaded is not None and loaded.meta.format == CHECKPOINT_FORMAT
    assert loaded.meta.versions == EXPECTED["versions"] and loaded.meta.merges == EXPECTED["merges"]
    assert all(torch.equal(loaded.tensors[k], v) for k, v in core.state_dict()[0].items() if k.startswith("theta/"))


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(format=99), "'format' is 99: this rackmend reads checkpoint formats 1 to"),
    (lambda m: m.update(norms=[[1.0]]), "'norms' must list one entry per fragment"),
    (lambda m: m.update(shard=3), "'shard' is a int, not a str"),
    (lambda m: m.pop("optim"), "'optim' is missing"),
])
def test_a_meta_that_cannot_be_used_is_refused_naming_the_field(change, message: str, tmp_path: Path) -> None:
    with safe_open(str(FIXTURE / CHECKPOINT_NAME), framework="pt") as f:
        raw = json.loads(f.metadata()["rackmend"])
    change(raw)
    with pytest.raises(ValueError, match=message):
        CheckpointMeta.from_json(raw)
    from safetensors.torch import load_file, save_file
    path = tmp_path / CHECKPOINT_NAME
    save_file(load_file(str(FIXTURE / CHECKPOINT_NAME)), str(path), metadata={"rackmend": json.dumps(raw)})
    with pytest.raises(CheckpointError, match=rf"{path}: .*{message[:20]}"):
        with open_checkpoint(path):
            pass


def test_a_rule_less_checkpoint_that_fails_to_restore_is_kept_and_the_learner_told(tmp_path: Path) -> None:
    """A checkpoint without the run's rules is restored at the first hello; when that
    fails (here: its outer optimizer state has no parameter group), the learner gets a
    fatal error naming it, and the syncer neither seeds a fresh model over the
    checkpoint nor forgets it."""
    from safetensors.torch import load_file, save_file

    from rackmend.transport import wire

    directory = tmp_path / "ck"
    directory.mkdir()
    with safe_open(str(FIXTURE / CHECKPOINT_NAME), framework="pt") as f:
        raw = json.loads(f.metadata()["rackmend"])
    raw.pop("first_learner")
    raw["optim"][0]["param_groups"] = []
    save_file(load_file(str(FIXTURE / CHECKPOINT_NAME)), str(directory / CHECKPOINT_NAME),
              metadata={"rackmend": json.dumps(raw)})
    rig = Rig(LEARNERS_CONFIG, syncer=RunConfig(compression=DOWN, syncer=LEARNERS_CONFIG.syncer),
              checkpoint_dir=str(directory), resume=True)
    for lid in ("l0", "l1"):
        replies = rig.learner(lid).hello()
        errors = [m for m in replies if isinstance(m, wire.ErrorIn)]
        assert errors and errors[0].code == "fatal" and "parameter group" in errors[0].reason, replies
        assert not any(isinstance(m, wire.InitRequestIn) for m in replies), "seeded anew over the checkpoint"
        assert rig.node.core is None
    assert not rig.of(Resumed)
