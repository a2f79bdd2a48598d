"""DES-LOC moment rounds on the syncer: the weighted mean of the learners' Adam moments.

Per (fragment, kind) of moment (``exp_avg``, ``exp_avg_sq``) a round collects the
learners' ``MomentContribution``s and, when it closes, sets the syncer's copy to their
weighted mean (the weights of parameter merges, from the same counters; no outer
optimizer, no learners counted absent), bumps the round's version and sends the mean
to every connected learner. Rounds close like parameter rounds: in deterministic mode
once every expected learner is in, otherwise at quorum plus the grace window or once
every expected, healthy learner is in. Only contributions based on the current version
count as fresh; older ones are averaged along (moments are values, not changes: an
older estimate is still an estimate) without opening a round of their own.

With a lossy moments codec the mean is encoded once and the syncer keeps its decoding,
which is what every learner decodes, so all copies stay bit-identical.

Used by ``rackmend.core.syncer.SyncerCore``, which owns membership, time, the grace
window and the checks of what arrives; nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Any, Callable, Sequence

import torch

from rackmend.config import RackmendConfig
from rackmend.core.fragments import FragmentSpec
from rackmend.core.merge import merge_deltas, merge_weights, normalized_weights
from rackmend.core.messages import MOMENT_KINDS, MomentContribution, MomentUpdate, moment_spec
from rackmend.core.rounds import RoundClock

__all__ = ["MomentRounds", "MomentKey"]

MomentKey = tuple[int, str]
"""(fragment, kind)."""


@dataclass
class _MomentRound:
    pending: dict[str, MomentContribution] = field(default_factory=dict)
    clock: RoundClock = field(default_factory=RoundClock)


class MomentRounds:
    """Every (fragment, kind)'s moment round, version and current mean. See the module docstring."""

    def __init__(self, config: RackmendConfig, fragments: Sequence[FragmentSpec], epoch: int) -> None:
        self.config = config
        self.enabled = config.schedule.desloc
        self.epoch = epoch
        self.specs = [moment_spec(f) for f in fragments]
        self.keys: list[MomentKey] = [(p, kind) for p in range(len(self.specs)) for kind in MOMENT_KINDS]
        self.rounds: dict[MomentKey, _MomentRound] = {k: _MomentRound() for k in self.keys}
        self.versions: dict[MomentKey, int] = {k: 0 for k in self.keys}
        self.current: dict[MomentKey, MomentUpdate] = {}
        """The latest mean of each (fragment, kind); absent before its first round."""
        self.sequences: dict[tuple[str, int, str], tuple[int, int]] = {}
        """Per (learner, fragment, kind), the session and highest ``seq`` accepted (replay guard)."""
        codec = config.compression.build_moments()
        self.codec = None if codec.lossless else codec
        if self.enabled:
            config.compression.require_float32("moments", ((t.name, t.dtype) for s in self.specs for t in s.tensors))

    # ------------------------------------------------------------------ arrival
    def accept(self, c: MomentContribution, now: float) -> list[dict[str, Any]]:
        """Add ``c`` (checked by the syncer core) to its round; log fields of what it replaced."""
        if c.seq > 0:
            self.sequences[(c.learner_id, c.fragment, c.kind)] = (c.session, c.seq)
        key = (c.fragment, c.kind)
        rnd = self.rounds[key]
        old = rnd.pending.get(c.learner_id)
        notes: list[dict[str, Any]] = []
        if old is not None and old.step >= c.step:
            # Values, not work: the newer estimate is the better one, whichever came last.
            notes.append({"learner": c.learner_id, "fragment": c.fragment, "kind": c.kind, "step": c.step,
                          "by_step": old.step})
            return notes
        if old is not None:
            notes.append({"learner": c.learner_id, "fragment": c.fragment, "kind": c.kind, "step": old.step,
                          "by_step": c.step})
        rnd.pending[c.learner_id] = c
        if self._fresh(key, c):
            rnd.clock.arrived(now)
        return notes

    def _fresh(self, key: MomentKey, c: MomentContribution) -> bool:
        # A learner of another epoch (joined before a syncer restart, or never averaged)
        # has no older version here to be behind of.
        return c.base_epoch != self.epoch or c.base_version == self.versions[key]

    # ------------------------------------------------------------------ closing
    def next_deadline(self) -> float | None:
        deadlines = [r.clock.deadline for r in self.rounds.values() if r.clock.deadline is not None]
        return min(deadlines) if deadlines else None

    def due(self, key: MomentKey, now: float, expected: AbstractSet[str], grace: Callable[[], float],
            leave: bool = False) -> bool:
        """Whether round ``key`` closes now. ``leave``: after a graceful leave, close a round
        that waits for nobody any more, quorum or not (as parameter rounds do)."""
        rnd = self.rounds[key]
        fresh = {lid for lid, c in rnd.pending.items() if self._fresh(key, c)}
        if leave:
            return bool(fresh) and expected <= fresh
        return rnd.clock.due(now, len(fresh), bool(expected) and expected <= fresh,
                             deterministic=self.config.deterministic, min_quorum=self.config.syncer.min_quorum,
                             grace=grace)

    def pending_keys(self) -> list[MomentKey]:
        return [k for k in self.keys if self.rounds[k].pending]

    @torch.no_grad()
    def merge(self, key: MomentKey, now: float) -> tuple[MomentUpdate, dict[str, Any]] | None:
        """Close round ``key``: the weighted mean as the new version, and the fields of its
        ``moments`` log record. None (round dropped, reason in the record's place) when the
        mean is not finite, which finite inputs cannot give but is checked all the same."""
        rnd = self.rounds[key]
        ids = sorted(rnd.pending)
        contribs, clipped = self._guard([rnd.pending[i] for i in ids])
        raw = merge_weights(self.config.syncer.weighting, [c.c_tokens for c in contribs],
                            [c.c_steps for c in contribs])
        mean = merge_deltas([c.tensors for c in contribs], raw, "mean")
        encoded = None
        if self.codec is not None:
            encoded = tuple(self.codec.encode(t) for t in mean)
            mean = [self.codec.decode(e) for e in encoded]  # what every learner decodes
        self.rounds[key] = _MomentRound()
        if not all(bool(torch.isfinite(t).all()) for t in mean if t.numel()):
            return None
        self.versions[key] += 1
        p, kind = key
        upd = MomentUpdate(p, kind, self.versions[key], tuple(mean), epoch=self.epoch, encoded=encoded)
        self.current[key] = upd
        first = now if rnd.clock.first_arrival is None else rnd.clock.first_arrival
        fields = {
            "fragment": p, "kind": kind, "version": upd.version, "merged": ids,
            "stale": [c.learner_id for c in contribs if not self._fresh(key, c)],
            "weights": dict(zip(ids, normalized_weights(raw))),
            "tokens": dict(zip(ids, (c.c_tokens for c in contribs))),
            "steps": dict(zip(ids, (c.step for c in contribs))),
            "wait_s": now - first,
            "bytes_in": sum(self._nbytes(c.tensors, c.encoded) for c in contribs),
            "clipped": clipped,
        }
        return upd, fields

    def _guard(self, contribs: list[MomentContribution]) -> tuple[list[MomentContribution], dict[str, dict[str, float]]]:
        """The round's contributions, each clipped to ``norm_guard`` (its square for
        ``exp_avg_sq``) x the lower median of the round's norms when above it; and per clipped learner its norm and the bound.
        Moments are values: honest learners at about the same step hold moments of about
        the same size, so the round itself is the scale (a history would not do: Adam's
        uncorrected second moment grows about linearly over the first 1/(1 - beta2) steps).
        The lower median, because with two learners one liar and one honest learner are
        otherwise a tie; a lone contribution has nothing to be compared with. Without
        this, one learner's huge finite first moment, averaged into every learner's Adam,
        moves all their parameters."""
        factor = self.config.syncer.norm_guard
        if factor <= 0 or len(contribs) < 2:
            return contribs, {}
        if contribs[0].kind == "exp_avg_sq":
            factor *= factor  # a mean of squared gradients: learners' differ as the squares of theirs
        norms = [math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
                               for t in c.tensors if t.numel())) for c in contribs]
        bound = factor * sorted(norms)[(len(norms) - 1) // 2]
        if bound <= 0:
            return contribs, {}
        clipped: dict[str, dict[str, float]] = {}
        out = []
        for c, norm in zip(contribs, norms):
            if norm > bound:
                clipped[c.learner_id] = {"norm": norm, "bound": bound}
                c = replace(c, tensors=tuple((t.to(torch.float64) * (bound / norm)).to(t.dtype) for t in c.tensors))
            out.append(c)
        return out, clipped

    def _nbytes(self, tensors: Sequence[torch.Tensor], encoded: Sequence[Any] | None) -> int:
        if encoded is not None:
            return sum(e.nbytes() for e in encoded)
        return sum(t.numel() * t.element_size() for t in tensors)

    def update_nbytes(self, upd: MomentUpdate) -> int:
        return self._nbytes(upd.tensors, upd.encoded)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors by name, JSON-able rest): the current means and versions, and the
        replay guard's sequence numbers. Pending contributions are not kept."""
        tensors = {f"moments/{p}/{kind}/{i}": t for (p, kind), upd in self.current.items()
                   for i, t in enumerate(upd.tensors)}
        meta = {"versions": [[p, kind, v] for (p, kind), v in self.versions.items() if v > 0],
                "sequences": [[lid, p, kind, sess, seq]
                              for (lid, p, kind), (sess, seq) in sorted(self.sequences.items())]}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore ``state_dict``'s output; a mean saved without its tensors is an error."""
        for p, kind, version in meta.get("versions", []):
            key = (int(p), str(kind))
            if key not in self.versions:
                raise ValueError(f"checkpoint has moments of {kind} for fragment {p}, which this layout lacks")
            spec = self.specs[key[0]]
            names = [f"moments/{p}/{kind}/{i}" for i in range(len(spec.tensors))]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"checkpoint lacks {missing[0]} of moments version {version}")
            values = tuple(tensors[n].clone() for n in names)
            for t, s in zip(values, spec.tensors):
                if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                    raise ValueError(f"checkpoint's {kind} moments of {s.name} are {t.dtype} {list(t.shape)}, the "
                                     f"layout says {s.dtype} {list(s.shape)}")
            self.versions[key] = int(version)
            # Values of the epoch that wrote them: a learner's next send names that epoch.
            self.current[key] = MomentUpdate(key[0], key[1], int(version), values, epoch=self.epoch)
        for lid, p, kind, sess, seq in meta.get("sequences", []):
            self.sequences[(str(lid), int(p), str(kind))] = (int(sess), int(seq))

