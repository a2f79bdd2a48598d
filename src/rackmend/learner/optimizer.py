"""The learner integration: an optimizer wrapper that adds Decoupled DiLoCo to any loop.

``RackmendOptimizer(model, inner, config, link, learner_id=...)`` behaves like the
inner optimizer (``step``, ``zero_grad``, ``param_groups``, ``state_dict``). After
each inner step it feeds rackmend's sans-I/O learner core (``rackmend.core.learner``,
which owns the rules: when a fragment is due, the outer gradient, the counters,
when and how a merged value applies, what deterministic mode waits for) and carries
out the core's actions: host snapshots of fragments (on CUDA through
``rackmend.learner.device``: pinned buffers on a side stream, merged values staged on
the device as they arrive), sends on one send thread (``rackmend.learner.sending``)
and waits on the link, the collectives between the ranks of
a multi-rank learner (``rackmend.learner.pieces``: agreeing on what changes, bringing
received values to every rank, sharded DTensor parameters included), writes into
the model's parameters, merge-gain probes and user callbacks. It owns the model,
the inner optimizer, the link and the clock. It blocks only when joining and, in
deterministic mode, at t_send + tau.

It honours the ``torch.optim.Optimizer`` contract: step and state_dict hooks,
LR schedulers (``param_groups`` are the inner optimizer's), ``zero_grad``.
Checkpoint/resume works in either usual order (model then optimizer state, or the
optimizer built first); see ``load_state_dict`` and docs/integration.md.

The transport is whatever ``LearnerLink`` is passed in; nothing here knows sockets.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import FragmentSpec, fragment_tensors, pack_fragments
from rackmend.core.learner import (
    ApplyDue,
    ApplyMoments,
    ApplyValue,
    Change,
    ChangeAgreed,
    InnerStepDone,
    JoinedValue,
    LearnerAction,
    LearnerCore,
    Log,
    MomentsAnswered,
    MomentsTaken,
    OffersShared,
    ProbeMeasured,
    Rebase,
    SendFragment,
    SendMoments,
    SetValue,
    ShareChanges,
    SnapshotTaken,
    SpreadValue,
    TakeMoments,
    TakeSnapshot,
    TrainingResumed,
    WaitAnswered,
    WaitForMoments,
    WaitForVersion,
)
from rackmend.core.messages import MomentUpdate, Update
from rackmend.core.settings import RunRules, SyncerSettings, syncer_differences
from rackmend.learner.binding import Mismatch, compare, launcher, local_of, sharding
from rackmend.learner.device import CudaCopies
from rackmend.learner.pieces import RackPieces, refuse_differing_copies, refuse_fsdp1
from rackmend.learner.sending import SendThread
from rackmend.learner.statistics import RunningStats
from rackmend.learner.tensorboard import Applied, LearnerScalars
from rackmend.transport.base import LearnerLink, TransportError

__all__ = ["RackmendOptimizer", "ResumeOrderError"]

log = logging.getLogger("rackmend.learner")


RANK_STATE_FILE = "rackmend-rank{rank}-of-{world}.pt"
"""The name of a rank's own rackmend state in a checkpoint folder (``save_rank_state``)."""

PER_RANK = {"per_rank": RANK_STATE_FILE}
"""``state_dict()["rackmend"]`` with ``state_per_rank`` set: the state is in each rank's file."""


class ResumeOrderError(RuntimeError):
    """The model's parameters were overwritten after ``load_state_dict`` rebased them."""


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
        if not isinstance(link, LearnerLink):
            raise TypeError(f"link must be a rackmend.transport.LearnerLink (subclass it), got {type(link).__name__}")
        self.link = link
        learner_id = learner_id or os.environ.get("RACKMEND_LEARNER_ID")
        if not learner_id:
            raise ValueError("no learner id: pass learner_id=... or set RACKMEND_LEARNER_ID; "
                             "keep it the same across restarts so the syncer knows the learner")
        self.learner_id = learner_id
        self.count_tokens = count_tokens
        self.probe_loss = probe_loss
        self._warned_tokens = False
        self._pending_tokens: float | None = None
        """Tokens counted by ``add_tokens`` for the next step."""
        self._closed = False
        self.state_per_rank = False
        """Set by trainer integrations whose checkpoint holds the optimizer state of rank 0
        only (the Hugging Face Trainer, accelerate, Lightning under DDP): ``state_dict``
        then carries the inner optimizer's state and no rackmend part, ``load_state_dict``
        of such a state restores the inner optimizer only, and each rank's own rackmend
        state goes to a file of its own (``save_rank_state`` / ``load_rank_state``)."""
        # Inside a multi-rank learner (torchrun), one rank owns each block of each fragment
        # (core.pieces.owner): only it sends it and talks to the syncer about it; merged
        # values reach the ranks holding copies by broadcast, at the same step on every rank.
        dist = torch.distributed
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
        self.world_size = dist.get_world_size(process_group) if several else 1
        self.rank = dist.get_rank(process_group) if several else 0
        link_ranks = (link.rank, link.world_size)
        if link_ranks != (self.rank, self.world_size):
            # A link that disagrees would carry only part of the fragments (each rank of
            # a 2-rank job calling itself rank 0 of 1 sends the same half twice).
            raise ConfigError(
                f"the link carries rank {link_ranks[0]} of {link_ranks[1]}, but the process group says rank "
                f"{self.rank} of {self.world_size}; build the link after init_process_group with "
                "ZmqLink(endpoint) (it reads both from torch.distributed) or pass it the same "
                "process_group as RackmendOptimizer")
        sch = config.schedule
        refuse_fsdp1(model)
        self.fragments = fragments or pack_fragments(model, sch.num_fragments, sch.sync_every, sch.packing,
                                                     buffers=sch.sync_buffers)
        tensors = fragment_tensors(model, self.fragments)
        self._pieces = RackPieces(self.fragments, tensors, process_group)
        """This rank's blocks of each fragment and how copies reach the other ranks."""
        self._shardings = [[sharding(t) for t in ts] for ts in tensors]
        """Per fragment and tensor, its DTensor placements when built ('none': plain)."""
        self._pieces.check_learner_id(learner_id)
        self._params: list[list[torch.Tensor]] = self._pieces.local
        """Per fragment, the model's tensors (parameters and synced buffers) in order; of a
        DTensor, this rank's local shard (a view: writing it writes the parameter). The
        pieces the core's values and actions are about."""
        self._stats = RunningStats(model, self.fragments) if sch.sync_buffers else None
        """BatchNorm statistics: sent as the rack's own estimate (``rackmend.learner.statistics``)."""
        self._mark_all()
        self.core = LearnerCore(config, self.fragments, learner_id=learner_id, rank=self.rank,
                                world_size=self.world_size, layout=self._pieces.layout)
        """The learner's rules and per-fragment state (``rackmend.core.learner``)."""
        self._moment_params = self._check_desloc()
        """DES-LOC: per fragment, its parameters (``moment_spec`` order); empty when off."""
        self._clock: Callable[[], float] = time.perf_counter
        self._rebased: list[tuple[torch.Tensor, int]] | None = None
        """Set by load_state_dict when it rebased: each tensor and its version counter then."""
        self.blocked_seconds = 0.0
        """Wall time spent blocked on the syncer (join excluded)."""
        self.bytes_sent = 0
        """Bytes of outer gradients (and DES-LOC moments) handed to the link (encoded bytes
        with a lossy codec), as of this step's bookkeeping: the send thread's count, taken
        on the training thread so it holds still between steps (final after ``close``)."""
        self._bytes_out = 0
        """The send thread's running count behind ``bytes_sent``."""
        self._in_step = False
        """Inside ``step``: it orders the next inner step after this step's snapshot copies."""
        self._model_checked = False
        """The first step has checked that the model still holds the tensors rackmend works on."""
        self._bound_checks = 0
        """Steps whose start checked the model's tensors against the views (``_follow_moves``):
        the first follows a move, the second refuses any replacement (a module assigning a
        buffer anew at every forward), later steps do not look."""
        devices = sorted({str(t.device) for ts in self._params for t in ts if t.is_cuda})
        if len(devices) > 1:
            # The snapshot copies and their events are made on one device's streams; a
            # tensor on another device would be copied on that device's stream, which
            # the event does not cover, and be sent half copied.
            raise ConfigError(
                f"the model's tensors are on {len(devices)} GPUs ({', '.join(devices)}) in this process; a learner "
                "rank keeps its model on one device. Spread a model over GPUs with one process per GPU (FSDP2's "
                "fully_shard, tensor parallelism under torchrun), not device_map='auto' or manual placement")
        first = next((t for ts in self._params for t in ts), None)
        device = first.device if first is not None and first.is_cuda else None
        # The send thread's CUDA calls (waiting for snapshot copies) on this rank's device,
        # not on device 0, where they would open a context of their own.
        self._sends = SendThread(f"{learner_id}-{self.rank}",
                                 None if device is None else lambda: torch.cuda.set_device(device))
        """Builds contributions and hands them to the link, off the training thread."""
        self._cuda = None if device is None else CudaCopies(
            device, -(-sch.overlap * sch.num_fragments // sch.sync_every) + 1, f"{learner_id}-{self.rank}")
        """A CUDA learner's snapshots, at-send copies and staged merged values; copies in
        device memory bounded by what the schedule keeps in flight, plus one fragment."""
        self.on_apply: Callable[[int, Update], None] | None = None
        """Optional hook called after a merged value is applied (fragment, update)."""
        self.on_fail_slow: Callable[[FailSlowReport], None] = self._warn_fail_slow
        """Called (on the training thread, inside ``step``) with each fail-slow report the
        syncer sends this learner: ``state`` slow (rounds no longer wait for it), evict
        (marked for eviction) or restored, naming the slow ``rank``. Replace it to act,
        e.g. shrink that rank's batch or rebalance work; the default logs a warning."""
        tb = config.learner.tensorboard_dir
        self._scalars = None if tb is None else LearnerScalars(tb, self.rank, self.world_size)
        """TensorBoard scalars (``LearnerConfig.tensorboard_dir``), written at each applied merge."""
        self._join()

    # ------------------------------------------------------- the core's state, read-only
    @property
    def step_count(self) -> int:
        """Inner steps done."""
        return self.core.step

    @property
    def versions(self) -> list[int]:
        """Per fragment, the version of the global value held."""
        return [f.version for f in self.core.fragments]

    @property
    def epochs(self) -> list[int]:
        """Per fragment, the syncer epoch of the held value (``Update.epoch``)."""
        return [f.epoch for f in self.core.fragments]

    @property
    def held(self) -> list[list[torch.Tensor]]:
        """Per fragment, the global value held (shared; do not modify)."""
        return [f.held for f in self.core.fragments]

    @property
    def c_steps(self) -> list[int]:
        """Per fragment, inner steps counted since its value was last applied."""
        return [f.c_steps for f in self.core.fragments]

    @property
    def c_tokens(self) -> list[float]:
        """Per fragment, the learner's tokens over those steps."""
        return [f.c_tokens for f in self.core.fragments]

    @property
    def c_time(self) -> list[float]:
        """Per fragment, seconds of those steps."""
        return [f.c_time for f in self.core.fragments]

    @property
    def merge_gains(self) -> list[float | None]:
        """Per fragment, the relative probe-loss change (before - after) / before of the
        last merged value applied; None until measured."""
        return [f.merge_gain for f in self.core.fragments]

    @property
    def version_lags(self) -> list[int]:
        """Per fragment, for the last merged value applied: how many versions it lies beyond
        the next one after the value held before (0: the very next version; more: merges
        happened in between, e.g. this learner's contribution came late). Counted within
        one syncer epoch; a value of a new epoch counts 0."""
        return [f.version_lag for f in self.core.fragments]

    @property
    def fragments_in_flight(self) -> tuple[int, ...]:
        """Fragments sent and not yet answered by an applied merged value, ascending."""
        return self.core.in_flight()

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
        self._check_open()
        if self._bound_checks < 2:  # before the inner step, while moved values still equal the views'
            self._follow_moves()
        if self._rebased is not None:
            self._check_not_overwritten()
        n = self._tokens(tokens)  # before the inner step: a refused count leaves the model as it was
        if self._cuda is not None:
            self._cuda.guard_writes()  # the inner step writes what the last snapshots read
        loss = self.inner.step(closure)
        self._in_step = True
        try:
            self.after_inner_step(n)
        finally:
            self._in_step = False
        return loss

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"learner {self.learner_id}: this RackmendOptimizer was closed (it left the run; a trainer integration "
                "closes it when training ends): build a new one, with a new inner optimizer or the same, to train on")

    def add_tokens(self, tokens: float) -> None:
        """Count ``tokens`` (this rank's) toward the next ``step``: for callers that reach
        the optimizer through a wrapper whose ``step`` takes no ``tokens=`` (accelerate's
        ``AcceleratedOptimizer``, Lightning). Micro-batches of gradient accumulation add up;
        a step that a wrapper skips (a GradScaler's overflow) leaves them to the next."""
        if not tokens >= 0:
            raise ValueError(f"add_tokens takes a count of tokens >= 0, got {tokens!r}")
        self._pending_tokens = (self._pending_tokens or 0.0) + float(tokens)

    def _tokens(self, tokens: float | None) -> float:
        pending, self._pending_tokens = self._pending_tokens, None
        if tokens is not None:
            if pending is not None:
                raise ValueError(f"learner {self.learner_id}: step(tokens={tokens}) after add_tokens({pending}) for "
                                 "the same step; count this step's tokens one way")
            return tokens
        if pending is not None:
            return pending
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
        state = {"inner": self.inner.state_dict(), "rackmend": PER_RANK if self.state_per_rank else self._own_state()}
        for post in self._optimizer_state_dict_post_hooks.values():
            result = post(self, state)
            if result is not None:
                state = result
        return state

    def _own_state(self) -> dict[str, Any]:
        """This rank's rackmend state: what ``state_dict()["rackmend"]`` holds."""
        self._sends.wait()  # the uplink codec's residuals include every send made
        return {"learner_id": self.learner_id, **self.core.state_dict(),
                "params": [[t.detach().clone() for t in ts] for ts in self._params]}

    def rank_state_file(self, folder: str | os.PathLike[str]) -> Path:
        """Where ``save_rank_state(folder)`` writes this rank's state."""
        return Path(folder) / RANK_STATE_FILE.format(rank=self.rank, world=self.world_size)

    def save_rank_state(self, folder: str | os.PathLike[str]) -> Path:
        """Write this rank's rackmend state (``state_dict()["rackmend"]``) into ``folder``
        (created if missing), as a file of its own: every rank calls it, at the same step
        as the trainer's checkpoint. Returns the file."""
        path = self.rank_state_file(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self._own_state(), tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous file, not half of one
        return path

    def load_rank_state(self, folder: str | os.PathLike[str]) -> None:
        """Restore this rank's rackmend state from ``folder`` (``save_rank_state``'s file);
        FileNotFoundError naming the file when it is not there."""
        path = self.rank_state_file(folder)
        if not path.is_file():
            raise FileNotFoundError(
                f"learner {self.learner_id}: no rackmend state for rank {self.rank} of {self.world_size} at {path}: "
                "each rank writes its own beside the trainer's checkpoint; resume from the folder the trainer saved "
                "(with the same number of ranks), or resume without it (the learner joins with the global value)")
        # A file this learner's own trainer wrote on local disk, never bytes from the network;
        # weights_only keeps even a tampered file from running code.
        self.load_state_dict({"rackmend": torch.load(path, map_location="cpu", weights_only=True)})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore inner state, rackmend's counters and this learner's parameters.

        The parameters come from ``state_dict`` itself, so the order of
        ``model.load_state_dict`` against building this optimizer does not matter.
        Where the syncer (at join) gave a newer global value than the checkpoint
        holds, the local progress since the checkpoint's value is rebased onto the
        newer one instead of being lost. Loading the model's own checkpoint *after*
        this call would undo that rebase; the next ``step`` then raises
        ``ResumeOrderError``.

        Without an ``"inner"`` entry only rackmend's part is restored: the inner
        optimizer's state was restored elsewhere, e.g. by torch.distributed.checkpoint
        (docs/integration.md, "Checkpoint and resume of a learner")."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre(self, state_dict)
            if result is not None:
                state_dict = result
        if "rackmend" not in state_dict:
            raise ValueError(
                f"this state_dict has no 'rackmend' entry (it has {sorted(state_dict)[:4]}): "
                + ("it is a plain optimizer's, as torch.distributed.checkpoint's get_optimizer_state_dict gives; "
                   "pass opt.inner to torch.distributed.checkpoint and save opt.state_dict()['rackmend'] on each "
                   "rank beside it (docs/integration.md, 'Checkpoint and resume of a learner')"
                   if "state" in state_dict else "load what RackmendOptimizer.state_dict() returned"))
        self._sends.wait()  # no send may read the uplink's residuals while they are replaced
        if "inner" in state_dict:
            self.inner.load_state_dict(state_dict["inner"])
        rs = state_dict["rackmend"]
        if rs == PER_RANK:  # rackmend's part is in each rank's own file (load_rank_state)
            for post in self._optimizer_load_state_dict_post_hooks.values():
                post(self)
            return
        if "params" not in rs:
            raise ValueError("this state_dict predates rackmend's parameter snapshot ('params'); "
                             "save it again with this version")
        if len(rs["params"]) != len(self.fragments):
            raise ValueError(f"this state_dict holds parameters of {len(rs['params'])} fragments, the learner has "
                             f"{len(self.fragments)}; it was saved with another model or schedule.num_fragments")
        rebases = self.core.load_state_dict(rs)
        if self._cuda is not None:
            self._cuda.guard_writes()
        with torch.no_grad():
            for params, saved in zip(self._params, rs["params"]):
                for param, value in zip(params, saved):
                    param.copy_(value)
        self._mark_all()
        self._run(rebases)
        rebased = bool(rebases)
        # Parameters only: a forward pass updates buffers (BatchNorm statistics) in place.
        self._rebased = [(t, t._version) for spec, ts in zip(self.fragments, self._params)
                         for s, t in zip(spec.tensors, ts) if not s.is_buffer] if rebased else None
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _mark(self, fragment: int) -> None:
        """Fragment ``fragment``'s values were just written: its BatchNorm statistics count
        their batches from here."""
        if self._stats:
            self._stats.mark(fragment, self._params[fragment])

    def _mark_all(self) -> None:
        for p in range(len(self.fragments)):
            self._mark(p)

    def _check_model(self) -> None:
        """At the first step: raise if a multi-rank rack does not keep its copies of a
        block equal (``refuse_differing_copies``), if the model no longer holds the
        tensors this optimizer was built on, or if the inner optimizer steps none of them;
        warn if it steps parameters the model does not have. Each would leave rackmend
        reading and writing values the training does not use, with no error anywhere."""
        # First, on every rank alike (a collective): whether the rack keeps its copies equal.
        refuse_differing_copies(self._pieces.differing_copies())
        current = self._current_tensors()
        mismatches = compare(self.fragments, self._params, self._shardings, current, follow=False)
        if mismatches:  # replaced after the check before the inner step: by the inner step itself
            raise self._refusal(mismatches)
        stepped = {id(p) for group in self.inner.param_groups for p in group["params"]}
        synced = [tensor for spec, ts in zip(self.fragments, current) for t, tensor in zip(spec.tensors, ts)
                  if not t.is_buffer]
        if synced and not any(id(p) in stepped for p in synced):
            raise ConfigError(
                "the inner optimizer steps none of the model's parameters (it was built on other tensors, e.g. "
                "before fully_shard or parallelize_module replaced them): build it from model.parameters() after "
                "sharding the model, then RackmendOptimizer")
        mine = {id(p) for p in self.model.parameters()}
        foreign = [p for group in self.inner.param_groups for p in group["params"] if id(p) not in mine]
        if foreign:
            log.warning("learner %s: the inner optimizer steps %d tensors that are not parameters of the model given "
                        "to RackmendOptimizer (shapes %s%s); rackmend never synchronises them, so they train on this "
                        "learner alone. Pass the whole model if they should be merged", self.learner_id,
                        len(foreign), [list(p.shape) for p in foreign[:4]], " ..." if len(foreign) > 4 else "")
        self._model_checked = True  # last: a step retried after a refusal checks again

    def _current_tensors(self) -> list[list[torch.Tensor]]:
        """The model's tensors of each fragment now; ConfigError if one is gone."""
        try:
            return fragment_tensors(self.model, self.fragments)
        except ConfigError as exc:
            raise ConfigError(f"{exc}. The model changed after RackmendOptimizer was built (a parameter frozen, "
                              "renamed or removed: only parameters with requires_grad are synchronised); change it "
                              "first, then build the inner optimizer and RackmendOptimizer") from None

    def _follow_moves(self) -> None:
        """At the first step, before the inner step: take views anew of tensors that a
        launcher gave new memory with the same device, dtype, shape, sharding and values
        (buffers: layout) since this optimizer was built (``accelerator.prepare(model)`` on
        several CPU ranks copies the model to ``cpu:0``); raise for any other change
        (``binding.compare``), or when the inner optimizer still steps a parameter's old
        tensor. At the second step raise for any tensor replaced again (a module that
        assigns a buffer anew at each forward). Never trains on stale views: without this
        the training would go on in memory rackmend never reads."""
        current = self._current_tensors()
        mismatches = compare(self.fragments, self._params, self._shardings, current, follow=self._bound_checks == 0)
        changed = [m for m in mismatches if m.changes]
        if changed:
            raise self._refusal(changed)
        stepped = {id(p) for group in self.inner.param_groups for p in group["params"]}
        unstepped = [m for m in mismatches
                     if not m.spec.is_buffer and id(current[m.fragment][m.index]) not in stepped]
        if unstepped:
            names = ", ".join(m.spec.name for m in unstepped[:3]) + (" ..." if len(unstepped) > 3 else "")
            raise ConfigError(
                f"the model's parameter {names} is not the tensor RackmendOptimizer was built on (its memory (a "
                "tensor assigned anew)), and the inner optimizer still steps the old tensor, so the training would "
                f"never update it{self._under()}. Assign or replace parameters first, then build the inner "
                "optimizer from model.parameters() and RackmendOptimizer")
        if mismatches:
            old = {id(self._params[m.fragment][m.index]) for m in mismatches}
            for m in mismatches:
                self._params[m.fragment][m.index] = local_of(current[m.fragment][m.index])
            if self._rebased is not None:  # the rebase's check follows the tensors too
                self._rebased = [(t, v) for t, v in self._rebased if id(t) not in old] + [
                    (self._params[m.fragment][m.index], self._params[m.fragment][m.index]._version)
                    for m in mismatches if not m.spec.is_buffer]
            if self._moment_params:
                self._moment_params = self._check_desloc()
            log.info("learner %s: %d of the model's tensors moved to new memory (same values and layout) after "
                     "RackmendOptimizer was built%s; rackmend follows them", self.learner_id, len(mismatches),
                     self._under())
        self._bound_checks += 1

    @staticmethod
    def _under() -> str:
        who = launcher()
        return f"; this step runs under {who}" if who else ""

    def _refusal(self, mismatches: list[Mismatch]) -> ConfigError:
        """The error for tensors changed since the optimizer was built, naming the first,
        what changed, and the trainer on the call stack when there is one."""
        m = mismatches[0]
        kind = "buffer" if m.spec.is_buffer else "parameter"
        more = f" (and {len(mismatches) - 1} more tensors)" if len(mismatches) > 1 else ""
        who = launcher()
        cause = (f"this step runs under {who}" if who else
                 "the model changed after the optimizer was built (model.to(), .half(), fully_shard, "
                 "parallelize_module, a tensor assigned anew)")
        return ConfigError(
            f"the model's {kind} {m.spec.name} is not the tensor RackmendOptimizer was built on "
            f"({', '.join(m.changes) or 'its memory (a tensor assigned anew)'}){more}: {cause}, so rackmend would "
            "read and write tensors the training no longer uses. Move, cast and shard the model first, then build "
            "the inner optimizer and RackmendOptimizer"
            + (" (a module that assigns this buffer anew at each forward, instead of updating it in place, cannot "
               "have it synchronised: ScheduleConfig(sync_buffers=False) keeps buffers local)" if m.spec.is_buffer
               else ""))

    def _check_not_overwritten(self) -> None:
        changed = [t for t, v in self._rebased or () if t._version != v]
        self._rebased = None
        if changed:
            raise ResumeOrderError(
                "the model's parameters changed between RackmendOptimizer.load_state_dict and the first step "
                "(e.g. model.load_state_dict after it), which undoes the rebase onto the syncer's newer global "
                "value; restore in this order: model.load_state_dict(...) (optional), build RackmendOptimizer, "
                "opt.load_state_dict(...), then train")

    def flush(self) -> None:
        """Block until every contribution made so far has been handed to the link (they
        are built and sent on rackmend's send thread, off the training thread); raise a
        send's failure. ``close`` and ``state_dict`` do this themselves."""
        self._sends.wait()
        self.bytes_sent = self._bytes_out

    def close(self) -> None:
        """Send what is queued, then leave the run (the syncer stops expecting this
        learner at once). Closing again does nothing: a trainer integration closes at the
        end of training and the script may too."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sends.close()
        finally:
            self.bytes_sent = self._bytes_out
            if self._cuda is not None:
                self._cuda.close()
            if self._scalars is not None:
                self._scalars.close()
            self.link.leave()

    def __enter__(self) -> "RackmendOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the outer loop
    def after_inner_step(self, tokens: float) -> None:
        """Bookkeeping after one inner step; ``step`` calls it for you. A loop that steps
        the inner optimizer itself calls this after each of its steps (on CUDA it then
        orders the device's next writes after this step's snapshot copies)."""
        self._check_open()
        if self._bound_checks < 2 and not self._in_step:  # the caller stepped the inner optimizer itself
            self._follow_moves()
        if not self._model_checked:  # after the first inner step: whether it kept the rack's copies equal
            self._check_model()
        core = self.core
        now = self._clock()
        self._sends.check()
        self.bytes_sent = self._bytes_out
        for report in self.link.poll_advice():
            self.on_fail_slow(report)
        moments = tuple(self.link.poll_moments()) if self._moment_params else ()
        arrived = tuple(self.link.poll())
        if arrived and self._cuda is not None:
            self._cuda.stage(arrived, core.in_flight())
        rack = self._pieces.rack_tokens(tokens) if self.world_size > 1 else None
        self._run(core.handle(InnerStepDone(tokens, arrived, moments, rack_tokens=rack), now))
        self._run(core.handle(ApplyDue(), self._clock()))
        core.handle(TrainingResumed(), self._clock())
        if self._cuda is not None and not self._in_step:
            self._cuda.guard_writes()  # the caller's own inner step comes next

    def _run(self, actions: Sequence[LearnerAction]) -> None:
        """Carry out the core's actions in order (answers to them run at once)."""
        for a in actions:
            if isinstance(a, TakeSnapshot):
                params = self._params[a.fragment]
                # The previous send of this fragment has read its snapshot (pinned buffers
                # are reused; host copies stay at one per fragment in memory).
                self._sends.wait(a.fragment)
                sent = self._stats.sent(a.fragment, params) if self._stats else None
                if self._cuda is not None and params and params[0].is_cuda:
                    pieces, at_send = self._cuda.snapshot(
                        a.fragment, params, a.keep, len(self.core.in_flight()), self.core.owns(a.fragment),
                        [spec.is_buffer for spec in self.fragments[a.fragment].tensors], sent)
                else:
                    pieces = [t.detach().to("cpu", copy=True) for t in (sent or params)]
                    # keep_local adds the progress since the send to the merged value: the
                    # progress of the buffers as they are, not of what was sent for them.
                    at_send = [t.detach().to("cpu", copy=True) for t in params] if sent and a.keep else None
                self._run(self.core.handle(SnapshotTaken(a.fragment, pieces, at_send), self._clock()))
            elif isinstance(a, SendFragment):
                ready = None if self._cuda is None else self._cuda.ready(a.draft.fragment)
                self._sends.submit(self._sender(a, ready), a.draft.fragment)
            elif isinstance(a, ApplyValue):
                self._apply(a)
            elif isinstance(a, (SetValue, Rebase)):
                if self._cuda is not None:
                    self._cuda.forget(a.fragment)
                    self._cuda.guard_writes()
                a.apply_to(self._params[a.fragment])
                self._mark(a.fragment)
            elif isinstance(a, WaitForVersion):
                self._run(self.core.handle(WaitAnswered(a.fragment, self._wait(a)), self._clock()))
            elif isinstance(a, ShareChanges):
                # One small all-gather per step: every rank's offers, from which each
                # rank's core decides the same changes.
                offers = self._pieces.gather_offers(a.offers)
                self._run(self.core.handle(OffersShared(offers), self._clock()))
            elif isinstance(a, SpreadValue):
                upd = self._pieces.spread(a.fragment, a.update, (a.version, a.epoch, a.change == Change.ADOPT))
                self._run(self.core.handle(ChangeAgreed(a.fragment, a.change, upd), self._clock()))
            elif isinstance(a, Log):
                log.log(a.level, "learner %s: %s", self.learner_id, a.message)
            elif isinstance(a, TakeMoments):
                self._run(self.core.handle(MomentsTaken(a.fragment, a.kind, self._take_moments(a)), self._clock()))
            elif isinstance(a, SendMoments):
                self._sends.submit(self._moments_sender(a))
            elif isinstance(a, WaitForMoments):
                self._run(self.core.handle(MomentsAnswered(a.fragment, a.kind, self._wait_moments(a)), self._clock()))
            elif isinstance(a, ApplyMoments):
                self._apply_moments(a)
            else:
                raise TypeError(f"unknown learner action {a!r}")

    def _sender(self, action: SendFragment, copied: Any) -> Callable[[], None]:
        """The send thread's job for ``action``: wait for the snapshot's copy (a CUDA
        event; None on the host), build the contribution, hand it to the link."""
        def job() -> None:
            if copied is not None:
                copied.synchronize()
            contribution, nbytes = action.build()
            self.link.send(contribution)
            self._bytes_out += nbytes
        return job

    def _moments_sender(self, action: SendMoments) -> Callable[[], None]:
        """The send thread's job for ``action`` (after the sends before it, on the one
        thread that sends on the link)."""
        def job() -> None:
            self.link.send_moments(action.contribution)
            self._bytes_out += action.nbytes
        return job

    def _warn_fail_slow(self, report: FailSlowReport) -> None:
        """The default ``on_fail_slow``: a log line naming the slow rank."""
        speed = f"{report.ratio:.2f}x its usual step time ({report.fleet_ratio:.2f}x relative to the fleet)"
        if report.state == "alone":
            log.info("learner %s: the syncer no longer flags rank %d: this learner is the only one left, and with "
                     "no fleet to compare with a slowdown cannot be told from the workload; rounds wait for it again",
                     self.learner_id, report.rank)
        elif report.state == "restored":
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
        """Whether this rank sends and receives fragment p."""
        return self.core.owns(p)

    def _join(self) -> None:
        initial = [[t.detach() for t in params] for params in self._params]
        layout = self.core.layout
        sharded = {"pieces": layout.owned} if layout.sharded else {}
        updates = self.link.join(self.learner_id, self.fragments, initial, self.config.learner.join_timeout,
                                 settings=RunRules.from_config(self.config), **sharded)
        self.syncer_settings: SyncerSettings | None = self.link.syncer_settings
        """The round settings the syncer stated when this learner joined (min_quorum,
        grace_max, weighting, failslow); None from a syncer or link that predates them."""
        if self.syncer_settings is not None and self.rank == 0:
            for text in self._syncer_differences(self.syncer_settings):
                log.warning("%s", text)
        got = {u.fragment: u for u in updates}
        missing = [p for p in range(len(self.fragments)) if p not in got and self.owns(p)]
        if missing:
            raise TransportError(f"join: the syncer sent no value for fragments {missing}")
        for p in range(len(self.fragments)):
            upd = self._pieces.spread(p, got.get(p))  # the owners' values on every rank that holds them
            self._run(self.core.handle(JoinedValue(upd), self._clock()))

    def _syncer_differences(self, syncer: SyncerSettings) -> list[str]:
        """A warning for each round setting of this learner's config that the syncer runs
        with another value of: the learner's ``SyncerConfig`` is never sent, so such a
        value is one the run does not use, though the script says it does."""
        return syncer_differences(self.learner_id, self.config.syncer, syncer)

    def _wait(self, action: WaitForVersion) -> Update:
        t0 = self._clock()
        self._sends.wait()  # the merge waited for needs this learner's sends
        upd = self.link.wait(action.fragment, action.after_version, max(0.0, action.deadline - t0))
        self.blocked_seconds += self._clock() - t0
        if upd is None:
            raise TransportError(
                f"learner {self.learner_id}: no merged value for fragment {action.fragment} within "
                f"{self.config.learner.wait_timeout}s in deterministic mode (is every listed learner running? "
                "raise learner.wait_timeout if merges are legitimately slower)"
            )
        return upd

    # ---------------------------------------------------------------- DES-LOC
    def _check_desloc(self) -> list[list[torch.Tensor]]:
        """The parameters whose moments DES-LOC averages, per fragment; ConfigError when
        the inner optimizer or the link cannot do it. Empty with DES-LOC off."""
        if not self.config.schedule.desloc:
            return []
        inner = self.inner
        if not isinstance(inner, torch.optim.Adam):  # AdamW is a subclass
            raise ConfigError(
                f"DES-LOC (ScheduleConfig.desloc) averages Adam's moments, but the inner optimizer is "
                f"{type(inner).__module__}.{type(inner).__qualname__}; use torch.optim.Adam or AdamW as the inner "
                "optimizer, or turn desloc off")
        if any(g.get("amsgrad") for g in inner.param_groups):
            raise ConfigError(
                "DES-LOC (ScheduleConfig.desloc) cannot be used with Adam(amsgrad=True): its running maximum "
                "max_exp_avg_sq would no longer bound the averaged exp_avg_sq; use amsgrad=False or turn desloc off")
        if not self.link.carries_moments:
            raise ConfigError(f"DES-LOC (ScheduleConfig.desloc) needs a link that carries moments, but "
                              f"{type(self.link).__name__} does not (LearnerLink.carries_moments: send_moments, "
                              "poll_moments, wait_moments); use ZmqLink or InProcessLink")
        # The model's own parameters, not the detached blocks in ``_params``: the inner
        # optimizer keys its state by parameter.
        return [[t for t, spec in zip(ts, frag.tensors) if not spec.is_buffer]
                for ts, frag in zip(fragment_tensors(self.model, self.fragments), self.fragments)]

    def _take_moments(self, action: TakeMoments) -> list[torch.Tensor]:
        """Host copies of the inner optimizer's ``kind`` moments of the fragment's
        parameters; zeros where it has none yet (a parameter never stepped: Adam starts
        its moments from zeros)."""
        out = []
        for param in self._moment_params[action.fragment]:
            moment = self.inner.state.get(param, {}).get(action.kind)
            out.append(torch.zeros(param.shape, dtype=param.dtype) if moment is None
                       else moment.detach().to("cpu", copy=True))
        return out

    @torch.no_grad()
    def _apply_moments(self, action: ApplyMoments) -> None:
        """Overwrite the moments with the syncer's mean. A parameter the optimizer has no
        state for yet keeps none: creating moments at Adam's step 0 would make its bias
        correction amplify them at the first step."""
        for param, value in zip(self._moment_params[action.fragment], action.update.tensors):
            moment = self.inner.state.get(param, {}).get(action.kind)
            if moment is None:
                log.debug("learner %s: no %s yet for a parameter of fragment %d; averaged moments skipped",
                          self.learner_id, action.kind, action.fragment)
                continue
            moment.copy_(value.to(moment.device, non_blocking=True))

    def _wait_moments(self, action: WaitForMoments) -> MomentUpdate:
        t0 = self._clock()
        self._sends.wait()
        upd = self.link.wait_moments(action.fragment, action.kind, action.after_version, action.epoch,
                                     max(0.0, action.deadline - t0))
        self.blocked_seconds += self._clock() - t0
        if upd is None:
            raise TransportError(
                f"learner {self.learner_id}: no averaged {action.kind} moments for fragment {action.fragment} within "
                f"{self.config.learner.wait_timeout}s in deterministic mode (is every listed learner running with "
                "the same ScheduleConfig.desloc settings? a merge_dropped record in the syncer's log names a round "
                "it dropped; raise learner.wait_timeout if merges are slower)")
        return upd

    @torch.no_grad()
    def _apply(self, action: ApplyValue) -> None:
        """A merged value, with the merge-gain probe around it when one is set."""
        p = action.fragment
        before = float(self.probe_loss()) if self.probe_loss is not None else None
        if self._cuda is None:
            action.apply_to(self._params[p])
        else:
            self._cuda.guard_writes()
            self._cuda.on_device(action).apply_to(self._params[p])
        self._mark(p)
        if before is not None:
            assert self.probe_loss is not None
            self._run(self.core.handle(ProbeMeasured(p, before, float(self.probe_loss())), self._clock()))
        if self._scalars is not None:
            self._scalars.applied(Applied(step=self.step_count, staleness=self.version_lags[p],
                                          blocked_s=self.blocked_seconds, bytes_sent=self.bytes_sent,
                                          bytes_received=self.link.bytes_received, merge_gain=self.merge_gains[p]))
        if self.on_apply is not None:
            self.on_apply(p, action.update)
