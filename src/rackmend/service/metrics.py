"""The syncer's Prometheus metrics: what they are, how the service feeds them, the
``/metrics`` endpoint.

``SyncerMetrics`` owns one ``CollectorRegistry`` per syncer (never the process-wide
default one, so several syncers in one process keep their numbers apart) and is fed by
the service core (``rackmend.service.core``) from the round core's typed actions and
records (``rackmend.core.records``) and from what the driver itself measures (bytes on the socket,
joins and leaves, checkpoints). Nothing here reads a log line back or parses a reason
sentence: rejections are counted by the core's fixed ``RejectCode`` words and the
service's fixed event names.

Label values are bounded: fragments by the layout, reasons by fixed sets, learner ids
by the join rules (a hello must pass the roster, settings and layout checks) and, as a
last resort, by ``MAX_LEARNER_LABELS``. ``docs/operations.md`` ("Metrics") lists every
metric with its meaning. The HTTP server is prometheus-client's own; sockets, round
logic and the status request live elsewhere.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from rackmend.config import ConfigError
from rackmend.core.shards import Shard
from rackmend.core.failslow import (
    AdviseLearner,
    FailSlowAction,
    FailSlowBlip,
    MarkForEviction,
    RestoreLearner,
    StopExpecting,
)
from rackmend.core.records import REJECT_CODES, Dropped, Incomplete, Merged, Rejected, Superseded, SyncerRecord

__all__ = ["SyncerMetrics", "MAX_LEARNER_LABELS", "OTHER_LEARNERS", "UNJOINED", "MESSAGE_REFUSALS",
           "FAILSLOW_STATES", "METRICS_MAX_CONNECTIONS", "METRICS_REQUEST_TIMEOUT_S", "is_loopback_host"]

log = logging.getLogger("rackmend.syncer")

MAX_LEARNER_LABELS = 1000
"""Distinct learner ids given series of their own; further ids share ``OTHER_LEARNERS``.
Join rules already bound them (``--learners``, keys); this bounds a syncer that admits
whoever joins."""
OTHER_LEARNERS = "_other"
"""The learner label of ids past ``MAX_LEARNER_LABELS``."""
UNJOINED = "_unjoined"
"""The learner label of bytes to and from connections that have not joined (strangers,
``rackmend status`` clients)."""

MESSAGE_REFUSALS = ("bad_message", "unknown_peer", "identity_refused", "settings_refused", "auth_denied",
                    "internal_error")
"""Service-level refusals (the event each is logged as): a malformed message, one from
a connection that has not joined, one naming a learner rank held elsewhere, a hello
whose settings or layout do not fit the run, a Curve key refused or not allowed the id,
a message whose handling raised (a fault validation missed: dropped, the service goes on)."""

METRICS_MAX_CONNECTIONS = 16
"""Connections the metrics port serves at once; more are closed as they arrive. A scraper
needs one: 800 held half-sent requests once gave the syncer 800 threads and descriptors,
and a 1024-descriptor limit would have starved its learners."""
METRICS_REQUEST_TIMEOUT_S = 10.0
"""Most seconds one metrics connection is served, reading the request included; a
request sent a byte at a time is cut off there."""

FAILSLOW_STATES = {"normal": 0, "slow": 1, "evict": 2}
"""Values of ``rackmend_learner_failslow_state``."""

_FAILSLOW_EVENTS: dict[type, str] = {
    FailSlowBlip: "blip", StopExpecting: "slow", AdviseLearner: "advise", MarkForEviction: "evict",
    RestoreLearner: "restore",
}

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Buckets of round-time histograms: grace windows are fractions of a second to
seconds; over a slow link a round waits minutes."""
_PARTICIPANTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # host names, '' (every interface): not provably loopback


class SyncerMetrics:
    """A syncer's metrics in a registry of their own; ``serve`` exposes them over HTTP."""

    def __init__(self, clock: Callable[[], float], shard: Shard = Shard()) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self._checkpoint_at: float | None = None
        self._learners: set[str] = set()
        r = self.registry
        # Shards own disjoint fragments and label them in the model's numbering, so a sum
        # over the shards' endpoints is the whole syncer's count.
        Gauge("rackmend_syncer_shard", "1, labelled with this syncer's shard index and the number of shards "
              "(0 of 1: one syncer for the whole model).", ["shard", "shards"],
              registry=r).labels(str(shard.index), str(shard.count)).set(1)
        self.merges = Counter("rackmend_merges", "Merges (outer steps) per fragment.", ["fragment"], registry=r)
        self.fragment_version = Gauge("rackmend_fragment_version", "Current version of each fragment.",
                                      ["fragment"], registry=r)
        self.round_seconds = Histogram(
            "rackmend_round_duration_seconds", "Per merge: seconds from the round's first fresh contribution "
            "to the merge.", registry=r, buckets=_SECONDS)
        self.quorum_seconds = Histogram(
            "rackmend_quorum_wait_seconds", "Per merge that reached quorum: seconds from the round's first "
            "fresh contribution to min_quorum fresh ones.", registry=r, buckets=_SECONDS)
        self.grace_seconds = Histogram(
            "rackmend_grace_wait_seconds", "Per merge that reached quorum: seconds waited after quorum for "
            "stragglers (at most the grace window).", registry=r, buckets=_SECONDS)
        self.grace_window = Gauge("rackmend_grace_window_seconds", "Grace window granted to the latest round "
                                  "that reached quorum.", registry=r)
        self.merge_seconds = Histogram(
            "rackmend_merge_compute_seconds", "Per merge: seconds spent merging, stepping the outer optimizer "
            "and queueing the new value.", registry=r, buckets=_SECONDS)
        self.participants = Histogram("rackmend_merge_participants", "Learners whose work went into a merge.",
                                      registry=r, buckets=_PARTICIPANTS)
        self.contributions = Counter("rackmend_contributions", "Contributions received (parsed), per learner.",
                                     ["learner"], registry=r)
        self.stale = Counter("rackmend_contributions_stale", "Contributions merged into a round newer than "
                             "the version they were based on (they missed their own round and rode along).",
                             registry=r)
        self.late = Counter("rackmend_contributions_late", "Contributions not merged on their own because a "
                            "newer send of the same learner, already received, holds their work (a late "
                            "arrival or a repeat).", registry=r)
        self.rejected = Counter("rackmend_contributions_rejected", "Contributions refused by the syncer "
                                "core, by reason (see RejectCode), dropped at merge time (merge_dropped), or "
                                "left incomplete by a sharded learner's ranks (incomplete).",
                                ["reason"], registry=r)
        for reason in (*REJECT_CODES, "merge_dropped", "incomplete"):
            self.rejected.labels(reason)  # present at 0, so rate() sees the first one
        self.refused = Counter("rackmend_messages_rejected", "Messages and connections refused before "
                               "reaching the core, by reason.", ["reason"], registry=r)
        for reason in MESSAGE_REFUSALS:
            self.refused.labels(reason)
        self.bytes_in = Counter("rackmend_received_bytes", "Bytes of messages received, per learner.",
                                ["learner"], registry=r)
        self.bytes_out = Counter("rackmend_sent_bytes", "Bytes of messages sent, per learner.", ["learner"],
                                 registry=r)
        self.connected = Gauge("rackmend_learner_connected", "1 while a learner has a rank connected, else 0.",
                               ["learner"], registry=r)
        self.step_seconds = Gauge("rackmend_learner_step_seconds", "Mean seconds per inner step the "
                                  "learner's newest contribution reported.", ["learner"], registry=r)
        self.version_lag = Gauge("rackmend_learner_version_lag", "Versions the learner's newest "
                                 "contributions were behind the syncer's when they arrived (largest over "
                                 "fragments).", ["learner"], registry=r)
        self.failslow_state = Gauge("rackmend_learner_failslow_state", "Fail-slow state: 0 normal, 1 slow "
                                    "(rounds stop waiting for it), 2 marked for eviction.", ["learner"],
                                    registry=r)
        self.failslow_events = Counter("rackmend_failslow_events", "Fail-slow ladder actions, by kind.",
                                       ["event"], registry=r)
        for event in _FAILSLOW_EVENTS.values():
            self.failslow_events.labels(event)
        self.checkpoints = Counter("rackmend_checkpoints", "Checkpoints written.", registry=r)
        Gauge("rackmend_checkpoint_age_seconds", "Seconds since the last checkpoint was written (NaN before "
              "the first).", registry=r).set_function(self._checkpoint_age)
        self._server: Any = None
        self._thread: Any = None
        self.url: str | None = None

    # ------------------------------------------------------------------ feeding
    def learner(self, lid: str | None) -> str:
        """The label of learner ``lid`` (None: a connection that has not joined)."""
        if lid is None:
            return UNJOINED
        if lid in self._learners:
            return lid
        if len(self._learners) >= MAX_LEARNER_LABELS:
            return OTHER_LEARNERS
        self._learners.add(lid)
        return lid

    def record(self, record: SyncerRecord) -> None:
        """One of the core's records, its fragment in the model's numbering (types other
        than those counted here are ignored)."""
        if isinstance(record, Merged):
            self._merge(record)
        elif isinstance(record, Rejected):
            self.rejected.labels(record.code).inc()
        elif isinstance(record, Dropped):
            # A dropped moments round (``dropped`` None) lost no contribution's work.
            self.rejected.labels("merge_dropped").inc(len(record.dropped or ()))
        elif isinstance(record, Incomplete):
            self.rejected.labels("incomplete").inc()
        elif isinstance(record, Superseded):
            self.late.inc()

    def _merge(self, m: Merged) -> None:
        fragment = str(m.fragment)
        self.merges.labels(fragment).inc()
        self.fragment_version.labels(fragment).set(m.version)
        self.participants.observe(len(m.merged))
        self.stale.inc(len(m.stale))
        self.round_seconds.observe(m.wait_s)
        if m.quorum_s is not None:
            self.quorum_seconds.observe(m.quorum_s)
            self.grace_seconds.observe(max(0.0, m.wait_s - m.quorum_s))
        if m.grace_s is not None:
            self.grace_window.set(m.grace_s)

    def versions(self, versions: Mapping[int, int]) -> None:
        """The fragments' versions (fragment in the model's numbering: a syncer shard's
        are every S-th) when the core starts (fresh, or from a checkpoint)."""
        for p, v in versions.items():
            self.merges.labels(str(p))  # present at 0 from the start
            self.fragment_version.labels(str(p)).set(v)

    def failslow(self, action: FailSlowAction) -> None:
        """One rung of the core's fail-slow ladder."""
        self.failslow_events.labels(_FAILSLOW_EVENTS[type(action)]).inc()
        state = {StopExpecting: "slow", MarkForEviction: "evict", RestoreLearner: "normal"}.get(type(action))
        if state is not None:
            self.failslow_state.labels(self.learner(action.report.learner)).set(FAILSLOW_STATES[state])

    def contribution(self, lid: str, step_time: float, version_lag: int) -> None:
        label = self.learner(lid)
        self.contributions.labels(label).inc()
        self.step_seconds.labels(label).set(step_time)
        self.version_lag.labels(label).set(version_lag)

    def joined(self, lid: str) -> None:
        """A learner joined (again): the core starts its fail-slow watch afresh."""
        label = self.learner(lid)
        self.connected.labels(label).set(1)
        self.failslow_state.labels(label).set(FAILSLOW_STATES["normal"])

    def left(self, lid: str) -> None:
        label = self.learner(lid)
        self.connected.labels(label).set(0)
        self.failslow_state.labels(label).set(FAILSLOW_STATES["normal"])  # the core forgets its case

    def refusal(self, reason: str) -> None:
        """A message or connection refused by the service (one of ``MESSAGE_REFUSALS``)."""
        self.refused.labels(reason).inc()

    def received(self, lid: str | None, nbytes: int) -> None:
        self.bytes_in.labels(self.learner(lid)).inc(nbytes)

    def sent(self, lid: str | None, nbytes: int) -> None:
        self.bytes_out.labels(self.learner(lid)).inc(nbytes)

    def merge_compute(self, seconds: Iterable[float]) -> None:
        for s in seconds:
            self.merge_seconds.observe(s)

    def checkpointed(self, at: float) -> None:
        self._checkpoint_at = at
        self.checkpoints.inc()

    def _checkpoint_age(self) -> float:
        at = self._checkpoint_at  # read once: the syncer's thread may set it meanwhile
        return math.nan if at is None else self._clock() - at

    # ------------------------------------------------------------------ serving
    def serve(self, host: str, port: int, *, max_connections: int = METRICS_MAX_CONNECTIONS,
              request_timeout: float = METRICS_REQUEST_TIMEOUT_S) -> str:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread, at most
        ``max_connections`` at once, each for at most ``request_timeout`` s; returns the URL."""
        if not is_loopback_host(host):
            log.warning("metrics on %s:%d are readable by anyone who can reach that address (learner ids, "
                        "rates); bind them to 127.0.0.1 (--metrics-host) behind a scraper on this machine, or "
                        "restrict the port with a firewall", host, port)
        try:
            self._server = _BoundedServer((host, port), max_connections, request_timeout)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; pick another "
                              "--metrics-port (0: no metrics endpoint)") from None
        self._server.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(target=self._server.serve_forever, name="rackmend-metrics", daemon=True)
        self._thread.start()
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self._server.server_port}/metrics"
        return self.url

    def close(self) -> None:
        """Stop serving (the port is free again once this returns)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (a scraper every few seconds would fill it)."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A WSGI server with one thread per connection, at most ``max_connections`` of them
    (a connection past the cap is closed unread, and counted in ``refused``), each cut
    off ``timeout`` s after it was accepted."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], max_connections: int, timeout: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _QuietHandler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._timeout = timeout
        self.refused = 0
        """Connections closed unread because every slot was taken."""

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        request.settimeout(self._timeout)  # each read; the timer below bounds the whole request
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # A read timeout alone lets a byte every few seconds hold the slot for good.
        cutoff = threading.Timer(self._timeout, _cut, (request,))
        cutoff.daemon = True
        cutoff.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cutoff.cancel()
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def _cut(request: socket.socket) -> None:
    """End a metrics connection that outlived its time: its thread's read returns."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile
        pass
