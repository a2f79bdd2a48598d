"""Hugging Face accelerate racks through ``rackmend.learner.accel``, with real torchrun
ranks (gloo) and a real ``rackmend syncer`` on 127.0.0.1; the misuses it names."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from procs import HERE, TORCHRUN, Procs, events, finish  # noqa: E402
from rackmend import ConfigError, InProcessSyncer, RackmendConfig, RackmendOptimizer, ScheduleConfig  # noqa: E402
from rackmend.core.fragments import fragment_offsets  # noqa: E402
from rackmend.core.records import Left, Merged, Rejected, TokenUnits  # noqa: E402
from rackstate import assert_held_equal_syncer  # noqa: E402
from test_huggingface import _expected_tokens  # noqa: E402

PROC = str(HERE / "_accelerate_proc.py")


def test_accelerate_racks_of_two_ranks_merge_resume_each_ranks_state_and_leave(procs: Procs, tmp_path: Path) -> None:
    """Two accelerate racks of 2 ranks each, the inner optimizer built before the model was
    prepared (before: refused at step 1 with 2 ranks, accelerate having copied the model to
    cpu:0). Each stops after step 7 with ``accelerator.save_state`` and resumes from it with
    ``load_state`` to step 14: every merge reports exactly the non-padding tokens both ranks
    passed to ``add_tokens`` in its window; each rank resumes its own rackmend state (rank
    1's file altered between the runs); every rank ends holding the syncer's values of the
    version it holds; both runs end with a clean leave of both racks."""
    from safetensors.torch import load_file

    ids, stop, steps, H, P, tau, world = ["l0", "l1"], 7, 14, 4, 2, 1, 2
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                                    "--overlap", str(tau), "--checkpoint-dir", str(ck))

    def run(name: str, *flags: str) -> None:
        racks = {lid: procs.start([*TORCHRUN, PROC, "--endpoint", endpoint, "--id", lid, "--learners", ",".join(ids),
                                   "--steps", str(steps), "--folder", str(tmp_path / f"state-{lid}"),
                                   "--held-out", str(tmp_path / f"{lid}-{name}.held"),
                                   "--out", str(tmp_path / f"{lid}-{name}.json"), *flags], f"{lid}-{name}")
                 for lid in ids}
        for lid, proc in racks.items():
            finish(proc, procs, f"{lid}-{name}", timeout=240)

    run("first", "--stop-at", str(stop))
    folder = tmp_path / "state-l0"
    saved = torch.load(folder / "rackmend-rank0-of-2.pt", weights_only=True)
    marked = torch.load(folder / "rackmend-rank1-of-2.pt", weights_only=True)
    assert (saved["rank"], marked["rank"], saved["step"]) == (0, 1, stop)
    marked["c_time"] = [123.25] * P  # only rank 1's own file says this (seconds: no effect on the merges)
    torch.save(marked, folder / "rackmend-rank1-of-2.pt")
    assert sorted(e.learner for e in events(tmp_path, Left)) == ids, "the first run did not leave cleanly"
    run("second", "--resume")
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0
    assert sorted(e.learner for e in events(tmp_path, Left)) == sorted(ids * 2), "the second run did not leave cleanly"

    result = {(lid, name, r): json.loads((tmp_path / f"{lid}-{name}.json.{r}").read_text())
              for lid in ids for name in ("first", "second") for r in range(world)}
    r0, r1 = result["l0", "second", 0]["resumed"], result["l0", "second", 1]["resumed"]
    assert r0["step"] == r1["step"] == stop
    assert r1["c_time"] == [123.25] * P and r0["c_time"] == pytest.approx(saved["c_time"]), (r0, r1)
    merges = events(tmp_path, Merged)
    for lid in ids:
        assert all(result[lid, "second", r]["step"] == steps for r in range(world))
        step_tokens = [sum(t) for t in zip(*(result[lid, "first", r]["collated"][:stop]
                                             + result[lid, "second", r]["collated"][:steps - stop]
                                             for r in range(world)))]
        assert len(step_tokens) == steps and len(set(step_tokens)) > 1
        for p, offset in enumerate(fragment_offsets(P, H)):
            got = [e.tokens[lid] for e in merges if e.fragment == p]
            assert got == _expected_tokens(step_tokens, offset, H, tau, steps), (lid, p, got, step_tokens)
    assert not events(tmp_path, TokenUnits, Rejected)
    checkpoint = load_file(str(ck / "syncer.safetensors"))
    for lid in ids:
        assert_held_equal_syncer([f"{tmp_path}/{lid}-second.held.{r}" for r in range(world)], checkpoint)


def _config() -> RackmendConfig:
    return RackmendConfig(schedule=ScheduleConfig(sync_every=4, num_fragments=1))


def test_accelerate_misuses_are_named() -> None:
    """``accel.prepare`` given an optimizer it must build itself is refused with the fix;
    a RackmendOptimizer built by hand on a model that ``prepare`` then changes (here cast
    to float64 before prepare) is refused at its first step naming accelerate and the order
    that works; ``add_tokens`` after ``step(tokens=)``'s worth is a clear error."""
    import accelerate

    from rackmend.learner import accel

    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    with InProcessSyncer.for_model(_config(), torch.nn.Linear(4, 1)) as hub:
        inner = torch.optim.AdamW(model.parameters())
        opt = RackmendOptimizer(model, inner, _config(), hub.connect(), learner_id="l0")
        with pytest.raises(ConfigError, match="takes the inner optimizer .* not a RackmendOptimizer"):
            accel.prepare(acc, model, opt, _config(), hub.connect(), learner_id="l1")
        model.double()
        prepared, wrapped = acc.prepare(model, opt)
        prepared(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        with pytest.raises(ConfigError, match=r"dtype torch\.float32 -> torch\.float64.*this step runs under "
                                              r"accelerate .*rackmend\.learner\.accel\.prepare"):
            wrapped.step()
        opt.close()
        with pytest.raises(RuntimeError, match="was closed"):
            opt.step()
        model = torch.nn.Linear(4, 1)
        opt = RackmendOptimizer(model, torch.optim.AdamW(model.parameters()), _config(), hub.connect(),
                                learner_id="l2")
        model(torch.randn(2, 4)).sum().backward()
        opt.add_tokens(3)
        with pytest.raises(ValueError, match=r"step\(tokens=2\) after add_tokens\(3\.0\)"):
            opt.step(tokens=2)
        opt.close()
