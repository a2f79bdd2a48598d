"""torchtitan jobs as racks: ``examples/torchtitan_rack.py`` (``rackmend.learner.titan``)
run by torchrun with gloo on the CPU, FSDP2 over 2 ranks per rack, through a real
``rackmend syncer``; skipped when torchtitan is absent. The CPU shims the ranks need are
test scaffolding (``_titan_shims``); the tokenizer and the chat corpus are made here from
Python's own ``pydoc_data`` (nothing downloaded)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")  # the package only: torchtitan present but broken fails below

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from procs import HERE, TORCHRUN, Procs, events, finish, of  # noqa: E402
from trainer_racks import expected_tokens  # noqa: E402
from rackmend.core.fragments import fragment_offsets  # noqa: E402
from rackmend.core.records import Joined, Left, Merged, Rejected  # noqa: E402
from rackmend.service.events import BadMessage  # noqa: E402
from rackstate import assert_held_equal_syncer  # noqa: E402

pytestmark = pytest.mark.integration  # a third-party trainer stack (pyproject.toml markers)

PROC = str(HERE / "_titan_proc.py")
EXAMPLE = HERE.parent / "examples" / "torchtitan_rack.py"
H, P, TAU, STEPS, CKPT = 4, 2, 1, 12, 7
"""Fragment 1 is sent at steps 2, 6, 10 and fragment 0 at 4, 8, 12; each merged value is
applied one step later, so at the checkpoint (after step 7) none is in flight."""
TP = {"l1": ("--parallelism.tensor-parallel-degree", "2")}
"""Racks sharded by tensor parallelism instead of FSDP2 (both ranks read the same batch)."""


def make_assets(root: Path) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer with a chat template and a JSONL of single-turn chats
    (question: a pydoc topic, answer: one of its paragraphs), both from ``pydoc_data``."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chats = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
        for i, para in enumerate([p for p in paragraphs if len(p) >= 40][:8]):
            chats.append({"messages": [{"role": "user", "content": f"{name} {i}?"},
                                       {"role": "assistant", "content": para[:160]}]})
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((m["content"] for c in chats for m in c["messages"]), trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    tok.save(str(tokenizer / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                "<|eos|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": template}))
    return tokenizer, data


def _rack(procs: Procs, tmp: Path, endpoint: str, lid: str, phase: str, *extra: str,
          ranks: int = 2) -> subprocess.Popen:
    tokenizer, data = tmp / "tokenizer", tmp / "chat.jsonl"
    cmd = [*TORCHRUN[:-1], str(ranks), PROC, "--rackmend.endpoint", endpoint, "--rackmend.learner-id", lid,
           "--rackmend.config.deterministic", "--rackmend.config.schedule.sync-every", str(H),
           "--rackmend.config.schedule.num-fragments", str(P), "--rackmend.config.schedule.overlap", str(TAU),
           "--rackmend.config.learner.wait-timeout", "120",
           "--hf-assets-path", str(tokenizer), "--dataloader.load-dataset-kwargs.data-files", str(data),
           "--dump-folder", str(tmp / lid), "--training.steps", str(STEPS), "--metrics.log-freq", str(STEPS),
           "--checkpoint.enable", "--checkpoint.interval", str(CKPT), "--checkpoint.no-last-save-model-only",
           "--override.imports", "_titan_shims.sdpa_on_cpu", "_titan_shims.recording_loader",
           "_titan_shims.recording_optimizer", *TP.get(lid, ()), *extra]
    env = {"TITAN_RECORD": str(tmp / f"{phase}-{lid}"), "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp / "hf"), "PYTHONPATH": str(HERE)}
    if phase in "AB":
        # Both racks meet once joined: a deterministic syncer stops waiting for a listed
        # learner that left, so a rack resuming late would miss the other's first rounds.
        env.update(TITAN_MEET=str(tmp / f"met-{phase}"), TITAN_MEET_ALL="l0.0,l0.1,l1.0,l1.1")
    return procs.start(cmd, f"{phase}-{lid}", env)


def _step_tokens(tmp: Path, record: str, lid: str) -> tuple[list[int], int]:
    """Per step, the valid tokens of the rack, and all its labels: of both ranks' batches
    (FSDP), or of the one batch both ranks read (TP)."""
    ranks = [[tuple(map(int, line.split())) for line in (tmp / f"{record}.tokens.{r}").read_text().splitlines()]
             for r in range(2)]
    if lid in TP:
        assert ranks[0] == ranks[1], "the TP ranks read different batches"
        ranks = ranks[:1]
    assert len(ranks[0]) == len(ranks[-1])
    return [sum(rank[t][0] for rank in ranks) for t in range(len(ranks[0]))], sum(n for rank in ranks for _, n in rank)


@pytest.mark.slow
def test_fsdp2_and_tp_racks_count_tokens_leave_and_resume_from_torchtitans_checkpoint(procs: Procs,
                                                                                      tmp_path: Path) -> None:
    """Two torchtitan racks (the example on 2 gloo ranks each: l0 FSDP2, l1 tensor
    parallel), deterministic, through a checkpointing syncer.

    First run, steps 1-12 with torchtitan's checkpoint at step 7: every merge takes both
    racks with exactly the valid tokens (labels not IGNORE_INDEX: chat prompts and
    padding are masked) their batches held, and each rack leaves cleanly at the end.
    Second run, both racks resume from step 7: each rank gets back its own rackmend state
    from torchtitan's checkpoint (its rank, blocks, counters and held values, not another
    rank's), reads the same batches again and reports the same tokens for the same sends;
    at the end every rank holds its blocks of the syncer's values, bit for bit, and both
    racks leave again. Last, a rack started from l0's checkpoint as torchtitan's initial
    load joins after the load: a new syncer's global model is the checkpoint's (joining
    when the optimizers are built, before the load, gave the syncer the rack's random
    initialisation)."""
    make_assets(tmp_path)
    ids = ["l0", "l1"]
    ck = tmp_path / "ck"
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "2", "--learners", ",".join(ids),
                                    "--overlap", str(TAU), "--checkpoint-dir", str(ck))
    for phase, extra in (("A", ()), ("B", ("--checkpoint.load-step", str(CKPT)))):
        racks = {lid: _rack(procs, tmp_path, endpoint, lid, phase, *extra) for lid in ids}
        for lid, proc in racks.items():
            finish(proc, procs, f"{phase}-{lid}", timeout=300)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0
    log = events(tmp_path)
    assert not of(log, Rejected, BadMessage)
    left = of(log, Left)
    assert sorted((e.learner, e.reason) for e in left) == sorted([(lid, "leave") for lid in ids] * 2), left
    first_run_end = max(e.t for e in left[:2])
    assert all(e.t > first_run_end for e in left[2:]) and len(of(log, Joined)) == 2 * 2 * len(ids)
    merges = {phase: [e for e in of(log, Merged) if (e.t < first_run_end) == (phase == "A")] for phase in "AB"}
    offsets = fragment_offsets(P, H)
    for lid in ids:
        steps_a, labels_a = _step_tokens(tmp_path, f"A-{lid}", lid)
        steps_b, _ = _step_tokens(tmp_path, f"B-{lid}", lid)
        assert len(steps_a) == STEPS and sum(steps_a) < labels_a, "no label was masked: valid = all tokens"
        assert steps_b == steps_a[CKPT:], "the resumed rack did not read the batches after the checkpoint"
        for p, offset in enumerate(offsets):
            got_a = [e.tokens[lid] for e in merges["A"] if e.fragment == p]
            assert got_a == expected_tokens(steps_a, offset, H, TAU, STEPS), f"{lid} fragment {p}: merged tokens of the first run"
            got_b = [e.tokens[lid] for e in merges["B"] if e.fragment == p]
            sends_b = [t for t in range(CKPT + 1, STEPS + 1) if (t - offset) % H == 0]
            assert got_b == got_a[-len(sends_b):], f"{lid} fragment {p}: the resumed rack's counts differ"
        held_saved = []
        for rank in range(2):
            saved = torch.load(tmp_path / f"A-{lid}.saved.{rank}.{CKPT}.pt", weights_only=True)
            loaded = torch.load(tmp_path / f"B-{lid}.loaded.{rank}.pt", weights_only=True)
            assert loaded["rank"] == saved["rank"] == rank
            for key in ("step", "versions", "c_steps", "c_tokens", "blocks"):
                assert loaded[key] == saved[key], f"{lid} rank {rank}: {key} {loaded[key]} != {saved[key]}"
            assert len(sum(saved["held"], [])) == len(sum(loaded["held"], []))
            for a, b in zip(sum(saved["held"], []), sum(loaded["held"], [])):
                assert torch.equal(a, b), f"{lid} rank {rank}: held values not its own"
            held_saved.append(sum(saved["held"], []))
        assert any(not torch.equal(a, b) for a, b in zip(*held_saved)), "ranks hold the same values: no test"
        assert_held_equal_syncer([tmp_path / f"B-{lid}.held.{r}" for r in range(2)],
                                 load_file(str(ck / "syncer.safetensors")))
    for phase in "AB":
        assert merges[phase] and all(list(e.merged) == ids for e in merges[phase])
    assert len(merges["A"]) == 6 and len(merges["B"]) == 3

    # A rack that starts from a model-only checkpoint (l0's at step 7) joins after
    # torchtitan loaded it: a new syncer's global model is those weights.
    (tmp_path / "events.jsonl").rename(tmp_path / "events-AB.jsonl")
    syncer, endpoint = procs.syncer("--deterministic", "--min-quorum", "1", "--overlap", str(TAU), "--checkpoint-dir",
                                    str(tmp_path / "ck-C"), name="syncer-C")
    start = _rack(procs, tmp_path, endpoint, "l2", "C", "--training.steps", "1", "--checkpoint.initial-load-path",
                  str(tmp_path / "l0" / "checkpoint" / f"step-{CKPT}"), ranks=1)
    finish(start, procs, "C-l2", timeout=300)
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(30) == 0
    assert not of(events(tmp_path), Merged), "a merge changed the syncer's first value"
    subprocess.run([sys.executable, "-m", "rackmend.cli", "export", str(tmp_path / "ck-C"), "--out",
                    str(tmp_path / "global.safetensors")], check=True, timeout=120)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "l0" / "checkpoint" / f"step-{CKPT}", tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    exported = load_file(str(tmp_path / "global.safetensors"))
    # torchtitan saves its fused q/k/v projection split into wq, wk and wv.
    assert [name for name in exported if name not in ckpt] == [f"layers.{i}.attention.qkv_linear.wqkv.weight"
                                                                for i in range(2)]
    for name, value in exported.items():
        if name in ckpt:
            assert torch.equal(value, ckpt[name]), f"{name}: the syncer's first value is not the checkpoint's"


def test_pipeline_parallelism_and_several_inner_optimizers_are_refused(tmp_path: Path) -> None:
    """Refused before anything joins, each with the reason and the fix: pipeline
    parallelism (the trainer), several model parts or inner optimizers (the container),
    no endpoint."""
    import runpy

    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from rackmend.config import ConfigError
    from rackmend.learner.titan import RackmendOptimizersContainer, RackmendSection, RackmendTrainer

    config = runpy.run_path(str(EXAMPLE))["rack"]()
    config.parallelism.pipeline_parallel_degree = 2
    with pytest.raises(ConfigError, match="pipeline parallelism .* every rank of a rack must hold the same fragment "
                                          "layout; set it to 1"):
        RackmendTrainer(config)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    two = RackmendOptimizersContainer.Config(
        rackmend=RackmendSection(endpoint="tcp://127.0.0.1:1"), implementation="for-loop", param_groups=[
            ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})])
    with pytest.raises(ConfigError, match=r"one inner optimizer, but optimizer.param_groups build 2 \(Adam, AdamW\)"):
        RackmendOptimizersContainer(two, model_parts=[model])
    with pytest.raises(ConfigError, match="2 model parts .*--parallelism.pipeline-parallel-degree 1"):
        RackmendOptimizersContainer(two, model_parts=[model, torch.nn.Linear(2, 2)])
    one = RackmendOptimizersContainer.Config(implementation="for-loop", param_groups=two.param_groups[1:])
    with pytest.raises(ConfigError, match="set --rackmend.endpoint"):
        RackmendOptimizersContainer(one, model_parts=[model])


def test_torchtitan_stays_optional() -> None:
    """``import rackmend`` does not load torchtitan, and the module without it fails at
    import with what to install."""
    probe = ("import sys; import rackmend, rackmend.learner; assert 'torchtitan' not in sys.modules; "
             "sys.modules['torchtitan'] = None\n"
             "try:\n    import rackmend.learner.titan\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs torchtitan 0.3: pip install 'rackmend[torchtitan]'" in out.stdout
