"""Quantization semantics shared by every op, kernel and fake-quantized training path.

Symmetric, two's complement; q = clamp(round_half_even(x / scale), qmin, qmax) in fp32 with a
true division. Containers by bit width (the layout the kernels read):

    bits  signed                     unsigned
    16    int16                      int16 holding the u16 bit pattern
    12    int16 in [-2048, 2047]     -
    8     int8                       uint8
    4     uint8, two per byte along the last dim (element 2t in the low nibble)

Only softmax probabilities are unsigned: they are non-negative, so the sign bit buys nothing.
"""

from __future__ import annotations

import torch

BITS = (4, 8, 12, 16)
UNSIGNED_BITS = (4, 8, 16)


def qrange(bits: int, signed: bool = True) -> tuple[int, int]:
    """(qmin, qmax) of a `bits`-wide integer."""
    check_bits(bits, signed)
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def check_bits(bits: int, signed: bool = True, name: str = "bits") -> None:
    allowed = BITS if signed else UNSIGNED_BITS
    if bits not in allowed:
        kind = "signed" if signed else "unsigned"
        raise ValueError(f"{name}: expected one of {allowed} for {kind} data, got {bits!r}")


def container_dtype(bits: int, signed: bool = True) -> torch.dtype:
    """Element dtype of the tensor that stores `bits`-wide integers (int4 is packed in uint8)."""
    check_bits(bits, signed)
    if bits == 4:
        return torch.uint8
    if bits == 8:
        return torch.int8 if signed else torch.uint8
    return torch.int16


def absmax_scale(x: torch.Tensor, bits: int, signed: bool = True, dim=None) -> torch.Tensor:
    """fp32 scale = absmax / qmax over `dim` (all elements if None, kept dims otherwise).

    qmax is the positive end of the type, so the absmax element maps to +-qmax and nothing
    saturates. An all-zero slice gets scale 1 so that dividing by it is harmless.
    """
    a = x.detach().abs()  # abs and max are exact in any float dtype: reduce before widening
    return scale_of_absmax(a.amax() if dim is None else a.amax(dim=dim, keepdim=True), bits, signed)


def scale_of_absmax(absmax: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """The fp32 scale absmax_scale gives a slice of this absmax: absmax / qmax, or 1 if it is 0 (or NaN)."""
    _, qmax = qrange(bits, signed)
    absmax = absmax.float()
    # A tensor divisor: CUDA divides by a Python number as a product with its reciprocal, which
    # can miss the CPU's correctly rounded quotient by one bit (and the CPU is the reference).
    return torch.where(absmax > 0, absmax / torch.full_like(absmax, qmax), torch.ones_like(absmax))


def quantize(x: torch.Tensor, scale, bits: int, signed: bool = True) -> torch.Tensor:
    """Round to nearest even and saturate; returns the integer values in int32 (not packed)."""
    return _rounded(x, scale, bits, signed).to(torch.int32)


def _rounded(x: torch.Tensor, scale, bits: int, signed: bool) -> torch.Tensor:
    """round_half_even(x / scale) saturated, as fp32 integers, with no host sync. NaN gives 0 (the
    kernels do the same; a cast of NaN to an integer type is undefined)."""
    qmin, qmax = qrange(bits, signed)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    # The division is fp32 whatever x's dtype. A half x over a scale with dims promotes to fp32
    # without the extra pass of x.float(); a 0-dim scale would not promote it (it would divide in half).
    narrow = x.dtype in (torch.float16, torch.bfloat16) and scale.dim() > 0
    q = torch.div(x if narrow or x.dtype == torch.float32 else x.float(), scale)
    return q.round_().clamp_(qmin, qmax).nan_to_num_(nan=0.0)  # torch.round rounds half to even


def to_container(q: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """Integer values -> the container the kernels read (int4 packed along the last dim)."""
    if q.is_floating_point() or q.is_complex():  # the cast below would truncate 2.5 to 2
        raise ValueError(f"q: expected integer values in an integer dtype, got {q.dtype} (quantize() returns them)")
    qmin, qmax = qrange(bits, signed)
    if q.numel() and (int(q.min()) < qmin or int(q.max()) > qmax):
        raise ValueError(f"q: values outside [{qmin}, {qmax}] for {bits}-bit {'signed' if signed else 'unsigned'} data")
    if bits == 4:
        return pack_int4(q)
    if bits == 16 and not signed:
        q = torch.where(q > 0x7FFF, q - 0x10000, q)  # the u16 bit pattern, read as int16
    return q.to(container_dtype(bits, signed))


def from_container(c: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """The container's integer values in int64 (int4 unpacked along the last dim)."""
    check_bits(bits, signed)
    if bits == 4:
        return unpack_int4(c, signed)
    x = c.to(torch.int64)
    return x & 0xFFFF if (bits == 16 and not signed) else x


def quantize_to_container(x: torch.Tensor, scale, bits: int, signed: bool = True) -> torch.Tensor:
    """quantize() straight into the kernels' container; saturated by construction, so unchecked."""
    q = _rounded(x, scale, bits, signed)
    if bits == 4:
        return pack_int4(q)
    if bits == 16 and not signed:
        q = torch.where(q > 0x7FFF, q - 0x10000, q)
    return q.to(container_dtype(bits, signed))


def dequantize(q: torch.Tensor, scale) -> torch.Tensor:
    return q.float() * torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (signed or unsigned, any int dtype) -> uint8, two per byte, low nibble first."""
    if q.shape[-1] % 2:
        raise ValueError(f"q: int4 packing needs an even last dimension, got shape {tuple(q.shape)}")
    n = q.to(torch.int16) & 0xF  # via a signed int: a negative float cast to uint8 is undefined
    return (n[..., 0::2] | (n[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """uint8 packed nibbles -> int64 values, the last dim doubled."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8 packed int4, got {packed.dtype}")
    p = packed.to(torch.int64)
    n = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    return torch.where(n >= 8, n - 16, n) if signed else n


def split_planes(x: torch.Tensor, plane_bits: int, planes: int) -> list[torch.Tensor]:
    """x = sum_i planes[i] << (plane_bits * (planes-1-i)), highest plane first.

    The highest plane keeps the sign (arithmetic shift); the lower planes are unsigned, which
    is how a wide operand is emulated on narrow MMAs of mixed signedness.
    """
    x = x.to(torch.int64)
    mask = (1 << plane_bits) - 1
    out = [(x >> (plane_bits * i)) & mask for i in range(planes - 1)]
    out.append(x >> (plane_bits * (planes - 1)))
    return out[::-1]


def combine_planes(planes: list[torch.Tensor], plane_bits: int) -> torch.Tensor:
    """Inverse of split_planes, in int64."""
    acc = torch.zeros_like(planes[0], dtype=torch.int64)
    for p in planes:
        acc = (acc << plane_bits) + p.to(torch.int64)
    return acc
