"""What the syncer service tracks to report on itself: per learner id the bytes, steps,
contributions and version lag that ``rackmend status`` shows (``LearnerStats``), each
fragment's latest merge, and the progress line logged every ``progress_every`` seconds.

``Tracker.status`` builds the fragments' and learners' part of the status answer; the
syncer's own part (its counters, endpoint, state) is ``ServiceCore.status``'s. The
Prometheus metrics are ``rackmend.service.metrics``'s; the status client and its tables
are ``rackmend.service.status``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

from rackmend.core.records import Merged
from rackmend.core.shards import Shard
from rackmend.core.status import BasedOn, FragmentStatus, LearnerStatus, SyncerPart, SyncerStatus
from rackmend.core.syncer import SyncerCore
from rackmend.service.membership import Peer
from rackmend.service.metrics import SyncerMetrics

__all__ = ["LearnerStats", "Tracker", "age_s"]

log = logging.getLogger("rackmend.syncer")


@dataclass
class _Progress:
    """What the next progress line sums up: merges since ``at`` and who was merged (the
    latest versions are ``Tracker.last_merge``'s)."""

    at: float
    merges: int = 0
    learners: set[str] = field(default_factory=set)


@dataclass
class LearnerStats:
    """What ``status`` reports about one learner id (all its ranks together)."""

    state: str
    """joining (waiting for the first learner's initial values), connected, left, silent."""
    first_seen: float
    last_seen: float
    bytes_in: int = 0
    bytes_out: int = 0
    contributions: int = 0
    rejected: int = 0
    step: int | None = None
    """Inner step count of its newest contribution."""
    step_time: float | None = None
    """Mean seconds per inner step its newest contribution reported."""
    last_contribution: float | None = None
    based: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per fragment: (base_version of its newest contribution, how many versions behind
    the syncer's that base was when the contribution arrived)."""


def age_s(now: float, t: float | None) -> float | None:
    """Seconds from ``t`` to ``now`` as the status shows them; None for never."""
    return None if t is None else round(now - t, 3)


class Tracker:
    """Per learner id its ``LearnerStats`` (``stats``; only ids that passed a hello, so a
    stranger cannot grow the table), which learner each connection spoke for, and each
    fragment's latest merge (in the model's fragment numbers)."""

    def __init__(self, clock: Callable[[], float], shard: Shard, metrics: SyncerMetrics,
                 progress_every: float) -> None:
        self.clock = clock
        self.shard = shard
        self.metrics = metrics
        self.progress_every = progress_every
        self.stats: dict[str, LearnerStats] = {}
        self.ident_learner: dict[bytes, str] = {}
        """Connection -> learner id, kept after a peer is dropped (its last sends still count)."""
        self.last_merge: dict[int, dict[str, Any]] = {}
        self._progress = _Progress(at=clock())
        """Merges since the last progress line (``progress_every``)."""

    def hello(self, ident: bytes, lid: str) -> LearnerStats:
        """A hello of ``lid`` from ``ident`` that passed the checks: its stats (new ones
        ``joining``)."""
        now = self.clock()
        stats = self.stats.setdefault(lid, LearnerStats(state="joining", first_seen=now, last_seen=now))
        self.ident_learner[ident] = lid
        return stats

    def received(self, lid: str, nbytes: int) -> None:
        """A message naming ``lid`` (any string a sender put there) arrived."""
        stats = self.stats.get(lid)
        if stats is not None:  # only ids that passed a hello: a stranger cannot grow this table
            stats.bytes_in += nbytes
            stats.last_seen = self.clock()
        self.metrics.received(lid if stats is not None else None, nbytes)

    def merged(self, record: Merged) -> None:
        """A merge (its fragment in the model's numbering), for the status and the next
        progress line."""
        self.last_merge[record.fragment] = {"t": record.t, "version": record.version, "merged": list(record.merged)}
        self._progress.merges += 1
        self._progress.learners.update(record.merged)

    def versions_to_metrics(self, core: SyncerCore) -> None:
        self.metrics.versions({self.shard.to_global(p): v for p, v in enumerate(core.versions)})

    def report_progress(self, peers: Collection[Peer]) -> None:
        """The progress line at INFO every ``progress_every`` seconds (see there)."""
        every, now, pr = self.progress_every, self.clock(), self._progress
        if not every or now - pr.at < every:
            return
        if pr.merges:
            versions = ", ".join(f"{p}: v{m['version']}" for p, m in sorted(self.last_merge.items()))
            log.info("progress: %d merges in the last %.1f s (latest versions %s); learners merged: %s", pr.merges,
                     now - pr.at, versions, ", ".join(sorted(pr.learners)))
        elif peers:
            connected = sorted({p.learner_id for p in peers})
            log.info("progress: no merge in the last %.1f s; connected: %s", now - pr.at, ", ".join(connected))
        self._progress = _Progress(at=now)

    def status(self, now: float, syncer: SyncerPart, core: SyncerCore | None, peers: Iterable[Peer],
               roster: Iterable[str]) -> SyncerStatus:
        """The status answer at ``now``: ``syncer`` (the service's own part), every
        fragment's round and every learner seen, connected (``peers``) or expected
        (``roster``). Ages and durations in seconds."""
        peers, roster = list(peers), tuple(roster)

        def age(t: float | None) -> float | None:
            return age_s(now, t)

        fragments: list[FragmentStatus] = []
        for p, spec in enumerate(core.fragments if core is not None else ()):
            assert core is not None
            frag, last = core.frags[p], self.last_merge.get(self.shard.to_global(p))
            rnd, clock = frag.round, frag.round.clock
            fragments.append(FragmentStatus(
                fragment=self.shard.to_global(p), version=frag.version, tensors=len(spec.tensors), bytes=spec.nbytes,
                phase=clock.phase.value, waiting=tuple(sorted(rnd.pending)),
                fresh=tuple(sorted(lid for lid, c in rnd.pending.items() if c.base_version == frag.version)),
                round_age_s=age(clock.first_arrival),
                grace_left_s=None if clock.deadline is None else round(clock.deadline - now, 3),
                last_merge_age_s=age(last["t"]) if last else None,
                last_merged=tuple(last["merged"]) if last else ()))
        learners: list[LearnerStatus] = []
        members = core.members if core is not None else {}
        for lid in sorted(set(self.stats) | set(members) | set(roster)):
            st = self.stats.get(lid)
            worlds = {peer.world for peer in peers if peer.learner_id == lid}
            member = members.get(lid)
            common = dict(id=lid, ranks=tuple(sorted(peer.rank for peer in peers if peer.learner_id == lid)),
                          world=max(worlds) if worlds else None,
                          expected=bool(member.expected) if member is not None else lid in roster)
            if st is None:
                learners.append(LearnerStatus(state="never joined", **common))  # type: ignore[arg-type]
                continue
            learners.append(LearnerStatus(
                state=st.state, last_seen_s=age(st.last_seen), step=st.step, step_time_s=st.step_time,
                last_contribution_s=age(st.last_contribution), contributions=st.contributions, rejected=st.rejected,
                version_lag=max((lag for _, lag in st.based.values()), default=None),
                based_on=tuple(BasedOn(fragment=p, base_version=b, lag=lag) for p, (b, lag) in sorted(st.based.items())),
                bytes_in=st.bytes_in, bytes_out=st.bytes_out, **common))  # type: ignore[arg-type]
        return SyncerStatus(syncer=syncer, fragments=tuple(fragments), learners=tuple(learners))
