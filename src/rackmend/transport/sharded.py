"""A learner's link to a sharded syncer: one ``ZmqLink`` per shard, each fragment routed
to the shard that owns it (``rackmend.core.shards.owner``).

Shards know nothing of each other, so neither does this link beyond the routing: each
shard's link joins, sends, receives, retries and rejoins on its own. A shard that dies
pauses only its fragments (their waits time out or their sends queue in that shard's
outbox); the others go on, and the dead one's link rejoins it when it comes back.

``connect`` is the one entry point that takes either one endpoint or several.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import torch

from rackmend.core.failslow import FailSlowReport
from rackmend.core.fragments import FragmentSpec
from rackmend.core.messages import Contribution, MomentContribution, MomentUpdate, Update
from rackmend.core.pieces import RankPieces
from rackmend.core.settings import RunRules, SyncerSettings
from rackmend.core.shards import Shard, owner
from rackmend.transport.base import LearnerLink, TransportError
from rackmend.transport.zmq_link import ZmqLink

__all__ = ["ShardedLink", "connect"]


def connect(endpoints: str | Sequence[str] | None = None, **kwargs: Any) -> "ZmqLink | ShardedLink":
    """A link to the syncer at ``endpoints``: one endpoint (a ``ZmqLink``), or the endpoints
    of every shard of a sharded syncer in shard order, as a list or comma-separated (a
    ``ShardedLink``). None: ``RACKMEND_CONNECT``. ``kwargs`` as ``ZmqLink`` takes them."""
    if endpoints is None:
        endpoints = os.environ.get("RACKMEND_CONNECT")
        if not endpoints:
            raise TransportError("no syncer endpoint: pass one or set RACKMEND_CONNECT=tcp://host:port "
                                 "(a sharded syncer: every shard's endpoint, comma-separated, shard 0 first)")
    listed = [e.strip() for e in endpoints.split(",")] if isinstance(endpoints, str) else list(endpoints)
    if not listed or not all(listed):
        raise TransportError(f"empty syncer endpoint in {endpoints!r}")
    return ZmqLink(listed[0], **kwargs) if len(listed) == 1 else ShardedLink(listed, **kwargs)


class ShardedLink(LearnerLink):
    """``LearnerLink`` over S syncer shards: ``endpoints[s]`` must be shard ``s`` of S
    (a shard refuses a hello meant for another, naming both). ``kwargs`` go to each
    shard's ``ZmqLink``."""

    carries_moments = True

    def __init__(self, endpoints: Sequence[str], **kwargs: Any) -> None:
        if len(endpoints) < 2:
            raise ValueError("a ShardedLink needs the endpoints of at least two shards; use ZmqLink for one")
        self.endpoints = list(endpoints)
        self.links = [ZmqLink(e, shard=Shard(s, len(endpoints)), **kwargs) for s, e in enumerate(endpoints)]
        self.rank = self.links[0].rank
        self.world_size = self.links[0].world_size
        self.endpoint = ",".join(self.endpoints)

    def _link(self, fragment: int) -> ZmqLink:
        return self.links[owner(fragment, len(self.links))]

    # ------------------------------------------------------------------ LearnerLink
    def join(self, learner_id: str, fragments: Sequence[FragmentSpec],
             initial: Sequence[Sequence[torch.Tensor]], timeout: float, *,
             settings: RunRules, pieces: RankPieces | None = None) -> list[Update]:
        """Join every shard at once (each seeds, or answers with, its own fragments); the
        first shard's failure is raised, naming it."""
        got: list[list[Update]] = [[] for _ in self.links]
        errors: list[tuple[int, BaseException]] = []

        def one(s: int) -> None:
            try:
                got[s] = self.links[s].join(learner_id, fragments, initial, timeout, settings=settings, pieces=pieces)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
                errors.append((s, exc))

        threads = [threading.Thread(target=one, args=(s,), name=f"rackmend-join-shard{s}", daemon=True)
                   for s in range(len(self.links))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10.0)  # each join gives up by itself at ``timeout``
        if errors:
            s, exc = min(errors, key=lambda e: e[0])
            raise TransportError(f"syncer shard {s}/{len(self.links)} at {self.endpoints[s]}: {exc}") from exc
        if any(t.is_alive() for t in threads):
            raise TransportError(f"joining the syncer shards did not finish within {timeout:g}s")
        return [u for updates in got for u in updates]

    def send(self, contribution: Contribution) -> None:
        self._link(contribution.fragment).send(contribution)

    def send_moments(self, contribution: MomentContribution) -> None:
        self._link(contribution.fragment).send_moments(contribution)

    def poll(self) -> list[Update]:
        # Each fragment's updates come from one shard, in order: the concatenation keeps that order.
        return [u for link in self.links for u in link.poll()]

    def wait(self, fragment: int, after_version: int, timeout: float) -> Update | None:
        return self._link(fragment).wait(fragment, after_version, timeout)

    def poll_moments(self) -> list[MomentUpdate]:
        return [u for link in self.links for u in link.poll_moments()]

    def wait_moments(self, fragment: int, kind: str, after_version: int, epoch: int,
                     timeout: float) -> MomentUpdate | None:
        return self._link(fragment).wait_moments(fragment, kind, after_version, epoch, timeout)

    def poll_advice(self) -> list[FailSlowReport]:
        """Fail-slow advice of every shard (each judges the step times it is sent, so a slow
        learner may hear it from several shards)."""
        return [r for link in self.links for r in link.poll_advice()]

    def leave(self) -> None:
        """Leave every shard at once: each waits up to its ``leave_timeout_s`` for the
        shard's bye, and one shard down must not add its wait to the others'."""
        threads = [threading.Thread(target=link.leave, name=f"rackmend-leave-shard{s}", daemon=True)
                   for s, link in enumerate(self.links)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)  # a link's leave is bounded by its own timeouts (bye, then the thread's join)

    close = leave

    # ------------------------------------------------------------------ what a link reports
    @property
    def syncer_settings(self) -> SyncerSettings | None:
        """The round settings shard 0 stated (shards started from one config agree)."""
        return self.links[0].syncer_settings

    @property
    def bytes_sent(self) -> int:
        return sum(link.bytes_sent for link in self.links)

    @property
    def bytes_received(self) -> int:
        return sum(link.bytes_received for link in self.links)

    @property
    def dropped_sends(self) -> int:
        return sum(link.dropped_sends for link in self.links)

    @property
    def superseded_sends(self) -> int:
        return sum(link.superseded_sends for link in self.links)

    @property
    def fetches_sent(self) -> int:
        return sum(link.fetches_sent for link in self.links)
