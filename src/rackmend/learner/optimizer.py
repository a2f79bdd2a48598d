"""The learner integration: an optimizer wrapper that adds Decoupled DiLoCo to any loop.

``RackmendOptimizer(model, inner, config, link, learner_id=...)`` behaves like the
inner optimizer (``step``, ``zero_grad``, ``param_groups``, ``state_dict``). After
each inner step it counts steps and tokens per fragment, sends the fragments that
are due (outer gradient = global value held - local value, computed on a host
snapshot), and applies merged values that came back by the configured rule. It
blocks only when joining and, in deterministic mode, at t_send + tau. A merged
value is applied only at t_send + tau of this learner's own send (or the first step
after it arrives, if later), never in between.

It honours the ``torch.optim.Optimizer`` contract: step and state_dict hooks,
LR schedulers (``param_groups`` are the inner optimizer's), ``zero_grad``.
Checkpoint/resume works in either usual order (model then optimizer state, or the
optimizer built first); see ``load_state_dict`` and docs/integration.md.

The transport is whatever ``LearnerLink`` is passed in; nothing here knows sockets.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rackmend.codecs.feedback import FeedbackEncoder
from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import FragmentSpec, fragment_tensors, fragments_due, pack_fragments
from rackmend.core.messages import Contribution, Update
from rackmend.core.settings import LearnerSettings
from rackmend.learner.pieces import RackPieces
from rackmend.learner.tensorboard import LearnerScalars
from rackmend.transport.base import LearnerLink, TransportError

__all__ = ["RackmendOptimizer", "ResumeOrderError"]

log = logging.getLogger("rackmend.learner")


class ResumeOrderError(RuntimeError):
    """The model's parameters were overwritten after ``load_state_dict`` rebased them."""


@dataclass
class _Pending:
    """A fragment sent and not yet answered."""

    t_send: int
    snapshot: list[torch.Tensor] | None  # host copy at send time, kept for keep_local
    counts_at_send: tuple[int, float, float]


class RackmendOptimizer(torch.optim.Optimizer):
    """Wrap ``inner`` (e.g. AdamW over ``model``) with rackmend's outer loop.

    Call ``step(tokens=n)`` where you would call ``inner.step()``; ``tokens`` is the
    number of tokens (or samples) this rank trained on in this step. Callers that
    cannot pass it (the Hugging Face ``Trainer`` calls ``step()`` bare) set
    ``LearnerConfig.tokens_per_step`` or pass ``count_tokens``, a callable returning
    this step's tokens; with neither, a step counts 1 and a warning says so once.

    ``model`` may be wrapped (DDP, ``torch.compile``): names are canonical. Inside a
    multi-rank learner (torchrun) rank and world size come from ``process_group``
    (the default group when None), and ``link`` must carry the same ones
    (``ZmqLink(endpoint)`` takes them from ``torch.distributed`` itself).
    On construction the learner joins through ``link`` and loads the syncer's current
    values into ``model``.

    ``probe_loss``: a callable returning the model's loss on a fixed small held-out
    batch. When given, it runs (under ``torch.no_grad``) just before and just after each
    merged value is applied; ``(before - after) / before`` is that merge's *gain*
    (negative: the merge made this learner's model worse; -0.05: 5 % worse). The
    latest gain per fragment is in ``merge_gains`` and rides to the syncer with the
    fragment's next contribution, where it shows in the merge log (docs/tuning.md).
    Costs two forward passes of the probe batch per applied merge.
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        config: RackmendConfig,
        link: LearnerLink,
        *,
        learner_id: str | None = None,
        fragments: list[FragmentSpec] | None = None,
        process_group: Any = None,
        count_tokens: Callable[[], float] | None = None,
        probe_loss: Callable[[], float] | None = None,
    ) -> None:
        # Deliberately no Optimizer.__init__ (it would build param_groups and state of its
        # own): those are the inner optimizer's, as in torch's PostLocalSGDOptimizer. The
        # hook tables and the hooked step are set up as Optimizer.__init__ would.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._patch_step_function()
        self.inner = inner
        self.model = model
        self.config = config
        self.link = link
        learner_id = learner_id or os.environ.get("RACKMEND_LEARNER_ID")
        if not learner_id:
            raise ValueError("no learner id: pass learner_id=... or set RACKMEND_LEARNER_ID; "
                             "keep it the same across restarts so the syncer knows the learner")
        self.learner_id = learner_id
        self.count_tokens = count_tokens
        self.probe_loss = probe_loss
        self._warned_tokens = False
        # Inside a multi-rank learner (torchrun), rank r owns fragments p = r mod world:
        # only it sends them and talks to the syncer about them; merged values reach the
        # other ranks by broadcast, at the same step on every rank.
        self._group = process_group
        dist = torch.distributed
        self._dist = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
        self.world_size = dist.get_world_size(process_group) if self._dist else 1
        self.rank = dist.get_rank(process_group) if self._dist else 0
        link_ranks = (getattr(link, "rank", 0), getattr(link, "world_size", 1))
        if link_ranks != (self.rank, self.world_size):
            # A link that disagrees would carry only part of the fragments (each rank of
            # a 2-rank job calling itself rank 0 of 1 sends the same half twice).
            raise ConfigError(
                f"the link carries rank {link_ranks[0]} of {link_ranks[1]}, but the process group says rank "
                f"{self.rank} of {self.world_size}; build the link after init_process_group with "
                "ZmqLink(endpoint) (it reads both from torch.distributed) or pass it the same "
                "process_group as RackmendOptimizer")
        sch = config.schedule
        self.fragments = fragments or pack_fragments(model, sch.num_fragments, sch.sync_every, sch.packing,
                                                     buffers=sch.sync_buffers)
        self._pieces = RackPieces(self.fragments, fragment_tensors(model, self.fragments), process_group)
        """This rank's blocks of each fragment, which of them it owns, how copies reach other ranks."""
        self._params: list[list[torch.Tensor]] = self._pieces.local
        """Per fragment, the model's tensors (parameters and synced buffers) in order; of a
        DTensor, this rank's local shard (a view: writing it writes the parameter)."""
        n = len(self.fragments)
        self._rule = config.apply_rule()
        """``learner.apply`` with ``auto`` resolved."""
        self.step_count = 0
        self.versions = [0] * n
        self.epochs = [0] * n
        """Per fragment, the syncer epoch of the held value (``Update.epoch``)."""
        self.held: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.c_steps = [0] * n
        self.c_tokens = [0.0] * n
        self.c_time = [0.0] * n
        self._pending: dict[int, _Pending] = {}
        self._arrived: dict[int, Update] = {}
        self._last_step_end: float | None = None
        self._rebased: list[tuple[torch.Tensor, int]] | None = None
        """Set by load_state_dict when it rebased: each tensor and its version counter then."""
        self.blocked_seconds = 0.0
        """Wall time spent blocked on the syncer (join excluded)."""
        self.bytes_sent = 0
        """Bytes of outer gradients sent (encoded bytes with a lossy uplink codec)."""
        uplink = config.compression.build_uplink()
        self._uplink: FeedbackEncoder | None = None if uplink.lossless else FeedbackEncoder(uplink)
        """Error feedback and codec state per (fragment, tensor) of a lossy uplink codec.
        Only the owner rank of a fragment encodes it (it is the only one sending)."""
        config.compression.require_float32(
            "uplink", ((t.name, t.dtype) for spec in self.fragments for t in spec.tensors))
        self._copy_stream: Any = None  # torch.cuda.Stream for snapshots, made on first CUDA send
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self.merge_gains: list[float | None] = [None] * n
        """Per fragment, the relative probe-loss change (before - after) / before of the
        last merged value applied; None until measured."""
        self._gain_to_report: dict[int, float] = {}
        self.on_apply: Callable[[int, Update], None] | None = None
        """Optional hook called after a merged value is applied (fragment, update)."""
        self.version_lags: list[int] = [0] * n
        """Per fragment, for the last merged value applied: how many versions it lies beyond
        the next one after the value held before (0: the very next version; more: merges
        happened in between, e.g. this learner's contribution came late). Counted within
        one syncer epoch; a value of a new epoch counts 0."""
        self.on_fail_slow: Callable[[FailSlowReport], None] = self._warn_fail_slow
        """Called (on the training thread, inside ``step``) with each fail-slow report the
        syncer sends this learner: ``state`` slow (rounds no longer wait for it), evict
        (marked for eviction) or restored, naming the slow ``rank``. Replace it to act,
        e.g. shrink that rank's batch or rebalance work; the default logs a warning."""
        self._poll_advice: Callable[[], list[FailSlowReport]] | None = getattr(link, "poll_advice", None)
        """The link's fail-slow advice, looked up once (links without it have none)."""
        self._rank_times: list[float] = []
        """Seconds of each step of this rank since its previous contribution (fail-slow timing)."""
        tb = config.learner.tensorboard_dir
        self._scalars = None if tb is None else LearnerScalars(tb, self.rank, self.world_size)
        """TensorBoard scalars (``LearnerConfig.tensorboard_dir``), written at each applied merge."""
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "RackmendOptimizer fixes its fragments when it is built, so parameters added later would "
            "never be synchronised; add the group to the inner optimizer before building RackmendOptimizer")

    def step(self, closure: Callable[[], float] | None = None, tokens: float | None = None) -> Any:  # type: ignore[override]
        """One inner step, then rackmend's per-step bookkeeping (never waits on peers
        except in deterministic mode). ``tokens``: what this rank trained on in this step
        (see the class docstring for callers that cannot pass it)."""
        if self._rebased is not None:
            self._check_not_overwritten()
        loss = self.inner.step(closure)
        self.after_inner_step(self._tokens(tokens))
        return loss

    def _tokens(self, tokens: float | None) -> float:
        if tokens is not None:
            return tokens
        if self.count_tokens is not None:
            return float(self.count_tokens())
        per_step = self.config.learner.tokens_per_step
        if per_step is not None:
            return per_step
        if not self._warned_tokens:
            self._warned_tokens = True
            log.warning(
                "learner %s: step() got no tokens and no LearnerConfig.tokens_per_step or count_tokens is set; "
                "each step counts 1. If another rack passes token counts, this rack's merges weigh almost "
                "nothing: pass step(tokens=...) or set tokens_per_step", self.learner_id)
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus rackmend's: counters, versions, the global
        values held, and this learner's parameters (so that ``load_state_dict`` can
        restore them onto a newer global value whatever the model holds then)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = {
            "inner": self.inner.state_dict(),
            "rackmend": {
                "learner_id": self.learner_id,
                "step": self.step_count,
                "versions": list(self.versions),
                "epochs": list(self.epochs),
                "c_steps": list(self.c_steps),
                "c_tokens": list(self.c_tokens),
                "c_time": list(self.c_time),
                "held": [[t.clone() for t in h] for h in self.held],
                "params": [[t.detach().clone() for t in ts] for ts in self._params],
                "uplink": {} if self._uplink is None else self._uplink.state_dict(),
            },
        }
        for post in self._optimizer_state_dict_post_hooks.values():
            result = post(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore inner state, rackmend's counters and this learner's parameters.

        The parameters come from ``state_dict`` itself, so the order of
        ``model.load_state_dict`` against building this optimizer does not matter.
        Where the syncer (at join) gave a newer global value than the checkpoint
        holds, the local progress since the checkpoint's value is rebased onto the
        newer one instead of being lost. Loading the model's own checkpoint *after*
        this call would undo that rebase; the next ``step`` then raises
        ``ResumeOrderError``."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre(self, state_dict)
            if result is not None:
                state_dict = result
        self.inner.load_state_dict(state_dict["inner"])
        rs = state_dict["rackmend"]
        if "params" not in rs:
            raise ValueError("this state_dict predates rackmend's parameter snapshot ('params'); "
                             "save it again with this version")
        self.step_count = int(rs["step"])
        self.c_steps = [int(x) for x in rs["c_steps"]]
        self.c_tokens = [float(x) for x in rs["c_tokens"]]
        self.c_time = [float(x) for x in rs["c_time"]]
        if self._uplink is not None:
            # Without its residuals a restored learner would silently drop what the
            # codec held back before the checkpoint.
            self._uplink.load_state_dict(rs.get("uplink", {}))
        rebased = False
        with torch.no_grad():
            epochs = [int(e) for e in rs.get("epochs", [0] * len(self.fragments))]  # older saves lack them
            for p, (version, held, saved) in enumerate(zip(rs["versions"], rs["held"], rs["params"])):
                for param, value in zip(self._params[p], saved):
                    param.copy_(value)
                joined = bool(self.held[p])
                # Versions of two syncer epochs do not compare: a joined value of another
                # epoch than the saved one is the current one.
                if not joined or (epochs[p] == self.epochs[p] and int(version) >= self.versions[p]):
                    self.held[p] = [t.clone() for t in held]
                    self.versions[p] = int(version)
                    self.epochs[p] = epochs[p]
                else:
                    self._rebase(p, old=held, new=self.held[p])
                    rebased = True
        self._pending.clear()
        # Parameters only: a forward pass updates buffers (BatchNorm statistics) in place.
        self._rebased = [(t, t._version) for spec, ts in zip(self.fragments, self._params)
                         for s, t in zip(spec.tensors, ts) if not s.is_buffer] if rebased else None
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _check_not_overwritten(self) -> None:
        changed = [t for t, v in self._rebased or () if t._version != v]
        self._rebased = None
        if changed:
            raise ResumeOrderError(
                "the model's parameters changed between RackmendOptimizer.load_state_dict and the first step "
                "(e.g. model.load_state_dict after it), which undoes the rebase onto the syncer's newer global "
                "value; restore in this order: model.load_state_dict(...) (optional), build RackmendOptimizer, "
                "opt.load_state_dict(...), then train")

    def close(self) -> None:
        """Leave the run (the syncer stops expecting this learner at once)."""
        if self._scalars is not None:
            self._scalars.close()
        self.link.leave()

    def __enter__(self) -> "RackmendOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the outer loop
    def after_inner_step(self, tokens: float) -> None:
        """Bookkeeping after one inner step; ``step`` calls it for you."""
        now = time.perf_counter()
        dt = 0.0 if self._last_step_end is None else now - self._last_step_end
        self.step_count += 1
        t = self.step_count
        for p in range(len(self.fragments)):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens * self.world_size  # ranks see equal batches: the learner's total
            self.c_time[p] += dt
        if dt > 0:  # the first step has no start time to measure from
            self._rank_times.append(dt)
        self._absorb(self.link.poll())
        if self._poll_advice is not None:
            for report in self._poll_advice():
                self.on_fail_slow(report)
        for p in fragments_due(t, self.fragments, self.config.schedule.sync_every):
            self._send(p)
        if self._dist:
            self._apply_across_ranks(t)
            self._last_step_end = time.perf_counter()
            return
        tau = self.config.schedule.overlap
        for p in sorted(self._pending):
            pend = self._pending[p]
            if t < pend.t_send + tau:
                continue
            upd = self._arrived.pop(p, None)
            if upd is None and self.config.deterministic:
                upd = self._wait(p)
            if upd is not None and upd.reset:
                # The syncer forgot this learner (silence, restart) while we waited: its
                # contribution is gone, so no merge will answer it. Adopt the value and
                # take part again from the fragment's next send.
                self._adopt(upd)
            elif upd is not None:
                self._apply(p, upd, pend)
        # An update for a fragment not sent yet waits for that fragment's own send:
        # the send then carries this learner's progress as a stale contribution that
        # rides along with the next round instead of opening a round of its own.
        self._last_step_end = time.perf_counter()

    @property
    def fragments_in_flight(self) -> tuple[int, ...]:
        """Fragments sent and not yet answered by an applied merged value, ascending."""
        return tuple(sorted(self._pending))
    def _warn_fail_slow(self, report: FailSlowReport) -> None:
        """The default ``on_fail_slow``: a log line naming the slow rank."""
        speed = f"{report.ratio:.2f}x its usual step time ({report.fleet_ratio:.2f}x relative to the fleet)"
        if report.state == "restored":
            log.info("learner %s: the syncer sees rank %d back at normal speed (%s); rounds wait for it again",
                     self.learner_id, report.rank, speed)
        elif report.state == "evict":
            log.warning("learner %s: the syncer marked this learner for eviction: rank %d runs at %s and has cost "
                        "the fleet %.0f s; replace or restart that rack", self.learner_id, report.rank, speed,
                        report.cost_s)
        else:
            log.warning("learner %s: the syncer reports rank %d fail-slow: %s for %d steps; rounds no longer wait "
                        "for this learner. Shrink that rank's batch, rebalance, or check its hardware (set "
                        "RackmendOptimizer.on_fail_slow to act on this)", self.learner_id, report.rank, speed,
                        report.steps)

    def owns(self, p: int) -> bool:
        """Whether this rank sends and receives (pieces of) fragment p."""
        return self._pieces.owns(p)

    def _join(self) -> None:
        initial = [[t.detach() for t in params] for params in self._params]
        sharded = {"pieces": self._pieces.owned} if self._pieces.sharded else {}
        updates = self.link.join(self.learner_id, self.fragments, initial, self.config.learner.join_timeout,
                                 settings=LearnerSettings.from_config(self.config), **sharded)
        got = {u.fragment: u for u in updates}
        missing = [p for p in range(len(self.fragments)) if p not in got and self.owns(p)]
        if missing:
            raise TransportError(f"join: the syncer sent no value for fragments {missing}")
        for p in range(len(self.fragments)):
            upd = self._pieces.spread(p, got.get(p))  # the owners' values on every rank that holds them
            with torch.no_grad():
                for param, value in zip(self._params[p], upd.tensors):
                    param.copy_(value)
            self.held[p] = list(upd.tensors)
            self.versions[p] = upd.version
            self.epochs[p] = upd.epoch

    def _apply_across_ranks(self, t: int) -> None:
        """One small all-reduce per step tells every rank which fragments change now
        (1: apply a merged value, 2: adopt a rejoin value); owners then broadcast them."""
        n = len(self.fragments)
        tau = self.config.schedule.overlap
        ready: list[Update | None] = [None] * n
        for p in range(n):
            if not self.owns(p):
                continue
            arrived = self._arrived.get(p)
            if arrived is None or not arrived.reset:
                pend = self._pending.get(p)
                if pend is None or t < pend.t_send + tau:
                    continue
                if arrived is None and self.config.deterministic:
                    self._arrived[p] = arrived = self._wait(p)
            ready[p] = arrived
        for p, (code, version, epoch, reset) in enumerate(self._pieces.agree(ready)):
            if code == 0:
                continue
            upd = self._pieces.spread(p, self._arrived.pop(p, None) if self.owns(p) else None, (version, epoch, reset))
            if code == 2:
                self._adopt(upd)
            else:
                self._apply(p, upd, self._pending[p])

    def _absorb(self, updates: list[Update]) -> None:
        for upd in updates:
            if upd.reset and self._dist:
                self._arrived[upd.fragment] = upd  # adopted on every rank at once, next step
                continue
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
        if not self.owns(p):
            # The owner rank sends; this rank only tracks the round so it applies in step.
            keep = self._snapshot(p) if self._rule == "keep_local" else None
            if keep is not None and p in self._pinned:
                keep = [t.clone() for t in keep]
            self._pending[p] = _Pending(self.step_count, keep, (self.c_steps[p], self.c_tokens[p], self.c_time[p]))
            return
        snapshot = self._snapshot(p)
        owned = self._pieces.owned_of
        delta = tuple(h - s for h, s in zip(owned(p, self.held[p]), owned(p, snapshot)))
        encoded = None
        nbytes = self._pieces.owned_nbytes(p)
        if self._uplink is not None:
            pairs = [self._uplink.encode_decoded((p, i), d) for i, d in enumerate(delta)]
            encoded = tuple(enc for enc, _ in pairs)
            delta = tuple(dec for _, dec in pairs)  # what the syncer will merge, bit for bit
            nbytes = sum(enc.nbytes() for enc in encoded)
        steps = self.c_steps[p]
        contribution = Contribution(
            learner_id=self.learner_id,
            fragment=p,
            base_version=self.versions[p],
            base_epoch=self.epochs[p],
            step=self.step_count,
            c_steps=steps,
            c_tokens=self.c_tokens[p],
            step_time=self.c_time[p] / steps if steps else 0.0,
            tensors=delta,
            encoded=encoded,
            merge_gain=self._gain_to_report.pop(p, None),
            rank=self.rank,
            rank_steps=len(self._rank_times),
            rank_step_time=statistics.median(self._rank_times) if self._rank_times else 0.0,
            pieces=self._pieces.wire_pieces(p),
        )
        self._rank_times = []
        self.link.send(contribution)
        self.bytes_sent += nbytes
        # Pinned buffers are reused at the next send, so keep_local holds its own copy.
        keep = None
        if self._rule == "keep_local":
            keep = [t.clone() for t in snapshot] if p in self._pinned else snapshot
        self._pending[p] = _Pending(self.step_count, keep, (steps, self.c_tokens[p], self.c_time[p]))

    @torch.no_grad()
    def _apply(self, p: int, upd: Update, pend: _Pending) -> None:
        rule = self._rule
        before = float(self.probe_loss()) if self.probe_loss is not None else None
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
        same_epoch = upd.epoch == self.epochs[p]
        self.version_lags[p] = max(0, upd.version - self.versions[p] - 1) if same_epoch else 0
        self.held[p] = list(upd.tensors)
        self.versions[p] = upd.version
        self.epochs[p] = upd.epoch
        del self._pending[p]
        if rule == "keep_local":
            s, k, c = pend.counts_at_send
            self.c_steps[p] -= s
            self.c_tokens[p] -= k
            self.c_time[p] -= c
        else:
            self.c_steps[p], self.c_tokens[p], self.c_time[p] = 0, 0.0, 0.0
        if before is not None:
            assert self.probe_loss is not None
            # Relative, so one threshold fits every model's loss scale.
            gain = (before - float(self.probe_loss())) / abs(before) if before else 0.0
            self.merge_gains[p] = gain
            if math.isfinite(gain):  # a non-finite probe is the user's to see, not the syncer's
                self._gain_to_report[p] = gain
        if self._scalars is not None:
            self._scalars.applied(self, p)
        if self.on_apply is not None:
            self.on_apply(p, upd)

    def _adopt(self, upd: Update) -> None:
        """A rejoin answer (e.g. the syncer restarted from a checkpoint): take its value
        as the new base and keep the local progress made on top of the old one."""
        p = upd.fragment
        # Whatever was sent for p is forgotten by the syncer (or will be answered as a
        # plain update, applied after this learner's next send of p).
        self._pending.pop(p, None)
        self._arrived.pop(p, None)
        self.epochs[p] = upd.epoch
        if upd.version == self.versions[p] and all(map(torch.equal, self.held[p], upd.tensors)):
            return
        self._rebase(p, old=self.held[p], new=list(upd.tensors))
        self.held[p] = list(upd.tensors)
        self.versions[p] = upd.version

    @torch.no_grad()
    def _rebase(self, p: int, old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        for param, o, n in zip(self._params[p], old, new):
            param.add_((n - o).to(param.device))
