"""The registered ops on the CPU (the reference) against dense int64 / float64 computations."""

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import RandomPattern, kept_slots, problem, random_ints
from magicube.ops import (SDDMM_BITS, SPMM_PAIRS, absmax_scale, from_container, quantize, sddmm, sparse_attention,
                          sparse_softmax, spmm, to_container)
from magicube.ops.format import value_coordinates

V = st.sampled_from([2, 4, 8])
SPMM_KINDS = [(a, b, True) for a, b in SPMM_PAIRS] + [(a, b, False) for a, b in SPMM_PAIRS if a != 12]
shapes = dict(bh=st.integers(1, 3), rows=st.integers(1, 5), k=st.integers(1, 70), n=st.integers(1, 12),
              sparsity=st.floats(0, 1), seed=st.integers(0, 2**16), shuffle=st.booleans())


def _scales(bh, rows, cols, g, a_bits, b_bits):
    """Scales of the size absmax quantization gives, so that the fp16 output stays finite."""
    return ((torch.rand(bh, rows, generator=g) + 0.01) / 2 ** (a_bits - 1),
            (torch.rand(bh, cols, generator=g) + 0.01) / 2 ** (b_bits - 1))


def _dequantized(acc, sa, sb):
    """DESIGN's definition: fp32(acc) * (scale_a * scale_b), one rounding to fp16."""
    return (acc.to(torch.float32) * (sa[:, :, None] * sb[:, None, :])).to(torch.float16)


@pytest.mark.parametrize("a_bits, b_bits, a_signed", SPMM_KINDS)
@settings(max_examples=12, deadline=None)
@given(v=V, **shapes)
def test_spmm_integer_pairs(a_bits, b_bits, a_signed, v, bh, rows, k, n, sparsity, seed, shuffle):
    g = torch.Generator().manual_seed(seed)
    n += n % 2 if b_bits == 4 else 0
    p, emask = problem(bh, rows, k, v, sparsity, seed, shuffle)
    a = random_ints((bh, p.m, k), a_bits, a_signed, g) * emask
    b = random_ints((bh, k, n), b_bits, True, g)
    a_values = to_container(p.pack_values(a), a_bits, a_signed)
    b_store = to_container(b, b_bits)
    kw = dict(a_bits=a_bits, b_bits=b_bits, a_signed=a_signed)
    acc = spmm(p, a_values, b_store, out_dtype=torch.int64, **kw)
    assert acc.dtype == torch.int64 and torch.equal(acc, a @ b)
    sa, sb = _scales(bh, p.m, n, g, a_bits, b_bits)
    out = spmm(p, a_values, b_store, scale_a=sa, scale_b=sb, **kw)
    assert out.dtype == torch.float16 and torch.equal(out, _dequantized(a @ b, sa, sb))
    exact = (a.double() @ b.double()) * sa.double()[:, :, None] * sb.double()[:, None, :]
    assert torch.allclose(out.double(), exact, rtol=2e-3, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), v=V, rows=st.integers(1, 40), k=st.integers(1, 300))
def test_random_patterns_of_the_fuzz_tests(seed, v, rows, k):
    """conftest.RandomPattern, which the GPU fuzz tests draw their patterns from, builds what the
    format accepts in any of its column and row orders and views, and the reference SpMM and SDDMM
    over it equal the dense products on its element mask."""
    rp = RandomPattern.draw(random.Random(seed), rows, k, v)
    p, emask = rp.build()
    assert emask.shape == (rows * v, k) and rp.longest_row(p) >= -1
    g = torch.Generator().manual_seed(seed)
    a = random_ints((2, p.m, k), 8, True, g) * emask
    b = random_ints((2, k, 5), 8, True, g)
    pattern = [rp.view(x) for x in (p.row_ptr, p.col_idx, p.row_order)]
    got = torch.ops.magicube.spmm(*pattern, rp.view(to_container(p.pack_values(a), 8)), rp.view(to_container(b, 8)),
                                  None, None, v, p.m, 8, True, 8, torch.int64, rp.longest_row(p))
    assert torch.equal(got, a @ b)
    q, kk = random_ints((2, p.m, 3), 8, True, g), random_ints((2, k, 3), 8, True, g)
    got = torch.ops.magicube.sddmm(*pattern, to_container(q, 8), to_container(kk, 8), None, None, v, 8, torch.int64,
                                   rp.longest_row(p))
    assert torch.equal(p.to_dense(got), (q @ kk.transpose(1, 2)) * emask)


@settings(max_examples=30, deadline=None)
@given(v=V, **shapes)
def test_spmm_fp16(v, bh, rows, k, n, sparsity, seed, shuffle):
    g = torch.Generator().manual_seed(seed)
    p, emask = problem(bh, rows, k, v, sparsity, seed, shuffle)
    a = torch.randn(bh, p.m, k, generator=g).half() * emask
    b = torch.randn(bh, k, n, generator=g).half()
    out = spmm(p, p.pack_values(a), b)
    exact = a.double() @ b.double()
    bound = (a.double().abs() @ b.double().abs()) * 2e-3 + 1e-3
    assert out.dtype == torch.float16 and bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("bits", SDDMM_BITS)
@settings(max_examples=15, deadline=None)
@given(v=V, **shapes)
def test_sddmm_integer(bits, v, bh, rows, k, n, sparsity, seed, shuffle):
    g = torch.Generator().manual_seed(seed)
    d = 2 * n  # the reduction; int4 packs along it
    p, emask = problem(bh, rows, k, v, sparsity, seed, shuffle)
    a = random_ints((bh, p.m, d), bits, True, g)
    b = random_ints((bh, k, d), bits, True, g)
    ac, bc = to_container(a, bits), to_container(b, bits)
    acc = sddmm(p, ac, bc, bits=bits, out_dtype=torch.int64)
    assert torch.equal(p.to_dense(acc), (a @ b.transpose(1, 2)) * emask)
    _, col = p.element_coordinates()
    assert bool((acc[:, col < 0] == 0).all())
    sa, sb = _scales(bh, p.m, k, g, bits, bits)
    out = sddmm(p, ac, bc, bits=bits, scale_a=sa, scale_b=sb)
    assert torch.equal(p.to_dense(out), _dequantized(a @ b.transpose(1, 2), sa, sb) * emask)


@settings(max_examples=30, deadline=None)
@given(v=V, **shapes)
def test_sddmm_fp16(v, bh, rows, k, n, sparsity, seed, shuffle):
    g = torch.Generator().manual_seed(seed)
    p, emask = problem(bh, rows, k, v, sparsity, seed, shuffle)
    a = torch.randn(bh, p.m, n, generator=g).half()
    b = torch.randn(bh, k, n, generator=g).half()
    out = p.to_dense(sddmm(p, a, b).double())
    exact = (a.double() @ b.double().transpose(1, 2)) * emask
    bound = (a.double().abs() @ b.double().abs().transpose(1, 2)) * 2e-3 + 1e-3
    assert bool(((out - exact).abs() <= bound).all())


def _softmax_dense(p, values, emask, scale):
    x = p.to_dense(values.double()) * scale
    x = x.masked_fill(~emask, float("-inf"))
    return torch.softmax(x, -1).nan_to_num(0.0)


@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
@settings(max_examples=15, deadline=None)
@given(v=V, **shapes)
def test_sparse_softmax(out_bits, v, bh, rows, k, n, sparsity, seed, shuffle):
    g = torch.Generator().manual_seed(seed)
    p, emask = problem(bh, rows, k, v, sparsity, seed, shuffle)
    values = (torch.randn(bh, p.nnz_pad * v, generator=g) * 4).half()
    scale = 1 / math.sqrt(2 * n)
    probs, row_scale = sparse_softmax(p, values, scale=scale, out_bits=out_bits)
    expected = _softmax_dense(p, values, emask, scale)
    _, col = p.element_coordinates()
    empty = ~emask.any(-1).expand(bh, -1)
    if out_bits == 0:
        got = p.to_dense(probs.double())
        assert bool((probs[:, col < 0] == 0).all())
        assert torch.allclose(got, expected, atol=1e-3, rtol=1e-3)
        return
    q = from_container(probs, out_bits, signed=False)
    qmax = (1 << out_bits) - 1
    assert bool(((q >= 0) & (q <= qmax)).all())
    assert bool((q[:, col < 0] == 0).all())
    got = p.to_dense(q.double()) * row_scale.double()[..., None]
    # per-row absmax quantization: half a step of the row's largest probability
    step = expected.amax(-1, keepdim=True) / qmax
    assert bool(((got - expected).abs() <= step / 2 + 1e-6).all())
    # the row's largest probability maps to qmax exactly; empty rows give zero scale
    has = ~empty
    assert bool((p.to_dense(q).amax(-1)[has] == qmax).all())
    assert bool((row_scale[empty] == 0).all()) and not bool(row_scale.isnan().any())


@pytest.mark.parametrize("out_bits", [0, 16, 8, 4])
def test_sparse_softmax_non_finite_scores(out_bits):
    """A row whose scaled scores hold +inf or NaN, or are -inf alone, comes out NaN, as a dense
    softmax's would: NaN fp16 probabilities (padding too), or integer ones with a NaN row scale. The
    max skips a NaN, so that row keeps the integers it would have with -inf in the NaN's place; a
    -inf score among finite ones is probability 0; no other row changes."""
    v = 2
    p, _ = problem(1, 6, 40, v, 0.3, seed=1)  # element rows 0 and 1 empty, 6 and 7 full
    g = torch.Generator().manual_seed(out_bits)
    clean = (torch.randn(1, p.nnz_pad * v, generator=g) * 4).half()
    # +inf in row 2, NaN in row 4, -inf alone in row 6, one -inf in row 8; `minus` has -inf for the NaN
    bad, minus = clean.clone(), clean.clone()
    bad[0, kept_slots(p, 2)[0]] = float("inf")
    bad[0, kept_slots(p, 4)[1]], minus[0, kept_slots(p, 4)[1]] = float("nan"), float("-inf")
    bad[0, kept_slots(p, 6)] = float("-inf")
    bad[0, kept_slots(p, 8)[0]] = minus[0, kept_slots(p, 8)[0]] = float("-inf")
    (probs, rs), (want, want_rs), (alt, alt_rs) = (sparse_softmax(p, x, scale=0.3, out_bits=out_bits)
                                                   for x in (bad, clean, minus))
    row, _ = value_coordinates(p.row_ptr, p.col_idx, v, 32)
    nan_row = torch.isin(torch.arange(p.m), torch.tensor([2, 4, 6]))
    untouched = ~torch.isin(row, torch.tensor([2, 4, 6, 8]))
    if out_bits == 0:
        assert bool(probs[0, nan_row[row]].isnan().all()) and not bool(probs[0, ~nan_row[row]].isnan().any())
        assert torch.equal(probs[:, untouched], want[:, untouched]) and torch.equal(rs, want_rs)
        assert probs[0, kept_slots(p, 8)[0]] == 0 and torch.equal(probs[:, row == 8], alt[:, row == 8])
        return
    q, wq, aq = (from_container(x, out_bits, signed=False) for x in (probs, want, alt))
    assert torch.equal(rs[0].isnan(), nan_row) and torch.equal(rs[:, ~nan_row], alt_rs[:, ~nan_row])
    assert torch.equal(q[:, untouched], wq[:, untouched])
    assert bool((q[0, (row == 2) | (row == 6)] == 0).all())  # every e NaN, and NaN rounds to 0
    assert torch.equal(q[:, (row == 4) | (row == 8)], aq[:, (row == 4) | (row == 8)])


@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (8, 8), (16, 8)])
def test_sparse_attention_non_finite_scores(p_bits, qk_bits):
    """Scores that overflow fp16 (row 5) or a NaN in Q (row 9) make those rows of the output NaN,
    and no other row changes."""
    g = torch.Generator().manual_seed(p_bits + qk_bits)
    bh, length, d, v = 2, 40, 12, 2
    p, _ = problem(bh, length // v, length, v, 0.7, 5)
    if p_bits == 0:
        q, k, val = (torch.randn(bh, length, d, generator=g).half() for _ in range(3))
        scales = dict(scale_q=None, scale_k=None, scale_v=None)
        bad = q.clone()
        bad[0, 5] *= 6e4
        bad[0, 9, 0] = float("nan")
    else:
        q, k, val = (to_container(random_ints((bh, length, d), qk_bits, True, g), qk_bits) for _ in range(3))
        scales = dict(scale_q=torch.rand(bh, length, generator=g) / 2 ** qk_bits,
                      scale_k=torch.rand(bh, length, generator=g) / 2 ** qk_bits,
                      scale_v=torch.rand(bh, d, generator=g) / 2 ** qk_bits)
        bad, bad_scales = q, dict(scales, scale_q=scales["scale_q"].clone())
        bad_scales["scale_q"][0, 5], bad_scales["scale_q"][0, 9] = 1e4, float("nan")
    args = dict(softmax_scale=d ** -0.5, qk_bits=qk_bits, p_bits=p_bits)
    out = sparse_attention(p, q, k, val, **args, **scales)
    got = sparse_attention(p, bad, k, val, **args, **(scales if p_bits == 0 else bad_scales))
    nan_row = torch.zeros(bh, length, dtype=torch.bool)
    nan_row[0, [5, 9]] = True
    assert bool(got[nan_row].isnan().all()) and not bool(got[~nan_row].isnan().any())
    assert torch.equal(got[~nan_row], out[~nan_row])


def test_quantized_attention_pipeline_matches_fp64_attention():
    """sddmm -> softmax -> spmm through the ops, 8b-8b, against fp64 masked attention."""
    g = torch.Generator().manual_seed(0)
    bh, length, d, v = 2, 64, 16, 4
    p, emask = problem(bh, length // v, length, v, 0.5, 0)
    q, k, val = (torch.randn(bh, length, d, generator=g) for _ in range(3))
    sq, sk, sv = (absmax_scale(t, 8, dim=(1, 2)).reshape(bh) for t in (q, k, val))
    qq, kq, vq = (to_container(quantize(t, s[:, None, None], 8), 8) for t, s in ((q, sq), (k, sk), (val, sv)))
    scores = sddmm(p, qq, kq, bits=8, scale_a=sq, scale_b=sk)
    probs, row_scale = sparse_softmax(p, scores, scale=d ** -0.5, out_bits=8)
    out = spmm(p, probs, vq, a_bits=8, a_signed=False, b_bits=8, scale_a=row_scale, scale_b=sv)
    att = (q.double() @ k.double().transpose(1, 2) * d ** -0.5).masked_fill(~emask, float("-inf"))
    ref = torch.softmax(att, -1).nan_to_num(0.0) @ val.double()
    assert (out.double() - ref).norm() / ref.norm() < 0.05


@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (16, 8), (8, 8), (8, 4), (4, 4), (16, 16)])
def test_sparse_attention_is_the_three_op_pipeline(p_bits, qk_bits):
    g = torch.Generator().manual_seed(p_bits + qk_bits)
    bh, length, d, v = 3, 40, 12, 2
    p, emask = problem(bh, length // v, length, v, 0.7, 5)
    fp16 = p_bits == 0
    if fp16:
        q, k, val = (torch.randn(bh, length, d, generator=g).half() for _ in range(3))
        scales = dict(scale_q=None, scale_k=None, scale_v=None)
    else:
        q, k, val = (to_container(random_ints((bh, length, d), qk_bits, True, g), qk_bits) for _ in range(3))
        scales = dict(scale_q=torch.rand(bh, length, generator=g) / 2 ** qk_bits,
                      scale_k=torch.rand(bh, length, generator=g) / 2 ** qk_bits,
                      scale_v=torch.rand(bh, d, generator=g) / 2 ** qk_bits)
    out = sparse_attention(p, q, k, val, softmax_scale=d ** -0.5, qk_bits=qk_bits, p_bits=p_bits, **scales)
    s = sddmm(p, q, k, bits=qk_bits, scale_a=scales["scale_q"], scale_b=scales["scale_k"])
    probs, rs = sparse_softmax(p, s, scale=d ** -0.5, out_bits=p_bits)
    if fp16:
        expected = spmm(p, probs, val)
    else:
        expected = spmm(p, probs, val, a_bits=p_bits, a_signed=False, b_bits=qk_bits, scale_a=rs,
                        scale_b=scales["scale_v"])
    assert out.dtype == torch.float16 and torch.equal(out, expected)
    assert bool((out[:, ~emask.any(-1)] == 0).all())  # rows with nothing kept are zero


@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (8, 8), (16, 8), (8, 4)])
def test_sparse_attention_heads_layout(p_bits, qk_bits):
    """heads=H gives [B, M, H, dv], the [BH, M, dv] result with the heads moved next to dv; one
    scale per batch x head gives what its contiguous copy does."""
    g = torch.Generator().manual_seed(7)
    bh, length, d, v = 6, 24, 8, 4
    p, _ = problem(bh, length // v, length, v, 0.6, 6)
    if p_bits == 0:
        q, k, val = (torch.randn(bh, length, d, generator=g).half() for _ in range(3))
        per_head = copies = dict(scale_q=None, scale_k=None, scale_v=None)
    else:
        q, k, val = (to_container(random_ints((bh, length, d), qk_bits, True, g), qk_bits) for _ in range(3))
        s = torch.rand(3, bh, generator=g) / 2 ** qk_bits
        per_head = dict(scale_q=s[0], scale_k=s[1], scale_v=s[2])
        copies = {name: x[:, None].expand(bh, n).contiguous() for (name, x), n in zip(per_head.items(),
                                                                                      (length, length, d))}
    args = dict(softmax_scale=d ** -0.5, qk_bits=qk_bits, p_bits=p_bits)
    flat = sparse_attention(p, q, k, val, **args, **copies)
    assert flat.shape == (bh, length, d)
    assert torch.equal(sparse_attention(p, q, k, val, **args, **per_head), flat)
    for heads in (1, 2, 3, 6):
        out = sparse_attention(p, q, k, val, **args, **per_head, heads=heads)
        assert out.shape == (bh // heads, length, heads, d) and out.is_contiguous()
        assert torch.equal(out, flat.view(bh // heads, heads, length, d).transpose(1, 2))
    with pytest.raises(ValueError, match=r"heads: expected a positive divisor of BH = 6 .*got 4"):
        sparse_attention(p, q, k, val, **args, **per_head, heads=4)
    with pytest.raises(ValueError, match=r"softmax_scale: expected a real number, got None"):
        sparse_attention(p, q, k, val, **dict(args, softmax_scale=None), **per_head)
    if p_bits:  # one scale per head ([heads]), shared by the batch: the [BH] scales that repeat it
        shared = {name: x[:2] for name, x in per_head.items()}
        out = sparse_attention(p, q, k, val, **args, **shared, heads=2)
        repeated = {name: x.repeat(3) for name, x in shared.items()}
        assert torch.equal(out, sparse_attention(p, q, k, val, **args, **repeated, heads=2))
        with pytest.raises(ValueError, match=r"scale_q: expected a number, a 0-d tensor, \[heads=2\], \[BH=6\]"):
            sparse_attention(p, q, k, val, **args, **dict(shared, scale_q=shared["scale_q"][:1].repeat(4)), heads=2)


@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (8, 8), (16, 8), (8, 4)])
def test_sparse_attention_reads_per_head_views(p_bits, qk_bits):
    """Q, K, V as [B, H, T, d] views of one token-major projection output [B, T, 3, H, d'] (read in
    place), or of a layout whose rows the kernel cannot read in place (copied): the [B, T, H, dv]
    result of the same values as [BH, T, d'] with heads=H."""
    g = torch.Generator().manual_seed(9)
    b, heads, length, d, v = 2, 3, 24, 16, 4
    p, _ = problem(b * heads, length // v, length, v, 0.6, 7)
    if p_bits == 0:
        qkv = torch.randn(b, length, 3, heads, d, generator=g).half()
        scales = dict(scale_q=None, scale_k=None, scale_v=None)
    else:
        qkv = to_container(random_ints((b, length, 3, heads, d), qk_bits, True, g), qk_bits)
        s = torch.rand(3, b * heads, generator=g) / 2 ** qk_bits
        scales = dict(scale_q=s[0], scale_k=s[1], scale_v=s[2])
    args = dict(softmax_scale=d ** -0.5, qk_bits=qk_bits, p_bits=p_bits, **scales)
    views = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, T, d']
    want = sparse_attention(p, *(x.reshape(b * heads, length, -1) for x in views), heads=heads, **args)
    got = sparse_attention(p, *views, **args)
    assert got.shape == (b, length, heads, want.shape[-1]) and torch.equal(got, want)
    odd = torch.cat([qkv, qkv[..., :1]], -1)[..., :-1].permute(2, 0, 3, 1, 4)  # rows off 16-byte strides: copied
    assert torch.equal(sparse_attention(p, *odd, heads=heads, **args), want)
    with pytest.raises(ValueError, match=r"heads: 4-D inputs hold their heads in dim 1 \(3\), got heads=2"):
        sparse_attention(p, *views, heads=2, **args)
    with pytest.raises(ValueError, match=r"heads: expected a positive int, got 3.0"):
        sparse_attention(p, *(x.reshape(b * heads, length, -1) for x in views), heads=3.0, **args)
    with pytest.raises(ValueError, match="all 3-D .* or all 4-D"):
        sparse_attention(p, views[0], views[1].reshape(b * heads, length, -1), views[2], **args)


def test_sparse_attention_rejects_a_pair_the_spmm_lacks():
    p, _ = problem(1, 2, 8, 4, 0.5, 0)
    q = torch.zeros(1, 8, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"p_bits, qk_bits: .* got \(4, 8\)"):
        sparse_attention(p, q, q, q, softmax_scale=1.0, qk_bits=8, p_bits=4, scale_q=1.0, scale_k=1.0, scale_v=1.0)
