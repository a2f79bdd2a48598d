"""The fail-slow monitor's fleet reads are cached per detector (``current_shift`` and
``level_over`` computed once per state, the detectors' order kept), not rescanned at
every contribution. These tests drive the monitor and a reference that rescans
everything, as the code did before the caches, on the same randomized traces (M in
{2, 3, 16, 64}, shared and individual slowdowns, flags and restores, steps=0 sends, late
sends, forgotten learners, checkpoint reloads) and ask for identical outputs: every
action, every probe of the fleet, the final state."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

import pytest

from rackmend.core import FailSlowMonitor, StepTimeDetector
from rackmend.core.failslow import FLEET_SE, FLEET_TRIM, _trimmed_mean, _wmedian


# ------------------------------------------------------------------ the reference
class RefDetector(StepTimeDetector):
    """``current_shift`` and ``level_over`` as they were before the caches: a pass over
    the recent samples at every call (copied verbatim)."""

    def current_shift(self) -> float | None:
        if self.mu is None or not self._recent:
            return None
        return _wmedian(self._since(self.steps - self.min_steps)) - self.mu

    def level_over(self, span: int, skip_newest: bool = False) -> tuple[float, float] | None:
        if self.mu is None or not self._recent or not self._base:
            return None
        if self._base_level is None:
            self._base_level = _trimmed_mean(list(self._base), FLEET_TRIM)
        recent = list(self._recent)[:-1] if skip_newest and len(self._recent) > 1 else list(self._recent)
        end = recent[-1][0]
        samples = [(x, n) for e, x, n in recent if e > end - span] or [(recent[-1][1], recent[-1][2])]
        covered = sum(n for _, n in samples)
        se = self.sigma * FLEET_SE * math.hypot(1 / math.sqrt(covered), 1 / math.sqrt(max(self._base_steps, 1)))
        return _trimmed_mean(samples, FLEET_TRIM) - self._base_level, se


class RefMonitor(FailSlowMonitor):
    """The monitor with the reference detectors and the fleet chosen by a fresh sort of
    every detector at every call (copied verbatim)."""

    _detector = RefDetector

    def _others(self, learner: str) -> list[StepTimeDetector]:
        others = sorted(((lid, rank), d) for (lid, rank), d in self.detectors.items()
                        if lid != learner and d.mu is not None)
        healthy = [d for (lid, _), d in others if lid not in self.cases]
        return healthy or [d for _, d in others]


# ------------------------------------------------------------------ traces
def make_trace(seed: int, m: int, rounds: int) -> tuple[dict[str, Any], list[tuple]]:
    """Monitor settings and a list of operations: ("observe", learner, rank, step, seconds,
    steps, fleet_size), ("forget", learner), ("reload",), ("probe", learner, rank, span, skip)."""
    rng = random.Random(f"fleet-{seed}-{m}")
    short = m >= 64 or rng.random() < 0.75
    settings = dict(min_slowdown=rng.choice([0.1, 0.2]), min_steps=rng.choice([4, 6, 10]),
                    baseline_steps=rng.choice([24, 32, 48]) if short else 256,
                    advise_after=rng.choice([10, 30]), evict_cost=rng.choice([5.0, 20.0, 200.0, 3600.0]))
    learners = [f"L{i}" for i in range(m)]
    ranks = {lid: (2 if rng.random() < 0.25 else 1) for lid in learners}
    base = {lid: rng.uniform(0.8, 1.25) for lid in learners}
    cv = {lid: rng.choice([0.0, 0.02, 0.1, 0.3]) for lid in learners}
    step = {lid: 0 for lid in learners}

    def spans(n: int, length: float, factor: tuple[float, float]) -> list[tuple[int, int, float]]:
        out = []
        for _ in range(n):
            start = rng.randrange(rounds)
            out.append((start, start + max(1, int(rng.expovariate(1 / length))), rng.uniform(*factor)))
        return out

    shared = spans(rng.randint(1, 3), rounds / 5, (1.3, 2.5))
    own = {lid: spans(rng.randint(0, 2), rounds / 6, (1.15, 4.0)) if rng.random() < 0.4 else [] for lid in learners}
    # A few learners share a slowdown of their own (a rack row), not the whole fleet.
    group = rng.sample(learners, k=max(1, m // 3))
    group_spans = spans(1, rounds / 5, (1.3, 2.0))

    def factor(lid: str, rank: int, r: int) -> float:
        f = 1.0
        for a, b, g in shared:
            f *= g if a <= r < b else 1.0
        for a, b, g in own[lid]:
            f *= g if a <= r < b and (rank == 0 or ranks[lid] == 1 or rng.random() < 0.7) else 1.0
        if lid in group:
            for a, b, g in group_spans:
                f *= g if a <= r < b else 1.0
        return f

    ops: list[tuple] = []
    for r in range(rounds):
        order = learners[:]
        rng.shuffle(order)
        for lid in order:
            if rng.random() < 0.05:
                continue  # this one skips a round
            w = rng.choice([1, 1, 2, 4, 6])
            step[lid] += w
            for rank in range(ranks[lid]):
                times = sorted(base[lid] * factor(lid, rank, r) * math.exp(rng.gauss(0.0, cv[lid]))
                               * (5.0 if rng.random() < 0.005 else 1.0) for _ in range(w))
                seconds = times[len(times) // 2]
                n = 0 if rng.random() < 0.05 else w  # a sender without per-rank times
                ops.append(("observe", lid, rank, step[lid], seconds, n, m))
                if rng.random() < 0.01:  # an older send arriving late, or a repeat
                    ops.append(("observe", lid, rank, step[lid] - rng.randint(0, 3), seconds, w, m))
            if rng.random() < 0.15:
                other = rng.choice(learners)
                ops.append(("probe", other, rng.randrange(ranks[other]), rng.choice([0, 1, 3, 7, 20, 64, 500]),
                            rng.random() < 0.5))
        if rng.random() < 0.01:
            ops.append(("forget", rng.choice(learners)))
        if rng.random() < 0.01:
            ops.append(("reload",))
    return settings, ops


def run(monitor: FailSlowMonitor, ops: list[tuple]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        if op[0] == "observe":
            _, lid, rank, step, seconds, steps, fleet = op
            out.append(monitor.observe(lid, rank, step, seconds, steps, fleet))
            # What the ladder reads, after every sample (the observed learner's view).
            out.append((monitor._fleet_shift(lid), monitor._fleet_seconds(lid), monitor.is_slow(lid)))
        elif op[0] == "forget":
            monitor.forget(op[1])
        elif op[0] == "reload":
            monitor.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
        else:
            _, lid, rank, span, skip = op
            det = monitor.detectors.get((lid, rank))
            out.append(None if det is None else (det.current_shift(), det.level_over(span, skip),
                                                 det.level_over(span), monitor._fleet_view(lid, span or None)))
    out.append(json.dumps(monitor.state_dict(), sort_keys=True))
    return out


CASES = [(seed, m, rounds) for m, rounds in ((2, 400), (3, 400), (16, 150), (64, 60)) for seed in range(4)]


@pytest.mark.parametrize("seed,m,rounds", CASES)
def test_cached_fleet_reads_match_a_full_rescan(seed: int, m: int, rounds: int) -> None:
    settings, ops = make_trace(seed, m, rounds)
    new, ref = FailSlowMonitor(**settings), RefMonitor(**settings)
    got, want = run(new, ops), run(ref, ops)
    assert all(type(d) is RefDetector for d in ref.detectors.values())
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"output {i} differs"


def test_the_traces_walk_the_whole_ladder() -> None:
    """The traces above are worth comparing on: between them they flag, advise, evict
    and restore, with blips, at every M (evict: M >= 3)."""
    for m in (2, 3, 16, 64):
        kinds: Counter[str] = Counter()
        for seed, mm, rounds in CASES:
            if mm != m:
                continue
            settings, ops = make_trace(seed, m, rounds)
            mon = FailSlowMonitor(**settings)
            for op in ops:
                if op[0] == "observe":
                    _, lid, rank, step, seconds, steps, fleet = op
                    kinds.update(type(a).__name__ for a in mon.observe(lid, rank, step, seconds, steps, fleet))
                elif op[0] == "forget":
                    mon.forget(op[1])
        assert {"StopExpecting", "RestoreLearner", "AdviseLearner", "FailSlowBlip"} <= set(kinds), (m, kinds)
        if m >= 3:
            assert kinds["MarkForEviction"] > 0, (m, kinds)
