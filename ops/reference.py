"""Pure-PyTorch reference of every op: the CPU implementation and the test oracle.

Integer products are exact in int64; dequantization is the one definition every kernel
follows: out = fp16(fp32(acc) * (scale_a[row] * scale_b[col])). The arguments are those of
the op schemas in `library.py` and arrive validated.
"""

from __future__ import annotations

import torch

from .format import value_coordinates
from .quant import from_container, to_container

OP_STRIDE = 32


def _dequantize(acc: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == torch.int64:
        return acc
    if scale is None:  # fp16 inputs, accumulated in fp32
        return acc.to(out_dtype)
    return (acc.to(torch.float32) * scale).to(out_dtype)


def _decode(x: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """Values of a container as int64, or fp16 data as fp32."""
    if x.dtype == torch.float16:
        return x.float()
    return from_container(x, bits, signed)


def spmm(row_ptr, col_idx, row_order, a_values, b, scale_a, scale_b, v, m, a_bits, a_signed,
         b_bits, out_dtype):
    del row_order  # the result does not depend on the processing order
    a = _decode(a_values, a_bits, a_signed)  # [BH, nnz_pad*V]
    bm = _decode(b, b_bits)  # [BH, K, N]
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    keep = col >= 0
    row, col, a = row[keep], col[keep], a[:, keep]
    acc = bm.new_zeros(bm.shape[0], m, bm.shape[2])
    acc.index_add_(1, row, a.unsqueeze(-1) * bm[:, col, :])
    scale = None if scale_a is None else scale_a.unsqueeze(-1) * scale_b.unsqueeze(-2)
    return _dequantize(acc, scale, out_dtype)


def sddmm(row_ptr, col_idx, row_order, a, b, scale_a, scale_b, v, bits, out_dtype):
    del row_order
    am, bm = _decode(a, bits), _decode(b, bits)  # [BH, M, K], [BH, N, K]
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    pad = col < 0
    col = col.clamp(min=0)
    acc = (am[:, row, :] * bm[:, col, :]).sum(-1).masked_fill(pad, 0)
    scale = None if scale_a is None else scale_a[:, row] * scale_b[:, col]
    return _dequantize(acc, scale, out_dtype)


def sparse_softmax(row_ptr, col_idx, row_order, values, v, scale, out_bits):
    del row_order
    bh, m = values.shape[0], (row_ptr.numel() // 2) * v
    row, col = value_coordinates(row_ptr, col_idx, v, OP_STRIDE)
    keep = (col >= 0).expand(bh, -1)
    index = row.expand(bh, -1)
    x = values.float() * scale
    row_max = x.new_full((bh, m), float("-inf")).scatter_reduce(
        1, index, x.masked_fill(~keep, float("-inf")), "amax")
    e = torch.exp(x - row_max.gather(1, index)).masked_fill(~keep, 0.0)
    s = x.new_zeros(bh, m).scatter_add(1, index, e)
    if out_bits == 0:
        probs = torch.where(keep, e / s.gather(1, index), 0.0).to(torch.float16)
        return probs, torch.ones(bh, m, dtype=torch.float32, device=values.device)
    qmax = (1 << out_bits) - 1
    # The row's largest probability is 1/s, so p / (absmax/qmax) is e * qmax exactly.
    q = torch.round(e * qmax).to(torch.int32)
    row_scale = torch.where(s > 0, 1.0 / (s * qmax), 0.0)
    return to_container(q, out_bits, signed=False), row_scale


def sparse_attention(row_ptr, col_idx, row_order, query, key, value, scale_q, scale_k, scale_v, v, softmax_scale,
                     qk_bits, p_bits):
    pattern = (row_ptr, col_idx, row_order)
    scores = sddmm(*pattern, query, key, scale_q, scale_k, v, qk_bits, torch.float16)
    probs, row_scale = sparse_softmax(*pattern, scores, v, softmax_scale, p_bits)
    m = row_ptr.numel() // 2 * v
    if p_bits == 0:
        return spmm(*pattern, probs, value, None, None, v, m, 16, True, 16, torch.float16)
    return spmm(*pattern, probs, value, row_scale, scale_v, v, m, p_bits, False, qk_bits, torch.float16)
