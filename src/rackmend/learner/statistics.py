"""What a learner sends of its BatchNorm running statistics: the racks' own estimate,
without the pull of the last global value.

A BatchNorm layer in training keeps ``running = (1 - f) * running + f * batch_stat``
(``f`` the momentum, or ``1 / num_batches_tracked`` when the momentum is None). When a
merged value ``b0`` is set, the next ``n`` batches leave ``running = w * b0 + (1 - w) *
x`` with ``w`` the product of the ``(1 - f)`` (``(1 - m)^n``, or ``n0 / n_now``) and
``x`` the rack's own moving average of what it has seen since. With ``H < 1/m`` the
share ``w`` is large (0.43 at H=8, m=0.1), so sending ``running`` as it is counts the
global value again at every merge: the racks' means are pulled together and the
pooled variance loses most of the spread between racks (issue 33, item 10). Sent
instead is ``x = (running - w * b0) / (1 - w)``, the rack's own estimate.

Only modules of torch's BatchNorm/InstanceNorm family with running statistics are
corrected (their update rule is known); other floating buffers are sent as they are.
The learner's own buffers are never changed here. The driver calls ``mark`` after it
writes a fragment's values and ``sent`` when it snapshots one; no I/O, no clock.
Computed on the buffers' device without reading values back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from rackmend.core.fragments import FragmentSpec, canonical_name, unwrap_model

__all__ = ["RunningStats", "MIN_NEW_SHARE"]

MIN_NEW_SHARE = 1e-6
"""Below this share of new batches (``1 - w``) a buffer is sent as it is: no batch has
updated it since the last merged value (eval mode, a frozen layer), or its batch
count went back (a checkpoint loaded into the model)."""


@dataclass
class _Tracked:
    index: int
    """The buffer's place in its fragment's tensors."""
    module: _NormBase
    variance: bool
    """A ``running_var`` (kept non-negative), else a ``running_mean``."""


class RunningStats:
    """Per fragment, the BatchNorm buffers in it, their values and batch counts when the
    last merged value was written, and what to send in their place."""

    def __init__(self, model: nn.Module, fragments: Sequence[FragmentSpec]) -> None:
        modules = {canonical_name(n): m for n, m in unwrap_model(model).named_modules()}
        self._tracked: list[list[_Tracked]] = []
        for frag in fragments:
            tracked = []
            for i, spec in enumerate(frag.tensors):
                owner, _, leaf = spec.name.rpartition(".")
                module = modules.get(owner)
                if (spec.is_buffer and leaf in ("running_mean", "running_var") and isinstance(module, _NormBase)
                        and module.track_running_stats):
                    tracked.append(_Tracked(i, module, leaf == "running_var"))
            self._tracked.append(tracked)
        self._base: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(fragments)
        """Per fragment and tracked buffer: (its value, its module's batch count) at the
        last ``mark``; None before the first."""

    def __bool__(self) -> bool:
        return any(self._tracked)

    @torch.no_grad()
    def mark(self, fragment: int, pieces: Sequence[torch.Tensor]) -> None:
        """The fragment's values were just written (a merged value, a join, a rebase, a
        restored checkpoint): later batches are counted from here."""
        tracked = self._tracked[fragment]
        if tracked:
            self._base[fragment] = [(pieces[t.index].detach().clone(), _count(t.module).clone()) for t in tracked]

    @torch.no_grad()
    def sent(self, fragment: int, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The fragment's tensors as they are to be sent: ``pieces`` itself for parameters
        and untracked buffers, new tensors for tracked ones; None where nothing differs
        (no BatchNorm statistics in it, or no ``mark`` yet)."""
        base = self._base[fragment]
        if base is None:
            return None
        out = list(pieces)
        for t, (b0, n0) in zip(self._tracked[fragment], base):
            b = pieces[t.index]
            out[t.index] = own_estimate(b, b0.to(b.device), _share_of_base(t.module, n0), t.variance)
        return out


def _count(module: _NormBase) -> torch.Tensor:
    assert module.num_batches_tracked is not None  # track_running_stats
    return module.num_batches_tracked


def _share_of_base(module: _NormBase, n0: torch.Tensor) -> torch.Tensor:
    """``w``: the share of the value marked left in the running value (float64, 0-dim, on
    the batch count's device)."""
    n = _count(module).to(n0.device, torch.float64)
    n0 = n0.to(torch.float64)
    if module.momentum is None:  # cumulative average: running = (n0 * b0 + sum of new) / n
        return torch.where(n > 0, n0 / n.clamp_min(1), torch.ones_like(n))
    return torch.pow(1.0 - module.momentum, n - n0)


def own_estimate(running: torch.Tensor, base: torch.Tensor, share: torch.Tensor, variance: bool) -> torch.Tensor:
    """``(running - share * base) / (1 - share)`` in float64, in ``running``'s dtype;
    ``running`` itself (a copy) where ``1 - share`` is below ``MIN_NEW_SHARE``."""
    share = share.to(running.device)
    new = 1.0 - share
    x = (running.to(torch.float64) - share * base.to(torch.float64)) / new.clamp_min(MIN_NEW_SHARE)
    if variance:  # rounding can leave a variance a hair below zero
        x = x.clamp_min(0.0)
    return torch.where(new >= MIN_NEW_SHARE, x, running.to(torch.float64)).to(running.dtype)
