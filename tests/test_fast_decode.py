"""The int8/int4 decode (chunked, int4 nibbles spread in 16-bit words, cut into jobs for
a pool, into recycled buffers) gives the bits of the straightforward decode written
here; a decode with the nibbles swapped does not; recycled buffers are never handed out
while anything still holds them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from rackmend import buffers
from rackmend.codecs import Encoded, make_codec
from rackmend.codecs.quant import _DECODE_CHUNK
from rackmend.core import Contribution, FragmentSpec, TensorSpec
from rackmend.transport import wire

TINY = torch.finfo(torch.float32).tiny
BIG = torch.finfo(torch.float32).max


def plain_decode(enc: Encoded, swap_nibbles: bool = False) -> torch.Tensor:
    """level x scale of its block, one element at a time in spirit: int4 element 2i is
    byte i's low nibble, 2i + 1 its high one, each minus 8."""
    scale, q = enc.frames
    n, bs = int(np.prod(enc.shape)), int(enc.params["block_size"])
    if enc.codec == "int4":
        lo, hi = (q & 15).to(torch.int32), (q >> 4).to(torch.int32)
        if swap_nibbles:
            lo, hi = hi, lo
        levels = torch.stack([lo, hi], dim=1).reshape(-1)[:n] - 8
    else:
        levels = q.to(torch.int32)
    per_element = scale.repeat_interleave(bs)[:n]
    return (levels.to(torch.float32) * per_element).view(enc.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


def cases() -> list[tuple[str, int, int, str]]:
    """(codec, block size, numel, content): odd sizes, a partial tail block, a tail alone,
    several decode jobs, the largest block."""
    out = []
    for codec in ("int4", "int8"):
        for bs in (1, 7, 64, 256, 65536):
            for n in (0, 1, 2, 63, 65, 1001, 2 * _DECODE_CHUNK + 129, 3 * _DECODE_CHUNK)[: 8 if bs in (7, 65536) else 6]:
                out.append((codec, bs, n, "randn"))
        for content in ("zeros", "extremes", "raw"):
            out.append((codec, 64, 2 * _DECODE_CHUNK + 77, content))
            out.append((codec, 3, 1001, content))
    return out


def encoded(codec: str, bs: int, n: int, content: str, seed: int) -> Encoded:
    g = torch.Generator().manual_seed(seed)
    c = make_codec(codec, block_size=bs)
    if content == "zeros":
        return c.encode(torch.zeros(n))
    if content == "extremes":  # huge, tiny (flushed to scale 0), subnormal and signed values side by side
        pick = torch.tensor([BIG, -BIG, TINY, -TINY * 0.5, 1e-40, 0.0, 1.0, -3.0e38])
        return c.encode(pick[torch.randint(0, len(pick), (n,), generator=g)])
    if content == "raw":  # any bytes a sender may put on the wire, nibble 0 included
        enc = c.encode(torch.zeros(n))
        scale, q = enc.frames
        scale = torch.rand(scale.numel(), generator=g) * torch.tensor([0.0, 1e-38, 1.0, 3e37])[
            torch.randint(0, 4, (scale.numel(),), generator=g)]
        q = torch.randint(-128 if codec == "int8" else 0, 128 if codec == "int8" else 256, (q.numel(),),
                          generator=g, dtype=torch.int32).to(q.dtype)
        return Encoded(codec=codec, shape=enc.shape, params=enc.params, frames=(scale, q))
    x = torch.randn(n, generator=g) * torch.logspace(-20, 20, 7)[torch.randint(0, 7, (n,), generator=g)]
    return c.encode(x)


@pytest.mark.parametrize("codec,bs,n,content", cases())
def test_decode_gives_the_bits_of_the_plain_decode(codec: str, bs: int, n: int, content: str) -> None:
    enc = encoded(codec, bs, n, content, seed=n + bs)
    want = plain_decode(enc)
    c = make_codec(codec)
    assert same_bits(c.decode(enc), want)
    out, jobs = c.decode_parts(enc)
    assert len(jobs) >= 2 if n >= 2 * _DECODE_CHUNK else len(jobs) == (n > 0)
    for job in reversed(jobs):  # any order
        job()
    assert same_bits(out, want)
    packed = enc.frames[1]
    if codec == "int4" and bool(((packed & 15) != (packed >> 4)).any()):  # not all pairs alike
        # The comparison sees a decoder that reads the nibbles the other way round.
        assert not same_bits(plain_decode(enc, swap_nibbles=True), want)
        swapped = Encoded(codec=codec, shape=enc.shape, params=enc.params,
                          frames=(enc.frames[0], (packed << 4) | (packed >> 4)))
        assert not same_bits(c.decode(swapped), want)
    else:
        assert codec == "int8" or content == "zeros" or n < 1001 or bs == 1, "the swap check must run here"


@pytest.mark.parametrize("codec,bs,n,content", [c for c in cases() if c[3] in ("randn", "raw")])
def test_a_range_decoded_alone_has_the_bits_of_the_whole_decode(codec: str, bs: int, n: int, content: str) -> None:
    """``dequantize_range`` into one reused buffer, range by range (the last one with the
    partial tail), gives the whole decode's bits; a range not on whole units is refused."""
    enc = encoded(codec, bs, n, content, seed=n + 3 * bs)
    want = plain_decode(enc).view(-1)
    c = make_codec(codec)
    unit = bs * (2 if codec == "int4" else 1)
    step = max(unit, (1000 // unit) * unit)
    buf = torch.full((step,), float("nan"))
    got = torch.cat([c.dequantize_range(enc, lo, min(n, lo + step), buf).clone() for lo in range(0, n, step)]) \
        if n else torch.empty(0)
    assert same_bits(got, want)
    if n > unit > 1:
        with pytest.raises(ValueError, match="whole units"):
            c.dequantize_range(enc, 1, unit, buf)


def test_jobs_on_a_pool_and_parse_contribution_give_the_same_bits() -> None:
    n = 2 * _DECODE_CHUNK + 333
    spec = FragmentSpec(0, 0, (TensorSpec("a", (n,), torch.float32), TensorSpec("b", (3, 5), torch.float32),
                               TensorSpec("c", (_DECODE_CHUNK // 2 + 1,), torch.float32)))
    g = torch.Generator().manual_seed(3)
    values = tuple(torch.randn(s.shape, generator=g) for s in spec.tensors)
    for codec in ("int4", "int8", "bf16", "powersgd"):
        enc = tuple(make_codec(codec).encode(v) for v in values)
        c = Contribution("l0", 0, 0, 4, 4, 100.0, 0.1, values, encoded=enc, session=1, seq=1)
        frames = [bytes(f) if isinstance(f, (bytes, memoryview)) else f for f in wire.contribution_frames(c, 0)]
        want = [make_codec(codec).decode(e) for e in enc]
        for workers in (None, 1, 3):
            pool = ThreadPoolExecutor(workers) if workers else None
            try:
                got = wire.parse_contribution(wire.decode_header(frames, wire.SYNCER_RECEIVES, 1 << 30), [spec], pool)
            finally:
                if pool is not None:
                    pool.shutdown()
            assert all(same_bits(a, b) for a, b in zip(got.tensors, want)), (codec, workers)
            if codec in ("int4", "int8"):
                assert all(same_bits(a, plain_decode(e)) for a, e in zip(got.tensors, enc))
        # Checked on arrival but not decoded: the same frames, decoded later, the same bits.
        codec_got, received = wire.parse_encoded_frames(wire.decode_header(frames, wire.SYNCER_RECEIVES, 1 << 30),
                                                        spec)
        assert codec_got.name == codec and all(same_bits(codec_got.decode(e), w) for e, w in zip(received, want))
    plain = Contribution("l0", 0, 0, 4, 4, 100.0, 0.1, values, session=1, seq=1)
    with pytest.raises(wire.WireError, match="plain tensors"):
        wire.parse_encoded_frames(wire.decode_header(wire.contribution_frames(plain, 0), wire.SYNCER_RECEIVES,
                                                     1 << 30), spec)


@pytest.mark.skipif(buffers._idle is None, reason="this torch counts storage references differently: no recycling")
def test_a_buffer_is_reused_only_when_nothing_holds_it() -> None:
    cpu, n = torch.device("cpu"), 12345  # a size no other test asks for
    holders = {
        "the tensor": lambda t: t,
        "a view": lambda t: t.view(3, -1)[1:],
        "a flat view": lambda t: t.reshape(-1),
        "a numpy array": lambda t: t.numpy(),
        "a memoryview": lambda t: memoryview(t.numpy()),
        "the storage": lambda t: t.untyped_storage(),
    }
    for what, hold in holders.items():
        t = buffers.empty_float32(n, cpu)
        ptr = t.data_ptr()
        held = hold(t)
        del t
        other = buffers.empty_float32(n, cpu)
        assert other.data_ptr() != ptr, f"handed out again while {what} is held"
        del other, held
        again = [buffers.empty_float32(n, cpu) for _ in range(2)]  # both idle now: the two come back
        assert ptr in {a.data_ptr() for a in again}, f"not reused once {what} was dropped"
        del again


@pytest.mark.skipif(buffers._idle is None, reason="this torch counts storage references differently: no recycling")
def test_each_snapshot_copies_into_a_buffer_no_earlier_update_still_holds() -> None:
    """The value sent after each merge is a copy in a kept buffer: an ``Update`` a
    learner (or the outbox) still holds keeps its values; once dropped, its memory
    serves a later snapshot."""
    from rackmend.config import SyncerConfig
    from rackmend.core.syncer_fragment import SyncerFragment

    spec = FragmentSpec(0, 0, (TensorSpec("w", (23456,), torch.float32),))  # a size no other test asks for
    frag = SyncerFragment(0, spec, [torch.zeros(23456)], SyncerConfig().build_outer_optimizer, 1, keep_history=False)
    held = frag.snapshot()
    ptr = held.tensors[0].data_ptr()
    assert ptr in {b.data_ptr() for b in buffers._kept.get(23456, [])}, "not a kept buffer"
    frag.theta[0].fill_(2.0)
    second = frag.snapshot()
    assert second.tensors[0].data_ptr() != ptr and torch.equal(held.tensors[0], torch.zeros(23456))
    del held
    frag.theta[0].fill_(3.0)
    third = frag.snapshot()
    assert third.tensors[0].data_ptr() == ptr and torch.equal(third.tensors[0], torch.full((23456,), 3.0))
    assert torch.equal(second.tensors[0], torch.full((23456,), 2.0))
