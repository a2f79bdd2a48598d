"""A sharded rack for the tests: TinyLM (or a small Llama) under FSDP2, tensor parallel
or both, trained through a ZmqLink to a real ``rackmend syncer``; torchrun, gloo, CPU.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_sharded_proc.py \\
    --mode fsdp --endpoint tcp://127.0.0.1:PORT --id l0 --steps 12 --out l0.safetensors

Every rank trains on the learner's batch ``batch(id, t)`` (so a deterministic run equals
a single process's), passing its share of the tokens. ``--out``: the whole final
parameters (gathered for the test only, on rank 0). ``--held-out``: each rank's held
values and where its blocks lie, as ``<held-out>.<rank>`` (``held/<p>/<i>``,
``place/<p>/<i>`` = offsets then shape, ``versions``). ``--pid-out``: each rank writes
``<pid-out>.<rank>`` = its pid and torchrun's restart count, at start. ``--progress``:
each rank writes ``<progress>.<rank>`` = the step whose gradient it has (after the
backward pass, before ``opt.step``) and its versions. ``--step-sleep``: the last rank
then sleeps that long before its ``opt.step`` (the others wait for it in the step's
collective), so its pieces trail the other ranks': killed in that sleep, it leaves the
others' pieces of the step without its own. ``--applied-out``: each rank writes
``<applied-out>.<rank>``, a line ``step fragment version`` per merged value it applied.
``--mixed``: FSDP2 with bf16 compute (``MixedPrecisionPolicy``). ``--checkpoint DIR
--checkpoint-at T``: after step T, the model and inner optimizer through
torch.distributed.checkpoint and rackmend's part per rank; ``--resume DIR``: restore them
(writing what the test checks), then train from ``--first-step``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from helpers import VOCAB, batch, make_inner, make_model  # noqa: E402
from rackstate import save_held  # noqa: E402

from rackmend import LearnerConfig, RackmendConfig, RackmendOptimizer, ScheduleConfig, SyncerConfig  # noqa: E402
from rackmend.transport.zmq_link import ZmqLink  # noqa: E402


def build(mode: str, model_kind: str, mixed: bool = False) -> torch.nn.Module:
    """The model, sharded as ``mode`` says over all ranks (hsdp: 2 replicas of FSDP over
    world/2 ranks; tp_fsdp: FSDP over world/2 ranks of TP pairs). Two that rackmend must
    refuse: fsdp1 (FSDP1's flat parameters) and
    stages (ranks holding different layers); unseeded (plain copies that differ at
    construction) trains unless its ranks train apart (``--data-per-rank``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if mode == "unseeded":  # each rank initialises its own model (seeded apart), nothing shards it
        return make_model(seed=dist.get_rank())
    if mode == "plain":  # every rank holds the whole model (as DDP does), nothing sharded
        return make_model()
    if mode == "stages":  # pipeline parallelism: the last rank holds only later layers
        return make_model().blocks if dist.get_rank() == world - 1 else make_model()
    model = make_model() if model_kind == "tiny" else make_llama()
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        # bf16 compute over fp32 sharded parameters, as LLM recipes run FSDP2: rackmend
        # works on the sharded (fp32) parameters the optimizer steps.
        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  } if mixed else {}
        if model_kind == "llama":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
    elif mode == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"blocks.0": ColwiseParallel(), "blocks.1": RowwiseParallel()})
    elif mode == "hsdp":  # replicate over the first mesh dimension, shard over the second
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif mode == "tp_fsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"blocks.0": ColwiseParallel(), "blocks.1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise SystemExit(f"unknown mode {mode}")
    return model


def make_llama() -> torch.nn.Module:
    """A small Llama from a config (random init, nothing downloaded), with TinyLM's
    call signature: ``model(x, y)`` is the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)

    class Llama(LlamaForCausalLM):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            logits = super().forward(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    return Llama(config)


def _dcp_state(model: torch.nn.Module, opt: RackmendOptimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt.inner)}


def checkpoint(model: torch.nn.Module, opt: RackmendOptimizer, where: Path, rank: int) -> None:
    """docs/integration.md's recipe: the model and the inner optimizer through
    torch.distributed.checkpoint, rackmend's part per rank beside them."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(model, opt), checkpoint_id=str(where))
    torch.save(opt.state_dict()["rackmend"], where / f"rackmend-{rank}.pt")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def resume(model: torch.nn.Module, opt: RackmendOptimizer, where: Path, rank: int) -> None:
    """Restore ``checkpoint``'s files in the documented order (the model and inner
    optimizer, then rackmend's part); write ``<where>/resumed-<rank>.safetensors`` for
    the test: per fragment p and tensor i this rank's block as the distributed checkpoint
    restored it (``dcp``), after the rebase (``after``), and rackmend's saved parameters
    (``ckpt``), held values then (``then``) and now (``now``); the versions then and now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from rackmend.core.fragments import fragment_tensors

    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(where))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt.inner, state["optim"])
    restored = [[_local(t) for t in ts] for ts in fragment_tensors(model, opt.fragments)]
    saved = torch.load(where / f"rackmend-{rank}.pt")  # this test's own file, not network bytes
    opt.load_state_dict({"rackmend": saved})
    out = {"versions/then": torch.tensor(saved["versions"]), "versions/now": torch.tensor(opt.versions)}
    for p, ts in enumerate(fragment_tensors(model, opt.fragments)):
        for i, t in enumerate(ts):
            out.update({f"dcp/{p}/{i}": restored[p][i], f"after/{p}/{i}": _local(t),
                        f"ckpt/{p}/{i}": saved["params"][p][i], f"then/{p}/{i}": saved["held"][p][i],
                        f"now/{p}/{i}": opt.held[p][i].clone()})
    save_file({k: v.contiguous() for k, v in out.items()}, str(where / f"resumed-{rank}.safetensors"))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's is gathered: for the test's comparison only)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("fsdp", "tp", "hsdp", "tp_fsdp", "plain", "fsdp1", "unseeded", "stages"), required=True)
    p.add_argument("--model", choices=("tiny", "llama"), default="tiny")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--H", type=int, default=3)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--tau", type=int, default=1)
    p.add_argument("--learners", default="")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--held-out", type=Path)
    p.add_argument("--loss-out", type=Path, help="rank 0 writes the first and last held-out loss here")
    p.add_argument("--pid-out", type=Path)
    p.add_argument("--progress", type=Path)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--applied-out", type=Path)
    p.add_argument("--mixed", action="store_true", help="fsdp: bf16 compute (MixedPrecisionPolicy)")
    p.add_argument("--id-per-rank", action="store_true", help="a user's mistake: learner id <id>-<rank>")
    p.add_argument("--nudge", action="store_true",
                   help="after the join the last rank scales its parameters by 1 + 2**-22 (a rounding-level drift)")
    p.add_argument("--data-per-rank", action="store_true",
                   help="each rank trains on batches of its own (without DDP nothing keeps plain copies equal)")
    p.add_argument("--checkpoint", type=Path, help="torch.distributed.checkpoint directory (with --checkpoint-at)")
    p.add_argument("--checkpoint-at", type=int, default=0)
    p.add_argument("--resume", type=Path, help="restore from a --checkpoint directory, then train from --first-step")
    p.add_argument("--first-step", type=int, default=1)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    if a.pid_out:  # before the process group: the test may kill this rank at any point after
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        Path(f"{a.pid_out}.{os.environ['RANK']}").write_text(f"{os.getpid()} {restart}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(a.mode, a.model, a.mixed)
    ids = tuple(x for x in a.learners.split(",") if x)
    config = RackmendConfig(
        schedule=ScheduleConfig(sync_every=a.H, num_fragments=a.P, overlap=a.tau),
        syncer=SyncerConfig(min_quorum=max(1, len(ids)) if a.deterministic else 1, learners=ids),
        learner=LearnerConfig(wait_timeout=a.join_timeout, join_timeout=a.join_timeout),
        deterministic=a.deterministic,
    )
    lid = f"{a.id}-{rank}" if a.id_per_rank else a.id
    opt = RackmendOptimizer(model, make_inner(model), config, ZmqLink(a.endpoint, heartbeat_s=0.2), learner_id=lid)
    applied: list[str] = []
    if a.applied_out:
        opt.on_apply = lambda p, upd: applied.append(f"{opt.step_count} {p} {upd.version}")
    probe = batch("l9", 10_000)  # held out: a learner id and step no run trains on

    def held_out_loss() -> float:
        with torch.no_grad():
            return float(model(probe[0], probe[1]))

    if a.resume:
        resume(model, opt, a.resume, rank)
    if a.nudge and rank == world - 1:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + 2**-22)
    first = held_out_loss()
    try:
        for t in range(a.first_step, a.steps + 1):
            x, y, tokens = batch(a.id, t + 100_000 * rank if a.data_per_rank else t)
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            if a.progress:
                Path(f"{a.progress}.{rank}").write_text(f"{t} {' '.join(map(str, opt.versions))}")
            if a.step_sleep and rank == world - 1:
                time.sleep(a.step_sleep)
            opt.step(tokens=tokens // world)  # this rank's share: the learner counts tokens x world size
            if a.checkpoint and t == a.checkpoint_at:
                checkpoint(model, opt, a.checkpoint, rank)
    finally:
        opt.close()
    last = held_out_loss()
    if a.applied_out:
        Path(f"{a.applied_out}.{rank}").write_text("".join(f"{line}\n" for line in applied))
    if a.loss_out and rank == 0:
        a.loss_out.write_text(f"{first} {last}")
    whole = {k: full(v).detach().contiguous() for k, v in model.state_dict().items()}
    if a.out and rank == 0:
        save_file(whole, str(a.out))
    if a.held_out:
        save_held(opt, f"{a.held_out}.{rank}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not SystemExit: with torch 2.13 (CPU) a gloo job of 3 FSDP2 ranks sometimes aborts in
    # the interpreter's teardown after destroy_process_group ("terminate called without an
    # active exception", 1 run in 6 with plain FSDP2 and no rackmend); everything this
    # process had to do is done and written by now.
    os._exit(code)
