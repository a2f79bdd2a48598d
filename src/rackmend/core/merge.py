"""Contribution weights, CGAD's staleness scale and the merge of outer gradients (mean
and radial-directional).

Inputs arrive already in canonical order (sorted learner id) and every element is
summed in that order, so the result does not depend on arrival order. The mean of
float32 (or narrower) tensors is summed in float32 with one fused multiply-add per
term (``acc_dtype``): DESIGN §1 asks for fp32 or wider, and float64 sums took about
twice the time for no difference Theta can hold (docs/capacity.md). Norms, the
radial-directional merge and the pooled variance stay in float64 (``ACC_DTYPE``).

No state, no I/O, no threads of its own: a driver may pass an ``Executor`` (``pool``),
over which the sums spread as contiguous ranges of elements.
Every element is summed in the same order either way, so the result is the same bits
with or without a pool, with any number of workers.

Buffers merge by the weighted mean of the learners' values, except a BatchNorm
variance paired with its mean (``variance_of``), which merges as the pooled variance
of the racks' data: the mean of the variances plus the variance of the means. Racks on
different data (one sees N(0, 1), another N(5, 1)) each have a variance near 1, while
the union's is 7.25; the mean of the variances alone gave the global model statistics
worse than fresh ones.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from typing import Callable, Sequence

import torch

from rackmend.buffers import empty_float32, scratch
from rackmend.config import MERGES, WEIGHTINGS, check_choice

__all__ = ["contribution_weight", "merge_weights", "normalized_weights", "merge_deltas", "staleness_scale",
           "parallel_ranges", "run_jobs", "ACC_DTYPE", "acc_dtype"]

ACC_DTYPE = torch.float64
"""Accumulation dtype of the norms, the radial-directional merge and the pooled variance."""


_FLOAT32_SUMS = (torch.float32, torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the weighted mean of ``dtype`` tensors is summed in: float32 for float32 and
    narrower floats, float64 for anything else (float64, integer buffers).

    Why float32 is enough: each term goes in with one rounding (a fused multiply-add), so
    the sum of M terms is off by at most about M float32 ulps of the largest term, an
    outer gradient's; Theta, which that gradient moves, is itself float32 and far larger.
    Why not float64: converting every float32 value made merge + outer step take 1.9-2.0x
    as long with one thread (``benchmarks/syncer_capacity.py``, docs/capacity.md)."""
    return torch.float32 if dtype in _FLOAT32_SUMS else torch.float64


def contribution_weight(weighting: str, c_tokens: float, c_steps: int) -> float:
    """w_m for one contribution: ``tokens_sq_per_step`` = tokens**2/steps, ``tokens``, ``uniform``."""
    if weighting == "tokens_sq_per_step":
        if c_steps <= 0:
            return 0.0
        return float(c_tokens) * float(c_tokens) / float(c_steps)
    if weighting == "tokens":
        return float(c_tokens)
    if weighting == "uniform":
        return 1.0
    check_choice("weighting", weighting, WEIGHTINGS)
    raise AssertionError(f"weighting {weighting!r} is in WEIGHTINGS but has no rule here")


def _log_weight(weighting: str, c_tokens: float, c_steps: int) -> float:
    """ln w_m, or -inf for a zero weight; finite for any finite counters."""
    if weighting == "tokens_sq_per_step":
        if c_steps <= 0 or c_tokens <= 0:
            return -math.inf
        return 2.0 * math.log(c_tokens) - math.log(c_steps)
    if weighting == "tokens":
        return math.log(c_tokens) if c_tokens > 0 else -math.inf
    return 0.0


def merge_weights(weighting: str, c_tokens: Sequence[float], c_steps: Sequence[int]) -> list[float]:
    """Raw weights of a round's contributions that are finite for any finite counters.

    Where ``contribution_weight`` and their sum stay finite its values are returned
    unchanged, so results stay bit for bit what they were (the test vectors pin them).
    Otherwise (tokens**2 overflowing) the weights are computed in log space and scaled
    so the largest is 1: the same ratios, hence the same normalised weights."""
    raw = [contribution_weight(weighting, t, s) for t, s in zip(c_tokens, c_steps)]
    if all(math.isfinite(w) for w in raw) and math.isfinite(math.fsum(raw)):
        return raw
    logs = [_log_weight(weighting, float(t), int(s)) for t, s in zip(c_tokens, c_steps)]
    top = max(logs)
    if top == -math.inf:
        return [0.0] * len(logs)
    return [math.exp(lw - top) for lw in logs]


def normalized_weights(weights: Sequence[float], absent: float = 0.0) -> list[float]:
    """Weights divided by their sum plus ``absent`` (the weight of learners counted as
    sending a zero outer gradient); all-zero weights fall back to uniform."""
    total = 0.0
    for w in weights:
        total += w
    if total <= 0.0:
        return [1.0 / len(weights)] * len(weights)
    if absent > 0.0:
        total += absent
    return [w / total for w in weights]


def staleness_scale(tau: int, decay: float, cutoff: int | None) -> float:
    """CGAD's sigma(tau) = gamma(tau) * exp(-decay * tau) (Cosine-Gated Adam-Decay, arXiv
    2605.09126): what the outer gradient of a contribution ``tau`` versions behind is
    multiplied by before the merge (``SyncerConfig.staleness_decay``, ``staleness_cutoff``).
    The gate gamma(tau) = 0.5 * (1 + cos(pi * tau / cutoff)) falls smoothly from 1 to 0
    at ``cutoff`` and is 0 from there on; no cutoff: gamma = 1. Exactly 1.0 for a fresh
    contribution (``tau`` <= 0) and with the option off (``decay`` 0, no cutoff)."""
    if tau <= 0 or (decay == 0.0 and cutoff is None):
        return 1.0
    if cutoff is not None and tau >= cutoff:
        return 0.0
    gate = 1.0 if cutoff is None else 0.5 * (1.0 + math.cos(math.pi * tau / cutoff))
    return gate * math.exp(-decay * tau)


_CHUNK = 1 << 18
"""Elements per accumulation chunk: an accumulator of this size (1 MiB in float32) stays
in cache while every learner's piece is added to it, instead of a pass over memory per
learner; 256k rather than 64k elements makes 4x fewer Python calls per merge
(``benchmarks/syncer_capacity.py`` measures the merge)."""


def _weighted_sum(tensors: Sequence[torch.Tensor], weights: Sequence[float], dtype: torch.dtype,
                  pool: Executor | None = None) -> torch.Tensor:
    """sum_m w_m t_m in ``dtype``, summed chunk by chunk in ``acc_dtype(dtype)`` (float32
    sums go straight into the result); with ``pool``, each worker sums its own
    contiguous run of chunks, an accumulator in its core's cache (meant for many-core
    hosts, where torch's own threads would split every chunk's add over all the cores;
    on 2 cores no faster than those, docs/capacity.md)."""
    flat = [t.reshape(-1) for t in tensors]
    n, dev = tensors[0].numel(), tensors[0].device
    # A float32 result lives for one outer step: the memory of an earlier one, where idle.
    out_flat = empty_float32(n, dev) if dtype == torch.float32 else torch.empty(n, dtype=dtype, device=dev)
    out = out_flat.view(tensors[0].shape)
    acc_type = acc_dtype(dtype)

    def run(lo: int, hi: int) -> None:
        acc = None if acc_type == dtype else scratch("merge_acc", min(hi - lo, _CHUNK), acc_type, out.device)
        for start in range(lo, hi, _CHUNK):
            end = min(hi, start + _CHUNK)
            a = out_flat[start:end] if acc is None else acc[: end - start]
            a.zero_()
            for t, w in zip(flat, weights):
                a.add_(t[start:end], alpha=w)
            if acc is not None:
                out_flat[start:end].copy_(a)

    parallel_ranges(run, n, pool)
    return out


def _workers(pool: Executor | None) -> int:
    """How many of ``pool``'s workers to share work among: one per thread torch computes
    with (a driver with a pool sizes it and torch's threads alike)."""
    return torch.get_num_threads() if pool is not None else 1


def run_jobs(jobs: Sequence[Callable[[], None]], pool: Executor | None) -> None:
    """Every job, in order on this thread, or over ``pool`` as one contiguous batch per
    worker: a job per submit costs a worker's wake-up and a future each, which for a round
    of 1M-element decode jobs made decoding over 2 workers slower than on one thread."""
    workers = min(_workers(pool), len(jobs))
    if workers <= 1:
        for job in jobs:
            job()
        return
    per = -(-len(jobs) // workers)

    def batch(part: Sequence[Callable[[], None]]) -> None:
        for job in part:
            job()

    for f in [pool.submit(batch, jobs[i:i + per]) for i in range(0, len(jobs), per)]:  # type: ignore[union-attr]
        f.result()


def parallel_ranges(fn: Callable[[int, int], None], n: int, pool: Executor | None) -> None:
    """``fn(lo, hi)`` over [0, n) split into runs of whole ``_CHUNK``s, one per worker
    (``_workers``); all of [0, n) at once without a pool or for small n."""
    workers = _workers(pool)
    chunks = -(-n // _CHUNK)
    if workers <= 1 or chunks < 2:
        fn(0, n)
        return
    per = -(-chunks // min(workers, chunks)) * _CHUNK
    for f in [pool.submit(fn, lo, min(n, lo + per)) for lo in range(0, n, per)]:  # type: ignore[union-attr]
        f.result()


def _unit(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = x / ||x||, with phi(0) = 0 (never NaN)."""
    n = torch.linalg.vector_norm(x, dtype=ACC_DTYPE)
    if n.item() == 0.0:
        return torch.zeros_like(x, dtype=ACC_DTYPE)
    return x.to(ACC_DTYPE) / n


def merge_deltas(
    deltas: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    method: str = "mean",
    embedding: Sequence[bool] | None = None,
    absent: float = 0.0,
    variance_of: Sequence[int | None] | None = None,
    pool: Executor | None = None,
) -> list[torch.Tensor]:
    """Merge per-learner outer gradients into one, tensor by tensor.

    ``deltas[m][i]`` is learner m's gradient for tensor i; ``weights[m]`` its raw
    weight. ``mean``: sum_m w_m d_m / sum_m w_m. ``rda``: (weighted mean of norms) *
    phi(weighted mean of phi(d_m)); tensors flagged in ``embedding`` use mean.
    ``absent`` adds the raw weight of learners counted as sending zero to every
    denominator, which scales the result by the present share of the weight.
    ``variance_of[j] = i``: tensor j is a buffer variance whose mean is tensor i (both
    as ``Theta - value``, like every delta; ``FragmentSpec.variance_of``); the merged
    value ``Theta_j - out[j]`` is then the pooled variance sum_m w_m var_m +
    sum_m w_m (mean_m - mean)^2, the absent learners counted at Theta's own mean and
    variance (zero deltas). The spread of the means is the same in delta terms,
    (Theta_i - d_mi) - (Theta_i - dbar_i) = dbar_i - d_mi, so it is subtracted from the
    weighted mean of the variance deltas. Returns tensors in the input dtype. ``pool``:
    the weighted sums spread over its workers (the same bits as without).
    """
    check_choice("merge", method, MERGES)
    if not deltas:
        raise ValueError("merge_deltas needs at least one contribution")
    w = normalized_weights(weights, absent)
    n_tensors = len(deltas[0])
    embedding = embedding or [False] * n_tensors
    out: list[torch.Tensor] = []
    for i in range(n_tensors):
        column = [d[i] for d in deltas]
        dtype = column[0].dtype
        if method == "mean" or embedding[i]:
            out.append(_weighted_sum(column, w, dtype, pool))
            continue
        radius = 0.0
        for t, wm in zip(column, w):
            radius += wm * torch.linalg.vector_norm(t, dtype=ACC_DTYPE).item()
        direction = _unit(_weighted_sum([_unit(t) for t in column], w, ACC_DTYPE))
        out.append(direction.mul_(radius).to(dtype))
    for j, i in enumerate(variance_of or ()):
        if i is not None:
            var = _weighted_sum([d[j] for d in deltas], w, ACC_DTYPE)
            out[j] = var.sub_(_spread(deltas, w, i, absent > 0.0)).to(out[j].dtype)
    return out


def _spread(deltas: Sequence[Sequence[torch.Tensor]], w: Sequence[float], i: int, absent: bool) -> torch.Tensor:
    """sum_m w_m (d_mi - dbar_i)^2 in ACC_DTYPE, dbar_i = sum_m w_m d_mi, plus, with
    ``absent`` learners (the weight the normalised ``w`` lacks) at delta 0, their
    share times dbar_i^2. Two passes, not E[d^2] - dbar^2, which cancels badly when
    the means sit far from Theta and close to each other."""
    column = [d[i] for d in deltas]
    center = _weighted_sum(column, w, ACC_DTYPE)
    out = torch.zeros_like(center)
    for t, wm in zip(column, w):
        out.add_((t.to(ACC_DTYPE) - center).square_(), alpha=wm)
    if absent:
        out.add_(center.square(), alpha=max(0.0, 1.0 - math.fsum(w)))
    return out
