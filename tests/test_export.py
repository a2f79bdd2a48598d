"""``rackmend export``: a real training's syncer checkpoint becomes a model file that
loads strictly into a fresh model and computes what the syncer's Θ computes; models
with ties, frozen layers and integer buffers are filled (``--model``), and a missing or
corrupt checkpoint is refused with a clear message."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

from rackmend import (
    ExportError,
    RackmendConfig,
    RackmendOptimizer,
    ScheduleConfig,
    SyncerConfig,
    export_model,
)
from rackmend.cli import main as cli_main
from rackmend.core.fragments import pack_fragments
from rackmend.core.records import Merged
from rackmend.transport.zmq_link import ZmqLink

from _export_model import make_tied_model, tied_batch
from helpers import batch, make_inner, make_model, run_threads, serving
from procs import Procs, events, finish

EXPORT = [sys.executable, "-m", "rackmend.cli", "export"]


def run_export(*args: str) -> subprocess.CompletedProcess:
    """``rackmend export ARGS``, the command's own code run in this process (a Python
    start-up per call cost seconds; ``--model`` modules import from this folder, on the
    path already): its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli_main(["export", *args])
        except SystemExit as exc:  # argparse's refusals
            rc = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess([*EXPORT, *args], rc, out.getvalue(), err.getvalue())


def test_export_of_a_real_training_loads_strictly_and_computes_the_syncers_theta(procs: Procs,
                                                                                 tmp_path: Path) -> None:
    ids, H, P, steps = ["l0", "l1"], 3, 2, 12
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                                    "--overlap", "1", "--checkpoint-dir", str(ck))
    learners = {lid: procs.learner(endpoint, lid, "--steps", str(steps), "--H", str(H), "--P", str(P), "--tau", "1",
                                   "--deterministic", "--learners", ",".join(ids)) for lid in ids}
    for lid, proc in learners.items():
        finish(proc, procs, lid, timeout=120)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0

    out = tmp_path / "model.safetensors"
    done = run_export(str(ck), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "synchronised tensors" in done.stdout

    fresh = make_model(seed=7)
    fresh.load_state_dict(load_file(str(out)), strict=True)
    # Θ placed by a layout computed here from the model, not by the names the export wrote.
    theta = load_file(str(ck / "syncer.safetensors"))
    reference = make_model(seed=7)
    named = dict(reference.named_parameters())
    moved = 0
    with torch.no_grad():
        for frag in pack_fragments(make_model(), P, H):
            for i, name in enumerate(frag.names):
                named[name].copy_(theta[f"theta/{frag.index}/{i}"])
                assert torch.equal(dict(fresh.named_parameters())[name], theta[f"theta/{frag.index}/{i}"]), name
                moved += not torch.equal(theta[f"theta/{frag.index}/{i}"], dict(make_model().named_parameters())[name])
    assert moved, "vacuous: training did not change the global model"
    x, y, _ = batch("l0", 99)
    assert torch.equal(fresh(x, y), reference(x, y))

    merges = events(tmp_path, Merged)
    last = [max(e.version for e in merges if e.fragment == p) for p in range(P)]
    with safe_open(str(out), framework="pt") as f:
        import json
        provenance = json.loads(f.metadata()["rackmend"])
    assert provenance["versions"] == last and provenance["merges"] == len(merges)


def _train_tied(tmp_path: Path) -> tuple[Path, dict[str, torch.nn.Module]]:
    """Two learners of TiedLM through a real syncer service; its checkpoint directory."""
    H = 2
    config = RackmendConfig(schedule=ScheduleConfig(sync_every=H, num_fragments=2, overlap=1),
                            syncer=SyncerConfig(min_quorum=2, learners=("l0", "l1")), deterministic=True)
    svc, _, server = serving(config, checkpoint_dir=str(tmp_path / "ck"))
    models = {lid: make_tied_model() for lid in ("l0", "l1")}

    def learner(lid: str) -> None:
        model = models[lid]
        opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(svc.endpoint, leave_timeout_s=1.0),
                                learner_id=lid)
        try:
            for t in range(1, 3 * H + 1):
                x, y, tokens = tied_batch(lid, t)
                loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step(tokens=tokens)
        finally:
            opt.close()

    try:
        run_threads(learner, [("l0",), ("l1",)], timeout=90)
    finally:
        svc.stop()
        server.join(20)
    return tmp_path / "ck", models


def test_tied_frozen_and_integer_entries_are_named_missing_then_filled_with_model(tmp_path: Path) -> None:
    ck, models = _train_tied(tmp_path)
    theta_names = {"emb.weight", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var",
                   "mix.weight", "mix.bias"}

    plain = tmp_path / "plain.safetensors"
    done = run_export(str(ck), "--out", str(plain))
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout and "strict=False" in done.stdout, "the note on strict loading is missing"
    assert set(load_file(str(plain))) == theta_names
    with pytest.raises(RuntimeError) as missing:
        make_tied_model().load_state_dict(load_file(str(plain)), strict=True)
    for key in ("head.weight", "frozen.weight", "frozen.bias"):
        assert key in str(missing.value)
    # (BatchNorm forgives a missing num_batches_tracked itself, setting it to 0.)

    # --model: the tie is seen, the rest filled from the built model and listed.
    full = tmp_path / "full.safetensors"
    done = run_export(str(ck), "--out", str(full), "--model", "_export_model:make_tied_model")
    assert done.returncode == 0, done.stderr
    assert "head.weight: tied to emb.weight" in done.stdout
    assert "norm.num_batches_tracked: int64 buffer" in done.stdout and "frozen.weight: frozen parameter" in done.stdout
    fresh = make_tied_model()
    fresh.load_state_dict(load_file(str(full)), strict=True)
    exported = load_file(str(plain))
    for name in theta_names:
        assert torch.equal(fresh.state_dict()[name], exported[name]), name
    assert torch.equal(fresh.head.weight, exported["emb.weight"])
    assert not torch.equal(exported["emb.weight"], make_tied_model().emb.weight), "vacuous: nothing trained"
    assert int(fresh.norm.num_batches_tracked) == 0  # the built model's: each rack counts its own
    assert torch.equal(fresh.frozen.weight, make_tied_model().frozen.weight)

    # --base (a learner's saved state): the unsynchronised entries come from it instead.
    learner_state = tmp_path / "l0.safetensors"
    save_model(models["l0"], str(learner_state))  # drops the tied duplicate, as safetensors does
    result = export_model(ck, tmp_path / "based.safetensors", model=make_tied_model(), base=learner_state)
    based = load_file(str(result.path))
    assert int(based["norm.num_batches_tracked"]) == int(models["l0"].norm.num_batches_tracked) == 6
    assert result.aliases == {"head.weight": "emb.weight"}
    assert set(result.filled) == {"frozen.weight", "frozen.bias", "norm.num_batches_tracked"}
    assert all(str(learner_state) in why for why in result.filled.values())
    make_tied_model().load_state_dict(based, strict=True)


def test_missing_and_corrupt_checkpoints_fail_with_a_clear_message(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_export(str(empty), "--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 2 and "holds no syncer.safetensors" in done.stderr, done.stderr
    assert not (tmp_path / "m.safetensors").exists()

    ck, _ = _train_tied(tmp_path)
    data = (ck / "syncer.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    done = run_export(str(cut), "--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 2 and "corrupt" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

    foreign = tmp_path / "foreign.safetensors"
    save_model(make_model(), str(foreign))
    with pytest.raises(ExportError, match="not a rackmend syncer checkpoint"):
        export_model(foreign, tmp_path / "m.safetensors")
    with pytest.raises(ExportError, match="a different model"):
        export_model(ck, tmp_path / "m.safetensors", model=make_model())
    assert not (tmp_path / "m.safetensors").exists()
