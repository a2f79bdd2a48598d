"""Learner integration: the optimizer wrapper that runs rackmend inside a training loop."""

from rackmend.learner.optimizer import RackmendOptimizer

__all__ = ["RackmendOptimizer"]
