"""Wire codecs for the outer gradients (pseudo-gradients) that peers exchange.

Outer gradients cross slow WAN links, so their size sets the step time; quantizing them is the
cheapest lever. Every payload is a concatenation of little-endian arrays (the wire contract; hosts
are assumed little-endian, as x86 and ARM are), for a flat vector of ``n`` float32 values:

``fp32``  ``n`` float32 values (4·n bytes). Lossless.
``bf16``  ``n`` bfloat16 values, round-to-nearest-even from float32 (2·n bytes).
``int8``  blockwise absmax, block 256 (last block may be short), ``nb = ceil(n/256)``:
          ``nb`` float32 scales ``s = absmax/127`` (0 for an all-zero block), then ``n`` int8
          codes ``q = round(x/s)`` clamped to [-127, 127]. Value = ``q·s``. Bytes: 4·nb + n.
``fp4``   Streaming DiLoCo's FP4 E3M0, block 64, ``nb = ceil(n/64)``: ``nb`` float32 scales
          ``s = absmax`` of the block, then ``ceil(n/2)`` bytes of 4-bit codes, element 2i in the
          low nibble and 2i+1 in the high nibble; an odd ``n`` pads the last high nibble with the
          zero code 0x7, which decoders ignore. Code = ``sign << 3 | e``: ``e`` in 0..6 means
          magnitude ``s·2^-e``, ``e = 7`` means zero (encoded with sign 0). Encoding picks the
          nearest level in log2 space, ``e = round(-log2(|x|/s))`` clamped to [0, 6]; magnitudes
          below ``s·2^-6.5`` become zero. Value = ``±s·2^-e``. Bytes: 4·nb + ceil(n/2).
``q2``    two magnitudes per block, block 64, ``nb = ceil(n/64)``: a block's values split at its
          RMS ``r = sqrt(Σx²/len)`` (over its real values) into the high ones, ``|x| > r``, and
          the low ones (the rest, zeros included); ``lo`` and ``hi`` are the mean ``|x|`` of each
          (0 for an empty class), rounded to bfloat16. Then ``nb`` bfloat16 ``lo`` scales, ``nb``
          bfloat16 ``hi`` scales and ``ceil(n/4)`` bytes of 2-bit codes, element 4i + j in bits
          2j..2j+1, the last byte zero-padded. Code = ``sign << 1 | high``; value ``±hi`` or
          ``±lo``, so no value decodes to zero but in a block whose scales are 0. The split at
          the RMS with class means is Lloyd-Max's 2-bit quantizer for a Gaussian block, within
          1 % of its error, and keeps decoded values on their grid: a decoded block's RMS lies
          between its two magnitudes. Bytes: 4·nb + ceil(n/4).
``q1``    one magnitude per block, block 64, ``nb = ceil(n/64)``: ``nb`` bfloat16 scales ``m``, the
          mean ``|x|`` of the block (over its real values; computed as absmax·mean(|x|/absmax), so
          that no sum overflows), then ``ceil(n/8)`` bytes of sign bits, element 8i + j in bit j,
          the last byte zero-padded. Bit = ``x < 0``; value ``±m``: for signs alone, ``m`` is the
          scale of least squared error (EF-SignSGD's, Karimireddy et al. 2019). Bytes: 2·nb +
          ceil(n/8).
``topk2`` ``topk4``  SparseLoCo-style chunked top-k with b = 2 or 4 bits per value: chunks of
          ``C = 256`` values, ``nc = ceil(n/C)``, ``k`` slots per chunk (``--topk``: a fraction
          of C, rounded, at least 1; default 1/8). ``nc`` float32 scales ``s = absmax`` of the chunk, then
          ``nc·k`` uint8 indices (chunk by chunk), then ``nc·k`` b-bit codes packed low bits
          first, ``8/b`` per byte, the last byte zero-padded. A chunk's selection is its k largest
          |x| (``torch.topk``) among its nonzero values; its indices are written ascending, and
          when fewer than k values are nonzero the unused slots repeat the last used index with
          code 0 (a chunk of zeros: index 0, code 0 throughout, scale 0). Slot i > 0 is used iff
          its index is greater than slot i−1's; indices never decrease, and a used slot never
          follows an unused one. Code = ``sign << (b−1) | m``, ``L = 2^(b−1)`` magnitude levels,
          ``m = round(|x|/s·L − 1)`` clamped to [0, L−1]; value ``±s·(m+1)/L``, so a selected
          value never decodes to zero. Bytes: 4·nc + nc·k + ceil(nc·k·b/8). With k > 32 the
          indices of a chunk are instead a 256-bit mask (32 bytes; bit j of byte i: position
          8i + j), its set positions ascending taking the first slots and unused slots code 0.

Lossy codecs pair with error feedback (``strategies.Strategy.outer_gradient``): what a replica
did not send of a fragment's outer gradient is added to its next one. A top-k codec's averages are
denser than what each member sent: the owner of a butterfly slice encodes its aggregate with
``mean_codec(M)``, the same chunked format with min(C, M·k) slots and 8-bit values, which keeps
every coordinate some member sent (the union of M selections) and quantizes only the values.

Decoded values are already on the codec's grid, so decode→encode→decode returns the same tensor.
``decode`` takes payloads from untrusted peers: it checks the length against the ``numel`` the
caller expects before allocating anything and rejects non-finite or negative scales and values,
always with :class:`UserError`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from p2p_cocodc.errors import UserError
from p2p_cocodc.names import CODEC_NAMES, DEFAULT_TOPK

__all__ = ["CODECS", "Codec", "SyncCodecs", "TopKCodec", "decode_mean", "get_codec", "mean_in_order"]


class Codec(ABC):
    """One wire format; the public methods validate, subclasses only implement the format."""

    name: str
    block: int = 1  # values quantized together; slices cut on block edges encode like the whole

    def encode(self, x: torch.Tensor) -> bytes:
        """Serialize a 1-D float tensor (any device, any strides) to wire bytes."""
        if not isinstance(x, torch.Tensor):
            raise UserError(f"{self.name}: encode expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 1 or not x.is_floating_point():
            raise UserError(f"{self.name}: encode expects a 1-D float tensor, got {x.dim()}-D {x.dtype}")
        x = x.detach().to(torch.float32)
        if not _all_finite(x):
            raise UserError(f"{self.name}: cannot encode NaN or Inf values (diverged training?)")
        return self._encode(x)

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Parse an untrusted payload into a new 1-D float32 CPU tensor of ``numel`` values."""
        if not isinstance(payload, bytes | bytearray):
            raise UserError(f"{self.name}: payload must be bytes, got {type(payload).__name__}")
        expected = self.wire_bytes(numel)
        if len(payload) != expected:
            raise UserError(
                f"{self.name}: payload for {numel} values must be {expected} bytes, got {len(payload)} bytes"
            )
        # bytearray copy: the result must own writable memory, and bytes are read-only.
        buf = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)
        )
        out = self._decode(buf, numel)
        if not _all_finite(out):
            raise UserError(f"{self.name}: payload decodes to NaN or Inf values")
        return out

    def wire_bytes(self, numel: int) -> int:
        """Exact payload size for ``numel`` values; used to validate before allocating."""
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise UserError(f"{self.name}: numel must be a non-negative int, got {numel!r}")
        return self._wire_bytes(numel)

    @property
    def lossless(self) -> bool:
        return False

    def mean_codec(self, members: int) -> Codec:
        """The format the owner of a butterfly slice encodes the aggregate of ``members`` members'
        slices in (the codec itself, but for a sparse one)."""
        return self

    def round_bytes(self, numel: int, members: int) -> int:
        """What one member of a butterfly round of ``members`` sends of a vector of ``numel`` values,
        (M − 1)/M of it, or receives: the vector's slices encoded, plus their means encoded."""
        return self.wire_bytes(numel) + self.mean_codec(members).wire_bytes(numel)

    def bound_bytes(self, numel: int) -> int:
        """The largest payload for ``numel`` values that any message of a round with this codec
        carries, whatever the number of members."""
        return self.wire_bytes(numel)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receivers of ``encode(x)`` decode (a new fp32 CPU tensor)."""
        return self.decode(self.encode(x), x.numel())

    @abstractmethod
    def _wire_bytes(self, numel: int) -> int: ...

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> bytes:
        """``x`` is a finite 1-D float32 tensor."""

    @abstractmethod
    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """``buf`` is writable uint8 of exactly ``wire_bytes(numel)`` bytes."""


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite: its least and its greatest are (torch documents that
    aminmax propagates a NaN; an infinity is one of the two). About 10x faster than
    ``isfinite(x).all()``."""
    if x.numel() == 0:
        return True
    least, greatest = torch.aminmax(x)
    return math.isfinite(least) and math.isfinite(greatest)


def _to_bytes(*parts: torch.Tensor) -> bytes:
    """Concatenate the raw bytes of tensors (any device) without a numpy round trip."""
    raw = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
    out = bytearray(sum(r.numel() for r in raw))
    if out:
        dst = torch.frombuffer(out, dtype=torch.uint8)
        pos = 0
        for r in raw:
            dst[pos : pos + r.numel()].copy_(r)
            pos += r.numel()
    return bytes(out)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """View ``x`` as (nblocks, block), zero-padded; zero padding never changes a block absmax."""
    return F.pad(x, (0, -x.numel() % block)).view(-1, block)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes (uint8) packed low bits first, 8/bits a byte, the last byte zero-padded."""
    per = 8 // bits
    grouped = F.pad(codes, (0, -codes.numel() % per)).view(-1, per)
    packed = torch.zeros(grouped.shape[0], dtype=torch.uint8)
    for j in range(per):
        packed |= grouped[:, j] << (j * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` ``bits``-bit codes of ``_pack``'s bytes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:count]


def _codes(packed: torch.Tensor, bits: int, nblocks: int, block: int) -> torch.Tensor:
    """``_pack``'s codes as (nblocks, block) int64 indices, the last block's padding code 0."""
    codes = _unpack(packed, bits, nblocks * block)
    return F.pad(codes, (0, nblocks * block - codes.numel())).view(nblocks, block).long()


def _first(blocks: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` values of decoded blocks, in a tensor of their own (no padding kept)."""
    values = blocks.view(-1)
    return values if values.numel() == numel else values[:numel].clone()


class _Magnitudes(NamedTuple):
    """A vector's blocks and their magnitudes scaled by each block's absmax (``_magnitudes``)."""

    blocks: torch.Tensor  # (nblocks, block), zero-padded
    magnitude: torch.Tensor  # |blocks|
    absmax: torch.Tensor  # per block
    unit: torch.Tensor  # |blocks| / absmax (÷ 1 in an all-zero block): sums and squares stay in range
    real: torch.Tensor  # 1 on the vector's values, 0 on the last block's padding


def _magnitudes(x: torch.Tensor, block: int) -> _Magnitudes:
    blocks = _blocks(x, block)
    magnitude = blocks.abs()
    absmax = magnitude.amax(1)
    unit = magnitude / torch.where(absmax > 0, absmax, 1.0)[:, None]
    return _Magnitudes(blocks, magnitude, absmax, unit, _blocks(torch.ones_like(x), block))


def _check_scales(name: str, scales: torch.Tensor) -> None:
    """Honest encoders only emit finite, non-negative scales; anything else is a hostile payload."""
    bad = ~(torch.isfinite(scales) & (scales >= 0))
    if bool(bad.any()):
        block = int(bad.nonzero()[0, 0])
        raise UserError(
            f"{name}: block {block} has invalid scale {float(scales[block])} (must be finite and >= 0)"
        )


class Fp32Codec(Codec):
    """Lossless baseline."""

    name = "fp32"

    @property
    def lossless(self) -> bool:
        return True

    def _wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode(self, x: torch.Tensor) -> bytes:
        return _to_bytes(x)

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf.view(torch.float32)


class Bf16Codec(Codec):
    """Halves traffic; keeps fp32's exponent range so no scales are needed."""

    name = "bf16"

    def _wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode(self, x: torch.Tensor) -> bytes:
        y = x.to(torch.bfloat16)
        if not _all_finite(y):
            raise UserError("bf16: values beyond the bfloat16 range (~3.39e38) cannot be encoded")
        return _to_bytes(y)

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf.view(torch.bfloat16).to(torch.float32)


class Int8Codec(Codec):
    """~3.9x smaller than fp32 with error at most half a quantization step per element."""

    name = "int8"
    block = 256

    def _wire_bytes(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + numel

    def _encode(self, x: torch.Tensor) -> bytes:
        xb = _blocks(x, self.block)
        scales = xb.abs().amax(dim=1) / 127
        # An all-zero block has scale 0 and codes 0; divide by 1 there instead of 0.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = (xb / divisor[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return _to_bytes(scales, q.reshape(-1)[: x.numel()])

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        nb = -(-numel // self.block)
        scales = buf[: 4 * nb].view(torch.float32)
        _check_scales(self.name, scales)
        q = buf[4 * nb :].view(torch.int8)
        if bool((q == -128).any()):
            raise UserError("int8: code -128 is outside the valid range [-127, 127]")
        return q.to(torch.float32).mul_(scales.repeat_interleave(self.block)[:numel])


# Decoded value of each 4-bit code (sign << 3 | e) as a multiple of the block scale; both zero
# codes give +0.0 so a re-encode reproduces the same bits.
_FP4_TABLE = torch.tensor(
    [2.0**-e for e in range(7)] + [0.0] + [-(2.0**-e) for e in range(7)] + [0.0],
    dtype=torch.float32,
)


class Fp4Codec(Codec):
    """Streaming DiLoCo's FP4 E3M0: ~7.1x smaller; relative error at most 2^0.5 above s·2^-6."""

    name = "fp4"
    block = 64
    zero_code = 7

    def _wire_bytes(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + -(-numel // 2)

    def _encode(self, x: torch.Tensor) -> bytes:
        xb = _blocks(x, self.block)
        scales = xb.abs().amax(dim=1)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        t = torch.log2(xb.abs() / divisor[:, None]).neg_()  # +inf for zeros
        e = t.round().clamp_(0, 6).to(torch.uint8)
        zero = t > 6.5
        codes = torch.where(zero, self.zero_code, e | ((xb < 0).to(torch.uint8) << 3))
        # Padded elements are zeros, so they already carry the zero code; nblocks*64 is even.
        pairs = codes.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return _to_bytes(scales, packed[: -(-x.numel() // 2)])

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        nb = -(-numel // self.block)
        scales = buf[: 4 * nb].view(torch.float32)
        _check_scales(self.name, scales)
        packed = buf[4 * nb :]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
        return _FP4_TABLE[codes.long()].mul_(scales.repeat_interleave(self.block)[:numel])


class Q1Codec(Codec):
    """A sign a value and one magnitude per block of 64 (see the module docstring): 1.25 bits a
    value, 25.6x smaller than fp32, half of q2's bytes; what it leaves out is error feedback's."""

    name = "q1"
    block = 64

    def _wire_bytes(self, numel: int) -> int:
        return 2 * -(-numel // self.block) + -(-numel // 8)

    def _encode(self, x: torch.Tensor) -> bytes:
        m = _magnitudes(x, self.block)
        scales = m.unit.sum(1).div_(m.real.sum(1).clamp_(min=1)).mul_(m.absmax).to(torch.bfloat16)
        signs = _pack((m.blocks < 0).to(torch.uint8).reshape(-1), 1)  # nblocks·64 divides by 8
        return _to_bytes(scales, signs[: -(-x.numel() // 8)])

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        nb = -(-numel // self.block)
        scales = buf[: 2 * nb].view(torch.bfloat16).float()
        _check_scales(self.name, scales)
        table = torch.stack([scales, -scales], 1)  # block j's two values, by sign bit: m, -m
        return _first(table.gather(1, _codes(buf[2 * nb :], 1, nb, self.block)), numel)


class Q2Codec(Codec):
    """Two magnitudes per block of 64 (see the module docstring): 2.5 bits a value, ~12.8x smaller
    than fp32, with about 12 % of a Gaussian block's energy in its error (fp4: ~4 %)."""

    name = "q2"
    block = 64

    def _wire_bytes(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + -(-numel // 4)

    def _encode(self, x: torch.Tensor) -> bytes:
        m = _magnitudes(x, self.block)
        xb = m.magnitude
        # the RMS as absmax·rms(x/absmax): the squares of tiny values would underflow
        rms = m.unit.square().sum(1).div_(m.real.sum(1).clamp_(min=1)).sqrt_().mul_(m.absmax)
        high = xb > rms[:, None]  # padding is 0, never above the RMS
        low = m.real.bool() & ~high
        scales = torch.stack([_class_mean(xb, low), _class_mean(xb, high)]).to(torch.bfloat16)
        codes = high.to(torch.uint8) | ((m.blocks < 0).to(torch.uint8) << 1)
        packed = _pack(codes.reshape(-1), 2)  # nblocks·64 divides by 4
        return _to_bytes(scales.reshape(-1), packed[: -(-x.numel() // 4)])

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        nb = -(-numel // self.block)
        scales = buf[: 4 * nb].view(torch.bfloat16).float().view(2, nb)
        for scale in scales:  # lo, then hi: block j's are scales[:, j]
            _check_scales(self.name, scale)
        table = torch.cat([scales, -scales]).t()  # block j's four values, by code: lo, hi, -lo, -hi
        return _first(table.gather(1, _codes(buf[4 * nb :], 2, nb, self.block)), numel)


def _class_mean(values: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of the finite, non-negative ``values`` where ``member``; 0 for a row with
    none (the product keeps a member's value and makes the others +0, as a select would, faster)."""
    return (values * member).sum(1).div_(member.sum(1).clamp_(min=1))


class TopKCodec(Codec):
    """Chunked top-k with low-bit values (see the module docstring): with k = 32 of 256 and 2 bits,
    23x smaller than fp32; what it leaves out is error feedback's to carry."""

    block = 256  # the chunk C: indices fit a byte, and slices cut on chunk edges encode like the whole

    def __init__(self, name: str, slots: int, bits: int) -> None:
        if bits not in (2, 4, 8) or not 1 <= slots <= self.block:
            raise ValueError(f"top-k needs 2, 4 or 8 bits and 1..{self.block} slots, got {bits}, {slots}")
        self.name, self.slots, self.bits = name, slots, bits
        self.levels = 2 ** (bits - 1)
        self.mask = 8 * slots > self.block  # positions as a 256-bit mask: fewer bytes than indices
        self.position_bytes = self.block // 8 if self.mask else slots

    def mean_codec(self, members: int) -> Codec:
        if members < 1:
            raise UserError(f"{self.name}: an average needs at least one member, got {members}")
        return TopKCodec(f"{self.name} mean of {members}", min(self.block, members * self.slots), 8)

    def bound_bytes(self, numel: int) -> int:
        return max(self.wire_bytes(numel), self.mean_codec(self.block).wire_bytes(numel))

    def _wire_bytes(self, numel: int) -> int:
        chunks = -(-numel // self.block)
        return chunks * (4 + self.position_bytes) + -(-chunks * self.slots * self.bits // 8)

    def _encode(self, x: torch.Tensor) -> bytes:
        xb = _blocks(x, self.block)
        absolute = xb.abs()
        scales = absolute.amax(dim=1)
        magnitude, index = absolute.topk(self.slots, dim=1)
        used = magnitude > 0
        # used slots first, by index; unused after them (their order is irrelevant: they are refilled)
        order = torch.where(used, index, index + self.block).argsort(dim=1)
        index, used = index.gather(1, order), used.gather(1, order)
        index = torch.where(used, index, -1).cummax(dim=1).values.clamp_(min=0)
        value = xb.gather(1, index)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
        m = (value.abs() / divisor * self.levels - 1).round_().clamp_(0, self.levels - 1).to(torch.uint8)
        codes = torch.where(used, m | ((value < 0).to(torch.uint8) << (self.bits - 1)), 0)
        if self.mask:  # bit j of byte i: position 8i + j (an unused slot's repeated index adds 0)
            bits = torch.zeros_like(xb, dtype=torch.uint8).scatter_add_(1, index, used.to(torch.uint8))
            positions = _pack(bits.reshape(-1), 1)
        else:
            positions = index
        return _to_bytes(scales, positions.to(torch.uint8).reshape(-1), _pack(codes.reshape(-1), self.bits))

    def _decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = -(-numel // self.block)
        count = chunks * self.slots
        scales = buf[: 4 * chunks].view(torch.float32)
        _check_scales(self.name, scales)
        end = 4 * chunks + chunks * self.position_bytes
        positions = buf[4 * chunks : end].view(chunks, self.position_bytes)
        codes = _unpack(buf[end:], self.bits, count).view(chunks, self.slots)
        if self.mask:
            index, used = self._from_mask(positions, codes, numel)
        else:
            index, used = self._from_indices(positions.long(), codes, numel)
        half = self.levels
        magnitude = ((codes & (half - 1)).float() + 1) / half * scales[:, None]
        value = torch.where(codes >= half, -magnitude, magnitude)
        out = torch.zeros(chunks, self.block)
        out.scatter_add_(1, index, torch.where(used, value, 0.0))  # unused slots add +0
        return out.view(-1)[:numel].clone() if numel % self.block else out.view(-1)

    def _from_mask(
        self, mask: torch.Tensor, codes: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, used) per slot from a chunk's 256-bit mask: the set positions ascending, then
        unused slots (code 0) at the last of them."""
        chunks = mask.shape[0]
        bits = _unpack(mask.reshape(-1), 1, chunks * self.block).view(chunks, self.block).bool()
        count = bits.sum(1)
        if bool((count > self.slots).any()):
            raise UserError(f"{self.name}: a chunk's mask has more than {self.slots} positions")
        used = torch.arange(self.slots)[None, :] < count[:, None]
        if bool((codes[~used] != 0).any()):
            raise UserError(f"{self.name}: a chunk's codes beyond its mask's positions must be 0")
        if numel % self.block and bool(bits[-1, numel % self.block :].any()):
            raise UserError(f"{self.name}: a position points beyond the {numel} values")
        # the k-th set position of each chunk, by a stable sort of the unset ones behind the set ones
        order = torch.argsort((~bits).to(torch.uint8), dim=1, stable=True)[:, : self.slots]
        return torch.where(used, order, 0), used

    def _from_indices(
        self, index: torch.Tensor, codes: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, used) per slot from a chunk's ascending indices (see the module docstring)."""
        chunks = index.shape[0]
        step = index.diff(dim=1)
        if bool((step < 0).any()):
            raise UserError(
                f"{self.name}: chunk {int((step < 0).any(1).nonzero()[0, 0])} has decreasing indices"
            )
        used = torch.cat([torch.ones(chunks, 1, dtype=torch.bool), step > 0], dim=1)
        if bool((used[:, 1:] & ~used[:, :-1]).any()) or bool((codes[~used] != 0).any()):
            raise UserError(f"{self.name}: a chunk's unused slots must end it, repeat its last index, code 0")
        beyond = used & (index + torch.arange(chunks)[:, None] * self.block >= numel)
        if bool(beyond.any()):
            raise UserError(f"{self.name}: an index points beyond the {numel} values")
        return index, used


def _topk_slots(fraction: float) -> int:
    """Slots per chunk for a --topk fraction: rounded, at least 1."""
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise UserError(f"--topk must be a fraction in (0, 1], got {fraction!r}")
    return max(1, min(TopKCodec.block, round(fraction * TopKCodec.block)))


def _make(name: str, topk: float) -> Codec:
    bits = {"topk2": 2, "topk4": 4}[name]
    return TopKCodec(name, _topk_slots(topk), bits)


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Fp32Codec(),
        Bf16Codec(),
        Int8Codec(),
        Fp4Codec(),
        Q2Codec(),
        Q1Codec(),
        _make("topk2", DEFAULT_TOPK),
        _make("topk4", DEFAULT_TOPK),
    )
}
if tuple(CODECS) != CODEC_NAMES:  # the CLI offers CODEC_NAMES without importing this module
    raise ImportError(f"codecs {tuple(CODECS)} differ from names.CODEC_NAMES {CODEC_NAMES}")


def get_codec(name: str, topk: float = DEFAULT_TOPK) -> Codec:
    """Look a codec up by its config/CLI name; ``topk``: a top-k codec's share of each chunk."""
    if name in ("topk2", "topk4") and topk != DEFAULT_TOPK:
        return _make(name, topk)
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise UserError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}") from None


@dataclass(frozen=True)
class SyncCodecs:
    """The wire codec of each fragment sync: ``steady`` (--codec) while the swarm sends at its
    schedule's own spacing, ``paced`` (--paced-codec; None: ``steady`` throughout) for a sync sent
    while a link paces the swarm (a send slot wider than ⌊H/N⌋). Which one a sync uses follows from
    the schedule's spacing at its send, which every replica holds identically, so every member of
    a round encodes it alike. ``feedback``: a lossy codec's error is fed back
    (``Strategy.outer_gradient``)."""

    steady: Codec
    paced: Codec | None = None
    feedback: bool = False

    def at(self, paced: bool) -> Codec:
        """The codec of a sync sent with the swarm paced (``paced``) or not."""
        return self.paced if paced and self.paced is not None else self.steady

    def all(self) -> list[Codec]:
        return [c for c in (self.steady, self.paced) if c is not None]

    def feeds_back(self, codec: Codec) -> bool:
        return self.feedback and not codec.lossless

    def largest(self, numel: int) -> int:
        """The largest payload of ``numel`` values any sync's messages carry (``Codec.bound_bytes``)."""
        return max(c.bound_bytes(numel) for c in self.all())


def decode_mean(payloads: Sequence[bytes], codec: Codec, numel: int) -> torch.Tensor:
    """Average peers' payloads; a fixed fp32 accumulation order makes every peer agree bitwise."""
    return mean_in_order([codec.decode(payload, numel) for payload in payloads])


def mean_in_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in the given order, then divide: the same float ops wherever the mean is taken."""
    if not values:
        raise UserError("a mean needs at least one payload")
    total = values[0].clone()
    for value in values[1:]:
        total.add_(value)
    return total.div_(len(values))
