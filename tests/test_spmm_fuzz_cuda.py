"""The CUDA SpMM on random problems across the automatic choice's whole range, against the reference.

The other SpMM tests fix their shapes to reach one kernel path each; here every case draws its own
(seeded by its number): any precision pair and signedness, V, M and K from a few columns to 4608,
N at and around the tiles' widths, batch x heads, a pattern of conftest.RandomPattern (per-row
densities from empty to full, so rows of very different lengths and long rows past the staged
indices; any column and row order; inputs as views off 16-byte boundaries; a `longest_row` hint
that may be wrong), and a way of computing it (the automatic or the tuned choice, or one way
forced). Each case is bit-exact against the reference, run on the GPU in float64 (int64 output and
the fp16 dequantized one) or, for fp16 operands, within the fp32 accumulation bound.

`MAGICUBE_FUZZ_CASES` (default 48) and `MAGICUBE_FUZZ_SEED` (default 0) widen a run, e.g.
`MAGICUBE_FUZZ_CASES=2000 MAGICUBE_FUZZ_SEED=7 python -m pytest -x tests/test_spmm_fuzz_cuda.py`;
a failure names its case, which reruns alone with the same two variables.
"""

import random

import pytest
import torch

from conftest import FUZZ_CASES, FUZZ_SEED, FUZZ_SIZES, RandomPattern, load_kernels, poison_allocator, random_ints
from magicube.ops import reference, to_container
from test_spmm_cuda import within_fp16_bound

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (a_bits, b_bits, a_signed); a_bits 0: fp16 x fp16.
KINDS = [(8, 8, True), (8, 8, False), (4, 4, True), (4, 4, False), (16, 8, True), (16, 8, False),
         (16, 16, True), (16, 16, False), (8, 4, True), (8, 4, False), (16, 4, True), (16, 4, False),
         (12, 4, True), (0, 0, True)]
WAYS = ["auto", "auto", "auto", "tuned", "gather", "stacked", "merged", "resident", "dense", "dense_wgmma"]
# Widths of B around the kernels' tiles (rows of 16-512 bytes) and a few odd ones.
NS = [1, 3, 8, 16, 31, 32, 40, 48, 63, 64, 65, 96, 100, 112, 127, 128, 129, 160, 192, 224, 255, 256, 257, 272,
      320, 384, 511, 512, 513, 640, 1000]
ELEMENTS = 48 << 20  # bound on BH x M x K, so that a case's float64 reference stays small


def _case(i: int) -> dict:
    rng = random.Random(f"{FUZZ_SEED}-{i}")
    a_bits, b_bits, a_signed = rng.choice(KINDS)
    v = rng.choice([2, 4, 8])
    size = rng.choice(FUZZ_SIZES)
    rows = rng.randint(1, max(1, size // v))
    k = rng.randint(1, size)
    bh = max(1, min(rng.choice([1, 1, 1, 2, 3, 5, 8, 12, 24, 40]), ELEMENTS // (rows * v * k)))
    n = rng.choice(NS)
    n += n % 2 if b_bits == 4 else 0  # 4-bit B packs two values a byte
    return dict(a_bits=a_bits, b_bits=b_bits, a_signed=a_signed, k=k, n=n, bh=bh, way=rng.choice(WAYS),
                seed=rng.randrange(1 << 30), pattern=RandomPattern.draw(rng, rows, k, v))


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("spmm")


@pytest.mark.parametrize("i", range(FUZZ_CASES))
def test_random_problem(kernels, monkeypatch, i):
    c = _case(i)
    if c["way"] == "dense_wgmma" and torch.cuda.get_device_capability()[0] != 9:
        c["way"] = "dense"
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", c["way"])
    rp = c["pattern"]
    p, emask = rp.build()
    p, emask = p.to("cuda"), emask.cuda()
    bh, m, k, n, a_bits, b_bits, a_signed = c["bh"], p.m, c["k"], c["n"], c["a_bits"], c["b_bits"], c["a_signed"]
    g = torch.Generator(device="cuda").manual_seed(c["seed"])
    pattern = (p.row_ptr, p.col_idx, p.row_order)

    def run(a_values, b, sa, sb, bits, out_dtype):
        tail = (rp.v, m, bits[0], a_signed, bits[1], out_dtype)
        poison_allocator(-0x5A5A5A5A5A5A5A5A, torch.int64)
        got = kernels.spmm(*(rp.view(x) for x in (*pattern, a_values, b, sa, sb)), *tail, rp.longest_row(p))
        return got, reference.spmm(*pattern, a_values, b, sa, sb, *tail)

    where = f"case {i} (MAGICUBE_FUZZ_SEED={FUZZ_SEED}): {c}"
    if a_bits == 0:
        a = (torch.randn(bh, m, k, device="cuda", generator=g) * emask).half()
        b = torch.randn(bh, k, n, device="cuda", generator=g).half()
        got, _ = run(p.pack_values(a), b, None, None, (16, 16), torch.float16)
        assert within_fp16_bound(got, a, b), where
        return
    a = random_ints((bh, m, k), a_bits, a_signed, g) * emask
    a_values = to_container(p.pack_values(a), a_bits, a_signed)
    b = to_container(random_ints((bh, k, n), b_bits, True, g), b_bits)
    got, want = run(a_values, b, None, None, (a_bits, b_bits), torch.int64)
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{where}: {(got != want).sum()} of {want.numel()} differ"
    sa = (torch.rand(bh, m, device="cuda", generator=g) + 0.01) / 2 ** (a_bits - 1)
    sb = (torch.rand(bh, n, device="cuda", generator=g) + 0.01) / 2 ** (b_bits - 1)
    got, want = run(a_values, b, sa, sb, (a_bits, b_bits), torch.float16)
    assert torch.equal(got, want), f"{where}: fp16 output differs in {(got != want).sum()} of {want.numel()}"
