"""The one-pass quantization kernel: bit-exact against the definition, ties and saturation included."""

import pytest
import torch

from conftest import load_kernels
from magicube import ops
from magicube.ops import quant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KINDS = [(16, True), (12, True), (8, True), (4, True), (16, False), (8, False), (4, False)]
# per (batch x head), per row, per tensor, and a small 2-D case; every one has columns in 8s
SHAPES = [((32, 4096, 64), (32, 1, 1)), ((32, 4096, 64), (32, 4096, 1)), ((3, 7, 40), ()), ((5, 8), (5, 1))]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("quantize")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape, scale_shape", SHAPES)
@pytest.mark.parametrize("bits, signed", KINDS)
def test_matches_the_definition(kernels, bits, signed, shape, scale_shape, dtype):
    x = torch.randn(shape, device="cuda") * 2 ** (bits - 3)
    x = (x if signed else x.abs()).to(dtype)
    s = torch.rand(scale_shape, device="cuda") + 0.25
    x.view(-1)[:5] = (torch.tensor([0.5, 1.5, -2.5, 3e4, -3e4], device="cuda") * s.reshape(-1)[0]).to(dtype)
    got = ops.quantize_to_container(x, s, bits, signed)
    want = quant.quantize_to_container(x.cpu(), s.cpu(), bits, signed)
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("bits", [16, 8])
def test_quotients_next_to_half_integers_round_as_the_division_does(kernels, bits):
    """Quotients a few ulps either side of k + 1/2 (and on it), for scales whose reciprocals are
    inexact, subnormal and huge: a product with 1/s instead of the division rounds 700 of these
    4480 values (16-bit) the other way."""
    scales = torch.tensor([3.0, 0.1, 7.3, 1 / 3, 0.0123, 1e-39, 3e36, 2.5e-38], dtype=torch.float64)
    k = torch.arange(-40, 40, dtype=torch.float64) + 0.5
    rows = []
    for s in scales:
        up = down = (k * s).float()
        near = [up]
        for _ in range(3):  # 1, 2 and 3 ulps either side
            up, down = torch.nextafter(up, up + float("inf")), torch.nextafter(down, down - float("inf"))
            near += [up, down]
        rows.append(torch.cat(near))
    x, s = torch.stack(rows), scales.float()  # a row of 560 values per scale
    got = kernels.quantize(x.cuda(), s.cuda(), bits, True).cpu()
    assert torch.equal(got, quant.quantize_to_container(x, s[:, None], bits, True))


@pytest.mark.parametrize("bits", [16, 8])
def test_every_float16_value_rounds_as_the_division_does(kernels, bits):
    """float16 inputs divide by the fast path with the reciprocal taken once per group when the
    scale lies in [2^-60, 2^60], by the full division otherwise: all 65536 bit patterns (NaNs,
    infinities and subnormals included) against the reference, for scales inside the range, on
    and past both of its ends."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    scales = torch.tensor([1.0, 2.0, 3.0, 0.1, 1 / 3, 7.3, 0.0123, 1e-3, 37.1, 513.7, 2.0**-60, 1.5 * 2.0**-60,
                           2.0**60, 1.7 * 2.0**59, 2.0**-61, 2.0**61, 1e-30, 1e30, 2.5e-38, 3e36])
    xs = x.expand(len(scales), -1).contiguous()
    got = kernels.quantize(xs.cuda(), scales.cuda(), bits, True).cpu()
    assert torch.equal(got, quant.quantize_to_container(xs, scales[:, None], bits, True))


@pytest.mark.parametrize("bits, signed", KINDS)
def test_nan_gives_zero_and_infinities_saturate(kernels, bits, signed):
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 1.0] * 2])
    got = kernels.quantize(x.cuda(), torch.ones(1, device="cuda"), bits, signed).cpu()
    want = quant.quantize_to_container(x, torch.ones(1, 1), bits, signed)
    assert torch.equal(got, want)
    q = quant.quantize(x, torch.ones(1, 1), bits, signed)
    qmin, qmax = quant.qrange(bits, signed)
    assert q[0, :4].tolist() == [0, qmax, qmin, 1]


def test_the_kernel_serves_the_op(kernels):
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    s = torch.full((4,), 0.01, device="cuda")
    assert torch.equal(kernels.quantize(x, s, 8, True), torch.ops.magicube.quantize(x, s, 8, True))
    assert torch.equal(kernels.quantize(x, s, 8, True).cpu(), quant.quantize_to_container(x.cpu(), s.cpu()[:, None], 8))


def strided_cases(dtype, signed):
    """(x, per-row scale) strided views on the GPU: a layer's Q, K, V [3, B, H, T, d] (the last one
    larger than the resident grid, so that every thread carries its digits several times), a
    slice, a broadcast leading dim, transposed leading dims, a single row, rows 16 bytes apart whose
    first row is not on 16 bytes (the op copies it)."""
    g = torch.Generator().manual_seed(6)

    def data(*shape):
        x = torch.randn(shape, generator=g) * 30
        return (x if signed else x.abs()).to(dtype).cuda()

    def scale(*shape):
        return (torch.rand(shape, generator=g) + 0.25).cuda()

    def qkv(B, T, H, d):
        return data(B, T, 3, H, d).permute(2, 0, 3, 1, 4), scale(3, B, H, 1).expand(3, B, H, T)

    return [qkv(2, 5, 2, 24), qkv(2, 96, 4, 64), qkv(7, 3001, 5, 24),
            (data(4, 6, 40)[:, 1:5, 8:32], scale(4, 4).t()),
            (data(5, 16).expand(3, 5, 16), scale(3, 1).expand(3, 5)),
            (data(6, 4, 8).transpose(0, 1), scale(4, 6)),
            (data(32), scale()),
            (data(72)[1:65].view(4, 16), scale(4))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits, signed", KINDS)
def test_strided_views_match_the_reference(kernels, bits, signed, dtype):
    for x, s in strided_cases(dtype, signed):
        got = kernels.quantize(x, s, bits, signed)
        want = torch.ops.magicube.quantize(x.cpu(), s.cpu(), bits, signed)  # CPU: the reference
        assert got.is_contiguous() and torch.equal(got.cpu(), want), (tuple(x.shape), x.stride())
        assert torch.equal(got, kernels.quantize(x.contiguous(), s.contiguous(), bits, signed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_layer_absmax_on_the_gpu_is_the_reference(dtype):
    """The layer's min/max reduction on the GPU == absmax_scale on the CPU, zero head and NaN included."""
    from magicube.model.lra import qkv_absmax_scale

    x = (torch.randn(2, 300, 3, 4, 64) * 10).to(dtype).permute(2, 0, 3, 1, 4)
    x[1, 0, 2] = 0
    x[2, 1, 0, 7, 3] = float("nan")
    assert torch.equal(qkv_absmax_scale(x.cuda(), 8).cpu(), ops.absmax_scale(x, 8, dim=(3, 4)))


@pytest.mark.parametrize("precision", ["8b-8b", "8b-4b"])
def test_the_layer_quantizes_like_the_reference(kernels, precision):
    """Attention.quantize on the GPU (min/max scales, the strided kernel) == on the CPU (the reference)."""
    from magicube.model.lra import QUANTIZED, LRAClassifier, LRAConfig

    config = LRAConfig(max_len=512, emb_dim=256, num_heads=4, num_layers=1, attention=precision)
    attn = LRAClassifier(config).blocks[0].attn
    x = (torch.randn(2, 512, 3, 4, 64) * 3).half().permute(2, 0, 3, 1, 4)
    bits = QUANTIZED[precision][1]
    (want_q, want_s), (got_q, got_s) = attn.quantize(x, bits), attn.quantize(x.cuda(), bits)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s)
