"""Training really learns: a short in-process run of the byte-level GPT through
rackmend's default (asynchronous, K=1) path brings held-out loss well below where it
started. The margin is set from measured runs (initial about ln 256 = 5.55, final
about 3.0 after 2 x 80 steps with the demo's rackmend arm) with room for thread-timing noise."""

from __future__ import annotations

import pytest

from rackmend.demo.spec import arm_specs
from rackmend.demo.threads import thread_settings, train_arm
from rackmend.workloads import ByteCorpus, GPTConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def test_rackmend_run_learns_on_held_out_data() -> None:
    s = thread_settings(learners=2, steps=80, batch_size=8, sync_every=8, fragments=2, overlap=1, evals=1,
                     model=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
    result = train_arm("rackmend", arm_specs(s)["rackmend"].config, s, ByteCorpus())
    initial, final = result.points[0][2], result.points[-1][2]
    assert initial > 5.0, f"an untrained byte model should score near ln 256, got {initial:.3f}"
    assert final < initial - 1.5, f"held-out loss only went from {initial:.3f} to {final:.3f}"
    # Every fragment went through several outer rounds: the syncer's model is what was scored.
    assert result.merges >= 2 * (80 // 8) * 0.8
