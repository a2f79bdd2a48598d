"""The scenario every trainer integration is tested on (test helper): two racks of two
ranks under torchrun (gloo) with a real ``rackmend syncer``, deterministic, stopped after
step ``STOP`` with the trainer's own checkpoint and resumed from it to step ``STEPS``.

A rack's process meets the other racks once joined (``rackstate.meet`` in ``--meet``),
and writes ``<out>.<rank>`` (JSON: ``collated``, the non-padding tokens of each
micro-batch it trained on, counted by its collator; ``step``; ``resumed``, what the rank
held right after the resume) and ``--held-out`` files (``rackstate.save_held``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from procs import Procs, events, finish
from rackmend.core.fragments import fragment_offsets
from rackmend.core.records import Left, Merged, Rejected, TokenUnits
from rackmend.service.events import BadMessage
from rackstate import assert_held_equal_syncer

# Stopped at an odd step: with H=4, P=2 (offsets 0, 2) and tau=1 no fragment is in flight
# then, so the resumed run's windows continue the first run's exactly.
IDS, STOP, STEPS, H, P, TAU, WORLD = ("l0", "l1"), 7, 14, 4, 2, 1, 2
MARK = 123.25
"""Written into rank 1's saved ``c_time`` between the runs (seconds: no effect on merges)."""


def expected_tokens(step_tokens: list[int], offset: int, H: int, tau: int, steps: int) -> list[int]:
    """Per send of one fragment, the tokens it reports in deterministic mode: the steps
    since the previous merged value was applied (at t_send + tau, counters reset after
    that step's count), the first send counting from step 1."""
    out, start = [], 1
    for t in range(1, steps + 1):
        if (t - offset) % H == 0:
            out.append(sum(step_tokens[start - 1:t]))
            start = t + tau + 1
    return out


class StopResume:
    """The syncer (checkpointing to ``tmp/ck``) and the two runs of both racks."""

    def __init__(self, procs: Procs, tmp: Path) -> None:
        self.procs, self.tmp = procs, tmp
        self.syncer, self.endpoint = procs.syncer(
            "--deterministic", "--min-quorum", "2", "--learners", ",".join(IDS), "--overlap", str(TAU),
            "--checkpoint-dir", str(tmp / "ck"))

    def run(self, name: str, command: Callable[[str], list[str]]) -> None:
        """Both racks, ``command(lid)`` each (the held-out and result files appended), to their end."""
        racks = {lid: self.procs.start([*command(lid), "--held-out", str(self.tmp / f"{lid}-{name}.held"),
                                        "--out", str(self.tmp / f"{lid}-{name}.json"),
                                        "--meet", str(self.tmp / f"met-{name}")], f"{lid}-{name}")
                 for lid in IDS}
        for lid, proc in racks.items():
            finish(proc, self.procs, f"{lid}-{name}", timeout=240)
        left = sorted(e.learner for e in events(self.tmp, Left))
        assert left == sorted(IDS * (1 if name == "first" else 2)), f"the {name} run did not leave cleanly: {left}"

    def mark(self, folder: Path) -> dict:
        """Each rank's rackmend state of l0 as saved in ``folder``; rank 1's is changed on
        disk (``MARK``). Returns rank 0's."""
        files = sorted(p.name for p in folder.glob("rackmend-*"))
        assert files == ["rackmend-rank0-of-2.pt", "rackmend-rank1-of-2.pt"], files
        saved = torch.load(folder / files[0], weights_only=True)
        marked = torch.load(folder / files[1], weights_only=True)
        assert (saved["rank"], marked["rank"], saved["step"]) == (0, 1, STOP)
        marked["c_time"] = [MARK] * P
        torch.save(marked, folder / files[1])
        return saved

    def check(self, saved: dict) -> None:
        """After the second run: each rank resumed its own state, every merge carries
        exactly the tokens both ranks' collators saw in its window (across the resume),
        and every rank holds the syncer's values of its version."""
        self.syncer.send_signal(signal.SIGTERM)
        assert self.syncer.wait(30) == 0
        result = {(lid, name, r): json.loads((self.tmp / f"{lid}-{name}.json.{r}").read_text())
                  for lid in IDS for name in ("first", "second") for r in range(WORLD)}
        r0, r1 = result["l0", "second", 0]["resumed"], result["l0", "second", 1]["resumed"]
        assert r0["step"] == r1["step"] == STOP
        assert r1["c_time"] == [MARK] * P and r0["c_time"] == pytest.approx(saved["c_time"]), (r0, r1)
        merges = events(self.tmp, Merged)
        for lid in IDS:
            assert all(result[lid, "second", r]["step"] == STEPS for r in range(WORLD))
            step_tokens = [sum(t) for t in zip(*(result[lid, "first", r]["collated"][:STOP]
                                                 + result[lid, "second", r]["collated"][:STEPS - STOP]
                                                 for r in range(WORLD)))]
            assert len(step_tokens) == STEPS and len(set(step_tokens)) > 1, "batches were not ragged"
            for p, offset in enumerate(fragment_offsets(P, H)):
                got = [e.tokens[lid] for e in merges if e.fragment == p]
                assert got == expected_tokens(step_tokens, offset, H, TAU, STEPS), (lid, p, got, step_tokens)
        assert not events(self.tmp, TokenUnits, Rejected, BadMessage)
        checkpoint = load_file(str(self.tmp / "ck" / "syncer.safetensors"))
        for lid in IDS:
            assert_held_equal_syncer([f"{self.tmp}/{lid}-second.held.{r}" for r in range(WORLD)], checkpoint)
