"""The learner's rules as a sans-I/O state machine: one state object per fragment.

``LearnerCore.handle(event, now)`` takes what happened (an inner step finished with
its tokens, a snapshot was taken, a merged value the driver waited for came in, ...)
and returns typed actions (take a snapshot of fragment p, send this contribution,
apply this value by this rule, wait for a version newer than v until a deadline).
It owns the rules of Decoupled DiLoCo's learner side (``../DESIGN.md`` §1):

- when a fragment is due: after inner step t when ``(t - t_p) mod H == 0``;
- the outer gradient ``held - local`` against the global value held, through the
  uplink codec's error feedback (computed when the driver builds the send,
  ``SendFragment.build``, which it may do on another thread), and what rides along
  with it: step and token counters, step time, this rank's step times for fail-slow
  detection, the merge gain measured when the previous value was applied;
- when a merged value is applied: at ``t_send + tau`` of this learner's own send, or
  on the first step after it arrives if later; in deterministic mode it waits for
  it there instead (``WaitForVersion``);
- how: ``overwrite``, ``mix`` or ``keep_local`` (``ApplyValue``), the counters reset
  (``keep_local`` keeps the steps made since the send), a rejoin answer adopted by
  rebasing local progress onto it (``Rebase``);
- inside a multi-rank learner, which pieces this rank owns (sends, and receives
  merged values of: ``RankLayout``, from ``rackmend.core.pieces``'s owner rule), the
  outer gradient over those pieces only, and which changes all ranks must agree on
  at a step: every owner's offer (``ShareChanges``), gathered from all ranks
  (``OffersShared``), decides the same on every rank (``SpreadValue``); owners that
  received different versions pin the newest of them and apply it once all hold it.
- DES-LOC (``ScheduleConfig.desloc``): every K_u (K_v) steps, with a parameter send of
  the fragment, take Adam's ``exp_avg`` (``exp_avg_sq``) of the fragment's parameters
  (``TakeMoments``), send them with the fragment's counters (``SendMoments``), and
  overwrite them with the syncer's weighted mean at t_send + tau (``ApplyMoments``;
  in deterministic mode ``WaitForMoments`` there first).

What does not live here: the clock (``now`` is passed in), the link to the syncer,
collectives between ranks, device copies (the driver takes snapshots, through pinned
buffers on CUDA), the model and inner optimizer, user callbacks. The driver is
``rackmend.learner.RackmendOptimizer``; a simulator can drive the same core.

Pieces: every fragment value here is a list of *pieces*, one local tensor per tensor
of the fragment: this rank's block of it (``FragmentState.pieces`` says where each
lies in the global tensor). For a plain rack a block is the whole tensor; for a
sharded one (FSDP2, tensor parallel, HSDP) it is the rank's local shard, and a
contribution carries the owned blocks with their places (``Contribution.pieces``).
Which rank holds which block is read from DTensors by ``rackmend.learner.pieces``;
the collectives that agree on changes and bring the owners' values to the other
ranks are the driver's.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from rackmend.codecs.feedback import FeedbackEncoder
from rackmend.config import ConfigError, RackmendConfig
from rackmend.core.fragments import FragmentSpec, fragment_problem, fragments_due
from rackmend.core.messages import MOMENT_KINDS, Contribution, MomentContribution, MomentUpdate, Update, moment_spec
from rackmend.core.pieces import Piece, RankLayout, pieces_problem, plain_layout, wire_pieces

__all__ = [
    "LearnerCore",
    "FragmentState",
    "InFlight",
    "Pieces",
    "Change",
    "JoinedValue",
    "InnerStepDone",
    "SnapshotTaken",
    "ApplyDue",
    "WaitAnswered",
    "ChangeAgreed",
    "Offer",
    "MAX_OFFER_VALUES",
    "OffersShared",
    "ProbeMeasured",
    "TrainingResumed",
    "MomentsTaken",
    "MomentsAnswered",
    "MomentState",
    "TakeMoments",
    "SendMoments",
    "WaitForMoments",
    "ApplyMoments",
    "LearnerEvent",
    "SetValue",
    "Rebase",
    "TakeSnapshot",
    "OuterGradient",
    "SendFragment",
    "WaitForVersion",
    "ShareChanges",
    "SpreadValue",
    "ApplyValue",
    "Log",
    "LearnerAction",
]

Pieces = list[torch.Tensor]
"""One fragment's value on this rank: a tensor per piece, in the fragment's order."""


class Change(enum.IntEnum):
    """What happens to a fragment at a step, as the ranks of a learner agree on it
    (an integer, so that it travels in the driver's all-gather)."""

    NONE = 0
    APPLY = 1
    """Apply the merged value by the configured rule."""
    ADOPT = 2
    """Adopt a rejoin answer (``Update.reset``): rebase local progress onto it."""


ValueKey = tuple[int, int]
"""(version, epoch): names one value of a fragment (``Update``)."""

MAX_OFFER_VALUES = 2
"""Values an ``Offer`` names at most: the newest received and the pinned one."""


@dataclass(frozen=True)
class Offer:
    """What one rank owning pieces of a fragment offers at a step (``ShareChanges``)."""

    change: Change
    """``NONE``: not due (``values`` may be held already), or due with nothing received
    yet; ``APPLY``: due, with ``values``; ``ADOPT``: a rejoin answer received."""
    values: tuple[ValueKey, ...] = ()
    """The values this rank holds, newest first: the newest received and the pinned one
    (``FragmentState.pin``) when it holds that too; at most ``MAX_OFFER_VALUES``."""


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class JoinedValue:
    """The syncer's current value of one fragment, received at join (on every rank)."""

    update: Update


@dataclass(frozen=True)
class InnerStepDone:
    """The training loop finished an inner step at ``now``."""

    tokens: float
    """What this rank trained on in the step."""
    arrived: tuple[Update, ...] = ()
    """Updates the link received since the previous step, oldest first."""
    moments: tuple[MomentUpdate, ...] = ()
    """DES-LOC: averaged moments the link received since the previous step, oldest first."""
    rack_tokens: float | None = None
    """What the whole learner trained on in the step: the sum of its ranks' ``tokens``
    (the driver sums them). None: ``tokens`` x world size, as if every rank's were equal."""


@dataclass(frozen=True)
class SnapshotTaken:
    """The host copy asked for by ``TakeSnapshot``, taken at ``now``."""

    fragment: int
    pieces: Pieces
    """Host tensors, one per piece. When the action said ``keep`` and ``at_send`` is None,
    memory the driver does not reuse (the core holds it until the value is applied)."""
    at_send: Pieces | None = None
    """``keep``: where the driver keeps the copy the value's application needs, when not
    in ``pieces`` (a CUDA driver keeps it on the device: a copy there costs no host time
    and the apply then needs no host-to-device transfer). Same shapes as ``pieces``."""


@dataclass(frozen=True)
class ApplyDue:
    """After this step's sends: apply what is due now (t >= t_send + tau)."""


@dataclass(frozen=True)
class WaitAnswered:
    """The value ``WaitForVersion`` asked for (a newer version or a rejoin answer)."""

    fragment: int
    update: Update


@dataclass(frozen=True)
class OffersShared:
    """Multi-rank: every rank's ``ShareChanges`` offers of this step, gathered by the
    driver, the same on every rank: ``offers[r][p]`` is rank r's for fragment p, None
    where rank r owns no piece of p."""

    offers: tuple[tuple[Offer | None, ...], ...]


@dataclass(frozen=True)
class ChangeAgreed:
    """Multi-rank: all ranks agreed on ``change`` for ``fragment`` (``SpreadValue``);
    ``update`` is the owners' value as this rank holds it: one local tensor per piece
    (``FragmentState.pieces``), the blocks other ranks own brought over by the driver."""

    fragment: int
    change: Change
    update: Update


@dataclass(frozen=True)
class ProbeMeasured:
    """The probe loss just before and just after an ``ApplyValue`` was carried out."""

    fragment: int
    before: float
    after: float


@dataclass(frozen=True)
class TrainingResumed:
    """The driver hands control back to the training loop at ``now``: the next inner
    step's time is measured from here, so rackmend's own time (sends, waits, probes)
    does not count as step time."""


@dataclass(frozen=True)
class MomentsTaken:
    """DES-LOC: the moments asked for by ``TakeMoments``, one host tensor per parameter of
    the fragment (``moment_spec``); zeros for a parameter the optimizer has no state of
    yet (what Adam starts its moments from)."""

    fragment: int
    kind: str
    pieces: Pieces


@dataclass(frozen=True)
class MomentsAnswered:
    """DES-LOC: the averaged moments ``WaitForMoments`` asked for."""

    fragment: int
    kind: str
    update: MomentUpdate


LearnerEvent = Union[JoinedValue, InnerStepDone, SnapshotTaken, ApplyDue, WaitAnswered, OffersShared, ChangeAgreed,
                     ProbeMeasured, TrainingResumed, MomentsTaken, MomentsAnswered]


# ---------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class SetValue:
    """Write ``value`` into the fragment's local pieces (join)."""

    fragment: int
    value: Pieces

    @torch.no_grad()
    def apply_to(self, pieces: Sequence[torch.Tensor]) -> None:
        for piece, v in zip(pieces, self.value):
            piece.copy_(v)


@dataclass(frozen=True)
class Rebase:
    """Move the local pieces from base ``old`` to base ``new``, keeping the progress made
    on top of ``old``: piece += new - old. A rejoin answer (the syncer restarted or
    forgot this learner), or a checkpoint restored under a newer global value."""

    fragment: int
    old: Pieces
    new: Pieces

    @torch.no_grad()
    def apply_to(self, pieces: Sequence[torch.Tensor]) -> None:
        for piece, o, n in zip(pieces, self.old, self.new):
            piece.add_((n - o).to(piece.device))


@dataclass(frozen=True)
class TakeSnapshot:
    """Copy the fragment's local pieces to host memory and answer ``SnapshotTaken``."""

    fragment: int
    keep: bool
    """The core holds the copy until the value is applied (``keep_local``): it must be
    memory the driver does not reuse."""


@dataclass
class OuterGradient:
    """What a send's outer gradient is computed from: the owned pieces of the global
    value held at the send and of the snapshot, and the uplink codec's error feedback."""

    fragment: int
    held: tuple[torch.Tensor, ...]
    """The owned pieces of the global value held when the send was made."""
    local: tuple[torch.Tensor, ...]
    """The owned pieces of the snapshot."""
    uplink: FeedbackEncoder | None
    """A lossy uplink codec with the learner's error feedback; None: sent uncompressed."""
    nbytes: int
    """Bytes of the owned pieces, uncompressed."""
    computed: bool = False
    """Set by the one ``SendFragment.build``."""


@dataclass(frozen=True)
class SendFragment:
    """Send the fragment's contribution to the syncer; ``build()`` makes it.

    ``draft`` is the contribution without its outer gradient (counters, what rides
    along). ``build`` computes ``held - local`` of the owned pieces and passes it through
    a lossy uplink codec's error feedback. It reads only tensors nobody writes any more
    (a new global value replaces the held one, never writes it; the snapshot is the
    driver's memory, not to be reused before ``build`` returns), so a driver may call it
    later and on another thread, once the snapshot's copy is complete: each send's
    ``build`` once, in the order the actions came (the error feedback runs through them
    in that order). It keeps the arithmetic and the wire off the training thread."""

    draft: Contribution
    outer: OuterGradient

    def build(self) -> tuple[Contribution, int]:
        """The contribution to send and its bytes of outer gradient (encoded bytes with
        a lossy uplink codec)."""
        o = self.outer
        if o.computed:
            raise RuntimeError(f"the send of fragment {o.fragment} at step {self.draft.step} was built twice; "
                               "build each SendFragment once (a second build would feed the codec's error "
                               "feedback twice)")
        o.computed = True
        delta = tuple(_difference(h, t) for h, t in zip(o.held, o.local))
        if o.uplink is None:
            return replace(self.draft, tensors=delta), o.nbytes
        pairs = [o.uplink.encode_decoded((o.fragment, i), d) for i, d in enumerate(delta)]
        encoded = tuple(enc for enc, _ in pairs)
        # The decoded values: what the syncer will merge, bit for bit.
        return (replace(self.draft, tensors=tuple(dec for _, dec in pairs), encoded=encoded),
                sum(enc.nbytes() for enc in encoded))


@dataclass(frozen=True)
class WaitForVersion:
    """Deterministic mode: block until the fragment's value newer than ``after_version``
    (or a rejoin answer) arrives, then answer ``WaitAnswered``; fail with an error
    if ``deadline`` (a ``now`` value) passes first."""

    fragment: int
    after_version: int
    deadline: float


@dataclass(frozen=True)
class ShareChanges:
    """Multi-rank: gather every rank's ``offers`` (a collective: every rank makes one per
    ``ApplyDue``) and answer ``OffersShared`` with them. A fragment changes when every
    rank owning a piece of it offers the same change and they hold a value in common
    (the newest such is taken): an owner offering ``Change.NONE`` holds it back, so every
    rank's blocks change at the same step. Where their values differ, the core pins one
    for them to converge on. Offers not agreed on are made again at the next
    ``ApplyDue``."""

    offers: tuple[Offer | None, ...]
    """One per fragment: this rank's offer where it owns pieces of it, else None."""


@dataclass(frozen=True)
class SpreadValue:
    """Multi-rank, on every rank in the same order: the ranks agreed on ``change`` to value
    (``version``, ``epoch``) of ``fragment``. Bring the owners' pieces of it to every rank
    holding copies of their blocks (a collective), then answer ``ChangeAgreed``."""

    fragment: int
    change: Change
    version: int
    epoch: int
    update: Update | None
    """This rank's owned pieces of the value; None on a rank owning none of the fragment."""


@dataclass(frozen=True)
class ApplyValue:
    """Apply merged value ``update`` to the fragment's local pieces by ``rule``. When the
    driver measures merge gains it answers ``ProbeMeasured``."""

    fragment: int
    update: Update
    rule: str
    """``overwrite``, ``mix`` or ``keep_local`` (``LearnerConfig.apply``, resolved)."""
    alpha: float
    """``mix``: the share of the local value kept."""
    at_send: Pieces | None
    """``keep_local``: the copy taken at the send (host, or where ``SnapshotTaken.at_send``
    kept it); the progress since then stays."""

    @torch.no_grad()
    def apply_to(self, pieces: Sequence[torch.Tensor]) -> None:
        for i, (piece, value) in enumerate(zip(pieces, self.update.tensors)):
            value = value.to(piece.device, non_blocking=True)
            if self.rule == "overwrite":
                piece.copy_(value)
            elif self.rule == "mix":
                piece.mul_(self.alpha).add_(value, alpha=1 - self.alpha)
            else:
                assert self.at_send is not None
                # merged + (local - at send), in place: float addition commutes, so these
                # are the bits of value + progress without two temporaries.
                piece.sub_(self.at_send[i].to(piece.device, non_blocking=True)).add_(value)


@dataclass(frozen=True)
class Log:
    """A line for the learner's log; nothing to act on."""

    level: int
    message: str


@dataclass(frozen=True)
class TakeMoments:
    """DES-LOC: copy the inner optimizer's ``kind`` moments of the fragment's parameters to
    host memory and answer ``MomentsTaken``."""

    fragment: int
    kind: str


@dataclass(frozen=True)
class SendMoments:
    """DES-LOC: send ``contribution`` (moments of one kind of one fragment) to the syncer."""

    contribution: MomentContribution
    nbytes: int
    """Bytes of moments: encoded bytes with a lossy moments codec."""


@dataclass(frozen=True)
class WaitForMoments:
    """DES-LOC, deterministic mode: block until averaged ``kind`` moments of the fragment
    newer than ``after_version`` (or of another syncer epoch than ``epoch``) arrive, then
    answer ``MomentsAnswered``; fail with an error if ``deadline`` passes first."""

    fragment: int
    kind: str
    after_version: int
    epoch: int
    deadline: float


@dataclass(frozen=True)
class ApplyMoments:
    """DES-LOC: overwrite the inner optimizer's ``kind`` moments of the fragment's
    parameters with ``update.tensors`` (in ``moment_spec`` order)."""

    fragment: int
    kind: str
    update: MomentUpdate


LearnerAction = Union[SetValue, Rebase, TakeSnapshot, SendFragment, WaitForVersion, ShareChanges, SpreadValue,
                      ApplyValue, Log, TakeMoments, SendMoments, WaitForMoments, ApplyMoments]


# ------------------------------------------------------------------------------ state
@dataclass
class InFlight:
    """A send of a fragment not yet answered by an applied value."""

    step: int
    """t_send: the inner step after which it was sent."""
    at_send: Pieces | None
    """The copy taken at the send, kept for ``keep_local`` (host, or where the driver
    kept it: ``SnapshotTaken.at_send``)."""
    counts: tuple[int, float, float]
    """(c_steps, c_tokens, c_time) at the send: what the send carried."""


@dataclass
class MomentState:
    """DES-LOC: one kind of moment of one fragment."""

    kind: str
    period: int
    """K_u or K_v: inner steps between two sends."""
    version: int = 0
    """Version of the last averaged moments applied (0: none yet)."""
    epoch: int = 0
    """Syncer epoch of that version."""
    in_flight: int | None = None
    """t_send of the latest send not yet answered by applied moments."""
    arrived: MomentUpdate | None = None
    """The newest averaged moments received and not applied yet (they wait for t_send + tau)."""

    def newer(self, upd: MomentUpdate, than: "MomentUpdate | None" = None) -> bool:
        """Whether ``upd`` is newer than the moments applied (or than ``than``); versions of
        two syncer epochs do not compare, so another epoch's counts as newer."""
        version, epoch = (self.version, self.epoch) if than is None else (than.version, than.epoch)
        return upd.epoch != epoch or upd.version > version


@dataclass
class FragmentState:
    """Everything this rank knows about one fragment."""

    spec: FragmentSpec
    pieces: tuple[Piece | None, ...]
    """Where each piece of a value (one per tensor of the fragment) lies in its global
    tensor: this rank's block of it, the whole tensor on a plain rack; None where the
    rank holds nothing of the tensor (its piece is an empty tensor)."""
    owned: tuple[Piece, ...]
    """The pieces this rank sends and receives merged values of (``RankLayout.owned``);
    empty where other ranks own all of the fragment's blocks this rank holds."""
    held: Pieces = field(default_factory=list)
    """The global value held (the base of the next outer gradient); empty before join."""
    version: int = 0
    """The version of ``held`` (``Update.version``)."""
    epoch: int = 0
    """The syncer epoch of ``held`` (``Update.epoch``)."""
    c_steps: int = 0
    """Inner steps since the fragment's value was last applied."""
    c_tokens: float = 0.0
    """The learner's tokens over those steps."""
    c_time: float = 0.0
    """Seconds of those steps."""
    in_flight: InFlight | None = None
    """This rank's latest send (or, on a rank that does not own the fragment, its
    owner's), until a value answers it."""
    arrived: Update | None = None
    """The newest value received and not applied yet (it waits for t_send + tau)."""
    pin: ValueKey | None = None
    """Multi-rank: the value the fragment's owners converge on after they offered
    different ones, the same on every rank (from the gathered offers); None while they
    agree."""
    pinned: Update | None = None
    """This rank's received value of ``pin``, kept when newer ones arrive: an owner holds
    at most two received values not applied, ``arrived`` and this, each of its owned
    pieces only."""
    split: tuple[int, float, int] | None = None
    """Multi-rank: (step, now, step of the next warning) since the owners, due, first held
    no value in common; None while they agree."""
    merge_gain: float | None = None
    """Relative probe-loss change (before - after) / before of the last value applied."""
    gain_to_report: float | None = None
    """``merge_gain``, until the fragment's next contribution carries it to the syncer."""
    version_lag: int = 0
    """For the last value applied: how many versions beyond the next one after the value
    held before (0: the very next; more: merges happened in between). Within one
    syncer epoch; a value of a new epoch counts 0."""

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def owns(self) -> bool:
        """Whether this rank sends (pieces of) the fragment."""
        return bool(self.owned)

    @property
    def owned_nbytes(self) -> int:
        """Bytes of the owned pieces, uncompressed."""
        return sum(pc.numel * self.spec.tensors[pc.tensor].dtype.itemsize for pc in self.owned)

    def counts(self) -> tuple[int, float, float]:
        return self.c_steps, self.c_tokens, self.c_time


class LearnerCore:
    """One learner rank's rules; see the module docstring. ``fragments[p].index`` must be p.
    ``layout``: this rank's blocks and owned pieces (``rackmend.core.pieces.rank_layout``
    over every rank's blocks); None for a plain rack (``plain_layout``)."""

    def __init__(self, config: RackmendConfig, fragments: Sequence[FragmentSpec], *, learner_id: str,
                 rank: int = 0, world_size: int = 1, layout: RankLayout | None = None) -> None:
        wrong = [(i, f.index) for i, f in enumerate(fragments) if f.index != i]
        if wrong:
            raise ValueError(f"fragment {wrong[0][0]} of the layout says index {wrong[0][1]}; fragments must be "
                             "numbered 0..P-1 in order (build them with pack_fragments)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
        self.config = config
        self.learner_id = learner_id
        self.rank = rank
        self.world_size = world_size
        self.rule = config.apply_rule()
        """``learner.apply`` with ``auto`` resolved."""
        layout = layout if layout is not None else plain_layout(fragments, rank, world_size)
        _check_layout(fragments, layout, world_size)
        self.layout = layout
        self.fragments = [FragmentState(spec, blocks, owned)
                          for spec, blocks, owned in zip(fragments, layout.blocks, layout.owned)]
        self._specs = list(fragments)
        self._wire = [(wire_pieces(f.spec, f.owned), f.owned_nbytes) for f in self.fragments]
        """Per fragment, what its contributions name as pieces and their bytes (the layout's)."""
        H = config.schedule.sync_every
        self._due = [fragments_due(r or H, fragments, H) for r in range(H)]
        """Per step mod H, the fragments sent after such a step (``fragments_due``)."""
        self.step = 0
        """Inner steps done (t)."""
        self.rank_times: list[float] = []
        """Seconds of each step of this rank since its previous contribution (fail-slow timing)."""
        self.ready_at: float | None = None
        """When the training loop got control back last (``TrainingResumed``)."""
        uplink = config.compression.build_uplink()
        self.uplink: FeedbackEncoder | None = None if uplink.lossless else FeedbackEncoder(uplink)
        """Error feedback and codec state per (fragment, piece) of a lossy uplink codec.
        Only the owner rank of a fragment encodes it (it is the only one sending)."""
        config.compression.require_float32("uplink", ((t.name, t.dtype) for f in fragments for t in f.tensors))
        self._snapshots_asked: set[int] = set()
        self.moments: list[dict[str, MomentState]] = self._moment_states(fragments)
        """DES-LOC: per fragment, the state of each moment kind averaged (empty when off)."""
        self._moments_asked: set[tuple[int, str]] = set()
        self._moment_specs = [moment_spec(f) for f in fragments]
        moments = config.compression.build_moments()
        self.moment_codec = None if moments.lossless else moments
        """The lossy codec moments travel with, or None (no error feedback: values travel)."""
        if self.moments:
            config.compression.require_float32(
                "moments", ((t.name, t.dtype) for f in self._moment_specs for t in f.tensors))
        self._waiting: int | None = None
        """The fragment of the latest ``WaitForVersion``, until answered. A wait that fails
        (the driver raises) is asked again at the next ``ApplyDue``."""
        self._offered: tuple[Offer | None, ...] | None = None
        """Multi-rank: the offers of the latest ``ShareChanges``, until ``OffersShared``."""

    # ------------------------------------------------------------------ public API
    def handle(self, event: LearnerEvent, now: float) -> list[LearnerAction]:
        """Apply one event at time ``now`` (seconds, any monotonic origin) and return
        what the driver must do, in order."""
        actions: list[LearnerAction] = []
        if isinstance(event, InnerStepDone):
            self._step_done(event, now, actions)
        elif isinstance(event, TrainingResumed):  # every step, like InnerStepDone: checked early
            self.ready_at = now
        elif isinstance(event, SnapshotTaken):
            self._snapshot_taken(event, actions)
        elif isinstance(event, ApplyDue):
            self._apply_due(now, actions)
        elif isinstance(event, WaitAnswered):
            self._wait_answered(event, now, actions)
        elif isinstance(event, OffersShared):
            self._offers_shared(event, now, actions)
        elif isinstance(event, ChangeAgreed):
            self._change_agreed(event, actions)
        elif isinstance(event, ProbeMeasured):
            self._probe_measured(event)
        elif isinstance(event, MomentsTaken):
            self._moments_taken(event, actions)
        elif isinstance(event, MomentsAnswered):
            self._moments_answered(event, now, actions)
        elif isinstance(event, JoinedValue):
            f = self._fragment(event.update.fragment)
            f.held = list(event.update.tensors)
            f.version, f.epoch = event.update.version, event.update.epoch
            actions.append(SetValue(f.index, f.held))
        else:
            raise TypeError(f"unknown event {event!r}")
        return actions

    def owns(self, p: int) -> bool:
        """Whether this rank sends (pieces of) fragment p and receives their values."""
        return self.fragments[p].owns

    def in_flight(self) -> tuple[int, ...]:
        """Fragments sent and not yet answered by an applied value, ascending."""
        return tuple(f.index for f in self.fragments if f.in_flight is not None)

    def state_dict(self) -> dict:
        """Counters, versions, the values held, the uplink's residuals (copies)."""
        return {
            "step": self.step,
            "versions": [f.version for f in self.fragments],
            "epochs": [f.epoch for f in self.fragments],
            "c_steps": [f.c_steps for f in self.fragments],
            "c_tokens": [f.c_tokens for f in self.fragments],
            "c_time": [f.c_time for f in self.fragments],
            "held": [[t.clone() for t in f.held] for f in self.fragments],
            "uplink": {} if self.uplink is None else self.uplink.state_dict(),
            "moment_versions": [{k: [m.version, m.epoch] for k, m in ms.items()} for ms in self.moments],
            "rank": self.rank,
            "world_size": self.world_size,
            "blocks": _blocks_listed(self.layout.blocks),
            "owned": _owned_listed(self.layout.owned),
        }

    def load_state_dict(self, state: Mapping) -> list[Rebase]:
        """Restore ``state_dict``'s counters and values. Where the value held now (from
        join) is newer than the saved one, the saved value is not taken back: the
        returned ``Rebase`` actions move the restored local pieces onto the newer value.
        Fragments in flight are forgotten (their sends belong to the earlier run)."""
        n = len(self.fragments)
        lengths = {k: len(state[k]) for k in ("versions", "held", "c_steps", "c_tokens", "c_time")}
        if any(v != n for v in lengths.values()):
            raise ValueError(f"the saved learner state has {lengths} entries per fragment, this layout has {n} "
                             "fragments; it was saved with another model or schedule.num_fragments")
        self._check_saved_blocks(state)
        self.step = int(state["step"])
        epochs = [int(e) for e in state.get("epochs", [0] * n)]  # older saves lack them
        for f, steps, tokens, seconds in zip(self.fragments, state["c_steps"], state["c_tokens"], state["c_time"]):
            f.c_steps, f.c_tokens, f.c_time = int(steps), float(tokens), float(seconds)
        if self.uplink is not None:
            # Without its residuals a restored learner would silently drop what the
            # codec held back before the checkpoint.
            self.uplink.load_state_dict(state.get("uplink", {}))
        rebases: list[Rebase] = []
        for f, version, held, epoch in zip(self.fragments, state["versions"], state["held"], epochs):
            joined = bool(f.held)
            # Versions of two syncer epochs do not compare: a joined value of another
            # epoch than the saved one is the current one.
            if not joined or (epoch == f.epoch and int(version) >= f.version):
                f.held = [t.clone() for t in held]
                f.version, f.epoch = int(version), epoch
            else:
                rebases.append(Rebase(f.index, old=list(held), new=f.held))
            f.in_flight = None
            f.pin, f.pinned, f.split = None, None, None
        for ms, saved in zip(self.moments, state.get("moment_versions", ())):  # older saves lack them
            for kind, (version, epoch) in saved.items():
                if kind in ms:
                    ms[kind].version, ms[kind].epoch = int(version), int(epoch)
                    ms[kind].in_flight, ms[kind].arrived = None, None
        return rebases

    def _check_saved_blocks(self, state: Mapping) -> None:
        """Raise unless ``state`` holds this rank's blocks: a sharded rack's state is per
        rank, and another rank's (the same shapes under even sharding) or another
        sharding's would put values into the wrong places without an error."""
        saved = state.get("blocks")
        mine = _blocks_listed(self.layout.blocks)
        if saved is None:  # older saves: only the shapes of the blocks' values held can be checked
            mine = [[None if b is None else [None, b[1]] for b in f] for f in mine]
            saved = [[None if b is None else [None, list(t.shape)] for t, b in zip(held, ours)]
                     for held, ours in zip(state["held"], mine)]
        for f, (theirs, ours) in enumerate(zip(saved, mine)):
            for i, (a, b) in enumerate(zip(theirs, ours)):
                if a != b:
                    name = self._specs[f].tensors[i].name
                    where = (f"saved by rank {state['rank']} of {state['world_size']}" if "rank" in state
                             else "saved by another rank or sharding")
                    raise ValueError(
                        f"this learner state was {where}: of {name} (fragment {f}) it holds the block "
                        f"{_describe_block(a)}, this rank (rank {self.rank} of {self.world_size}) holds "
                        f"{_describe_block(b)}. Load each rank's own state, saved with the same sharding; after a "
                        "change of sharding, resume without it (the learner joins with the global value)")
        if state.get("uplink") and state.get("owned", _owned_listed(self.layout.owned)) != _owned_listed(
                self.layout.owned):
            # The same blocks (a replica's state) but other pieces sent: the codec's error
            # feedback is per piece sent, and this rank's own would be lost.
            raise ValueError(
                f"this learner state was saved by rank {state.get('rank')} of {state.get('world_size')}, which sends "
                f"other pieces than this rank (rank {self.rank}); its uplink codec's residuals (error feedback) "
                "belong to those pieces. Load each rank's own state")

    # ------------------------------------------------------------------ the step
    def _step_done(self, event: InnerStepDone, now: float, actions: list[LearnerAction]) -> None:
        dt = 0.0 if self.ready_at is None else now - self.ready_at
        self.step += 1
        learner_tokens = event.tokens * self.world_size if event.rack_tokens is None else event.rack_tokens
        for f in self.fragments:
            f.c_steps += 1
            f.c_tokens += learner_tokens
            f.c_time += dt
        if dt > 0:  # the first step has no start time to measure from
            self.rank_times.append(dt)
        for upd in event.arrived:
            self._absorb(upd, actions)
        for mu in event.moments:
            self._absorb_moments(mu)
        for p in self._due[self.step % len(self._due)]:
            self._moments_due_to_send(p, actions)
            f = self.fragments[p]
            keep = self.rule == "keep_local"
            if f.owns or keep:
                self._snapshots_asked.add(p)
                actions.append(TakeSnapshot(p, keep=keep))
            else:
                # The owner rank sends; this rank only tracks the round so it applies in step.
                f.in_flight = InFlight(self.step, None, f.counts())

    def _absorb(self, upd: Update, actions: list[LearnerAction]) -> None:
        f = self._fragment(upd.fragment)
        pending = f.arrived if f.arrived is not None and f.arrived.reset else None
        if self.world_size > 1 and pending is not None and not upd.reset and upd.epoch == pending.epoch:
            # A newer value of the run whose rejoin answer waits to be adopted is adopted
            # instead: the rack's ranks may have rejoined versions apart.
            upd = replace(upd, reset=True)
        if upd.reset and self.world_size > 1:
            if pending is None or upd.epoch != pending.epoch or upd.version > pending.version:
                self._hold(f, upd)  # adopted on every rank at once, at ApplyDue
        elif upd.reset:
            self._adopt(f, upd, actions)
        elif upd.version <= f.version:
            actions.append(Log(logging.DEBUG, f"fragment {f.index}: version {upd.version} arrived, {f.version} is "
                                              "held already; ignored"))
        elif f.arrived is None or upd.version > f.arrived.version:
            # A value for a fragment not sent yet waits for that fragment's own send: the
            # send then carries this learner's progress as a stale contribution that rides
            # along with the next round instead of opening a round of its own.
            self._hold(f, upd)

    @staticmethod
    def _hold(f: FragmentState, upd: Update) -> None:
        """``upd`` is the newest value received; the pinned one is kept as well."""
        f.arrived = upd
        if f.pin == _key(upd):
            f.pinned = upd
        elif upd.reset and f.pinned is not None and not (f.pinned.reset and f.pinned.epoch == upd.epoch):
            f.pinned = None  # a value from before the rejoin: never adopted

    def _snapshot_taken(self, event: SnapshotTaken, actions: list[LearnerAction]) -> None:
        p = event.fragment
        if p not in self._snapshots_asked:
            raise RuntimeError(f"a snapshot of fragment {p} came in, but none was asked for (TakeSnapshot)")
        self._snapshots_asked.discard(p)
        f = self.fragments[p]
        if len(event.pieces) != len(f.pieces):
            raise ValueError(f"the snapshot of fragment {p} has {len(event.pieces)} pieces, the fragment {len(f.pieces)}")
        for t, block, spec in zip(event.pieces, f.pieces, f.spec.tensors):
            if (tuple(t.shape) != block.shape) if block is not None else t.numel():
                raise ValueError(f"the snapshot of fragment {p}, {spec.name}: shape {list(t.shape)}, this rank "
                                 f"holds {list(block.shape) if block is not None else 'nothing'} of it")
        if event.at_send is not None:
            shapes = [list(t.shape) for t in event.pieces]
            if [list(t.shape) for t in event.at_send] != shapes:
                raise ValueError(f"the snapshot of fragment {p}: at_send has shapes "
                                 f"{[list(t.shape) for t in event.at_send]}, the pieces {shapes}")
        keep = (event.pieces if event.at_send is None else event.at_send) if self.rule == "keep_local" else None
        if not f.owns:
            f.in_flight = InFlight(self.step, keep, f.counts())
            return
        gain, f.gain_to_report = f.gain_to_report, None
        draft = Contribution(
            learner_id=self.learner_id,
            fragment=p,
            base_version=f.version,
            base_epoch=f.epoch,
            step=self.step,
            c_steps=f.c_steps,
            c_tokens=f.c_tokens,
            step_time=f.c_time / f.c_steps if f.c_steps else 0.0,
            tensors=(),
            merge_gain=gain,
            rank=self.rank,
            rank_steps=len(self.rank_times),
            rank_step_time=statistics.median(self.rank_times) if self.rank_times else 0.0,
            pieces=self._wire[p][0],
        )
        self.rank_times = []
        f.in_flight = InFlight(self.step, keep, f.counts())
        outer = OuterGradient(p, tuple(f.held[pc.tensor] for pc in f.owned),
                              tuple(event.pieces[pc.tensor] for pc in f.owned), self.uplink, self._wire[p][1])
        actions.append(SendFragment(draft, outer))

    def _apply_due(self, now: float, actions: list[LearnerAction]) -> None:
        """Resolve, in fragment order, every fragment at or past t_send + tau. Returns early
        with a ``WaitForVersion`` last; its answer resumes here."""
        if self.world_size > 1:
            self._share_due(now, actions)
            return
        for f in self.fragments:
            if not self._due_now(f):
                continue
            upd, f.arrived = f.arrived, None
            if upd is None:
                if self.config.deterministic:
                    self._wait_for(f, now, actions)
                    return
                continue  # applied on the first step after it arrives
            self._resolve(f, upd, actions)
        self._apply_moments_due(now, actions)

    def _share_due(self, now: float, actions: list[LearnerAction]) -> None:
        offers: list[Offer | None] = []
        for f in self.fragments:
            if not f.owns:
                offers.append(None)
            elif f.arrived is not None and f.arrived.reset:
                offers.append(Offer(Change.ADOPT, _values(f)))
            elif not self._due_now(f) or f.arrived is None:
                if self._due_now(f) and self.config.deterministic:
                    self._wait_for(f, now, actions)
                    return
                # Values held before they are due count too: the owners pin one early.
                offers.append(Offer(Change.NONE, _values(f)))
            else:
                offers.append(Offer(Change.APPLY, _values(f)))
        # ``arrived`` stays until the ranks agree (ChangeAgreed): another owner of the
        # fragment's blocks may not be ready at this step, or hold another version.
        self._offered = tuple(offers)
        actions.append(ShareChanges(self._offered))

    def _offers_shared(self, event: OffersShared, now: float, actions: list[LearnerAction]) -> None:
        """Decide, from every rank's offers, what changes now. The same offers reach every
        rank and nothing else decides, so every rank decides the same."""
        table, n = event.offers, len(self.fragments)
        if len(table) != self.world_size or any(len(row) != n for row in table):
            raise ValueError(f"OffersShared holds {[len(row) for row in table]} offers per rank, expected "
                             f"{self.world_size} ranks x {n} fragments")
        if self._offered is None or table[self.rank] != self._offered:
            raise RuntimeError(f"rank {self.rank}: the gathered offers give this rank {table[self.rank]}, but it "
                               f"offered {self._offered}; was OffersShared answered to another ShareChanges?")
        self._offered = None
        for f in self.fragments:
            owners = {r: row[f.index] for r, row in enumerate(table) if row[f.index] is not None}
            agreed = self._agree(f, owners, now, actions)
            if agreed is None:
                continue
            change, key = agreed
            mine = None
            if f.owns:
                mine = next((u for u in (f.arrived, f.pinned) if u is not None and _key(u) == key), None)
                if mine is None:  # every owner offered ``key``, this one included
                    raise RuntimeError(f"rank {self.rank}: the ranks agreed on version {key[0]} of fragment "
                                       f"{f.index}, which this rank does not hold")
            f.pin, f.pinned, f.split = None, None, None
            actions.append(SpreadValue(f.index, change, key[0], key[1], mine))

    def _agree(self, f: FragmentState, owners: Mapping[int, Offer], now: float,
               actions: list[LearnerAction]) -> tuple[Change, ValueKey] | None:
        """The change of fragment ``f`` all its owners make now, or None: when they are due
        (or hold rejoin answers), the newest value they all hold. Otherwise pin the value
        they converge on (``_pin``)."""
        if not owners:
            raise ValueError(f"fragment {f.index}: no rank offers for it; every fragment needs an owner")
        changes = {o.change for o in owners.values()}
        change = Change.ADOPT if Change.ADOPT in changes else Change.APPLY
        if changes == {change}:
            common = set.intersection(*(set(o.values) for o in owners.values()))
            if common:
                return change, max(common)
        # Rejoin answers wait for the other owners' (every rank gets one) and are what
        # they converge on; otherwise any value an owner holds is. A lone owner (a plain
        # rack's fragment) agrees with itself once due.
        holding = {r: o for r, o in owners.items() if o.values and (change == Change.APPLY or o.change == change)}
        if holding and len(owners) > 1:
            self._pin(f, holding, owners, change in changes, now, actions)
        return None

    def _pin(self, f: FragmentState, holding: Mapping[int, Offer], owners: Mapping[int, Offer], due: bool,
             now: float, actions: list[LearnerAction]) -> None:
        """Pin the newest value any owner holds (``holding``: those offering values) unless
        the pin is still on its way: some owner lacks it and none received a newer one
        without it. Each owner keeps the pinned value once received, so at the next step they
        likely hold it in common: an owner whose poll came before another's received the
        pin by its next poll, which comes after the other's (the ranks meet in every
        step's collectives), unless its link delivers more than a step late. Refreshed
        every step until due, the pin is the newest value of the step before, so a value
        is applied at t_send + tau as on one process. ``due``: the owners could have
        changed now (the split is timed and, if it lasts, logged)."""
        newest = {r: o.values[0] for r, o in holding.items()}
        skipped = [r for r, o in holding.items() if f.pin is not None and f.pin not in o.values
                   and (newest[r][1] != f.pin[1] or newest[r][0] > f.pin[0])]
        reached = f.pin is not None and all(f.pin in o.values for o in owners.values())
        if f.pin is None or skipped or reached:
            if f.pin is not None and skipped:
                # In-order links deliver every version; one that fell behind gets the newest
                # value only (the syncer's outbox), so that pin could never reach it.
                actions.append(Log(logging.DEBUG, f"rank {self.rank}: fragment {f.index}: rank {skipped[0]} received "
                                                  f"version {newest[skipped[0]][0]} but not the pinned version "
                                                  f"{f.pin[0]} (its link skipped it); pinning the newest again"))
            f.pin = max(newest.values())
            f.pinned = f.arrived if f.arrived is not None and _key(f.arrived) == f.pin else None
        if not due:
            return
        if f.split is None:
            f.split = (self.step, now, self.step + self.config.schedule.sync_every)
            return
        since, t0, warn_at = f.split
        if self.step < warn_at:
            return
        f.split = (since, t0, self.step + 2 * (self.step - since))  # again once it lasted three times as long
        if self.rank != min(owners) or f.pin is None:
            return  # one rank of the rack says it
        held = ", ".join(f"rank {r} v{o.values[0][0]}" if o.values else f"rank {r} none" for r, o in owners.items())
        lacking = [r for r, o in owners.items() if f.pin not in o.values]
        actions.append(Log(logging.WARNING, (
            f"fragment {f.index}: the ranks owning it have not held one merged value in common for "
            f"{self.step - since} steps ({now - t0:.1f} s): newest per rank {held}; pinned version "
            f"{f.pin[0]}, not yet received by rank(s) {lacking}. The rack keeps version "
            f"{f.version} meanwhile and its contributions grow stale. A rank's link to the syncer delivers late "
            "or not at all: check that rank's connection and the syncer's log")))

    def _due_now(self, f: FragmentState) -> bool:
        return f.in_flight is not None and self.step >= f.in_flight.step + self.config.schedule.overlap

    def _wait_for(self, f: FragmentState, now: float, actions: list[LearnerAction]) -> None:
        self._waiting = f.index
        actions.append(WaitForVersion(f.index, f.version, now + self.config.learner.wait_timeout))

    def _wait_answered(self, event: WaitAnswered, now: float, actions: list[LearnerAction]) -> None:
        if event.fragment != self._waiting or event.update.fragment != event.fragment:
            raise RuntimeError(f"WaitAnswered for fragment {event.fragment} with a value of fragment "
                               f"{event.update.fragment}, but the core waits for fragment {self._waiting}")
        self._waiting = None
        f = self.fragments[event.fragment]
        if self.world_size > 1:
            self._hold(f, event.update)
        else:
            self._resolve(f, event.update, actions)
        self._apply_due(now, actions)

    def _change_agreed(self, event: ChangeAgreed, actions: list[LearnerAction]) -> None:
        f = self._fragment(event.fragment)
        if event.change == Change.ADOPT:
            self._adopt(f, event.update, actions)
        elif event.change == Change.APPLY:
            if f.in_flight is None:
                raise RuntimeError(f"rank {self.rank}: the ranks agreed to apply fragment {f.index}, which this rank "
                                   "has not sent; were the ranks' steps out of step?")
            upd = event.update
            if f.arrived is not None and not (f.arrived.epoch == upd.epoch and f.arrived.version > upd.version):
                f.arrived = None  # applied now (a newer one, when owners agreed on a pinned value, stays)
            self._apply(f, upd, f.in_flight, actions)
        else:
            raise ValueError(f"ChangeAgreed for fragment {f.index} with {event.change!r}; only nonzero changes are agreed")

    def _resolve(self, f: FragmentState, upd: Update, actions: list[LearnerAction]) -> None:
        if upd.reset:
            # The syncer forgot this learner (silence, restart) while we waited: its
            # contribution is gone, so no merge will answer it. Adopt the value and
            # take part again from the fragment's next send.
            self._adopt(f, upd, actions)
        else:
            assert f.in_flight is not None
            self._apply(f, upd, f.in_flight, actions)

    def _apply(self, f: FragmentState, upd: Update, sent: InFlight, actions: list[LearnerAction]) -> None:
        same_epoch = upd.epoch == f.epoch
        f.version_lag = max(0, upd.version - f.version - 1) if same_epoch else 0
        f.held = list(upd.tensors)
        f.version, f.epoch = upd.version, upd.epoch
        f.in_flight = None
        if self.rule == "keep_local":
            # The steps made since the send are still in the local value: they count
            # in the next contribution.
            s, k, c = sent.counts
            f.c_steps -= s
            f.c_tokens -= k
            f.c_time -= c
        else:
            f.c_steps, f.c_tokens, f.c_time = 0, 0.0, 0.0
        actions.append(ApplyValue(f.index, upd, self.rule, self.config.learner.mix_alpha, sent.at_send))

    def _adopt(self, f: FragmentState, upd: Update, actions: list[LearnerAction]) -> None:
        """A rejoin answer (e.g. the syncer restarted from a checkpoint): take its value
        as the new base and keep the local progress made on top of the old one."""
        # Whatever was sent is forgotten by the syncer (or will be answered as a plain
        # update, applied after this learner's next send of the fragment).
        f.in_flight = None
        newer = f.arrived is not None and f.arrived.epoch == upd.epoch and f.arrived.version > upd.version
        # A newer value than the one adopted (the ranks agreed on a pinned one) is
        # applied like any merged value, after the fragment's next send.
        f.arrived = replace(f.arrived, reset=False) if newer and f.arrived is not None else None
        f.pin, f.pinned, f.split = None, None, None
        f.epoch = upd.epoch
        if upd.version == f.version and all(map(torch.equal, f.held, upd.tensors)):
            return
        new = list(upd.tensors)
        actions.append(Rebase(f.index, old=f.held, new=new))
        f.held = new
        f.version = upd.version

    def _probe_measured(self, event: ProbeMeasured) -> None:
        f = self._fragment(event.fragment)
        before, after = event.before, event.after
        # Relative, so one threshold fits every model's loss scale.
        gain = (before - after) / abs(before) if before else 0.0
        f.merge_gain = gain
        if math.isfinite(gain):  # a non-finite probe is the user's to see, not the syncer's
            f.gain_to_report = gain

    # ------------------------------------------------------------------ DES-LOC
    def _moment_states(self, fragments: Sequence[FragmentSpec]) -> list[dict[str, MomentState]]:
        sch = self.config.schedule
        if not sch.desloc:
            return []
        if self.world_size > 1:
            raise ConfigError(
                f"DES-LOC (ScheduleConfig.desloc) needs a single-process learner, but this one has "
                f"{self.world_size} ranks: the averaged moments would reach one rank's optimizer only. Turn "
                "desloc off for multi-rank learners")
        ku, kv = sch.moment_periods()
        return [{"exp_avg": MomentState("exp_avg", ku), "exp_avg_sq": MomentState("exp_avg_sq", kv)}
                for _ in fragments]

    def _moments_due_to_send(self, p: int, actions: list[LearnerAction]) -> None:
        """With fragment p's parameter send after this step: the moment kinds due too."""
        if not self.moments:
            return
        offset = self._specs[p].offset
        for kind in MOMENT_KINDS:
            ms = self.moments[p][kind]
            if (self.step - offset) % ms.period == 0:
                self._moments_asked.add((p, kind))
                actions.append(TakeMoments(p, kind))

    def _moments_taken(self, event: MomentsTaken, actions: list[LearnerAction]) -> None:
        key = (event.fragment, event.kind)
        if key not in self._moments_asked:
            raise RuntimeError(f"moments {event.kind} of fragment {event.fragment} came in, but none were asked "
                               "for (TakeMoments)")
        self._moments_asked.discard(key)
        p, spec = event.fragment, self._moment_specs[event.fragment]
        if len(event.pieces) != len(spec.tensors):
            raise ValueError(f"the {event.kind} moments of fragment {p} have {len(event.pieces)} pieces, the "
                             f"fragment has {len(spec.tensors)} parameters")
        tensors = tuple(event.pieces)
        encoded = None
        nbytes = spec.nbytes
        if self.moment_codec is not None:
            encoded = tuple(self.moment_codec.encode(t) for t in tensors)
            tensors = tuple(self.moment_codec.decode(e) for e in encoded)  # what the syncer averages
            nbytes = sum(e.nbytes() for e in encoded)
        f, ms = self.fragments[p], self.moments[p][event.kind]
        ms.in_flight = self.step
        actions.append(SendMoments(MomentContribution(
            learner_id=self.learner_id, fragment=p, kind=event.kind, base_version=ms.version, base_epoch=ms.epoch,
            step=self.step, c_steps=f.c_steps, c_tokens=f.c_tokens, tensors=tensors, encoded=encoded,
            rank=self.rank), nbytes))

    def _absorb_moments(self, upd: MomentUpdate) -> None:
        if not self.moments:
            raise RuntimeError(f"averaged moments of fragment {upd.fragment} arrived, but DES-LOC is off here")
        ms = self._fragment_moments(upd.fragment, upd.kind)
        if ms.newer(upd) and (ms.arrived is None or ms.newer(upd, ms.arrived)):
            ms.arrived = upd  # applied at t_send + tau of this learner's own send, like a parameter value

    def _apply_moments_due(self, now: float, actions: list[LearnerAction]) -> None:
        """After the parameter values due now: overwrite the moments due (t >= t_send + tau),
        in fragment and kind order; in deterministic mode wait for them."""
        tau = self.config.schedule.overlap
        for p, states in enumerate(self.moments):
            for kind in MOMENT_KINDS:
                ms = states[kind]
                if ms.in_flight is None or self.step < ms.in_flight + tau:
                    continue
                if ms.arrived is not None:
                    self._apply_moments(p, ms, ms.arrived, actions)
                elif self.config.deterministic:
                    actions.append(WaitForMoments(p, kind, ms.version, ms.epoch,
                                                  now + self.config.learner.wait_timeout))
                    return

    def _moments_answered(self, event: MomentsAnswered, now: float, actions: list[LearnerAction]) -> None:
        ms = self._fragment_moments(event.fragment, event.kind)
        upd = event.update
        if (upd.fragment, upd.kind) != (event.fragment, event.kind) or not ms.newer(upd):
            raise RuntimeError(f"MomentsAnswered for {event.kind} of fragment {event.fragment} with {upd.kind} of "
                               f"fragment {upd.fragment}, version {upd.version}; version {ms.version} is held")
        self._apply_moments(event.fragment, ms, upd, actions)
        self._apply_moments_due(now, actions)

    def _apply_moments(self, p: int, ms: MomentState, upd: MomentUpdate, actions: list[LearnerAction]) -> None:
        ms.version, ms.epoch = upd.version, upd.epoch
        ms.in_flight, ms.arrived = None, None
        actions.append(ApplyMoments(p, ms.kind, upd))

    def _fragment_moments(self, p: int, kind: str) -> MomentState:
        if kind not in MOMENT_KINDS:
            raise ValueError(f"moment kind {kind!r} is not one of {', '.join(MOMENT_KINDS)}")
        return self.moments[self._fragment(p).index][kind]

    def _fragment(self, p: int) -> FragmentState:
        problem = fragment_problem(p, len(self.fragments))
        if problem:
            raise ValueError(problem)
        return self.fragments[p]


def _key(upd: Update) -> ValueKey:
    return upd.version, upd.epoch


def _values(f: FragmentState) -> tuple[ValueKey, ...]:
    """The values an owner holds and could change to, newest first (``Offer.values``)."""
    out = tuple(_key(u) for u in (f.arrived, f.pinned) if u is not None)
    return out[:1] if len(out) == 2 and out[0] == out[1] else out


def _blocks_listed(blocks: Sequence[Sequence[Piece | None]]) -> list[list[list[list[int]] | None]]:
    """A rank's blocks as plain lists, [offsets, shape] per tensor (None: it holds none),
    as a checkpoint keeps them."""
    return [[None if b is None else [list(b.offsets), list(b.shape)] for b in f] for f in blocks]


def _owned_listed(owned: Sequence[Sequence[Piece]]) -> list[list[list[Any]]]:
    """A rank's owned pieces as plain lists, [tensor, offsets, shape] each."""
    return [[[pc.tensor, list(pc.offsets), list(pc.shape)] for pc in f] for f in owned]


def _describe_block(block: Any) -> str:
    if block is None:
        return "nothing"
    offsets, shape = block
    return f"of shape {shape}" if offsets is None else f"at {offsets} of shape {shape}"


def _check_layout(fragments: Sequence[FragmentSpec], layout: RankLayout, world_size: int) -> None:
    """Raise ValueError naming what is wrong when ``layout`` cannot be this rank's part of
    ``fragments``: one entry per fragment and tensor, owned pieces well formed and each
    the rank's own block of its tensor."""
    if len(layout.blocks) != len(fragments) or any(len(b) != len(f.tensors) for f, b in zip(fragments, layout.blocks)):
        raise ValueError(f"the rank layout has blocks for {[len(b) for b in layout.blocks]} tensors per fragment, the "
                         f"fragments have {[len(f.tensors) for f in fragments]}; build it with rank_layout over "
                         "these fragments")
    problem = pieces_problem(fragments, layout.owned)
    if problem:
        raise ValueError(f"the rank layout's owned pieces: {problem}")
    for f, blocks, owned in zip(fragments, layout.blocks, layout.owned):
        foreign = [pc for pc in owned if blocks[pc.tensor] != pc]
        if foreign:
            raise ValueError(f"fragment {f.index}: the rank layout owns {foreign[0]}, which is not this rank's block "
                             f"of that tensor ({blocks[foreign[0].tensor]})")
    if layout.sharded and world_size < 2:
        raise ValueError("a sharded rank layout needs world_size >= 2 (one process holds every tensor whole)")


_NUMPY_DTYPES = (torch.float32, torch.float64)  # float16: numpy and torch may round differently
_TORCH_GRAIN = 32768
"""Elements below which torch computes an elementwise op on the calling thread alone
(``at::internal::GRAIN_SIZE``): there its own subtraction costs less than the trip
through NumPy."""


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b``, the same bits as torch's. Host tensors of ``_TORCH_GRAIN`` elements or
    more go through numpy, on this thread alone: torch would wake its intra-op pool (every
    core by default) for a small, memory-bound op, and on a GPU host those threads contend
    with the training thread's kernel launches (H200, 19M-parameter GPT, ``make
    gpu-check``: 3.7 ms per step in this subtraction with torch's 16 threads)."""
    if a.device.type != "cpu" or b.device.type != "cpu" or a.dtype != b.dtype or a.dtype not in _NUMPY_DTYPES \
            or a.shape != b.shape or a.numel() < _TORCH_GRAIN:
        return a - b
    out = torch.empty_like(a, memory_format=torch.contiguous_format)
    np.subtract(a.numpy(), b.numpy(), out=out.numpy())
    return out
