"""The CUDA sparse softmax against the reference (the CPU implementation of magicube::sparse_softmax).

The kernel rounds x = value * scale and x - max as the reference does; its exp and its summation
order differ from the reference's by a few ulp, so: quantized probabilities may differ by one, and
only where e * qmax (e of that rounded argument) lies within a few ulp of a .5 tie; fp16
probabilities agree to a few ulp; row scales lie within 1e-5 of the float64 sum of those e, or
within twice the reference's own distance from it (its float32 sum drifts on long rows). Padding
slots are filled with garbage in the inputs, which the kernel must ignore (col_idx == -1).
"""

import math
import subprocess
import sys

import pytest
import torch

from conftest import kept_slots, load_kernels, problem, reordered
from magicube.ops import SRBCRS, VectorMask, from_container
from magicube.ops.format import value_coordinates

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (BH, M/V, N): the full row of N = 2200 has more than 16 warp steps for every V (the
# streamed path); N = 45, 100 give a partial last block; every pattern has an empty row.
SHAPES = [(1, 7, 100), (3, 5, 272), (1, 1, 2), (2, 9, 700), (1, 3, 2200), (3, 4, 45)]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("softmax")


def scores(p, bh, g, spread=4.0, center=0.0):
    """Scores on the kept slots, garbage (large) on the padding slots."""
    _, col = value_coordinates(p.row_ptr, p.col_idx, p.v, 32)
    x = torch.randn(bh, p.nnz_pad * p.v, generator=g) * spread + center
    return torch.where(col < 0, torch.full_like(x, 6e4), x).half(), col


def _run(kernels, p, values, scale, out_bits, longest_row=-1):
    cuda = p.to("cuda")
    junk = torch.full((1 << 22,), -1, dtype=torch.int64, device="cuda")
    del junk
    got, rs = kernels.sparse_softmax(cuda.row_ptr, cuda.col_idx, cuda.row_order, values.cuda(), p.v, scale,
                                     out_bits, longest_row)
    torch.cuda.synchronize()
    want, want_rs = torch.ops.magicube.sparse_softmax(p.row_ptr, p.col_idx, p.row_order, values, p.v, scale,
                                                      out_bits)
    return got.cpu(), rs.cpu(), want, want_rs


def _exact_e(p, values, scale):
    """exp(d) in float64 of every value slot (0 on padding), d = x - max with x = value * scale,
    each rounded to float32 as the reference and the kernel round them."""
    row, col = value_coordinates(p.row_ptr, p.col_idx, p.v, 32)
    keep = col >= 0
    x = values.float() * scale
    bh, m = values.shape[0], p.m
    mx = x.new_full((bh, m), -math.inf).scatter_reduce(
        1, row.expand(bh, -1), x.masked_fill(~keep, -math.inf), "amax")
    return torch.exp((x - mx.gather(1, row.expand(bh, -1))).double()).masked_fill(~keep, 0.0)


def check(p, values, col, scale, out_bits, result, what):
    """result = (probabilities, row scales) of the kernel, then of the reference. Row scales within
    1e-5 of the float64 ones, or twice the reference's distance from them (its float32 sum drifts on
    long rows); fp16 probabilities within 2e-3 of the reference's; integer ones equal, or one apart
    where e * qmax lies within a few ulp of a .5 tie."""
    got, rs, want, want_rs = result
    assert got.dtype == want.dtype and got.shape == want.shape and rs.shape == want_rs.shape
    assert not rs.isnan().any()
    pad = col < 0
    if out_bits == 0:
        assert torch.equal(rs, want_rs), f"{what}: fp16 probabilities carry row scales of 1"
        assert not got.isnan().any()
        assert (got[:, pad] == 0).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-7, msg=lambda m: f"{what}: {m}")
        return
    qmax = (1 << out_bits) - 1
    e = _exact_e(p, values, scale)
    row, _ = value_coordinates(p.row_ptr, p.col_idx, p.v, 32)
    s = e.new_zeros(rs.shape).scatter_add(1, row.expand(rs.shape[0], -1), e)
    exact_rs = torch.where(s > 0, 1 / (s * qmax), 0.0)

    def distance(x):
        return ((x.double() - exact_rs).abs() / exact_rs.clamp(min=1e-300)).max().item() if x.numel() else 0.0

    assert distance(rs) <= max(1e-5, 2 * distance(want_rs)), \
        f"{what}: row scales {distance(rs):.3g} from float64, the reference's {distance(want_rs):.3g}"
    q, wq = from_container(got, out_bits, False), from_container(want, out_bits, False)
    assert (q[:, pad] == 0).all()
    diff = (q - wq).abs()
    assert bool((diff <= 1).all()), f"{what}: off by more than one"
    t = e * qmax
    near_tie = ((t - t.floor() - 0.5).abs() <= qmax * 2.0 ** -19 + 1e-9)
    assert (near_tie | (diff == 0)).all(), f"{what}: off-by-one away from a tie"


@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
def test_matches_reference(kernels, out_bits, v):
    for i, (bh, rows, n) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(10 * i + v)
        p, _ = problem(bh, rows, n, v, 0.5 + 0.07 * i, seed=i, shuffle=bool(i % 2))
        values, col = scores(p, bh, g)
        scale = 64 ** -0.5
        check(p, values, col, scale, out_bits, _run(kernels, p, values, scale, out_bits), f"shape {(bh, rows, n)}")


@pytest.mark.parametrize("scale", [1.0, -0.7])
@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
def test_large_scores(kernels, out_bits, scale):
    """Scores of a few hundred, a few apart (fp16 values around +-300): x = value * scale and
    x - max round as in the reference, so 16-bit probabilities near 1 still differ from it only
    beside ties (a scale folded with log2 e into one product moves them by up to |x| 2^-23)."""
    for i, (bh, rows, n) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(80 + i)
        p, _ = problem(bh, rows, n, 8, 0.4, seed=i, shuffle=bool(i % 2))
        values, col = scores(p, bh, g, spread=2.0, center=300.0 * (-1) ** i)
        check(p, values, col, scale, out_bits, _run(kernels, p, values, scale, out_bits), f"shape {(bh, rows, n)}")


@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
def test_global_rows(kernels, out_bits, v):
    """Rows past 8 mean rows (global tokens) are split over a CTA's 4 warps, a quarter of the
    steps each, with the max and the sum combined across them: 400 vector rows of density 0.01
    beside 20 full ones (128 blocks against a mean of 9: a quarter is 32 steps at V 8, streamed,
    and 8 at V 2, cached) and one of 2999 columns (its last block and 8-slot group partial), one
    empty. In length order, in a shuffled and a reversed one (long rows past the positions the
    split CTAs look at stay on one warp), and with longest_row given (0: every row on a warp)."""
    n, rows, bh = 4096, 400, 2
    g = torch.Generator().manual_seed(60 + out_bits + v)
    mask = torch.rand(rows, n, generator=g) < 0.01
    mask[3::20], mask[11, :2999], mask[7] = True, True, False
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    assert p.longest_row == n
    values, col = scores(p, bh, g)
    scale = 0.3
    for hint in (-1, p.longest_row, 0):
        result = _run(kernels, p, values, scale, out_bits, hint)
        check(p, values, col, scale, out_bits, result, f"global rows, longest_row={hint}")
    for name, other in reordered(p, g).items():
        check(p, values, col, scale, out_bits, _run(kernels, other, values, scale, out_bits), f"{name} row_order")


@pytest.mark.parametrize("out_bits", [0, 8])
def test_negative_scale(kernels, out_bits):
    """The row max is taken on the fp16 values, on their negation when the scale is negative."""
    for i, (bh, rows, n) in enumerate(SHAPES[:4]):
        g = torch.Generator().manual_seed(50 + i)
        p, _ = problem(bh, rows, n, 4, 0.6, seed=i, shuffle=bool(i % 2))
        values, col = scores(p, bh, g)
        got, rs, want, want_rs = _run(kernels, p, values, -0.3, out_bits)
        torch.testing.assert_close(rs, want_rs, rtol=1e-5, atol=0)
        if out_bits == 0:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-7)
        else:
            q, wq = from_container(got, out_bits, False), from_container(want, out_bits, False)
            assert (q - wq).abs().max() <= 1 and (q[:, col < 0] == 0).all()


@pytest.mark.parametrize("out_bits", [0, 8, 4])
def test_empty_rows(kernels, out_bits):
    v, n = 4, 70
    mask = torch.zeros(4, n, dtype=torch.bool)
    mask[1, 3] = True
    mask[3, ::2] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    values = torch.randn(2, p.nnz_pad * v).half()
    got, rs, want, want_rs = _run(kernels, p, values, 1.0, out_bits)
    assert not rs.isnan().any() and torch.equal(rs[:, :v], want_rs[:, :v])
    empty = torch.cat([rs[:, :v], rs[:, 2 * v:3 * v]], dim=1)
    assert (empty == (1.0 if out_bits == 0 else 0.0)).all()
    # The one-entry row (vector row 1, slots 32..63): probability 1 (qmax) exactly.
    one = slice(32 * v, 64 * v)
    if out_bits == 0:
        assert not got.isnan().any()
        assert torch.equal(got[:, one], want[:, one])
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-7)
    else:
        q, wq = from_container(got, out_bits, False), from_container(want, out_bits, False)
        assert torch.equal(q[:, one], wq[:, one])
        assert (q - wq).abs().max() <= 1


def _poisoned(p, values, rows):
    """values with batch 0's rows rows[0] holding +inf, rows[1] a NaN, rows[2] -inf alone and
    rows[3] one -inf among finite scores."""
    slots = [kept_slots(p, r) for r in rows]
    assert all(len(x) > 1 for x in slots)
    bad = values.clone()
    bad[0, slots[0][0]], bad[0, slots[1][-1]], bad[0, slots[3][0]] = float("inf"), float("nan"), float("-inf")
    bad[0, slots[2]] = float("-inf")
    return bad


@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
def test_non_finite_scores(kernels, out_bits, v):
    """Rows with +inf or a NaN among their scores, or -inf alone, come out as the reference defines
    them (NaN rows: NaN fp16 probabilities, or integers beside a NaN row scale), on whole rows and
    on global rows split over a CTA's warps; a -inf among finite scores is probability 0; every
    other row is bit for bit what it is with clean scores."""
    g = torch.Generator().manual_seed(70 + out_bits + v)
    awkward, _ = problem(2, 9, 700, v, 0.6, seed=3)  # vector row 0 empty, 4 full
    mask = torch.rand(400, 2048, generator=g) < 0.01
    mask[3::20] = True  # global rows: split
    cases = {"whole rows": (awkward, [v, 2 * v + 1, 4 * v, 3 * v]),
             "global rows": (SRBCRS.from_mask(VectorMask(mask, v), stride=32), [3 * v, 23 * v + 1, 43 * v, v])}
    for what, (p, rows) in cases.items():
        clean, _ = scores(p, 2, g)
        got_clean, rs_clean, _, _ = _run(kernels, p, clean, 0.3, out_bits)
        got, rs, want, want_rs = _run(kernels, p, _poisoned(p, clean, rows), 0.3, out_bits)
        row, _ = value_coordinates(p.row_ptr, p.col_idx, v, 32)
        nan_row = torch.zeros(2, p.m, dtype=torch.bool)
        nan_row[0, rows[:3]] = True
        touched_row = nan_row.clone()
        touched_row[0, rows[3]] = True
        untouched = ~touched_row.gather(1, row.expand(2, -1))  # slots of the rows left clean
        torch.testing.assert_close(rs, want_rs, rtol=1e-5, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        assert torch.equal(rs[~touched_row], rs_clean[~touched_row]), f"{what}: a clean row's scale changed"
        if out_bits == 0:
            assert torch.equal(got.isnan(), nan_row.gather(1, row.expand(2, -1))), what
            assert torch.equal(got.isnan(), want.isnan()) and not bool(rs.isnan().any()), what
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-7, equal_nan=True)
            assert torch.equal(got[untouched], got_clean[untouched]), f"{what}: a clean row changed"
            continue
        assert torch.equal(rs.isnan(), nan_row), what
        q, wq, q_clean = (from_container(x, out_bits, False) for x in (got, want, got_clean))
        assert (q - wq).abs().max() <= 1, what
        assert bool((q[0, (row == rows[0]) | (row == rows[2])] == 0).all()), f"{what}: every e is NaN, so q = 0"
        assert torch.equal(q[untouched], q_clean[untouched]), f"{what}: a clean row changed"


def test_all_rows_empty(kernels):
    v = 8
    p = SRBCRS.from_mask(VectorMask(torch.zeros(2, 30, dtype=torch.bool), v), stride=32)
    values = torch.zeros(3, 0).half()
    got, rs, want, want_rs = _run(kernels, p, values, 1.0, 8)
    assert got.shape == want.shape and torch.equal(rs, want_rs)


REJECT = """
import torch
from magicube.ops import SRBCRS, extension, random_vector_mask
extension.load("softmax")
p = SRBCRS.from_mask(random_vector_mask(16, 40, 8, 0.5, seed=0), stride=32).to("cuda")
bad = torch.zeros(1, p.nnz_pad * 8, dtype=torch.float32, device="cuda")
try:
    torch.ops.magicube_cuda.sparse_softmax(p.row_ptr, p.col_idx, p.row_order, bad, 8, 1.0, 8)
except RuntimeError as e:
    print("raised:", e)
"""


def test_rejects_bad_values(kernels):
    # In a child process: a failed check that took the interpreter down would
    # otherwise end the whole session.
    res = subprocess.run([sys.executable, "-c", REJECT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "values must be" in res.stdout, res.stdout + res.stderr
