"""A read-only client of a running syncer: ask for its status over ZeroMQ.

One DEALER socket, with the same CurveZMQ keys a learner would use when the syncer
has them; each request carries a nonce the reply echoes, so a late answer to an
earlier, timed-out request is never taken for the current one. Nothing here draws
tables (``rackmend.service.status`` does) or joins a round.
"""

from __future__ import annotations

import itertools
import time

import zmq

from rackmend.core.status import SyncerStatus
from rackmend.transport import wire
from rackmend.transport.base import TransportError
from rackmend.transport.zmq_link import CurveClientKeys

__all__ = ["StatusClient", "StatusTimeout", "StatusRefused"]

MAX_REPLY_BYTES = 64 << 20
"""A status document of thousands of learners fits many times over."""


class StatusTimeout(TransportError):
    """No answer within the timeout (syncer down, wrong address, or Curve keys refused)."""


class StatusRefused(TransportError):
    """The syncer answered with an error (e.g. an older syncer without status requests)."""


class StatusClient:
    """``StatusClient(endpoint, curve=...).query(timeout)`` -> the syncer's status."""

    def __init__(self, endpoint: str, *, curve: CurveClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)  # an unanswered request must not keep the process alive
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if curve is not None:
            self._sock.curve_publickey = curve.public
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_serverkey = curve.server_public
        self._sock.connect(endpoint)
        self._nonces = itertools.count(1)

    def query(self, timeout: float) -> SyncerStatus:
        """The syncer's current status; ``StatusTimeout`` after ``timeout`` seconds without
        an answer, ``StatusRefused`` when it answers with an error."""
        nonce = next(self._nonces)
        try:
            self._sock.send_multipart(wire.status_request_frames(nonce), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet (ZeroMQ queues nothing before the handshake): the wait below times out
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not self._sock.poll(left * 1000, zmq.POLLIN):
                break
            frames = self._sock.recv_multipart(copy=False)
            try:
                answer = wire.parse_status_answer(frames, MAX_REPLY_BYTES)
                if isinstance(answer, wire.ErrorIn):
                    raise StatusRefused(
                        f"the syncer at {self.endpoint} refused the status request: "
                        f"{answer.reason[:300]} (a syncer of an older rackmend does not "
                        "answer status requests; upgrade it)")
                got, status = answer.nonce, answer.status
            except wire.WireError as exc:
                raise TransportError(f"malformed status reply from {self.endpoint}: {exc}") from None
            if got == nonce:
                return status
        raise StatusTimeout(
            f"no answer from the syncer at {self.endpoint} within {timeout:g}s. Check that `rackmend syncer` runs "
            "and listens there, that this host reaches that port, and, if the syncer was started with "
            "--secret-key, pass --key (a .key_secret whose public key is in its --allowed-keys directory) and "
            "--server-key (the syncer's .key); the syncer logs a refused key as auth_denied")

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "StatusClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
