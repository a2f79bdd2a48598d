"""benchmarks/fuzz.py's fuzzer, a slice of it, against a real ``rackmend syncer`` process
while a learner process trains: every mutation class, attributed reply by reply. Its
own module, marked serial: it runs with the tests that start processes, one at a time
(Makefile), while test_wire_fuzz's tests share one in-process syncer in the other run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _fuzz_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import fuzz

    return fuzz


@pytest.mark.serial  # a syncer process of its own, checked against time bounds
def test_fuzz_slice_against_a_live_syncer_process(tmp_path: Path) -> None:
    fuzz = _fuzz_module()
    r = fuzz.run(3000, seed=1, warmup_s=2.0, workdir=tmp_path)
    assert (r["crashes"], r["hangs"], r["bad_accepted"], r["corruption"]) == (0, 0, 0, 0), r
    assert r["messages"] == 3000 and r["must_refuse"] > 2000 and set(r["by_mutation"]) >= {"spoof", "replay", "hello"}
    assert r["merge_rate_during"] > 0, "the healthy learner stopped merging during the fuzz"
