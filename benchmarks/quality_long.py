"""Training quality over a long horizon (150 outer rounds and more) at two model sizes,
and the ablation that finds why rackmend's gap to data-parallel grows with the horizon.

Runbook:

- ``python benchmarks/quality_long.py --jobs 2`` runs every arm at both sizes over three
  seeds, two runs at a time (each on one torch thread; the progress bar gives the time
  left). On 2 cores that is about 1.5 hours for the small model's 24 runs and about 9 for
  the larger model's (about 45 minutes a run two at a time): the whole matrix does not
  fit 3 hours there; ``--sizes``, ``--arms`` and ``--seeds`` pick the part that does.
  ``--quick`` is a smoke run of a few minutes (12 rounds, one seed, the small size).
- ``--section ablation`` switches each suspected cause of the gap off alone, on the
  small model (``--ablation-rounds``, default 75); ``--variants 'rackmend;rackmend, H=4'``
  runs some of them.
- Every finished run is kept in ``benchmarks/results/quality-long-runs.jsonl``, keyed
  by everything that decides its number: an interrupted run goes on where it stopped,
  and the matrix can be filled over several sessions (``--sizes``, ``--seeds``,
  ``--arms`` pick a part). ``--fresh`` ignores what is kept; with ``--out X.json`` runs
  are kept in ``X-runs.jsonl`` unless ``--runs`` names the file. ``--kept-only`` trains
  nothing and tabulates what is kept (each run paired with data-parallel's of its seed).

Writes ``benchmarks/results/quality-long.json`` (its RESULT: ``gap_dp_small``,
``gap_dp_large``: rackmend's defaults against data-parallel at equal tokens, as a
fraction, median over seeds; ``rounds``), plots of held-out loss against tokens per
size and of the gap against rounds (``quality-long-*.png``), and prints a table.

The arms are those of ``benchmarks/quality.py`` (every learner its own stream of
random windows of the same corpus; all train the same total tokens; deterministic
mode but ``rackmend-async``), plus classic DiLoCo at outer lr 0.4 and rackmend with int4
compression both ways (block absmax, error feedback on both sides). Every arm trains
with the same inner schedule: AdamW at peak lr 3e-3, linear warm-up over the first
2 % of each learner's steps, then a half cosine down to 10 % of the peak at its last
step (``--lr-schedule constant`` keeps 3e-3 throughout, the setting of the short
benchmark).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from _common import RESULTS, finish, parser
from quality import H_DEFAULT, bootstrap, config, outer
from rackmend.config import CompressionConfig, LearnerConfig, RackmendConfig
from rackmend.demo.threads import thread_settings, train_arm
from rackmend.workloads import ByteCorpus, GPTConfig

M = 4
SIZES = {"small": GPTConfig(), "large": GPTConfig(n_layer=8, n_embd=232)}
"""The demo GPT (1.29 M parameters) and the smallest of its shape at least 4x its size
(5.27 M: twice the layers, 232 wide), same tokenizer and corpus."""
RUNS = RESULTS / "quality-long-runs.jsonl"
BATCH = thread_settings(steps=1).batch_size
"""Sequences per learner step (the demo's 8, of 64 bytes each)."""
TOKENS_PER_ROUND = M * H_DEFAULT * BATCH * GPTConfig().block_size
"""Tokens all learners train between two syncs of a fragment (every size has the same
block size): the x axis of the plots, in outer rounds."""
INT4 = CompressionConfig(uplink="int4", downlink="int4")
"""Both directions int4 (block absmax, error feedback on each learner and on the syncer)."""


def arms(H: int) -> dict[str, tuple[RackmendConfig, int]]:
    """Arm name -> (config, number of learners)."""
    return {
        "data-parallel": (config(M, 1, 1, 0, weighting="uniform", **outer(1.0, 0.0)), M),
        "alone": (config(1, H, 1, 0, **outer(1.0, 0.0)), 1),
        "averaging": (config(M, H, 1, 0, **outer(1.0, 0.0)), M),
        "diloco-0.7": (config(M, H, 1, 0, **outer(0.7, 0.9)), M),
        "diloco-0.4": (config(M, H, 1, 0, **outer(0.4, 0.9)), M),
        "rackmend": (config(M, H, 4, 2), M),
        "rackmend-async": (config(M, H, 4, 2, deterministic=False), M),
        "rackmend-int4": (replace(config(M, H, 4, 2), compression=INT4), M),
    }


def ablations() -> dict[str, tuple[str, RackmendConfig, int, int]]:
    """Variant -> (schedule, config, learners, batch): each switches one suspected cause
    of the gap off (or on) against rackmend's defaults under the cosine schedule; one
    learner alone and Streaming DiLoCo's outer step (Nesterov, lr 0.4, momentum 0.9) on
    rackmend's schedule are there to compare with."""
    base = arms(H_DEFAULT)
    rackmend = base["rackmend"][0]
    return {name: (v + (BATCH,))[:4] for name, v in {
        "data-parallel, constant lr": ("constant", *base["data-parallel"]),
        "rackmend, constant lr": ("constant", *base["rackmend"]),
        "data-parallel": ("cosine", *base["data-parallel"]),
        "rackmend": ("cosine", *base["rackmend"]),
        "rackmend, H=4": ("cosine", config(M, 4, 4, 2), M),
        "rackmend, H=8": ("cosine", config(M, 8, 4, 2), M),
        "rackmend, Adam moments averaged every merge": (
            "cosine", replace(rackmend, schedule=replace(rackmend.schedule, desloc=True, desloc_ku=H_DEFAULT,
                                                         desloc_kv=H_DEFAULT)), M),
        "averaging (P=1, tau=0)": ("cosine", *base["averaging"]),
        "rackmend, outer Nesterov lr 0.4, momentum 0.9": ("cosine", config(M, H_DEFAULT, 4, 2, **outer(0.4, 0.9)), M),
        "alone": ("cosine", *base["alone"]),
        "rackmend, tau=0": ("cosine", config(M, H_DEFAULT, 4, 0), M),
        "rackmend, apply keep_local": ("cosine", replace(rackmend, learner=LearnerConfig(apply="keep_local")), M),
        "rackmend, outer lr 1.5": ("cosine", config(M, H_DEFAULT, 4, 2, **outer(1.5, 0.0)), M),
        "rackmend-async": ("cosine", *base["rackmend-async"]),
        # What async changes besides timing: the apply rule auto picks keep_local, and a
        # round that closes without a learner counts it as a zero.
        "rackmend-async, apply overwrite": ("cosine", replace(base["rackmend-async"][0],
                                                              learner=LearnerConfig(apply="overwrite")), M),
        "rackmend-async, absent not counted": ("cosine", replace(base["rackmend-async"][0], syncer=replace(
            base["rackmend-async"][0].syncer, count_absent=False)), M),
        "rackmend, batch 32 per learner, H=4": ("cosine", config(M, 4, 4, 2), M, 32),
        "rackmend, int4 both ways": ("cosine", *base["rackmend-int4"]),
        "rackmend, int8 both ways": ("cosine", replace(rackmend, compression=CompressionConfig(
            uplink="int8", downlink="int8")), M),
        "rackmend, int4 up, fp32 down": ("cosine", replace(rackmend, compression=CompressionConfig(uplink="int4")), M),
    }.items()}


def changed(obj: Any) -> dict[str, Any]:
    """The fields of a (nested) config dataclass that differ from their defaults: a new
    option whose default keeps today's behaviour leaves every kept run's key as it was,
    a changed default makes new runs."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        if value != default:
            out[f.name] = changed(value) if is_dataclass(value) else value
    return out


def key(size: str, seed: int, steps: int, schedule: str, cfg: RackmendConfig, learners: int,
        batch: int = BATCH) -> str:
    """Everything that decides a run's number, not its label: an ablation variant equal
    to an arm reuses the arm's runs."""
    k = {"size": size, "model": asdict(SIZES[size]), "seed": seed, "steps": steps, "learners": learners,
         "schedule": schedule, "config": changed(cfg)}
    if batch != BATCH:
        k["batch"] = batch
    return json.dumps(k, sort_keys=True, default=repr)


class Runs:
    """The runs kept on disk, one JSON line each; a run is trained only when missing."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        if path.exists() and not fresh:
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.done[row["key"]] = row

    def put(self, k: str, result: dict[str, Any]) -> None:
        row = {"key": k, **result}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.done[k] = row


@dataclass(frozen=True)
class Job:
    """One training run: everything ``train`` needs, picklable for a worker process."""

    size: str
    seed: int
    steps: int
    """Steps per learner."""
    schedule: str
    cfg: RackmendConfig
    learners: int
    batch: int = BATCH
    evals: int = 10

    @property
    def key(self) -> str:
        return key(self.size, self.seed, self.steps, self.schedule, self.cfg, self.learners, self.batch)


def train(job: Job, corpus: ByteCorpus | None = None, bar: tqdm | None = None) -> dict[str, Any]:
    """Train ``job``'s run on one torch thread: its held-out curve, final loss and wall time."""
    torch.set_num_threads(1)
    s = thread_settings(learners=job.learners, steps=job.steps, seed=job.seed, evals=job.evals,
                        model=SIZES[job.size], lr_schedule=job.schedule, warmup_steps=max(1, job.steps // 50),
                        batch_size=job.batch)
    t0 = time.perf_counter()
    r = train_arm(job.size, job.cfg, s, corpus or ByteCorpus(), progress=bar)
    return {"points": r.points, "loss": r.points[-1][2], "wall_s": time.perf_counter() - t0,
            "merges": r.merges, "guard_events": r.guard_events}


def train_missing(runs: Runs, jobs: list[Job], parallel: int, corpus: ByteCorpus) -> None:
    """Train the jobs not kept yet, keeping each as it finishes: here, one after another,
    or over ``parallel`` worker processes of one torch thread each (each run is the same
    either way: a deterministic run's number depends on its seed alone)."""
    todo = list({job.key: job for job in jobs if job.key not in runs.done}.values())
    total = sum(job.steps * job.learners for job in todo)
    with tqdm(total=total, unit="step", desc="learner steps still to train", smoothing=0.02, mininterval=5) as bar:
        if parallel <= 1:
            for job in todo:
                runs.put(job.key, train(job, corpus, bar))
            return
        # spawn: a fresh interpreter per worker, not a fork of this one's torch state
        with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
            running = {pool.submit(train, job): job for job in todo}
            for done in as_completed(running):
                job = running[done]
                runs.put(job.key, done.result())
                bar.update(job.steps * job.learners)
                bar.set_postfix(run=f"{job.size} seed {job.seed}", loss=f"{runs.done[job.key]['loss']:.3f}",
                                refresh=False)


def loss_at(points: list[list[float]], tokens: float) -> float:
    """Held-out loss at ``tokens``, linearly interpolated between evaluations."""
    for (t0, _, l0), (t1, _, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l1
    return points[-1][2]


def gap_curve(runs: list[dict[str, Any]], dp: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(outer rounds, median over seeds of loss / data-parallel's loss - 1) at each of
    the arm's evaluations, data-parallel read at the same tokens."""
    out = []
    for i, (tokens, _, _) in enumerate(runs[0]["points"][1:], start=1):
        gaps = [r["points"][i][2] / loss_at(d["points"], r["points"][i][0]) - 1 for r, d in zip(runs, dp)]
        out.append((tokens / TOKENS_PER_ROUND, statistics.median(gaps)))
    return out


def plot(path: Path, title: str, curves: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    colors = plt.get_cmap("tab20").colors  # up to 20 curves, none sharing a colour
    for (name, pts), color in zip(curves.items(), colors):
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=name, color=color)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def section_arms(outdir: Path, stem: str, runs: Runs, sizes: list[str], names: list[str], seeds: list[int],
                 rounds: int, schedule: str, corpus: ByteCorpus, evals: int, kept_only: bool = False,
                 parallel: int = 1) -> dict[str, Any]:
    """The arms' table and plots (``{stem}-{size}.png``, ``{stem}-{size}-gap.png``).
    ``kept_only``: the runs already kept, none trained (the rest are listed as missing)."""
    steps = rounds * H_DEFAULT
    table = arms(H_DEFAULT)
    plan = [(size, name, seed) for size in sizes for name in names for seed in seeds]
    if kept_only:
        kept = [(size, name, seed) for size, name, seed in plan
                if key(size, seed, steps * M // table[name][1], schedule, *table[name]) in runs.done]
        missing = [f"{size} {name} seed {seed}" for size, name, seed in plan if (size, name, seed) not in kept]
        if missing:
            print(f"not run yet, left out (--kept-only): {'; '.join(missing)}")
        plan = kept
    jobs = {(size, name, seed): Job(size, seed, steps * M // table[name][1], schedule, *table[name], evals=evals)
            for size, name, seed in plan}
    train_missing(runs, list(jobs.values()), parallel, corpus)
    out: dict[str, Any] = {}
    for (size, name, seed), job in jobs.items():
        out.setdefault(size, {}).setdefault(name, []).append({**runs.done[job.key], "seed": seed})
    summary: dict[str, Any] = {}
    for size, by_arm in out.items():
        print(f"\n{size} model ({sum(p.numel() for p in _params(size)) / 1e6:.2f} M parameters): "
              f"{rounds} rounds of H={H_DEFAULT}, M={M}, {schedule} inner lr")
        print(f"{'arm':<16} {'median':>8} {'95% interval':>18} {'vs DP':>8}  per seed")
        dp = {r["seed"]: r for r in by_arm.get("data-parallel", [])}
        rows = {}
        for name, rs in by_arm.items():
            losses = [r["loss"] for r in rs]
            lo, hi = bootstrap(losses)
            paired = [(r, dp[r["seed"]]) for r in rs if r["seed"] in dp]  # the same seed's data-parallel run
            gaps = [r["loss"] / d["loss"] - 1 for r, d in paired]
            rows[name] = {"seeds": [r["seed"] for r in rs], "losses": losses, "median": statistics.median(losses),
                          "interval": [lo, hi], "gap_dp": statistics.median(gaps) if gaps else None,
                          "gaps_dp": gaps, "wall_s": [r["wall_s"] for r in rs],
                          "guard_events": sum(r["guard_events"] for r in rs)}
            if paired:
                rows[name]["gap_curve"] = gap_curve(*map(list, zip(*paired)))
            vs_dp = f"{rows[name]['gap_dp']:+.1%}" if gaps else "-"
            print(f"{name:<16} {rows[name]['median']:>8.3f} {f'[{lo:.3f}, {hi:.3f}]':>18} {vs_dp:>8}  "
                  + " ".join(f"{x:.3f} (seed {r['seed']})" for x, r in zip(losses, rs)))
        summary[size] = rows
        curves = {name: [(p[0] / TOKENS_PER_ROUND, statistics.median(r["points"][i][2] for r in rs))
                         for i, p in enumerate(rs[0]["points"])] for name, rs in by_arm.items()}
        n_seeds = sorted({len(rs) for rs in by_arm.values()})
        plot(outdir / f"{stem}-{size}.png", f"{size} GPT, M={M}, H={H_DEFAULT}: held-out loss (median of "
             f"{'/'.join(map(str, n_seeds))} seeds)", curves, "outer rounds (equal tokens across arms)",
             "held-out loss")
        if dp:
            plot(outdir / f"{stem}-{size}-gap.png", f"{size} GPT: loss / data-parallel's - 1 at equal tokens",
                 {n: r["gap_curve"] for n, r in rows.items() if n != "data-parallel" and "gap_curve" in r},
                 "outer rounds", "gap")
    return summary


def _params(size: str) -> list[torch.Tensor]:
    from rackmend.workloads import GPT
    return list(GPT(SIZES[size]).parameters())


def section_ablation(outdir: Path, stem: str, runs: Runs, seeds: list[int], rounds: int, corpus: ByteCorpus,
                     evals: int, only: list[str], parallel: int = 1) -> dict[str, Any]:
    """The ablation's table and plot (``{stem}.png``); ``only``: these variants (and the
    data-parallel rows they are compared with), or all."""
    steps = rounds * H_DEFAULT
    variants = ablations()
    if only:
        keep = set(only) | {"data-parallel"} | ({"data-parallel, constant lr"} if any(
            variants[n][0] == "constant" for n in only) else set())
        variants = {n: v for n, v in variants.items() if n in keep}
    # Equal tokens: fewer learners or larger batches take fewer steps each.
    plan = {name: (sched, cfg, learners, batch, steps * M * BATCH // (learners * batch))
            for name, (sched, cfg, learners, batch) in variants.items()}
    jobs = {name: [Job("small", seed, per_learner, sched, cfg, learners, batch, evals) for seed in seeds]
            for name, (sched, cfg, learners, batch, per_learner) in plan.items()}
    train_missing(runs, [job for js in jobs.values() for job in js], parallel, corpus)
    rows = {name: [runs.done[job.key] for job in js] for name, js in jobs.items()}
    print(f"\nablation, small model, {rounds} rounds at H={H_DEFAULT} (equal tokens), seeds {seeds}")
    print(f"{'variant':<46} {'loss':>7} {'vs DP':>8}   gap at 1/4, 1/2, 3/4, all of the run")
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        sched = variants[name][0]
        dp = rows["data-parallel, constant lr" if sched == "constant" else "data-parallel"]
        curve = gap_curve(rs, dp)
        loss = statistics.median(r["loss"] for r in rs)
        quarter = [curve[round(len(curve) * q) - 1][1] for q in (0.25, 0.5, 0.75, 1.0)]
        out[name] = {"schedule": sched, "losses": [r["loss"] for r in rs], "loss": loss, "gap_curve": curve}
        print(f"{name:<46} {loss:>7.3f} {curve[-1][1]:>+8.1%}   " + ", ".join(f"{g:+.1%}" for g in quarter))
    plot(outdir / f"{stem}.png", "ablation (small GPT): loss / data-parallel's - 1 at equal tokens",
         {n: r["gap_curve"] for n, r in out.items() if not n.startswith("data-parallel")}, "outer rounds", "gap")
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--section", choices=("all", "arms", "ablation"), default="arms")
    p.add_argument("--rounds", type=int, default=None, help="outer rounds at H=16 (default 150; quick 12)")
    p.add_argument("--ablation-rounds", type=int, default=None, help="rounds of the ablation (default 75; quick 12)")
    p.add_argument("--sizes", default=None, help="comma-separated, from small,large (default both; quick small)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick 0)")
    p.add_argument("--arms", default="", help="comma-separated arms (default: all)")
    p.add_argument("--variants", default="", help="ablation variants to run, separated by ';' (their names hold "
                   "commas), e.g. 'rackmend;rackmend, H=4' (default: all)")
    p.add_argument("--runs", type=Path, default=None,
                   help=f"the file of kept runs (default: {RUNS.name}, or OUT-runs.jsonl beside --out)")
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="the inner schedule of the arms section (default cosine)")
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations per run (default 10)")
    p.add_argument("--fresh", action="store_true", help=f"train every run again, ignoring {RUNS.name}")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process on one torch thread (default 1; 2 uses both "
                        "cores of a 2-core machine)")
    p.add_argument("--kept-only", action="store_true",
                   help="arms section: train nothing, tabulate and plot the runs already kept, list the missing ones")
    args = p.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (12 if args.quick else 150)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    sizes = (args.sizes or ("small" if args.quick else "small,large")).split(",")
    names = [a for a in args.arms.split(",") if a] or list(arms(H_DEFAULT))
    unknown = [s for s in sizes if s not in SIZES] + [a for a in names if a not in arms(H_DEFAULT)]
    if unknown:
        p.error(f"unknown sizes or arms {unknown}: sizes are {', '.join(SIZES)}, arms {', '.join(arms(H_DEFAULT))}")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1 (runs trained at once), got {args.jobs}")
    only = [v.strip() for v in args.variants.split(";") if v.strip()]
    if [v for v in only if v not in ablations()]:
        p.error(f"unknown variants {[v for v in only if v not in ablations()]}: they are {'; '.join(ablations())}")
    outdir = args.out.parent if args.out else RESULTS
    outdir.mkdir(parents=True, exist_ok=True)
    runs = Runs(args.runs or (args.out.with_name(args.out.stem + "-runs.jsonl") if args.out else RUNS), args.fresh)
    corpus = ByteCorpus()
    out: dict[str, Any] = {"inputs": {"rounds": rounds, "H": H_DEFAULT, "M": M, "seeds": seeds, "sizes": sizes,
                                      "models": {s: asdict(SIZES[s]) for s in sizes}, "schedule": args.lr_schedule}}
    result: dict[str, Any] = {}
    if args.section in ("all", "arms"):
        result["rounds"] = rounds
        stem = args.out.stem if args.out else "quality-long"
        out["arms"] = section_arms(outdir, stem, runs, sizes, names, seeds, rounds, args.lr_schedule, corpus,
                                   args.evals, args.kept_only, args.jobs)
        for size, rows in out["arms"].items():
            if rows.get("rackmend", {}).get("gap_dp") is not None:
                result[f"gap_dp_{size}"] = rows["rackmend"]["gap_dp"]
    if args.section in ("all", "ablation"):
        ab_rounds = args.ablation_rounds or (12 if args.quick else 75)
        out["ablation"] = section_ablation(outdir, args.out.stem if args.out else "quality-long-ablation", runs, seeds,
                                           ab_rounds, corpus, args.evals, only, args.jobs)
        result["ablation_rounds"] = ab_rounds
    finish("quality-long" if args.section != "ablation" else "quality-long-ablation", args.out, out, result)


if __name__ == "__main__":
    main()
