"""The codec contract: what an encoded tensor is and what every codec must do.

An :class:`Encoded` is a codec name, the original shape, a few small parameters
and one or more flat *frames* whose raw bytes are what travels. The wire format
(header, framing, msgpack) lives elsewhere; this module only promises that a
receiver holding ``(codec, shape, params)`` and the frame bytes can rebuild the
exact same :class:`Encoded` with :meth:`Codec.from_wire`, after checking that the
bytes have precisely the length the parameters imply. Nothing is unpickled.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

__all__ = [
    "CodecError",
    "Encoded",
    "Codec",
    "FrameLayout",
    "ParamValue",
    "MAX_NDIM",
]

ParamValue = int | float | str
"""Types allowed as codec parameter values (all msgpack-native)."""

FrameLayout = list[tuple[torch.dtype, int]]
"""(dtype, numel) of each frame, in order."""

MAX_NDIM = 64
"""Shapes with more dimensions than this are rejected (torch itself stops at 64)."""


class CodecError(ValueError):
    """Bad codec parameters, a tensor a codec cannot encode, or frames that do not
    match their header. The message names what is wrong and what was expected."""


@dataclass(frozen=True, eq=False)
class Encoded:
    """One tensor after encoding: everything a receiver needs to decode it.

    ``eq=False`` because frames are tensors, for which field-wise ``==`` is ambiguous;
    compare frames with ``torch.equal``.
    """

    codec: str
    """Name of the codec that produced it (a key of ``rackmend.codecs.CODECS``)."""
    shape: tuple[int, ...]
    """Shape of the original tensor (``()`` for a 0-d tensor)."""
    params: dict[str, ParamValue]
    """Small parameters the decoder needs (block size, rank, mode); msgpack-serialisable."""
    frames: tuple[torch.Tensor, ...]
    """Contiguous 1-D tensors whose raw bytes go on the wire, in order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", check_shape(self.shape))
        object.__setattr__(self, "frames", tuple(self.frames))
        for i, f in enumerate(self.frames):
            if not isinstance(f, torch.Tensor) or f.ndim != 1 or not f.is_contiguous():
                raise CodecError(f"{self.codec}: frame {i} must be a contiguous 1-D tensor")

    def nbytes(self) -> int:
        """Bytes on the wire for the frames (the header is not counted)."""
        return sum(f.numel() * f.element_size() for f in self.frames)


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or CodecError saying why not."""
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise CodecError(f"shape must be a tuple of ints, got {type(shape).__name__}")
    if len(shape) > MAX_NDIM:
        raise CodecError(f"shape has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise CodecError(f"shape {tuple(shape)!r} must hold non-negative ints only")
    return tuple(shape)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def expect_params(codec: str, params: Any, spec: Mapping[str, type]) -> None:
    """Check that ``params`` has exactly the keys of ``spec``, each of that type.

    ``bool`` is refused where ``int`` is asked (it is an int subclass in Python, but
    ``True`` as a block size is a bug, not a value).
    """
    if not isinstance(params, Mapping):
        raise CodecError(f"{codec}: params must be a dict, got {type(params).__name__}")
    keys, want = set(params), set(spec)
    if keys != want:
        unknown, missing = sorted(map(str, keys - want)), sorted(want - keys)
        parts = ([f"unknown {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
        expected = sorted(want) if want else "no params"
        raise CodecError(f"{codec}: params {', '.join(parts)}; expected {expected}")
    for key, typ in spec.items():
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, typ):
            raise CodecError(f"{codec}: param {key}={value!r} must be {typ.__name__}")


def int_in_range(codec: str, key: str, value: Any, lo: int, hi: int) -> int:
    """``value`` if it is an int (not bool) in [lo, hi], else CodecError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecError(f"{codec}: {key}={value!r} must be an int")
    if not lo <= value <= hi:
        raise CodecError(f"{codec}: {key}={value} is out of range; use {lo} <= {key} <= {hi}")
    return value


def require_finite(codec: str, x: torch.Tensor, limit: float = math.inf) -> None:
    """Raise CodecError unless every element of ``x`` is finite and ``|x| < limit``.

    A whole-tensor ``aminmax`` is one cheap pass (over 10x faster than
    ``isfinite(x).all()`` on the CPU, which materialises a bool tensor) and NaN
    propagates through it, so a finite min and max mean every element is finite.
    """
    if x.numel() == 0:
        return
    lo, hi = torch.aminmax(x.reshape(-1))
    lo_f, hi_f = float(lo), float(hi)
    if not (math.isfinite(lo_f) and math.isfinite(hi_f)):
        raise CodecError(f"{codec}: input has NaN or Inf values; the syncer rejects them, so they are refused here")
    if max(-lo_f, hi_f) >= limit:
        big = max(-lo_f, hi_f)
        raise CodecError(f"{codec}: input magnitude {big:.4g} is beyond this codec's range (< {limit:.4g})")


def owned_flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened into contiguous memory that does not alias ``x`` (one copy)."""
    c = x.contiguous()
    return c.view(-1).clone() if c is x else c.view(-1)


class Codec(ABC):
    """A way to turn a float32 tensor into frames and back.

    Subclasses are frozen kw-only dataclasses whose fields are the *encoder's*
    settings (block size, rank). Encoded data is self-describing: ``decode`` and
    ``from_wire`` use the parameters carried in the :class:`Encoded`, so a receiver
    needs only the codec name, not the sender's configuration.

    Contract for every codec:
    - ``encode`` accepts float32 of any shape (0-d, empty, one element included), on
      CPU or CUDA, and leaves its frames on ``x``'s device; frames never alias ``x``.
    - NaN or Inf in the input raises :class:`CodecError` (the syncer rejects
      non-finite contributions anyway; refusing early gives a clearer error).
    - ``decode`` returns float32 of ``enc.shape`` on the frames' device.
    - ``max |decode(encode(x)) - x| <= error_bound(x)`` (see each codec).
    """

    name: ClassVar[str]
    """Codec name used in configs and headers."""
    codec_id: ClassVar[int]
    """Stable small integer for compact headers: none=0, bf16=1, int8=2, int4=3, powersgd=4."""
    lossless: ClassVar[bool]
    """True when decode(encode(x)) == x always; error feedback keeps no residual then."""
    fresh_decode: ClassVar[bool] = False
    """True when ``decode`` only reads the frames and returns new memory, so received
    frames may be decoded where they lie (``from_wire(copy=False)``)."""

    # -- what subclasses implement ------------------------------------------------
    @abstractmethod
    def wire_params(self, shape: tuple[int, ...]) -> dict[str, ParamValue]:
        """The params ``encode`` emits for a tensor of ``shape``."""

    @abstractmethod
    def _layout(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> FrameLayout:
        """Validate params for ``shape`` (raise CodecError) and return the layout."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, state: dict[str, Any] | None) -> Encoded:
        """Encode a float32 tensor already known to be a tensor of the right dtype."""

    @abstractmethod
    def _decode(self, enc: Encoded) -> torch.Tensor:
        """Decode frames already checked against the layout."""

    @abstractmethod
    def error_bound(self, x: torch.Tensor) -> float:
        """Bound on ``max |decode(encode(x)) - x|`` for this ``x`` (documented per codec)."""

    def _check_frame_values(self, enc: Encoded) -> None:
        """Cheap checks on received values (e.g. scales); default: none."""

    # -- the shared contract ---------------------------------------------------------
    def encode(self, x: torch.Tensor, state: dict[str, Any] | None = None) -> Encoded:
        """Encode ``x`` (float32, any shape). ``state`` is a mutable dict owned by the
        caller, one per (learner, fragment, tensor); codecs that keep memory between
        calls (PowerSGD's warm-start Q) read and write it, the others ignore it."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise CodecError(f"{self.name}: expected float32, got {x.dtype}; cast before encoding")
        return self._encode(x.detach(), state)

    def decode(self, enc: Encoded) -> torch.Tensor:
        """float32 tensor of ``enc.shape`` on the frames' device."""
        self._check_encoded(enc)
        return self._decode(enc)

    def decode_parts(self, enc: Encoded) -> tuple[torch.Tensor, list[Callable[[], None]]] | None:
        """``decode`` cut into parts: (the output, allocated here and now, and jobs that
        fill disjoint ranges of it, to run in any order or at the same time on other
        threads; once all have run it holds ``decode(enc)``'s bits). None (the default)
        for a codec that decodes whole tensors only. The checks run here, so the jobs
        raise nothing. Allocating on the caller's thread matters on the CPU: glibc serves
        a worker thread's large blocks from fresh mmaps, each page faulted in anew."""
        return None

    def _check_encoded(self, enc: Encoded) -> None:
        """CodecError unless ``enc`` is this codec's, with frames matching its layout."""
        if enc.codec != self.name:
            raise CodecError(f"{self.name}: cannot decode data encoded by {enc.codec!r}")
        layout = self.frame_layout(enc.shape, enc.params)
        if len(enc.frames) != len(layout):
            raise CodecError(f"{self.name}: {len(enc.frames)} frames, expected {len(layout)}")
        for i, (f, (dtype, n)) in enumerate(zip(enc.frames, layout)):
            if f.dtype != dtype or f.numel() != n:
                raise CodecError(f"{self.name}: frame {i} is {f.numel()} x {f.dtype}, expected {n} x {dtype}")
        if len({f.device for f in enc.frames}) > 1:
            raise CodecError(f"{self.name}: frames are on different devices")

    def frame_layout(self, shape: Sequence[int], params: Mapping[str, Any]) -> FrameLayout:
        """Expected (dtype, numel) of each frame for ``shape`` and ``params``;
        CodecError for invalid params (unknown keys, wrong types, out-of-range values)."""
        return self._layout(check_shape(shape), params)

    def from_wire(
        self, shape: Sequence[int], params: Mapping[str, Any], buffers: Sequence[bytes | bytearray | memoryview],
        copy: bool = True,
    ) -> Encoded:
        """Rebuild an :class:`Encoded` from received bytes, after checking them.

        Each buffer's byte length must equal its frame's layout exactly; the bytes are
        reinterpreted with ``torch.frombuffer``, on the CPU. They are copied, so the
        result is writable and independent of the receive buffer, unless ``copy`` is
        False and the codec's decode only reads them (``fresh_decode``): then the frames
        are the buffers themselves (which the caller must leave unchanged while the
        result lives), saving a copy of every byte received.
        """
        shape_t = check_shape(shape)
        layout = self._layout(shape_t, params)
        buffers = list(buffers)
        if len(buffers) != len(layout):
            raise CodecError(
                f"{self.name}: got {len(buffers)} frame buffers, expected {len(layout)} for params {dict(params)}"
            )
        frames = []
        for i, (buf, (dtype, n)) in enumerate(zip(buffers, layout)):
            try:
                view = memoryview(buf)
            except TypeError:
                raise CodecError(f"{self.name}: frame {i} is a {type(buf).__name__}, not a bytes-like object") from None
            want = n * dtype.itemsize
            if view.nbytes != want:
                raise CodecError(
                    f"{self.name}: frame {i} has {view.nbytes} bytes, expected {want} "
                    f"({n} x {dtype}) for shape {shape_t} and params {dict(params)}"
                )
            if not n:
                frames.append(torch.empty(0, dtype=dtype))
            elif copy or not self.fresh_decode:
                frames.append(torch.frombuffer(bytearray(view), dtype=dtype))
            else:
                with warnings.catch_warnings():  # a read-only buffer is fine: decode only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    frames.append(torch.frombuffer(view, dtype=dtype))
        enc = Encoded(codec=self.name, shape=shape_t, params=dict(params), frames=tuple(frames))
        self._check_frame_values(enc)
        return enc

    def expected_ratio(self, shape: Sequence[int]) -> float:
        """fp32 bytes / encoded frame bytes for a tensor of ``shape`` (1.0 when empty)."""
        shape_t = check_shape(shape)
        encoded = sum(n * dtype.itemsize for dtype, n in self._layout(shape_t, self.wire_params(shape_t)))
        return 4.0 * numel(shape_t) / encoded if encoded else 1.0
