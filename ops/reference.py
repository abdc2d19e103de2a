"""Pure-PyTorch reference of every op: the CPU implementation and the test oracle.

Integer products are exact: they run as float64 matrix products, whose every product and
partial sum of at most 16-bit x 16-bit integers stays an integer below 2^53 for reductions
shorter than 2^21 (checked), and come back as int64. Dequantization is the one definition
every kernel follows: out = fp16(fp32(acc) * (scale_a[row] * scale_b[col])). The arguments
are those of the op schemas in `library.py` and arrive validated.
"""

from __future__ import annotations

import torch

from .format import value_coordinates
from .quant import from_container, quantize_to_container, to_container

OP_STRIDE = 32
EXACT_REDUCTION = 1 << 21  # 2^21 * 2^31 (u16 x s16) < 2^53
CHUNK_ELEMENTS = 1 << 25  # dense float64 scratch per chunk of (batch x heads): 256 MB


def _dequantize(acc: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == torch.int64:
        return acc
    if scale is None:  # fp16 inputs, accumulated in fp32
        return acc.to(out_dtype)
    return (acc.to(torch.float32) * scale).to(out_dtype)


def _decode(x: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """Values of a container as exact float64 integers, or fp16 data as fp32."""
    if x.dtype == torch.float16:
        return x.float()
    return from_container(x, bits, signed).double()


def _integers(acc: torch.Tensor, quantized: bool) -> torch.Tensor:
    return acc.round().to(torch.int64) if quantized else acc


def _chunks(bh: int, per_item: int):
    step = max(1, CHUNK_ELEMENTS // max(per_item, 1))
    return [slice(i, min(i + step, bh)) for i in range(0, bh, step)]


def _check_exact(reduction: int, quantized: bool) -> None:
    if quantized and reduction >= EXACT_REDUCTION:
        raise ValueError(f"the CPU reference sums at most {EXACT_REDUCTION - 1} exact integer products, "
                         f"got a reduction of {reduction}")


def spmm(row_ptr, col_idx, row_order, a_values, b, scale_a, scale_b, v, m, a_bits, a_signed,
         b_bits, out_dtype, longest_row=-1):
    del row_order, longest_row  # the result depends on neither
    quantized = a_values.dtype != torch.float16
    a = _decode(a_values, a_bits, a_signed)  # [BH, nnz_pad*V]
    bm = _decode(b, b_bits)  # [BH, K, N]
    bh, k = bm.shape[0], bm.shape[1]
    _check_exact(k, quantized)
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    keep = col >= 0
    row, col, a = row[keep], col[keep], a[:, keep]
    acc = []
    for part in _chunks(bh, m * k):
        dense = bm.new_zeros(a[part].shape[0], m, k)
        dense[:, row, col] = a[part]
        acc.append(dense @ bm[part])
    acc = _integers(torch.cat(acc) if acc else bm.new_zeros(0, m, bm.shape[2]), quantized)
    scale = None if scale_a is None else scale_a.unsqueeze(-1) * scale_b.unsqueeze(-2)
    return _dequantize(acc, scale, out_dtype)


def sddmm(row_ptr, col_idx, row_order, a, b, scale_a, scale_b, v, bits, out_dtype, longest_row=-1):
    del row_order, longest_row  # the result depends on neither
    quantized = a.dtype != torch.float16
    am, bm = _decode(a, bits), _decode(b, bits)  # [BH, M, K], [BH, N, K]
    _check_exact(am.shape[2], quantized)
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    pad = col < 0
    col = col.clamp(min=0)
    parts = _chunks(am.shape[0], am.shape[1] * bm.shape[1])
    acc = [(am[part] @ bm[part].transpose(1, 2))[:, row, col] for part in parts]
    acc = torch.cat(acc) if acc else am.new_zeros(0, row.numel())
    acc = _integers(acc, quantized).masked_fill(pad, 0)
    scale = None if scale_a is None else scale_a[:, row] * scale_b[:, col]
    return _dequantize(acc, scale, out_dtype)


def sparse_softmax(row_ptr, col_idx, row_order, values, v, scale, out_bits, longest_row=-1):
    del row_order, longest_row  # the result depends on neither
    bh, m = values.shape[0], (row_ptr.numel() // 2) * v
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    keep = (col >= 0).expand(bh, -1)
    index = row.expand(bh, -1)
    x = values.float() * scale  # x and x - max each rounded to fp32: both CUDA kernels round them so
    # The max skips NaN (as fmaxf does) but the row does not: a NaN score, an infinite one (inf - inf)
    # or a row of -inf alone (-inf + inf) gives a NaN e, so a NaN sum, NaN fp16 probabilities and a
    # NaN row scale, and the row's output is NaN, as a dense softmax's would be.
    row_max = x.new_full((bh, m), float("-inf")).scatter_reduce(
        1, index, x.masked_fill(~keep | x.isnan(), float("-inf")), "amax")
    e = torch.exp(x - row_max.gather(1, index)).masked_fill(~keep, 0.0)
    s = x.new_zeros(bh, m).scatter_add(1, index, e)
    if out_bits == 0:
        probs = (e / s.gather(1, index)).to(torch.float16)  # padding: 0, in a NaN row NaN (0 / NaN)
        return probs, torch.ones(bh, m, dtype=torch.float32, device=values.device)
    qmax = (1 << out_bits) - 1
    # The row's largest probability is 1/s, so p / (absmax/qmax) is e * qmax exactly; NaN rounds
    # to 0 (cvt.rni's rule). An empty row's scale is 0, a NaN row's NaN.
    q = torch.round(e * qmax).nan_to_num(nan=0.0).to(torch.int32)
    row_scale = torch.where(s != 0, 1.0 / (s * qmax), 0.0)
    return to_container(q, out_bits, signed=False), row_scale


def sparse_attention(*args):
    return compose_attention(sddmm, sparse_softmax, spmm, *args)


def compose_attention(sddmm, sparse_softmax, spmm, row_ptr, col_idx, row_order, query, key, value, scale_q, scale_k,
                      scale_v, v, softmax_scale, qk_bits, p_bits, heads, longest_row=-1):
    """sparse_attention's function, sddmm -> sparse_softmax -> spmm, through the implementations of
    the three ops given: these reference functions, or the dispatcher's ops where a fused kernel
    does not take the shape."""
    # [B, heads, rows, d'] views as the [BH, rows, d'] they hold; [B, heads, rows] scales as [BH, rows];
    # contiguous, as the ops take them
    query, key, value = (x.reshape(-1, *x.shape[-2:]).contiguous() for x in (query, key, value))
    scale_q, scale_k, scale_v = (None if s is None else s.reshape(-1, s.shape[-1]).contiguous()
                                 for s in (scale_q, scale_k, scale_v))
    pattern = (row_ptr, col_idx, row_order)
    scores = sddmm(*pattern, query, key, scale_q, scale_k, v, qk_bits, torch.float16, longest_row)
    probs, row_scale = sparse_softmax(*pattern, scores, v, softmax_scale, p_bits, longest_row)
    m = row_ptr.numel() // 2 * v
    if p_bits == 0:
        out = spmm(*pattern, probs, value, None, None, v, m, 16, True, 16, torch.float16, longest_row)
    else:
        out = spmm(*pattern, probs, value, row_scale, scale_v, v, m, p_bits, False, qk_bits, torch.float16,
                   longest_row)
    bh, _, dv = out.shape
    return out.view(bh // heads, heads, m, dv).transpose(1, 2).contiguous()


def quantize(x, scale, bits, is_signed):
    # elementwise ops keep a strided x's layout; the op's output is contiguous
    return quantize_to_container(x, scale[..., None], bits, is_signed).contiguous()


def qkv_projection(x, weight, bias, scale, heads, bits):
    b, t, _ = x.shape
    q = quantize_to_container(projection_heads(x, weight, bias, heads), scale.view(3, 1, heads, 1, 1), bits)
    # the width named, not -1: with no rows (B or T 0) it cannot be inferred
    return q.reshape(3, b * heads, t, q.shape[-1]).contiguous()


def projection_heads(x, weight, bias, heads):
    """fp16(x @ weight^T + bias) summed in fp32 and rounded once, as a [3, B, heads, T, E / heads]
    view of Q, K and V (the CUDA op's unfused path takes it too: every fp16 value is exact in fp32 and
    TF32, where an fp16 GEMM may sum in fp16)."""
    b, t, e = x.shape
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).half()
    return y.view(b, t, 3, heads, e // heads).permute(2, 0, 3, 1, 4)
