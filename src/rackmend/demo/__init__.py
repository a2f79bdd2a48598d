"""``rackmend demo``: one model trained across emulated racks over an emulated WAN,
with faults, once per arm, and a report of what each arm bought.

Runbook: ``rackmend demo`` (what ``make demo`` runs) takes about five minutes on two
CPU cores and writes ``rackmend-demo-report/`` (``report.md``, PNG plots, JSONL
logs). ``rackmend demo --help`` lists the knobs; ``--duration 20 --arms rackmend``
is a quick look.

Per arm, M learner processes (plain processes running ``rackmend.demo.worker``)
train the byte-level GPT against a real ``rackmend syncer`` process, each through
its own emulated link (default 50 Mbit/s, 100 ms ±50 % one way). The same faults hit
every arm at the same moments: learner 1 is SIGKILLed and started again, learner 2
turns fail-slow for a while (in the rackmend arms the syncer flags it, stops waiting
for it and restores it afterwards), learner 3 has a four times worse link. Arms:

- ``data-parallel``: exchange every step, blocking, all learners (H=1, P=1, tau=0).
- ``diloco``: classic DiLoCo: the whole model every H steps, blocking, quorum = all.
- ``rackmend``: rackmend's defaults: P fragments, tau overlap, K=1, adaptive grace.
- ``local``: no rackmend at all (the step-time baseline; not run by default).

Modules: ``spec`` (settings and arms, plain data), ``worker`` (one learner process),
``orchestrate`` (runs an arm: processes, links, faults, measurements), ``report``
(files from measurements), ``threads`` (the older in-process variant used by tests
and ``benchmarks/anchoring.py``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rackmend.cli import bandwidth_flag, refuse_renamed

if TYPE_CHECKING:  # the CLI imports this package for --help; torch loads only when a demo runs
    from rackmend.demo.spec import RunSettings

__all__ = ["add_arguments", "main", "settings_from_args"]


def _learner_or_none(text: str) -> int | None:
    return None if text.lower() in ("none", "off", "-") else int(text)


def _window(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    return float(lo), float(hi)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rackmend.demo.spec import ARMS, FaultPlan, LinkPlan, RunSettings

    d, f, link = RunSettings(), FaultPlan(), LinkPlan()
    g = p.add_argument_group("run")
    g.add_argument("--racks", dest="learners", type=int, default=d.learners,
                   help="how many racks to run, one learner process each: M (default %(default)s)")
    g.add_argument("--duration", type=float, default=d.duration_s,
                   help="seconds each arm trains, after every learner joined (default %(default)s)")
    g.add_argument("--steps", type=int, default=None, help="also stop each learner after this many steps")
    g.add_argument("--arms", default=",".join(d.arms),
                   help=f"comma-separated arms from {', '.join(ARMS)} (default %(default)s)")
    g.add_argument("--out", type=Path, default=Path("rackmend-demo-report"), help="report folder (default %(default)s)")
    g.add_argument("--keep-raw", action="store_true", help="keep each arm's raw files (process output, logs) in OUT/raw")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of model, data and jitter (default %(default)s)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    g = p.add_argument_group("schedule of the diloco and rackmend arms")
    g.add_argument("--sync-every", type=int, default=d.sync_every, help="H (default %(default)s)")
    g.add_argument("--fragments", type=int, default=d.fragments, help="P of the rackmend arm (default %(default)s)")
    g.add_argument("--overlap", type=int, default=d.overlap, help="tau of the rackmend arm (default %(default)s)")
    g = p.add_argument_group("emulated link of every learner")
    g.add_argument("--bandwidth", type=bandwidth_flag, default=None if link.bandwidth_mbit is None
                   else link.bandwidth_mbit * 1e6, metavar="RATE",
                   help=f"per direction, e.g. 50Mbit or 6MB/s, or 'none' for no cap "
                        f"(default {link.bandwidth_mbit:g}Mbit)")
    g.add_argument("--latency-ms", type=float, default=link.latency_ms, help="one-way latency (default %(default)s)")
    g.add_argument("--latency-jitter", type=float, default=link.jitter,
                   help="latency spread, fraction (default %(default)s)")
    g = p.add_argument_group("faults (times are fractions of --duration; learner indices from 0; 'none' turns one off)")
    g.add_argument("--no-faults", action="store_true", help="inject no fault at all")
    g.add_argument("--kill-learner", type=_learner_or_none, default=f.kill_learner,
                   help="learner to SIGKILL and restart")
    g.add_argument("--kill-window", type=_window, default=(f.kill_at, f.restart_at),
                   help="KILL_AT:RESTART_AT (default %(default)s)")
    g.add_argument("--slow-learner", type=_learner_or_none, default=f.slow_learner,
                   help="learner that turns fail-slow")
    g.add_argument("--slow-window", type=_window, default=(f.slow_from, f.slow_until),
                   help="FROM:UNTIL (default %(default)s)")
    g.add_argument("--slow-factor", type=float, default=f.slow_factor, help="step time multiplier (default %(default)s)")
    g.add_argument("--worse-link", type=_learner_or_none, default=f.worse_link_learner,
                   help="learner with the worse link")
    refuse_renamed(p, {"--jitter": "--latency-jitter (`rackmend simulate` spreads step times with --step-jitter)",
                       "--kill": "--kill-learner (`rackmend simulate --kill` takes I:AT[:REJOIN] in seconds)",
                       "--slow": "--slow-learner (`rackmend simulate --slow` takes I:FACTOR[:START[:END]])",
                       "--learners": "--racks (how many racks to run; `rackmend syncer --learners` is "
                                    "the list of learner ids allowed to join)"})
    g.add_argument("--worse-link-factor", type=float, default=f.worse_link_factor,
                   help="bandwidth / F and latency x F on that link (default %(default)s)")


def settings_from_args(a: argparse.Namespace) -> RunSettings:
    from rackmend.demo.spec import FaultPlan, LinkPlan, RunSettings

    faults = FaultPlan.none() if a.no_faults else FaultPlan(
        kill_learner=a.kill_learner, kill_at=a.kill_window[0], restart_at=a.kill_window[1],
        slow_learner=a.slow_learner, slow_from=a.slow_window[0], slow_until=a.slow_window[1], slow_factor=a.slow_factor,
        worse_link_learner=a.worse_link, worse_link_factor=a.worse_link_factor)
    bw = None if a.bandwidth is None else a.bandwidth / 1e6
    return RunSettings(
        learners=a.learners, duration_s=a.duration, max_steps=a.steps, batch_size=a.batch_size, seed=a.seed,
        sync_every=a.sync_every, fragments=a.fragments, overlap=a.overlap,
        arms=tuple(x.strip() for x in a.arms.split(",") if x.strip()),
        link=LinkPlan(bandwidth_mbit=bw, latency_ms=a.latency_ms, jitter=a.latency_jitter), faults=faults)


def main(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rackmend.config import ConfigError
    from rackmend.demo.orchestrate import run_arm, temporary_run_dir
    from rackmend.demo.report import failslow_notes, format_summary, write_report
    from rackmend.demo.spec import arm_specs
    from rackmend.workloads import GPT

    try:
        s = settings_from_args(a)
    except (ConfigError, ValueError) as exc:
        print(f"rackmend demo: {exc}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in GPT(s.model).parameters())
    print(f"rackmend demo: {s.learners} learner processes, byte-level GPT with {params / 1e6:.2f} M parameters, "
          f"arms {', '.join(s.arms)}; links {s.link.link_config().describe()}", flush=True)
    raw = temporary_run_dir()
    runs = []
    try:
        for name, spec in arm_specs(s).items():
            total = s.duration_s or float(s.max_steps or 0)
            with tqdm(total=round(total), desc=f"{name:<13}", unit="s" if s.duration_s else "step",
                      dynamic_ncols=True) as bar:
                started: list[bool] = []

                def progress(elapsed: float, st: dict) -> None:
                    if not started:
                        bar.reset(bar.total)  # the arm's clock starts once every learner joined
                        started.append(True)
                    bar.n = min(round(elapsed if s.duration_s else st["steps"] / s.learners), bar.total)
                    bar.set_postfix_str(f"steps={st['steps']} loss={st['loss']:.3f}"
                                        + (f" merged=[{st['merged']}]" if "merged" in st else ""), refresh=True)

                runs.append(run_arm(spec, s, raw / name, progress))
                bar.n = bar.total
        summary = write_report(a.out, runs, s, "rackmend demo " + " ".join(map(shlex.quote, sys.argv[2:])))
    finally:
        if a.keep_raw:
            shutil.copytree(raw, a.out / "raw", dirs_exist_ok=True)
        shutil.rmtree(raw, ignore_errors=True)
    print()
    print(format_summary(summary["arms"]))
    for run in runs:
        for line in failslow_notes(run):
            print(f"{run.name}: {line}")
    print(f"\nreport: {a.out / 'report.md'} (plots and JSONL logs next to it)")
    return 0
