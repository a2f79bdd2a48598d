"""Hugging Face accelerate racks through ``rackmend.learner.accel``, with real torchrun
ranks (gloo) and a real ``rackmend syncer`` on 127.0.0.1; the misuses it names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from procs import HERE, TORCHRUN, Procs  # noqa: E402
from rackmend import ConfigError, InProcessSyncer, RackmendConfig, RackmendOptimizer, ScheduleConfig  # noqa: E402
from trainer_racks import IDS, STEPS, STOP, StopResume  # noqa: E402

PROC = str(HERE / "_accelerate_proc.py")


def test_accelerate_racks_of_two_ranks_merge_resume_each_ranks_state_and_leave(procs: Procs, tmp_path: Path) -> None:
    """Two accelerate racks of 2 ranks each, the inner optimizer built before the model was
    prepared (before: refused at step 1 with 2 ranks, accelerate having copied the model to
    cpu:0), in ``trainer_racks.StopResume``: stopped after step 7 with
    ``accelerator.save_state`` and resumed with ``load_state`` to step 14. Every merge
    reports exactly the non-padding tokens both ranks passed to ``add_tokens`` in its
    window; each rank resumes its own rackmend state (rank 1's file altered between the
    runs); every rank ends holding the syncer's values of the version it holds; both runs
    end with a clean leave of both racks."""
    scenario = StopResume(procs, tmp_path)
    command = lambda lid: [*TORCHRUN, PROC, "--endpoint", scenario.endpoint, "--id", lid,  # noqa: E731
                           "--learners", ",".join(IDS), "--steps", str(STEPS),
                           "--folder", str(tmp_path / f"state-{lid}")]
    scenario.run("first", lambda lid: [*command(lid), "--stop-at", str(STOP)])
    saved = scenario.mark(tmp_path / "state-l0")
    scenario.run("second", lambda lid: [*command(lid), "--resume"])
    scenario.check(saved)


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
