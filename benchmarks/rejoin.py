"""How long a learner killed mid-run takes to be back in the merges, beside a plain restart.

Three learners train the demo GPT (1.3 M parameters, P=4, H=8, tau=1) against one
``rackmend syncer`` on 127.0.0.1. Each trial SIGKILLs learner l2 and starts it again at
once; measured from that start: the interpreter and imports, the optimizer built (the
join: hello, answer, the global values), the first step, and the first merged round
that holds l2's own work (the syncer's ``merge`` record naming l2). Beside it, in the
same trial and started at the same moment on the same cores, a *plain restart*: the
same script without rackmend (inner optimizer only) to its first step, the floor any
restart pays.

Two kinds of trial, the token ones first: **token**, the restarted process finds the
resume token the killed one kept (same host: the default), and **no token**, it does
not (as on another host, ``RACKMEND_TOKEN_DIR=""``), so the syncer admits it only once
the rank has been silent for ``--takeover-after`` (the default, 30 s; it was 5 s before
resume tokens, which a restart's imports and model build nearly use up on their own).

    python benchmarks/rejoin.py            # 5 trials of each kind
    python benchmarks/rejoin.py --quick    # 2 of each

Prints a table (medians, min-max) and writes ``benchmarks/results/rejoin.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser, running_syncer, summary  # noqa: E402

LEARNER = [sys.executable, str(Path(__file__).parent / "_rejoin_learner.py")]
TAKEOVER_AFTER = 30.0
"""The syncer's default ``--takeover-after``, which a restart without the token waits for."""
WAIT_S = 120.0
"""Bound on every wait (a join, a merge): a trial that passes it fails the benchmark."""


H, P, TOKENS_PER_STEP = 8, 4, 8 * 64
"""The learners' schedule (``_rejoin_learner.py``'s defaults) and batch."""


def _merges_of(events: Path, lid: str, first_sends: bool = False) -> int:
    """Merged rounds holding ``lid``'s work; ``first_sends``: only work of fewer than H
    steps, which a learner sends only in its first period after a join (fragment p's
    first send comes p·H/P steps in; later ones carry H steps each), so a round that
    merged a killed process's last send does not count as its successor's."""
    if not events.exists():
        return 0
    n = 0
    for line in events.read_text().splitlines():
        if '"event": "merge"' in line:
            rec = json.loads(line)
            if lid in rec.get("merged", ()) and (not first_sends or rec["tokens"][lid] < H * TOKENS_PER_STEP):
                n += 1
    return n


def _takeovers(events: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in events.read_text().splitlines() if '"event": "takeover"' in line]


def _wait(what: str, cond: Any, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out after {WAIT_S:.0f}s waiting for {what}")
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a learner exited while waiting for {what}")
        time.sleep(0.02)


def _start(endpoint: str, lid: str, times: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*LEARNER, "--endpoint", endpoint, "--id", lid, "--times", str(times)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=None, help="trials of each kind (default 5, --quick 2)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the logs here (default: a temporary folder)")
    a = p.parse_args()
    trials = a.trials or (2 if a.quick else 5)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rackmend-rejoin-") as tmp:
        work = a.workdir or Path(tmp)
        tokens = work / "tokens"
        env = {**os.environ, "RACKMEND_TOKEN_DIR": str(tokens), "OMP_NUM_THREADS": "1"}
        os.environ.update(env)  # the learners started below inherit it
        with running_syncer(work / "syncer", threads=1, flags=("--overlap", "1")) as endpoint:
            events = work / "syncer" / "events.jsonl"
            procs = {lid: _start(endpoint, lid, work / f"{lid}.json", work / f"{lid}.out")
                     for lid in ("l0", "l1", "l2")}
            try:
                # Past every learner's first sends (fragment p's after p·H/P steps) and a period more.
                _wait("every learner to merge two periods",
                      lambda: all(_merges_of(events, lid) >= 2 * P for lid in procs), list(procs.values()))
                for n in range(2 * trials):
                    # The token trials first: a no-token restart takes the rank with a new token,
                    # which would leave the file's token stale for a token trial after it.
                    kind = "token" if n < trials else "no token"
                    procs["l2"].kill()
                    procs["l2"].wait(30)
                    before, fresh = _merges_of(events, "l2"), _merges_of(events, "l2", first_sends=True)
                    takeovers = len(_takeovers(events))
                    times = work / f"l2-{n}.json"
                    restarted = time.time()
                    # Side by side: the plain restart starts with the real one, on the same cores.
                    plain_times = work / f"plain{n}.json"
                    plain = subprocess.Popen([*LEARNER, "--plain", "--steps", "1", "--times", str(plain_times)],
                                             stdout=subprocess.DEVNULL)
                    procs["l2"] = _start(endpoint, "l2", times, work / "l2.out",
                                         env={**env, "RACKMEND_TOKEN_DIR": ""} if kind == "no token" else None)
                    _wait("the restarted l2's work to merge",
                          lambda: _merges_of(events, "l2", first_sends=True) > fresh, list(procs.values()))
                    merged = time.time() - restarted
                    if plain.wait(WAIT_S) != 0:
                        raise SystemExit("the plain restart failed")
                    t = json.loads(times.read_text())
                    new = _takeovers(events)[takeovers:]
                    take = new[0] if new else {}
                    row = {"kind": kind, "imports_s": t["imported"] - restarted, "model_s": t["model"] - t["imported"],
                           "join_s": t["built"] - t["model"], "first_step_s": t["first_step"] - restarted,
                           "own_work_merged_s": merged,
                           "plain_first_step_s": json.loads(plain_times.read_text())["first_step"] - restarted,
                           "takeover": {k: take.get(k) for k in ("token", "silent_s")}}
                    rows.append(row)
                    print(f"trial {n + 1}/{2 * trials} ({kind}): own work merged {merged:.1f}s after the restart, "
                          f"join {row['join_s']:.1f}s, plain restart to its first step "
                          f"{row['plain_first_step_s']:.1f}s; takeover {row['takeover']}", flush=True)
                    # Past its first sends (fragment p's after p·H/P steps) and a whole period more.
                    _wait("l2 to merge a full period", lambda: _merges_of(events, "l2") > before + 2 * P,
                          list(procs.values()))
            finally:
                for proc in procs.values():
                    proc.kill()
                    proc.wait(30)

    cols = ["imports_s", "model_s", "join_s", "first_step_s", "own_work_merged_s", "plain_first_step_s"]
    stats = {kind: {c: summary([r[c] for r in rows if r["kind"] == kind]) for c in cols}
             for kind in ("token", "no token")}
    print("\nrestart of l2, seconds: median [min-max]")
    print(f"{'':<10}" + "".join(f"{c:>20}" for c in cols))
    for kind, by_col in stats.items():
        print(f"{kind:<10}" + "".join(f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]".rjust(20)
                                      for s in by_col.values()))
    result = {f"{k.replace(' ', '_')}_{c}": stats[k][c]["median"]
              for k in stats for c in ("own_work_merged_s", "join_s")}
    result["plain_first_step_s"] = stats["token"]["plain_first_step_s"]["median"]
    finish("rejoin", a.out, {"trials": trials, "takeover_after_s": TAKEOVER_AFTER, "model": "demo GPT 1.3M",
                             "schedule": {"H": H, "P": P, "tau": 1}, "rows": rows, "stats": stats}, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
