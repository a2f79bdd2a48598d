"""``rackmend simulate``: a simulated run from flags, printed as a short table (or JSON).

M learners train a toy model (one quadratic per learner) against one syncer in virtual
time, with the real learner and syncer cores; faults and links come from the flags.
It answers "what does a 4x slower rack / a dead rack / a 200 ms link cost, and which
grace window or quorum suits it" in a second. See docs/simulate.md. Only the flag
parsing and printing live here; the simulator is ``rackmend.sim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from rackmend.cli import bandwidth_flag, refuse_renamed
from rackmend.config import (CompressionConfig, ConfigError, LearnerConfig, RackmendConfig, RunConfig, ScheduleConfig,
                             SyncerConfig)
# One machinery turns config fields into options, for ``rackmend syncer`` and here.
from rackmend.service.cli import Option, _options
from rackmend.sim.config import Failures, Kill, RackSpec, SimConfig, Slowdown
from rackmend.sim.engine import Goodput, SimReport, SimulationError, simulate
from rackmend.sim.goodput import simulate_data_parallel

__all__ = ["OPTIONS", "SECTIONS", "add_arguments", "main", "config_from_args", "format_report", "format_goodput"]


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


SECTIONS: tuple[tuple[type, tuple[str, ...] | None], ...] = (
    (ScheduleConfig, ("sync_every", "num_fragments", "overlap")),
    (SyncerConfig, tuple(f.name for f in dataclasses.fields(SyncerConfig) if f.name not in ("learners", "overlap"))),
    (LearnerConfig, ("apply", "mix_alpha", "wait_timeout")),
    (RunConfig, ("deterministic",)),
    (CompressionConfig, ("uplink", "downlink")),
    (SimConfig, ("duration", "seed", "silence_timeout", "fragment_size", "lr", "target_spread")),
    (Failures, None),
)
"""The dataclasses whose fields are ``rackmend simulate`` options (None: every field). Name,
default, choices and help come from the field, as for ``rackmend syncer``; the learners'
own settings (DES-LOC, packing, TensorBoard) have no meaning in the toy model."""

OPTIONS: tuple[Option, ...] = tuple(o for owner, only in SECTIONS for o in _options(owner, only))

ALIASES: dict[str, tuple[str, ...]] = {
    "sync_every": ("-H",), "num_fragments": ("-P", "--fragments"), "overlap": ("--tau",),
    "min_quorum": ("--quorum",),
}
"""Short names kept from the first ``rackmend simulate`` (the paper's H, P, tau, K)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    racks = len(SimConfig().racks)
    p.add_argument("--racks", dest="learners", type=int, default=racks,
                   help=f"how many racks (learners) to simulate, named L0.. (default {racks})")
    refuse_renamed(p, {"--learners": "--racks (how many racks to simulate; `rackmend syncer --learners` "
                                   "is the list of learner ids allowed to join)"})
    p.add_argument("--step-time", type=_floats, default=[1.0], metavar="S[,S...]",
                   help="seconds per inner step: one value for all, or one per learner (default 1)")
    p.add_argument("--step-jitter", type=float, default=RackSpec().jitter,
                   help="relative step-time spread in [0, 1): a step takes step_time * (1 + J*u), u uniform in "
                        "[-1, 1] (default %(default)s)")
    refuse_renamed(p, {"--jitter": "--step-jitter (the step-time spread; a link's latency spread is "
                                   "--latency-jitter in `rackmend demo` and `rackmend link`)"})
    p.add_argument("--latency", type=_floats, default=[0.0], metavar="S[,S...]",
                   help="one-way link latency in seconds, each way: one value or one per learner (default 0)")
    p.add_argument("--bandwidth", type=bandwidth_flag, default=None, metavar="RATE",
                   help="link bandwidth each way, e.g. 50Mbit or 6MB/s, or 'none' (default: no cap)")
    p.add_argument("--kill", type=_kill, action="append", default=[], metavar="I:AT[:REJOIN]",
                   help="learner I dies at AT seconds (and rejoins at REJOIN); repeatable, also for one learner")
    p.add_argument("--slow", type=_slow, action="append", default=[], metavar="I:FACTOR[:START[:END]]",
                   help="learner I steps FACTOR times slower from START to END; repeatable")
    p.add_argument("--data-parallel", action="store_true",
                   help="simulate the data-parallel baseline instead: one job over --chips chips, the same failures "
                        "(--failure-mode restart: not elastic); prints its goodput")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    for o in OPTIONS:
        text = o.help.replace("%", "%%") + f" (default {o.default})"
        if o.name == "silence_timeout":
            text += "; <= 0: never"
        flags = (*ALIASES.get(o.field, ()), o.flag)
        if o.kind == "bool":
            p.add_argument(*flags, dest=o.name, default=o.default, help=text,
                           action=argparse.BooleanOptionalAction if o.default else "store_true")
        else:
            p.add_argument(*flags, dest=o.name, default=o.default, help=text, choices=o.choices,
                           type=str if o.choices else o.parse, metavar=None if o.choices else o.name.upper())


def _section(args: argparse.Namespace, owner: type) -> dict[str, Any]:
    """The fields of ``owner`` set from its options."""
    return {o.field: o.to_field(getattr(args, o.name)) for o in OPTIONS if o.owner is owner}


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
        raise ConfigError(f"--racks must be >= 1, got {n}")
    steps = _per_learner(args.step_time, n, "--step-time")
    latency = _per_learner(args.latency, n, "--latency")
    bytes_per_s = None if args.bandwidth is None else args.bandwidth / 8
    racks = tuple(RackSpec(step_time=s, jitter=args.step_jitter, uplink_latency=lat, downlink_latency=lat,
                           uplink_bandwidth=bytes_per_s, downlink_bandwidth=bytes_per_s)
                  for s, lat in zip(steps, latency))
    run = RackmendConfig(schedule=ScheduleConfig(**_section(args, ScheduleConfig)),
                         syncer=SyncerConfig(**_section(args, SyncerConfig)),
                         learner=LearnerConfig(**_section(args, LearnerConfig)),
                         compression=CompressionConfig(**_section(args, CompressionConfig)),
                         **_section(args, RunConfig))
    sim = _section(args, SimConfig)
    timeout = sim.pop("silence_timeout")
    return SimConfig(run=run, racks=racks, kills=tuple(args.kill), slowdowns=tuple(args.slow),
                     silence_timeout=timeout if timeout is not None and timeout > 0 else None,
                     failures=Failures(**_section(args, Failures)), **sim)


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
    if r.goodput is not None:
        lines.append(format_goodput(r.goodput))
    if r.warnings:
        lines.append(f"{len(r.warnings)} warning(s), first: {r.warnings[0]}")
    return "\n".join(lines)


def format_goodput(g: Goodput) -> str:
    """One line: goodput, where the rest of the chip-time went, uptime, failures."""
    parts = ", ".join(f"{k} {100 * v:.2f}" for k, v in g.shares().items() if k != "useful")
    return (f"goodput {100 * g.goodput:.2f} % of allocated chip-time ({parts} %); uptime {100 * g.uptime:.2f} %; "
            f"{g.failures} chip failures")


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        short = config.failures.short_run_warning(config.duration)
        if short:
            print(f"rackmend simulate: warning: {short}", file=sys.stderr)
        if args.data_parallel:
            g = simulate_data_parallel(config.failures, duration=config.duration, seed=config.seed,
                                       step_time=config.racks[0].step_time)
            print(json.dumps(g.to_dict(), indent=2) if args.json else format_goodput(g))
            return 0
        report = simulate(config)
    except (ConfigError, SimulationError, ValueError) as exc:
        print(f"rackmend simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
