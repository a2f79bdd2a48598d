"""``rackmend simulate``: a simulated run from flags, printed as a short table (or JSON).

M learners train a toy model (one quadratic per learner) against one syncer in virtual
time, with the real learner and syncer cores; faults and links come from the flags.
It answers "what does a 4x slower rack / a dead rack / a 200 ms link cost, and which
grace window or quorum suits it" in a second. See docs/simulate.md. Only the flag
parsing and printing live here; the simulator is ``rackmend.sim``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rackmend.config import ConfigError, LearnerConfig, RackmendConfig, ScheduleConfig, SyncerConfig
from rackmend.sim.config import Kill, RackSpec, SimConfig, Slowdown
from rackmend.sim.engine import SimReport, SimulationError, simulate

__all__ = ["add_arguments", "main", "config_from_args", "format_report"]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list of numbers, got {text!r}")


def _kill(text: str) -> Kill:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        return Kill(learner=int(parts[0]), at=float(parts[1]),
                    rejoin_at=float(parts[2]) if len(parts) == 3 else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kill takes I:AT or I:AT:REJOIN (learner index, seconds), got {text!r}")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"--kill {text}: {exc}")


def _slow(text: str) -> Slowdown:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError
        return Slowdown(learner=int(parts[0]), factor=float(parts[1]),
                        start=float(parts[2]) if len(parts) > 2 else 0.0,
                        end=float(parts[3]) if len(parts) > 3 else math.inf)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slow takes I:FACTOR, I:FACTOR:START or I:FACTOR:START:END (learner index, multiplier, seconds), "
            f"got {text!r}")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"--slow {text}: {exc}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, default=4, help="number of learners (racks), named L0.. (default 4)")
    p.add_argument("--step-time", type=_floats, default=[1.0], metavar="S[,S...]",
                   help="seconds per inner step: one value for all, or one per learner (default 1)")
    p.add_argument("--jitter", type=float, default=0.0, help="relative step-time spread in [0, 1) (default 0)")
    p.add_argument("--latency", type=_floats, default=[0.0], metavar="S[,S...]",
                   help="one-way link latency in seconds, each way: one value or one per learner (default 0)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                   help="link bandwidth each way in bytes/s (default unlimited)")
    p.add_argument("-H", "--sync-every", type=int, default=24, help="H: inner steps between syncs of a fragment")
    p.add_argument("-P", "--fragments", type=int, default=4, help="P: number of fragments (default 4)")
    p.add_argument("--tau", type=int, default=2, help="tau: overlap steps before a merged value applies (default 2)")
    p.add_argument("--quorum", type=int, default=1, help="min_quorum: fresh contributions a merge needs (default 1)")
    p.add_argument("--grace-max", type=float, default=2.0, help="longest grace window in seconds (default 2)")
    p.add_argument("--apply", default="auto", choices=("auto", "overwrite", "mix", "keep_local"),
                   help="how learners apply merged values (default auto)")
    p.add_argument("--deterministic", action="store_true", help="deterministic mode: rounds wait for every learner")
    p.add_argument("--kill", type=_kill, action="append", default=[], metavar="I:AT[:REJOIN]",
                   help="learner I dies at AT seconds (and rejoins at REJOIN); repeatable")
    p.add_argument("--slow", type=_slow, action="append", default=[], metavar="I:FACTOR[:START[:END]]",
                   help="learner I steps FACTOR times slower from START to END; repeatable")
    p.add_argument("--silence-timeout", type=float, default=10.0,
                   help="seconds until the syncer declares a dead learner gone; <= 0: never (default 10)")
    p.add_argument("--duration", type=float, default=600.0, help="virtual seconds to simulate (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the jitter (default 0)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")


def _per_learner(values: list[float], n: int, flag: str) -> list[float]:
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ConfigError(f"{flag} lists {len(values)} values for {n} learners; give one value or {n}")
    return values


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` the flags describe (ConfigError names a bad flag value)."""
    n = args.learners
    if n < 1:
        raise ConfigError(f"--learners must be >= 1, got {n}")
    steps = _per_learner(args.step_time, n, "--step-time")
    latency = _per_learner(args.latency, n, "--latency")
    racks = tuple(RackSpec(step_time=s, jitter=args.jitter, uplink_latency=lat, downlink_latency=lat,
                           uplink_bandwidth=args.bandwidth, downlink_bandwidth=args.bandwidth)
                  for s, lat in zip(steps, latency))
    run = RackmendConfig(
        schedule=ScheduleConfig(sync_every=args.sync_every, num_fragments=args.fragments, overlap=args.tau),
        syncer=SyncerConfig(min_quorum=args.quorum, grace_max=args.grace_max),
        learner=LearnerConfig(apply=args.apply), deterministic=args.deterministic)
    return SimConfig(run=run, racks=racks, duration=args.duration, seed=args.seed, kills=tuple(args.kill),
                     slowdowns=tuple(args.slow),
                     silence_timeout=args.silence_timeout if args.silence_timeout > 0 else None)


def format_report(r: SimReport) -> str:
    """A short human-readable table of ``r``."""
    lines = [f"{'learner':<8} {'steps':>6} {'idle s':>8} {'down s':>8} {'sent':>5} {'merged':>6} {'stale':>5} "
             f"{'reject':>6} {'loss':>9}"]
    for lr in r.learners:
        lines.append(f"{lr.learner:<8} {lr.steps:>6} {lr.idle_s:>8.1f} {lr.down_s:>8.1f} {lr.sent:>5} "
                     f"{lr.merged:>6} {lr.merged_stale:>5} {lr.rejected:>6} {lr.loss:>9.4f}")
    gap = "-" if r.max_merge_gap is None else f"{r.max_merge_gap:.2f} s"
    lag = "-" if r.version_lag_median is None else f"median {r.version_lag_median:g}, max {r.version_lag_max}"
    lines += [
        f"merges per fragment: {', '.join(map(str, r.merges))}   max gap between merges of a fragment: {gap}",
        f"version lag of merged contributions: {lag}",
        f"global loss {r.global_loss:.4f} (start {r.initial_loss:.4f}, optimum {r.optimum_loss:.4f}, "
        f"gap {r.global_loss - r.optimum_loss:.4g})",
    ]
    if r.warnings:
        lines.append(f"{len(r.warnings)} warning(s), first: {r.warnings[0]}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        report = simulate(config_from_args(args))
    except (ConfigError, SimulationError) as exc:
        print(f"rackmend simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
