"""Element-wise codecs: ``none`` (fp32), ``bf16``, and block-wise absmax ``int8``/``int4``.

Block quantisation, in one paragraph: the tensor is flattened and cut into blocks of
``block_size`` consecutive elements; the last block holds the remainder
(``numel % block_size`` elements) and is a block of its own, with its own scale, so
nothing is padded on the wire (int4 alone rounds its packed bytes up to a whole byte
when ``numel`` is odd; that spare high nibble is written as 0 and ignored on decode).
Each block's scale is ``s = absmax / qmax`` in float32; elements are sent as
``q = round(x * (1/s))`` (round half to even) clamped to ``[-qmax, qmax]``: int8 uses
qmax = 127, int4 uses the symmetric qmax = 7 (nibble value ``q + 8`` in 1..15, two per
byte, element ``2i`` in the low nibble), so zero is exact and ``-x`` encodes as ``-q``.
Blocks exist because gradients mix tiny and huge values: one scale per tensor would
round every small block to zero; a per-block scale keeps each block's error relative
to its own magnitude. All of it is vectorised: whole-block tensor ops, run over
cache-sized chunks on the CPU (a loop over 64 chunks to encode 16M elements, 16 to
decode them, never over blocks or elements), plus one gathered op for the partial
tail. A decode's chunks can run on several threads at once (``decode_parts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch

from rackmend.buffers import empty_float32, scratch
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

__all__ = ["IdentityCodec", "BF16Codec", "Int8Codec", "Int4Codec", "MAX_BLOCK_SIZE", "BF16_LIMIT"]

MAX_BLOCK_SIZE = 1 << 16
"""Largest accepted block size. Past this, one scale covers so many elements that
blocks stop doing their job; the cap also keeps a hostile header from being legal."""

BF16_LIMIT = (2.0 - 2.0**-8) * 2.0**127
"""Magnitudes at or above this round to Inf in bfloat16 (about 3.396e38)."""

_TINY = torch.finfo(torch.float32).tiny
"""Smallest normal float32 (2**-126). Scales below it are flushed to 0 (see below)."""

_REL_SLACK = 2.0**-21
"""Rounding slack of the int bound in units of ``qmax * s``: the float32 reciprocal,
product and decode multiply add at most about 3 ulps, and 2**-21 is 8 ulps."""


@dataclass(frozen=True, kw_only=True)
class IdentityCodec(Codec):
    """``none``: float32 as is, one frame of ``numel`` float32. Exact: decode(encode(x))
    equals x bit for bit. The decoded tensor is a view of the frame (no copy)."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    def wire_params(self, shape: tuple[int, ...]) -> dict[str, ParamValue]:
        return {}

    def _layout(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> FrameLayout:
        expect_params(self.name, params, {})
        return [(torch.float32, numel(shape))]

    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        require_finite(self.name, x)
        return Encoded(codec=self.name, shape=tuple(x.shape), params={}, frames=(owned_flat(x),))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.frames[0].view(enc.shape)

    def error_bound(self, x: torch.Tensor) -> float:
        """0: the codec is exact."""
        require_finite(self.name, x)
        return 0.0


@dataclass(frozen=True, kw_only=True)
class BF16Codec(Codec):
    """``bf16``: one frame of ``numel`` bfloat16 (torch's round to nearest even).

    Exact for values already representable in bfloat16. Magnitudes >= ``BF16_LIMIT``
    would become Inf and are refused like NaN/Inf input (CodecError).
    """

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    fresh_decode: ClassVar[bool] = True

    def wire_params(self, shape: tuple[int, ...]) -> dict[str, ParamValue]:
        return {}

    def _layout(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> FrameLayout:
        expect_params(self.name, params, {})
        return [(torch.bfloat16, numel(shape))]

    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        require_finite(self.name, x, BF16_LIMIT)
        frame = x.contiguous().view(-1).to(torch.bfloat16)
        return Encoded(codec=self.name, shape=tuple(x.shape), params={}, frames=(frame,))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.frames[0].to(torch.float32).view(enc.shape)

    def error_bound(self, x: torch.Tensor) -> float:
        """``max|x| * 2**-8 + 2**-134``: bfloat16 keeps 8 significant bits, so round to
        nearest errs by at most 2**-8 relative; 2**-134 is half the smallest bfloat16
        subnormal, the absolute floor for values near zero."""
        require_finite(self.name, x, BF16_LIMIT)
        if x.numel() == 0:
            return 0.0
        return float(x.abs().max()) * 2.0**-8 + 2.0**-134


_CPU_CHUNK = 1 << 18
"""Elements per chunk on the CPU (1 MB of float32 scratch, cache-resident). Each
codec step is a handful of whole-tensor ops; running them chunk by chunk through one
small buffer instead of a fresh 64 MB temporary is 3-4x faster on the CPU, where
every large allocation is page-faulted in anew. On CUDA the caching allocator makes
temporaries cheap and launches are the cost, so the whole region is one chunk."""


def _block_absmax(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """max |x| per block (full blocks, then the partial tail block); NaN propagates.

    ``amax`` and ``amin`` over the block dim are each ~10x faster than ``aminmax``
    with ``dim`` on the CPU (and than ``abs().amax()``, which needs a temporary).
    """
    n = flat.numel()
    full, cut = n // block_size, (n // block_size) * block_size
    out = flat.new_empty(-(-n // block_size))
    if full:
        blocks = flat[:cut].view(full, block_size)
        torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_(), out=out[:full])
    if cut < n:
        lo, hi = torch.aminmax(flat[cut:])
        out[full] = torch.maximum(hi, lo.neg())
    return out


def _chunks(n: int, block_size: int, unit: int, device: torch.device) -> tuple[list[tuple[int, int]], int]:
    """(start, stop) chunks covering [0, main) in whole ``unit``s (a multiple of the
    block size), and ``main``; the tail [main, n) is shorter than one unit."""
    main = (n // unit) * unit
    step = _chunk_step(n, unit, device)
    return [(s, min(s + step, main)) for s in range(0, main, step)], main


def _chunk_step(n: int, unit: int, device: torch.device, chunk: int = _CPU_CHUNK) -> int:
    """Length of ``_chunks``' chunks (the last may be shorter): about ``chunk`` on the CPU."""
    return max(unit, (chunk // unit) * unit) if device.type == "cpu" else max((n // unit) * unit, unit)


_DECODE_CHUNK = 1 << 20
"""Elements per chunk of a decode on the CPU, and per job of ``decode_parts``. Decoding
is half a dozen cheap ops per chunk, each with a fixed cost per call that weighs on
``_CPU_CHUNK``-sized chunks; at 1M elements (4 MB of float32 out, in L3) it does not,
and a 64 MB fragment still makes 16 jobs for a pool's workers to share."""


def _tail_index(start: int, n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Block index of each element in the tail [start, n) (fewer than two blocks)."""
    return torch.arange(start, n, device=device) // block_size


class _BlockQuantCodec(Codec):
    """Shared body of int8 and int4 (see the module docstring for the scheme).

    Scales are float32, one per block (4 bytes per block on the wire). A block whose
    scale would be below the smallest normal float32 (absmax < qmax * 2**-126, i.e.
    ~1e-36 for int8: far below anything a gradient carries) is sent with scale 0 and
    decodes to zeros; this also makes all-zero blocks exact and never NaN.
    """

    fresh_decode: ClassVar[bool] = True
    qmax: ClassVar[int]
    q_dtype: ClassVar[torch.dtype]
    unit: ClassVar[int]
    """Elements per packed byte group: chunks start at multiples of block_size * unit."""
    block_size: int

    def __post_init__(self) -> None:
        int_in_range(self.name, "block_size", self.block_size, 1, MAX_BLOCK_SIZE)

    # -- layout ---------------------------------------------------------------------
    @classmethod
    def _q_numel(cls, n: int) -> int:
        raise NotImplementedError

    def wire_params(self, shape: tuple[int, ...]) -> dict[str, ParamValue]:
        return {"block_size": self.block_size}

    def _layout(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> FrameLayout:
        expect_params(self.name, params, {"block_size": int})
        bs = int_in_range(self.name, "block_size", params["block_size"], 1, MAX_BLOCK_SIZE)
        n = numel(shape)
        return [(torch.float32, -(-n // bs)), (self.q_dtype, self._q_numel(n))]

    def _check_frame_values(self, enc: Encoded) -> None:
        scales = enc.frames[0]
        if scales.numel():
            lo, hi = torch.aminmax(scales)
            if not (math.isfinite(float(hi)) and float(lo) >= 0.0):
                raise CodecError(f"{self.name}: scales must be finite and >= 0, got range [{float(lo)}, {float(hi)}]")

    # -- maths ----------------------------------------------------------------------
    def _scales(self, flat: torch.Tensor, block_size: int) -> torch.Tensor:
        absmax = _block_absmax(flat, block_size)
        if not bool(torch.isfinite(absmax).all()):
            bad = int((~torch.isfinite(absmax)).sum())
            raise CodecError(
                f"{self.name}: input has NaN or Inf values (in {bad} block(s)); "
                "the syncer rejects them, so they are refused here"
            )
        # A tensor divisor, not a Python number: CUDA divides by a scalar as a multiply by
        # its reciprocal (an ulp off at times), the CPU divides; elementwise both divide
        # exactly, so a device encodes the same bits as the host.
        scale = absmax / torch.full_like(absmax, float(self.qmax))
        return torch.where(scale >= _TINY, scale, 0.0)

    def _levels(self, flat: torch.Tensor, scale: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (start, levels) with levels = clamp(round(x * (1/s)), -qmax, qmax) as
        float32, chunk by chunk; a chunk's buffer is reused once the next is asked for."""
        bs, n, dev = self.block_size, flat.numel(), flat.device
        inv = torch.where(scale > 0, scale.reciprocal(), 0.0)
        chunks, main = _chunks(n, bs, bs * self.unit, dev)
        buf = torch.empty(chunks[0][1] if chunks else 0, dtype=torch.float32, device=dev)
        for s, e in chunks:
            b = buf[: e - s]
            torch.mul(flat[s:e].view(-1, bs), inv[s // bs : e // bs, None], out=b.view(-1, bs))
            yield s, b.round_().clamp_(-self.qmax, self.qmax)
        if main < n:
            tail = flat[main:] * inv[_tail_index(main, n, bs, dev)]
            yield main, tail.round_().clamp_(-self.qmax, self.qmax)

    def _chunk_levels(self, enc: Encoded, start: int, stop: int) -> torch.Tensor:
        """The int8 levels of elements [start, stop) (``start`` a multiple of the unit),
        in any memory until the next call on this thread."""
        raise NotImplementedError

    def decode_parts(self, enc: Encoded) -> tuple[torch.Tensor, list[Callable[[], None]]]:
        self._check_encoded(enc)
        return self._parts(enc)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        out, jobs = self._parts(enc)
        for job in jobs:
            job()
        return out

    def _parts(self, enc: Encoded) -> tuple[torch.Tensor, list[Callable[[], None]]]:
        """The output and the jobs that fill it, one chunk each, the partial tail block
        with the last (on CUDA one job: the whole tensor is one chunk)."""
        n, dev = numel(enc.shape), enc.frames[0].device
        out = empty_float32(n, dev)  # the memory of an earlier decode, where none holds it
        unit = int(enc.params["block_size"]) * self.unit
        main, step = (n // unit) * unit, _chunk_step(n, unit, dev, _DECODE_CHUNK)
        starts = list(range(0, main, step)) if main else [0] if n else []  # [0]: a tail alone
        stops = starts[1:] + [n]
        jobs = [partial(self.dequantize_range, enc, lo, hi, out[lo:hi]) for lo, hi in zip(starts, stops)]
        return out.view(enc.shape), jobs

    def dequantize_range(self, enc: Encoded, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Elements [start, stop) of ``enc``'s decoded value (flat), written to the first
        ``stop - start`` elements of ``out`` (float32, on the frames' device) and returned:
        the same bits as ``decode(enc).view(-1)[start:stop]``, without the whole tensor, so
        a consumer can decode chunk by chunk into memory it reuses. ``start`` is a multiple
        of ``block_size`` times the elements per packed unit (2 for int4); ``stop`` either
        is too or is the tensor's end. ``enc`` must have been checked (``from_wire`` does)."""
        scale, bs, n = enc.frames[0], int(enc.params["block_size"]), numel(enc.shape)
        unit = bs * self.unit
        if not (0 <= start <= stop <= n and start % unit == 0 and (stop % unit == 0 or stop == n)):
            raise ValueError(f"{self.name}: range [{start}, {stop}) of {n} elements does not start and end on "
                             f"whole units of {unit} elements (or at the end)")
        main = min(stop, (n // unit) * unit)
        o = out[: stop - start]
        if start < main:
            body = o[: main - start]
            body.copy_(self._chunk_levels(enc, start, main))
            body.view(-1, bs).mul_(scale[start // bs : main // bs, None])
        if main < stop:
            tail = o[main - start :]
            tail.copy_(self._chunk_levels(enc, main, stop))
            tail.mul_(scale[_tail_index(main, stop, bs, out.device)])
        return o

    def error_bound(self, x: torch.Tensor) -> float:
        """``max_b s_b * (1/2 + qmax * 2**-21) + qmax * 2**-126``, s_b = absmax_b / qmax.

        Per element the error is at most half its *own block's* step s_b (rounding to
        the nearest level); the 2**-21 term covers float32 rounding of the reciprocal
        and the two products, the last term the blocks flushed to zero. This returns
        the max over blocks; a block's own elements satisfy the same formula with
        its own s_b (the tests check both).
        """
        flat = x.detach().contiguous().view(-1)
        if flat.numel() == 0:
            return 0.0
        scale = self._scales(flat, self.block_size)
        return float(scale.max()) * (0.5 + self.qmax * _REL_SLACK) + self.qmax * _TINY


@dataclass(frozen=True, kw_only=True)
class Int8Codec(_BlockQuantCodec):
    """``int8``: block-wise absmax, qmax 127. Frames: scales (float32, one per block),
    values (int8, one per element). Default block 256: 1.6 % scale overhead, ratio
    4 / (1 + 4/256) = 3.94 vs fp32, error <= absmax/254 of each block."""

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 2
    lossless: ClassVar[bool] = False
    qmax: ClassVar[int] = 127
    q_dtype: ClassVar[torch.dtype] = torch.int8
    unit: ClassVar[int] = 1

    block_size: int = 256
    """Elements per scale (1..65536); the last block may be partial."""

    @classmethod
    def _q_numel(cls, n: int) -> int:
        return n

    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        flat = x.contiguous().view(-1)
        scale = self._scales(flat, self.block_size)
        q = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
        for s, levels in self._levels(flat, scale):
            q[s : s + levels.numel()].copy_(levels)
        return Encoded(codec=self.name, shape=tuple(x.shape), params=self.wire_params(tuple(x.shape)),
                       frames=(scale, q))

    def _chunk_levels(self, enc: Encoded, start: int, stop: int) -> torch.Tensor:
        return enc.frames[1][start:stop]


@dataclass(frozen=True, kw_only=True)
class Int4Codec(_BlockQuantCodec):
    """``int4``: block-wise absmax, symmetric qmax 7, two values per byte. Frames:
    scales (float32, one per block), packed (uint8, ceil(numel/2)). Default block 64:
    ratio 8 / (1 + 8/64) = 7.11 vs fp32, error <= absmax/14 of each block."""

    name: ClassVar[str] = "int4"
    codec_id: ClassVar[int] = 3
    lossless: ClassVar[bool] = False
    qmax: ClassVar[int] = 7
    q_dtype: ClassVar[torch.dtype] = torch.uint8
    unit: ClassVar[int] = 2

    block_size: int = 64
    """Elements per scale (1..65536); the last block may be partial."""

    @classmethod
    def _q_numel(cls, n: int) -> int:
        return (n + 1) // 2

    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        flat = x.contiguous().view(-1)
        n = flat.numel()
        scale = self._scales(flat, self.block_size)
        packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=flat.device)
        nibbles: torch.Tensor | None = None
        for s, levels in self._levels(flat, scale):  # s is even: chunks cover whole byte pairs
            k = levels.numel()
            if k & 1:  # only the tail of an odd-length tensor: the spare nibble is 0
                levels = torch.cat([levels, levels.new_full((1,), -8.0)])
                k += 1
            if nibbles is None or nibbles.numel() < k:
                nibbles = torch.empty(k, dtype=torch.uint8, device=flat.device)
            u = nibbles[:k]
            u.copy_(levels.add_(8.0))
            torch.bitwise_left_shift(u[1::2], 4, out=packed[s // 2 : (s + k) // 2]).bitwise_or_(u[0::2])
        return Encoded(codec=self.name, shape=tuple(x.shape), params=self.wire_params(tuple(x.shape)),
                       frames=(scale, packed))

    def _chunk_levels(self, enc: Encoded, start: int, stop: int) -> torch.Tensor:
        # Byte b = hi << 4 | lo, widened to int16 and spread to lo | hi << 8, is the byte
        # pair (lo, hi) in memory: elements 2i and 2i + 1 in order, in four contiguous
        # ops over 2-byte words instead of two strided ones over bytes (the slow part).
        # Little-endian, as the wire's frames are (and are read) throughout.
        p = enc.frames[1][start // 2 : (stop + 1) // 2]
        dev = p.device
        wide = scratch("int4_wide", p.numel(), torch.int16, dev)
        pairs = scratch("int4_pairs", p.numel(), torch.int16, dev)
        wide.copy_(p)
        torch.bitwise_left_shift(wide, 4, out=pairs).bitwise_or_(wide).bitwise_and_(0x0F0F)
        return pairs.view(torch.int8)[: stop - start].sub_(8)  # nibble 0 (never sent) decodes to -8
