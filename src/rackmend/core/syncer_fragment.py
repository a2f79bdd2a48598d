"""One fragment as the syncer holds it, and the names it has in a checkpoint.

``SyncerFragment`` owns everything the syncer keeps per fragment: the global value and
its outer optimizer, the version, the open round (pending contributions and its
``RoundClock``), the earlier values kept for re-anchoring, the norm guard's window and
scale, the merge-gain streak, and its own ``state_dict``/``load_state_dict`` under the
checkpoint key scheme (``theta/{p}/{i}``, ``optim/{p}/...``, ``history/{p}/{v}/{i}``).
Reading the global model out of a checkpoint goes through ``global_values`` (or
``named_global_values``) so that scheme is written in this module only.

What does not live here: deciding what is accepted, merged and sent, and membership
(``core.syncer``), the merge arithmetic (``core.merge``), file I/O (the service).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rackmend.buffers import clone_float32
from rackmend.codecs.base import Encoded
from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution, Update
from rackmend.core.rounds import RoundClock

__all__ = [
    "SyncerFragment",
    "Round",
    "GUARD_WINDOW",
    "GUARD_MIN_NORMS",
    "GUARD_GROWTH",
    "theta_key",
    "global_values",
    "named_global_values",
    "contribution_norm",
    "check_tensors",
]

GUARD_WINDOW = 32
"""Per fragment, how many recent norms of merged, unclipped contributions the norm
guard's median is taken over (``SyncerConfig.norm_guard``). A learner adds at most one
per merge of the fragment (its pending sends of the round count once), so a burst of
sends cannot fill it, and no learner can hold more than its share of it."""

GUARD_MIN_NORMS = 5
"""Nonzero norms a fragment must have seen before the norm guard acts: before that
there is no scale to compare with, and the first contributions of a run are the
largest."""

GUARD_GROWTH = 2.0
"""Most the norm guard's scale may grow from one merge of a fragment to the next: the
scale is the lower median of the window, capped at this multiple of the previous
merge's scale (it may fall freely). A learner that owns most of the window (the only
learner, or the one whose sends close most rounds of a K=1 run) could otherwise raise
its bound by almost ``norm_guard`` (30x) every few merges, sending just under it; this
way a millionfold takes at least log2(10^6) = 20 merges. Honest training stays far
below it: the largest growth from one merge to the next measured on the demo GPT is
given in docs/reliability.md ("Does the guard touch honest training?")."""


GUARD_HISTORY = 1024
"""Merges of a fragment whose guard scale is remembered for the long-horizon cap."""

GUARD_LONG_GROWTH = 2.0
"""Most the guard's scale may stand above the lower median of its last ``GUARD_HISTORY``
values. ``GUARD_GROWTH`` alone compounds (2x per merge: 19 248x in 57 merges once, by a
learner alone sending just under its bound every merge); against the median of its own
history the scale grows at most in proportion to the merges (2x the median, which is
the value of half the merges ago). Honest norms rising linearly from nothing (a
learning-rate warm-up) stand at 2x that median, and the bound is ``norm_guard`` (30)
times the scale, so honest work is clipped only past 60x the history's median."""


def theta_key(p: int, i: int) -> str:
    """The checkpoint name of tensor ``i`` of fragment ``p``'s global value."""
    return f"theta/{p}/{i}"


def global_values(source: Any, layout: Sequence[FragmentSpec]) -> list[list[torch.Tensor]]:
    """Each fragment's global value in a syncer checkpoint, in ``layout``'s order (the
    fragments the checkpoint holds, numbered from 0 as its keys are), checked against
    the layout. ``source``: the checkpoint's tensors by name, or an open safetensors
    file (``safe_open``: only the values are read, not the optimizer state or history).
    Raises ``ValueError`` naming what is missing or does not match."""
    keys = set(source.keys())
    get = source.get_tensor if hasattr(source, "get_tensor") else source.__getitem__
    out = []
    for p, spec in enumerate(layout):
        names = [theta_key(p, i) for i in range(len(spec.tensors))]
        for key, t in zip(names, spec.tensors):
            if key not in keys:
                raise ValueError(f"it lacks {key} ({t.name}): the checkpoint is corrupt or incomplete")
        values = [get(key) for key in names]
        problem = check_tensors(spec, values)
        if problem:
            raise ValueError(f"its global value does not match the layout ({problem}): the checkpoint is corrupt")
        out.append(values)
    return out


def named_global_values(source: Any, layout: Sequence[FragmentSpec]) -> dict[str, torch.Tensor]:
    """``global_values`` by canonical tensor name (a model's ``state_dict`` names)."""
    named: dict[str, torch.Tensor] = {}
    for spec, values in zip(layout, global_values(source, layout)):
        for t, v in zip(spec.tensors, values):
            if t.name in named:
                raise ValueError(f"the layout names {t.name} twice: the checkpoint is corrupt")
            named[t.name] = v
    return named


def check_tensors(spec: FragmentSpec, tensors: Sequence[torch.Tensor]) -> str | None:
    """Why ``tensors`` are not a value of fragment ``spec`` (count, shape, dtype), or None."""
    if len(tensors) != len(spec.tensors):
        return f"fragment {spec.index} has {len(spec.tensors)} tensors, got {len(tensors)}"
    for t, s in zip(tensors, spec.tensors):
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            return f"{s.name}: expected {s.dtype} {list(s.shape)}, got {t.dtype} {list(t.shape)}"
    return None


def contribution_norm(tensors: Sequence[torch.Tensor]) -> float:
    """L2 norm over all of a contribution's tensors, added up in float64; NaN when a value
    is NaN or infinite, inf when the finite values' norm overflows float64. One read of
    each tensor proves it finite too (a NaN or Inf makes its norm non-finite), so the
    syncer checks finiteness with the norm it needs anyway."""
    def one(t: torch.Tensor) -> float:
        if not t.numel():
            return 0.0
        # float32 first: torch's float64 norm of a float32 tensor converts element by
        # element at ~1 GB/s, 25x slower; the guard needs the magnitude, not the last
        # bits. Only a norm that is not finite needs more: the exact check, then, for
        # finite values whose squares overflow float32, the norm again in float64.
        n = float(torch.linalg.vector_norm(t))
        if math.isfinite(n):
            return n * n
        if not bool(torch.isfinite(t).all()):
            return math.nan
        return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2

    return math.sqrt(sum(map(one, tensors)))


def contains(newer: Contribution, older: Contribution) -> bool:
    """Whether ``newer`` (a later send of the same learner and fragment) already holds
    ``older``'s work, so replacing ``older`` by it loses nothing.

    A learner's outer gradient is measured against the global value it holds, and its
    counters run since it last received the fragment. With the same base version it
    applied nothing in between: ``newer`` is cumulative and contains ``older``. With a
    newer base it applied a merged value in between and reset its counters, so the two
    hold disjoint work (to combine), unless ``newer``'s step count reaches back over
    ``older``'s send: then it adopted a rejoin value keeping its progress and counters,
    and ``newer`` is cumulative again."""
    return newer.base_version == older.base_version or newer.c_steps > newer.step - older.step


def combine(older: Contribution, newer: Contribution) -> Contribution:
    """One contribution carrying the disjoint work of two sends of one learner.

    The result is based on ``newer``'s version, with outer gradient
    Δ_older + Δ_newer: by the time of its newer send the learner had applied that
    version, so its model sits on it, and the older work (lost from the learner's
    model by the apply, since the merged value did not contain it) is a displacement
    added on top, as ``keep_local`` adds local progress to a new value. With
    ``anchoring="syncer"`` the sum is then re-anchored once, from ``newer``'s base to
    the current value; re-anchoring the older piece from its own base as well would
    pull the global value back by the merges the learner has since received. Counters
    add up, so the weight reflects both pieces of work."""
    steps = older.c_steps + newer.c_steps
    return Contribution(
        learner_id=newer.learner_id,
        fragment=newer.fragment,
        base_version=newer.base_version,
        step=newer.step,
        c_steps=steps,
        c_tokens=older.c_tokens + newer.c_tokens,
        step_time=(older.step_time * older.c_steps + newer.step_time * newer.c_steps) / steps if steps else 0.0,
        tensors=tuple(o + n for o, n in zip(older.tensors, newer.tensors)),
        encoded=None,
        merge_gain=newer.merge_gain if newer.merge_gain is not None else older.merge_gain,
        base_epoch=newer.base_epoch,
    )


@dataclass
class Round:
    """The contributions one fragment's next merge will take, and when it closes."""

    pending: dict[str, Contribution] = field(default_factory=dict)
    """Per learner, its newest send; it decides freshness and what a later send replaces."""
    carried: dict[str, Contribution] = field(default_factory=dict)
    """Per learner, older work disjoint from its newest send (it applied a merged value
    in between), summed; merged together with the newest send (see ``combine``).
    Kept apart so a later cumulative send replaces only the newest, not this."""
    carried_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes received for ``carried`` (a combined contribution has no encoding of its own)."""
    clock: RoundClock = field(default_factory=RoundClock)
    clipped: set[str] = field(default_factory=set)
    """Learners with a send clipped by the norm guard this round: their merged norm stays
    out of the guard's window (else sends just under the bound would ratchet it up)."""
    norms: dict[str, float] = field(default_factory=dict)
    """Per learner, the norm its ``pending`` send arrived with (finite, not clipped), so
    a merge that takes that send as it is reads its values once, not three times."""

    def pend(self, lid: str, c: Contribution, norm: float | None) -> None:
        """Make ``c`` ``lid``'s newest send, with the norm it was accepted at (None: unknown)."""
        self.pending[lid] = c
        if norm is None:
            self.norms.pop(lid, None)
        else:
            self.norms[lid] = norm

    def known_norm(self, lid: str, c: Contribution) -> float | None:
        """The arrival norm of ``c`` when it is ``lid``'s pending send itself (not combined)."""
        return self.norms.get(lid) if self.pending.get(lid) is c else None

    def effective(self, lid: str) -> Contribution:
        """What is merged for ``lid``: its newest send plus any older disjoint work."""
        c = self.pending[lid]
        old = self.carried.get(lid)
        return c if old is None else combine(old, c)

    def carry(self, lid: str, older: Contribution, nbytes: int) -> None:
        """Keep ``older`` (disjoint from ``lid``'s pending send) to merge with it."""
        prior = self.carried.get(lid)
        self.carried[lid] = older if prior is None else combine(prior, older)
        self.carried_bytes[lid] = self.carried_bytes.get(lid, 0) + nbytes

    def drop(self, lid: str) -> None:
        """Forget everything pending of ``lid``."""
        self.pending.pop(lid, None)
        self.norms.pop(lid, None)
        self.carried.pop(lid, None)
        self.carried_bytes.pop(lid, None)


class SyncerFragment:
    """Fragment ``index``'s global value and everything the syncer keeps beside it."""

    def __init__(self, index: int, spec: FragmentSpec, values: Sequence[torch.Tensor],
                 build_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], epoch: int,
                 *, keep_history: bool) -> None:
        problem = check_tensors(spec, values)
        if problem:
            raise ValueError(problem)
        self.index = index
        """The fragment's number on this syncer (its place in the core's list)."""
        self.spec = spec
        self.epoch = epoch
        self.theta: list[torch.Tensor] = [v.detach().to("cpu", copy=True) for v in values]
        """The global value, stepped in place by ``optimizer``."""
        self.optimizer = build_optimizer(self.theta)
        self.version = 0
        self.round = Round()
        self.keep_history = keep_history
        self.history: dict[int, list[torch.Tensor]] = {0: [t.clone() for t in self.theta]} if keep_history else {}
        """Earlier values by version, the last ``max_staleness`` (``anchoring="syncer"``: a
        contribution based on one of them is re-anchored to the current value)."""
        self.current: Update = self.snapshot()
        """The latest value as sent (a copy: the live tensors change at the next merge)."""
        self.merge_gain: float | None = None
        """The median merge gain the learners reported in the last merge (their probe loss
        before minus after applying the previous value)."""
        self.harmful_streak = 0
        """Consecutive merges whose median gain was harmful (``core.syncer.HARMFUL_LOSS``)."""
        self.norms: deque[float] = deque(maxlen=GUARD_WINDOW)
        """Recent nonzero norms of merged, unclipped contributions, at most one per learner
        per merge (the norm guard's window)."""
        self.norm_steps: deque[int] = deque(maxlen=GUARD_WINDOW)
        """The ``c_steps`` behind those norms (the guard's usual amount of work)."""
        self.norm_learners: deque[str] = deque(maxlen=GUARD_WINDOW)
        """Who sent each of ``norms`` ("" for norms from a checkpoint that predates it):
        a learner's bound is taken from the others' norms (``scale_for``)."""
        self.scale_history: deque[float] = deque(maxlen=GUARD_HISTORY)
        """``norm_scale`` after each merge that set it (the long-horizon cap)."""
        self._long_cap = math.inf
        """``long_cap()`` of the current history, kept: every contribution reads it, and
        the history changes only at a rescale or a load."""
        self.norm_scale: float | None = None
        """The norm the guard's bound is a multiple of: the window's lower median, grown by
        at most ``GUARD_GROWTH`` per merge; None until the window holds ``GUARD_MIN_NORMS``
        norms (no guard yet)."""
        self._spare: tuple[list[torch.Tensor], dict[Any, Any]] | None = None
        """The buffers ``keep`` copies the value and optimizer state into."""

    # ------------------------------------------------------------------ value
    def snapshot(self, delta: tuple[Encoded, ...] | None = None) -> Update:
        """The current value as an ``Update`` (copied, into memory an earlier snapshot no
        longer uses where there is some: a fresh copy faults in every page), remembered as
        ``current``."""
        self.current = Update(self.index, self.version, tuple(clone_float32(t) for t in self.theta),
                              epoch=self.epoch, delta=delta)
        return self.current

    def value_at(self, version: int) -> list[torch.Tensor]:
        """The value this fragment had at ``version`` (kept for re-anchoring)."""
        return self.history[version]

    def keep(self) -> tuple[list[torch.Tensor], dict[Any, Any]]:
        """The value and outer optimizer state before a step, to roll back a non-finite
        result (and to encode the downlink change from): copied into buffers kept across
        merges, since a fresh clone of a large fragment costs a page fault per 4 KiB,
        several times the copy itself."""
        spare, spare_state = self._spare or ([], {})
        if [t.shape for t in spare] != [t.shape for t in self.theta]:
            spare = [t.detach().clone() for t in self.theta]
        else:
            for o, t in zip(spare, self.theta):
                o.copy_(t)
        state: dict[Any, Any] = {}
        for k, st in self.optimizer.state.items():
            kept = spare_state.get(k, {})
            state[k] = {n: (kept[n].copy_(v) if isinstance(kept.get(n), torch.Tensor) and kept[n].shape == v.shape
                            else v.clone()) if isinstance(v, torch.Tensor) else v for n, v in st.items()}
        self._spare = (spare, state)
        return spare, state

    @torch.no_grad()
    def roll_back(self, old: list[torch.Tensor], old_state: dict[Any, Any]) -> None:
        """Undo a step: ``keep``'s value and optimizer state back in place."""
        for theta, o in zip(self.theta, old):
            theta.copy_(o)
        self.optimizer.state.clear()
        # Copies: the kept buffers are overwritten by the next merge's ``keep``.
        self.optimizer.state.update({k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
                                     for k, st in old_state.items()})

    def advance(self, max_staleness: int, delta: tuple[Encoded, ...] | None) -> int:
        """The stepped value becomes the next version (kept for re-anchoring, sent as
        ``current``); the round starts over. Returns the new version."""
        self.version += 1
        if self.keep_history:
            hist = self.history
            evicted = [hist.pop(v) for v in [v for v in hist if v < self.version - max_staleness]]
            # An evicted version's tensors take the new one: copying into memory already
            # touched is several times faster than filling a fresh allocation.
            hist[self.version] = ([o.copy_(t) for o, t in zip(evicted[0], self.theta)] if evicted
                                  else [t.clone() for t in self.theta])
        self.snapshot(delta)
        return self.version

    # ------------------------------------------------------------------ norm guard
    def guard_usual_steps(self) -> int:
        """The median ``c_steps`` behind the guard's window (0 when none)."""
        steps = self.norm_steps
        return sorted(steps)[len(steps) // 2] if steps else 0

    def window_median(self) -> float:
        """The window's lower median, before the growth cap."""
        return sorted(self.norms)[(len(self.norms) - 1) // 2]

    def note_norms(self, ids: Sequence[str], contribs: Sequence[Contribution]) -> None:
        """Add the norms of a merge's contributions to the guard window, one per learner
        (``contribs`` are each learner's combined work), leaving out those with a clipped
        send this round; then update the guard's scale."""
        for lid, c in zip(ids, contribs):
            if lid in self.round.clipped:
                continue
            norm = self.round.known_norm(lid, c)
            if norm is None:
                norm = contribution_norm(c.tensors)
            if norm > 0 and math.isfinite(norm):  # a zero delta says nothing about the scale
                self.norms.append(norm)
                self.norm_learners.append(lid)
                if c.c_steps > 0:
                    self.norm_steps.append(c.c_steps)
        self.rescale()

    def rescale(self) -> None:
        """Set the guard scale from the window: the lower median (with two learners and
        one entry each per merge, the upper one would be the larger learner's, so one liar
        beside one honest learner would set it), at most ``GUARD_GROWTH`` x the previous
        scale and ``GUARD_LONG_GROWTH`` x the lower median of its recent history."""
        if len(self.norms) < GUARD_MIN_NORMS:
            return
        scale = self.window_median()
        if self.norm_scale is not None:
            scale = min(scale, GUARD_GROWTH * self.norm_scale)
        self.norm_scale = min(scale, self._long_cap)
        self.scale_history.append(self.norm_scale)
        self._long_cap = self.long_cap()

    def long_cap(self) -> float:
        """``GUARD_LONG_GROWTH`` x the lower median of the scale's recent history (inf
        while it holds fewer than ``GUARD_MIN_NORMS`` values)."""
        h = self.scale_history
        if len(h) < GUARD_MIN_NORMS:
            return math.inf
        return GUARD_LONG_GROWTH * sorted(h)[(len(h) - 1) // 2]

    def scale_for(self, learner: str) -> float | None:
        """The scale of the guard's bound for a contribution of ``learner``: the lower
        median of the window's norms the other learners sent (leave-one-out: what a
        learner sends never raises its own bound), under the long-horizon cap; the
        fragment's scale when fewer than ``GUARD_MIN_NORMS`` came from others (a learner
        alone: docs/reliability.md says what the guard can do then). None: no guard yet."""
        if self.norm_scale is None:
            return None
        others = sorted(n for n, lid in zip(self.norms, self.norm_learners) if lid != learner)
        if len(others) < GUARD_MIN_NORMS:
            return self.norm_scale
        return min(others[(len(others) - 1) // 2], self._long_cap)

    def note_gain(self, median: float, harmful: float) -> int:
        """Record a merge's median gain; the streak of those below ``-harmful``."""
        self.merge_gain = median
        self.harmful_streak = self.harmful_streak + 1 if median < -harmful else 0
        return self.harmful_streak

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors under this fragment's checkpoint keys, its plain JSON-able rest)."""
        p = self.index
        tensors = {theta_key(p, i): t.detach() for i, t in enumerate(self.theta)}
        sd = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{p}/{idx}/{key}"] = value
                else:
                    scalars.setdefault(str(idx), {})[key] = value
        for v, hist in self.history.items():
            for i, t in enumerate(hist):
                tensors[f"history/{p}/{v}/{i}"] = t
        meta = {"version": self.version, "optim": {"param_groups": sd["param_groups"], "scalars": scalars},
                "norms": list(self.norms), "norm_steps": list(self.norm_steps), "norm_scale": self.norm_scale,
                "norm_learners": list(self.norm_learners), "scale_history": list(self.scale_history)}
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``'s output (``meta``: this fragment's entry of a
        ``CheckpointMeta``, which fills in what older formats lack)."""
        p = self.index
        values = [tensors[theta_key(p, i)] for i in range(len(self.spec.tensors))]
        problem = check_tensors(self.spec, values)
        if problem:
            raise ValueError(f"checkpoint does not match the layout: {problem}")
        with torch.no_grad():
            for t, v in zip(self.theta, values):
                t.copy_(v)
        state: dict[int, dict[str, Any]] = {}
        hist: dict[int, list[torch.Tensor]] = {}
        for key, value in tensors.items():
            parts = key.split("/")
            if parts[0] == "optim" and parts[1] == str(p):
                state.setdefault(int(parts[2]), {})[parts[3]] = value.clone()
            elif parts[0] == "history" and parts[1] == str(p):
                hist.setdefault(int(parts[2]), [None] * len(self.spec.tensors))[int(parts[3])] = value.clone()  # type: ignore[list-item]
        for idx, scalars in meta["optim"]["scalars"].items():
            state.setdefault(int(idx), {}).update(scalars)
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["optim"]["param_groups"]})
        self.history = hist
        self.version = int(meta["version"])
        self.snapshot()
        self.round = Round()
        self.norms = deque((float(x) for x in meta["norms"]), maxlen=GUARD_WINDOW)
        self.norm_steps = deque((int(x) for x in meta["norm_steps"]), maxlen=GUARD_WINDOW)
        self.norm_learners = deque((str(x) for x in meta["norm_learners"]), maxlen=GUARD_WINDOW)
        self.scale_history = deque((float(x) for x in meta["scale_history"]), maxlen=GUARD_HISTORY)
        self._long_cap = self.long_cap()
        self.norm_scale = None if meta["norm_scale"] is None else float(meta["norm_scale"])
        if self.norm_scale is None:
            self.rescale()  # a window without a scale (format 1 before the growth cap): the window's
