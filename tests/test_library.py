"""Op registration: opcheck, torch.compile through the fake kernels, and the argument checks."""

import pytest
import torch

from conftest import problem, random_ints
from magicube.ops import (library, qkv_projection, quantize_to_container, reference, sddmm, sparse_attention,
                          sparse_softmax, spmm, to_container)


def _spmm_args(a_bits=8, b_bits=8, a_signed=True, bh=2, rows=3, k=37, n=10, v=4, device="cpu"):
    g = torch.Generator().manual_seed(1)
    p, emask = problem(bh, rows, k, v, 0.5, 1)
    a = to_container(p.pack_values(random_ints((bh, p.m, k), a_bits, a_signed, g)), a_bits, a_signed)
    b = to_container(random_ints((bh, k, n), b_bits, True, g), b_bits)
    sa, sb = torch.rand(bh, p.m, generator=g) / 128, torch.rand(bh, n, generator=g) / 128
    args = (p.row_ptr, p.col_idx, p.row_order, a, b, sa, sb, v, p.m, a_bits, a_signed, b_bits, torch.float16)
    return p, tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in args)


def _sddmm_args(bits=8, bh=2, rows=3, k=37, d=12, v=4):
    g = torch.Generator().manual_seed(2)
    p, _ = problem(bh, rows, k, v, 0.5, 2)
    a = to_container(random_ints((bh, p.m, d), bits, True, g), bits)
    b = to_container(random_ints((bh, k, d), bits, True, g), bits)
    # scales that keep every score finite in fp16 (|a . b| < 2^18 here)
    sa, sb = torch.rand(bh, p.m, generator=g) / 16, torch.rand(bh, k, generator=g) / 16
    return p, (p.row_ptr, p.col_idx, p.row_order, a, b, sa, sb, v, bits, torch.float16)


def _softmax_args(out_bits=8, bh=2, rows=3, k=37, v=4):
    g = torch.Generator().manual_seed(3)
    p, _ = problem(bh, rows, k, v, 0.5, 3)
    return p, (p.row_ptr, p.col_idx, p.row_order, torch.randn(bh, p.nnz_pad * v, generator=g).half(), v, 0.125,
               out_bits)


@pytest.mark.parametrize("make", [
    lambda: _spmm_args(), lambda: _spmm_args(4, 4), lambda: _spmm_args(16, 8, False), lambda: _spmm_args(12, 4),
    lambda: _spmm_args(16, 16),
])
def test_opcheck_spmm(make):
    p, args = make()
    torch.library.opcheck(torch.ops.magicube.spmm.default, args)
    torch.library.opcheck(torch.ops.magicube.spmm.default, (*args, p.longest_row))


@pytest.mark.parametrize("bits, is_signed", [(4, True), (8, True), (12, True), (16, False), (4, False)])
def test_opcheck_quantize(bits, is_signed):
    x = torch.randn(6, 24) * 100
    torch.library.opcheck(torch.ops.magicube.quantize.default, (x.abs() if not is_signed else x, torch.rand(6) + 0.5,
                                                                bits, is_signed))


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_opcheck_sddmm(bits):
    _, args = _sddmm_args(bits)
    torch.library.opcheck(torch.ops.magicube.sddmm.default, args)


@pytest.mark.parametrize("out_bits", [0, 4, 8, 16])
def test_opcheck_softmax(out_bits):
    p, args = _softmax_args(out_bits)
    torch.library.opcheck(torch.ops.magicube.sparse_softmax.default, args)
    torch.library.opcheck(torch.ops.magicube.sparse_softmax.default, (*args, p.longest_row))


@pytest.mark.parametrize("heads, per", [(1, "row"), (2, "batch x head"), (2, "head"), (4, "row")])
@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (8, 8), (8, 4)])
def test_opcheck_sparse_attention(p_bits, qk_bits, heads, per):
    g = torch.Generator().manual_seed(4)
    bh, length, d, v = 4, 24, 8, 4
    p, _ = problem(bh, length // v, length, v, 0.5, 4)
    if p_bits == 0:
        q, k, val = (torch.randn(bh, length, d, generator=g).half() for _ in range(3))
        scales = (None, None, None)
    else:
        q, k, val = (to_container(random_ints((bh, length, d), qk_bits, True, g), qk_bits) for _ in range(3))
        if per == "batch x head":  # expanded views, read in place
            scales = tuple(torch.rand(bh, 1, generator=g).expand(bh, n) for n in (length, length, d))
        elif per == "head":  # [B, heads, rows], shared by the batch
            scales = tuple(torch.rand(1, heads, 1, generator=g).expand(bh // heads, heads, n)
                           for n in (length, length, d))
        else:
            scales = tuple(torch.rand(bh, n, generator=g) for n in (length, length, d))
    args = (p.row_ptr, p.col_idx, p.row_order, q, k, val, *scales, v, d ** -0.5, qk_bits, p_bits, heads)
    torch.library.opcheck(torch.ops.magicube.sparse_attention.default, args)
    torch.library.opcheck(torch.ops.magicube.sparse_attention.default, (*args, p.longest_row))


@pytest.mark.parametrize("p_bits, qk_bits", [(0, 16), (8, 8)])
def test_opcheck_sparse_attention_per_head_views(p_bits, qk_bits):
    """Q, K, V as [B, H, T, d] views of a token-major [B, T, 3, H, d] tensor."""
    g = torch.Generator().manual_seed(5)
    b, heads, length, d, v = 2, 2, 24, 16, 4
    p, _ = problem(b * heads, length // v, length, v, 0.5, 4)
    if p_bits == 0:
        qkv = torch.randn(b, length, 3, heads, d, generator=g).half()
        scales = (None, None, None)
    else:
        qkv = to_container(random_ints((b, length, 3, heads, d), qk_bits, True, g), qk_bits)
        # scales that keep every score finite in fp16 (|q . k| < 2^18 at d 16)
        scales = tuple(torch.rand(b * heads, n, generator=g) / 16 for n in (length, length, d))
    args = (p.row_ptr, p.col_idx, p.row_order, *qkv.permute(2, 0, 3, 1, 4), *scales, v, d ** -0.5, qk_bits, p_bits,
            heads)
    torch.library.opcheck(torch.ops.magicube.sparse_attention.default, args)


def test_batches_past_the_grid_limit_run_in_slices(monkeypatch):
    """BH past MAX_BH (the kernels' grid limit) runs in slices of at most MAX_BH, whole batches of
    heads, and the outputs joined are the output of one call (the reference stands in for the
    kernels, at a limit of 5)."""
    monkeypatch.setattr(library, "MAX_BH", 5)
    g = torch.Generator().manual_seed(6)
    bh, heads, length, d, v = 12, 3, 16, 8, 4
    p, _ = problem(bh, length // v, length, v, 0.5, 6)
    q, k, val = (to_container(random_ints((bh, length, d), 8, True, g), 8) for _ in range(3))
    scales = tuple(torch.rand(bh, n, generator=g) / 16 for n in (length, length, d))
    per_head = tuple(torch.rand(1, heads, 1, generator=g).expand(bh // heads, heads, n) for n in (length, length, d))
    attention = (p.row_ptr, p.col_idx, p.row_order)
    cases = [("spmm", _spmm_args(bh=bh)[1], 1, [5, 5, 2]), ("sddmm", _sddmm_args(bh=bh)[1], 1, [5, 5, 2]),
             ("sparse_softmax", _softmax_args(bh=bh)[1], 1, [5, 5, 2]),
             ("sparse_attention", (*attention, q, k, val, *scales, v, d ** -0.5, 8, 8, heads), heads, [3] * 4),
             ("sparse_attention", (*attention, *(t.view(bh // heads, heads, length, d) for t in (q, k, val)),
                                   *per_head, v, d ** -0.5, 8, 8, heads), heads, [3] * 4)]
    for name, args, h, sizes in cases:
        op, seen = getattr(reference, name), []

        def run(*part, op=op, seen=seen):
            seen.append(part[3].shape[0] * (part[3].shape[1] if part[3].dim() == 4 else 1))
            return op(*part)

        whole, sliced = op(*args), library.in_batch_slices(run, name, args, bh, h)
        assert seen == sizes, name
        for a, b in zip(*((whole, sliced) if isinstance(whole, tuple) else ((whole,), (sliced,)))):
            assert torch.equal(a, b), name


def test_sparse_attention_checks_per_head_views():
    p, _ = problem(4, 2, 8, 4, 0.5, 0)
    qkv = torch.zeros(2, 8, 3, 2, 8, dtype=torch.float16)
    q, k, val = qkv.permute(2, 0, 3, 1, 4)  # [2, 2, 8, 8] views, rows 96 bytes apart
    pat = (p.row_ptr, p.col_idx, p.row_order)
    tail = (None, None, None, 4, 1.0, 16, 0)
    with pytest.raises(ValueError, match=r"query: a 4-D \[B, heads, rows, d\] tensor needs heads = 4 in dim 1"):
        torch.ops.magicube.sparse_attention(*pat, q, k, val, *tail, 4)
    with pytest.raises(ValueError, match="all 3-D .* or all 4-D"):
        torch.ops.magicube.sparse_attention(*pat, q, k.reshape(4, 8, 8), val, *tail, 2)
    with pytest.raises(ValueError, match="key: expected contiguous rows on strides of whole 16 bytes"):
        torch.ops.magicube.sparse_attention(*pat, q, k.transpose(2, 3), val, *tail, 2)
    odd = torch.zeros(2, 8, 2, 12, dtype=torch.float16)[..., :8].transpose(1, 2)  # rows 24 bytes apart
    with pytest.raises(ValueError, match="value: expected contiguous rows on strides of whole 16 bytes"):
        torch.ops.magicube.sparse_attention(*pat, q, k, odd, *tail, 2)
    # fp16 attention: fp16 scores and probabilities, whatever widths are given
    with pytest.raises(ValueError, match=r"p_bits: fp16 attention keeps fp16 probabilities \(0\), got 8"):
        torch.ops.magicube.sparse_attention(*pat, q, k, val, None, None, None, 4, 1.0, 16, 8, 2)
    with pytest.raises(ValueError, match=r"qk_bits: fp16 inputs .* the default \(16\), got 8"):
        torch.ops.magicube.sparse_attention(*pat, q, k, val, None, None, None, 4, 1.0, 8, 0, 2)


def test_sparse_attention_checks_scale_shapes():
    p, _ = problem(4, 2, 8, 4, 0.5, 0)
    q = torch.zeros(4, 8, 8, dtype=torch.int8)
    pat = (p.row_ptr, p.col_idx, p.row_order, q, q, q)
    s = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"scale_k: expected shape \(2, 2, 8\), got .*\(4, 1, 8\)"):
        torch.ops.magicube.sparse_attention(*pat, s, s.view(4, 1, 8), s, 4, 1.0, 8, 8, 2)
    with pytest.raises(ValueError, match=r"scale_v: expected shape \(4, 8\), got .*\(8, 4\)"):
        torch.ops.magicube.sparse_attention(*pat, s, s, s.view(8, 4), 4, 1.0, 8, 8, 2)
    per_head = torch.ones(1, 2, 1).expand(2, 2, 8)
    assert torch.equal(torch.ops.magicube.sparse_attention(*pat, per_head, per_head, per_head, 4, 1.0, 8, 8, 2),
                       torch.ops.magicube.sparse_attention(*pat, s, s, s, 4, 1.0, 8, 8, 2))


def test_sparse_attention_rejects_an_empty_head_dim():
    """Refused on every device, not left to the three ops' reshapes and the kernels' edges."""
    p, _ = problem(2, 2, 8, 4, 0.5, 0)
    q, kv = torch.zeros(2, 8, 8).half(), torch.zeros(2, 8, 8).half()
    with pytest.raises(ValueError, match=r"query: expected a head dim >= 1, got .*\(2, 8, 0\)"):
        sparse_attention(p, q[..., :0], kv[..., :0], kv, softmax_scale=1.0)
    with pytest.raises(ValueError, match=r"value: expected a head dim >= 1, got .*\(2, 8, 0\)"):
        sparse_attention(p, q, kv, kv[..., :0], softmax_scale=1.0)


def test_sparse_attention_rejects_heads_not_dividing_bh():
    p, _ = problem(6, 2, 8, 4, 0.5, 0)
    q = torch.zeros(6, 8, 8, dtype=torch.float16)
    args = (p.row_ptr, p.col_idx, p.row_order, q, q, q, None, None, None, 4, 1.0, 16, 0)
    for heads in (4, 0, -2):
        with pytest.raises(ValueError, match=rf"heads: expected a positive divisor of BH = 6 .*got {heads}"):
            torch.ops.magicube.sparse_attention(*args, heads)


def test_sparse_attention_longest_row_is_a_hint():
    """Any longest_row gives the same function; below -1 it is refused by name."""
    p, _ = problem(2, 4, 16, 4, 0.5, 1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 16, 8, generator=g).half()
    args = (p.row_ptr, p.col_idx, p.row_order, q, q, q, None, None, None, 4, 1.0, 16, 0, 1)
    out = torch.ops.magicube.sparse_attention(*args)
    for hint in (0, p.longest_row, 10**6):
        assert torch.equal(torch.ops.magicube.sparse_attention(*args, hint), out)
    with pytest.raises(ValueError, match=r"longest_row: expected -1 \(not known\) or .*got -2"):
        torch.ops.magicube.sparse_attention(*args, -2)


@pytest.mark.parametrize("name, make", [("spmm", _spmm_args), ("sddmm", _sddmm_args),
                                        ("sparse_softmax", _softmax_args)])
def test_longest_row_is_a_hint(name, make):
    """Any longest_row gives the same function; below -1 it is refused by name."""
    op = getattr(torch.ops.magicube, name)
    p, args = make()

    def outputs(*extra):  # sparse_softmax returns a pair, the others one tensor
        out = op(*args, *extra)
        return out if isinstance(out, tuple) else (out,)

    want = outputs()
    for hint in (0, p.longest_row, 10**6):
        assert all(torch.equal(got, w) for got, w in zip(outputs(hint), want, strict=True))
    with pytest.raises(ValueError, match=r"longest_row: expected -1 \(not known\) or .*got -2"):
        op(*args, -2)


def test_torch_compile_traces_the_pipeline():
    p, args = _sddmm_args()
    _, (*_, a, b, sa, sb, _, _, _) = None, args

    def attention(a, b, vals):
        s = sddmm(p, a, b, bits=8, scale_a=sa, scale_b=sb)
        probs, rs = sparse_softmax(p, s, scale=0.25, out_bits=8)
        return spmm(p, probs, vals, a_bits=8, a_signed=False, b_bits=8, scale_a=rs, scale_b=0.01)

    vals = to_container(random_ints((2, p.k, 6), 8), 8)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a, b, vals), attention(a, b, vals))


def _replace(args, index, value):
    return args[:index] + (value,) + args[index + 1:]


def test_spmm_rejects_bad_inputs_with_messages():
    p, args = _spmm_args()
    op = torch.ops.magicube.spmm
    cases = [
        (3, args[3].to(torch.int16), r"a_values: expected dtype torch.int8, got torch.int16"),
        (3, args[3][:, :-1].contiguous(), r"a_values: expected shape \(2, 384\)"),
        (4, args[4].transpose(1, 2), r"b: expected .*contiguous"),
        (4, args[4].float(), r"b: expected dtype torch.int8"),
        (4, args[4][0], r"b: expected a 3-D tensor"),
        (5, args[5][:, :-1].contiguous(), r"scale_a: expected shape \(2, 12\)"),
        (6, args[6].double(), r"scale_b: expected dtype torch.float32"),
        (7, 3, r"v: expected one of \(2, 4, 8\), got 3"),
        (8, 16, r"m: expected \(M/V\)\*V = 12 rows"),
        (9, 2, r"a_bits, b_bits: expected one of the pairs"),
        (10, False, None),  # unsigned int8 needs a uint8 container
        (12, torch.float32, r"out_dtype: expected torch.float16 \(dequantized\) or torch.int64"),
        (0, args[0].long(), r"row_ptr: expected dtype torch.int32"),
        (1, args[1][:-1], r"col_idx: the ops read patterns of stride 32"),
        (2, args[2][:-1], r"row_order: expected shape \(3,\)"),
    ]
    for index, value, message in cases:
        with pytest.raises(ValueError, match=message or r"a_values: expected dtype torch.uint8"):
            op(*_replace(args, index, value))
    with pytest.raises(ValueError, match="scale_a, scale_b: a float16 output of integer inputs needs both scales"):
        op(*_replace(args, 5, None))
    # the public wrapper checks what the raw op cannot know
    with pytest.raises(ValueError, match=r"b: expected K = 37 rows"):
        spmm(p, args[3], args[4][:, :-1], a_bits=8, b_bits=8, scale_a=1.0, scale_b=1.0)
    with pytest.raises(ValueError, match=r"scale_a: expected a number, a 0-d tensor, \[BH=2\]"):
        spmm(p, args[3], args[4], a_bits=8, b_bits=8, scale_a=torch.ones(5), scale_b=1.0)
    with pytest.raises(ValueError, match="pattern: expected an SRBCRS"):
        spmm(None, args[3], args[4])
    # fp16 values are multiplied in fp16: a width or signedness given with them would be ignored
    a16, b16 = torch.randn(args[3].shape).half(), torch.randn(args[4].shape).half()
    spmm(p, a16, b16)
    for kw, got in ((dict(a_bits=8, b_bits=8), r"\(8, 8, True\)"), (dict(a_signed=False), r"\(16, 16, False\)")):
        with pytest.raises(ValueError, match=rf"a_bits, b_bits, a_signed: fp16 .* \(16, 16, True\), got {got}"):
            spmm(p, a16, b16, **kw)


def test_sddmm_and_softmax_reject_bad_inputs_with_messages():
    p, args = _sddmm_args()
    op = torch.ops.magicube.sddmm
    cases = [
        (3, args[3][:, :-1].contiguous(), r"a: expected 12 rows \(M of the pattern\)"),
        (4, args[4][:, :, :-1].contiguous(), r"b: expected shape \(2, N, 12\)"),
        (8, 12, r"bits: expected one of \(8, 4, 16\), got 12"),
        (4, args[4].half(), r"b: expected dtype torch.int8"),
        (3, args[3].half(), r"b: fp16 a needs fp16 b"),
        (3, args[3][:, :, :0], r"a: expected K >= 1 \(the dim the products sum over\)"),
    ]
    for index, value, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*_replace(args, index, value))
    fp16 = (*args[:3], args[3].half(), args[4].half(), None, None, *args[7:])  # bits 8
    op(*_replace(fp16, 8, 16))
    with pytest.raises(ValueError, match=r"bits: fp16 inputs .* take the default \(16\), got 8"):
        op(*fp16)
    no_rows = [torch.zeros(0, dtype=torch.int32), args[1], torch.zeros(0, dtype=torch.int32), args[3][:, :0]]
    slots = args[1].numel()
    message = rf"col_idx: a pattern with no rows \(empty row_ptr\) has no columns, got {slots}"
    with pytest.raises(ValueError, match=message):
        op(*no_rows, *args[4:])
    p, args = _softmax_args()
    op = torch.ops.magicube.sparse_softmax
    for index, value, message in [
        (3, args[3].float(), "values: expected dtype torch.float16"),
        (3, args[3][:, :-2].contiguous(), r"values: expected \[BH, nnz_pad\*V = 384\]"),
        (6, 2, r"out_bits: expected one of \(0, 4, 8, 16\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            op(*_replace(args, index, value))
    with pytest.raises(ValueError, match=r"pattern: the ops read SR-BCRS of stride 32, got stride 16"):
        from magicube.ops import SRBCRS
        sparse_softmax(SRBCRS.from_mask(p.vector_mask(), stride=16), args[3])
    for scale in ("a", None, torch.ones(2)):
        with pytest.raises(ValueError, match=r"scale: expected a real number, got"):
            sparse_softmax(p, args[3], scale=scale)
    sparse_softmax(p, args[3], scale=torch.tensor(0.5))


def test_floats_other_than_fp16_are_named_not_taken_for_containers():
    """A float32 or bfloat16 operand would otherwise be checked against the integer container of
    the default width and the message would name a dtype the user never meant."""
    p, args = _spmm_args()
    for dtype in (torch.float32, torch.bfloat16):
        message = rf"expected torch.float16 \(fp16 arithmetic\) or the integer containers .*got {dtype}"
        with pytest.raises(ValueError, match="a_values: " + message):
            spmm(p, args[3].to(dtype), args[4].to(dtype))
        q = torch.zeros(2, p.m, 8, dtype=dtype)
        k = torch.zeros(2, p.k, 8, dtype=dtype)
        with pytest.raises(ValueError, match="a: " + message):
            sddmm(p, q, k)
        with pytest.raises(ValueError, match="query: " + message):
            sparse_attention(p, q, k, k, softmax_scale=1.0)


def test_wrappers_name_an_argument_that_is_not_a_tensor_or_a_scale():
    p, args = _spmm_args()
    a, b = args[3], args[4]
    q, k = torch.zeros(2, p.m, 8).half(), torch.zeros(2, p.k, 8).half()
    x, w, bias, scale, heads, _ = _qkv_projection_args(8)
    calls = [
        (lambda: spmm(p, a.tolist(), b), r"a_values: expected a tensor, got list"),
        (lambda: spmm(p, a, None), r"b: expected a tensor, got NoneType"),
        (lambda: sddmm(p, q, k.numpy()), r"b: expected a tensor, got ndarray"),
        (lambda: sparse_softmax(p, [0.0]), r"values: expected a tensor, got list"),
        (lambda: sparse_attention(p, q, k, None, softmax_scale=1.0), r"value: expected a tensor, got NoneType"),
        (lambda: quantize_to_container([1.0], 0.1, 8), r"x: expected a tensor, got list"),
        (lambda: qkv_projection(x, w, bias.tolist(), scale, heads=heads, bits=8), r"bias: expected a tensor"),
        (lambda: spmm(p, a, b, a_bits=8, b_bits=8, scale_a="x", scale_b=1.0),
         r"scale_a: expected a number or a tensor of scales, got 'x'"),
        (lambda: quantize_to_container(q, None, 8), r"scale: expected a number or a tensor of scales, got None"),
        (lambda: qkv_projection(x, w, bias, "x", heads=heads, bits=8), r"scale: expected a number or a tensor"),
        # one scale alone: the op says both are needed for an fp16 output
        (lambda: spmm(p, a, b, a_bits=8, b_bits=8, scale_a=1.0),
         r"scale_a, scale_b: a float16 output of integer inputs needs both scales"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
    # with a raw (int64) output the scales are not read, so one alone is no error
    raw = spmm(p, a, b, a_bits=8, b_bits=8, scale_b=1.0, out_dtype=torch.int64)
    assert torch.equal(raw, spmm(p, a, b, a_bits=8, b_bits=8, out_dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_is_named():
    _, args = _spmm_args()
    with pytest.raises(ValueError, match=r"b: expected a tensor on cuda"):
        torch.ops.magicube.spmm(*_replace(tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args), 4,
                                          args[4]))


@pytest.mark.parametrize("bits, is_signed", [(4, True), (8, True), (16, False)])
def test_opcheck_quantize_of_a_strided_view(bits, is_signed):
    qkv = (torch.randn(2, 5, 3, 2, 16) * 100).permute(2, 0, 3, 1, 4)  # [3, B, H, T, d] of one projection
    qkv = qkv.abs() if not is_signed else qkv
    scale = (torch.rand(3, 2, 2, 1) + 0.5).expand(3, 2, 2, 5)
    torch.library.opcheck(torch.ops.magicube.quantize.default, (qkv, scale, bits, is_signed))


def test_quantize_rejects_bad_inputs_with_messages():
    op = torch.ops.magicube.quantize
    x, s = torch.randn(4, 16), torch.ones(4)
    cases = [
        (torch.randn(16, 4).t(), s, r"x: expected a contiguous last dim \(stride 1\), got strides \(1, 4\)"),
        (torch.randn(4, 17)[:, 1:9], s, r"x: rows must lie a multiple of 16 bytes apart; strides \(17, 1\)"),
        (torch.randn(4, 12).half()[:, :8], s, r"x: rows must lie a multiple of 16 bytes apart; strides \(12, 1\)"),
        (torch.randn(4, 12), s, r"x: expected a multiple of 8 columns"),
        (torch.randn(1, 1, 1, 1, 1, 8), torch.ones(1, 1, 1, 1, 1), r"x: expected 1 to 5 dims"),
        (x.double(), s, r"x: expected float16 or float32 data"),
        (x, torch.ones(2, 4), r"scale: expected shape \(4,\)"),
        (x[None].expand(3, 4, 16), s, r"scale: expected shape \(3, 4\)"),
        (x, s.half(), r"scale: expected dtype torch.float32"),
    ]
    for xi, si, message in cases:
        with pytest.raises(ValueError, match=message):
            op(xi, si, 8, True)
    with pytest.raises(ValueError, match=r"bits: expected one of \(4, 8, 16\) for unsigned data, got 12"):
        op(x, s, 12, False)


def _qkv_projection_args(bits, bias=True, b=2, t=5, e=24, heads=3, dtype=torch.float16):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(b, t, e, generator=g).to(dtype)
    w = (torch.randn(3 * e, e, generator=g) / e ** 0.5).to(dtype)
    bias = (torch.randn(3 * e, generator=g) / 10).to(dtype) if bias else None
    return x, w, bias, torch.rand(3, heads, generator=g) / 20 + 0.01, heads, bits


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_opcheck_qkv_projection(bits, bias):
    torch.library.opcheck(torch.ops.magicube.qkv_projection.default, _qkv_projection_args(bits, bias))


@pytest.mark.parametrize("b, t", [(2, 0), (0, 5)])
@pytest.mark.parametrize("bits", [4, 8])
def test_opcheck_qkv_projection_of_no_rows(b, t, bits):
    """No rows (an empty batch or sequence): an empty container of the full shape, as the CUDA op's."""
    args = _qkv_projection_args(bits, b=b, t=t)
    torch.library.opcheck(torch.ops.magicube.qkv_projection.default, args)
    assert torch.ops.magicube.qkv_projection(*args).shape == (3, b * 3, t, 8 // (2 if bits == 4 else 1))


def test_qkv_projection_is_the_projection_then_quantize():
    """Containers [3, B * H, T, d'] of Q, K, V: per (batch x head) the fp16 projection's slice quantized
    with its Q/K/V x head scale."""
    x, w, bias, scale, heads, _ = _qkv_projection_args(8)
    got = qkv_projection(x, w, bias, scale, heads=heads, bits=8)
    y = torch.nn.functional.linear(x.float(), w.float(), bias.float()).half()  # [B, T, 3E]
    b, t, e = x.shape
    d = e // heads
    for which in range(3):
        for bb in range(b):
            for h in range(heads):
                part = y[bb, :, which * e + h * d:which * e + (h + 1) * d]
                want = torch.round(part.float() / scale[which, h]).clamp(-128, 127).to(torch.int8)
                assert torch.equal(got[which, bb * heads + h], want)
    # one scale per Q/K/V: the same as that scale repeated over the heads
    assert torch.equal(qkv_projection(x, w, bias, scale[:, :1], heads=heads, bits=8),
                       qkv_projection(x, w, bias, scale[:, :1].expand(3, heads), heads=heads, bits=8))


def test_qkv_projection_rejects_bad_inputs_with_messages():
    x, w, bias, scale, heads, bits = _qkv_projection_args(8)
    cases = [
        ((x.float(), w, bias, scale, heads, 8), r"x: expected dtype torch.float16"),
        ((x, w[:-1], bias, scale, heads, 8), r"weight: expected shape \(72, 24\)"),
        ((x, w, bias[:-1], scale, heads, 8), r"bias: expected shape \(72,\)"),
        ((x, w, bias, scale, 5, 8), r"heads: expected a positive divisor of the embedding E = 24 .*got 5"),
        ((x, w, bias, scale[:, :2], heads, 8), r"scale: expected shape \(3, 3\)"),
        ((x, w, bias, scale, heads, 12), r"bits: expected one of \(8, 4, 16\)"),
        ((x[..., :15].contiguous(), w[:45, :15].contiguous(), bias[:45], scale, heads, 4),
         r"heads: 4-bit containers pack pairs along the head dim, which E / heads = 5 does not split"),
        ((x[:, ::2], w, bias, scale, heads, 8), r"x: expected a contiguous tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            torch.ops.magicube.qkv_projection(*args)
    with pytest.raises(ValueError, match=r"scale: expected \[3\], \[3, 1\] or \[3, heads=3\] scales"):
        qkv_projection(x, w, bias, scale[:2], heads=heads, bits=8)
    for bad in (-2, 0, 3.0, True):  # checked before the scale is shaped by it
        with pytest.raises(ValueError, match=rf"heads: expected a positive int, got {bad!r}"):
            qkv_projection(x, w, bias, scale[:, 0], heads=bad, bits=8)
