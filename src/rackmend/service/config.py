"""How the syncer service is configured: ``ServiceConfig`` (where it listens, checkpoints,
authenticates; every field is a ``rackmend syncer`` option) and the message-size bounds its
docstrings name (``layout_message_limit``, ``STRANGER_MAX_BYTES``, ``AUTO_ZMQ_CAP``).

The run's own settings (``RunConfig`` and its parts) live in ``rackmend.config``; this
module sits here rather than there because its checks need the shard parser, the wire's
header bound and the metrics' loopback test, which import ``rackmend.config`` themselves.
The service that reads it is ``rackmend.service.syncer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rackmend.config import HEARTBEAT_TIMEOUT_S, OPTION, OPTION_SCALE, ConfigError, frozen_config
from rackmend.core.fragments import FragmentSpec
from rackmend.core.shards import parse_shard
from rackmend.service.metrics import is_loopback_host
from rackmend.transport import wire

__all__ = ["ServiceConfig", "layout_message_limit", "STRANGER_MAX_BYTES", "AUTO_ZMQ_CAP", "LOG_WINDOW_S"]

STRANGER_MAX_BYTES = wire.MAX_HEADER_BYTES + (64 << 10)
"""Largest message taken from a connection that has not joined (a hello is one header
frame): junk from strangers never needs more memory than this past ZeroMQ."""
AUTO_ZMQ_CAP = 256 << 20
"""ZeroMQ's pre-read cap (fixed when the socket binds) when neither the operator
(``--max-message-mb``) nor a checkpoint gives the model's size: the layout arrives later,
with the first hello. ZeroMQ reads a whole message into memory before the syncer sees
it, so this bounds what one connection that never joined can cost (three strangers'
512 MiB messages cost +1.5 GiB RSS under the former 2 GiB cap). A first learner whose
largest fragment needs more is refused by name, pointing at ``--max-message-mb``."""
LOG_WINDOW_S = 10.0
"""The window of ``ServiceConfig.log_burst``, seconds."""
ALL_CONNECTIONS_BURST = 4
"""Per kind of bad input, the most log records per window over every connection together,
in units of ``ServiceConfig.log_burst``: a stranger that opens a new connection per
message gets a fresh per-connection allowance each time, so the per-connection limit
alone does not bound the log (584 connections wrote 1487 records in 5 s)."""


def layout_message_limit(fragments: list[FragmentSpec]) -> int:
    """The largest message a joined learner sends for this layout: its largest fragment
    uncompressed (an ``init`` or a ``contrib``) plus the largest header allowed."""
    return max((f.nbytes for f in fragments), default=0) + wire.MAX_HEADER_BYTES


@frozen_config
@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Where and how the syncer service listens, checkpoints and authenticates."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint of the ROUTER socket. Without Curve keys only loopback
    addresses are allowed unless ``insecure`` is set."""

    insecure: bool = False
    """Allow a non-loopback bind without CurveZMQ (traffic unauthenticated and in clear)."""

    secret_key_file: str | None = field(default=None, metadata={OPTION: "secret_key"})
    """The syncer's ``.key_secret`` file from ``rackmend keygen``; turns CurveZMQ on."""

    allowed_keys_dir: str | None = field(default=None, metadata={OPTION: "allowed_keys"})
    """Directory of learners' public ``.key`` files; only those may connect (needs the
    syncer's secret key, ``secret_key_file``)."""

    checkpoint_dir: str | None = None
    """Directory checkpoints are written to; unset (None): no checkpoints."""

    checkpoint_every: int = 50
    """Write a checkpoint every this many merges (and always on SIGTERM/SIGINT)."""

    resume: bool = False
    """Start from the checkpoint in ``checkpoint_dir`` (an error if there is none)."""

    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S
    """Seconds without any message after which a learner rank counts as gone and
    rounds stop waiting for it. Learners send heartbeats every second by default;
    set this to several heartbeat periods so a busy learner is not dropped."""

    max_message_bytes: int | None = field(default=None, metadata={OPTION: "max_message_mb", OPTION_SCALE: 2**20})
    """Largest message accepted: bytes here, MiB as ``rackmend syncer --max-message-mb``;
    larger ones are rejected (logged, answered). Beyond twice this
    ZeroMQ drops the sender's connection before reading the message into memory.
    None: follow the model, its largest fragment plus the header bound (with
    ``resume`` ZeroMQ's cap follows it too; on a fresh start ZeroMQ's cap is
    ``AUTO_ZMQ_CAP``, 256 MiB, since the model is not known when the socket binds: a
    first learner whose largest fragment needs more is refused, naming the value to
    pass, and the ``message_limit`` event names it too). Connections that have not
    joined are held to ``STRANGER_MAX_BYTES`` (or this, if smaller) either way."""

    takeover_after: float = 30.0
    """Seconds a learner rank must have been silent before a hello for its id and rank
    that lacks the rank's resume token takes its place (the token, given at join, takes
    it back at once: the learner's own link, or its process restarted on the same host,
    which keeps it in a file). Sooner, the hello is refused (logged as
    ``identity_refused``; the learner's link retries): a stranger cannot evict or
    impersonate a live learner, nor one paused for a few seconds (a GC, a checkpoint
    write). A learner restarted where its token file is not (another host) waits this
    long at most. Keep it well above the learners' heartbeat period (1 s by default)."""

    log_path: str | None = field(default=None, metadata={OPTION: "log"})
    """JSONL file of every event (merges, joins, rejections); unset (None): not written."""

    init_timeout: float = 60.0
    """Seconds a fresh syncer waits for the next initial value (``init``) from the
    learner it asked to seed the model. Past it, that learner counts as gone and the
    request passes to another waiting learner (events ``init_timeout``, then
    ``init_request``); without one, the next learner to join is asked. Raise it when a
    single fragment of the model takes longer than this to upload."""

    log_burst: int = 5
    """Per connection (per learner for rejected contributions) and kind of bad input,
    the most log records per 10 s, and ``ALL_CONNECTIONS_BURST`` (4) times as many over
    every connection together; the rest are counted in one ``suppressed`` record per
    window and key, so a junk flood cannot fill the disk, however many connections it
    opens. Raise it to see every rejection of one misbehaving learner."""

    ready_file: str | None = None
    """Once the socket is bound and the loop serves, the bound endpoint is written to
    this file (atomically: a reader never sees half of it), for scripts that start the
    syncer on port 0. None: not written."""

    metrics_port: int = 0
    """TCP port of the Prometheus endpoint (``http://HOST:PORT/metrics``); 0: none.
    ``docs/operations.md`` lists the metrics."""

    progress_every: float = 30.0
    """Seconds between the progress lines logged at INFO: the merges since the last line,
    each fragment's latest version and the learners merged in them (or, with learners connected
    and nothing merged, that no merge happened). 0: none. Every merge is in the
    ``log_path`` file either way."""

    threads: int = 0
    """Threads the syncer computes with: torch's intra-op threads, which split the merge's
    sums, the norms, the outer step and codec decoding. 0: as many as torch uses by
    default (the machine's physical cores). ``docs/capacity.md`` shows what each thread
    buys."""

    shard: str = "0/1"
    """This syncer's part of the model, ``s/S``: shard ``s`` of ``S`` owns the fragments
    ``p`` with ``p mod S == s`` and knows nothing of the others (no coordination between
    shards). Start one ``rackmend syncer --shard s/S`` per shard, each with its own port
    and checkpoint directory, and give every learner all S endpoints in shard order
    (``--connect tcp://a:5555,tcp://b:5555``). ``0/1``: one syncer for the whole model."""

    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on. Metrics are served without
    authentication: keep the loopback default and scrape from this machine, or put a
    firewall in front (a warning is logged for any other address)."""

    def validate(self) -> None:
        parse_shard(self.shard)
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 1, or 0 for torch's default (the physical cores); got "
                              f"{self.threads} (--threads)")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port in 1..65535, or 0 for no metrics endpoint; got "
                              f"{self.metrics_port} (--metrics-port)")
        if not self.metrics_host.strip():
            raise ConfigError("metrics_host is empty; give an address such as 127.0.0.1 (--metrics-host)")
        if self.log_burst < 1:
            raise ConfigError(f"log_burst must be >= 1 records per window, got {self.log_burst}")
        if self.progress_every < 0:
            raise ConfigError(f"progress_every must be >= 0 seconds (0: no progress lines), got {self.progress_every} "
                              "(--progress-every)")
        if not self.init_timeout > 0:
            raise ConfigError(f"init_timeout must be > 0 seconds, got {self.init_timeout}; the default is 60 "
                              "(--init-timeout)")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 merges, got {self.checkpoint_every}")
        if self.max_message_bytes is not None and self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0 (or None: follow the model), got "
                              f"{self.max_message_bytes}; --max-message-mb takes MiB")
        if not self.takeover_after > 0:
            raise ConfigError(f"takeover_after must be > 0 seconds, got {self.takeover_after}; the default is 30 "
                              "(--takeover-after)")
        if self.heartbeat_timeout <= 0:
            raise ConfigError(f"heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (where to find the checkpoint)")
        if self.allowed_keys_dir and not self.secret_key_file:
            raise ConfigError("allowed_keys_dir needs secret_key_file: Curve authentication needs the syncer's key")
        if not self.secret_key_file and not self.insecure and not _is_loopback(self.bind):
            raise ConfigError(
                f"bind={self.bind!r} is not a loopback address and no Curve key is set: traffic would be "
                "unauthenticated; pass --secret-key (see `rackmend keygen`) or --insecure")

    def __post_init__(self) -> None:
        self.validate()


def _is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    # '*', interface names, host names: not provably loopback
    return is_loopback_host(endpoint.split("://", 1)[-1].rsplit(":", 1)[0])
