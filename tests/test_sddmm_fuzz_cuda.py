"""The CUDA SDDMM on random problems, against the reference.

Every case draws its own (seeded by its number): the precision (16-, 8- or 4-bit, or fp16), V, M
and N from a few rows to 4608, K from one to 4096 (head dimensions, and reductions whose 16-bit
sums pass 2^31), batch x heads, and a pattern of conftest.RandomPattern (rows from empty to full,
any column and row order, inputs as views off 16-byte boundaries, a `longest_row` hint that may be
wrong). Each case is bit-exact against the reference, run on the GPU in float64 (int64 output and
the fp16 dequantized one), or, for fp16 operands, within the fp32 accumulation bound.
`MAGICUBE_FUZZ_CASES` and `MAGICUBE_FUZZ_SEED` widen a run, as for tests/test_spmm_fuzz_cuda.py.
"""

import random

import pytest
import torch

from conftest import FUZZ_CASES, FUZZ_SEED, RandomPattern, fuzz_extent, load_kernels, poison_allocator, random_ints
from magicube.ops import reference, to_container
from test_sddmm_cuda import within_fp32_bound

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ELEMENTS = 48 << 20  # bound on BH x M x N (the reference's dense product) and on BH x (M + N) x K


def _case(i: int) -> dict:
    rng = random.Random(f"sddmm-{FUZZ_SEED}-{i}")
    bits = rng.choice([16, 8, 4, 0])
    v = rng.choice([2, 4, 8])
    rows, n = fuzz_extent(rng, v)
    k = rng.choice([1, 2, 7, 16, 32, 33, 40, 64, 72, 96, 128, 130, 256, 300, 1000, 4096])
    k += k % 2 if bits == 4 else 0  # 4-bit operands pack two values a byte
    bh = rng.choice([1, 1, 1, 2, 3, 5, 8, 12, 24, 40])
    bh = max(1, min(bh, ELEMENTS // (rows * v * n), ELEMENTS // ((rows * v + n) * k)))
    return dict(bits=bits, k=k, bh=bh, seed=rng.randrange(1 << 30), pattern=RandomPattern.draw(rng, rows, n, v))


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("sddmm")


@pytest.mark.parametrize("i", range(FUZZ_CASES))
def test_random_problem(kernels, i):
    c = _case(i)
    rp = c["pattern"]
    p, _ = rp.build()
    p = p.to("cuda")
    bh, m, n, k, bits = c["bh"], p.m, rp.cols, c["k"], c["bits"]
    g = torch.Generator(device="cuda").manual_seed(c["seed"])
    pattern = (p.row_ptr, p.col_idx, p.row_order)

    def run(a, b, sa, sb, out_dtype):
        tail = (rp.v, bits or 16, out_dtype)
        poison_allocator(-0x5A5A5A5A5A5A5A5A, torch.int64)
        got = kernels.sddmm(*(rp.view(x) for x in (*pattern, a, b, sa, sb)), *tail, rp.longest_row(p))
        return got, reference.sddmm(*pattern, a, b, sa, sb, *tail)

    where = f"case {i} (MAGICUBE_FUZZ_SEED={FUZZ_SEED}): {c}"
    if bits == 0:
        a = torch.randn(bh, m, k, device="cuda", generator=g).half()
        b = torch.randn(bh, n, k, device="cuda", generator=g).half()
        got, _ = run(a, b, None, None, torch.float16)
        assert within_fp32_bound(got, p, a, b), where
        return
    a = to_container(random_ints((bh, m, k), bits, True, g), bits)
    b = to_container(random_ints((bh, n, k), bits, True, g), bits)
    got, want = run(a, b, None, None, torch.int64)
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{where}: {(got != want).sum()} of {want.numel()} differ"
    sa = (torch.rand(bh, m, device="cuda", generator=g) + 0.01) / 2 ** (bits - 1)
    sb = (torch.rand(bh, n, device="cuda", generator=g) + 0.01) / 2 ** (bits - 1)
    got, want = run(a, b, sa, sb, torch.float16)
    assert torch.equal(got, want), f"{where}: fp16 output differs in {(got != want).sum()} of {want.numel()}"
