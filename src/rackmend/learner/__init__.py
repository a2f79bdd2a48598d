"""Learner integration: the optimizer wrapper that runs rackmend inside a training loop,
and ``enable_async_tp`` for a rack's tensor-parallel dimension. The trainer integrations
(``hf``, ``accel``, ``lightning``, ``titan``) are imported by name, each only where its
trainer is installed."""

from rackmend.learner.async_tp import AsyncTPUnavailable, enable_async_tp
from rackmend.learner.optimizer import RackmendOptimizer

__all__ = ["AsyncTPUnavailable", "RackmendOptimizer", "enable_async_tp"]
