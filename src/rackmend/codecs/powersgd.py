"""PowerSGD (Vogels et al., 2019): rank-r factors from one warm-started power iteration.

A tensor of shape ``(n, *rest)`` is viewed as the matrix M = (n, m), m = prod(rest).
With Q (m x r) from the previous call (the caller's ``state["q"]``; a fixed-seed
Gaussian the first time), one step computes

    P = orth(M Q)         (n x r, orthonormal columns, torch.linalg.qr)
    Q' = M^T P            (m x r)

and sends P and Q' (float32); the receiver rebuilds M_hat = P Q'^T = P P^T M, the
projection of M's columns onto span(P). Q' is kept as the next warm start, so over
calls the power iteration keeps converging on the dominant subspace of what is sent,
which for slowly changing outer gradients (plus the error-feedback residual) costs
one matmul pair per step instead of an SVD.

Vectors (ndim <= 1) and matrices too small for factors to pay off
(r * (n + m) >= n * m) are sent dense, exactly, as float32: params
``{"mode": "dense"}`` instead of ``{"mode": "lowrank", "rank": r}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from rackmend.codecs.base import (
    Codec,
    CodecError,
    Encoded,
    FrameLayout,
    ParamValue,
    expect_params,
    int_in_range,
    numel,
    owned_flat,
    require_finite,
)

__all__ = ["PowerSGDCodec", "MAX_RANK", "INIT_SEED"]

MAX_RANK = 1024
"""Largest configurable rank; past this a rank-r factorisation is rarely smaller."""

INIT_SEED = 0
"""Seed of the Gaussian first Q, so a fresh state encodes the same way every run."""

_BOUND_SLACK = 1e-3
"""Relative slack of the projection bound for float32 QR and matmul rounding."""


def _matrix_dims(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(n, m) of the matrix view of ``shape``, or None for vectors and scalars."""
    if len(shape) < 2:
        return None
    return shape[0], numel(shape[1:])


def _factors_pay_off(n: int, m: int, rank: int) -> bool:
    return rank * (n + m) < n * m


@dataclass(frozen=True, kw_only=True)
class PowerSGDCodec(Codec):
    """``powersgd``: rank-r factors P (n*r float32) and Q (m*r float32), or one dense
    float32 frame for vectors and small matrices (see the module docstring).

    Warm start needs a ``state`` dict per tensor (it holds ``"q"``, m x r, on the
    tensor's device); with ``state=None`` every call starts from the seeded Gaussian.
    """

    name: ClassVar[str] = "powersgd"
    codec_id: ClassVar[int] = 4
    lossless: ClassVar[bool] = False

    rank: int = 4
    """r: columns of P and Q. Wire bytes are 4*r*(n+m) per n x m matrix; higher r
    captures more of each step (less residual carried) at proportionally more bytes."""

    def __post_init__(self) -> None:
        int_in_range(self.name, "rank", self.rank, 1, MAX_RANK)

    def wire_params(self, shape: tuple[int, ...]) -> dict[str, ParamValue]:
        dims = _matrix_dims(shape)
        if dims is not None and _factors_pay_off(*dims, self.rank):
            return {"mode": "lowrank", "rank": self.rank}
        return {"mode": "dense"}

    def _layout(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> FrameLayout:
        mode = params.get("mode") if isinstance(params, Mapping) else None
        if mode == "dense":
            expect_params(self.name, params, {"mode": str})
            return [(torch.float32, numel(shape))]
        if mode != "lowrank":
            raise CodecError(f"{self.name}: params need mode='lowrank' or mode='dense', got {params!r}")
        expect_params(self.name, params, {"mode": str, "rank": int})
        rank = int_in_range(self.name, "rank", params["rank"], 1, MAX_RANK)
        dims = _matrix_dims(shape)
        if dims is None:
            raise CodecError(f"{self.name}: mode='lowrank' needs a tensor with >= 2 dims, got shape {shape}")
        n, m = dims
        if not _factors_pay_off(n, m, rank):
            raise CodecError(
                f"{self.name}: rank {rank} factors ({rank * (n + m)} values) are not smaller than the "
                f"{n} x {m} matrix of shape {shape}; such tensors must be sent with mode='dense'"
            )
        return [(torch.float32, n * rank), (torch.float32, m * rank)]

    def _start_q(self, state: dict[str, Any] | None, m: int, device: torch.device) -> torch.Tensor:
        q = state.get("q") if state is not None else None
        if q is None:
            g = torch.Generator(device=device).manual_seed(INIT_SEED)
            return torch.randn(m, self.rank, generator=g, device=device)
        fits = isinstance(q, torch.Tensor) and q.shape == (m, self.rank) and q.dtype == torch.float32
        if not fits or q.device != device:
            got = f"{tuple(q.shape)} {q.dtype} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise CodecError(
                f"{self.name}: state['q'] is {got}, expected ({m}, {self.rank}) float32 on {device}; "
                "a state dict belongs to one tensor and one rank (pass a fresh dict after changing either)"
            )
        return q

    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        require_finite(self.name, x)
        shape = tuple(x.shape)
        params = self.wire_params(shape)
        if params["mode"] == "dense":
            return Encoded(codec=self.name, shape=shape, params=params, frames=(owned_flat(x),))
        n, m = _matrix_dims(shape)  # type: ignore[misc]
        mat = x.contiguous().view(n, m)
        p = torch.linalg.qr(mat @ self._start_q(state, m, x.device)).Q
        q = mat.T @ p
        if state is not None:
            state["q"] = q.clone()
        return Encoded(codec=self.name, shape=shape, params=params,
                       frames=(p.contiguous().view(-1), q.contiguous().view(-1)))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        if enc.params["mode"] == "dense":
            return enc.frames[0].view(enc.shape)
        rank = int(enc.params["rank"])
        p, q = (f.view(-1, rank) for f in enc.frames)
        return (p @ q.T).view(enc.shape)

    def error_bound(self, x: torch.Tensor) -> float:
        """Dense-sent shapes: 0 (exact). Low rank: ``max_j ||M[:, j]||_2 * (1 + 1e-3)``.

        M_hat = P P^T M projects each column of M orthogonally, so no element moves by
        more than its column's 2-norm. That is all one call can promise (an M orthogonal
        to span(P) loses everything) and it is deliberately weak: PowerSGD is only
        meant to be used with error feedback, where what is bounded is the running gap
        sum(decoded) - sum(inputs) = -residual (see ``rackmend.codecs.feedback``).
        """
        require_finite(self.name, x)
        shape = tuple(x.shape)
        if self.wire_params(shape)["mode"] == "dense":
            return 0.0
        n, m = _matrix_dims(shape)  # type: ignore[misc]
        cols = torch.linalg.vector_norm(x.detach().reshape(n, m), dim=0)
        return float(cols.max()) * (1.0 + _BOUND_SLACK)
