"""The learner integration: an optimizer wrapper that adds Decoupled DiLoCo to any loop.

``RackmendOptimizer(model, inner, config, link, learner_id=...)`` behaves like the
inner optimizer (``step``, ``zero_grad``, ``param_groups``, ``state_dict``). After
each inner step it counts steps and tokens per fragment, sends the fragments that
are due (outer gradient = global value held - local value, computed on a host
snapshot), and applies merged values that came back by the configured rule. It
blocks only when joining and, in deterministic mode, at t_send + tau. A merged
value is applied only at t_send + tau of this learner's own send (or the first step
after it arrives, if later), never in between.

The transport is whatever ``LearnerLink`` is passed in; nothing here knows sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rackmend.config import RackmendConfig
from rackmend.core.fragments import FragmentSpec, fragments_due, pack_fragments
from rackmend.core.messages import Contribution, Update
from rackmend.transport.base import LearnerLink, TransportError

__all__ = ["RackmendOptimizer"]


@dataclass
class _Pending:
    """A fragment sent and not yet answered."""

    t_send: int
    snapshot: list[torch.Tensor] | None  # host copy at send time, kept for keep_local
    counts_at_send: tuple[int, float, float]


class RackmendOptimizer(torch.optim.Optimizer):
    """Wrap ``inner`` (e.g. AdamW over ``model``) with rackmend's outer loop.

    Call ``step(tokens=n)`` where you would call ``inner.step()``; ``tokens`` is the
    number of tokens (or samples) trained on in this step and defaults to 1, so
    weights then follow step counts. On construction the learner joins through
    ``link`` and loads the syncer's current parameters into ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        config: RackmendConfig,
        link: LearnerLink,
        *,
        learner_id: str,
        fragments: list[FragmentSpec] | None = None,
    ) -> None:
        # Deliberately no super().__init__: param_groups and state are the inner
        # optimizer's, exactly as torch's PostLocalSGDOptimizer does it.
        self.inner = inner
        self.model = model
        self.config = config
        self.link = link
        self.learner_id = learner_id
        sch = config.schedule
        self.fragments = fragments or pack_fragments(model, sch.num_fragments, sch.sync_every, sch.packing)
        named = dict(model.named_parameters())
        self._params: list[list[torch.Tensor]] = [
            [named[name] for name in spec.names] for spec in self.fragments
        ]
        n = len(self.fragments)
        self.step_count = 0
        self.versions = [0] * n
        self.held: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.c_steps = [0] * n
        self.c_tokens = [0.0] * n
        self.c_time = [0.0] * n
        self._pending: dict[int, _Pending] = {}
        self._arrived: dict[int, Update] = {}
        self._last_step_end: float | None = None
        self.blocked_seconds = 0.0
        """Wall time spent blocked on the syncer (join excluded)."""
        self.bytes_sent = 0
        self._copy_stream: Any = None  # torch.cuda.Stream for snapshots, made on first CUDA send
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self.on_apply: Callable[[int, Update], None] | None = None
        """Optional hook called after a merged value is applied (fragment, update)."""
        self._join()

    # ---------------------------------------------------------- optimizer contract
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None, tokens: float = 1) -> Any:  # type: ignore[override]
        """One inner step, then rackmend's per-step bookkeeping (never waits on peers
        except in deterministic mode)."""
        loss = self.inner.step(closure)
        self.after_inner_step(tokens)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "rackmend": {
                "learner_id": self.learner_id,
                "step": self.step_count,
                "versions": list(self.versions),
                "c_steps": list(self.c_steps),
                "c_tokens": list(self.c_tokens),
                "c_time": list(self.c_time),
                "held": [[t.clone() for t in h] for h in self.held],
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore inner state and rackmend counters. Where the syncer (at join) gave a
        newer global value than the checkpoint holds, the local progress since the
        checkpoint's value is rebased onto the newer one instead of being lost."""
        self.inner.load_state_dict(state_dict["inner"])
        rs = state_dict["rackmend"]
        self.step_count = int(rs["step"])
        self.c_steps = [int(x) for x in rs["c_steps"]]
        self.c_tokens = [float(x) for x in rs["c_tokens"]]
        self.c_time = [float(x) for x in rs["c_time"]]
        for p, (version, held) in enumerate(zip(rs["versions"], rs["held"])):
            if int(version) >= self.versions[p]:
                self.held[p] = [t.clone() for t in held]
                self.versions[p] = int(version)
            else:
                self._rebase(p, old=held, new=self.held[p])
        self._pending.clear()

    def close(self) -> None:
        """Leave the run (the syncer stops expecting this learner at once)."""
        self.link.leave()

    def __enter__(self) -> "RackmendOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the outer loop
    def after_inner_step(self, tokens: float = 1) -> None:
        """Bookkeeping after one inner step; ``step`` calls it for you."""
        now = time.perf_counter()
        dt = 0.0 if self._last_step_end is None else now - self._last_step_end
        self.step_count += 1
        t = self.step_count
        for p in range(len(self.fragments)):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
            self.c_time[p] += dt
        self._absorb(self.link.poll())
        for p in fragments_due(t, self.fragments, self.config.schedule.sync_every):
            self._send(p)
        tau = self.config.schedule.overlap
        for p in sorted(self._pending):
            pend = self._pending[p]
            if t < pend.t_send + tau:
                continue
            upd = self._arrived.pop(p, None)
            if upd is None and self.config.deterministic:
                upd = self._wait(p)
            if upd is not None:
                self._apply(p, upd, pend)
        # An update for a fragment not sent yet waits for that fragment's own send:
        # the send then carries this learner's progress as a stale contribution that
        # rides along with the next round instead of opening a round of its own.
        self._last_step_end = time.perf_counter()

    def _join(self) -> None:
        initial = [[t.detach() for t in params] for params in self._params]
        updates = self.link.join(self.learner_id, self.fragments, initial, self.config.learner.wait_timeout)
        got = {u.fragment: u for u in updates}
        missing = [p for p in range(len(self.fragments)) if p not in got]
        if missing:
            raise TransportError(f"join: the syncer sent no value for fragments {missing}")
        with torch.no_grad():
            for p, upd in got.items():
                for param, value in zip(self._params[p], upd.tensors):
                    param.copy_(value)
                self.held[p] = list(upd.tensors)
                self.versions[p] = upd.version

    def _absorb(self, updates: list[Update]) -> None:
        for upd in updates:
            if upd.reset:
                self._adopt(upd)
                continue
            if upd.version <= self.versions[upd.fragment]:
                continue
            prev = self._arrived.get(upd.fragment)
            if prev is None or upd.version > prev.version:
                self._arrived[upd.fragment] = upd

    def _wait(self, p: int) -> Update:
        t0 = time.perf_counter()
        timeout = self.config.learner.wait_timeout
        upd = self.link.wait(p, self.versions[p], timeout)
        self.blocked_seconds += time.perf_counter() - t0
        if upd is None:
            raise TransportError(
                f"learner {self.learner_id}: no merged value for fragment {p} within "
                f"{timeout}s in deterministic mode (is every listed learner running? "
                "raise learner.wait_timeout if merges are legitimately slower)"
            )
        return upd

    def _snapshot(self, p: int) -> list[torch.Tensor]:
        """Host copy of fragment p. CUDA parameters go to pinned buffers (reused per
        fragment) on a side stream, so the copy overlaps the next kernels of the
        current stream instead of serialising with them; the host waits only for
        this copy, never for the whole device queue."""
        params = self._params[p]
        if not params or not params[0].is_cuda:
            return [param.detach().to("cpu", copy=True) for param in params]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=params[0].device)
        buffers = self._pinned.get(p)
        if buffers is None:
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in params]
            self._pinned[p] = buffers
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(params[0].device))
        with torch.cuda.stream(stream):
            for buf, param in zip(buffers, params):
                buf.copy_(param.detach(), non_blocking=True)
        stream.synchronize()
        return buffers

    def _send(self, p: int) -> None:
        snapshot = self._snapshot(p)
        delta = tuple(h - s for h, s in zip(self.held[p], snapshot))
        steps = self.c_steps[p]
        contribution = Contribution(
            learner_id=self.learner_id,
            fragment=p,
            base_version=self.versions[p],
            step=self.step_count,
            c_steps=steps,
            c_tokens=self.c_tokens[p],
            step_time=self.c_time[p] / steps if steps else 0.0,
            tensors=delta,
        )
        self.link.send(contribution)
        self.bytes_sent += self.fragments[p].nbytes
        # Pinned buffers are reused at the next send, so keep_local holds its own copy.
        keep = None
        if self.config.learner.apply == "keep_local":
            keep = [t.clone() for t in snapshot] if p in self._pinned else snapshot
        self._pending[p] = _Pending(self.step_count, keep, (steps, self.c_tokens[p], self.c_time[p]))

    @torch.no_grad()
    def _apply(self, p: int, upd: Update, pend: _Pending) -> None:
        rule = self.config.learner.apply
        for i, (param, value) in enumerate(zip(self._params[p], upd.tensors)):
            value = value.to(param.device, non_blocking=True)
            if rule == "overwrite":
                param.copy_(value)
            elif rule == "mix":
                alpha = self.config.learner.mix_alpha
                param.mul_(alpha).add_(value, alpha=1 - alpha)
            else:  # keep_local: the tau steps since the send stay
                assert pend.snapshot is not None
                progress = param - pend.snapshot[i].to(param.device)
                param.copy_(value + progress)
        self.held[p] = list(upd.tensors)
        self.versions[p] = upd.version
        del self._pending[p]
        if rule == "keep_local":
            s, k, c = pend.counts_at_send
            self.c_steps[p] -= s
            self.c_tokens[p] -= k
            self.c_time[p] -= c
        else:
            self.c_steps[p], self.c_tokens[p], self.c_time[p] = 0, 0.0, 0.0
        if self.on_apply is not None:
            self.on_apply(p, upd)

    def _adopt(self, upd: Update) -> None:
        """A rejoin answer (e.g. the syncer restarted from a checkpoint): take its value
        as the new base and keep the local progress made on top of the old one."""
        p = upd.fragment
        if upd.version == self.versions[p] and all(map(torch.equal, self.held[p], upd.tensors)):
            return
        self._rebase(p, old=self.held[p], new=list(upd.tensors))
        self.held[p] = list(upd.tensors)
        self.versions[p] = upd.version
        self._pending.pop(p, None)
        self._arrived.pop(p, None)

    @torch.no_grad()
    def _rebase(self, p: int, old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        for param, o, n in zip(self._params[p], old, new):
            param.add_((n - o).to(param.device))
