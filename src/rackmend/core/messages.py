"""The values that cross between a learner and the syncer, independent of transport.

These are plain dataclasses; transports (in-process queues, ZeroMQ) carry them and
the sans-I/O cores consume and produce them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rackmend.codecs.base import Encoded
from rackmend.core.pieces import Piece
from rackmend.core.fragments import FragmentSpec

MOMENT_KINDS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
"""What DES-LOC averages: Adam's first and second moment (its state keys)."""

__all__ = ["Contribution", "Update", "MomentContribution", "MomentUpdate", "MOMENT_KINDS", "moment_spec"]


@dataclass(frozen=True)
class Contribution:
    """A learner's outer gradient for one fragment, with the work behind it."""

    learner_id: str
    fragment: int
    base_version: int
    """Version of the global fragment value the gradient was computed against."""
    step: int
    """The learner's inner-step count when it sent (newer supersedes older)."""
    c_steps: int
    """Inner steps since the learner last received this fragment."""
    c_tokens: float
    """Tokens trained on since the learner last received this fragment."""
    step_time: float
    """Mean seconds per inner step over those steps (0 when unknown)."""
    tensors: tuple[torch.Tensor, ...]
    """Delta = global - local, one tensor per fragment tensor, on the host. With a
    lossy uplink codec these are the *decoded* values, i.e. what the syncer merges."""
    encoded: tuple[Encoded, ...] | None = None
    """The same deltas as encoded by a lossy uplink codec (what a network transport
    ships); None when they travel uncompressed."""
    merge_gain: float | None = None
    """(before - after) / before of the learner's probe loss around applying this
    fragment's previous merged value (positive: the merge helped); None when not measured."""
    session: int = 0
    """Random number a learner rank draws when it connects: ``seq`` counts within it, so a
    restarted learner (whose ``step`` resumes from its checkpoint) is not mistaken for a
    replay. Set by network transports."""
    seq: int = 0
    """Per (learner, fragment, session) sequence number, increasing with every send; the
    syncer refuses one it has seen already or an older one (a replay). 0: unsequenced
    (in-process transports, which cannot replay), not checked."""
    base_epoch: int = 0
    """Epoch of the syncer run whose value ``base_version`` names (see ``Update.epoch``)."""
    rank: int = 0
    """The learner rank that sent it (the owner of the fragment)."""
    rank_steps: int = 0
    """Inner steps of the sending rank since its previous contribution (of any fragment);
    0: not reported (older learners), the syncer then uses ``step_time``."""
    rank_step_time: float = 0.0
    """Median seconds per inner step of the sending rank over those ``rank_steps`` steps:
    disjoint windows, unlike ``step_time`` (whose windows of successive fragments
    overlap), so the fail-slow detector sees each step once and can name the rank; a
    median, so a single stalled step does not read as a slow window."""
    pieces: tuple[Piece, ...] | None = None
    """One rank's share of a sharded rack's contribution: where each of ``tensors`` lies
    in its global tensor (``tensors`` then hold those blocks). None: ``tensors`` are the
    whole fragment. The syncer core only ever sees whole fragments: the service
    assembles a learner's pieces first."""


@dataclass(frozen=True)
class Update:
    """A new global value of one fragment, sent by the syncer."""

    fragment: int
    version: int
    tensors: tuple[torch.Tensor, ...]
    """Full values; receivers must not modify them (they may be shared)."""
    reset: bool = False
    """Sent in answer to a (re)join: the learner adopts it whatever version it holds
    (after a syncer restart versions may go back to the last checkpoint)."""
    epoch: int = 0
    """The syncer run (a random number drawn at each start) that made this value. A
    syncer that crashed and resumed from its checkpoint reissues the version numbers
    after it, with other values: (epoch, version) names a value, a version alone does
    not. A learner treats a value of a new epoch as a rejoin answer (reset)."""
    delta: tuple[Encoded, ...] | None = None
    """With a lossy downlink codec: the change from version - 1 as encoded, which a
    network transport ships instead of ``tensors`` (full value = value of version - 1
    + decode(delta), bit for bit equal to ``tensors``). None: send ``tensors``."""


def moment_spec(fragment: FragmentSpec) -> FragmentSpec:
    """The layout of fragment ``fragment``'s moments: its parameters (not its buffers,
    which no optimizer steps), in the fragment's order, each moment shaped and typed
    like its parameter (as torch's Adam keeps them)."""
    return FragmentSpec(fragment.index, fragment.offset, tuple(t for t in fragment.tensors if not t.is_buffer))


@dataclass(frozen=True)
class MomentContribution:
    """DES-LOC: a learner's optimizer moments of one kind for one fragment's parameters."""

    learner_id: str
    fragment: int
    kind: str
    """``exp_avg`` or ``exp_avg_sq`` (``MOMENT_KINDS``)."""
    base_version: int
    """Version of the last averaged moments of this (fragment, kind) the learner applied
    (0: none yet). Rounds count only contributions based on the current version."""
    step: int
    """The learner's inner-step count when it sent."""
    c_steps: int
    """The fragment's step counter at the send: the same as its parameter send's, so the
    merge weight is the same."""
    c_tokens: float
    """The fragment's token counter at the send."""
    tensors: tuple[torch.Tensor, ...]
    """One tensor per parameter of the fragment (``moment_spec``); with a lossy moments
    codec, the decoded values (what the syncer averages)."""
    encoded: tuple[Encoded, ...] | None = None
    """The encoded values a network transport ships; None: uncompressed."""
    base_epoch: int = 0
    """Epoch of the syncer run whose moments ``base_version`` names."""
    session: int = 0
    """As ``Contribution.session`` (set by network transports)."""
    seq: int = 0
    """As ``Contribution.seq``, counted per (fragment, kind)."""
    rank: int = 0
    """The learner rank that sent it."""


@dataclass(frozen=True)
class MomentUpdate:
    """DES-LOC: the weighted mean of the learners' moments of one kind for one fragment."""

    fragment: int
    kind: str
    version: int
    tensors: tuple[torch.Tensor, ...]
    """Full values (what learners overwrite their moments with); shared, do not modify."""
    epoch: int = 0
    """The syncer run that made it (``Update.epoch``)."""
    encoded: tuple[Encoded, ...] | None = None
    """With a lossy moments codec: the values as encoded (``tensors`` is their decoding)."""
