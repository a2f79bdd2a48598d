"""Hugging Face accelerate through ``rackmend.learner.accel``: the misuses it names. Racks
of 2 ranks with a real syncer, stopped and resumed: test_huggingface.py's
``test_a_trainer_rack_and_an_accelerate_rack_of_two_ranks_merge_resume_each_ranks_state_and_leave``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from rackmend import ConfigError, InProcessSyncer, RackmendConfig, RackmendOptimizer, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.integration  # a third-party trainer stack (pyproject.toml markers)


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
