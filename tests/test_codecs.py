"""Codecs and error feedback: bounds on awkward sizes, exact wire layouts, rejection of
bad frames, PowerSGD warm start, and error feedback keeping the running sum honest."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Iterator

import pytest
import torch

from rackmend.codecs import (
    CODECS,
    MAX_BLOCK_SIZE,
    Codec,
    CodecError,
    Encoded,
    ErrorFeedback,
    make_codec,
)
from rackmend.codecs.quant import BF16_LIMIT

TINY = torch.finfo(torch.float32).tiny

CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int8", {"block_size": 100}),
    ("int4", {}),
    ("int4", {"block_size": 7}),
    ("powersgd", {}),
    ("powersgd", {"rank": 1}),
]
SHAPES: list[tuple[int, ...]] = [(0,), (), (1,), (63,), (65,), (1000003,), (33, 17), (257, 129), (0, 5), (4, 3, 5)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, params = case
    return name + "".join(f"-{k}{v}" for k, v in params.items())


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a 1-D tensor (numpy is not a dependency)."""
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def wire(enc: Encoded) -> list[bytes]:
    """The frames' raw bytes, as a transport would send them."""
    return [tensor_bytes(f) for f in enc.frames]


def per_element_bound(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Each element's own bound for block codecs: half its block's step, plus slack."""
    bs, qmax = codec.block_size, codec.qmax  # type: ignore[attr-defined]
    flat = x.reshape(-1)
    n = flat.numel()
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs)
    padded[:n] = flat.abs()
    s = padded.view(nb, bs).amax(dim=1) / qmax
    s = torch.where(s >= TINY, s, 0.0)
    return (s * (0.5 + qmax * 2.0**-21) + qmax * TINY).repeat_interleave(bs)[:n]


# -- round trips on awkward sizes ------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_round_trip_within_bound(case: tuple[str, dict[str, Any]], shape: tuple[int, ...]) -> None:
    codec = make_codec(case[0], **case[1])
    g = torch.Generator().manual_seed(len(shape) * 1000 + math.prod(shape) % 997)
    x = torch.randn(shape, generator=g) * 3.0
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert enc.shape == shape and enc.codec == codec.name
    assert all(f.ndim == 1 and f.is_contiguous() for f in enc.frames)
    layout = codec.frame_layout(shape, enc.params)
    assert [(f.dtype, f.numel()) for f in enc.frames] == layout
    assert enc.nbytes() == sum(n * dt.itemsize for dt, n in layout)
    err = (out - x).abs().max().item() if x.numel() else 0.0
    assert err <= codec.error_bound(x)
    if codec.lossless:
        assert torch.equal(out, x)
    if case[0] in ("int8", "int4") and x.numel():
        assert bool(((out - x).abs().reshape(-1) <= per_element_bound(codec, x)).all())
    back = codec.from_wire(shape, enc.params, wire(enc))
    assert torch.equal(codec.decode(back), out)  # bit for bit


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_non_contiguous_input_and_no_aliasing(case: tuple[str, dict[str, Any]]) -> None:
    codec = make_codec(case[0], **case[1])
    x = torch.randn(40, 70, generator=torch.Generator().manual_seed(5))
    xt = x.t()
    assert not xt.is_contiguous()
    ref = codec.decode(codec.encode(xt.contiguous()))
    enc = codec.encode(xt)
    assert torch.equal(codec.decode(enc), ref)
    before = codec.decode(enc).clone()
    x.add_(100.0)  # the encoded frames must not see later writes to the input
    assert torch.equal(codec.decode(enc), before)


def test_bounds_are_not_vacuous() -> None:
    # int4 at block 64 on N(0,1) data: the bound (~absmax/14) is within 2x of the real error.
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    codec = make_codec("int4")
    err = (codec.decode(codec.encode(x)) - x).abs().max().item()
    assert codec.error_bound(x) / 2 < err <= codec.error_bound(x)
    bf = make_codec("bf16")
    err = (bf.decode(bf.encode(x)) - x).abs().max().item()
    assert bf.error_bound(x) / 4 < err <= bf.error_bound(x)


# -- bf16 ------------------------------------------------------------------------------


def test_bf16_exact_on_representable_values() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(10000, generator=g) * 10.0 ** torch.randint(-30, 30, (10000,), generator=g),
                   torch.tensor([0.0, -0.0, 2.0**-133, 3.0e38, -1.0])])
    x = x.to(torch.bfloat16).to(torch.float32)
    codec = make_codec("bf16")
    assert torch.equal(codec.decode(codec.encode(x)), x)
    assert codec.expected_ratio(x.shape) == 2.0


def test_bf16_rounds_half_to_even() -> None:
    codec = make_codec("bf16")
    x = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 1 + 2.0**-8 + 2.0**-20])
    assert codec.decode(codec.encode(x)).tolist() == [1.0, 1 + 2.0**-6, -1.0, 1 + 2.0**-7]


def test_bf16_refuses_values_that_would_overflow() -> None:
    codec = make_codec("bf16")
    below = torch.nextafter(torch.tensor(BF16_LIMIT), torch.tensor(0.0))
    assert math.isfinite(codec.decode(codec.encode(below.reshape(1))).item())
    with pytest.raises(CodecError, match="beyond this codec's range"):
        codec.encode(torch.tensor([BF16_LIMIT]))


# -- block quantisation -----------------------------------------------------------------


@pytest.mark.parametrize("name,block", [("int4", 64), ("int8", 256), ("int4", 48)])
def test_block_scales_handle_magnitude_spread(name: str, block: int) -> None:
    """Blocks of 1e-6 next to blocks of 1e4: the small ones keep their own precision."""
    n = block * 40 + block // 3  # last block partial
    g = torch.Generator().manual_seed(3)
    block_idx = torch.arange(n) // block
    small = block_idx % 2 == 0
    x = torch.randn(n, generator=g) * torch.where(small, 1e-6, 1e4)
    codec = make_codec(name, block_size=block)
    qmax = codec.qmax  # type: ignore[attr-defined]
    err = (codec.decode(codec.encode(x)) - x).abs()
    assert bool((err <= per_element_bound(codec, x)).all())
    assert err[small].max().item() <= x[small].abs().max().item() / (2 * qmax) * 1.001  # ~1e-7, not ~1e3
    # With one scale for the whole tensor every small value rounds to zero.
    flat = make_codec(name, block_size=MAX_BLOCK_SIZE)
    out = flat.decode(flat.encode(x))
    assert bool((out[small] == 0).all())
    assert not bool(((out - x).abs() <= per_element_bound(codec, x)).all())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_zeros_never_nan(case: tuple[str, dict[str, Any]]) -> None:
    codec = make_codec(case[0], **case[1])
    for shape in [(1000,), (33, 17)]:
        z = torch.zeros(shape)
        assert torch.equal(codec.decode(codec.encode(z)), z)
    x = torch.randn(300, generator=torch.Generator().manual_seed(4))
    x[64:128] = 0.0
    out = codec.decode(codec.encode(x))
    assert not out.isnan().any()
    if case[0] != "powersgd":  # symmetric levels: zero is always exact
        assert bool((out[64:128] == 0).all())


def test_tiny_and_huge_values() -> None:
    x = torch.tensor([1e-39, -3e-39, 0.0, 2e-40] + [3.4e38, -3.4e38, 1.0, 0.0])
    for name in ("int8", "int4"):
        codec = make_codec(name, block_size=4)
        out = codec.decode(codec.encode(x))
        assert bool(out.isfinite().all())
        assert (out - x).abs().max().item() <= codec.error_bound(x)
        assert out[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # scale below 2**-126: flushed
        assert out[4].item() == pytest.approx(3.4e38, rel=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(case: tuple[str, dict[str, Any]], bad: float) -> None:
    codec = make_codec(case[0], **case[1])
    x = torch.randn(33, 17, generator=torch.Generator().manual_seed(6))
    x[20, 3] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x)
    with pytest.raises(CodecError):
        codec.encode(x.double())  # and only float32 is accepted


def test_int4_packing_layout_by_hand() -> None:
    codec = make_codec("int4", block_size=4)
    enc = codec.encode(torch.tensor([7.0, -7.0, 0.0, 3.5, 1.0]))  # scales 1.0 and 1/7
    scale, packed = enc.frames
    assert scale.tolist() == [1.0, pytest.approx(1 / 7)]
    # q = 7, -7, 0, 4 (3.5 rounds half to even), then 7; nibble = q + 8, low nibble first,
    # and the spare nibble of the odd last byte is 0.
    assert packed.tolist() == [15 | (1 << 4), 8 | (12 << 4), 15]
    assert codec.decode(enc).tolist() == pytest.approx([7.0, -7.0, 0.0, 4.0, 1.0], abs=1e-6)


# -- ratios ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_expected_ratio_matches_measured(case: tuple[str, dict[str, Any]]) -> None:
    codec = make_codec(case[0], **case[1])
    g = torch.Generator().manual_seed(7)
    for shape in [(1000003,), (1 << 20,), (257, 129), (512, 256), (0,)]:
        x = torch.randn(shape, generator=g)
        enc = codec.encode(x)
        measured = x.numel() * 4 / enc.nbytes() if enc.nbytes() else 1.0
        assert codec.expected_ratio(shape) == measured


def test_expected_ratio_by_hand() -> None:
    n = 1 << 20
    assert make_codec("none").expected_ratio((n,)) == 1.0
    assert make_codec("bf16").expected_ratio((n,)) == 2.0
    assert make_codec("int8").expected_ratio((n,)) == 1024 / 260  # 256 B values + 4 B scale per block
    assert make_codec("int4").expected_ratio((n,)) == 256 / 36  # 32 B values + 4 B scale per block
    assert make_codec("int4").expected_ratio((n,)) > 7.1
    odd = 1000003
    assert make_codec("int4").expected_ratio((odd,)) == 4 * odd / (4 * math.ceil(odd / 64) + (odd + 1) // 2)
    assert make_codec("powersgd", rank=4).expected_ratio((512, 256)) == 512 * 256 / (4 * (512 + 256))
    assert make_codec("powersgd", rank=4).expected_ratio((512, 16, 16)) == 512 * 256 / (4 * (512 + 256))
    assert make_codec("powersgd").expected_ratio((n,)) == 1.0  # vectors go dense
    assert make_codec("powersgd", rank=4).expected_ratio((8, 8)) == 1.0  # 4*(8+8) = 64 values: no gain


# -- from_wire -------------------------------------------------------------------------


def test_from_wire_accepts_memoryview_and_is_independent() -> None:
    codec = make_codec("int8", block_size=16)
    x = torch.randn(100, generator=torch.Generator().manual_seed(8))
    enc = codec.encode(x)
    bufs = [bytearray(b) for b in wire(enc)]
    back = codec.from_wire([100], enc.params, [memoryview(b) for b in bufs])
    ref = codec.decode(back).clone()
    for b in bufs:
        b[:] = bytes(len(b))  # overwrite the receive buffers
    assert torch.equal(codec.decode(back), ref)
    back.frames[1][0] = 1  # writable
    assert torch.equal(ref, codec.decode(enc))


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4", "powersgd"])
def test_from_wire_without_copy_decodes_in_place_only_where_decode_only_reads(name: str) -> None:
    """``copy=False`` (what the wire passes: a message owns its frames) leaves the frames
    in the received buffers for codecs whose decode returns new memory, the same values;
    the others (``none`` decodes to a view of its frame, PowerSGD) still copy."""
    codec = make_codec(name)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    enc = codec.encode(x)
    bufs = [bytearray(b) for b in wire(enc)]
    back = codec.from_wire(list(x.shape), enc.params, [memoryview(b) for b in bufs], copy=False)
    assert torch.equal(codec.decode(back), codec.decode(enc))
    shared = [f.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(b)) for f, b in zip(back.frames, bufs) if len(b)]
    assert shared and all(s == codec.fresh_decode for s in shared), shared
    assert codec.fresh_decode == (name in ("bf16", "int8", "int4"))
    if codec.fresh_decode:  # what the flag promises: the decoded value is memory of its own
        decoded = codec.decode(back)
        assert all(decoded.untyped_storage().data_ptr() != f.untyped_storage().data_ptr() for f in back.frames)


def _int4_enc() -> tuple[Codec, Encoded, list[bytes]]:
    codec = make_codec("int4", block_size=64)
    enc = codec.encode(torch.randn(1000, generator=torch.Generator().manual_seed(9)))
    return codec, enc, wire(enc)


def test_from_wire_rejects_wrong_byte_lengths() -> None:
    codec, enc, (scales, packed) = _int4_enc()
    assert len(scales) == 16 * 4 and len(packed) == 500
    with pytest.raises(CodecError, match=r"frame 1 has 499 bytes, expected 500"):
        codec.from_wire((1000,), enc.params, [scales, packed[:-1]])
    with pytest.raises(CodecError, match=r"frame 1 has 501 bytes, expected 500"):
        codec.from_wire((1000,), enc.params, [scales, packed + b"\0"])
    with pytest.raises(CodecError, match=r"frame 0 has 64 bytes, expected 128"):  # block count: 32 -> 32 blocks
        codec.from_wire((1000,), {"block_size": 32}, [scales, packed])
    with pytest.raises(CodecError, match=r"frame 1 has 500 bytes, expected 501"):  # shape says 1001 elements
        codec.from_wire((1001,), enc.params, [scales, packed])
    with pytest.raises(CodecError, match="got 1 frame buffers, expected 2"):
        codec.from_wire((1000,), enc.params, [scales])
    with pytest.raises(CodecError, match="not a bytes-like"):
        codec.from_wire((1000,), enc.params, [scales, 12])


@pytest.mark.parametrize(
    "name,shape,params,match",
    [
        ("int4", (1000,), {"block_size": 64, "rank": 2}, r"unknown \['rank'\]"),
        ("int4", (1000,), {}, r"missing \['block_size'\]"),
        ("int4", (1000,), {"block_size": "64"}, "must be int"),
        ("int4", (1000,), {"block_size": 64.0}, "must be int"),
        ("int4", (1000,), {"block_size": True}, "must be int"),
        ("int4", (1000,), {"block_size": 0}, "out of range"),
        ("int8", (1000,), {"block_size": -4}, "out of range"),
        ("int8", (1000,), {"block_size": MAX_BLOCK_SIZE + 1}, "out of range"),
        ("int8", (1000,), [("block_size", 64)], "params must be a dict"),
        ("none", (10,), {"block_size": 64}, "unknown"),
        ("bf16", (10,), {"x": 1}, "unknown"),
        ("none", (-1,), {}, "non-negative ints"),
        ("none", (2.0,), {}, "non-negative ints"),
        ("none", "10", {}, "tuple of ints"),
        ("powersgd", (64, 32), {"mode": "lowrank", "rank": 0}, "out of range"),
        ("powersgd", (8, 8), {"mode": "lowrank", "rank": 4}, "not smaller than the 8 x 8 matrix"),
        ("powersgd", (64, 32), {"mode": "lowrank", "rank": 30}, "not smaller"),
        ("powersgd", (1000,), {"mode": "lowrank", "rank": 2}, ">= 2 dims"),
        ("powersgd", (64, 32), {"mode": "svd", "rank": 2}, "mode='lowrank' or mode='dense'"),
        ("powersgd", (64, 32), {"rank": 2}, "mode='lowrank' or mode='dense'"),
        ("powersgd", (64, 32), {"mode": "dense", "rank": 2}, r"unknown \['rank'\]"),
        ("powersgd", (64, 32), {"mode": "lowrank", "rank": 2.0}, "must be int"),
    ],
)
def test_invalid_params_are_rejected(name: str, shape: Any, params: Any, match: str) -> None:
    codec = make_codec(name)
    with pytest.raises(CodecError, match=match):
        codec.frame_layout(shape, params)
    with pytest.raises(CodecError, match=match):
        codec.from_wire(shape, params, [b"", b""])


def test_powersgd_wire_rank_must_match_frames() -> None:
    codec = make_codec("powersgd", rank=4)
    enc = codec.encode(torch.randn(64, 32, generator=torch.Generator().manual_seed(10)))
    assert enc.params == {"mode": "lowrank", "rank": 4}
    p, q = wire(enc)
    assert (len(p), len(q)) == (64 * 4 * 4, 32 * 4 * 4)
    with pytest.raises(CodecError, match="frame 0 has 1024 bytes, expected 512"):
        codec.from_wire((64, 32), {"mode": "lowrank", "rank": 2}, [p, q])
    with pytest.raises(CodecError, match="got 2 frame buffers, expected 1"):
        codec.from_wire((64, 32), {"mode": "dense"}, [p, q])
    # A receiver decodes whatever rank the sender used, whatever its own setting.
    other = make_codec("powersgd", rank=1)
    assert torch.equal(other.decode(other.from_wire((64, 32), enc.params, [p, q])), codec.decode(enc))


def test_received_scales_must_be_finite_and_non_negative() -> None:
    codec = make_codec("int8", block_size=4)
    enc = codec.encode(torch.ones(8))
    q = wire(enc)[1]
    for bad in (-1.0, math.nan, math.inf):
        scales = tensor_bytes(torch.tensor([1.0, bad]))
        with pytest.raises(CodecError, match="scales must be finite and >= 0"):
            codec.from_wire((8,), enc.params, [scales, q])


def test_decode_checks_what_it_is_given() -> None:
    int4, int8 = make_codec("int4"), make_codec("int8")
    enc = int4.encode(torch.ones(10))
    with pytest.raises(CodecError, match="cannot decode data encoded by 'int4'"):
        int8.decode(enc)
    bad = Encoded(codec="int4", shape=(10,), params=enc.params, frames=(enc.frames[0], enc.frames[1].to(torch.int8)))
    with pytest.raises(CodecError, match="frame 1 is 5 x torch.int8, expected 5 x torch.uint8"):
        int4.decode(bad)
    with pytest.raises(CodecError, match="contiguous 1-D"):
        Encoded(codec="none", shape=(2, 2), params={}, frames=(torch.ones(2, 2),))


# -- registry --------------------------------------------------------------------------


def test_registry_names_ids_and_defaults() -> None:
    assert {n: c.codec_id for n, c in CODECS.items()} == {"none": 0, "bf16": 1, "int8": 2, "int4": 3, "powersgd": 4}
    assert [n for n, c in CODECS.items() if c.lossless] == ["none"]
    assert make_codec("int4").block_size == 64  # type: ignore[attr-defined]
    assert make_codec("int8").block_size == 256  # type: ignore[attr-defined]
    assert make_codec("powersgd").rank == 4  # type: ignore[attr-defined]
    assert make_codec("int4", block_size=32).encode(torch.ones(3)).params == {"block_size": 32}


def test_make_codec_errors_list_the_choices() -> None:
    with pytest.raises(CodecError, match="use one of none, bf16, int8, int4, powersgd"):
        make_codec("fp8")
    with pytest.raises(CodecError, match="does not take rank; it takes block_size"):
        make_codec("int4", rank=2)
    with pytest.raises(CodecError, match="does not take block_size; it takes no parameters"):
        make_codec("bf16", block_size=2)
    with pytest.raises(CodecError, match="out of range"):
        make_codec("int4", block_size=0)
    with pytest.raises(CodecError, match="must be an int"):
        make_codec("int8", block_size=True)
    with pytest.raises(CodecError, match="out of range"):
        make_codec("powersgd", rank=0)


# -- powersgd ----------------------------------------------------------------------------


def test_powersgd_reuses_warm_start_q_from_state() -> None:
    g = torch.Generator().manual_seed(11)
    m = torch.randn(40, 30, generator=g)
    codec = make_codec("powersgd", rank=3)
    state: dict[str, Any] = {}
    codec.encode(m, state)
    assert state["q"].shape == (30, 3)
    q0 = torch.randn(30, 3, generator=g)
    state["q"] = q0.clone()
    enc = codec.encode(m, state)
    p = torch.linalg.qr(m @ q0).Q
    assert torch.allclose(enc.frames[0].view(40, 3), p, atol=1e-6)
    assert torch.allclose(enc.frames[1].view(30, 3), m.T @ p, atol=1e-5)
    assert torch.equal(state["q"], enc.frames[1].view(30, 3))
    assert state["q"].data_ptr() != enc.frames[1].data_ptr()  # state does not alias the frame
    # Without state every call starts from the same seeded Gaussian.
    a, b = codec.encode(m), codec.encode(m)
    assert torch.equal(a.frames[0], b.frames[0])
    with pytest.raises(CodecError, match=r"state\['q'\] is \(30, 2\)"):
        codec.encode(m, {"q": torch.zeros(30, 2)})


def test_powersgd_rank_r_matrix_is_reconstructed() -> None:
    g = torch.Generator().manual_seed(12)
    m = torch.randn(120, 4, generator=g) @ torch.randn(4, 90, generator=g)
    codec = make_codec("powersgd", rank=4)
    state: dict[str, Any] = {}
    for _ in range(2):
        out = codec.decode(codec.encode(m, state))
    assert ((out - m).norm() / m.norm()).item() < 1e-5


def test_powersgd_warm_start_converges_to_best_rank_r() -> None:
    """A matrix with 4 strong and many weak singular values: warm-started iterations
    reach the Eckart-Young optimum; a cold start every call stays far from it."""
    g = torch.Generator().manual_seed(13)
    u = torch.linalg.qr(torch.randn(200, 120, generator=g)).Q
    v = torch.linalg.qr(torch.randn(120, 120, generator=g)).Q
    s = torch.cat([torch.tensor([10.0, 8.0, 6.0, 4.0]), 0.97 ** torch.arange(116.0)])
    m = u @ torch.diag(s) @ v.T
    best = s[4:].norm().item()
    codec = make_codec("powersgd", rank=4)
    state: dict[str, Any] = {}
    errs = [(codec.decode(codec.encode(m, state)) - m).norm().item() / best for _ in range(6)]
    cold = (codec.decode(codec.encode(m)) - m).norm().item() / best
    assert errs[0] == pytest.approx(cold)
    assert cold > 1.5
    assert errs[-1] < 1.001
    assert all(a >= b - 1e-6 for a, b in zip(errs, errs[1:]))


def test_powersgd_sends_vectors_and_small_matrices_dense() -> None:
    codec = make_codec("powersgd", rank=4)
    for shape in [(1000,), (), (8, 8), (3, 200)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(14))
        enc = codec.encode(x)
        assert enc.params == {"mode": "dense"}
        assert torch.equal(codec.decode(enc), x)
    assert codec.encode(torch.randn(9, 9)).params == {"mode": "lowrank", "rank": 4}  # 4*18 < 81


# -- error feedback ----------------------------------------------------------------------


def _run_sums(codec: Codec, shape: tuple[int, ...], steps: int, feedback: bool, seed: int) -> dict[str, Any]:
    """Encode `steps` random inputs; record the running gaps at a few steps."""
    g = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback()
    state: dict[str, Any] = {}
    sum_x = torch.zeros(shape, dtype=torch.float64)
    sum_d = torch.zeros(shape, dtype=torch.float64)
    out: dict[str, Any] = {"gap": {}, "residual": {}, "amax": {}, "captured": [], "xnorm": 0.0}
    amax = 0.0
    for t in range(1, steps + 1):
        x = torch.randn(shape, generator=g)
        amax = max(amax, x.abs().max().item())
        out["xnorm"] = max(out["xnorm"], x.norm().item())
        if feedback:
            prev = ef.residual("k")
            y = x + prev if prev is not None else x
            enc = ef.encode("k", x, codec, state)
            out["captured"].append(1.0 - (ef.residual("k").norm() ** 2 / y.norm() ** 2).item())
        else:
            enc = codec.encode(x, state)
        sum_x += x.double()
        sum_d += codec.decode(enc).double()
        if t in (50, 100, 200):
            out["gap"][t] = sum_d - sum_x
            out["residual"][t] = ef.residual("k")
            out["amax"][t] = amax
    return out


def test_error_feedback_int4_gap_is_the_residual_and_stays_bounded() -> None:
    codec = make_codec("int4", block_size=64)
    run = _run_sums(codec, (4096,), 200, feedback=True, seed=15)
    plain = _run_sums(codec, (4096,), 200, feedback=False, seed=15)
    for t in (50, 100, 200):
        gap = run["gap"][t]
        # sum(decoded) - sum(inputs) telescopes to -residual (up to float32 rounding) ...
        assert torch.allclose(gap, -run["residual"][t].double(), atol=1e-3)
        # ... and the residual never exceeds A / (2*qmax - 1) = A/13 (feedback.py docstring).
        bound = run["amax"][t] / 13 * (1 + 1e-5) + 1e-3
        assert gap.abs().max().item() <= bound
        # Without feedback the per-step errors pile up well past that bound.
        assert plain["gap"][t].abs().max().item() > 5 * bound
    assert plain["gap"][200].abs().max().item() > 1.5 * plain["gap"][50].abs().max().item()


def test_error_feedback_powersgd_gap_is_the_residual_and_stays_bounded() -> None:
    n, m, r = 64, 48, 2
    codec = make_codec("powersgd", rank=r)
    run = _run_sums(codec, (n, m), 200, feedback=True, seed=16)
    plain = _run_sums(codec, (n, m), 200, feedback=False, seed=16)
    # Each step keeps at least a fraction delta of the energy of what it encodes (the
    # best rank-r approximation keeps >= r/min(n, m); one warm power step is checked at
    # half that). Then ||e_t|| <= sqrt(1-delta) (||x_t|| + ||e_{t-1}||), so
    # ||e|| <= K max||x||, K = sqrt(1-delta) / (1 - sqrt(1-delta)), for every t.
    delta = min(run["captured"])
    assert delta >= r / min(n, m) / 2
    k = math.sqrt(1 - delta) / (1 - math.sqrt(1 - delta))
    gaps = {}
    for t in (50, 100, 200):
        gap = run["gap"][t]
        assert torch.allclose(gap, -run["residual"][t].double(), atol=1e-3)
        assert gap.norm().item() <= k * run["xnorm"] + 1e-3
        gaps[t] = gap.abs().max().item()
    # Stationary with feedback; growing like sqrt(t) without it.
    assert max(gaps[100], gaps[200]) <= 1.5 * gaps[50]
    plain_gaps = {t: plain["gap"][t].abs().max().item() for t in (50, 200)}
    assert plain_gaps[200] > 1.5 * plain_gaps[50]
    assert plain_gaps[200] > 3 * gaps[200]


def test_error_feedback_state_dict_round_trip() -> None:
    codec = make_codec("int4", block_size=16)
    g = torch.Generator().manual_seed(17)
    keys = [(0, 1), "emb.weight", (2, (3, "a")), 7]
    xs = {k: torch.randn(5, 33, generator=g) for k in keys}
    ef = ErrorFeedback()
    for _ in range(3):
        for k in keys:
            ef.encode(k, xs[k], codec)
    sd = ef.state_dict()
    assert sorted(sd) == sorted(['[0,1]', '"emb.weight"', '[2,[3,"a"]]', "7"])
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in sd.values())
    clone = ErrorFeedback()
    clone.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert len(clone) == 4
    for k in keys:
        assert torch.equal(clone.residual(k), ef.residual(k))  # type: ignore[arg-type]
        a, b = ef.encode(k, xs[k], codec), clone.encode(k, xs[k], codec)
        assert all(torch.equal(x, y) for x, y in zip(a.frames, b.frames))
    ef.reset()
    assert len(ef) == 0 and ef.state_dict() == {}


def test_error_feedback_keys_and_mismatches() -> None:
    ef, codec = ErrorFeedback(), make_codec("int8")
    with pytest.raises(CodecError, match="must be a str, an int or a tuple"):
        ef.encode(1.5, torch.ones(3), codec)
    with pytest.raises(CodecError, match="not a JSON-encoded key"):
        ef.load_state_dict({"(0, 1)": torch.zeros(3)})
    with pytest.raises(CodecError, match="expected str, int"):
        ef.load_state_dict({"[1.5]": torch.zeros(3)})
    with pytest.raises(CodecError, match="float32"):
        ef.load_state_dict({"[1]": torch.zeros(3, dtype=torch.float64)})
    ef.encode("k", torch.randn(10), codec)
    with pytest.raises(CodecError, match="call reset"):
        ef.encode("k", torch.randn(11), codec)


def test_lossless_codec_keeps_no_residual_and_flushes_an_old_one() -> None:
    ef = ErrorFeedback()
    x = torch.randn(100, generator=torch.Generator().manual_seed(18))
    ef.encode("k", x, make_codec("none"))
    assert len(ef) == 0
    ef.encode("k", x, make_codec("int4"))
    residual = ef.residual("k").clone()  # type: ignore[union-attr]
    assert residual.abs().max().item() > 0
    none = make_codec("none")
    out = none.decode(ef.encode("k", x, none))
    assert torch.equal(out, x + residual)
    assert len(ef) == 0


# -- CUDA ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_stays_on_device_and_matches_cpu(case: tuple[str, dict[str, Any]]) -> None:
    codec = make_codec(case[0], **case[1])
    for shape in [(), (65,), (1000003,), (257, 129)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(19))
        xc = x.cuda()
        state: dict[str, Any] = {}
        enc = codec.encode(xc, state)
        assert all(f.is_cuda for f in enc.frames)
        out = codec.decode(enc)
        assert out.is_cuda and out.shape == x.shape
        assert (out - xc).abs().max().item() <= codec.error_bound(xc)
        if "q" in state:
            assert state["q"].is_cuda
        if case[0] != "powersgd":  # elementwise codecs: same bits as on the CPU
            assert torch.equal(out.cpu(), codec.decode(codec.encode(x)))
        back = codec.from_wire(shape, enc.params, wire(enc))
        if case[0] != "powersgd":
            assert torch.equal(codec.decode(back), out.cpu())
        else:  # the CPU matmul of the same factors may round differently
            assert torch.allclose(codec.decode(back), out.cpu(), rtol=1e-4, atol=1e-4)
        ef = ErrorFeedback()
        ef.encode("k", xc, codec)
        if not codec.lossless:
            assert ef.residual("k").is_cuda  # type: ignore[union-attr]
