"""TensorBoard scalars of one learner (``LearnerConfig.tensorboard_dir``).

``LearnerScalars`` writes, at each merged value the learner applies, what that
learner's outer loop did so far: merges applied, the merge's staleness (version lag),
seconds blocked on the syncer, bytes of outer gradients sent and bytes received from
the syncer, and the merge gain when a probe measures it. The x axis is the learner's
inner step. ``RackmendOptimizer`` builds it and hands it plain values (``Applied``) at
each apply; nothing here reads the optimizer, and nothing of the syncer's lives here (its
metrics: ``rackmend.service.metrics``).

``tensorboard`` is an optional dependency (``pip install tensorboard``, or the
``rackmend[tensorboard]`` extra): only a learner that sets ``tensorboard_dir`` imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rackmend.config import ConfigError

__all__ = ["Applied", "LearnerScalars", "TAGS", "FLUSH_SECS"]

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


@dataclass(frozen=True, kw_only=True)
class Applied:
    """Where a learner's outer loop stood right after it applied a merged value."""

    step: int
    """The learner's inner steps done (the x axis)."""
    staleness: int
    """Version lag of the value applied (``RackmendOptimizer.version_lags``)."""
    blocked_s: float
    """Seconds blocked on the syncer so far."""
    bytes_sent: int
    """Bytes of outer gradients (and DES-LOC moments) handed to the link so far."""
    bytes_received: int | None
    """Bytes received from the syncer so far; None for a link that does not count them."""
    merge_gain: float | None
    """The merge gain the probe measured for this value; None without a probe."""


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

    def applied(self, a: Applied) -> None:
        """After the learner applied a merged value."""
        self.merges_applied += 1
        add = self._writer.add_scalar
        add(TAGS["merges_applied"], self.merges_applied, a.step)
        add(TAGS["staleness"], a.staleness, a.step)
        add(TAGS["blocked_s"], a.blocked_s, a.step)
        add(TAGS["bytes_sent"], a.bytes_sent, a.step)
        if a.bytes_received is not None:
            add(TAGS["bytes_received"], a.bytes_received, a.step)
        if a.merge_gain is not None:
            add(TAGS["merge_gain"], a.merge_gain, a.step)

    def close(self) -> None:
        self._writer.close()
