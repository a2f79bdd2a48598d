"""The syncer as a network service: ``ServiceCore`` behind a ZeroMQ ROUTER socket.

One thread, one loop: poll the socket until the core's next deadline or a stop request,
hand each message to the core (``ServiceCore.receive``), let time act (``tick``) and
send what waits (``flush``). Everything the service decides is the core's
(``rackmend.service.core``, sans-I/O, tested on a fake clock); this module holds only
what touches the outside: the socket and its options, CurveZMQ and its authenticator
thread, signals, the ready file, the JSONL log file and the metrics HTTP server.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import zmq

from rackmend.core.status import SyncerStatus
from rackmend.config import ConfigError, RunConfig
from rackmend.core.syncer import SyncerCore
from rackmend.service.checkpoint import remove_stale_temps
from rackmend.service.config import ServiceConfig
from rackmend.service.core import PeerGone, ServiceCore
from rackmend.service.events import CheckpointTempsRemoved, Listening
from rackmend.service.identity import load_key_ids
from rackmend.service.membership import Peer
from rackmend.transport.outbox import SHORT_HWM

__all__ = ["ServiceConfig", "SyncerService"]

log = logging.getLogger("rackmend.syncer")


class SyncerService:
    """Serve learners until ``stop()`` (or SIGTERM/SIGINT when run in the main thread).

    ``config`` and ``clock`` are the core's (``ServiceCore``); ``service`` also says where
    to bind and listen."""

    def __init__(self, config: RunConfig, service: ServiceConfig,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.service = service
        if service.threads:
            torch.set_num_threads(service.threads)
        self.threads = torch.get_num_threads()
        """What the merge, the outer step and decoding compute with: torch's own threads
        splitting each operation, no worker pool of ours (``docs/capacity.md``: over a
        pool, decoding was slower and the merge no faster)."""
        self.clock = clock
        self._stop = threading.Event()
        self._log_file = open(service.log_path, "a", encoding="utf-8") if service.log_path else None
        self._log_lock = threading.Lock()  # the authenticator's thread logs refusals too
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted learner rank takes its identity back
        # A short per-peer queue that reports "full" (EAGAIN) instead of dropping: what does
        # not fit waits in the peer's Outbox, where a newer value of a fragment replaces an
        # unsent older one, so a slow link carries fresh values rather than a backlog.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SHORT_HWM)
        try:
            self._auth, key_ids = _setup_curve(service, self._ctx, self.sock, self._auth_denied)
            # Resumes from the checkpoint when asked: before the bind, since its layout sizes
            # ZeroMQ's cap (an option that only applies to connections accepted after it).
            self.node = ServiceCore(config, service, send=self._send, clock=clock,
                                    emit=lambda line: self._record(line), key_ids=key_ids)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.node.zmq_cap)
        self.sock.bind(service.bind)
        self.node.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if service.metrics_port:
            try:
                self.node.metrics_url = self.node.metrics.serve(service.metrics_host, service.metrics_port)
            except ConfigError:
                self.sock.close(linger=0)
                raise

    # What tests and the CLI read of the core, under the names they always had.
    @property
    def core(self) -> SyncerCore | None:
        """The round logic, once the model is known (``ServiceCore.core``)."""
        return self.node.core

    @property
    def peers(self) -> dict[bytes, Peer]:
        """The connected learner ranks, by connection (``Membership.peers``)."""
        return self.node.peers

    @property
    def endpoint(self) -> str:
        """Where the socket listens (``tcp://127.0.0.1:PORT`` once bound)."""
        return self.node.endpoint

    @property
    def metrics_url(self) -> str | None:
        """Where ``/metrics`` is served; None without ``metrics_port``."""
        return self.node.metrics_url

    @property
    def epoch(self) -> int:
        return self.node.epoch

    def status(self) -> SyncerStatus:
        """What ``rackmend status`` shows (``ServiceCore.status``)."""
        return self.node.status()

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (``ServiceCore.checkpoint``)."""
        return self.node.checkpoint()

    # ------------------------------------------------------------------ running
    def serve(self) -> None:
        """Run the loop; returns after ``stop()`` or a signal, with a checkpoint written."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
        node = self.node
        if self.service.checkpoint_dir:
            removed = remove_stale_temps(self.service.checkpoint_dir)
            if removed:
                node.event(CheckpointTempsRemoved, paths=tuple(str(p) for p in removed))
                log.info("removed %d temporary file(s) of interrupted checkpoint writes in %s", len(removed),
                         self.service.checkpoint_dir)
        node.event(Listening, endpoint=self.endpoint, resumed=node.core is not None, epoch=node.epoch,
                    metrics=self.metrics_url)
        if self.service.ready_file:
            tmp = Path(self.service.ready_file + ".tmp")
            tmp.write_text(self.endpoint, encoding="utf-8")
            tmp.replace(self.service.ready_file)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        curve = node.members.key_ids is not None
        try:
            while not self._stop.is_set():
                if poller.poll(node.wake_in() * 1000):
                    # Drain what is queued before ticking, so a burst is one pass.
                    for _ in range(1000):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        # The key the authenticator returned for this connection (Z85).
                        key = frames[1].get("User-Id") if curve and len(frames) > 1 else None
                        node.receive(frames[0].bytes, frames[1:], key)
                        # A message can be hundreds of MiB (a stranger's of many frames, each
                        # under ZeroMQ's per-frame cap): not kept until the next one arrives.
                        del frames
                node.tick()
                node.flush()
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._stop.set()

    def _send(self, ident: bytes, frames: list[Any]) -> None:
        """The core's ``Send``: never blocks (``zmq.Again`` when the peer's queue is full)."""
        try:
            self.sock.send_multipart([ident, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; its messages have nowhere to go
            raise PeerGone(exc.strerror) from None

    def _auth_denied(self, text: str) -> None:
        node = getattr(self, "node", None)
        if node is not None:  # no handshake can come before the bind, after the core is made
            node.auth_denied(text)

    def _shutdown(self) -> None:
        try:
            self.node.finish()
        finally:
            self.sock.close(linger=500)
            self.node.metrics.close()
            if self._auth is not None:
                self._auth.stop()
            with self._log_lock:
                if self._log_file:
                    self._log_file.close()
                    self._log_file = None

    def _record(self, record: dict) -> None:
        """Write ``record`` to the JSONL log (tests wrap this to watch the log)."""
        with self._log_lock:
            if self._log_file:
                self._log_file.write(json.dumps(record) + "\n")
                self._log_file.flush()


class _AuthLog:
    """Logger for pyzmq's authenticator: it reports refusals at debug level only; an
    operator needs to see them, so they become warnings and events."""

    def __init__(self, on_denied: Callable[[str], None]) -> None:
        self._log = logging.getLogger("rackmend.auth")
        self._on_denied = on_denied

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        text = msg % args if args else msg
        if "DENIED" in text:
            self._on_denied(text)
        else:
            self._log.debug(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def _setup_curve(service: ServiceConfig, ctx: zmq.Context, sock: zmq.Socket,
                 on_denied: Callable[[str], None]) -> tuple[Any, dict[str, frozenset[str] | None] | None]:
    """CurveZMQ on ``sock`` when ``service`` names a secret key: the authenticator thread
    (stop it with the socket; refusals reach ``on_denied``) and, with an allowed-keys
    directory, the learner ids each key may use. ``(None, None)`` without a key."""
    s = service
    if not s.secret_key_file:
        return None, None
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    public, secret = zmq.auth.load_certificate(s.secret_key_file)
    if secret is None:
        raise ConfigError(f"{s.secret_key_file} holds no secret key; pass the .key_secret file")
    auth = ThreadAuthenticator(ctx, log=_AuthLog(on_denied))  # type: ignore[arg-type]
    auth.start()
    key_ids = None
    if s.allowed_keys_dir:
        key_ids = load_key_ids(s.allowed_keys_dir)
        auth.configure_curve(domain="*", location=s.allowed_keys_dir)
    else:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return auth, key_ids
