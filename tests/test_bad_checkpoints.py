"""A bad syncer checkpoint is never served nor exported: one NaN in a fragment, versions
beyond the wire's integers, a guard scale that is not positive, a truncated or empty
file. ``rackmend export`` refuses it naming the file and the field; ``--resume`` falls
back to the previous checkpoint where it is good, and otherwise refuses to start with a
message naming both (exit 2, no traceback). Checkpoints are written by a real service
and spoilt on disk as a crash, a full disk or a bad edit would."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rackmend.config import ConfigError, RunConfig
from rackmend.service.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME, CheckpointError, load_checkpoint
from rackmend.service.events import Resumed, read_log
from rackmend.service.export import ExportError, export_model
from rackmend.service.config import ServiceConfig
from rackmend.service.syncer import SyncerService

from helpers import serving
from procs import of
from test_trust import CONFIG, Raw


def _checkpointed_run(directory: Path, *, resume: bool = False,
                      inspect: Callable[[SyncerService], None] = lambda svc: None) -> list:
    """A service seeded by one learner (or resumed), stopped: it writes a checkpoint.
    Its log's records. ``inspect`` sees the service after the learner's hello."""
    log = directory.parent / f"{directory.name}.jsonl"
    log.unlink(missing_ok=True)
    # What `rackmend syncer` builds: the syncer's own settings, no schedule.
    syncer = RunConfig(syncer=CONFIG.syncer, compression=CONFIG.compression, deterministic=CONFIG.deterministic)
    svc, _, thread = serving(syncer, checkpoint_dir=str(directory), resume=resume, log_path=str(log))
    raw = Raw(svc.endpoint, "l0")
    try:
        raw.hello()
        inspect(svc)
    finally:
        raw.close()
        svc.stop()
        thread.join(20)
    return read_log(log)


def _spoil(path: Path, tensors: Callable[[dict], None] = lambda t: None,
           meta: Callable[[dict], None] = lambda m: None) -> None:
    with safe_open(str(path), framework="pt") as f:
        m = json.loads(f.metadata()["rackmend"])
    t = load_file(str(path))
    tensors(t)
    meta(m)
    save_file(t, str(path), metadata={"rackmend": json.dumps(m)})


def _nan_in_theta(t: dict) -> None:
    name = next(k for k in sorted(t) if k.startswith("theta/"))
    t[name].view(-1)[0] = float("nan")


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        m[key] = value if not callable(value) else value(m[key])
    return change


SPOILT: dict[str, tuple[Callable[[Path], None], str]] = {
    "nan": (lambda p: _spoil(p, tensors=_nan_in_theta), r"tensor '[\w./]+' holds 1 NaN"),
    "huge version": (lambda p: _spoil(p, meta=_set("versions", lambda v: [2**70] * len(v))),
                     r"'versions.0' is 1180591620717411303424, beyond the wire's 64-bit integers"),
    "negative version": (lambda p: _spoil(p, meta=_set("versions", lambda v: [-3] * len(v))),
                         r"'versions'\[0\] is -3, not a count"),
    "guard scale": (lambda p: _spoil(p, meta=_set("norm_scale", lambda v: [-1.0] * len(v))),
                    r"'norm_scale'\[0\] is -1.0"),
    "no versions": (lambda p: _spoil(p, meta=lambda m: m.pop("versions")), r"'versions' is missing"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), "cannot be read as safetensors"),
    "empty": (lambda p: p.write_bytes(b""), "cannot be read as safetensors"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a latest and a previous checkpoint, both good."""
    directory = tmp_path_factory.mktemp("good") / "ck"
    _checkpointed_run(directory)
    _checkpointed_run(directory, resume=True)
    assert (directory / CHECKPOINT_NAME).exists() and (directory / PREVIOUS_NAME).exists()
    return directory


def _copy(good: Path, to: Path, *, previous: bool = True) -> Path:
    to.mkdir()
    for name in (CHECKPOINT_NAME, PREVIOUS_NAME) if previous else (CHECKPOINT_NAME,):
        (to / name).write_bytes((good / name).read_bytes())
    return to


@pytest.mark.parametrize("spoil", list(SPOILT))
def test_a_bad_checkpoint_is_refused_by_export_and_by_resume_naming_the_field(good: Path, tmp_path: Path,
                                                                                spoil: str) -> None:
    directory = _copy(good, tmp_path / "ck", previous=False)
    damage, says = SPOILT[spoil]
    damage(directory / CHECKPOINT_NAME)
    if spoil not in ("truncated", "empty"):  # export reads the file its own way; both are checked below
        with pytest.raises(ExportError, match=says):
            export_model(directory, tmp_path / "model.safetensors")
        assert not (tmp_path / "model.safetensors").exists()
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(directory)
    with pytest.raises(ConfigError, match=rf"resume: .*{CHECKPOINT_NAME}.*{says}.*No good checkpoint is left"):
        SyncerService(CONFIG, ServiceConfig(bind="tcp://127.0.0.1:0", checkpoint_dir=str(directory), resume=True))


@pytest.mark.parametrize("spoil", ["nan", "huge version", "truncated"])
def test_resume_falls_back_to_the_previous_checkpoint_when_the_latest_is_bad(
        good: Path, tmp_path: Path, spoil: str, caplog: pytest.LogCaptureFixture) -> None:
    directory = _copy(good, tmp_path / "ck")
    SPOILT[spoil][0](directory / CHECKPOINT_NAME)
    with safe_open(str(directory / PREVIOUS_NAME), framework="pt") as f:
        versions = json.loads(f.metadata()["rackmend"])["versions"]
    with caplog.at_level(logging.WARNING, logger="rackmend.syncer"):
        records = _checkpointed_run(directory, resume=True)
    (resumed,) = of(records, Resumed)
    assert list(resumed.versions) == versions
    assert any(SPOILT[spoil][1].split(r"\[")[0].strip("'") in r.getMessage() or "safetensors" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert any(f"using the previous checkpoint {directory / PREVIOUS_NAME}" in r.getMessage() for r in caplog.records)
    # The learner that joined the resumed run was served finite values: its checkpoint is good again.
    tensors = load_checkpoint(directory).tensors  # type: ignore[union-attr]
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def test_a_checkpoint_without_the_runs_rules_resumes_under_the_first_hellos(good: Path, tmp_path: Path) -> None:
    """Checkpoints written before hellos carried H, P and tau have no ``first_learner``:
    the syncer makes none up but restores the checkpoint when the first learner says
    hello, under that learner's rules, and the next checkpoint records them."""
    directory = _copy(good, tmp_path / "ck", previous=False)
    _spoil(directory / CHECKPOINT_NAME, meta=lambda m: m.pop("first_learner"))
    with safe_open(str(directory / CHECKPOINT_NAME), framework="pt") as f:
        versions = json.loads(f.metadata()["rackmend"])["versions"]
    sch = CONFIG.schedule
    seen = []

    def rules(svc: SyncerService) -> None:
        core = svc.node.core
        assert core is not None
        seen.append((core.config.schedule.sync_every, core.config.schedule.num_fragments))

    records = _checkpointed_run(directory, resume=True, inspect=rules)
    assert seen == [(sch.sync_every, sch.num_fragments)]
    (resumed,) = of(records, Resumed)
    assert list(resumed.versions) == versions
    first = load_checkpoint(directory).meta.first_learner  # type: ignore[union-attr]
    assert first is not None and first["learner"] == "l0"
    settings = first["settings"]
    assert (settings["sync_every"], settings["num_fragments"], settings["overlap"]) == (
        sch.sync_every, sch.num_fragments, sch.overlap)


def test_the_commands_refuse_a_bad_checkpoint_with_exit_2_and_no_traceback(good: Path, tmp_path: Path) -> None:
    directory = _copy(good, tmp_path / "ck", previous=False)
    _spoil(directory / CHECKPOINT_NAME, tensors=_nan_in_theta)
    export = subprocess.run([sys.executable, "-m", "rackmend.cli", "export", str(directory), "--out",
                             str(tmp_path / "m.safetensors")], capture_output=True, text=True, timeout=120)
    assert export.returncode == 2 and "NaN" in export.stderr and "Traceback" not in export.stderr, export.stderr
    for damage in ("huge version", "empty"):
        (directory / CHECKPOINT_NAME).write_bytes((good / CHECKPOINT_NAME).read_bytes())
        SPOILT[damage][0](directory / CHECKPOINT_NAME)
        syncer = subprocess.run([sys.executable, "-m", "rackmend.cli", "syncer", "--bind", "tcp://127.0.0.1:0",
                                 "--checkpoint-dir", str(directory), "--resume"],
                                capture_output=True, text=True, timeout=120)
        assert syncer.returncode == 2, (damage, syncer.returncode, syncer.stderr[-2000:])
        assert "Traceback" not in syncer.stderr and str(directory) in syncer.stderr, syncer.stderr[-2000:]
