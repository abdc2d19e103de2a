"""Quantization semantics: rounding, saturation, scales, containers, int4 packing, bit planes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import random_ints
from magicube.ops import (absmax_scale, combine_planes, container_dtype, from_container, pack_int4, qrange,
                          quantize, split_planes, to_container, unpack_int4)

KINDS = [(16, True), (12, True), (8, True), (4, True), (16, False), (8, False), (4, False)]


def test_ranges():
    assert qrange(8) == (-128, 127) and qrange(4) == (-8, 7) and qrange(12) == (-2048, 2047)
    assert qrange(16, signed=False) == (0, 65535) and qrange(4, signed=False) == (0, 15)
    with pytest.raises(ValueError, match="bits: expected one of"):
        qrange(12, signed=False)
    with pytest.raises(ValueError, match=r"bits: expected one of \(4, 8, 12, 16\) for signed data, got 3"):
        qrange(3)


def test_round_half_to_even_and_saturate():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 1000.0, -1000.0])
    assert quantize(x, 1.0, 8).tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -128]
    assert quantize(torch.tensor([-3.0, 300.0, 17.5]), 1.0, 8, signed=False).tolist() == [0, 255, 18]
    assert quantize(torch.tensor([7.5, -8.5, 8.49]), 1.0, 4).tolist() == [7, -8, 7]


def test_quantize_divides_in_fp32():
    x = torch.tensor([1.0, 3.0, 10.0])
    scale = torch.tensor(0.1)
    assert quantize(x, scale, 8).tolist() == torch.round(x / scale).tolist()
    # half data: fp32 division for every shape of scale (a 0-dim one does not promote half)
    h = torch.tensor([0.4995, 1.501, 2.5, 60000.0], dtype=torch.float16)
    for s in (torch.tensor(0.1001), torch.tensor([0.1001]), torch.full((4,), 0.1001)):
        want = (h.float() / s).round().clamp(0, 65535)
        assert torch.equal(quantize(h, s, 16, signed=False).float(), want)


@settings(max_examples=40, deadline=None)
@given(bits_signed=st.sampled_from(KINDS), shape=st.tuples(st.integers(1, 4), st.integers(1, 9)),
       seed=st.integers(0, 2**16))
def test_absmax_scale_maps_the_absmax_to_qmax(bits_signed, shape, seed):
    bits, signed = bits_signed
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape[0], shape[1] * 2, generator=g) * 10
    if not signed:
        x = x.abs()
    qmin, qmax = qrange(bits, signed)
    for dim in (None, -1):
        scale = absmax_scale(x, bits, signed, dim=dim)
        q = quantize(x, scale, bits, signed)
        assert int(q.abs().max()) == qmax
        assert int(q.min()) >= qmin
        # dequantization error at most half a step
        assert bool(((q.float() * scale - x).abs() <= scale / 2 + 1e-6 * x.abs()).all())


def test_zero_tensor_gets_scale_one():
    assert absmax_scale(torch.zeros(3, 4), 8).item() == 1.0
    assert absmax_scale(torch.zeros(3, 4), 8, dim=-1).tolist() == [[1.0]] * 3


@settings(max_examples=40, deadline=None)
@given(bits_signed=st.sampled_from(KINDS), n=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_containers_round_trip(bits_signed, n, seed):
    bits, signed = bits_signed
    q = random_ints((3, 2 * n), bits, signed, torch.Generator().manual_seed(seed))
    c = to_container(q, bits, signed)
    assert c.dtype == container_dtype(bits, signed)
    assert c.shape[-1] == (n if bits == 4 else 2 * n)
    assert torch.equal(from_container(c, bits, signed), q)


def test_container_layouts():
    assert pack_int4(torch.tensor([1, -1, -8, 7])).tolist() == [0xF1, 0x78]
    assert unpack_int4(torch.tensor([0xF1], dtype=torch.uint8)).tolist() == [1, -1]
    assert unpack_int4(torch.tensor([0xF1], dtype=torch.uint8), signed=False).tolist() == [1, 15]
    u16 = to_container(torch.tensor([0, 1, 32767, 32768, 65535]), 16, signed=False)
    assert u16.dtype == torch.int16 and u16.tolist() == [0, 1, 32767, -32768, -1]
    with pytest.raises(ValueError, match=r"values outside \[-8, 7\]"):
        to_container(torch.tensor([8, 0]), 4)
    for bits in (8, 4):  # a float would be truncated
        with pytest.raises(ValueError, match=r"q: expected integer values in an integer dtype, got torch.float32"):
            to_container(torch.tensor([2.5, 0.0]), bits)
    with pytest.raises(ValueError, match="even last dimension"):
        pack_int4(torch.tensor([1, 2, 3]))


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([16, 12, 8]), signed=st.booleans(), seed=st.integers(0, 2**16))
def test_bit_planes(bits, signed, seed):
    if bits == 12 and not signed:
        return
    q = random_ints((50,), bits, signed, torch.Generator().manual_seed(seed))
    plane_bits = 4 if bits == 12 else 8 if bits == 16 else 4
    planes = split_planes(q, plane_bits, bits // plane_bits)
    for low in planes[1:]:
        assert int(low.min()) >= 0 and int(low.max()) < (1 << plane_bits)
    hi_min, hi_max = qrange(plane_bits, signed) if signed else (0, (1 << plane_bits) - 1)
    assert hi_min <= int(planes[0].min()) and int(planes[0].max()) <= hi_max
    assert torch.equal(combine_planes(planes, plane_bits), q)


SCALE_SHAPES = [((3, 40, 16), (3, 1, 1)), ((3, 40, 16), (3, 40, 1)), ((3, 40, 16), ()), ((3, 40, 16), (3, 1, 16)),
                ((2, 5, 6), (2, 1, 1)), ((4, 24), (4, 1))]


@pytest.mark.parametrize("shape, scale_shape", SCALE_SHAPES)
@pytest.mark.parametrize("bits, signed", KINDS)
def test_the_quantize_op_is_the_definition(shape, scale_shape, bits, signed):
    """ops.quantize_to_container (the one-pass op where the scale allows) == quant's definition."""
    from magicube import ops
    from magicube.ops import quant

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(shape, generator=g) * 2 ** (bits - 3)
    x = x if signed else x.abs()
    s = torch.rand(scale_shape, generator=g) + 0.25
    x.view(-1)[:4] = torch.tensor([0.5, 1.5, -2.5, 1e9]) * s.reshape(-1)[0]  # ties and saturation
    got = ops.quantize_to_container(x, s, bits, signed)
    assert got.dtype == container_dtype(bits, signed)
    assert torch.equal(got, quant.quantize_to_container(x, s, bits, signed))


def projection_view(shape, dtype, generator):
    """[3, B, H, T, d] Q, K, V as an attention layer sees them: a view of one [B, T, 3, H, d] tensor."""
    B, H, T, d = shape
    return (torch.randn(B, T, 3, H, d, generator=generator) * 10).to(dtype).permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_layer_absmax_of_the_projection_is_absmax_scale(dtype):
    """The attention layer's min/max reduction in memory order gives absmax_scale's scales per
    (batch x head), bit for bit: an all-zero head (scale 1) and a NaN (scale 1 too) included."""
    from magicube.model.lra import qkv_absmax_scale

    g = torch.Generator().manual_seed(5)
    x = projection_view((2, 3, 40, 16), dtype, g)
    x[1, 0, 2] = 0
    x[2, 1, 0, 7, 3] = float("nan")
    for bits in (8, 4):
        got = qkv_absmax_scale(x, bits)
        assert got.shape == (3, 2, 3, 1, 1) and torch.equal(got, absmax_scale(x, bits, dim=(3, 4)))
        assert got[1, 0, 2].item() == 1.0 and got[2, 1, 0].item() == 1.0  # NaN > 0 is False
        assert got[0, 0, 0].item() == (x[0, 0, 0].abs().max().float() / qrange(bits)[1]).item()


def strided_cases(dtype, g):
    """(x, per-row scale) views the quantize op takes as they are: a layer's Q, K, V, a slice,
    a broadcast leading dim, transposed leading dims, a single row."""
    qkv = projection_view((2, 2, 5, 24), dtype, g)
    sliced = (torch.randn(4, 6, 40, generator=g) * 30).to(dtype)[:, 1:5, 8:32]
    wide = (torch.randn(5, 16, generator=g) * 30).to(dtype).expand(3, 5, 16)
    turned = (torch.randn(6, 4, 8, generator=g) * 30).to(dtype).transpose(0, 1)
    row = (torch.randn(32, generator=g) * 30).to(dtype)
    return [(qkv, torch.rand(3, 2, 2, 1, generator=g).expand(3, 2, 2, 5) + 0.25),
            (sliced, torch.rand(4, 4, generator=g).t() + 0.25),
            (wide, torch.rand(3, 1, generator=g).expand(3, 5) + 0.25),
            (turned, torch.rand(4, 6, generator=g) + 0.25),
            (row, torch.rand((), generator=g) + 0.25)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits, signed", KINDS)
def test_the_quantize_op_reads_strided_views(bits, signed, dtype):
    """A strided x (last dim contiguous) gives the contiguous container of x.contiguous()."""
    from magicube.ops import quant

    g = torch.Generator().manual_seed(bits + signed)
    for x, s in strided_cases(dtype, g):
        x = x if signed else x.abs()
        got = torch.ops.magicube.quantize(x, s, bits, signed)
        assert got.is_contiguous() and got.dtype == container_dtype(bits, signed)
        assert torch.equal(got, torch.ops.magicube.quantize(x.contiguous(), s.contiguous(), bits, signed))
        assert torch.equal(got, quant.quantize_to_container(x.contiguous(), s[..., None], bits, signed))


def test_nan_quantizes_to_zero_and_infinities_saturate():
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), -2.5]])
    for bits in (16, 8, 4):
        qmin, qmax = qrange(bits)
        assert quantize(x, 1.0, bits).tolist() == [[0, qmax, qmin, -2]]
