"""The public ops: SR-BCRS patterns in, the registered `torch.ops.magicube` ops underneath."""

from __future__ import annotations

import torch

from . import library  # registers the ops
from . import quant
from .format import SRBCRS

_ops = torch.ops.magicube


def _pattern(pattern: SRBCRS, device: torch.device) -> SRBCRS:
    if not isinstance(pattern, SRBCRS):
        raise ValueError(f"pattern: expected an SRBCRS, got {type(pattern).__name__}")
    if pattern.stride != library.OP_STRIDE:
        raise ValueError(f"pattern: the ops read SR-BCRS of stride {library.OP_STRIDE}, got stride {pattern.stride}; "
                         f"build it with SRBCRS.from_mask(mask, stride={library.OP_STRIDE})")
    if pattern.device != device:
        raise ValueError(f"pattern: on {pattern.device} but the data is on {device}; use pattern.to({str(device)!r})")
    return pattern


def _heads(heads):
    """`heads` checked before the wrappers shape scales with it (the ops check that it divides)."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads: expected a positive int, got {heads!r}")
    return heads


def _tensors(**named) -> None:
    """The wrappers' tensor arguments are tensors (before they read .device or .contiguous())."""
    for name, t in named.items():
        library.check_tensor(name, t, contiguous=False)


def _scale_tensor(scale, name: str, device) -> torch.Tensor:
    """A scale argument (a number, a sequence or a tensor) as an fp32 tensor on `device`."""
    try:
        return torch.as_tensor(scale, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name}: expected a number or a tensor of scales, got {scale!r}") from None


def _number(value, name: str) -> float:
    """A real number (an int, a float, a one-element tensor) as a Python float, for the ops' float
    arguments."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a real number, got {value!r}") from None


def expand_scale(scale, bh: int, n: int, name: str, device, heads: int | None = None) -> torch.Tensor:
    """A per-tensor, per-(batch x head) or per-row scale as an fp32 [BH, n] view (expanded, not
    copied: the fused attention reads it in place; spmm and sddmm take it contiguous). With `heads`,
    also one scale per head shared by the batch ([heads]), as a [BH / heads, heads, n] view."""
    s = _scale_tensor(scale, name, device)
    if heads and s.dim() == 1 and s.numel() == heads:
        return s.view(1, heads, 1).expand(bh // heads, heads, n)
    if s.dim() == 1 and s.numel() in (1, bh):
        s = s[:, None]
    if s.dim() not in (0, 2) or (s.dim() == 2 and (s.shape[0] not in (1, bh) or s.shape[1] not in (1, n))):
        per_head = "" if heads is None else f"[heads={heads}], "
        raise ValueError(f"{name}: expected a number, a 0-d tensor, {per_head}[BH={bh}], [BH, 1] or [BH, {n}] "
                         f"scales, got shape {tuple(s.shape)}")
    return s.expand(bh, n)


def _scales(scale_a, scale_b, bh, rows, cols, device):
    """Contiguous [BH, rows] and [BH, cols] scales for spmm and sddmm (a None stays None: the op
    says which outputs need scales)."""
    return tuple(None if s is None else expand_scale(s, bh, n, name, device).contiguous()
                 for s, n, name in ((scale_a, rows, "scale_a"), (scale_b, cols, "scale_b")))


def spmm(pattern: SRBCRS, a_values: torch.Tensor, b: torch.Tensor, *, a_bits: int = 16, b_bits: int = 16,
         a_signed: bool = True, scale_a=None, scale_b=None, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """C[bh] = A[bh] @ B[bh]: sparse A (SR-BCRS values [BH, nnz_pad*V]) times dense B [BH, K, N].

    Integer inputs come in the containers of `magicube.ops.quant` (int4 packed along N for B),
    holding values of their bits only (12-bit A's int16 in [-2048, 2047], as `to_container` checks:
    the kernel that stacks 12-bit A's digits relies on it); the result is dequantized with scale_a
    (per row of A) and scale_b (per column of B) to fp16, or returned as the exact int64 accumulator
    with out_dtype=torch.int64. fp16 inputs take no scales and the default widths (fp16 arithmetic).
    On CUDA, integer inputs run on one of three ways that give the same bits: the gather kernel, the
    resident-B kernel (narrow B, many gathers) or, where the mask is dense enough that B would be
    gathered many times over (low V and sparsity), A and B expanded to byte planes for a dense int8
    GEMM (cuBLAS's for one signed plane each on small problems off Hopper, else the project's own,
    on wgmma on Hopper); the op picks by estimated time, and the environment variable
    MAGICUBE_SPMM_KERNEL=gather|stacked|merged|resident|dense|dense_wgmma forces one where it
    applies (stacked: the gather kernel with 16-bit A's two byte planes in one MMA, at V 2, and at V
    4 unsigned 16-bit A's planes and 12-bit A's two digits; merged: the gather kernel on V 2 rows
    four at a time, as V 8 rows of their columns' union, where M is a multiple of 8), or
    MAGICUBE_SPMM_KERNEL=tuned times the ways at a problem's first call and runs the fastest after.
    """
    _tensors(a_values=a_values, b=b)
    p = _pattern(pattern, b.device)
    if b.dim() != 3:
        raise ValueError(f"b: expected a [BH, K, N] tensor, got shape {tuple(b.shape)}")
    if b.shape[1] != p.k:
        raise ValueError(f"b: expected K = {p.k} rows (the pattern's columns), got shape {tuple(b.shape)}")
    bh = b.shape[0]
    n = b.shape[2] * (2 if (b_bits == 4 and b.dtype == torch.uint8) else 1)
    sa, sb = _scales(scale_a, scale_b, bh, p.m, n, b.device)
    return _ops.spmm(p.row_ptr, p.col_idx, p.row_order, a_values.contiguous(), b.contiguous(), sa, sb, p.v, p.m,
                     a_bits, a_signed, b_bits, out_dtype, p.longest_row)


def sddmm(pattern: SRBCRS, a: torch.Tensor, b: torch.Tensor, *, bits: int = 16, scale_a=None, scale_b=None,
          out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """(A[bh] @ B[bh]^T) at the pattern's kept entries, as SR-BCRS values [BH, nnz_pad*V].

    A is [BH, M, K] and B [BH, N, K] (N = the pattern's columns), int4 packed along K; fp16 inputs
    take no scales and the default bits (fp16 arithmetic).
    """
    _tensors(a=a, b=b)
    p = _pattern(pattern, a.device)
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"a, b: expected [BH, M, K] and [BH, N, K], got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if b.shape[1] != p.k:
        raise ValueError(f"b: expected N = {p.k} rows (the pattern's columns), got shape {tuple(b.shape)}")
    sa, sb = _scales(scale_a, scale_b, a.shape[0], p.m, p.k, a.device)
    return _ops.sddmm(p.row_ptr, p.col_idx, p.row_order, a.contiguous(), b.contiguous(), sa, sb, p.v, bits,
                      out_dtype, p.longest_row)


def sparse_softmax(pattern: SRBCRS, values: torch.Tensor, *, scale: float = 1.0,
                   out_bits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of scale * values over the kept entries of every row.

    out_bits=0 gives fp16 probabilities; 16/8/4 give unsigned integers in SR-BCRS containers
    with a per-row fp32 dequantization scale (1 / (row sum * qmax)), ready for
    spmm(a_bits=out_bits, a_signed=False, scale_a=row_scale). Rows with no kept entry are 0; a row
    whose scores hold +inf or NaN, or -inf alone, is NaN (its row scale NaN at integer widths).
    """
    _tensors(values=values)
    p = _pattern(pattern, values.device)
    return _ops.sparse_softmax(p.row_ptr, p.col_idx, p.row_order, values.contiguous(), p.v, _number(scale, "scale"),
                               out_bits, p.longest_row)


def sparse_attention(pattern: SRBCRS, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                     softmax_scale: float, qk_bits: int = 16, p_bits: int = 0, scale_q=None, scale_k=None,
                     scale_v=None, heads: int | None = None) -> torch.Tensor:
    """softmax(scale * Q K^T at the pattern) V in one op: the composition of sddmm, sparse_softmax
    and spmm with the same roundings (fp16 scores, probabilities of p_bits), so that a fused
    kernel and the three-op pipeline compute one function. query [BH, M, d], key [BH, N, d],
    value [BH, N, dv], or all three [B, H, rows, d] (any strides: per-head views of one Q/K/V
    projection output are read in place where their rows are contiguous on 16-byte strides);
    integer inputs in the containers of qk_bits (int4 packed along d / dv). Scales: a number, one
    per batch x head ([BH]), per row of Q and K and column of V ([BH, rows]), or with `heads` or
    4-D inputs one per head ([heads]), shared by the batch; expanded forms are read in place.

    Returns [BH, M, dv], or with `heads` or 4-D inputs (BH = B * heads, bh = b * heads + h)
    [B, M, heads, dv]: the heads side by side, as an output projection reads them (a view as
    [B, M, heads * dv]).
    """
    _tensors(query=query, key=key, value=value)
    p = _pattern(pattern, query.device)
    heads = None if heads is None else _heads(heads)
    dims = (query.dim(), key.dim(), value.dim())
    if dims not in ((3, 3, 3), (4, 4, 4)):
        raise ValueError(f"query, key, value: expected all 3-D [BH, rows, d] or all 4-D [B, H, rows, d] tensors, got "
                         f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-2] != p.k:
        raise ValueError(f"key: expected N = {p.k} rows (the pattern's columns), got shape {tuple(key.shape)}")
    if query.dim() == 4:
        if heads not in (None, query.shape[1]):
            raise ValueError(f"heads: 4-D inputs hold their heads in dim 1 ({query.shape[1]}), got heads={heads}")
        heads = query.shape[1]
        bh = query.shape[0] * heads
        # read in place where the kernel can
        query, key, value = (x if library.rows_readable(x) else x.contiguous() for x in (query, key, value))
    else:
        bh = query.shape[0]
        query, key, value = (x.contiguous() for x in (query, key, value))
    dv = value.shape[-1] * (2 if (qk_bits == 4 and value.dtype == torch.uint8) else 1)
    sq, sk, sv = (None if s is None else expand_scale(s, bh, n, name, query.device, heads)
                  for s, n, name in ((scale_q, p.m, "scale_q"), (scale_k, p.k, "scale_k"), (scale_v, dv, "scale_v")))
    out = _ops.sparse_attention(p.row_ptr, p.col_idx, p.row_order, query, key, value, sq, sk, sv, p.v,
                                _number(softmax_scale, "softmax_scale"), qk_bits, p_bits, 1 if heads is None else heads,
                                p.longest_row)
    return out.view(bh, p.m, dv) if heads is None else out


def quantize_to_container(x: torch.Tensor, scale, bits: int, signed: bool = True) -> torch.Tensor:
    """quant.quantize_to_container (the definition) through the one-pass op where it applies.

    The op reads x where it lies (a strided view such as Q, K and V of one projection, up to 4
    leading dims, the last dim contiguous) with one scale per row: a scale constant along x's
    last dim (per tensor, per (batch x head), per row) maps onto it as an expanded view. A scale
    that varies along the last dim or broadcasts x to a larger shape, and an x the op does not
    take, go through the PyTorch path. Either way the container is contiguous.
    """
    _tensors(x=x)
    s = _scale_tensor(scale, "scale", x.device)
    per_row = s.dim() <= x.dim() and (s.dim() == 0 or s.shape[-1] == 1) and \
        torch.broadcast_shapes(s.shape, x.shape) == x.shape
    # Shapes and strides only: torch.compile traces no address (the op copies an x whose first row is
    # off 16 bytes).
    takes = (x.dtype in (torch.float16, torch.float32) and 1 <= x.dim() <= library.QUANTIZE_MAX_DIM
             and x.shape[-1] % 8 == 0 and x.stride(-1) == 1 and library.rows_aligned(x))
    if not (per_row and takes):
        return quant.quantize_to_container(x, s, bits, signed).contiguous()
    return _ops.quantize(x, (s[..., 0] if s.dim() else s).expand(x.shape[:-1]), bits, signed)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale, *, heads: int,
                   bits: int) -> torch.Tensor:
    """Q, K and V of x [B, T, E] quantized as they are projected: the containers of `bits`
    [3, B * heads, T, E / heads] (Q, K, V; row bh = b * heads + h; int4 packed) of
    quantize(fp16(x @ weight^T + bias), scale), with fixed scales per Q/K/V and head ([3, heads])
    or per Q/K/V ([3] or [3, 1]). The inputs of sparse_attention, sddmm and spmm as they are.

    On CUDA the GEMM quantizes in its epilogue, so the fp16 projection never reaches memory. Its
    accumulation order is not cuBLAS's (nor the reference's), so fp16(x @ weight^T + bias) can
    differ in its last bits, within the error bound of fp32 sums, and a quantized value then by a
    step at 8 bits, a few at 16 (rarely: 1 in 10^5 to 10^3 at the model's sizes).
    """
    _tensors(x=x, weight=weight)
    if bias is not None:
        _tensors(bias=bias)
    heads = _heads(heads)
    s = _scale_tensor(scale, "scale", x.device)
    if s.dim() == 1:
        s = s[:, None]
    if s.dim() != 2 or s.shape[0] != 3 or s.shape[1] not in (1, heads):
        raise ValueError(f"scale: expected [3], [3, 1] or [3, heads={heads}] scales (Q, K, V), got shape "
                         f"{tuple(s.shape)}")
    return _ops.qkv_projection(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
                               s.expand(3, heads).contiguous(), heads, bits)
