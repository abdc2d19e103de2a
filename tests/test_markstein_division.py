"""The quantizers' fast division of fp16 values by a scale: one reciprocal r, then q0 = RN(y r) and
Markstein's correction q = fma(r, fma(-s, q0, y), q0). The fused projection (`qkv_gemm._quantize`)
takes r = RN(1 / s); the quantize kernel (`csrc/quantize.cu`) refines `rcp.approx` (within an ulp,
by the PTX ISA) by one Newton step. Both take it for 2^-60 <= |s| <= 2^60 and claim the IEEE
quotient there for every fp16 y; this checks the claim on the CPU for every finite fp16 value at the
bounds and at random scales, and for the refined reciprocal from any start within two ulps.

fp32 arithmetic on the CPU rounds as the GPU's does; the fused multiply-add is emulated exactly in
fp64 (the product of two fp32 values is exact there, TwoSum gives the sum's error), and that
emulation is checked first against exact rational arithmetic on sums built to land on fp32 ties.
"""

from fractions import Fraction

import torch

F32, F64 = torch.float32, torch.float64


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """RN32(a * b + c) for fp32 tensors: p = a * b exactly in fp64, p + c = t + e exactly (TwoSum);
    RN32(t) is the answer unless t is an fp32 midpoint that e tips to the other side."""
    p = a.to(F64) * b.to(F64)
    c = c.to(F64).expand_as(p)
    t = p + c
    bb = t - p
    e = (p - (t - bb)) + (c - bb)
    r = t.to(F32)
    rd = r.to(F64)
    other = torch.where(t > rd, torch.nextafter(r, torch.tensor(torch.inf)),
                        torch.nextafter(r, torch.tensor(-torch.inf)))
    tie = (t != rd) & (t == (rd + other.to(F64)) / 2)
    toward_other = torch.where(t > rd, e > 0, e < 0)
    return torch.where(tie & toward_other, other, r)


def _round_to_f32(x: Fraction) -> float:
    """x rounded to fp32, to nearest and ties to even (x in fp32's normal range)."""
    near = torch.tensor(float(x), dtype=F32)
    candidates = (torch.nextafter(near, torch.tensor(-torch.inf)), near, torch.nextafter(near, torch.tensor(torch.inf)))
    return min(candidates, key=lambda c: (abs(Fraction(c.item()) - x), c.view(torch.int32).item() & 1)).item()


def test_the_fma_emulation_rounds_ties_exactly():
    """a b = 2^-24 (1 - 2^-46) beside c = +-(1 + k 2^-23): the fp64 sum lands on an fp32 midpoint that
    the exact sum lies just below; rounding fp64 to fp32 again would tie to even, wrongly for odd k."""
    k = torch.arange(64, dtype=F64)
    c = torch.cat([1 + k * 2.0 ** -23, -(1 + k * 2.0 ** -23)]).to(F32)
    a = torch.full_like(c, 2.0 ** -24 * (1 + 2.0 ** -23))
    b = torch.cat([torch.full((64,), 1 - 2.0 ** -23), torch.full((64,), -(1 - 2.0 ** -23))]).to(F32)
    got = _fma32(a, b, c)
    want = [_round_to_f32(Fraction(x) * Fraction(y) + Fraction(z))
            for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.tolist() == want
    double_rounded = (a.to(F64) * b.to(F64) + c.to(F64)).to(F32)
    assert (double_rounded != got).sum() == 64  # the cases are ties indeed


def _fp16_values() -> torch.Tensor:
    y = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return y[torch.isfinite(y)].to(F32)


def _scales(count: int, seed: int) -> list[float]:
    """The bounds, a few plain values, and `count` random scales over [2^-60, 2^60], both signs."""
    g = torch.Generator().manual_seed(seed)
    random = (1 + torch.rand(count, generator=g, dtype=F64)) * 2.0 ** torch.randint(-60, 60, (count,), generator=g)
    scales = torch.cat([torch.tensor([2.0 ** -60, 2.0 ** 60, 1.0, 3.0, 0.1, 1 / 3], dtype=F64), random]).to(F32)
    return scales.tolist() + (-scales).tolist()


def _assert_quotients(y: torch.Tensor, s: torch.Tensor, r: torch.Tensor):
    q0 = y * r
    q = _fma32(r, _fma32(-s, q0, y), q0)
    want = y / s
    # -0 / s gives +0 by the correction: the same integer after the kernels' rounding
    assert torch.equal(q, want), (s.item(), r.item(), y[q != want][:4].tolist())


def test_markstein_division_is_the_ieee_quotient_for_every_fp16_value():
    """The fused projection's: r = RN(1 / s)."""
    y = _fp16_values()
    for s in _scales(200, 0):
        s = torch.tensor(s, dtype=F32)
        _assert_quotients(y, s, 1 / s)


def test_the_refined_reciprocal_gives_the_same_quotients():
    """The quantize kernel's: r0 = rcp.approx(s), any fp32 value within two ulps of RN(1 / s), then
    r = fma(r0, fma(-s, r0, 1), r0), which must lie within an ulp of 1 / s."""
    y = _fp16_values()
    inf = torch.tensor(torch.inf)
    for s in _scales(30, 1):
        s = torch.tensor(s, dtype=F32)
        r0 = (1 / s).view(1)
        for _ in range(2):
            r0 = torch.cat([torch.nextafter(r0[:1], -inf), r0, torch.nextafter(r0[-1:], inf)])
        for start in r0:
            r = _fma32(start, _fma32(-s, start, torch.tensor(1.0)), start)
            assert abs(r.double() - 1 / s.double()) < (torch.nextafter(r.abs(), inf) - r.abs()).double(), s.item()
            _assert_quotients(y, s, r)
