"""The CUDA SpMM kernels against the reference (the CPU implementation of magicube::spmm).

Integer results are compared bit-exactly (int64 accumulators, and the fp16 dequantized output,
which the contract defines as one fp32 multiply and one rounding). The fp16 x fp16 kernel
accumulates in fp32 in another order than the reference, so it is held to the error bound of
fp32 accumulation plus one fp16 rounding, measured against a float64 product.
"""

import pytest
import torch

from conftest import load_kernels, poison_allocator, problem, random_ints, reordered, shifted, with_columns_shuffled
from magicube.ops import SRBCRS, VectorMask, qrange, to_container

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KINDS = [(8, 8, True), (8, 8, False), (4, 4, True), (4, 4, False), (16, 8, True), (16, 8, False),
         (16, 16, True), (16, 16, False), (8, 4, True), (8, 4, False), (16, 4, True), (16, 4, False),
         (12, 4, True)]
KIND_IDS = [f"L{a}{'' if s else 'u'}-R{b}" for a, b, s in KINDS]

# (BH, M/V, K, N): K and N multiples of no tile; N = 100 has dense rows not on 16 bytes for every
# width (padded by the op); N = 272 is aligned with a partial last tile, rows of several of the
# smaller tiles (on_tile: the narrow one of 8- and 16-bit B, the quarter one of 4-bit B but under
# 4-bit A); N = 48 and 128 take the gather kernel's small tiles, partly and wholly filled: the
# quarter tile (rows of at most 64 bytes of 8- and 4-bit B), the narrow one (at most 128 bytes).
SHAPES = [(1, 7, 333, 100), (3, 5, 97, 272), (1, 1, 40, 2), (3, 9, 700, 36), (2, 6, 300, 48), (1, 4, 130, 128)]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("spmm")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(autouse=True, params=["gather", "stacked", "merged", "resident", "dense", "dense_wgmma"])
def spmm_kernel(request, monkeypatch):
    """Each test of integer operands runs every way the op computes: the gather kernel, with 12- and
    16-bit A's planes in two MMAs and (at V 2, and at V 4 unsigned 16-bit A's and 12-bit A's as
    digits) stacked into one, which the automatic choice takes on larger problems than these, and
    on V 2 rows merged four at a time into V 8 rows, which it takes at high sparsity, the
    resident-B kernel (8- or 4-bit B), which it takes on narrow B, and the dense path, which it
    takes at low V and sparsity, with its GEMM chosen by size (on problems this small, on Hopper,
    with one or two plane products, the wgmma GEMM's least tile with K split between two CTAs, here
    and there with one of them past K; else the mma.sync one) and, on Hopper, with the wgmma GEMM
    forced. Where the one forced does not apply (stacking at V 8, signed 16-bit A's at V 4, or on
    8-bit B's narrow tile, merging at V 4 and 8 or where M is not a multiple of 8, the resident
    kernel where B's slice passes shared memory, the dense path past its K) the gather kernel runs.
    Dense rows not on 16 bytes are padded first, and every way runs on them."""
    callspec = getattr(request.node, "callspec", None)
    b_bits = callspec.params.get("b_bits") if callspec else None
    a_bits = callspec.params.get("a_bits") if callspec else None
    if request.param == "stacked" and (a_bits or 0) < 12:
        pytest.skip("the gather kernel stacks the planes of 12- and 16-bit A")
    if request.param == "resident" and b_bits not in (8, 4):
        pytest.skip("the resident-B kernel takes 8- and 4-bit B")
    if (request.param == "merged" or request.param.startswith("dense")) and b_bits is None:
        pytest.skip(f"the {request.param} way takes integer operands")
    if request.param == "dense_wgmma" and not _hopper():
        pytest.skip("the wgmma GEMM runs on Hopper")
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", request.param)
    return request.param


def _run(kernels, p, a_values, b, sa, sb, v, a_bits, a_signed, b_bits, out_dtype, longest_row=-1):
    """The kernel on CUDA copies, and the reference on the CPU tensors."""
    cuda = p.to("cuda")
    args = (a_values, b, sa, sb)
    dev = [x.cuda() if x is not None else None for x in args]
    poison_allocator(-0x5A5A5A5A5A5A5A5A, torch.int64)
    got = kernels.spmm(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v, p.m, a_bits, a_signed, b_bits,
                       out_dtype, longest_row)
    torch.cuda.synchronize()
    want = torch.ops.magicube.spmm(p.row_ptr, p.col_idx, p.row_order, *args, v, p.m, a_bits, a_signed, b_bits,
                                   out_dtype)
    return got.cpu(), want


def _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, g, fill=None):
    if fill is None:
        a = random_ints((bh, p.m, k), a_bits, a_signed, g)
        b = random_ints((bh, k, n), b_bits, True, g)
    else:
        a = torch.full((bh, p.m, k), fill[0], dtype=torch.int64)
        b = torch.full((bh, k, n), fill[1], dtype=torch.int64)
    a_values = to_container(p.pack_values(a * emask), a_bits, a_signed)
    return a_values, to_container(b, b_bits)


def _scales(bh, m, n, g, a_bits, b_bits):
    return ((torch.rand(bh, m, generator=g) + 0.01) / 2 ** (a_bits - 1),
            (torch.rand(bh, n, generator=g) + 0.01) / 2 ** (b_bits - 1))


def _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, g, where=""):
    """Random operands: the int64 products and the fp16 dequantized output equal the reference's
    (`where` names the case in a failure)."""
    a_values, b = _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, g)
    got, want = _run(kernels, p, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), f"{where}{(got != want).sum()} mismatches"
    sa, sb = _scales(bh, p.m, n, g, a_bits, b_bits)
    got, want = _run(kernels, p, a_values, b, sa, sb, v, a_bits, a_signed, b_bits, torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, want), f"{where}fp16 output differs"


@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_integer_exact(kernels, a_bits, b_bits, a_signed, v):
    for i, (bh, rows, k, n) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(1000 * i + v)
        p, emask = problem(bh, rows, k, v, 0.6 + 0.1 * (i % 4), seed=i, shuffle=bool(i % 2))
        _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, g, f"shape {(bh, rows * v, k, n)}: ")


# Batched problems whose wgmma GEMM on Hopper takes (in the dense path) its larger tile, its 128 x
# 128 or 128 x 64 tiles filling 3/4 of the SMs (12 x 3 x 3 of them), or, with one plane product,
# its smaller tile past one wave of the SMs (40 x 2 x 2 tiles of 128 x 64; within one wave that
# tile runs with a deeper ring, as in every smaller problem here); each also at an N of whole
# 16-byte fp16 chunks, which the two-warpgroup tiles store through shared memory. Then, with one
# or two plane products, its least tile (64 x 64), where the smaller one makes too few CTAs, within
# one wave of 132 SMs (16 x 4 x 2 tiles, its deeper ring) and past it (24 x 4 x 2). M, N and K
# multiples of no tile.
@pytest.mark.parametrize("bh, rows, k, n, v",
                         [(12, 75, 160, 300, 4), (12, 75, 160, 296, 4), (40, 30, 96, 100, 8), (40, 30, 96, 104, 8),
                          (16, 125, 136, 120, 2), (24, 125, 136, 118, 2)],
                         ids=["larger-tile", "larger-tile-chunks", "smaller-tile-waves", "smaller-tile-waves-chunks",
                              "least-tile", "least-tile-waves"])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_dense_gemm_batched_tiles(kernels, a_bits, b_bits, a_signed, bh, rows, k, n, v):
    """The GEMM's last K step partly past K. Under the other ways, one more batched problem."""
    p, emask = problem(bh, rows, k, v, 0.5, seed=11)
    _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, torch.Generator().manual_seed(7))


# Batched problems of short rows whose dense path expands A in groups of 8 vector rows a CTA (64 x
# 7 groups on a GPU of up to 149 SMs, the last of 5 rows) and of 4 (40 x 12, the last of 1 row);
# test_dense_gemm_batched_tiles's larger-tile problem takes groups of 2.
@pytest.mark.parametrize("bh, rows, v", [(64, 53, 2), (40, 45, 4)], ids=["groups-of-8", "groups-of-4"])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_dense_expansion_groups(kernels, a_bits, b_bits, a_signed, bh, rows, v):
    k, n = 200, 40
    p, emask = problem(bh, rows, k, v, 0.7, seed=5)
    _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, torch.Generator().manual_seed(9))


@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_merged_rows(kernels, spmm_kernel, a_bits, b_bits, a_signed):
    """V 2 rows merged four at a time (one CTA multiplies their union as a V 8 row): an empty row,
    a full one and rows of unequal length; K of several bitmap words a thread (5000) and of a
    partial word (333), int4-shuffled patterns and columns in any order; N of the narrow and the
    wide tile, partly filled. With the longest row given, not known (-1), and understated (0 and
    3), so that the union comes in windows of 32 columns, whose sums carry over. Every M / V a
    multiple of 4, so that every row merges."""
    if spmm_kernel != "merged":
        pytest.skip("the merged way's own problems")
    g = torch.Generator().manual_seed(a_bits * 10 + b_bits)
    for i, (bh, rows, k, n, sparsity) in enumerate([(2, 8, 333, 64, 0.8), (1, 12, 5000, 160, 0.95),
                                                    (3, 4, 700, 288, 0.5)]):
        p, emask = problem(bh, rows, k, 2, sparsity, seed=i, shuffle=bool(i % 2))
        if i == 2:
            p = with_columns_shuffled(p, g)
        a_values, b = _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, g)
        sa, sb = _scales(bh, p.m, n, g, a_bits, b_bits)
        for hint in (p.longest_row, -1, 0, 3):
            got, want = _run(kernels, p, a_values, b, None, None, 2, a_bits, a_signed, b_bits, torch.int64, hint)
            assert torch.equal(got, want), f"problem {i}, longest_row={hint}: {(got != want).sum()} mismatches"
        got, want = _run(kernels, p, a_values, b, sa, sb, 2, a_bits, a_signed, b_bits, torch.float16, 0)
        assert torch.equal(got, want), f"problem {i}: fp16 output differs"


@pytest.mark.parametrize("v, n", [(8, 40), (2, 160), (4, 160)])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_range_extremes(kernels, a_bits, b_bits, a_signed, v, n):
    """All values at qmin or qmax: the largest products, the int32 overflow of long rows. N 40 has
    rows not on 16 bytes (padded by the op), N 160 a partial last tile, where the stacked way puts
    16-bit A's planes into one MMA at V 2 (an offset high plane and a column of ones that undoes
    it), and at V 4 unsigned 16-bit A's and 12-bit A's (balanced digits, the high ones at -8 and
    8)."""
    amin, amax = qrange(a_bits, a_signed)
    bmin, bmax = qrange(b_bits, True)
    bh, rows, k = 2, 3, 2000
    p, emask = problem(bh, rows, k, v, 0.2, seed=5)
    for fill in [(amin, bmin), (amax, bmax), (amin, bmax), (amax, bmin)]:
        a_values, b = _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, None, fill)
        got, want = _run(kernels, p, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64)
        assert torch.equal(got, want), f"fill {fill}"


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(16, 16, True), (16, 16, False), (8, 8, False)],
                         ids=["L16-R16", "L16u-R16", "L8u-R8"])
def test_int32_overflow_long_row(kernels, a_bits, b_bits, a_signed, v):
    """One full row of 70000 columns (2188 blocks, past the int32 fold interval) at the extremes (at
    V 4, unsigned 16-bit A's planes stacked where asked)."""
    amin, amax = qrange(a_bits, a_signed)
    bmin, _ = qrange(b_bits, True)
    k, n = 70000, 16
    mask = torch.zeros(2, k, dtype=torch.bool)
    mask[1] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    fill = (amax if not a_signed else amin, bmin)
    a_values, b = _inputs(p, emask, 1, k, n, a_bits, a_signed, b_bits, None, fill)
    got, want = _run(kernels, p, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64)
    assert int(want.abs().max()) > 2**31
    assert torch.equal(got, want)


@pytest.mark.parametrize("a_bits, b_bits, a_signed, k, fill, past_int32", [
    (8, 8, True, 140000, (-128, -128), True),  # plane products of 128 x 128: past 2^31 from K = 2^17
    (16, 16, True, 33008, (-1, -1), False),    # low planes of 255 x 255: 2^31 - 1.6e6 at this K
    (16, 16, True, 33040, (-1, -1), False),    # ... and past 2^31 at this one
    (16, 16, False, 33008, (65535, -1), True),
], ids=["L8-R8-K140000", "L16-R16-K33008", "L16-R16-K33040", "L16u-R16-K33008"])
def test_dense_path_bound_on_k(kernels, a_bits, b_bits, a_signed, k, fill, past_int32):
    """Values whose plane products are the largest, over a K where their sum in the dense path's
    int32 accumulators comes within reach of 2^31 or passes it: below the bound the dense path must
    sum exactly, past it give way to a kernel that folds its sums into int64. Where the result
    itself passes 2^31 (int8's extremes; unsigned times signed 16 bits), the int64 output is
    checked too."""
    n, v = 8, 2
    mask = torch.zeros(1, k, dtype=torch.bool)
    mask[0, 7:] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    a_values, b = _inputs(p, emask, 1, k, n, a_bits, a_signed, b_bits, None, fill)
    got, want = _run(kernels, p, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64)
    assert (int(want.abs().max()) > 2**31) == past_int32
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [37, 6, 1])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", KINDS, ids=KIND_IDS)
def test_output_row_alignment(kernels, a_bits, b_bits, a_signed, n):
    """Odd N and N % 4 == 2: output rows that do not admit the paired (or 4-wide) stores."""
    if b_bits == 4 and n % 2:
        pytest.skip("int4 B packs two columns per byte")
    for v in (2, 8):
        g = torch.Generator().manual_seed(n + v)
        p, emask = problem(3, 5, 150, v, 0.6, seed=n)
        _assert_exact(kernels, p, emask, 3, 150, n, v, a_bits, a_signed, b_bits, g, f"v={v}: ")


@pytest.mark.parametrize("n", [24, 32, 96, 160])
@pytest.mark.parametrize("blocks", [511, 512, 513])
@pytest.mark.parametrize("a_bits, b_bits, a_signed, v",
                         [(8, 8, True, 2), (4, 4, True, 2), (8, 4, True, 2), (16, 8, True, 2), (16, 16, True, 2),
                          (16, 4, True, 2), (12, 4, True, 4), (16, 8, False, 4), (16, 16, False, 4), (16, 4, False, 4)],
                         ids=["L8-R8", "L4-R4", "L8-R4", "L16-R8", "L16-R16", "L16-R4", "L12-R4-V4", "L16u-R8-V4",
                              "L16u-R16-V4", "L16u-R4-V4"])
def test_fold_boundary(kernels, a_bits, b_bits, a_signed, v, blocks, n):
    """Rows of 511, 512 and 513 blocks: single-plane results are read from the int32 accumulator
    when no fold happened, from the folded int64 otherwise. N 24 has rows not on 16 bytes (padded
    by the op); N 32, 96 and 160 take the gather kernel's quarter tile for 8- and 4-bit B, its
    narrow tile (which for 8-bit B keeps the folds in local memory) and the wide one for 8- and
    16-bit B; the stacked way puts 16-bit A's planes into one MMA on every tile but 8-bit B's
    narrow one, and at V 4 unsigned 16-bit A's planes and 12-bit A's digits."""
    k = 32 * blocks
    mask = torch.zeros(3, k, dtype=torch.bool)
    mask[1] = True
    mask[2, : 32 * 511 + 5] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    g = torch.Generator().manual_seed(blocks)
    a_values, b = _inputs(p, emask, 1, k, n, a_bits, a_signed, b_bits, g)
    got, want = _run(kernels, p, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64)
    assert torch.equal(got, want)
    sa, sb = _scales(1, p.m, n, g, a_bits, b_bits)
    got, want = _run(kernels, p, a_values, b, sa, sb, v, a_bits, a_signed, b_bits, torch.float16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(8, 8, True), (16, 8, False), (8, 4, True), (4, 4, False)],
                         ids=["L8-R8", "L16u-R8", "L8-R4", "L4u-R4"])
def test_warps_take_several_rows(kernels, a_bits, b_bits, a_signed, v):
    """Enough batch x heads and column slices for one resident-B CTA per slice, so that each of
    its 16 warps runs several vector rows (an empty one and a full one among them; with V = 2 more
    than the 32 whose pattern entries a warp reads at once); 16-byte dense rows with a partial
    last 32-byte slice."""
    bh, rows, k, n = 5, 600 if v == 2 else 45, 300, 32 * 27 + 16
    p, emask = problem(bh, rows, k, v, 0.7, seed=v, shuffle=True)
    _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, torch.Generator().manual_seed(v))


@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(8, 8, True), (16, 16, False), (8, 4, True)],
                         ids=["L8-R8", "L16u-R16", "L8-R4"])
def test_rows_past_one_wave(kernels, a_bits, b_bits, a_signed):
    """The gather kernel takes vector row i in CTA i where one wave of CTAs holds its grid, and
    walks row_order past that: both exact, at BH 1 (200 vector rows, one wave) and at BH 64 (12800
    CTAs, past any GPU's wave), in the pattern's order and in a shuffled and a reversed one."""
    v, rows, k, n = 2, 200, 500, 40
    g = torch.Generator().manual_seed(a_bits + b_bits)
    p, emask = problem(1, rows, k, v, 0.8, seed=5, shuffle=True)
    for bh in (1, 64):
        for name, other in {"length": p, **reordered(p, g)}.items():
            _assert_exact(kernels, other, emask, bh, k, n, v, a_bits, a_signed, b_bits, g, f"BH {bh}, {name} order: ")


@pytest.mark.parametrize("v, k", [(2, 300), (8, 300), (2, 1600)])
@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(8, 8, True), (16, 8, False), (8, 4, True), (4, 4, False)],
                         ids=["L8-R8", "L16u-R8", "L8-R4", "L4u-R4"])
def test_small_resident_ctas(kernels, a_bits, b_bits, a_signed, v, k):
    """Rows of 96 bytes (three 32-byte slices) at BH 24: 72 (slice, batch x head) pairs, which a
    grid of one 16-warp resident-B CTA an SM holds once each, so it takes CTAs of 4 warps, several
    a pair (test_spmm_choice_cuda checks which). An empty row and a full one among 64 vector rows;
    at K 1600 the slice takes 51 KB of shared memory, past the 48 KB a launch gets unasked."""
    bh, rows = 24, 64
    n = 96 * 8 // b_bits
    p, emask = problem(bh, rows, k, v, 0.7, seed=v + 24, shuffle=True)
    _assert_exact(kernels, p, emask, bh, k, n, v, a_bits, a_signed, b_bits, torch.Generator().manual_seed(v + 24))


@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(8, 8, True), (16, 8, False), (8, 4, True)],
                         ids=["L8-R8", "L16u-R8", "L8-R4"])
def test_global_rows(kernels, a_bits, b_bits, a_signed):
    """A full row (32 blocks) among 300 rows of about one block, one empty: the resident-B
    kernel's warps take runs of rows of about equal work, so the full row's warp takes fewer
    others. With one CTA per slice (BH 5, 28 slices) and with many (BH 1: more warps than rows,
    so some runs are empty); in length order, shuffled and reversed, and with longest_row given
    (0: every warp its round-robin rows)."""
    k, v, rows = 1024, 2, 300
    g = torch.Generator().manual_seed(a_bits + b_bits)
    mask = torch.rand(rows, k, generator=g) < 0.02
    mask[5], mask[9], mask[17, :700] = True, False, True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    orders = {"length": p, **reordered(p, g)}
    for bh, n in ((5, 32 * 27 + 16), (1, 32)):
        a_values, b = _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, g)
        runs = [(name, other, -1) for name, other in orders.items()]
        runs += [("length", p, hint) for hint in (p.longest_row, 0)]
        for name, other, hint in runs:
            got, want = _run(kernels, other, a_values, b, None, None, v, a_bits, a_signed, b_bits, torch.int64, hint)
            assert torch.equal(got, want), \
                f"BH {bh}, {name} order, longest_row={hint}: {(got != want).sum()} mismatches"


def _off16(t: torch.Tensor) -> torch.Tensor:
    """A CUDA copy of `t` that starts 4 bytes past a 16-byte boundary, as a slice of a larger
    buffer would."""
    view = shifted(t.cuda(), 4 // t.element_size())
    assert view.data_ptr() % 16 == 4
    return view


@pytest.mark.parametrize("a_bits, b_bits, a_signed", [(8, 8, True), (16, 8, False), (8, 4, True)],
                         ids=["L8-R8", "L16u-R8", "L8-R4"])
def test_pattern_views_off_16_bytes(kernels, a_bits, b_bits, a_signed):
    """col_idx and the sparse values as views 4 bytes past a 16-byte boundary, which the kernels
    that copy them 16 bytes at a time (the gather kernel's paired steps, which rows of five blocks
    on six CTAs admit for all three kinds; the dense path's expansion; every kernel's sparse values)
    take as aligned copies: exact."""
    bh, rows, k, n, v = 2, 24, 500, 64, 8
    g = torch.Generator().manual_seed(a_bits + b_bits)
    p, emask = problem(bh, rows, k, v, 0.7, seed=3)
    a_values, b = _inputs(p, emask, bh, k, n, a_bits, a_signed, b_bits, g)
    want = torch.ops.magicube.spmm(p.row_ptr, p.col_idx, p.row_order, a_values, b, None, None, v, p.m, a_bits,
                                   a_signed, b_bits, torch.int64)
    cuda = p.to("cuda")
    got = kernels.spmm(cuda.row_ptr, _off16(cuda.col_idx), cuda.row_order, _off16(a_values.cuda()), b.cuda(), None,
                       None, v, p.m, a_bits, a_signed, b_bits, torch.int64, -1)
    assert torch.equal(got.cpu(), want)


def within_fp16_bound(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp16 SpMM outputs against the exact product of a's dense [BH, M, K] and b: fp32 accumulation
    of K terms, then one rounding to fp16 (half an ulp, 2^-11 relative)."""
    exact = a.double() @ b.double()
    bound = exact.abs() * 2.0**-11 + (a.double().abs() @ b.double().abs()) * a.shape[-1] * 2.0**-23 + 2.0**-24
    return bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("n", [37, 6])
def test_fp16_kernel_odd_rows(kernels, n):
    """fp16 output rows that do not admit paired stores (odd N) and N % 4 == 2."""
    for v in (2, 8):
        g = torch.Generator().manual_seed(n + v)
        p, emask = problem(3, 5, 150, v, 0.6, seed=n)
        a = (torch.randn(3, p.m, 150, generator=g) * emask).half()
        b = torch.randn(3, 150, n, generator=g).half()
        got, want = _run(kernels, p, p.pack_values(a), b, None, None, v, 16, True, 16, torch.float16)
        assert within_fp16_bound(got, a, b), f"v={v}"


@pytest.mark.parametrize("v", [2, 4, 8])
def test_fp16_kernel(kernels, v):
    for i, (bh, rows, k, n) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(77 + i)
        p, emask = problem(bh, rows, k, v, 0.5 + 0.1 * (i % 4), seed=i, shuffle=bool(i % 2))
        a = (torch.randn(bh, p.m, k, generator=g) * emask).half()
        b = torch.randn(bh, k, n, generator=g).half()
        a_values = p.pack_values(a)
        got, want = _run(kernels, p, a_values, b, None, None, v, 16, True, 16, torch.float16)
        assert got.dtype == torch.float16 and got.shape == want.shape
        assert within_fp16_bound(got, a, b), f"shape {(bh, rows * v, k, n)}"
        assert within_fp16_bound(want, a, b)


def test_fp16_padding_is_not_read(kernels):
    """Padding slots (col_idx -1) must contribute exactly zero even if B holds inf/NaN nowhere else."""
    v, k, n = 8, 50, 64
    mask = torch.zeros(2, k, dtype=torch.bool)
    mask[0, :3] = True
    mask[1, 10:45] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    a = (torch.ones(1, p.m, k) * emask).half()
    b = torch.ones(1, k, n).half()
    got, want = _run(kernels, p, p.pack_values(a), b, None, None, v, 16, True, 16, torch.float16)
    assert torch.equal(got, want)


def test_current_stream(kernels):
    p, emask = problem(2, 4, 256, 8, 0.5, seed=3)
    g = torch.Generator().manual_seed(0)
    a_values, b = _inputs(p, emask, 2, 256, 128, 8, True, 8, g)
    want = torch.ops.magicube.spmm(p.row_ptr, p.col_idx, p.row_order, a_values, b, None, None, 8, p.m, 8, True, 8,
                                   torch.int64)
    cuda = p.to("cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = kernels.spmm(cuda.row_ptr, cuda.col_idx, cuda.row_order, a_values.cuda(), b.cuda(), None, None, 8,
                           p.m, 8, True, 8, torch.int64)
    s.synchronize()
    assert torch.equal(got.cpu(), want)


def spmm_chain(op, p, a_values, b, sa, sbs):
    """op's fp16 outputs of a chain of 8-bit SpMM calls on pattern p (K = M), each taking the bits of
    the previous output, viewed as int8, as its B."""
    out = []
    for sb in sbs:
        out.append(op(p.row_ptr, p.col_idx, p.row_order, a_values, b, sa, sb, p.v, p.m, 8, True, 8, torch.float16))
        b = out[-1].view(torch.int8)
    return out


@pytest.mark.parametrize("b_bits", [8])  # named, so that the fixture runs both kernels
def test_chained_calls_wait_for_their_inputs(kernels, b_bits):
    """Each call reads the one before it: the fp16 output's bits, viewed as int8, are the next
    call's B (K = M), three calls deep, replayed from a CUDA graph so that the launches follow each
    other on the GPU. On sm_90 a call may start launching while its predecessor still writes (the
    gather kernel lets the next one launch before its epilogue, the dense path's expansion and GEMM
    launch as the kernel before them ends), so it must wait for those writes before reading
    anything. Compared bit for bit (as int16: a NaN's bits are data here)."""
    bh, rows, v = 4, 128, 8
    p, emask = problem(bh, rows, rows * v, v, 0.7, seed=5)
    g = torch.Generator().manual_seed(5)
    a_values, b = _inputs(p, emask, bh, p.m, 16, 8, True, b_bits, g)
    sa = (torch.rand(bh, p.m, generator=g) + 0.01) / 128
    sbs = [(torch.rand(bh, 16 << i, generator=g) + 0.01) / 128 for i in range(3)]
    want = spmm_chain(torch.ops.magicube.spmm, p, a_values, b, sa, sbs)
    cuda = p.to("cuda")
    args = (kernels.spmm, cuda, a_values.cuda(), b.cuda(), sa.cuda(), [sb.cuda() for sb in sbs])
    spmm_chain(*args)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = spmm_chain(*args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, (y, w) in enumerate(zip(got, want)):
            assert torch.equal(y.cpu().view(torch.int16), w.view(torch.int16)), f"call {i + 1} of the chain differs"


def test_public_op_dispatches_to_kernel(kernels):
    """magicube.ops.spmm on CUDA tensors gives the reference's answer."""
    from magicube.ops import spmm

    p, emask = problem(1, 6, 128, 4, 0.7, seed=9)
    g = torch.Generator().manual_seed(1)
    a_values, b = _inputs(p, emask, 1, 128, 64, 16, True, 4, g)
    want = spmm(p, a_values, b, a_bits=16, b_bits=4, out_dtype=torch.int64)
    got = spmm(p.to("cuda"), a_values.cuda(), b.cuda(), a_bits=16, b_bits=4, out_dtype=torch.int64)
    assert torch.equal(got.cpu(), want)


ARGUMENT_CHECKS = """
import torch
from conftest import problem
from magicube.ops import extension, to_container

extension.load("spmm")
spmm = torch.ops.magicube_cuda.spmm
p, emask = problem(1, 2, 64, 8, 0.5, seed=0)
cuda = p.to("cuda")
a = to_container(p.pack_values(emask.long()[None]), 8).cuda()
b = torch.zeros(1, 64, 32, dtype=torch.int8, device="cuda")
args = (cuda.row_ptr, cuda.col_idx, cuda.row_order)
cases = [("a_values", (a.short(), b, None, None, 8, p.m, 8, True, 8, torch.int64)),
         ("b of 8 bits", (a, b.short(), None, None, 8, p.m, 8, True, 8, torch.int64)),
         ("scale_a and scale_b", (a, b, None, None, 8, p.m, 8, True, 8, torch.float16)),
         ("contiguous", (a, b.transpose(1, 2).contiguous().transpose(1, 2), None, None, 8, p.m, 8, True, 8,
                         torch.int64))]
for name, case in cases:
    try:
        spmm(*args, *case)
    except RuntimeError as e:
        assert name in str(e), (name, str(e))
    else:
        raise AssertionError(f"no error for {name}")
print("checked")
"""


def test_argument_checks(kernels):
    """Bad arguments raise an error naming the argument.

    In a child process: a failure on the error path (the exception crossing from the extension
    into Python) must fail this test, not end the whole session.
    """
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", ARGUMENT_CHECKS], cwd=here, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "checked" in done.stdout, (done.returncode, done.stderr[-2000:])
