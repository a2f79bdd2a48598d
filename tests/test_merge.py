"""Weights and merges on hand-checkable inputs."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rackmend.config import ConfigError
from rackmend.core import contribution_weight, merge_deltas, normalized_weights
from rackmend.core.merge import run_jobs, staleness_scale


def test_weight_formulas_by_hand() -> None:
    assert contribution_weight("tokens_sq_per_step", 100, 4) == 2500.0
    assert contribution_weight("tokens_sq_per_step", 300, 9) == 10000.0
    assert contribution_weight("tokens", 300, 9) == 300.0
    assert contribution_weight("uniform", 300, 9) == 1.0
    assert contribution_weight("tokens_sq_per_step", 5, 0) == 0.0
    with pytest.raises(ConfigError, match="weighting"):
        contribution_weight("bogus", 1, 1)


def test_staleness_scale_is_cgads_sigma() -> None:
    """sigma(tau) = gamma(tau) * exp(-alpha * tau), gamma the cosine gate to 0 at tau_c."""
    # Off (decay 0, no cutoff): exactly 1 at any age; fresh work: exactly 1 with any setting.
    assert all(staleness_scale(tau, 0.0, None) == 1.0 for tau in range(10))
    assert staleness_scale(0, 0.7, None) == 1.0 and staleness_scale(0, 0.7, 3) == 1.0
    assert staleness_scale(0, 0.0, 1) == 1.0
    # The decay alone, the gate alone, both.
    assert staleness_scale(2, 0.5, None) == pytest.approx(math.exp(-1.0), rel=1e-15)
    assert staleness_scale(2, 0.0, 4) == pytest.approx(0.5, rel=1e-15)  # half way down the gate
    assert staleness_scale(1, 0.0, 4) == pytest.approx(0.5 + 0.5 / math.sqrt(2.0), rel=1e-15)
    for tau in (1, 2, 3):
        assert staleness_scale(tau, 0.25, 4) == pytest.approx(
            0.5 * (1.0 + math.cos(math.pi * tau / 4)) * math.exp(-0.25 * tau), rel=1e-15)
    # 0 at and past the cutoff, with or without a decay.
    assert [staleness_scale(tau, a, 4) for tau in (4, 5, 100) for a in (0.0, 0.25)] == [0.0] * 6
    assert staleness_scale(1, 0.3, 1) == 0.0
    # Falls with age.
    values = [staleness_scale(tau, 0.1, 6) for tau in range(8)]
    assert values == sorted(values, reverse=True) and values[0] == 1.0 and values[6] == 0.0


def test_tokens_sq_per_step_favours_faster_work() -> None:
    # Same tokens, fewer steps (bigger batches) weighs more; more tokens weighs more.
    assert contribution_weight("tokens_sq_per_step", 1000, 5) > contribution_weight("tokens_sq_per_step", 1000, 10)
    assert contribution_weight("tokens_sq_per_step", 2000, 10) > contribution_weight("tokens_sq_per_step", 1000, 10)


def test_weighted_mean_by_hand() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])
    (out,) = merge_deltas([[a], [b]], [3.0, 1.0], "mean")
    torch.testing.assert_close(out, torch.tensor([0.75, 1.0]))
    assert normalized_weights([0.0, 0.0]) == [0.5, 0.5]


def test_rda_norm_is_weighted_mean_of_norms() -> None:
    g = torch.Generator().manual_seed(3)
    deltas = [[torch.randn(50, generator=g) * s] for s in (0.1, 1.0, 5.0)]
    weights = [1.0, 2.0, 7.0]
    (out,) = merge_deltas(deltas, weights, "rda")
    w = normalized_weights(weights)
    expected = sum(wi * float(d[0].norm()) for wi, d in zip(w, deltas))
    assert math.isclose(float(out.norm()), expected, rel_tol=1e-5)
    # ... and it points along the weighted mean of unit directions.
    direction = sum(wi * d[0] / d[0].norm() for wi, d in zip(w, deltas))
    cos = float(torch.dot(out, direction) / (out.norm() * direction.norm()))
    assert cos > 1 - 1e-5


def test_rda_zero_inputs_do_not_produce_nan() -> None:
    z = torch.zeros(7)
    (out,) = merge_deltas([[z], [z]], [1.0, 1.0], "rda")
    assert torch.equal(out, z)
    x = torch.arange(7.0)
    (out,) = merge_deltas([[z], [x]], [1.0, 1.0], "rda")
    assert torch.isfinite(out).all()
    assert math.isclose(float(out.norm()), 0.5 * float(x.norm()), rel_tol=1e-5)
    (out,) = merge_deltas([[x], [-x]], [1.0, 1.0], "rda")  # directions cancel
    assert torch.equal(out, z)


def test_rda_embeddings_use_mean() -> None:
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    emb, other = merge_deltas([[a, a], [b, b]], [1.0, 1.0], "rda", embedding=[True, False])
    torch.testing.assert_close(emb, (a + b) / 2)
    assert not torch.allclose(other, (a + b) / 2)


def test_merge_is_order_independent_given_canonical_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    ds = [[torch.randn(1000, generator=g)] for _ in range(5)]
    w = [1.0, 3.0, 0.5, 2.0, 9.0]
    (a,) = merge_deltas(ds, w, "mean")
    (b,) = merge_deltas(ds, w, "mean")
    assert torch.equal(a, b) and a.dtype == torch.float32


def test_batchnorm_variance_merges_as_pooled_variance() -> None:
    """Tensor 1 is the variance of tensor 0's mean: merged value = sum w var_m +
    sum w (mean_m - mean)^2, worked in deltas (Theta - value) as the syncer holds them."""
    theta_mean, theta_var = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5])
    means = [torch.tensor([0.0, 0.0]), torch.tensor([5.0, 1.0])]
    variances = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])]
    deltas = [[theta_mean - m, theta_var - v] for m, v in zip(means, variances)]
    raw = [3.0, 1.0]  # normalised 0.75, 0.25
    d_mean, d_var = merge_deltas(deltas, raw, "mean", [True, True], variance_of=[None, 0])
    mean, var = theta_mean - d_mean, theta_var - d_var
    assert torch.allclose(mean, torch.tensor([1.25, 0.25]))
    # [0.75*1 + 0.25*1 + 0.75*1.25^2 + 0.25*3.75^2, 0.75*2 + 0.25*4 + 0.75*0.25^2 + 0.25*0.75^2]
    assert torch.allclose(var, torch.tensor([1.0 + 4.6875, 2.5 + 0.1875]))
    # Without the pairing the variance is the plain weighted mean (what it was before).
    _, plain = merge_deltas(deltas, raw, "mean", [True, True])
    assert torch.allclose(theta_var - plain, torch.tensor([1.0, 2.5]))
    # One learner: its own statistics, whatever Theta holds.
    one = merge_deltas(deltas[1:], raw[1:], "mean", [True, True], variance_of=[None, 0])
    assert torch.allclose(theta_var - one[1], variances[1])

    # Absent learners count at Theta's own statistics (delta 0), weight 4 of 8 here.
    d_mean, d_var = merge_deltas(deltas, raw, "mean", [True, True], absent=4.0, variance_of=[None, 0])
    w = [3 / 8, 1 / 8, 4 / 8]
    pts = means + [theta_mean]
    vs = variances + [theta_var]
    center = sum(wm * m for wm, m in zip(w, pts))
    pooled = sum(wm * (v + (m - center) ** 2) for wm, m, v in zip(w, pts, vs))
    assert torch.allclose(theta_mean - d_mean, center) and torch.allclose(theta_var - d_var, pooled)


def test_float32_sums_are_within_m_ulps_and_the_same_on_any_thread_count() -> None:
    """The mean of float32 tensors is summed in float32, one fused multiply-add per term:
    within M float32 ulps of the exact weighted sum of the terms' magnitudes, and the
    same bits whatever torch's thread count (every element is summed in the same order)."""
    from rackmend.core.merge import _CHUNK, acc_dtype

    assert acc_dtype(torch.float32) == torch.float32 and acc_dtype(torch.bfloat16) == torch.float32
    assert acc_dtype(torch.float64) == torch.float64 and acc_dtype(torch.int64) == torch.float64
    g = torch.Generator().manual_seed(5)
    n, m = 2 * _CHUNK + 1001, 8
    deltas = [[torch.randn(n, generator=g) * 10.0 ** (i % 4 - 2)] for i in range(m)]  # 1e-2 .. 10, cancelling
    weights = [1.0 + i for i in range(m)]
    w = normalized_weights(weights)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (one,) = merge_deltas(deltas, weights, "mean")
        torch.set_num_threads(2)
        (two,) = merge_deltas(deltas, weights, "mean")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    exact = sum(wm * d[0].double() for wm, d in zip(w, deltas))
    magnitude = sum(wm * d[0].double().abs() for wm, d in zip(w, deltas))
    err = (one.double() - exact).abs()
    assert bool((err <= m * torch.finfo(torch.float32).eps * magnitude).all()), float((err / magnitude).max())
    # bfloat16 inputs are summed in float32 too: the float32 merge of the same values, rounded once.
    low = [[d[0].bfloat16()] for d in deltas]
    (merged_low,) = merge_deltas(low, weights, "mean")
    (merged_wide,) = merge_deltas([[d[0].float()] for d in low], weights, "mean")
    assert merged_low.dtype == torch.bfloat16 and torch.equal(merged_low, merged_wide.bfloat16())


@pytest.mark.parametrize("method", ["mean", "rda"])
def test_a_worker_pool_gives_the_same_bits(method: str) -> None:
    """A driver's worker pool splits the sums into runs of chunks; every element is
    still summed in the same order: the same bits, any worker count."""
    from rackmend.core.merge import _CHUNK

    g = torch.Generator().manual_seed(3)
    sizes = [(3 * _CHUNK + 17,), (5, 7), (2 * _CHUNK,), (0,)]
    deltas = [[torch.randn(s, generator=g) for s in sizes] for _ in range(5)]
    weights = [1.0, 2.5, 0.3, 7.0, 1.1]
    alone = merge_deltas(deltas, weights, method, absent=0.4)
    for workers in (2, 3, 8):
        with ThreadPoolExecutor(workers) as pool:
            pooled = merge_deltas(deltas, weights, method, absent=0.4, pool=pool)
        assert all(torch.equal(a, b) for a, b in zip(alone, pooled)), workers


def test_run_jobs_runs_each_job_once_in_one_batch_per_worker() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for n_jobs in (1, 2, 7, 9):
            ran: list[tuple[int, str]] = []
            lock = threading.Lock()

            def job(i: int) -> None:
                with lock:
                    ran.append((i, threading.current_thread().name))

            with ThreadPoolExecutor(3, thread_name_prefix="w") as pool:
                run_jobs([lambda i=i: job(i) for i in range(n_jobs)], pool)
            assert sorted(i for i, _ in ran) == list(range(n_jobs))
            by_thread: dict[str, list[int]] = {}
            for i, name in ran:
                by_thread.setdefault(name, []).append(i)
            # One batch per worker: each thread ran one contiguous run of jobs, in order.
            assert len(by_thread) <= min(3, n_jobs)
            for runs in by_thread.values():
                assert runs == list(range(runs[0], runs[0] + len(runs)))
            if n_jobs == 1:
                assert [name for _, name in ran] == [threading.current_thread().name]
        ran.clear()
        run_jobs([lambda i=i: ran.append((i, "")) for i in range(4)], None)
        assert [i for i, _ in ran] == [0, 1, 2, 3]

        def boom() -> None:
            raise ValueError("bad chunk")

        with ThreadPoolExecutor(3) as pool, pytest.raises(ValueError, match="bad chunk"):
            run_jobs([lambda: None, boom, lambda: None], pool)
    finally:
        torch.set_num_threads(before)
