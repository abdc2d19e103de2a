"""The Q/K/V projection that quantizes in its GEMM epilogue: against the reference (projection in
fp32, rounded to fp16 once, then the ops' quantization).

With integer-valued data every product and partial sum is exact in fp32, so any accumulation
order gives the reference's fp16 projection and the containers must match bit for bit. With
random data the order can move fp16(x @ W^T + b) by its last bit, rarely.
"""

import pytest
import torch

from conftest import poison_allocator, shifted
from magicube import ops
from magicube.ops import qkv_gemm
from magicube.ops import quant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (B, T, E, heads): the target's head dim 64; rows and columns that fill no tile; one row; head dims of
# 40 and 8 (vector stores of 8 bytes), 6 (E 30: rows off 16 bytes, padded), 5 (odd: 8 and 16 bits only;
# byte stores); 16, 128 and 256 (tiles of 8 heads, of one, and one head over two tiles: a tile's scales
# as scalars where it holds 1 to 8 whole heads, per column otherwise); 63 with T 200 (odd head rows in
# row tiles that straddle batches)
SHAPES = [(2, 256, 256, 4), (3, 100, 96, 3), (1, 1, 128, 2), (2, 131, 320, 8), (1, 77, 48, 6), (2, 9, 30, 5),
          (1, 20, 40, 8), (1, 33, 64, 4), (1, 40, 128, 1), (1, 17, 256, 1), (3, 200, 189, 3)]


def _reference(x, w, b, scale, heads, bits):
    return torch.ops.magicube.qkv_projection(x.cpu(), w.cpu(), None if b is None else b.cpu(), scale.cpu(), heads,
                                             bits)


def _integer_problem(B, T, E, heads, g):
    """Small integers in fp16: |x @ W^T + b| < 2^24, every step exact in fp32."""
    x = torch.randint(-8, 9, (B, T, E), generator=g).half()
    w = torch.randint(-8, 9, (3 * E, E), generator=g).half()
    b = torch.randint(-64, 65, (3 * E,), generator=g).half()
    return x, w, b


@pytest.mark.parametrize("bits", [8, 16, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_integer_data_is_bit_exact(shape, bits):
    B, T, E, heads = shape
    if bits == 4 and (E // heads) % 2:
        pytest.skip("4-bit containers need an even head dim")
    g = torch.Generator().manual_seed(sum(shape) + bits)
    x, w, b = _integer_problem(B, T, E, heads, g)
    # scales that make ties (2, 0.5, 4) and inexact quotients, one per Q/K/V x head
    pool = torch.tensor([2.0, 0.5, 4.0, 0.3, 3.7, 1 / 3, 11.0, 0.07])
    scale = pool[torch.randint(0, len(pool), (3, heads), generator=g)] * (2.0 ** (16 - bits) if bits < 16 else 1)
    for bias in (b, None):
        want = _reference(x, w, bias, scale, heads, bits)
        poison_allocator(0x5A, torch.uint8)
        got = ops.qkv_projection(x.cuda(), w.cuda(), None if bias is None else bias.cuda(), scale.cuda(), heads=heads,
                                 bits=bits)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
        assert (want != 0).any()  # the data reaches beyond zero


@pytest.mark.parametrize("bits", [8, 16, 4])
def test_random_data_within_the_error_bound_of_fp32_accumulation(bits):
    """The model's magnitudes (unit activations, Xavier weights), scales that use the whole range.
    Any fp32 accumulation of x @ W^T + b (the reference's, cuBLAS's, the tensor cores') lies within
    E * 2^-23 * sum |terms| of the exact value, and its fp16 rounding within 2^-11 of that: each
    quantized value must lie between the quantizations of the interval's ends. Differences from
    the reference are rare, and at 8 bits one step at most."""
    g = torch.Generator().manual_seed(bits)
    B, T, E, heads = 4, 1000, 256, 4
    x = torch.randn(B, T, E, generator=g).half()
    w = (torch.randn(3 * E, E, generator=g) * (2 / (4 * E)) ** 0.5).half()
    b = (torch.randn(3 * E, generator=g) / 10).half()
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    bound = torch.nn.functional.linear(x.double().abs(), w.double().abs(), b.double().abs()) * E * 2.0 ** -23
    bound = bound + (exact.abs() + bound) * 2.0 ** -11
    qmax = (1 << (bits - 1)) - 1
    scale = exact.view(B * T, 3, heads, -1).abs().amax(dim=(0, 3)).float() / qmax
    got = quant.from_container(ops.qkv_projection(x.cuda(), w.cuda(), b.cuda(), scale.cuda(), heads=heads,
                                                  bits=bits).cpu(), bits)

    def quantized(y):  # [B, T, 3E] -> the containers' order, as integers
        view = y.view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
        return quant.quantize(view, scale.view(3, 1, heads, 1, 1).double(), bits).reshape(got.shape)

    assert ((quantized(exact - bound) <= got) & (got <= quantized(exact + bound))).all()
    want = quant.from_container(_reference(x, w, b, scale, heads, bits), bits)
    assert (got != want).float().mean() < 1e-3
    if bits == 8:
        assert (got - want).abs().max() <= 1
    assert want.abs().max() >= qmax - 1


@pytest.mark.parametrize("bits", [8, 16])
def test_overflow_nan_and_scales_off_the_fast_path(bits):
    """fp16 overflow (inf saturates), inf times a zero weight (NaN gives 0), and scales outside
    [2^-60, 2^60] or zero, which take the full division: all as the reference."""
    g = torch.Generator().manual_seed(3)
    B, T, E, heads = 2, 70, 64, 2
    x, w, b = _integer_problem(B, T, E, heads, g)
    x[0, :5] *= 1000  # |y| up to ~10^6: past fp16's 65504
    x[1, 3, 7] = float("inf")
    x[1, 4, 9] = float("nan")
    w[:, 7] = torch.where(torch.arange(3 * E) % 3 == 0, 0.0, w[:, 7].float()).half()  # inf * 0: NaN
    for s in (1e-30, 1e30, 0.0, 2.0 ** -60, 2.0 ** 60, 300.0):
        scale = torch.full((3, heads), s)
        scale[1, 1] = 0.37
        want = _reference(x, w, b, scale, heads, bits)
        got = ops.qkv_projection(x.cuda(), w.cuda(), b.cuda(), scale.cuda(), heads=heads, bits=bits)
        assert torch.equal(got.cpu(), want), s


def test_the_triton_kernel_serves_every_start_and_row_length(monkeypatch):
    """The CUDA op runs the fused kernel on x and W that start off 16 bytes (copied) and on rows that
    are not whole 16-byte chunks (E 36, padded), with the result of aligned operands and that of the
    unfused path (cuBLAS in fp32 and the quantize pass, which serves a torch without Triton)."""
    if not qkv_gemm.available():
        pytest.skip("no Triton with tensor descriptors")
    calls = []
    launch = qkv_gemm.qkv_projection
    monkeypatch.setattr(qkv_gemm, "qkv_projection", lambda *a: calls.append(a[0].shape[2]) or launch(*a))
    scale = torch.rand(3, 2, device="cuda") + 0.5
    fused = {}
    for e in (32, 36):
        x, w, b = (t.cuda() for t in _integer_problem(1, 16, e, 2, torch.Generator().manual_seed(e)))
        for bits in (8, 16, 4):
            fused[e, bits] = ops.qkv_projection(x, w, b, scale, heads=2, bits=bits)
        for x_off, w_off in ((shifted(x, 1), w), (x, shifted(w, 4)), (shifted(x, 3), shifted(w, 1))):
            assert x_off.data_ptr() % 16 or w_off.data_ptr() % 16
            assert torch.equal(ops.qkv_projection(x_off, w_off, b, scale, heads=2, bits=8), fused[e, 8])
    assert calls == [32] * 6 + [36] * 6
    monkeypatch.setattr(qkv_gemm, "available", lambda: False)
    for e, bits in fused:
        x, w, b = (t.cuda() for t in _integer_problem(1, 16, e, 2, torch.Generator().manual_seed(e)))
        assert torch.equal(ops.qkv_projection(x, w, b, scale, heads=2, bits=bits), fused[e, bits]), (e, bits)
    assert len(calls) == 12
    assert any((v != 0).any() for v in fused.values())


def test_opcheck_on_cuda():
    x, w, b = (t.cuda() for t in _integer_problem(2, 33, 48, 3, torch.Generator().manual_seed(1)))
    torch.library.opcheck(torch.ops.magicube.qkv_projection.default, (x, w, b, torch.rand(3, 3, device="cuda"), 3, 8))


def test_graph_capture_and_stream():
    """Launched on the current stream, and replayable from a CUDA graph."""
    x, w, b = (t.cuda() for t in _integer_problem(2, 64, 64, 2, torch.Generator().manual_seed(2)))
    scale = torch.rand(3, 2, device="cuda") + 0.5
    want = ops.qkv_projection(x, w, b, scale, heads=2, bits=8)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = ops.qkv_projection(x, w, b, scale, heads=2, bits=8)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("bits", [8, 16])
def test_containers_past_2_to_the_31_elements(bits, monkeypatch):
    """A container of more than 2^31 elements, which the kernel addresses with 64-bit offsets (V's
    plane lies wholly past 2^31): every element equals the cuBLAS-and-quantize path's, and the first
    and the last rows equal the reference's. The unfused path's fp32 projection peaks near 35 GB."""
    if torch.cuda.get_device_properties(0).total_memory < 48 << 30:
        pytest.skip("needs a device of 48 GB")
    B, E, heads = 2, 256, 4
    T = (1 << 30) // (B * E) + 77  # 3 x 2^30 elements and more; T fills no row tile
    g = torch.Generator(device="cuda").manual_seed(bits)
    x = torch.randint(-8, 9, (B, T, E), generator=g, device="cuda", dtype=torch.int8).half()
    w, b = (t.cuda() for t in _integer_problem(1, 1, E, heads, torch.Generator().manual_seed(bits))[1:])
    scale = (torch.rand(3, heads, generator=torch.Generator().manual_seed(bits)) + 0.5) * (4 if bits == 8 else 1)
    if not qkv_gemm.available():
        pytest.skip("no Triton with tensor descriptors")
    got = ops.qkv_projection(x, w, b, scale.cuda(), heads=heads, bits=bits)
    assert got.numel() > 2**31 + 2**30
    monkeypatch.setattr(qkv_gemm, "available", lambda: False)
    unfused = ops.qkv_projection(x, w, b, scale.cuda(), heads=heads, bits=bits)
    assert torch.equal(got, unfused)
    del unfused
    for batch, rows in ((0, slice(0, 300)), (B - 1, slice(T - 300, T))):
        want = _reference(x[batch:batch + 1, rows], w, b, scale, heads, bits)
        assert torch.equal(got[:, batch * heads:(batch + 1) * heads, rows].cpu(), want)
