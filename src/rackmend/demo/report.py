"""Turn the arms' measurements into a report folder: ``report.md``, PNG plots,
``events.jsonl``, ``steps.jsonl`` and ``summary.json``.

Pure post-processing of ``ArmRun`` objects: nothing here trains or starts a
process, so a test can feed it a tiny run and check every file appears.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from rackmend.core.failslow import RestoreLearner, StopExpecting
from rackmend.core.records import FailSlowNoted
from rackmend.demo.orchestrate import ArmRun
from rackmend.demo.spec import RunSettings

__all__ = ["REPORT_FILES", "write_report", "summary_rows", "format_summary", "loss_at_tokens", "failslow_notes",
           "failslow_spans"]

REPORT_FILES = (
    "report.md",
    "summary.json",
    "events.jsonl",
    "steps.jsonl",
    "loss_vs_tokens.png",
    "loss_vs_wall.png",
    "utilization.png",
    "link_bytes.png",
    "merge_timeline.png",
)
"""Every file ``write_report`` writes."""

_UTIL_WINDOW_S = 2.0
_COLORS = {"data-parallel": "tab:red", "diloco": "tab:orange", "rackmend": "tab:blue", "rackmend-int4": "tab:cyan",
           "local": "tab:gray"}


def loss_at_tokens(points: Sequence[tuple[int, float, float]], tokens: float) -> float | None:
    """Held-out loss at ``tokens`` by linear interpolation between evaluations.

    None beyond the last evaluation, and None when the two evaluations around
    ``tokens`` lie more than half of ``tokens`` apart: loss curves are far from
    straight early on, so a line from the start to a late evaluation says little.
    """
    pts = sorted(points)
    for (t0, _, l0), (t1, _, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            if tokens in (t0, t1):
                return l0 if tokens == t0 else l1
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 - t0 <= 0.5 * tokens else None
    if pts and pts[-1][0] == tokens:
        return pts[-1][2]
    return None


def summary_rows(runs: Sequence[ArmRun]) -> list[dict[str, Any]]:
    """One row per arm: the numbers of the results table (and summary.json)."""
    trained = [r for r in runs if len(r.points) > 1 and r.name != "local"]
    common = min((r.points[-1][0] for r in trained), default=0)
    rows = []
    for r in runs:
        healthy = r.healthy()
        util = [r.utilization(ls) for ls in healthy]
        step_times = [t for ls in healthy for t in ls.step_times]
        rows.append({
            "arm": r.name,
            "tokens": r.tokens,
            "wall_s": r.wall_s,
            "tokens_per_s": r.tokens / r.wall_s if r.wall_s else 0.0,
            "final_loss": r.points[-1][2] if r.points else None,
            "loss_at_common_tokens": loss_at_tokens(r.points, common) if common else None,
            "common_tokens": common,
            "utilization": statistics.mean(util) if util else 0.0,
            "utilization_per_learner": {ls.learner: r.utilization(ls) for ls in r.learners},
            "step_s_median": statistics.median(step_times) if step_times else None,
            "blocked_s_per_learner": statistics.mean(ls.blocked_s for ls in r.learners),
            "wan_bytes": r.wan_bytes,
            "wan_bytes_per_token": r.wan_bytes / r.tokens if r.tokens else None,
            "merges": len(r.merges()),
        })
    return rows


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def format_summary(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """The results table, as aligned text for the terminal or as Markdown."""
    common = rows[0]["common_tokens"] if rows else 0
    head = ["arm", "tokens", "tokens/s", f"loss @ {common / 1e3:.0f}k tok", "final loss",
            "util (healthy)", "step s (median)", "blocked s", "WAN MB", "WAN B/token", "merges"]
    body = [[r["arm"], _fmt(r["tokens"], ","), _fmt(r["tokens_per_s"], ".0f"),
             _fmt(r["loss_at_common_tokens"], ".3f"), _fmt(r["final_loss"], ".3f"), _fmt(r["utilization"], ".2f"),
             _fmt(r["step_s_median"], ".3f"), _fmt(r["blocked_s_per_learner"], ".1f"),
             _fmt(r["wan_bytes"] / 1e6, ".1f"), _fmt(r["wan_bytes_per_token"], ".0f"), str(r["merges"])]
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(head), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [fmt(row) for row in body])


# ------------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _fault_spans(run: ArmRun) -> list[tuple[float, float, str, str]]:
    """(start, end, label, learner) of each fault window, for shading."""
    spans = []
    kill = next((e for e in run.events if e.get("event") == "fault_kill"), None)
    restart = next((e for e in run.events if e.get("event") == "fault_restart"), None)
    if kill is not None:
        spans.append((kill["t"], restart["t"] if restart else run.wall_s, "killed", kill["learner"]))
    for e in run.events:
        if e.get("event") == "fault_slow":
            spans.append((e["t"], e["until"], "fail-slow", e["learner"]))
    return spans


def failslow_spans(run: ArmRun) -> list[dict[str, Any]]:
    """Each time the syncer flagged a learner fail-slow: ``learner``, ``rank``, ``t``
    (flagged), ``until`` (restored; None if still flagged at the end), ``ratio`` and
    ``fleet_ratio`` at the flag, ``restore_ratio``."""
    spans: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for rec in run.records():
        if not isinstance(rec, FailSlowNoted):
            continue
        r = rec.action.report
        if isinstance(rec.action, StopExpecting) and r.learner not in open_:
            open_[r.learner] = span = {"learner": r.learner, "rank": r.rank, "t": rec.t, "until": None,
                                       "ratio": r.ratio, "fleet_ratio": r.fleet_ratio,
                                       "baseline_s": r.baseline_s, "restore_ratio": None}
            spans.append(span)
        elif isinstance(rec.action, RestoreLearner) and r.learner in open_:
            span = open_.pop(r.learner)
            span["until"], span["restore_ratio"] = rec.t, r.ratio
    return spans


def _plot_loss(runs: Sequence[ArmRun], path: Path, x: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        if len(r.points) < 2 and r.name != "local":
            continue
        xs = [p[0] / 1e3 if x == "tokens" else p[1] for p in r.points]
        ax.plot(xs, [p[2] for p in r.points], marker="o", ms=3, label=r.name, color=_COLORS.get(r.name))
    ax.set_xlabel("tokens trained by all learners (thousands)" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("held-out loss (global model)")
    ax.set_title("Held-out loss vs " + ("tokens" if x == "tokens" else "wall time"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grid(n: int, height: float) -> tuple[Any, list[Any]]:
    plt = _plt()
    fig, axes = plt.subplots(n, 1, figsize=(8, height * n), squeeze=False, sharex=True)
    return fig, [a[0] for a in axes]


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def _plot_utilization(runs: Sequence[ArmRun], path: Path) -> None:
    fig, axes = _grid(len(runs), 2.3)
    for ax, r in zip(axes, runs):
        bins = max(1, math.ceil(r.wall_s / _UTIL_WINDOW_S))
        for lid, recs in r.steps.items():
            busy = [0.0] * bins
            for rec in recs:
                # A step's compute ends at rec["t"] minus its sync time; spread it over its bins.
                end = rec["t"] - rec["sync"]
                start = end - rec["compute"]
                k = max(0, int(start // _UTIL_WINDOW_S))
                while k < bins and k * _UTIL_WINDOW_S < end:
                    lo, hi = max(start, k * _UTIL_WINDOW_S), min(end, (k + 1) * _UTIL_WINDOW_S)
                    busy[k] += max(0.0, hi - lo)
                    k += 1
            ax.plot([(k + 0.5) * _UTIL_WINDOW_S for k in range(bins)], [b / _UTIL_WINDOW_S for b in busy],
                    label=lid, lw=1.2)
        for start, end, label, who in _fault_spans(r):
            ax.axvspan(start, end, alpha=0.12, color="red" if label == "killed" else "orange")
            ax.text(start, 1.02, f"{who} {label}", fontsize=7, va="bottom")
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("utilization")
        ax.set_title(f"{r.name}: time in inner steps per {_UTIL_WINDOW_S:g} s window", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=4, loc="lower right")
    axes[-1].set_xlabel("wall time (s)")
    _save(fig, path)


def _plot_links(runs: Sequence[ArmRun], path: Path) -> None:
    with_links = [r for r in runs if r.links]
    fig, axes = _grid(max(1, len(with_links)), 2.3)
    for ax, r in zip(axes, with_links):
        for name, link in r.links.items():
            tl = link["timeline"]
            ax.plot([t for t, _, _ in tl], [up / 1e6 for _, up, _ in tl], label=f"{name} up", lw=1.2)
            ax.plot([t for t, _, _ in tl], [down / 1e6 for _, _, down in tl], ls="--", lw=1, label=f"{name} down")
        ax.set_ylabel("MB (cumulative)")
        ax.set_title(f"{r.name}: bytes on each learner's link", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=4)
    if not with_links:
        axes[0].text(0.5, 0.5, "no arm used a link", ha="center")
    axes[-1].set_xlabel("wall time (s)")
    _save(fig, path)


def _plot_timeline(runs: Sequence[ArmRun], path: Path) -> None:
    synced = [r for r in runs if r.merges()] or list(runs[:1])
    fig, axes = _grid(len(synced), 2.0)
    for ax, r in zip(axes, synced):
        ids = [ls.learner for ls in r.learners]
        row = {lid: k for k, lid in enumerate(ids)}
        marks: dict[str, tuple[list[float], list[int]]] = {"merged": ([], []), "late": ([], []), "absent": ([], [])}
        for m in r.merges():
            for lid in m.merged:
                kind = "late" if lid in m.stale else "merged"
                marks[kind][0].append(m.t)
                marks[kind][1].append(row.get(lid, 0))
            for lid in m.absent:
                marks["absent"][0].append(m.t)
                marks["absent"][1].append(row.get(lid, 0))
        style = {"merged": ("o", "tab:green"), "late": ("s", "tab:orange"), "absent": ("x", "tab:red")}
        for kind, (xs, ys) in marks.items():
            marker, color = style[kind]
            ax.scatter(xs, ys, marker=marker, s=12, color=color, label=f"{kind} ({len(xs)})", linewidths=1)
        for start, end, label, who in _fault_spans(r):
            ax.axvspan(start, end, ymin=0, ymax=1, alpha=0.1, color="red" if label == "killed" else "orange")
        flagged = failslow_spans(r)
        for k, span in enumerate(flagged):
            # On the learner's own row: from the syncer's flag to its restore (or the end).
            y, end = row.get(span["learner"], 0), span["until"] if span["until"] is not None else r.wall_s
            ax.hlines(y, span["t"], end, lw=7, color="tab:purple", alpha=0.3, zorder=0,
                      label=f"flagged fail-slow ({len(flagged)})" if k == 0 else None)
            ax.vlines([span["t"]] + ([end] if span["until"] is not None else []), y - 0.35, y + 0.35,
                      color="tab:purple", lw=1.2)
        ax.set_yticks(range(len(ids)), ids, fontsize=7)
        ax.set_ylim(-0.7, len(ids) - 0.3)
        ax.set_title(f"{r.name}: each merge (all fragments): who was in, late or absent; purple: flagged "
                     "fail-slow", fontsize=9)
        ax.legend(fontsize=7, ncol=4, loc="upper right")
        ax.grid(alpha=0.2)
    axes[-1].set_xlabel("wall time (s)")
    _save(fig, path)


# ------------------------------------------------------------------------ narrative
def _fault_notes(r: ArmRun) -> list[str]:
    """What happened to the faulted learners in this arm, from the merge log."""
    notes = []
    merges = r.merges()
    kill = next((e for e in r.events if e.get("event") == "fault_kill"), None)
    restart = next((e for e in r.events if e.get("event") == "fault_restart"), None)
    if kill is not None:
        who = kill["learner"]
        back = next((m for m in merges if restart and m.t > restart["t"] and who in m.merged), None)
        during = [m for m in merges if kill["t"] <= m.t <= (restart["t"] if restart else r.wall_s)]
        text = f"{who} SIGKILLed at {kill['t']:.0f} s"
        if restart:
            text += f", restarted at {restart['t']:.0f} s"
        text += f"; {len(during)} merge{'' if len(during) == 1 else 's'} went on without it meanwhile"
        text += f"; merged again at {back.t:.0f} s." if back else "; it did not merge again before the end."
        notes.append(text)
    for e in r.events:
        if e.get("event") == "stuck_killed":
            notes.append(f"{e['learner']} was still blocked {e['t'] - r.wall_s:.0f} s after the deadline and was killed.")
        if e.get("event") != "fault_slow":
            continue
        who, lo, hi = e["learner"], e["t"], e["until"]
        window = [m for m in merges if lo <= m.t <= hi]
        without = sum(1 for m in window if who not in m.merged or who in m.stale)
        others = [ls for ls in r.learners if ls.learner != who and not ls.fault]
        rate_in = _steps_in(r, others, lo, hi) / max(hi - lo, 1e-9)
        rate_out = _steps_in(r, others, 0.0, lo) / max(lo, 1e-9)
        notes.append(f"{who} fail-slow ×{e['factor']:g} from {lo:.0f} s to {hi:.0f} s: "
                     f"{len(window)} merge{'' if len(window) == 1 else 's'} in that window, "
                     f"{without} without it or with it late; "
                     f"the healthy learners ran {rate_in:.2f} steps/s each (vs {rate_out:.2f} before).")
    if r.name.startswith("rackmend"):
        notes += failslow_notes(r)
    return notes


def failslow_notes(r: ArmRun) -> list[str]:
    """What the syncer's fail-slow detection made of the arm: for each injected slow
    window, when (and whether) the learner was flagged and restored; then any other
    learner it flagged (on shared cores, contention can slow a healthy one for real)."""
    notes = []
    spans = failslow_spans(r)
    merges = r.merges()
    used: list[dict[str, Any]] = []
    for e in r.events:
        if e.get("event") != "fault_slow":
            continue
        who, lo, hi = e["learner"], e["t"], e["until"]
        span = next((sp for sp in spans if sp["learner"] == who and lo <= sp["t"] <= hi), None)
        if span is None:
            notes.append(f"fail-slow detection: the syncer did not flag {who} during its slow window (is detection "
                         "off, or was the window too early for a baseline?).")
            continue
        used.append(span)
        end = span["until"] if span["until"] is not None else r.wall_s
        flagged = [m for m in merges if span["t"] <= m.t <= end]
        without = sum(1 for m in flagged if who not in m.merged)
        text = (f"fail-slow detection: the syncer flagged {who} (rank {span['rank']}) {span['t'] - lo:.1f} s into "
                f"its slow window at {span['ratio']:.1f}× its baseline of {span['baseline_s'] * 1e3:.0f} ms per "
                f"step ({span['fleet_ratio']:.1f}× relative to the fleet); rounds stopped waiting for it: "
                f"{without} of the {len(flagged)} merges while it was flagged closed without it")
        if span["until"] is None:
            text += "; it was still flagged at the end."
        else:
            text += (f"; restored at {span['until']:.1f} s, {span['until'] - hi:+.1f} s from the window's end "
                     f"({span['restore_ratio']:.1f}× its baseline).")
        notes.append(text)
    others = [sp for sp in spans if sp not in used]
    if others:
        notes.append("fail-slow detection also flagged " + "; ".join(
            f"{sp['learner']} at {sp['t']:.1f} s ({sp['ratio']:.1f}×, {sp['fleet_ratio']:.1f}× the fleet)"
            + (f", restored at {sp['until']:.1f} s" if sp["until"] is not None else ", to the end")
            for sp in others) + " (processes sharing the cores slow each other for real).")
    return notes


def _steps_in(r: ArmRun, learners: Sequence[Any], lo: float, hi: float) -> float:
    if not learners:
        return 0.0
    return sum(sum(1 for rec in r.steps[ls.learner] if lo <= rec["t"] < hi) for ls in learners) / len(learners)


def write_report(out: Path, runs: Sequence[ArmRun], settings: RunSettings, command: str) -> dict[str, Any]:
    """Write every file of ``REPORT_FILES`` into ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs)
    machine = {"platform": platform.platform(), "python": platform.python_version(),
               "cpus": __import__("os").cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    summary = {"command": command, "machine": machine, "settings": settings.to_dict(), "arms": rows,
               "runs": [r.to_dict() for r in runs]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    with open(out / "events.jsonl", "w", encoding="utf-8") as f:
        for r in runs:
            for e in r.events:
                f.write(json.dumps({"arm": r.name, **e}, default=str) + "\n")
    with open(out / "steps.jsonl", "w", encoding="utf-8") as f:
        for r in runs:
            for lid, recs in r.steps.items():
                for rec in recs:
                    f.write(json.dumps({"arm": r.name, "learner": lid, **rec}) + "\n")
    _plot_loss(runs, out / "loss_vs_tokens.png", "tokens")
    _plot_loss(runs, out / "loss_vs_wall.png", "wall")
    _plot_utilization(runs, out / "utilization.png")
    _plot_links(runs, out / "link_bytes.png")
    _plot_timeline(runs, out / "merge_timeline.png")
    (out / "report.md").write_text(_markdown(runs, rows, settings, command, machine))
    return summary


def _markdown(runs: Sequence[ArmRun], rows: Sequence[dict[str, Any]], s: RunSettings, command: str,
              machine: dict[str, Any]) -> str:
    link = s.link
    bw = "no cap" if link.bandwidth_mbit is None else f"{link.bandwidth_mbit:g} Mbit/s"
    lines = [
        "# rackmend demo report",
        "",
        f"`{command}` on {machine['platform']} ({machine['cpus']} CPUs, Python {machine['python']}), {machine['date']}.",
        "",
        f"{s.learners} learner processes train the byte-level GPT ({s.model.n_layer} layers, width {s.model.n_embd}), "
        f"batch {s.batch_size}×{s.model.block_size} bytes, AdamW lr {s.lr:g}; "
        + (f"{s.duration_s:g} s per arm" if s.duration_s else f"{s.max_steps} steps per learner")
        + f". Each learner reaches the syncer through its own emulated link: {bw}, "
        f"{link.latency_ms:g} ms ±{link.jitter * 100:g} % one way.",
        "",
        "## Arms",
        "",
    ]
    lines += [f"- **{r.name}**: {r.description}" for r in runs]
    lines += ["", "## Results", "", format_summary(rows, markdown=True), "",
              "*util (healthy)*: time in inner steps / wall time, mean over learners without an injected fault. "
              "*loss @ tokens*: held-out loss of the global model interpolated at the token count every arm reached. "
              "*WAN*: bytes through the emulated links, both directions.", ""]
    lines += ["## Faults", ""]
    f = s.faults
    if s.duration_s is None or (f.kill_learner is None and f.slow_learner is None and f.worse_link_learner is None):
        lines.append("None injected.")
    for r in runs:
        notes = _fault_notes(r)
        if notes:
            lines.append(f"**{r.name}**")
            lines += [f"- {n}" for n in notes]
            lines.append("")
    lines += ["## Per learner", "", "| arm | learner | fault | steps | utilization | blocked s | lives |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        for ls in r.learners:
            lines.append(f"| {r.name} | {ls.learner} | {ls.fault or '–'} | {ls.steps} | {r.utilization(ls):.2f} | "
                         f"{ls.blocked_s:.1f} | {ls.lives} |")
    lines += ["", "## Loss", ""]
    for r in runs:
        if len(r.points) > 1:
            lines.append(f"- {r.name}: held-out loss {r.points[0][2]:.3f} → {r.points[-1][2]:.3f} "
                         f"over {r.points[-1][0]:,} tokens")
    lines += ["", "## Plots", ""]
    for name, title in (("loss_vs_tokens", "Held-out loss vs tokens"), ("loss_vs_wall", "Held-out loss vs wall time"),
                        ("utilization", "Compute utilization per learner"), ("link_bytes", "Bytes on each link"),
                        ("merge_timeline", "Merge timeline")):
        lines += [f"### {title}", "", f"![{title}]({name}.png)", ""]
    lines += ["`events.jsonl`: every syncer event (joins, merges with who was merged, late or absent, checkpoints, "
              "fail-slow flags `failslow_*`) "
              "and every injected fault, per arm, times in seconds since the arm's start. "
              "`steps.jsonl`: every learner step. `summary.json`: the numbers above.", ""]
    return "\n".join(lines)
