"""The CUDA sparse softmax on random problems, against the reference.

Every case draws its own (seeded by its number): the output (fp16, or 16-, 8- or 4-bit unsigned
integers), V, the rows and columns (up to 4608, so rows from empty to past the streamed path's
length, and global rows split over a CTA's warps), batch x heads, the scores' spread, the scale's
size and sign, and a pattern of conftest.RandomPattern (any column and row order, inputs as views
off 16-byte boundaries, a `longest_row` hint that may be wrong). Padding slots hold garbage.
Each case is held to test_softmax_cuda.check against the reference, run on the GPU.
`MAGICUBE_FUZZ_CASES` and `MAGICUBE_FUZZ_SEED` widen a run, as for tests/test_spmm_fuzz_cuda.py.
"""

import random

import pytest
import torch

from conftest import FUZZ_CASES, FUZZ_SEED, RandomPattern, fuzz_extent, load_kernels, poison_allocator
from magicube.ops import reference
from test_softmax_cuda import check, scores

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ELEMENTS = 16 << 20  # bound on BH x the value slots, so that a case's float64 check stays small


def _case(i: int) -> dict:
    rng = random.Random(f"softmax-{FUZZ_SEED}-{i}")
    v = rng.choice([2, 4, 8])
    rows, cols = fuzz_extent(rng, v)
    scale = rng.choice([1.0, -1.0, 1.0, 1.0]) * rng.choice([0.05, 64 ** -0.5, 0.3, 1.0, 3.0])
    return dict(out_bits=rng.choice([0, 16, 8, 4]), bh=rng.choice([1, 1, 2, 3, 5, 8, 12, 24, 40]),
                spread=rng.choice([0.1, 1.0, 4.0, 16.0]), scale=scale, seed=rng.randrange(1 << 30),
                pattern=RandomPattern.draw(rng, rows, cols, v))


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("softmax")


@pytest.mark.parametrize("i", range(FUZZ_CASES))
def test_random_problem(kernels, i):
    c = _case(i)
    rp, out_bits, scale = c["pattern"], c["out_bits"], c["scale"]
    p, _ = rp.build()
    bh = max(1, min(c["bh"], ELEMENTS // max(1, p.nnz_pad * rp.v)))
    values, col = scores(p, bh, torch.Generator().manual_seed(c["seed"]), c["spread"])
    p, values, col = p.to("cuda"), values.cuda(), col.cuda()
    pattern = (p.row_ptr, p.col_idx, p.row_order)
    poison_allocator(-1, torch.int64)
    got = kernels.sparse_softmax(*(rp.view(x) for x in (*pattern, values)), rp.v, scale, out_bits,
                                 rp.longest_row(p))
    want = reference.sparse_softmax(*pattern, values, rp.v, scale, out_bits)
    check(p, values, col, scale, out_bits, (*got, *want), f"case {i} (MAGICUBE_FUZZ_SEED={FUZZ_SEED}): {c}, bh {bh}")
