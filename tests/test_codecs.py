"""Codec wire formats: sizes, per-element error bounds, determinism, and hostile payloads."""

import hashlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_cocodc.algorithms.codecs import CODECS, Codec, TopKCodec, decode_mean, get_codec
from p2p_cocodc.errors import UserError

SIZES = [0, 1, 63, 64, 65, 255, 256, 257, 10_000]
ALL = sorted(CODECS)


def randn(n: int, seed: int = 0) -> torch.Tensor:
    """Outer-gradient-like values with a spread of magnitudes across blocks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 1e-2


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of its block, computed independently of the codec."""
    nb = -(-x.numel() // block)
    padded = torch.zeros(nb * block)
    padded[: x.numel()] = x.abs()
    return padded.view(nb, block).amax(1).repeat_interleave(block)[: x.numel()]


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.numel())


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n", SIZES)
def test_wire_bytes_matches_encode_and_roundtrip_is_stable(name: str, n: int) -> None:
    codec = get_codec(name)
    x = randn(n, seed=n)
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    assert len(payload) == codec.wire_bytes(n)
    y = codec.decode(payload, n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    # Decoded values sit on the codec's grid: a second round trip reproduces the same bits.
    z = roundtrip(codec, y)
    assert torch.equal(z.view(torch.int32), y.view(torch.int32))


@pytest.mark.parametrize("name", ALL)
def test_decode_returns_new_writable_memory_and_accepts_strided_input(name: str) -> None:
    codec = get_codec(name)
    base = randn(3000)
    x = base[::3]
    assert not x.is_contiguous()
    payload = codec.encode(x)
    assert payload == codec.encode(x.contiguous())
    y = codec.decode(payload, x.numel())
    y += 1.0  # would raise on a read-only buffer
    assert torch.equal(codec.decode(payload, x.numel()) + 1.0, y)


def test_fp32_is_exact() -> None:
    x = randn(10_000)
    assert torch.equal(roundtrip(CODECS["fp32"], x), x)


def test_bf16_relative_error() -> None:
    x = randn(10_000)
    y = roundtrip(CODECS["bf16"], x)
    assert torch.all((y - x).abs() <= x.abs() * 2.0**-8)
    assert torch.equal(y, x.to(torch.bfloat16).float())


def test_int8_error_at_most_half_step() -> None:
    x = randn(10_000)
    y = roundtrip(CODECS["int8"], x)
    half_step = block_absmax(x, 256) / 254
    # Tiny slack for the float rounding of x/s and q*s themselves.
    assert torch.all((y - x).abs() <= half_step * (1 + 1e-5))
    assert torch.all(torch.sign(y) * torch.sign(x) >= 0)
    # The block maximum is reproduced (code ±127).
    assert torch.allclose(block_absmax(y, 256), block_absmax(x, 256), rtol=1e-6, atol=0)


def test_int8_all_zero_block_decodes_to_zero() -> None:
    x = torch.cat([torch.zeros(256), randn(100)])
    y = roundtrip(CODECS["int8"], x)
    assert torch.equal(y[:256], torch.zeros(256))
    assert y[256:].abs().sum() > 0


def test_fp4_levels_error_and_signs() -> None:
    x = randn(10_000)
    x[5] = 0.0
    y = roundtrip(CODECS["fp4"], x)
    s = block_absmax(x, 64)
    ratio = y.abs() / s
    levels = torch.tensor([2.0**-e for e in range(7)] + [0.0])
    assert torch.all(torch.isclose(ratio[:, None], levels[None, :], rtol=1e-6, atol=0).any(1))
    big = x.abs() >= s * 2.0**-6
    rel = y[big].abs() / x[big].abs()
    slack = 1 + 1e-6
    assert torch.all((rel <= 2.0**0.5 * slack) & (rel >= 2.0**-0.5 / slack))
    tiny = x.abs() < s * 2.0**-6.5
    assert tiny.sum() > 100  # the test data actually exercises the zero cut-off
    assert torch.all(y[tiny] == 0)
    nonzero = y != 0
    assert torch.all(torch.sign(y[nonzero]) == torch.sign(x[nonzero]))
    assert y[5] == 0


def test_fp4_nibble_layout() -> None:
    # One block: scale 1, values 1 (e=0), -0.5 (sign, e=1), 0 (zero code 7), pad nibble 7.
    payload = CODECS["fp4"].encode(torch.tensor([1.0, -0.5, 0.0]))
    assert payload == struct.pack("<f", 1.0) + bytes([0x9 << 4 | 0x0, 0x7 << 4 | 0x7])


def test_int8_layout() -> None:
    payload = CODECS["int8"].encode(torch.tensor([127.0, -63.6, 0.0]))
    assert payload == struct.pack("<f", 1.0) + struct.pack("<3b", 127, -64, 0)


@pytest.mark.parametrize(
    ("name", "ratio"),
    [
        ("bf16", 2.0),
        ("int8", 3.94),
        ("fp4", 7.11),
        ("q2", 12.8),
        ("q1", 25.6),
        ("topk2", 23.27),
        ("topk4", 19.69),
    ],
)
def test_compression_ratio(name: str, ratio: float) -> None:
    n = 10**6
    got = CODECS["fp32"].wire_bytes(n) / len(CODECS[name].encode(randn(n)))
    assert got == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize("name", ALL)
def test_decode_mean_is_fp32_mean_and_deterministic(name: str) -> None:
    codec = get_codec(name)
    n = 5000
    payloads = [codec.encode(randn(n, seed=s)) for s in range(4)]
    mean = decode_mean(payloads, codec, n)
    again = decode_mean(payloads, codec, n)
    assert torch.equal(mean.view(torch.int32), again.view(torch.int32))
    decoded = [codec.decode(p, n) for p in payloads]
    # The contract: fp32 sums in payload order, then one division (bitwise reproducible).
    expected = ((decoded[0] + decoded[1]) + decoded[2] + decoded[3]) / 4
    assert torch.equal(mean, expected)
    exact = torch.stack(decoded).double().mean(0)
    assert (mean.double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_decode_mean_fp32_matches_torch_mean() -> None:
    xs = [randn(5000, seed=s) for s in range(3)]
    codec = CODECS["fp32"]
    mean = decode_mean([codec.encode(x) for x in xs], codec, 5000)
    assert (mean - torch.stack(xs).mean(0)).abs().max() <= 1e-7


def test_decode_mean_needs_payloads() -> None:
    with pytest.raises(UserError, match="at least one payload"):
        decode_mean([], CODECS["fp32"], 10)


# --- hostile or broken input -----------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_wrong_length_rejected(name: str) -> None:
    codec = get_codec(name)
    payload = codec.encode(randn(100))
    expected = codec.wire_bytes(100)
    with pytest.raises(UserError, match=f"must be {expected} bytes, got {expected - 1}"):
        codec.decode(payload[:-1], 100)  # truncated
    with pytest.raises(UserError, match=f"got {expected + 1} bytes"):
        codec.decode(payload + b"\0", 100)
    longer = next(n for n in range(101, 1000) if codec.wire_bytes(n) != expected)  # a chunk more
    with pytest.raises(UserError, match="must be"):
        codec.decode(payload, longer)
    with pytest.raises(UserError, match="must be 0 bytes"):
        codec.decode(b"\0", 0)


@pytest.mark.parametrize("name", ALL)
def test_huge_claimed_numel_rejected_before_allocating(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(UserError, match=f"payload for {10**15} values must be"):
        codec.decode(b"\0" * 64, 10**15)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("numel", [-1, 1.5, True, "3"])
def test_bad_numel_rejected(name: str, numel: object) -> None:
    with pytest.raises(UserError, match="numel must be a non-negative int"):
        get_codec(name).decode(b"", numel)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ALL)
def test_payload_type_checked(name: str) -> None:
    with pytest.raises(UserError, match="payload must be bytes, got str"):
        get_codec(name).decode("abcd", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp32_non_finite_payload_rejected(bad: float) -> None:
    payload = struct.pack("<3f", 1.0, bad, 2.0)
    with pytest.raises(UserError, match="NaN or Inf"):
        CODECS["fp32"].decode(payload, 3)


def test_bf16_non_finite_payload_rejected() -> None:
    payload = bytes([0xC0, 0x7F, 0x80, 0x3F])  # bf16 NaN, 1.0
    with pytest.raises(UserError, match="NaN or Inf"):
        CODECS["bf16"].decode(payload, 2)


def test_q2_layout() -> None:
    # RMS of [1, -3, 0, 2] is sqrt(3.5): high -3 and 2 (mean |x| 2.5), low 1 and 0 (mean 0.5).
    payload = CODECS["q2"].encode(torch.tensor([1.0, -3.0, 0.0, 2.0]))
    lo, hi = torch.frombuffer(bytearray(payload[:4]), dtype=torch.bfloat16).tolist()
    assert (lo, hi) == (0.5, 2.5)
    assert payload[4] == 0b00 | 0b11 << 2 | 0b00 << 4 | 0b01 << 6
    assert CODECS["q2"].decode(payload, 4).tolist() == [0.5, -2.5, 0.5, 2.5]


def test_q2_splits_each_block_at_its_rms_into_two_class_means() -> None:
    x = randn(64 * 50 + 17)
    x[:64] = 0.0  # an all-zero block decodes to zeros
    y = roundtrip(CODECS["q2"], x)
    assert torch.equal(y[:64], torch.zeros(64))
    for start in range(64, x.numel(), 64):  # the last block is short: its RMS is of its real values
        xb, yb = x[start : start + 64], y[start : start + 64]
        high = xb.abs() > xb.square().mean().sqrt()
        assert torch.equal(yb.sign(), torch.where(xb < 0, -1.0, 1.0))
        for part in (high, ~high):
            expected = xb[part].abs().mean().to(torch.bfloat16).float()
            assert torch.equal(yb[part].abs(), expected.expand(int(part.sum())))
    gauss = torch.randn(64 * 1000, generator=torch.Generator().manual_seed(1))
    error = (roundtrip(CODECS["q2"], gauss) - gauss).square().sum() / gauss.square().sum()
    assert 0.10 < float(error) < 0.125  # Lloyd-Max's 2-bit optimum for a Gaussian is 0.1175


def test_q1_layout() -> None:
    # mean |x| of [1, -3, 0, 2] is 1.5; the sign bits are 0b0010 (only -3 is negative)
    payload = CODECS["q1"].encode(torch.tensor([1.0, -3.0, 0.0, 2.0]))
    assert torch.frombuffer(bytearray(payload[:2]), dtype=torch.bfloat16).tolist() == [1.5]
    assert payload[2:] == bytes([0b0010])
    assert CODECS["q1"].decode(payload, 4).tolist() == [1.5, -1.5, 1.5, 1.5]


def test_q1_sends_each_blocks_signs_and_mean_magnitude() -> None:
    x = randn(64 * 50 + 17)
    x[:64] = 0.0  # an all-zero block decodes to zeros
    x[64:128] *= 1e36  # no sum of a block overflows
    y = roundtrip(CODECS["q1"], x)
    assert torch.equal(y[:64], torch.zeros(64))
    for start in range(64, x.numel(), 64):  # the last block is short: its mean is of its real values
        xb, yb = x[start : start + 64], y[start : start + 64]
        assert torch.equal(yb.sign(), torch.where(xb < 0, -1.0, 1.0))
        expected = (xb.abs().double().mean()).to(torch.bfloat16).float()
        assert torch.allclose(yb.abs(), expected.expand(xb.numel()), rtol=2**-8, atol=0.0)
    gauss = torch.randn(64 * 1000, generator=torch.Generator().manual_seed(1))
    error = (roundtrip(CODECS["q1"], gauss) - gauss).square().sum() / gauss.square().sum()
    assert 0.34 < float(error) < 0.38  # 1 − 2/π = 0.363 for signs scaled by the mean |x|


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_q1_bad_scale_rejected(scale: float) -> None:
    payload = bytearray(CODECS["q1"].encode(randn(300)))  # 5 blocks: 5 scales, then the signs
    payload[2:4] = torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(UserError, match="block 1 has invalid scale"):
        CODECS["q1"].decode(bytes(payload), 300)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("which", [0, 1])
def test_q2_bad_scale_rejected(scale: float, which: int) -> None:
    payload = bytearray(CODECS["q2"].encode(randn(300)))  # 5 blocks: 5 lo scales, then 5 hi
    payload[2 * (5 * which + 1) : 2 * (5 * which + 2)] = (
        torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )
    with pytest.raises(UserError, match="block 1 has invalid scale"):
        CODECS["q2"].decode(bytes(payload), 300)


@pytest.mark.parametrize("name", ["int8", "fp4", "topk2", "topk4"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_bad_scale_rejected(name: str, scale: float) -> None:
    codec = get_codec(name)
    payload = bytearray(codec.encode(randn(300)))
    payload[4:8] = struct.pack("<f", scale)  # block 1
    with pytest.raises(UserError, match="block 1 has invalid scale"):
        codec.decode(bytes(payload), 300)


def test_int8_code_minus_128_rejected() -> None:
    payload = struct.pack("<f", 1.0) + struct.pack("<2b", 3, -128)
    with pytest.raises(UserError, match="-128"):
        CODECS["int8"].decode(payload, 2)


def test_int8_overflowing_scale_rejected() -> None:
    payload = struct.pack("<f", 3e38) + struct.pack("<b", 127)
    with pytest.raises(UserError, match="NaN or Inf"):
        CODECS["int8"].decode(payload, 1)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 42, 99])
def test_encode_rejects_non_finite(name: str, bad: float, at: int) -> None:
    x = randn(100)
    x[at] = bad
    with pytest.raises(UserError, match="NaN or Inf"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", ALL)
def test_encode_rejects_bad_shape_and_dtype(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(UserError, match="1-D float tensor, got 2-D"):
        codec.encode(torch.zeros(4, 4))
    with pytest.raises(UserError, match="1-D float tensor, got 1-D torch.int64"):
        codec.encode(torch.arange(4))
    with pytest.raises(UserError, match="expects a torch.Tensor"):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]


def test_bf16_encode_rejects_overflow() -> None:
    with pytest.raises(UserError, match="bfloat16 range"):
        CODECS["bf16"].encode(torch.tensor([3.4e38]))


def test_unknown_codec_lists_valid_names() -> None:
    with pytest.raises(UserError, match="unknown codec 'fp8'; valid codecs: fp32, bf16, int8, fp4"):
        get_codec("fp8")


# ---- top-k ----


def chunk_view(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.numel() % 256)).view(-1, 256)


@pytest.mark.parametrize("name", ["topk2", "topk4"])
@pytest.mark.parametrize("fraction", [1 / 256, 1 / 32, 0.1])
def test_topk_keeps_each_chunks_largest_values_within_a_level(name: str, fraction: float) -> None:
    codec = get_codec(name, fraction)
    k, levels = codec.slots, 2 ** (codec.bits - 1)  # type: ignore[attr-defined]
    assert k == max(1, round(fraction * 256))
    x = randn(256 * 7 + 100)
    x[:256] = 0.0  # an all-zero chunk
    x[256 : 256 + 200] = 0.0  # a chunk with fewer nonzero values than slots at 0.1
    y = roundtrip(codec, x)
    for xc, yc in zip(chunk_view(x), chunk_view(y), strict=True):
        nonzero = int((xc != 0).sum())
        kept = yc != 0
        assert int(kept.sum()) == min(k, nonzero)
        if nonzero:
            s = float(xc.abs().max())
            # the kept ones are the largest: nothing left out is larger than the smallest kept
            left_out = torch.cat([xc[~kept].abs(), torch.zeros(1)])
            assert float(left_out.max()) <= float(xc[kept].abs().min())
            assert torch.equal(yc[kept].sign(), xc[kept].sign())
            assert float((yc[kept] - xc[kept]).abs().max()) <= s / levels * (1 + 1e-6)
            assert float(yc.abs().max()) == s  # the largest value is exact


def test_topk_layout() -> None:
    codec = get_codec("topk2", 4 / 256)
    payload = codec.encode(torch.tensor([0.5, -1.0, 0.2, 0.0, 0.9]))
    scale, indices, codes = payload[:4], list(payload[4:8]), payload[8]
    assert struct.unpack("<f", scale) == (1.0,)
    assert indices == [0, 1, 2, 4]  # the four largest |x|, ascending
    # 2 bits each, low bits first: +0.5 -> m 0; -1.0 -> sign | m 1; 0.2 -> m 0 (s/2); 0.9 -> m 1
    assert [(codes >> (2 * i)) & 3 for i in range(4)] == [0, 3, 0, 1]
    payload = codec.encode(torch.tensor([0.0, 3.0, 0.0]))  # one nonzero value: three unused slots
    assert list(payload[4:8]) == [1, 1, 1, 1] and payload[8] == 1


def hostile(codec_name: str, change) -> bytes:
    codec = get_codec(codec_name, 4 / 256)
    payload = bytearray(codec.encode(randn(300)))
    change(payload)
    return bytes(payload)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda b: b.__setitem__(slice(8, 12), bytes([9, 3, 20, 30])), "decreasing indices"),
        (lambda b: b.__setitem__(slice(8, 12), bytes([3, 3, 20, 30])), "unused slots must end it"),
        (lambda b: b.__setitem__(slice(12, 16), bytes([40, 40, 40, 40])), "unused slots must end it"),
        (lambda b: b.__setitem__(slice(12, 16), bytes([40, 200, 210, 250])), "beyond the 300 values"),
    ],
)
def test_topk_hostile_indices_rejected(change, error: str) -> None:
    codec = get_codec("topk2", 4 / 256)
    with pytest.raises(UserError, match=error):
        codec.decode(hostile("topk2", change), 300)


def test_topk_with_more_than_32_slots_writes_positions_as_a_mask() -> None:
    codec = TopKCodec("t", 40, 8)
    assert codec.wire_bytes(256) == 4 + 32 + 40 and TopKCodec("t", 32, 8).wire_bytes(256) == 4 + 32 + 32
    x = torch.zeros(300)
    x[[3, 9, 255, 299]] = torch.tensor([1.0, -2.0, 0.5, 4.0])
    payload = codec.encode(x)
    mask = payload[8 : 8 + 32]
    assert mask[0] == 1 << 3 and mask[1] == 1 << 1 and mask[31] == 1 << 7 and sum(mask) == 8 + 2 + 128
    assert torch.equal(codec.decode(payload, 300) != 0, x != 0)
    assert torch.equal(roundtrip(codec, x)[[9, 299]], torch.tensor([-2.0, 4.0]))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda b: b.__setitem__(slice(8, 40), b"\xff" * 32), "more than 40 positions"),
        (lambda b: b.__setitem__(slice(8, 9), b"\x00"), "beyond its mask's positions must be 0"),
        (lambda b: b.__setitem__(slice(40 + 31, 40 + 32), b"\x80"), "beyond the 300 values"),
    ],
)
def test_topk_hostile_masks_rejected(change, error: str) -> None:
    codec = TopKCodec("t", 40, 8)
    x = torch.zeros(300)
    x[[3, 9, 255, 299]] = torch.tensor([1.0, -2.0, 0.5, 4.0])
    payload = bytearray(codec.encode(x))
    change(payload)
    with pytest.raises(UserError, match=error):
        codec.decode(bytes(payload), 300)


def test_topk_mean_codec_keeps_the_union_of_what_members_sent() -> None:
    codec = get_codec("topk2")
    members = [roundtrip(codec, randn(5000, seed=s)) for s in range(3)]
    mean = decode_mean([codec.encode(m) for m in members], codec, 5000)
    mean_codec = codec.mean_codec(3)
    assert mean_codec.slots == 3 * codec.slots and mean_codec.bits == 8  # type: ignore[attr-defined]
    assert codec.mean_codec(100).slots == 256  # type: ignore[attr-defined]
    got = roundtrip(mean_codec, mean)
    assert torch.equal(got != 0, mean != 0)  # the union of the three selections, nothing dropped
    scale = block_absmax(mean, 256)
    assert bool(((got - mean).abs() <= scale / 128 + 1e-12).all())
    assert codec.bound_bytes(5000) >= max(codec.wire_bytes(5000), mean_codec.wire_bytes(5000))
    assert codec.round_bytes(5000, 3) == codec.wire_bytes(5000) + mean_codec.wire_bytes(5000)


def test_topk_fraction_is_checked() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(UserError, match="--topk must be a fraction in"):
            get_codec("topk2", bad)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(ALL), numel=st.integers(0, 700), data=st.data())
def test_any_payload_decodes_to_finite_values_or_one_error(name: str, numel: int, data) -> None:
    """Fuzz: bytes of the right length from a hostile peer give a finite fp32 vector of numel values
    whose round trip is stable, or a UserError; never another exception."""
    codec = get_codec(name)
    size = codec.wire_bytes(numel)
    payload = data.draw(st.binary(min_size=size, max_size=size))
    try:
        value = codec.decode(payload, numel)
    except UserError:
        return
    assert value.shape == (numel,) and value.dtype == torch.float32 and bool(torch.isfinite(value).all())


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["topk2", "topk4"]), numel=st.integers(1, 600), data=st.data())
def test_mutated_topk_payloads_decode_or_fail_cleanly(name: str, numel: int, data) -> None:
    """Fuzz from valid payloads: flip bytes of an honest encoding."""
    codec = get_codec(name)
    payload = bytearray(codec.encode(randn(numel, seed=numel)))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    try:
        value = codec.decode(bytes(payload), numel)
    except UserError:
        return
    assert value.shape == (numel,) and bool(torch.isfinite(value).all())
    assert int((chunk_view(value) != 0).sum(1).max()) <= codec.slots  # type: ignore[attr-defined]


# Each codec's wire bytes and decoded values of ``pinned_vector()``, as sha256 (16 hex digits): a
# faster encoder or decoder must keep every bit (swarm ≡ simulator, θ̄ hashes, golden traces).
PINNED = {
    "fp32": "0fadd21c1c95fc3a",
    "bf16": "a420a08a0104874d",
    "int8": "bf3da674f9696892",
    "fp4": "fccf85a6c03af80c",
    "q2": "4660b51723be72ba",
    "q1": "fbbad9d4241fd28b",
    "topk2": "3d4a3dc3901811a0",
    "topk4": "a61a5a9b7abc6656",
}


def pinned_vector() -> torch.Tensor:
    """5000 values made by exact arithmetic (no platform's random or transcendental functions):
    two all-zero blocks of 64, a block of tiny values, and a short last block."""
    i = torch.arange(5000, dtype=torch.int64)
    x = ((i * 7919) % 1000 - 500).to(torch.float32) / 37.0
    x[640:768] = 0.0
    x[1000:1064] *= 1e-30
    return x


@pytest.mark.parametrize("name", ALL)
def test_wire_bytes_and_decoded_values_are_pinned(name: str) -> None:
    codec = get_codec(name)
    payload = codec.encode(pinned_vector())
    decoded = codec.decode(payload, 5000)
    assert hashlib.sha256(payload + decoded.numpy().tobytes()).hexdigest()[:16] == PINNED[name]
