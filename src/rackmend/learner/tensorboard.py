"""TensorBoard scalars of one learner (``LearnerConfig.tensorboard_dir``).

``LearnerScalars`` writes, at each merged value the learner applies, what that
learner's outer loop did so far: merges applied, the merge's staleness (version lag),
seconds blocked on the syncer, bytes of outer gradients sent and bytes received from
the syncer, and the merge gain when a probe measures it. The x axis is the learner's
inner step. ``RackmendOptimizer`` builds it and calls it; the optimizer's logic does not
live here, nor does anything of the syncer's (its metrics: ``rackmend.service.metrics``).

``tensorboard`` is an optional dependency (``pip install tensorboard``, or the
``rackmend[tensorboard]`` extra): only a learner that sets ``tensorboard_dir`` imports it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rackmend.config import ConfigError

if TYPE_CHECKING:
    from rackmend.learner.optimizer import RackmendOptimizer

__all__ = ["LearnerScalars", "TAGS", "FLUSH_SECS"]

TAGS = {
    "merges_applied": "rackmend/merges_applied",
    "staleness": "rackmend/staleness",
    "blocked_s": "rackmend/blocked_s",
    "bytes_sent": "rackmend/bytes_sent",
    "bytes_received": "rackmend/bytes_received",
    "merge_gain": "rackmend/merge_gain",
}
"""Scalar tags written (docs/operations.md says what each means)."""

FLUSH_SECS = 10
"""Seconds between writes of the event file to disk (``close`` writes the rest)."""


class LearnerScalars:
    """One learner process's TensorBoard event file; see the module docstring."""

    def __init__(self, log_dir: str, rank: int = 0, world_size: int = 1) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises this when the tensorboard package is missing
            raise ConfigError(
                f"LearnerConfig.tensorboard_dir={log_dir!r} needs the tensorboard package, which cannot be "
                f"imported ({exc}): pip install tensorboard (or rackmend[tensorboard]), or leave "
                "tensorboard_dir unset") from None
        # Ranks of one learner apply the same merges but send different fragments: one run each.
        self.log_dir = log_dir if world_size == 1 else os.path.join(log_dir, f"rank{rank}")
        self._writer: Any = SummaryWriter(self.log_dir, flush_secs=FLUSH_SECS)
        self.merges_applied = 0

    def applied(self, opt: "RackmendOptimizer", p: int) -> None:
        """After ``opt`` applied a merged value of fragment ``p``."""
        self.merges_applied += 1
        step = opt.step_count
        add = self._writer.add_scalar
        add(TAGS["merges_applied"], self.merges_applied, step)
        add(TAGS["staleness"], opt.version_lags[p], step)
        add(TAGS["blocked_s"], opt.blocked_seconds, step)
        add(TAGS["bytes_sent"], opt.bytes_sent, step)
        received = getattr(opt.link, "bytes_received", None)  # links that do not count have none
        if received is not None:
            add(TAGS["bytes_received"], received, step)
        gain = opt.merge_gains[p]
        if gain is not None:
            add(TAGS["merge_gain"], gain, step)

    def close(self) -> None:
        self._writer.close()
