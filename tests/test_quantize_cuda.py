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


def test_the_kernel_serves_the_op(kernels):
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    s = torch.full((4,), 0.01, device="cuda")
    assert torch.equal(kernels.quantize(x, s, 8, True), torch.ops.magicube.quantize(x, s, 8, True))
    assert torch.equal(kernels.quantize(x, s, 8, True).cpu(), quant.quantize_to_container(x.cpu(), s.cpu()[:, None], 8))
