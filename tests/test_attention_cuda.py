"""The fused CUDA sparse-attention kernel against the reference (the CPU implementation of
magicube::sparse_attention, i.e. sddmm -> sparse_softmax -> spmm with the same roundings).

Integer modes: the fp16 output is expected bit-exact, except where the exp() of the kernel and of
torch.exp on the CPU round differently and move one quantized probability by one unit. One unit of
q_j changes an output by row_scale * scale_v * |value_j|, so the difference is bounded by
row_scale * scale_v * sum_j |value_j| (over the row's kept keys) plus one fp16 ulp, and at least 99 %
of the outputs must be bit-exact. fp16 mode: both the kernel and the reference are held to the
error that fp16 scores, fp16 probabilities and the fp16 output allow, against a float64 softmax of
the exact scores.
"""

import math

import pytest
import torch

from conftest import load_kernels, poison_allocator, problem, random_ints, reordered, with_columns_shuffled
from magicube.ops import (SRBCRS, VectorMask, absmax_scale, from_container, quantize, random_vector_mask,
                          to_container)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (p_bits, qk_bits); p_bits 0 is the fp16 mode.
PAIRS = [(8, 8), (16, 8), (8, 4), (4, 4), (16, 16), (16, 4), (0, 16)]
PAIR_IDS = [f"P{p}-QK{q}" if p else "fp16" for p, q in PAIRS]

# (BH, M/V, N, sparsity): N multiple of nothing; row 0 is empty and row M/V // 2 full
# (conftest.awkward_mask); N = 1500 makes the full row longer than the kernel's score cache.
SHAPES = [(1, 7, 333, 0.6), (3, 5, 97, 0.7), (1, 1, 40, 0.8), (2, 4, 1500, 0.9)]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("attention")


def _quantized(x, bits, dim):
    """x quantized with absmax scales over `dim` -> (container, scale without the reduced dim; [BH, 1]
    when reducing over (1, 2))."""
    scale = absmax_scale(x, bits, dim=dim)
    kept = scale.squeeze(-1) if dim == (1, 2) else scale.squeeze(dim)
    return to_container(quantize(x, scale, bits), bits), kept.contiguous()


def make_inputs(bh, m, n, d, p_bits, qk_bits, g, spread=1.0, per_head=False):
    """Q, K, V ~ N(0, 1) (K times `spread`), quantized with per-row (Q, K) and per-column (V) scales,
    or with one scale per batch x head expanded over the rows (stride 0, as the layer passes them)."""
    q = torch.randn(bh, m, d, generator=g)
    k = torch.randn(bh, n, d, generator=g) * spread
    v = torch.randn(bh, n, d, generator=g)
    if p_bits == 0:
        return q.half(), k.half(), v.half(), None, None, None
    if per_head:
        (qc, sq), (kc, sk), (vc, sv) = (_quantized(x, qk_bits, (1, 2)) for x in (q, k, v))
        return qc, kc, vc, sq.expand(bh, m), sk.expand(bh, n), sv.expand(bh, d)
    qc, sq = _quantized(q, qk_bits, -1)
    kc, sk = _quantized(k, qk_bits, -1)
    vc, sv = _quantized(v, qk_bits, 1)
    return qc, kc, vc, sq, sk, sv


def to_cuda(x):
    """x on the GPU; an expanded scale stays an expanded view (a plain copy would be contiguous)."""
    if x is not None and x.dim() == 2 and x.stride(1) == 0:
        return x[:, :1].cuda().expand_as(x)
    return None if x is None else x.cuda()


def run_both(kernels, p, inputs, v, softmax_scale, qk_bits, p_bits, heads=1):
    """The kernel and the reference, both [BH / heads, M, heads, dv], returned as [BH, M, dv]."""
    cuda = p.to("cuda")
    dev = [to_cuda(x) for x in inputs]
    poison_allocator(float("nan"), torch.float16)
    got = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v, softmax_scale, qk_bits,
                                   p_bits, heads)
    torch.cuda.synchronize()
    want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, softmax_scale,
                                               qk_bits, p_bits, heads)
    bh, m, dv = inputs[0].shape[0], inputs[0].shape[1], want.shape[-1]
    assert got.shape == want.shape == (bh // heads, m, heads, dv) and got.is_contiguous()
    return heads_flat(got), heads_flat(want)


def heads_flat(y):
    """The op's [BH / heads, M, heads, dv] as [BH, M, dv], on the CPU."""
    b, m, heads, dv = y.shape
    return y.cpu().transpose(1, 2).reshape(b * heads, m, dv)


def on_stream_and_captured(kernels, args):
    """The op run on a side stream, and captured there in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        on_stream = kernels.sparse_attention(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            captured = kernels.sparse_attention(*args)
    graph.replay()
    torch.cuda.synchronize()
    return on_stream, captured


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.double().abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0**-14)))
    return torch.pow(2.0, e - 10)


def check_quantized(p, emask, inputs, got, want, v, softmax_scale, qk_bits, p_bits, what, min_exact=0.99):
    q, k, val, sq, sk, sv = inputs
    assert got.dtype == torch.float16 and got.shape == want.shape, what
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (an element was not written?)"
    pattern = (p.row_ptr, p.col_idx, p.row_order)
    scores = torch.ops.magicube.sddmm(*pattern, q, k, sq.contiguous(), sk.contiguous(), v, qk_bits, torch.float16)
    _, row_scale = torch.ops.magicube.sparse_softmax(*pattern, scores, v, softmax_scale, p_bits)
    vabs = from_container(val, qk_bits).abs().double()  # [BH, N, d]
    per_row = emask.double() @ vabs  # sum over the row's kept keys of |value|
    bound = row_scale.double()[..., None] * sv.double()[:, None, :] * per_row + fp16_ulp(want) * 1.0001
    diff = (got.double() - want.double()).abs()
    bad = diff > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} outputs beyond one probability unit, worst "
                           f"{float((diff - bound).max()):.3g}")
    exact = float((got == want).double().mean())
    assert exact >= min_exact, f"{what}: only {exact:.2%} of the outputs are bit-exact"
    empty = emask.sum(1) == 0
    assert bool((got[:, empty] == 0).all()), f"{what}: rows without kept keys must be 0"


def check(p, emask, inputs, got, want, v, softmax_scale, qk_bits, p_bits, what, min_exact=0.99):
    """The mode's bound: fp16 (p_bits 0) or quantized probabilities (`min_exact` of the outputs
    bit-exact)."""
    if p_bits == 0:
        check_fp16(p, emask, inputs, got, want, softmax_scale, what)
    else:
        check_quantized(p, emask, inputs, got, want, v, softmax_scale, qk_bits, p_bits, what, min_exact)


def check_fp16(p, emask, inputs, got, want, softmax_scale, what):
    q, k, val = (x.double() for x in inputs[:3])
    assert got.dtype == torch.float16 and got.shape == want.shape, what
    assert not torch.isnan(got).any(), f"{what}: NaN in the output"
    s = q @ k.transpose(1, 2)  # exact scores, [BH, M, N]
    keep = emask[None].expand_as(s)
    x = (s * softmax_scale).masked_fill(~keep, float("-inf"))
    prob = torch.softmax(x, dim=-1).nan_to_num(0.0)
    exact = prob @ val
    # Each side rounds the scores to fp16 (half an ulp, times the softmax scale, moves every
    # probability by a relative 2 * delta at most), the probabilities to fp16 (2^-11 relative,
    # 2^-25 absolute below the normal range) and the output once.
    delta = (fp16_ulp(s.masked_fill(~keep, 0.0)) * 0.5 * abs(softmax_scale)).amax(-1, keepdim=True)
    weighted = prob @ val.abs()
    tol = 1.5 * (2 * delta + 2.0**-10) * weighted + keep.double() @ val.abs() * 2.0**-25 + fp16_ulp(exact) + 1e-6
    for name, out in (("kernel", got), ("reference", want)):
        err = (out.double() - exact).abs()
        assert bool((err <= tol).all()), f"{what}: {name} beyond the fp16 bound, worst {float((err - tol).max()):.3g}"
    empty = emask.sum(1) == 0
    assert bool((got[:, empty] == 0).all()), f"{what}: rows without kept keys must be 0"


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("v", [2, 4, 8])
@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_matches_reference(kernels, p_bits, qk_bits, v, d):
    for i, (bh, rows, n, sparsity) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(100 * i + 10 * v + d)
        p, emask = problem(bh, rows, n, v, sparsity, seed=i, shuffle=bool(i % 2))
        spread = 1.0 + i  # peakier softmax in later shapes: many probabilities quantize to 0
        inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, spread)
        softmax_scale = d**-0.5
        got, want = run_both(kernels, p, inputs, v, softmax_scale, qk_bits, p_bits)
        what = f"shape (BH={bh}, M={p.m}, N={n}, d={d})"
        check(p, emask, inputs, got, want, v, softmax_scale, qk_bits, p_bits, what)


@pytest.mark.parametrize("p_bits, qk_bits", [pq for pq in PAIRS if pq[0]], ids=[i for i in PAIR_IDS if i != "fp16"])
def test_range_extremes(kernels, p_bits, qk_bits):
    """Q, K at qmax, V at qmin: equal scores (uniform probabilities), the largest value products."""
    lo, hi = -(1 << (qk_bits - 1)), (1 << (qk_bits - 1)) - 1
    bh, rows, n, v, d = 2, 3, 2000, 8, 64
    p, emask = problem(bh, rows, n, v, 0.2, seed=5)
    full = lambda shape, x: to_container(torch.full(shape, x, dtype=torch.int64), qk_bits)  # noqa: E731
    s = 1.0 / (hi * math.sqrt(d))  # scores of about 1, whatever the width
    inputs = (full((bh, p.m, d), hi), full((bh, n, d), hi), full((bh, n, d), lo),
              torch.full((bh, p.m), s), torch.full((bh, n), s), torch.full((bh, d), 1e-2))
    got, want = run_both(kernels, p, inputs, v, 0.125, qk_bits, p_bits)
    check_quantized(p, emask, inputs, got, want, v, 0.125, qk_bits, p_bits, "extremes")


@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_balanced_rows(kernels, p_bits, qk_bits):
    """The benchmark's kind of mask (every vector row keeps the same count, 13 blocks of 32 at
    L = 4096, sparsity 0.9) on a smaller L: whole rows with every block in the score cache, BH = 6
    batch x heads of 128 vector rows, 4 rows of one batch x head a CTA (the shapes of
    test_matches_reference leave the last CTA part empty)."""
    bh, seq, v, d = 6, 1024, 8, 64
    mask = random_vector_mask(seq, seq, v, 0.9, seed=2)
    p = SRBCRS.from_mask(mask, stride=32)
    g = torch.Generator().manual_seed(11)
    inputs = make_inputs(bh, seq, seq, d, p_bits, qk_bits, g)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
    check(p, mask.to_dense(), inputs, got, want, v, d**-0.5, qk_bits, p_bits, "balanced")


@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_negative_softmax_scale(kernels, p_bits, qk_bits):
    """A negative softmax scale: the row max is then the smallest score times the scale."""
    bh, rows, n, v, d = 3, 5, 97, 8, 32
    p, emask = problem(bh, rows, n, v, 0.7, seed=1)
    g = torch.Generator().manual_seed(5)
    inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g)
    scale = -(d**-0.5)
    got, want = run_both(kernels, p, inputs, v, scale, qk_bits, p_bits)
    check(p, emask, inputs, got, want, v, scale, qk_bits, p_bits, "negative scale")


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_heads_layout_and_expanded_scales(kernels, p_bits, qk_bits, heads):
    """The output as [BH / heads, M, heads, dv] (the layer's [B, M, H * d]) with per-(batch x head)
    scales read in place (stride 0 along the rows), whole rows (BH = 8: two CTAs of 4) and split rows:
    against the reference, and bit for bit the kernel's [BH, M, dv] result with contiguous scales."""
    cases = [(8, 6, 333, 0.6, 64)]  # (BH, M/V, N, sparsity, d)
    if (p_bits, qk_bits) == (16, 16):
        cases.append((4, 3, 22_500, 0.95, 32))  # past one warp's int32 accumulation: split rows
    for i, (bh, rows, n, sparsity, d) in enumerate(cases):
        v = 8
        p, emask = problem(bh, rows, n, v, sparsity, seed=3 + i, shuffle=True)
        g = torch.Generator().manual_seed(10 * heads + i)
        inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, per_head=True)
        got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits, heads)
        what = f"heads={heads}, BH={bh}, N={n}"
        check(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, what)
        contiguous = [x if x is None else x.contiguous() for x in inputs]
        flat, _ = run_both(kernels, p, contiguous, v, d**-0.5, qk_bits, p_bits)
        assert torch.equal(got, flat), f"{what}: the heads layout or the expanded scales changed the output"


def token_major(x, heads):
    """[BH, rows, d] as a [B, heads, rows, d] view of a token-major [B, rows, 2, heads, d] tensor (as
    Q of a Q/K/V projection output [B, rows, 3, heads, d]) whose other half holds junk (NaN, or the
    largest container value) that a wrong stride would read."""
    bh, rows, d = x.shape
    junk = float("nan") if x.dtype == torch.float16 else torch.iinfo(x.dtype).max
    buf = torch.full((bh // heads, rows, 2, heads, d), junk, dtype=x.dtype, device=x.device)
    buf[:, :, 1] = x.view(bh // heads, heads, rows, d).transpose(1, 2)
    return buf[:, :, 1].transpose(1, 2)


# (BH, M/V, N, sparsity): an empty row and a full one (conftest.awkward_mask); N = 1500 makes the
# full row longer than the score cache; BH = 12 leaves the last CTA of whole rows part empty.
TOKEN_MAJOR_SHAPES = [(4, 7, 333, 0.6), (6, 6, 1500, 0.9), (12, 5, 97, 0.7)]


@pytest.mark.parametrize("per_head", [False, True], ids=["per-row-scales", "per-head-scales"])
@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("v", [2, 8])
@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_per_head_views(kernels, p_bits, qk_bits, v, heads, per_head):
    """Q, K and V as 4-D [B, heads, rows, d] views of token-major tensors, read at their strides:
    against the reference on the same values as [BH, rows, d], and bit for bit the kernel's result
    from contiguous copies."""
    d = 64
    for i, (bh, rows, n, sparsity) in enumerate(TOKEN_MAJOR_SHAPES):
        bh = bh // heads * heads
        p, emask = problem(bh, rows, n, v, sparsity, seed=20 + i, shuffle=bool(i % 2))
        g = torch.Generator().manual_seed(1000 * i + 10 * v + heads)
        inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, spread=1.0 + i, per_head=per_head)
        cuda = p.to("cuda")
        q, k, val, *scales = (to_cuda(x) for x in inputs)
        tail = (*scales, v, d**-0.5, qk_bits, p_bits, heads)
        poison_allocator(float("nan"), torch.float16)
        got = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order,
                                       *(token_major(x, heads) for x in (q, k, val)), *tail)
        want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, d**-0.5, qk_bits,
                                                   p_bits, heads)
        assert got.shape == want.shape == (bh // heads, p.m, heads, d) and got.is_contiguous()
        what = f"per-head views, heads={heads}, BH={bh}, M={p.m}, N={n}"
        check(p, emask, inputs, heads_flat(got), heads_flat(want), v, d**-0.5, qk_bits, p_bits, what)
        copies = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, q, k, val, *tail)
        assert torch.equal(got, copies), f"{what}: the views changed the output"


def global_rows(n, v, g):
    """400 vector rows of density 0.01 over n keys, every 20th full (global tokens) and row 7
    empty: the pattern and its element mask."""
    mask = torch.rand(400, n, generator=g) < 0.01
    mask[3::20], mask[7] = True, False
    return SRBCRS.from_mask(VectorMask(mask, v), stride=32), VectorMask(mask, v).to_dense()


@pytest.mark.parametrize("rows", ["awkward", "global"])
@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("p_bits, qk_bits", PAIRS[:-1], ids=PAIR_IDS[:-1])
def test_scales_per_head(kernels, p_bits, qk_bits, heads, rows):
    """One scale per head, shared by the batch: [B, heads, rows] views of [heads] scales (stride 0
    along the batch and the rows), read in place beside 3-D and 4-D inputs, against the reference
    and bit for bit the kernel's result with contiguous [BH, rows] copies. Rows: an empty and a
    full one among short ones (whole rows), or 20 global rows of 2048 keys among 400 of density
    0.01 (the split kernel beside the whole-row one)."""
    d, v = 64, 8
    g = torch.Generator().manual_seed(50 + heads)
    if rows == "awkward":
        bh, n = 4 * heads, 333
        p, emask = problem(bh, 6, n, v, 0.7, seed=40 + heads, shuffle=True)
    else:
        bh, n = 2 * heads, 2048
        p, emask = global_rows(n, v, g)
    q, k, val, *per_bh = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, per_head=True)
    per_head = [s[:heads, 0] for s in per_bh]  # the first batch's scales serve every batch
    widths = (p.m, n, d)
    copies = [s.repeat(bh // heads)[:, None].expand(bh, c).contiguous() for s, c in zip(per_head, widths)]
    views = [s.cuda().view(1, heads, 1).expand(bh // heads, heads, c) for s, c in zip(per_head, widths)]
    cuda = p.to("cuda")
    dev = [x.cuda() for x in (q, k, val)]
    tail = (v, d**-0.5, qk_bits, p_bits, heads)
    poison_allocator(float("nan"), torch.float16)
    got = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, *views, *tail)
    from_views = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order,
                                          *(token_major(x, heads) for x in dev), *views, *tail)
    want = kernels.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, *(c.cuda() for c in copies),
                                    *tail)
    what = f"per-head scales, heads={heads}, {rows} rows"
    assert torch.equal(got, want) and torch.equal(from_views, want), f"{what}: the scale views changed the output"
    ref = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, q, k, val, *copies, *tail)
    check(p, emask, (q, k, val, *copies), heads_flat(got), heads_flat(ref), v, d**-0.5, qk_bits, p_bits, what)


def test_per_head_views_global_rows(kernels):
    """Long rows read from per-head views: the split CTAs on the side stream and the whole-row
    kernel both take the strides (400 vector rows of density 0.01, 20 full, one empty; B 2, 4
    heads), eager and captured in a CUDA graph."""
    heads, n, v, d = 4, 2048, 8, 64
    bh = 2 * heads
    g = torch.Generator().manual_seed(32)
    p, emask = global_rows(n, v, g)
    inputs = make_inputs(bh, p.m, n, d, 8, 8, g, per_head=True)
    cuda = p.to("cuda")
    q, k, val, *scales = (to_cuda(x) for x in inputs)
    args = (cuda.row_ptr, cuda.col_idx, cuda.row_order, *(token_major(x, heads) for x in (q, k, val)), *scales, v,
            d**-0.5, 8, 8, heads)
    eager, captured = on_stream_and_captured(kernels, args)
    assert torch.equal(captured, eager)
    want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, d**-0.5, 8, 8, heads)
    check_quantized(p, emask, inputs, heads_flat(eager), heads_flat(want), v, d**-0.5, 8, 8,
                    "per-head views, global rows")


def three_ops(p, q, k, val, sq, sk, sv, v, softmax_scale, qk_bits, p_bits):
    """sddmm -> sparse_softmax -> spmm by hand, [BH, M, dv]."""
    ops, pattern = torch.ops.magicube, (p.row_ptr, p.col_idx, p.row_order)
    scores = ops.sddmm(*pattern, q, k, sq, sk, v, qk_bits, torch.float16)
    probs, row_scale = ops.sparse_softmax(*pattern, scores, v, softmax_scale, p_bits)
    if p_bits == 0:
        return ops.spmm(*pattern, probs, val, None, None, v, p.m, 16, True, 16, torch.float16)
    return ops.spmm(*pattern, probs, val, row_scale, sv, v, p.m, p_bits, False, qk_bits, torch.float16)


@pytest.mark.parametrize("d", [8, 16, 48])
@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_other_head_dims_run_the_three_ops(kernels, p_bits, qk_bits, d):
    """Head dims the fused kernel is not built for, and a value narrower than query and key: the op
    runs the three ops on their kernels, within the mode's bound of the reference and bit for bit
    the three ops by hand."""
    for i, (bh, rows, n, sparsity) in enumerate(SHAPES):
        v = (2, 8)[i % 2]
        g = torch.Generator().manual_seed(100 * i + d)
        p, emask = problem(bh, rows, n, v, sparsity, seed=i, shuffle=bool(i % 2))
        q, k, val, sq, sk, sv = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, spread=1.0 + i)
        if i == 2:  # dv = d / 2
            per_byte = 2 if qk_bits == 4 else 1
            val = val[..., :d // 2 // per_byte].contiguous()
            sv = None if sv is None else sv[:, :d // 2].contiguous()
        inputs = (q, k, val, sq, sk, sv)
        cuda, dev = p.to("cuda"), [to_cuda(x) for x in inputs]
        poison_allocator(float("nan"), torch.float16)
        got = torch.ops.magicube.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v, d**-0.5,
                                                  qk_bits, p_bits, 1)
        want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, d**-0.5, qk_bits,
                                                   p_bits, 1)
        what = f"d={d}, dv={want.shape[-1]}, BH={bh}, M={p.m}, N={n}, V={v}"
        assert got.shape == want.shape == (bh, p.m, 1, want.shape[-1]) and got.is_contiguous(), what
        check(p, emask, inputs, heads_flat(got), heads_flat(want), v, d**-0.5, qk_bits, p_bits, what)
        hand = three_ops(cuda, *dev, v, d**-0.5, qk_bits, p_bits)
        assert torch.equal(got.view(bh, p.m, -1), hand), f"{what}: not the three ops' function"


@pytest.mark.parametrize("p_bits, qk_bits", [pq for pq in PAIRS if pq[1] != 4], ids=[
    i for i, pq in zip(PAIR_IDS, PAIRS) if pq[1] != 4])
def test_other_head_dims_per_head_views(kernels, p_bits, qk_bits):
    """4-D per-head views of head dim 16 (rows on 16-byte strides): the same output as contiguous
    [BH, rows, d] inputs, in the [B, M, heads, d] layout."""
    d, heads, v = 16, 2, 8
    bh, rows, n, sparsity = TOKEN_MAJOR_SHAPES[0]
    p, emask = problem(bh, rows, n, v, sparsity, seed=3)
    g = torch.Generator().manual_seed(7)
    inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g, per_head=True)
    cuda = p.to("cuda")
    q, k, val, *scales = (to_cuda(x) for x in inputs)
    tail = (*scales, v, d**-0.5, qk_bits, p_bits, heads)
    got = torch.ops.magicube.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order,
                                              *(token_major(x, heads) for x in (q, k, val)), *tail)
    flat = torch.ops.magicube.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, q, k, val, *tail)
    want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, d**-0.5, qk_bits,
                                               p_bits, heads)
    assert got.shape == want.shape == (bh // heads, p.m, heads, d)
    assert torch.equal(got, flat), "the views changed the output"
    check(p, emask, inputs, heads_flat(got), heads_flat(want), v, d**-0.5, qk_bits, p_bits, "per-head views")


def test_long_row_uncached(kernels):
    """One row of 6000 keys (188 blocks, most past the score cache) next to short ones."""
    v, n, d = 8, 6000, 64
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[0, ::7] = True
    mask[1] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    emask = VectorMask(mask, v).to_dense()
    g = torch.Generator().manual_seed(3)
    for p_bits, qk_bits in [(8, 8), (16, 16), (0, 16)]:
        inputs = make_inputs(1, p.m, n, d, p_bits, qk_bits, g)
        got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
        check(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, "long row")


@pytest.mark.parametrize("p_bits, qk_bits", [(8, 8), (8, 4), (0, 16)], ids=["P8-QK8", "P8-QK4", "fp16"])
def test_unsorted_columns(kernels, p_bits, qk_bits):
    """Each row's columns in a random order: the softmax, the score cache and the key / value
    gathers must not rely on ascending keys. 40 vector rows of 0 to 1200 keys."""
    bh, rows, n, v, d = 2, 40, 1200, 8, 64
    g = torch.Generator().manual_seed(21)
    mask = torch.rand(rows, n, generator=g) < torch.rand(rows, 1, generator=g) * 0.4
    mask[0], mask[1] = False, True
    p = with_columns_shuffled(SRBCRS.from_mask(VectorMask(mask, v), stride=32), g)
    emask = VectorMask(mask, v).to_dense()
    inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
    check(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, "unsorted columns")


@pytest.mark.parametrize("p_bits, qk_bits, n", [(16, 16, 22_500), (8, 8, 66_000), (16, 4, 66_000)])
def test_split_rows(kernels, p_bits, qk_bits, n):
    """N past the exact int32 accumulation of one warp over a whole row: the kernel splits each row
    over 4 warps. Rows of 2000 keys (63 blocks, past the score cache), 300 keys and none; BH = 3.
    The rows are kept short of N: with tens of thousands of 16-bit probabilities in one row, exp
    rounding alone moves enough of them by one unit to change more than 1 % of the outputs."""
    v, d = 8, 64
    gm = torch.Generator().manual_seed(3)
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[0, torch.randperm(n, generator=gm)[:2000]] = True
    mask[1, torch.randperm(n, generator=gm)[:300]] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32, shuffle=True)
    emask = VectorMask(mask, v).to_dense()
    g = torch.Generator().manual_seed(7)
    inputs = make_inputs(3, p.m, n, d, p_bits, qk_bits, g)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
    check_quantized(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, f"split rows, N={n}")


@pytest.mark.parametrize("p_bits, qk_bits", [(16, 16), (8, 8)], ids=["P16-QK16", "P8-QK8"])
def test_keys_past_the_fused_accumulation_run_the_three_ops(kernels, p_bits, qk_bits):
    """N past the exact int32 accumulation of the fused kernel even over split rows: the kernel
    refuses it, the op runs the three ops instead (int64 sums in the SpMM), bit for bit the three
    ops by hand and within the mode's bound of the reference. The op's bound is the kernel's: at
    the last N it takes, the op runs the fused kernel."""
    from magicube.ops.library import fused_sums_exact

    v, d, step = 8, 32, 32
    last = step
    while fused_sums_exact(last + step, qk_bits, p_bits):
        last += step
    assert not fused_sums_exact(last + 1, qk_bits, p_bits)
    ops = torch.ops.magicube
    for n in (last, last + 1):
        gm = torch.Generator().manual_seed(n)
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, torch.randperm(n, generator=gm)[:1000]] = True
        mask[0, n - 1] = True  # the last key, alone in its block past the bound
        p = SRBCRS.from_mask(VectorMask(mask, v), stride=32, shuffle=True)
        g = torch.Generator().manual_seed(7)
        inputs = make_inputs(1, p.m, n, d, p_bits, qk_bits, g)
        cuda, dev = p.to("cuda"), [to_cuda(x) for x in inputs]
        args = (cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v, d**-0.5, qk_bits, p_bits, 1)
        poison_allocator(float("nan"), torch.float16)
        got = ops.sparse_attention(*args).view(1, p.m, d)
        if n == last:
            assert torch.equal(got, kernels.sparse_attention(*args).view(1, p.m, d)), f"N={n}: not the fused kernel"
            continue
        with pytest.raises(RuntimeError, match="exact int32 accumulation"):
            kernels.sparse_attention(*args)
        assert torch.equal(got, three_ops(cuda, *dev, v, d**-0.5, qk_bits, p_bits)), f"N={n}: not the three ops"
        want = ops.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *inputs, v, d**-0.5, qk_bits, p_bits, 1)
        check_quantized(p, VectorMask(mask, v).to_dense(), inputs, got.cpu(), want.view(1, p.m, d), v, d**-0.5,
                        qk_bits, p_bits, f"N={n}")


@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_global_rows(kernels, p_bits, qk_bits):
    """Global tokens: 400 vector rows of density 0.01, 20 of them full (64 blocks against a mean of
    5: past 8 mean rows, so split CTAs take them, one a row, on a side stream beside the whole-row
    kernel), one empty; the same result from a CUDA graph (the fork and join captured). A shuffled
    and a reversed row_order put long rows past the positions the split CTAs look at (a
    permutation of any order is a valid pattern: the order only balances load), where a warp
    takes them: still within the bound of the reference."""
    bh, n, v, d = 3, 2048, 8, 64
    g = torch.Generator().manual_seed(31)
    p, emask = global_rows(n, v, g)
    inputs = make_inputs(bh, p.m, n, d, p_bits, qk_bits, g)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
    check(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, "global rows")
    cuda = p.to("cuda")
    args = (cuda.row_ptr, cuda.col_idx, cuda.row_order, *(to_cuda(x) for x in inputs), v, d**-0.5, qk_bits, p_bits, 1)
    eager, captured = on_stream_and_captured(kernels, args)
    assert torch.equal(captured, eager)
    assert torch.equal(eager.transpose(1, 2).reshape(bh, p.m, d).cpu(), got)
    # longest_row, a hint: the pattern's own gives the same launch; 0 (wrong) keeps every row on a
    # warp, still the same function.
    assert torch.equal(kernels.sparse_attention(*args, p.longest_row).transpose(1, 2).reshape(bh, p.m, d).cpu(), got)
    on_warps = kernels.sparse_attention(*args, 0).transpose(1, 2).reshape(bh, p.m, d).cpu()
    check(p, emask, inputs, on_warps, want, v, d**-0.5, qk_bits, p_bits, "global rows, longest_row=0")
    for name, other in reordered(p, g).items():
        got = run_both(kernels, other, inputs, v, d**-0.5, qk_bits, p_bits)[0]
        check(p, emask, inputs, got, want, v, d**-0.5, qk_bits, p_bits, f"global rows, {name} row_order")


@pytest.mark.parametrize("p_bits, qk_bits", PAIRS, ids=PAIR_IDS)
def test_non_finite_scores(kernels, p_bits, qk_bits):
    """Scores that overflow fp16 to +-inf (a Q row of +-1e4, or its scale 1e4) and a NaN in a Q row
    (or its scale) make those rows NaN, in the kernel as in the reference, on whole rows and on
    split global rows; every other row is bit for bit what it is with clean inputs."""
    bh, v, d = 2, 8, 64
    g = torch.Generator().manual_seed(51)
    cases = {"whole rows": (*problem(bh, 5, 1500, v, 0.9, seed=2), [2 * v, v + 3]),  # row 2 full, past the cache
             "global rows": (*global_rows(2048, v, g), [3 * v, 23 * v + 5])}
    for what, (p, emask, rows) in cases.items():
        assert bool(emask[rows].any(-1).all())
        inputs = make_inputs(bh, p.m, p.k, d, p_bits, qk_bits, g)
        bad = list(inputs)
        if p_bits == 0:
            bad[0] = inputs[0].clone()
            bad[0][0, rows[0]] = inputs[0][0, rows[0]].sign() * 1e4
            bad[0][0, rows[1], 7] = float("nan")
        else:
            bad[3] = inputs[3].clone()
            bad[3][0, rows[0]], bad[3][0, rows[1]] = 1e4, float("nan")
        clean, _ = run_both(kernels, p, inputs, v, d**-0.5, qk_bits, p_bits)
        got, want = run_both(kernels, p, bad, v, d**-0.5, qk_bits, p_bits)
        nan_row = torch.zeros(bh, p.m, dtype=torch.bool)
        nan_row[0, rows] = True
        assert bool(want[nan_row].isnan().all()) and not bool(want[~nan_row].isnan().any()), f"{what}: reference"
        assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN rows differ from the reference's"
        assert torch.equal(got[~nan_row], clean[~nan_row]), f"{what}: a clean row changed"
        # The three-op pipeline's kernels agree on the NaN rows.
        cuda = p.to("cuda")
        pattern = (cuda.row_ptr, cuda.col_idx, cuda.row_order)
        q, k, val, sq, sk, sv = (to_cuda(x) for x in bad)
        scores = torch.ops.magicube.sddmm(*pattern, q, k, sq, sk, v, qk_bits, torch.float16)
        probs, row_scale = torch.ops.magicube.sparse_softmax(*pattern, scores, v, d**-0.5, p_bits)
        three = torch.ops.magicube.spmm(*pattern, probs, val, row_scale if p_bits else None, sv, v, p.m, p_bits or 16,
                                        p_bits == 0, qk_bits, torch.float16)
        assert torch.equal(three.isnan().cpu(), want.isnan()), f"{what}: the three-op pipeline's NaN rows"


def test_global_rows_across_windows(kernels):
    """Long rows with more batch x heads than one rasterization window: both launches, split and
    whole rows, cover the second window. 200 vector rows, 10 full; BH one past a window of 8-bit
    keys and values (N x 128 bytes each at d 64)."""
    v, d, n, rows = 8, 64, 2048, 200
    window = torch.cuda.get_device_properties(0).L2_cache_size // 3 // (n * 2 * d)
    bh = window + 1
    g = torch.Generator().manual_seed(41)
    mask = torch.rand(rows, n, generator=g) < 0.01
    mask[3::20] = True
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    inputs = make_inputs(bh, p.m, n, d, 8, 8, g, per_head=True)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, 8, 8)
    check_quantized(p, VectorMask(mask, v).to_dense(), inputs, got, want, v, d**-0.5, 8, 8,
                    f"global rows, BH = {bh}, one past a window of {window}")


def test_rasterization_windows_and_row_groups(kernels):
    """The grid's two limits. Batch x heads go in windows of as many as keep their 8-bit keys and
    values (N x 128 bytes each at d 64) within a third of L2: one more than a window makes a
    second, narrow window. Row groups (4 vector rows each) go 65535 to a launch: 262,148 vector
    rows of V 2 (M = 524,296, N 40) take two launches."""
    v, d, n = 8, 64, 4096
    window = torch.cuda.get_device_properties(0).L2_cache_size // 3 // (n * 2 * d)
    bh = max(window, 1) + 1
    p, emask = problem(bh, 3, n, v, 0.9, seed=6)
    g = torch.Generator().manual_seed(4)
    inputs = make_inputs(bh, p.m, n, d, 8, 8, g, per_head=True)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, 8, 8)
    check_quantized(p, emask, inputs, got, want, v, d**-0.5, 8, 8, f"BH = {bh}, one past a window of {window}")

    v, n, d, rows = 2, 40, 32, 4 * 65535 + 8
    mask = torch.rand(rows, n, generator=g) < 0.1
    mask[-1] = True  # the second launch's last row keeps every key
    p = SRBCRS.from_mask(VectorMask(mask, v), stride=32)
    inputs = make_inputs(1, p.m, n, d, 8, 8, g, per_head=True)
    got, want = run_both(kernels, p, inputs, v, d**-0.5, 8, 8)
    check_quantized(p, VectorMask(mask, v).to_dense(), inputs, got, want, v, d**-0.5, 8, 8,
                    f"{rows} vector rows")


def test_public_op_dispatches_to_kernel(kernels):
    from magicube.ops import sparse_attention

    p, emask = problem(2, 6, 200, 8, 0.7, seed=9)
    g = torch.Generator().manual_seed(1)
    q, k, val, sq, sk, sv = make_inputs(2, p.m, 200, 64, 8, 8, g)
    want = sparse_attention(p, q, k, val, softmax_scale=0.125, qk_bits=8, p_bits=8, scale_q=sq, scale_k=sk,
                            scale_v=sv)
    got = sparse_attention(p.to("cuda"), q.cuda(), k.cuda(), val.cuda(), softmax_scale=0.125, qk_bits=8, p_bits=8,
                           scale_q=sq.cuda(), scale_k=sk.cuda(), scale_v=sv.cuda())
    check_quantized(p, emask, (q, k, val, sq, sk, sv), got.cpu(), want, 8, 0.125, 8, 8, "public op")


def test_batches_past_the_grid_limit_run_in_slices(kernels):
    """BH past 65535, the grid dimension the kernels lay batch x heads along: every public op runs
    in slices of whole batches. The SpMM's and SDDMM's raw integer outputs equal the reference's;
    the softmax's and the attention's equal the op's own outputs on the slices, joined."""
    from magicube.ops import reference

    bh, heads, v, n, d = 65540, 4, 8, 24, 32
    p, _ = problem(bh, 2, n, v, 0.5, seed=3)
    g = torch.Generator().manual_seed(7)
    cuda = p.to("cuda")
    pattern = (cuda.row_ptr, cuda.col_idx, cuda.row_order)
    a = to_container(p.pack_values(random_ints((bh, p.m, n), 8, True, g)), 8, True).cuda()
    q, k, val, b = (to_container(random_ints(shape, 8, True, g), 8).cuda()
                    for shape in ((bh, p.m, d), (bh, n, d), (bh, n, d), (bh, n, d)))
    spmm = (*pattern, a, b, None, None, v, p.m, 8, True, 8, torch.int64)
    sddmm = (*pattern, q, k, None, None, v, 8, torch.int64)
    assert torch.equal(torch.ops.magicube.spmm(*spmm), reference.spmm(*spmm))
    assert torch.equal(torch.ops.magicube.sddmm(*sddmm), reference.sddmm(*sddmm))

    def joined(op, args, step, batched):
        parts = [op(*(t[i:i + step] if j in batched else t for j, t in enumerate(args))) for i in range(0, bh, step)]
        return tuple(torch.cat(x) for x in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)

    scores = torch.randn(bh, p.nnz_pad * v, generator=g).half().cuda()
    softmax = (*pattern, scores, v, 0.125, 8)
    got, want = torch.ops.magicube.sparse_softmax(*softmax), joined(torch.ops.magicube.sparse_softmax, softmax,
                                                                     65535, (3,))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    scales = tuple(torch.rand(bh, rows, generator=g).cuda() / 64 for rows in (p.m, n, d))
    attention = (*pattern, q, k, val, *scales, v, d**-0.5, 8, 8, heads)
    got = torch.ops.magicube.sparse_attention(*attention)
    assert got.shape == (bh // heads, p.m, heads, d)
    assert torch.equal(got, joined(torch.ops.magicube.sparse_attention, attention, 65532, range(3, 9)))


def test_current_stream_and_graph_capture(kernels):
    """Runs on the current stream and needs no host synchronisation: a CUDA graph replays it."""
    p, _ = problem(2, 8, 512, 8, 0.9, seed=4)
    g = torch.Generator().manual_seed(2)
    inputs = [x.cuda() for x in make_inputs(2, p.m, 512, 64, 8, 8, g)]
    cuda = p.to("cuda")
    args = (cuda.row_ptr, cuda.col_idx, cuda.row_order, *inputs, 8, 0.125, 8, 8, 1)
    want = kernels.sparse_attention(*args)
    on_stream, captured = on_stream_and_captured(kernels, args)
    assert torch.equal(on_stream, want)
    assert torch.equal(captured, want)


def quantized_layer(pattern, x, scale, fused):
    """A quantized layer's ops on x [3, BH, N, d] (fp16 Q, K, V) with scales [3, BH, 1, 1]: the
    quantize op, then the fused op or sddmm -> sparse_softmax -> spmm, 8-bit throughout."""
    from magicube import ops

    q, k, v = ops.quantize_to_container(x, scale, 8)
    sq, sk, sv = scale.view(3, -1)
    d = x.shape[-1]
    if fused:
        return ops.sparse_attention(pattern, q, k, v, softmax_scale=d ** -0.5, qk_bits=8, p_bits=8, scale_q=sq,
                                    scale_k=sk, scale_v=sv)
    s = ops.sddmm(pattern, q, k, bits=8, scale_a=sq, scale_b=sk)
    p, row_scale = ops.sparse_softmax(pattern, s, scale=d ** -0.5, out_bits=8)
    return ops.spmm(pattern, p, v, a_bits=8, a_signed=False, b_bits=8, scale_a=row_scale, scale_b=sv)


@pytest.mark.parametrize("fused", [False, True], ids=["three-ops", "fused"])
def test_chained_ops_wait_for_their_inputs(kernels, fused):
    """Each op reads what the one before it wrote (a fresh fp16 product, its containers, the
    scores, the probabilities), replayed from a CUDA graph so that the launches follow each other
    on the GPU. On sm_90 every kernel may start launching while its predecessor still runs
    (launch.cuh), so it must wait for those writes first. Compared bit for bit with the same calls
    run one at a time, for three different inputs."""
    for family in ("quantize", "sddmm", "softmax", "spmm"):  # built, or the ops would fall back to the reference
        load_kernels(family)
    bh, n, d, v = 8, 512, 64, 8
    pattern = SRBCRS.from_mask(random_vector_mask(n, n, v, 0.8, seed=6)).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(6)
    base = torch.randn(3, bh, n, d, device="cuda", generator=g)
    scale = base.abs().amax(dim=(2, 3), keepdim=True) / 127
    factor = torch.ones((), device="cuda")
    wants = []
    for f in (1.0, -0.5, 2.0):
        wants.append(quantized_layer(pattern, (base * f).half(), scale, fused))
        torch.cuda.synchronize()
    quantized_layer(pattern, (base * factor).half(), scale, fused)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = quantized_layer(pattern, (base * factor).half(), scale, fused)
    for f, want in zip((1.0, -0.5, 2.0), wants):
        factor.fill_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"factor {f}: the chain differs"


def test_argument_checks(kernels):
    p, _ = problem(4, 2, 64, 8, 0.5, seed=0)
    cuda = p.to("cuda")
    g = torch.Generator().manual_seed(0)
    q, k, val, sq, sk, sv = (x.cuda() for x in make_inputs(4, p.m, 64, 64, 8, 8, g))
    pat = (cuda.row_ptr, cuda.col_idx, cuda.row_order)
    with pytest.raises(RuntimeError, match="dv"):
        kernels.sparse_attention(*pat, q, k, val[..., :32].contiguous(), sq, sk, sv[:, :32].contiguous(), 8, 0.1, 8,
                                 8, 1)
    with pytest.raises(RuntimeError, match="head dim d"):
        kernels.sparse_attention(*pat, q[..., :48].contiguous(), k[..., :48].contiguous(), val, sq, sk, sv, 8, 0.1,
                                 8, 8, 1)
    with pytest.raises(RuntimeError, match="p_bits"):
        kernels.sparse_attention(*pat, q, k, val, sq, sk, sv, 8, 0.1, 8, 4, 1)
    with pytest.raises(RuntimeError, match="scale_q"):
        kernels.sparse_attention(*pat, q, k, val, None, sk, sv, 8, 0.1, 8, 8, 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.sparse_attention(*pat, q, k.transpose(1, 2).contiguous().transpose(1, 2), val, sq, sk, sv, 8, 0.1,
                                 8, 8, 1)
    with pytest.raises(RuntimeError, match="heads must divide BH = 4, got 3"):
        kernels.sparse_attention(*pat, q, k, val, sq, sk, sv, 8, 0.1, 8, 8, 3)
    # 4-D inputs: heads in dim 1, rows contiguous on 16-byte strides
    q4, k4, v4 = (token_major(x, 2) for x in (q, k, val))
    with pytest.raises(RuntimeError, match="heads = 4"):
        kernels.sparse_attention(*pat, q4, k4, v4, sq, sk, sv, 8, 0.1, 8, 8, 4)
    with pytest.raises(RuntimeError, match="all be 3-D"):
        kernels.sparse_attention(*pat, q4, k, v4, sq, sk, sv, 8, 0.1, 8, 8, 2)
    with pytest.raises(RuntimeError, match="contiguous rows on strides"):
        kernels.sparse_attention(*pat, q4, k4.transpose(2, 3), v4, sq, sk, sv, 8, 0.1, 8, 8, 2)
    padded = torch.zeros(2, 64, 2, 72, dtype=torch.int8, device="cuda")[..., :64].transpose(1, 2)  # rows 72 bytes apart
    with pytest.raises(RuntimeError, match="strides of whole 16 bytes"):
        kernels.sparse_attention(*pat, q4, padded, v4, sq, sk, sv, 8, 0.1, 8, 8, 2)
    with pytest.raises(RuntimeError, match="scale_k must be a float32"):
        kernels.sparse_attention(*pat, q, k, val, sq, sk.double(), sv, 8, 0.1, 8, 8, 1)
    with pytest.raises(RuntimeError, match=r"scale_v must be a float32 \[BH, 64\] = \[4, 64\] or \[B, heads, 64\] = "
                                           r"\[2, 2, 64\] tensor, got Float of shape \[4, 1, 64\]"):
        kernels.sparse_attention(*pat, q, k, val, sq, sk, sv.view(4, 1, 64), 8, 0.1, 8, 8, 2)
    want = kernels.sparse_attention(*pat, q, k, val, sq, sk, sv, 8, 0.1, 8, 8, 1)
    assert math.isfinite(float(want.float().sum()))
    # scales at any strides: every other element of a wider tensor (NaN in between)
    strided = [torch.stack((s, torch.full_like(s, float("nan"))), -1)[..., 0] for s in (sq, sk, sv)]
    assert all(s.stride(1) == 2 for s in strided)
    assert torch.equal(kernels.sparse_attention(*pat, q, k, val, *strided, 8, 0.1, 8, 8, 1), want)
