"""A deliberately plain single-process rendering of the equations, used only by tests.

M models step one after another in a loop; every fragment round waits for all
learners (quorum = all, canonical learner order); there are no threads, queues,
events or timing. The weight and merge arithmetic is ``rackmend.core.merge``
(checked on its own against the independent vectors in ``data/merge_rounds.json``);
schedule, counters, outer gradients, the outer step and the apply rules are written
out again here from the design, so the distributed run is checked against them.
Floating buffers are merged by the weighted mean without an outer step (a BatchNorm
running_var with its running_mean: the pooled variance, mean of the variances plus the
variance of the means). A learner sends a BatchNorm layer's running statistic as its own
estimate since the value last written into it (a merged value, or the initial one):
with w the share of that value b0 left in the running value r after the n batches since
(w = (1 - momentum)^n; momentum None: w = n0 / n_now, the batch counts), it sends
(r - w b0) / (1 - w), or r itself where 1 - w < 1e-6; a variance is kept >= 0. The
arithmetic is float64, rounded to the buffer's dtype.

Compression, written out the same way (the codec classes only encode and decode):
each learner keeps a residual per (fragment, tensor) and sends decode(encode(Δ + r)),
keeping r = Δ + r - that; the syncer keeps a residual per (fragment, tensor) of the
change its outer step made and sets θ = θ_old + decode(encode(change + r)).

DES-LOC (``ScheduleConfig.desloc``), written out from the design: with a parameter send
of fragment p at step t, a learner also sends Adam's ``exp_avg`` when (t - t_p) is a
multiple of K_u (default 3H) and ``exp_avg_sq`` when it is a multiple of K_v (default
6H): the state tensors of the fragment's parameters in order, zeros where there is no
state yet, through the moments codec without feedback (decode(encode(m))). Once every
learner has sent, the round's value is the weighted mean (the parameter merge's weights,
from the counters at the send), sent as decode(encode(mean)); each learner overwrites
its moments with it at t + tau, after the parameter values due then (a parameter without
state is left without).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from rackmend.config import RackmendConfig
from rackmend.core.fragments import model_tensors, pack_fragments
from rackmend.core.merge import contribution_weight, merge_deltas

BatchFn = Callable[[str, int], tuple[torch.Tensor, torch.Tensor, int]]


@dataclass
class _Learner:
    model: nn.Module
    opt: torch.optim.Optimizer
    held: list[list[torch.Tensor]]
    c_steps: list[int]
    c_tokens: list[float]
    sent: dict[int, tuple[int, list[torch.Tensor], list[torch.Tensor], int, float]] = field(default_factory=dict)
    residual: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    codec_state: dict[tuple[int, int], dict] = field(default_factory=dict)
    moments_sent: dict[tuple[int, str], tuple[int, list[torch.Tensor], int, float]] = field(default_factory=dict)
    written: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    """BatchNorm statistics by name: (the value last written, the layer's batch count then)."""


def _batchnorm_of(model: nn.Module, name: str) -> nn.modules.batchnorm._NormBase | None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if (leaf in ("running_mean", "running_var") and isinstance(module, nn.modules.batchnorm._NormBase)
            and module.track_running_stats):
        return module
    return None


def _note_written(L: _Learner, names: tuple[str, ...]) -> None:
    for name in names:
        bn = _batchnorm_of(L.model, name)
        if bn is not None:
            L.written[name] = (L.model.get_buffer(name).detach().clone(), int(bn.num_batches_tracked))


def _as_sent(L: _Learner, name: str, value: torch.Tensor) -> torch.Tensor:
    bn = _batchnorm_of(L.model, name)
    if bn is None:
        return value
    b0, n0 = L.written[name]
    n = int(bn.num_batches_tracked)
    w = (n0 / n if n > 0 else 1.0) if bn.momentum is None else (1.0 - bn.momentum) ** (n - n0)
    if 1.0 - w < 1e-6:
        return value
    x = (value.double() - w * b0.double()) / (1.0 - w)
    return (x.clamp_min(0.0) if name.endswith("running_var") else x).to(value.dtype)


def _lossy_send(codec, residual: dict, state: dict, key: tuple, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x + r)); keeps r = (x + r) - that. No residual yet: x as it is."""
    y = x if key not in residual else x + residual[key]
    decoded = codec.decode(codec.encode(y, state.setdefault(key, {})))
    residual[key] = y - decoded
    return decoded


def reference_run(
    make_model: Callable[[], nn.Module],
    make_inner: Callable[[nn.Module], torch.optim.Optimizer],
    batch: BatchFn,
    config: RackmendConfig,
    learner_ids: list[str],
    steps: int,
    moments_out: dict[tuple[int, str], list[torch.Tensor]] | None = None,
    grad_ranks: dict[str, int] | None = None,
) -> tuple[dict[str, nn.Module], list[list[torch.Tensor]]]:
    """Returns each learner's final model and the global value of every fragment.

    ``grad_ranks``: learners whose rack averages its gradient over k data-parallel
    ranks that all see the learner's batch (FSDP2's reduce-scatter): their gradient is
    (g + ... + g) / k, k copies, as the rack computes it. For k = 1 or 2 that is g
    exactly; for k = 3 fl(fl(3g) / 3) can differ from g by an ulp, an op of the rack's
    own inner step that this models so the comparison stays bit for bit.
    ``moments_out`` (DES-LOC) receives the last averaged moments per (fragment, kind)."""
    sch, sc, lc = config.schedule, config.syncer, config.learner
    # "auto" written out here, not taken from the library: the reference runs in lockstep,
    # where it means overwrite.
    rule = lc.apply if lc.apply != "auto" else ("overwrite" if config.deterministic else "keep_local")
    init = make_model()
    frags = pack_fragments(init, sch.num_fragments, sch.sync_every, sch.packing, buffers=sch.sync_buffers)
    params = lambda m, f: [{n: t for n, t, _ in model_tensors(m)}[n] for n in f.names]  # noqa: E731
    theta = [[p.detach().clone() for p in params(init, f)] for f in frags]
    outer = [getattr(torch.optim, sc.outer_optimizer)(t, lr=sc.outer_lr, **sc.resolved_outer_kwargs()) for t in theta]
    up, down = config.compression.build_uplink(), config.compression.build_downlink()
    down_residual: dict[tuple[int, int], torch.Tensor] = {}
    down_state: dict[tuple[int, int], dict] = {}
    H = sch.sync_every
    periods = {"exp_avg": sch.desloc_ku or 3 * H, "exp_avg_sq": sch.desloc_kv or 6 * H} if sch.desloc else {}
    moment_codec = config.compression.build_moments()
    moments_out = {} if moments_out is None else moments_out
    learners: dict[str, _Learner] = {}
    for lid in sorted(learner_ids):
        model = copy.deepcopy(init)
        learners[lid] = _Learner(
            model, make_inner(model), [[t.clone() for t in th] for th in theta],
            [0] * len(frags), [0.0] * len(frags),
        )
        if sch.sync_buffers:
            _note_written(learners[lid], tuple(n for f in frags for n in f.names))

    def merge(f) -> None:
        p = f.index
        order = sorted(learners)
        sent = [learners[i].sent[p] for i in order]
        weights = [contribution_weight(sc.weighting, s[4], s[3]) for s in sent]
        merged = merge_deltas([s[2] for s in sent], weights, sc.merge,
                              [s.is_embedding or s.is_buffer for s in f.tensors], variance_of=f.variance_of)
        old = [th.detach().clone() for th in theta[p]]
        for th, g, s in zip(theta[p], merged, f.tensors):
            th.grad = None if s.is_buffer else g
        outer[p].step()
        with torch.no_grad():
            for th, g, s in zip(theta[p], merged, f.tensors):
                th.grad = None
                if s.is_buffer:  # buffers: the weighted mean of the learners' values (a BatchNorm
                    # variance: the pooled variance, see merge_deltas), no outer step
                    th.sub_(g)
        if not down.lossless:
            with torch.no_grad():
                for i, (th, o) in enumerate(zip(theta[p], old)):
                    th.copy_(o + _lossy_send(down, down_residual, down_state, (p, i), th - o))

    def apply(f) -> None:
        p = f.index
        for L in learners.values():
            _, snap, _, s_steps, s_tokens = L.sent.pop(p)
            with torch.no_grad():
                for i, (q, value) in enumerate(zip(params(L.model, f), theta[p])):
                    if rule == "overwrite":
                        q.copy_(value)
                    elif rule == "mix":
                        q.mul_(lc.mix_alpha).add_(value, alpha=1 - lc.mix_alpha)
                    else:
                        q.copy_(value + (q - snap[i]))
            L.held[p] = [v.clone() for v in theta[p]]
            _note_written(L, f.names)
            if rule == "keep_local":
                L.c_steps[p] -= s_steps
                L.c_tokens[p] -= s_tokens
            else:
                L.c_steps[p], L.c_tokens[p] = 0, 0.0

    def trained(model: nn.Module, f) -> list[torch.Tensor]:
        by_name = {n: (t, b) for n, t, b in model_tensors(model)}
        return [by_name[n][0] for n in f.names if not by_name[n][1]]

    def merge_moments(f, kind: str) -> None:
        sent = [learners[i].moments_sent[(f.index, kind)] for i in sorted(learners)]
        weights = [contribution_weight(sc.weighting, s[3], s[2]) for s in sent]
        mean = merge_deltas([s[1] for s in sent], weights, "mean")
        moments_out[(f.index, kind)] = [moment_codec.decode(moment_codec.encode(m)) for m in mean]

    def apply_moments(f, kind: str) -> None:
        for L in learners.values():
            del L.moments_sent[(f.index, kind)]
            for q, value in zip(trained(L.model, f), moments_out[(f.index, kind)]):
                state = L.opt.state.get(q, {})
                if kind in state:
                    state[kind].copy_(value)

    for t in range(1, steps + 1):
        for lid, L in learners.items():
            x, y, tokens = batch(lid, t)
            loss = L.model(x, y)
            L.opt.zero_grad()
            loss.backward()
            k = (grad_ranks or {}).get(lid, 1)
            if k > 2:
                with torch.no_grad():
                    for q in L.model.parameters():
                        if q.grad is not None:
                            total = q.grad.clone()
                            for _ in range(k - 1):
                                total += q.grad
                            q.grad.copy_(total / k)
            L.opt.step()
            for p in range(len(frags)):
                L.c_steps[p] += 1
                L.c_tokens[p] += tokens
            for f in frags:
                if (t - f.offset) % sch.sync_every == 0:
                    snap = [q.detach().clone() for q in params(L.model, f)]
                    delta = [h - _as_sent(L, n, s) for h, s, n in zip(L.held[f.index], snap, f.names)]
                    if not up.lossless:
                        delta = [_lossy_send(up, L.residual, L.codec_state, (f.index, i), d)
                                 for i, d in enumerate(delta)]
                    L.sent[f.index] = (t, snap, delta, L.c_steps[f.index], L.c_tokens[f.index])
                    for kind, K in periods.items():
                        if (t - f.offset) % K == 0:
                            ms = [L.opt.state.get(q, {}).get(kind) for q in trained(L.model, f)]
                            ms = [torch.zeros_like(q) if m is None else m.detach().clone()
                                  for q, m in zip(trained(L.model, f), ms)]
                            ms = [moment_codec.decode(moment_codec.encode(m)) for m in ms]
                            L.moments_sent[(f.index, kind)] = (t, ms, L.c_steps[f.index], L.c_tokens[f.index])
        for f in frags:
            if all(f.index in L.sent and L.sent[f.index][0] + sch.overlap == t for L in learners.values()):
                merge(f)
                apply(f)
        for f in frags:
            for kind in periods:
                key = (f.index, kind)
                if all(key in L.moments_sent and L.moments_sent[key][0] + sch.overlap == t for L in learners.values()):
                    merge_moments(f, kind)
                    apply_moments(f, kind)
    # Sends in the last tau steps were merged by the syncer but never applied.
    for f in frags:
        if all(f.index in L.sent for L in learners.values()):
            merge(f)
        for kind in periods:
            if all((f.index, kind) in L.moments_sent for L in learners.values()):
                merge_moments(f, kind)
    return {lid: L.model for lid, L in learners.items()}, theta
