"""Data-parallel baselines of the goodput model: one synchronous job over all the chips.

A data-parallel job has no syncer and no learners to isolate a failure: every chip
failure stops all N chips. Non-elastic (``failure_mode="restart"``), the job is down for
``restart_time``; elastic, it pauses ``downscale_time``, goes on without the failed
chips and pauses ``upscale_time`` to take them back after ``repair_time`` (a failure or
repair during a reshape: ``Failures.reshape_overlap``). The failure
process, the step lost to a failure and the accounting are the learners' of
``rackmend.sim.engine`` (``Goodput``), so the rows of the goodput table compare like
with like. There is nothing of rackmend's algorithm to drive here, so this is a plain
event loop, closed over a few thousand failures per simulated day.
"""

from __future__ import annotations

import heapq
import random

from rackmend.sim.config import Failures
from rackmend.sim.engine import Goodput

__all__ = ["simulate_data_parallel"]


def simulate_data_parallel(failures: Failures, *, duration: float, seed: int = 0,
                           step_time: float = 1.0) -> Goodput:
    """Goodput of one data-parallel job of ``failures.chips`` chips over ``duration``
    seconds, steps of ``step_time`` seconds; ``seed`` drives the failures."""
    f = failures
    if not f.enabled:
        raise ValueError("failures.chips is 0: a data-parallel baseline needs the job's chip count")
    rng = random.Random(f"data-parallel/{seed}")
    n, active = f.chips, f.chips
    acct = dict.fromkeys(("computing", "lost", "down", "paused", "failed"), 0.0)
    now, state, since, step_start = 0.0, "train", 0.0, 0.0
    busy_until = 0.0  # end of the pause or restart in progress
    repairs: list[float] = []  # times failed chips come back (elastic)
    uptime, failures_seen = 0.0, 0

    def close(t: float) -> None:
        nonlocal since, uptime
        dt = t - since
        if state == "down":
            acct["down"] += dt * n
        else:
            acct["failed"] += dt * (n - active)
            acct["computing" if state == "train" else "paused"] += dt * active
            if state == "train":
                uptime += dt
        since = t

    def stop(t: float, seconds: float, how: str) -> None:
        """The job stops at ``t`` for ``seconds``: the step in progress is lost."""
        nonlocal state, busy_until
        close(t)
        if state == "train":
            acct["lost"] += ((t - step_start) % step_time) * active
            busy_until = t
        absorbed = state == "paused" and busy_until > t and f.reshape_overlap == "absorb"
        state = how
        if not absorbed:  # a reshape under way that starts over ends ``seconds`` after this
            busy_until = max(busy_until, t + seconds)

    next_fail = rng.expovariate(active / f.mtbi_s)
    for _ in range(100_000_000):  # bounded: each pass consumes one failure, repair or resume
        candidates = [next_fail, repairs[0] if repairs else float("inf"),
                      busy_until if state != "train" else float("inf")]
        t = min(candidates)
        if t > duration:
            break
        now = t
        if t == candidates[2]:  # a pause or restart ends
            close(now)
            state, step_start = "train", now
            continue
        if t == candidates[1]:  # failed chips repaired: upscale
            heapq.heappop(repairs)
            close(now)
            active = min(n, active + f.chips_per_failure)
            stop(now, f.upscale_time, "paused")
        else:  # a chip fails
            failures_seen += 1
            if f.failure_mode == "restart":
                if state == "down":  # its chips are being replaced anyway
                    next_fail = now + rng.expovariate(active / f.mtbi_s)
                    continue
                stop(now, f.restart_time, "down")
            else:
                stop(now, f.downscale_time, "paused")  # at the chip count it ran on until now
                active -= min(f.chips_per_failure, active)
                heapq.heappush(repairs, now + f.repair_time)
        next_fail = now + (rng.expovariate(active / f.mtbi_s) if active > 0 else float("inf"))
    else:
        raise RuntimeError("data-parallel simulation did not end; duration too long for its event bound")
    now = duration
    close(now)
    return Goodput(allocated=n * duration, useful=acct["computing"] - acct["lost"], lost=acct["lost"],
                   down=acct["down"], paused=acct["paused"], failed=acct["failed"], blocked=0.0,
                   uptime=uptime / duration, failures=failures_seen)
