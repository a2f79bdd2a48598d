"""``rackmend status ENDPOINT``: a live view of a running syncer, like ``top``.

Asks the syncer for its status (a read-only request that passes the same CurveZMQ
authentication as a learner and never joins a round) and redraws two tables every
``--interval`` seconds: the learners (ranks, state, last seen, step time, version lag,
bytes each way) and the round of each fragment (version, who is in, age). Ctrl-C
ends it; ``--iterations`` bounds it. ``--once --json`` prints one JSON document for
scripts and exits non-zero when the syncer does not answer within ``--timeout``.

A sharded syncer (``--shard s/S``) is asked every shard at once: give every shard's
endpoint, comma-separated, and the view is one syncer's (``combine``): the fragments
of all shards, each learner's counts added up over the shards, and a line per shard.
A shard that does not answer is shown as unreachable beside the live ones (state
``degraded``), which is when an operator needs the view most; only when no shard
answers does the command fail.

The request itself lives in ``rackmend.transport.status``; the answer is built by
``ServiceCore.status``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, Sequence, TextIO

from rackmend.core.status import LearnerStatus, SyncerPart, SyncerStatus
from rackmend.transport.base import TransportError
from rackmend.transport.status import StatusClient, StatusTimeout
from rackmend.transport.zmq_link import CurveClientKeys

__all__ = ["add_arguments", "main", "render", "combine"]

CLEAR = "\x1b[H\x1b[2J"
"""ANSI: cursor home, clear screen (what ``top`` does between frames, minus curses)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", help="the syncer's endpoint, e.g. tcp://sync:5555; a sharded syncer: every shard's, "
                   "comma-separated")
    p.add_argument("--once", action="store_true", help="ask once, print, exit")
    p.add_argument("--json", action="store_true", help="print the status as JSON: with --once one document, "
                   "otherwise one document per line per refresh")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--iterations", type=int, default=None, help="stop after this many refreshes (default: until Ctrl-C)")
    p.add_argument("--no-clear", action="store_true", help="print frames one after another instead of redrawing")
    p.add_argument("--key", help="a .key_secret file whose public key is in the syncer's --allowed-keys (CurveZMQ)")
    p.add_argument("--server-key", help="the syncer's public .key file (CurveZMQ)")


def _curve(args: argparse.Namespace) -> CurveClientKeys | None:
    if not args.key and not args.server_key:
        return None
    if not (args.key and args.server_key):
        raise ValueError("--key and --server-key go together (this client's .key_secret and the syncer's .key)")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(args.key)
        server, _ = zmq.auth.load_certificate(args.server_key)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the Curve keys: {exc}") from None
    if secret is None:
        raise ValueError(f"{args.key} holds no secret key; pass the .key_secret file (see `rackmend keygen`)")
    return CurveClientKeys(public=public, secret=secret, server_public=server)


def _fmt_s(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    if v < 1:
        return f"{v * 1000:.0f}ms"
    if v < 120:
        return f"{v:.1f}s"
    return f"{v / 60:.0f}m" if v < 7200 else f"{v / 3600:.1f}h"


def _fmt_bytes(v: Any) -> str:
    v = float(v or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f}{unit}" if unit == "B" else f"{v:.1f}{unit}"
        v /= 1024
    return f"{v:.1f}TiB"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers)] + [line(r) for r in rows]


_SUMMED = ("merges", "rejected_messages", "rejected_contributions", "superseded_updates", "status_requests")
"""Syncer counters that add up over shards."""
_LEARNER_SUMS = ("contributions", "rejected", "bytes_in", "bytes_out")


def combine(statuses: Sequence[SyncerStatus], down: Sequence[SyncerPart] = ()) -> SyncerStatus:
    """One status of a syncer split into shards, from each live shard's: counters added
    up, every live shard's fragments (each shard names its own in the model's
    numbering), each learner's entries merged (counts added, the freshest ``last_seen``,
    the largest lag), and ``syncer.shards``: each shard's own syncer part, in shard
    order, where ``down`` (state ``unreachable``, with its ``error``) stands in for a
    shard that did not answer; the combined state is then ``degraded`` and
    ``syncer.shard`` says how many shards answered."""
    if len(statuses) == 1 and not down:
        return statuses[0]
    syncers = [st.syncer for st in statuses]
    states = {x.state for x in syncers}
    ages = [x.checkpoint_age_s for x in syncers if x.checkpoint_age_s is not None]
    syncer = replace(
        syncers[0], **{k: sum(getattr(x, k) for x in syncers) for k in _SUMMED},
        shard=f"{len(syncers)} of {len(syncers) + len(down)} shards", endpoint=",".join(x.endpoint for x in syncers),
        state="degraded" if down else syncers[0].state if len(states) == 1 else "mixed",
        checkpoint_age_s=max(ages, default=None),
        shards=tuple(sorted([*syncers, *down], key=lambda x: int(str(x.shard or "0/1").split("/")[0]))))
    fragments = tuple(sorted((f for st in statuses for f in st.fragments), key=lambda f: f.fragment))
    learners: dict[str, LearnerStatus] = {}
    for st in statuses:
        for ln in st.learners:
            have = learners.get(ln.id)
            learners[ln.id] = ln if have is None else _merged(have, ln)
    return SyncerStatus(syncer=syncer, fragments=fragments, learners=tuple(learners[k] for k in sorted(learners)))


def _merged(a: LearnerStatus, b: LearnerStatus) -> LearnerStatus:
    """One learner's entries of two shards as one."""
    def least(x: float | None, y: float | None) -> float | None:
        return min((v for v in (x, y) if v is not None), default=None)

    def most(x: int | None, y: int | None) -> int | None:
        return max((v for v in (x, y) if v is not None), default=None)

    return replace(
        a, **{k: getattr(a, k) + getattr(b, k) for k in _LEARNER_SUMS},
        ranks=tuple(sorted(set(a.ranks) | set(b.ranks))),
        last_seen_s=least(a.last_seen_s, b.last_seen_s),
        last_contribution_s=least(a.last_contribution_s, b.last_contribution_s),
        version_lag=most(a.version_lag, b.version_lag), step=most(a.step, b.step), world=most(a.world, b.world),
        based_on=tuple(sorted(a.based_on + b.based_on, key=lambda x: x.fragment)),
        state="connected" if "connected" in (a.state, b.state) else a.state)


def render(status: SyncerStatus, endpoint: str) -> str:
    """The status as the two tables of the interactive view (plain text)."""
    s = status.syncer
    rejected = f"rejected: {s.rejected_contributions} contributions, {s.rejected_messages} messages  "
    out = [
        f"rackmend syncer {endpoint}  {s.state}  up {_fmt_s(s.uptime_s)}  "
        f"merges {s.merges}  grace {_fmt_s(s.grace_s)}  quorum {'?' if s.min_quorum is None else s.min_quorum}"
        f"{'  deterministic' if s.deterministic else ''}{'  curve' if s.curve else ''}",
        *(f"  shard {x.shard} at {x.endpoint}: {x.state}, merges {x.merges}" if x.state != "unreachable" else
          f"  shard {x.shard} at {x.endpoint}: UNREACHABLE ({x.error}); its fragments are not shown"
          for x in s.shards),
        rejected + (f"checkpoint {_fmt_s(s.checkpoint_age_s)} ago" if s.checkpoint_age_s is not None
                    else "no checkpoint yet"),
        "",
    ]
    rows = []
    for ln in status.learners:
        ranks = ",".join(str(r) for r in ln.ranks) or "-"
        if ln.world:
            ranks += f"/{ln.world}"
        rows.append([ln.id, ranks, ln.state, _fmt_s(ln.last_seen_s), "-" if ln.step is None else str(ln.step),
                     _fmt_s(ln.step_time_s), "-" if ln.version_lag is None else str(ln.version_lag),
                     _fmt_bytes(ln.bytes_in), _fmt_bytes(ln.bytes_out), str(ln.rejected)])
    out += _table(["LEARNER", "RANKS", "STATE", "SEEN", "STEP", "STEP TIME", "LAG", "IN", "OUT", "REJECTED"], rows)
    out.append("")
    rows = []
    for f in status.fragments:
        inside = ",".join(f"{lid}{'' if lid in f.fresh else '*'}" for lid in f.waiting) or "-"
        rows.append([str(f.fragment), str(f.version), _fmt_bytes(f.bytes), f.phase, inside, _fmt_s(f.round_age_s),
                     _fmt_s(f.grace_left_s), ",".join(f.last_merged) or "-", _fmt_s(f.last_merge_age_s)])
    out += _table(["FRAGMENT", "VERSION", "SIZE", "PHASE", "IN ROUND", "ROUND AGE", "GRACE LEFT", "LAST MERGED", "AGO"],
                  rows)
    if any(set(f.waiting) - set(f.fresh) for f in status.fragments):
        out.append("* stale: based on an older version, rides along with the next merge")
    return "\n".join(out)


def main(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    try:
        return _main(args, stdout or sys.stdout)
    except BrokenPipeError:
        # The reader went away (`rackmend status ... | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(args: argparse.Namespace, stdout: TextIO) -> int:
    try:
        curve = _curve(args)
    except ValueError as exc:
        print(f"rackmend status: {exc}", file=sys.stderr)
        return 2
    if args.timeout <= 0 or args.interval < 0:
        print("rackmend status: --timeout must be > 0 and --interval >= 0 seconds", file=sys.stderr)
        return 2
    endpoints = [e.strip() for e in args.endpoint.split(",") if e.strip()]
    with ExitStack() as stack:
        client = _Shards([stack.enter_context(StatusClient(e, curve=curve)) for e in endpoints])
        if args.once:
            try:
                status = client.query(args.timeout)
            except TransportError as exc:
                print(f"rackmend status: {exc}", file=sys.stderr)
                return 1
            print(json.dumps(status.to_json(), indent=2) if args.json else render(status, args.endpoint), file=stdout)
            return 0
        done = 0
        try:
            while args.iterations is None or done < args.iterations:
                started = time.monotonic()
                try:
                    status = client.query(args.timeout)
                except StatusTimeout as exc:
                    if args.json:  # JSON Lines stay parseable: the complaint goes to stderr
                        print(f"rackmend status: {exc}", file=sys.stderr, flush=True)
                    status, frame = None, f"{exc}\n(retrying every {args.interval:g}s; Ctrl-C to stop)"
                except TransportError as exc:
                    print(f"rackmend status: {exc}", file=sys.stderr)
                    return 1
                if args.json:
                    if status is not None:
                        print(json.dumps(status.to_json()), file=stdout, flush=True)
                else:
                    if status is not None:
                        frame = render(status, args.endpoint)
                    print(f"{'' if args.no_clear else CLEAR}{frame}\n{time.strftime('%H:%M:%S')}  refresh every "
                          f"{args.interval:g}s, Ctrl-C to quit", file=stdout, flush=True)
                done += 1
                if args.iterations is None or done < args.iterations:
                    time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        except KeyboardInterrupt:
            pass
    return 0


class _Shards:
    """Every shard's client, asked at once: one status (``combine``) of the shards that
    answered, the others marked unreachable; the first failure, naming its shard, only
    when none answered (or a single syncer did not)."""

    def __init__(self, clients: list[StatusClient]) -> None:
        self.clients = clients

    def query(self, timeout: float) -> SyncerStatus:
        if len(self.clients) == 1:
            return self.clients[0].query(timeout)
        count = len(self.clients)
        got: list[SyncerStatus | None] = [None] * count
        failed: dict[int, TransportError] = {}

        def ask(s: int) -> None:
            try:
                got[s] = self.clients[s].query(timeout)
            except TransportError as exc:
                failed[s] = exc

        # One thread per shard: a dead shard costs one timeout, not one per shard before it.
        threads = [threading.Thread(target=ask, args=(s,), daemon=True) for s in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10.0)  # each query gives up by itself at ``timeout``
        for s in range(count):
            if got[s] is None and s not in failed:
                failed[s] = StatusTimeout(f"no answer within {timeout:g}s")
        live = [st for st in got if st is not None]
        if not live:
            s = min(failed)
            exc = failed[s]
            raise type(exc)(f"shard {s}/{count} at {self.clients[s].endpoint}: {exc}") from exc
        down = [SyncerPart(shard=f"{s}/{count}", endpoint=self.clients[s].endpoint, state="unreachable",
                           error=str(exc)) for s, exc in sorted(failed.items())]
        return combine(live, down)
