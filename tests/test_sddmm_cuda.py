"""The CUDA SDDMM kernels against the reference (the CPU implementation of magicube::sddmm).

Integer results are compared bit-exactly: the int64 accumulators, and the fp16 output, which
the contract defines as one fp32 multiply of the exact accumulator and one rounding. The
fp16 x fp16 kernel accumulates in fp32 in another order than the reference, so it is held to
the error bound of an fp32 dot product plus one fp16 rounding, against a float64 product.
"""

import subprocess
import sys

import pytest
import torch

from conftest import (load_kernels, poison_allocator, problem, random_ints, reordered, with_columns_shuffled,
                      with_row_order)
from magicube.ops import SRBCRS, VectorMask, qrange, to_container
from magicube.ops.format import value_coordinates

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (BH, M/V, K, N): K = 40 / 72 leave a partial 64-wide k chunk and 8-byte aligned rows,
# K = 33 (odd) byte-aligned rows, N is never a multiple of 32; every pattern has an empty
# vector row and a full one (conftest.awkward_mask); K = 300 gives rows of several k chunks
# loaded in 4-byte units (2-byte in int4).
SHAPES = [(1, 7, 64, 100), (3, 5, 40, 272), (1, 1, 72, 2), (3, 9, 128, 700), (2, 4, 33, 45), (1, 3, 32, 2200),
          (2, 5, 300, 90)]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("sddmm")


def _run(kernels, p, a, b, sa, sb, v, bits, out_dtype, longest_row=-1):
    cuda = p.to("cuda")
    dev = [x.cuda() if x is not None else None for x in (a, b, sa, sb)]
    poison_allocator(-0x5A5A5A5A5A5A5A5A, torch.int64)
    got = kernels.sddmm(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v, bits, out_dtype, longest_row)
    torch.cuda.synchronize()
    want = torch.ops.magicube.sddmm(p.row_ptr, p.col_idx, p.row_order, a, b, sa, sb, v, bits, out_dtype)
    return got.cpu(), want


def _k_for(bits, k):
    return k + (k % 2) if bits == 4 else k


def _scales(bh, m, n, g, bits):
    return ((torch.rand(bh, m, generator=g) + 0.01) / 2 ** (bits - 1),
            (torch.rand(bh, n, generator=g) + 0.01) / 2 ** (bits - 1))


@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_integer_exact(kernels, bits, v):
    for i, (bh, rows, k, n) in enumerate(SHAPES):
        k = _k_for(bits, k)
        g = torch.Generator().manual_seed(100 * i + v + bits)
        p, _ = problem(bh, rows, n, v, 0.5 + 0.08 * i, seed=i, shuffle=bool(i % 2))
        a = to_container(random_ints((bh, p.m, k), bits, True, g), bits)
        b = to_container(random_ints((bh, n, k), bits, True, g), bits)
        got, want = _run(kernels, p, a, b, None, None, v, bits, torch.int64)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want), f"shape {(bh, rows, k, n)}: {(got != want).sum()} mismatches"

        sa, sb = _scales(bh, p.m, n, g, bits)
        got, want = _run(kernels, p, a, b, sa, sb, v, bits, torch.float16)
        assert got.dtype == torch.float16 and not got.isnan().any()
        assert torch.equal(got, want), f"shape {(bh, rows, k, n)}: dequantized output differs"


@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("ends", ["min-min", "max-max", "min-max"])
def test_extremes(kernels, bits, v, ends):
    """Every element at the ends of its range; K = 4096 drives the 16-bit sums past 2^40."""
    lo, hi = qrange(bits)
    fa, fb = {"min-min": (lo, lo), "max-max": (hi, hi), "min-max": (lo, hi)}[ends]
    for bh, rows, k, n in [(1, 2, 4096, 70), (3, 3, 96, 40)]:
        p, _ = problem(bh, rows, n, v, 0.5, seed=7)
        a = to_container(torch.full((bh, p.m, k), fa, dtype=torch.int64), bits)
        b = to_container(torch.full((bh, n, k), fb, dtype=torch.int64), bits)
        got, want = _run(kernels, p, a, b, None, None, v, bits, torch.int64)
        assert torch.equal(got, want)
        sa = torch.full((bh, p.m), 0.5 ** 10)
        sb = torch.full((bh, n), 0.5 ** (2 * bits))
        got, want = _run(kernels, p, a, b, sa, sb, v, bits, torch.float16)
        assert torch.equal(got, want)


def within_fp32_bound(got, p, a, b) -> bool:
    """fp16 SDDMM values against the exact product: fp32 sums of K products (each exact in fp32)
    err by at most K * 2^-24 * sum|a b|, then one fp16 rounding; the reference obeys the same bound."""
    exact = p.pack_values(a.double() @ b.double().transpose(1, 2))
    mag = p.pack_values(a.double().abs() @ b.double().abs().transpose(1, 2))
    bound = exact.abs() * 2.0 ** -11 + mag * a.shape[-1] * 2.0 ** -24 + 2.0 ** -24
    return not got.isnan().any() and bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("v", [2, 4, 8])
def test_fp16_within_fp32_accumulation_bound(kernels, v):
    for i, (bh, rows, k, n) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(i + v)
        p, _ = problem(bh, rows, n, v, 0.6, seed=i, shuffle=bool(i % 2))
        a = torch.randn(bh, p.m, k, generator=g).half()
        b = torch.randn(bh, n, k, generator=g).half()
        got, want = _run(kernels, p, a, b, None, None, v, 16, torch.float16)
        assert within_fp32_bound(got, p, a, b), f"shape {(bh, rows, k, n)}"
        assert within_fp32_bound(want, p, a, b)


def _check_random_operands(kernels, p, bh, n, k, v, bits, g, what, longest_row=-1):
    """Random A (BH x M x K) and B (BH x N x K) of `bits` (0: float16) through the kernel: the int64
    and the dequantized fp16 outputs bit-exact against the reference, float16 within its bound."""
    if bits == 0:
        a = torch.randn(bh, p.m, k, generator=g).half()
        b = torch.randn(bh, n, k, generator=g).half()
        got, _ = _run(kernels, p, a, b, None, None, v, 16, torch.float16, longest_row)
        assert within_fp32_bound(got, p, a, b), what
        return
    a = to_container(random_ints((bh, p.m, k), bits, True, g), bits)
    b = to_container(random_ints((bh, n, k), bits, True, g), bits)
    got, want = _run(kernels, p, a, b, None, None, v, bits, torch.int64, longest_row)
    assert torch.equal(got, want), f"{what}: {(got != want).sum()} mismatches"
    sa, sb = _scales(bh, p.m, n, g, bits)
    got, want = _run(kernels, p, a, b, sa, sb, v, bits, torch.float16, longest_row)
    assert not got.isnan().any() and torch.equal(got, want), f"{what}: dequantized output differs"


@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("bits", [16, 8, 4, 0])
def test_rows_of_every_block_count(kernels, bits, v):
    """A warp streams all blocks of one vector row, the next block's loads in flight: rows of
    0 to 9 blocks (odd and even counts, full and partial last blocks), taken in a random
    row_order; K = 64 is one k step a block (the operand row held), K = 160 several. 53 vector
    rows: more than two CTAs' worth of warps."""
    n = 8 * 32 + 5
    counts = [0, 1, 31, 32, 33, 64, 65, 96, 100, 150, 224, 229, n, 3, 0, 40, 17] * 3 + [5, 70]
    g = torch.Generator().manual_seed(10 * bits + v)
    mask = torch.zeros(len(counts), n, dtype=torch.bool)
    for i, c in enumerate(counts):
        mask[i, torch.randperm(n, generator=g)[:c]] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32, shuffle=v == 8)
    p = with_row_order(p, p.row_order[torch.randperm(len(counts), generator=g)])
    bh = 3
    for k in (64, 160):
        _check_random_operands(kernels, p, bh, n, k, v, bits, g, f"K={k}")


@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("bits", [16, 8, 4, 0])
def test_unsorted_columns_many_rows(kernels, bits, v):
    """130 vector rows (17 CTAs) of 0 to 2085 kept columns, K = 64, each row's columns in a random
    order; the padding of a row's last block must still be zero."""
    n, rows, bh, k = 2085, 130, 2, 64
    g = torch.Generator().manual_seed(20 * bits + v)
    mask = torch.rand(rows, n, generator=g) < torch.rand(rows, 1, generator=g) * 0.3
    mask[0], mask[1], mask[2] = False, True, torch.arange(n) >= n - 40
    p = with_columns_shuffled(SRBCRS.from_mask(VectorMask(mask, v), stride=32), g)
    _check_random_operands(kernels, p, bh, n, k, v, bits, g, "unsorted columns")


@pytest.mark.parametrize("bits", [16, 8, 4, 0])
def test_global_rows(kernels, bits):
    """Rows past 8 mean rows (global tokens) are split over a CTA's 8 warps, a run of blocks each:
    400 vector rows of density 0.01 beside 20 full ones (64 blocks against a mean of 5) and one of
    1900 columns (60 blocks: the last warp's run is shorter, its last block partial), one empty.
    Exact in length order, in a shuffled and a reversed one (long rows past the positions the
    split CTAs look at stay on one warp), and with longest_row given (0: every row on a warp)."""
    n, rows, v, k, bh = 2048, 400, 8, 64, 2
    g = torch.Generator().manual_seed(50 + bits)
    mask = torch.rand(rows, n, generator=g) < 0.01
    mask[3::20], mask[11, :1900], mask[7] = True, True, False
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    assert p.longest_row == n
    for hint in (-1, p.longest_row, 0):
        _check_random_operands(kernels, p, bh, n, k, v, bits, g, f"global rows, longest_row={hint}", hint)
    for name, other in reordered(p, g).items():
        _check_random_operands(kernels, other, bh, n, k, v, bits, g, f"global rows, {name} row_order")


def test_padding_is_zero_and_row_order_irrelevant(kernels):
    bh, rows, k, n, v = 2, 6, 64, 90, 4
    g = torch.Generator().manual_seed(3)
    p, _ = problem(bh, rows, n, v, 0.7, seed=3, shuffle=True)
    a = to_container(random_ints((bh, p.m, k), 8, True, g), 8)
    b = to_container(random_ints((bh, n, k), 8, True, g), 8)
    got, want = _run(kernels, p, a, b, None, None, v, 8, torch.int64)
    _, col = value_coordinates(p.row_ptr, p.col_idx, v, 32)
    assert (col < 0).any() and (got[:, col < 0] == 0).all()
    assert torch.equal(got, want)
    got2, _ = _run(kernels, with_row_order(p, p.row_order.flip(0)), a, b, None, None, v, 8, torch.int64)
    assert torch.equal(got2, got)


def test_all_rows_empty(kernels):
    v, n = 4, 50
    p = SRBCRS.from_mask(VectorMask(torch.zeros(3, n, dtype=torch.bool), v), stride=32)
    a = torch.zeros(2, p.m, 64, dtype=torch.int8)
    b = torch.zeros(2, n, 64, dtype=torch.int8)
    got, want = _run(kernels, p, a, b, None, None, v, 8, torch.int64)
    assert got.shape == want.shape == (2, 0)


REJECT = """
import torch
from magicube.ops import SRBCRS, extension, random_vector_mask
extension.load("sddmm")
p = SRBCRS.from_mask(random_vector_mask(16, 40, 8, 0.5, seed=0), stride=32).to("cuda")
a = torch.zeros(1, p.m, 64, dtype=torch.int8, device="cuda")
for b, out in ((torch.zeros(1, 40, 64, dtype=torch.int16, device="cuda"), torch.int64),
               (torch.zeros(1, 40, 64, dtype=torch.int8, device="cuda"), torch.float16)):
    try:
        torch.ops.magicube_cuda.sddmm(p.row_ptr, p.col_idx, p.row_order, a, b, None, None, 8, 8, out)
    except RuntimeError as e:
        print("raised:", e)
"""


def test_rejects_bad_arguments(kernels):
    # In a child process: a failed check that took the interpreter down would
    # otherwise end the whole session.
    res = subprocess.run([sys.executable, "-c", REJECT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "b must be" in res.stdout and "scale_a and scale_b are required" in res.stdout, res.stdout
