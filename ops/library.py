"""The op schemas (defined once), their argument checks, and one implementation per device.

CPU: the pure-PyTorch reference. CUDA: the kernels of `csrc/`, built on first use; where
they cannot be built (no compiler) the reference runs on the GPU, with a warning. Attention of a
head dim the fused kernel is not built for runs as the three ops it fuses, on their kernels; a
batch x heads past the kernels' grid limit runs in slices. Fake implementations give shapes to
`torch.compile`.
"""

from __future__ import annotations

from functools import partial

import torch

from . import extension, qkv_gemm, reference
from .format import VECTOR_LENGTHS
from .quant import check_bits, container_dtype

NAMESPACE = "magicube"
OP_STRIDE = reference.OP_STRIDE

SPMM_PAIRS = ((8, 8), (4, 4), (16, 8), (16, 16), (8, 4), (16, 4), (12, 4))
SDDMM_BITS = (8, 4, 16)
SOFTMAX_BITS = (0, 4, 8, 16)

SCHEMAS = {
    "spmm": "spmm(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor a_values, Tensor b, "
            "Tensor? scale_a, Tensor? scale_b, int v, int m, int a_bits, bool a_signed, int b_bits, "
            "ScalarType out_dtype, int longest_row=-1) -> Tensor",
    # longest_row (here and in every op below but quantize): SRBCRS.longest_row, or -1 if not known; a hint
    # that spares a kernel work for long rows where there are none (any value gives the same function).
    "sddmm": "sddmm(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor a, Tensor b, "
             "Tensor? scale_a, Tensor? scale_b, int v, int bits, ScalarType out_dtype, int longest_row=-1) -> Tensor",
    "sparse_softmax": "sparse_softmax(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor values, "
                      "int v, float scale, int out_bits, int longest_row=-1) -> (Tensor, Tensor)",
    # x [..., cols] (up to 4 leading dims, any strides but a contiguous last dim, cols a
    # multiple of 8, rows a multiple of 16 bytes apart; a first row off 16 bytes is copied on
    # CUDA) / scale [...] (one per row, any strides) -> the contiguous container of `bits`,
    # shaped like x
    "quantize": "quantize(Tensor x, Tensor scale, int bits, bool is_signed) -> Tensor",
    # sddmm -> sparse_softmax -> spmm in one op, with the same intermediate roundings (fp16
    # scores, quantized probabilities), so that a fused kernel computes the same function. Query,
    # key and value contiguous [BH, rows, d'] or [B, heads, rows, d'] views of any strides with
    # contiguous rows on 16-byte strides (the heads of one projection output, read in place);
    # scales [BH, rows] or [B, heads, rows] of any strides (a scale per batch x head or per head,
    # expanded, is read in place); the output is [BH / heads, M, heads, dv] with bh = b * heads + h,
    # which views as [B, M, heads * dv].
    "sparse_attention": "sparse_attention(Tensor row_ptr, Tensor col_idx, Tensor row_order, Tensor query, "
                        "Tensor key, Tensor value, Tensor? scale_q, Tensor? scale_k, Tensor? scale_v, int v, "
                        "float softmax_scale, int qk_bits, int p_bits, int heads, int longest_row=-1) -> Tensor",
    # The Q/K/V projection quantized where it is computed: x [B, T, E] fp16, weight [3E, E],
    # bias [3E] or None, scale [3, heads] (Q/K/V x head) -> the containers of `bits`,
    # [3, B * heads, T, E / heads] (int4 packed): quantize(fp16(x @ weight^T + bias), scale).
    "qkv_projection": "qkv_projection(Tensor x, Tensor weight, Tensor? bias, Tensor scale, int heads, int bits) "
                      "-> Tensor",
}

for _name, _schema in SCHEMAS.items():
    torch.library.define(f"{NAMESPACE}::{_name}", _schema[_schema.index("("):])

# ---------------------------------------------------------------------------------------------
# Argument checks: metadata only (no device sync), shared by every implementation.

def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"

def check_tensor(name, t, dtype=None, dim=None, shape=None, device=None, contiguous=True):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {_describe(t)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got {_describe(t)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {_describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like the other inputs, got {_describe(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got a strided view of shape {tuple(t.shape)}; "
                         "call .contiguous() first")

def _check_arithmetic(name, t):
    """The dtype picks the arithmetic: fp16, or integers in their containers. Other floats would
    otherwise be taken for containers of the wrong width and named so."""
    if t.is_floating_point() and t.dtype != torch.float16:
        raise ValueError(f"{name}: expected torch.float16 (fp16 arithmetic) or the integer containers of "
                         f"quantize_to_container, got {_describe(t)}; cast with .half() or quantize it")

def _check_pattern(row_ptr, col_idx, row_order, v, device):
    if v not in VECTOR_LENGTHS:
        raise ValueError(f"v: expected one of {VECTOR_LENGTHS}, got {v!r}")
    check_tensor("row_ptr", row_ptr, torch.int32, 1, device=device)
    if row_ptr.numel() % 2:
        raise ValueError(f"row_ptr: expected 2*(M/V) entries (pairs), got {row_ptr.numel()}")
    check_tensor("col_idx", col_idx, torch.int32, 1, device=device)
    if col_idx.numel() % OP_STRIDE:
        raise ValueError(f"col_idx: the ops read patterns of stride {OP_STRIDE}; got {col_idx.numel()} slots, "
                         f"not a multiple of {OP_STRIDE} (build it with SRBCRS.from_mask(mask, stride={OP_STRIDE}))")
    check_tensor("row_order", row_order, torch.int32, 1, shape=(row_ptr.numel() // 2,), device=device)
    if row_ptr.numel() == 0 and col_idx.numel():
        # the kernels index rows from the blocks: a block with no row would read before the operands
        raise ValueError(f"col_idx: a pattern with no rows (empty row_ptr) has no columns, got {col_idx.numel()} slots")

def _check_scales(scale_a, scale_b, rows, cols, bh, device, quantized, out_dtype):
    if not quantized:
        if scale_a is not None or scale_b is not None:
            raise ValueError("scale_a, scale_b: fp16 inputs take no scales; pass None")
        if out_dtype != torch.float16:
            raise ValueError(f"out_dtype: fp16 inputs give float16 outputs, got {out_dtype}")
        return
    if out_dtype not in (torch.float16, torch.int64):
        raise ValueError(f"out_dtype: expected torch.float16 (dequantized) or torch.int64 (raw), got {out_dtype}")
    if out_dtype == torch.float16 and (scale_a is None or scale_b is None):
        raise ValueError("scale_a, scale_b: a float16 output of integer inputs needs both scales")
    if scale_a is not None:
        check_tensor("scale_a", scale_a, torch.float32, shape=(bh, rows), device=device)
    if scale_b is not None:
        check_tensor("scale_b", scale_b, torch.float32, shape=(bh, cols), device=device)

def _check_values(name, t, bh, elements, bits, signed, device):
    """A value tensor of the SR-BCRS layout: [BH, nnz_pad*V] elements (int4 packed)."""
    dtype = torch.float16 if t.dtype == torch.float16 else container_dtype(bits, signed)
    width = elements // 2 if (bits == 4 and dtype == torch.uint8) else elements
    check_tensor(name, t, dtype, shape=(bh, width), device=device)

def check_spmm(row_ptr, col_idx, row_order, a_values, b, scale_a, scale_b, v, m, a_bits, a_signed, b_bits,
               out_dtype, longest_row=-1):
    _check_longest_row(longest_row)
    device = a_values.device if isinstance(a_values, torch.Tensor) else None
    _check_pattern(row_ptr, col_idx, row_order, v, device)
    if m != row_ptr.numel() // 2 * v:
        raise ValueError(f"m: expected (M/V)*V = {row_ptr.numel() // 2 * v} rows for this pattern, got {m}")
    check_tensor("b", b, dim=3, device=device)
    _check_arithmetic("a_values", a_values)
    quantized = a_values.dtype != torch.float16
    if quantized:
        if (a_bits, b_bits) not in SPMM_PAIRS:
            raise ValueError(f"a_bits, b_bits: expected one of the pairs {SPMM_PAIRS}, got ({a_bits}, {b_bits})")
        check_bits(a_bits, a_signed, "a_bits")
        check_tensor("b", b, container_dtype(b_bits))
    elif b.dtype != torch.float16:
        raise ValueError(f"b: fp16 a_values need fp16 b, got {_describe(b)}")
    elif (a_bits, b_bits, a_signed) != (16, 16, True):
        # fp16 values are computed as they are: a width here would be silently ignored
        raise ValueError(f"a_bits, b_bits, a_signed: fp16 inputs are multiplied in fp16 and take the defaults "
                         f"(16, 16, True), got ({a_bits}, {b_bits}, {a_signed}); integer arithmetic takes the "
                         f"containers of quantize_to_container")
    bh = b.shape[0]
    _check_values("a_values", a_values, bh, col_idx.numel() * v, a_bits, a_signed, device)
    n = b.shape[2] * (2 if quantized and b_bits == 4 else 1)
    _check_scales(scale_a, scale_b, m, n, bh, device, quantized, out_dtype)
    return bh, m, n

def _check_longest_row(longest_row):
    if not isinstance(longest_row, int) or longest_row < -1:
        raise ValueError(f"longest_row: expected -1 (not known) or the most vectors a vector row keeps, "
                         f"got {longest_row!r}")


def check_sddmm(row_ptr, col_idx, row_order, a, b, scale_a, scale_b, v, bits, out_dtype, longest_row=-1):
    _check_longest_row(longest_row)
    device = a.device if isinstance(a, torch.Tensor) else None
    _check_pattern(row_ptr, col_idx, row_order, v, device)
    check_tensor("a", a, dim=3, device=device)
    check_tensor("b", b, dim=3, device=device)
    _check_arithmetic("a", a)
    quantized = a.dtype != torch.float16
    if quantized:
        if bits not in SDDMM_BITS:
            raise ValueError(f"bits: expected one of {SDDMM_BITS}, got {bits!r}")
        check_tensor("a", a, container_dtype(bits))
        check_tensor("b", b, container_dtype(bits))
    elif b.dtype != torch.float16:
        raise ValueError(f"b: fp16 a needs fp16 b, got {_describe(b)}")
    elif bits != 16:
        raise ValueError(f"bits: fp16 inputs are multiplied in fp16 and take the default (16), got {bits!r}; "
                         f"integer arithmetic takes the containers of quantize_to_container")
    m = row_ptr.numel() // 2 * v
    bh = a.shape[0]
    if a.shape[2] == 0:  # nothing to sum: refused on every device rather than left to the kernels' edge
        raise ValueError(f"a: expected K >= 1 (the dim the products sum over), got {_describe(a)}")
    if a.shape[1] != m:
        raise ValueError(f"a: expected {m} rows (M of the pattern), got {_describe(a)}")
    if b.shape[0] != bh or b.shape[2] != a.shape[2]:
        raise ValueError(f"b: expected shape ({bh}, N, {a.shape[2]}) to match a {tuple(a.shape)}, got {_describe(b)}")
    _check_scales(scale_a, scale_b, m, b.shape[1], bh, device, quantized, out_dtype)
    return bh, col_idx.numel() * v

def check_sparse_softmax(row_ptr, col_idx, row_order, values, v, scale, out_bits, longest_row=-1):
    _check_longest_row(longest_row)
    device = values.device if isinstance(values, torch.Tensor) else None
    _check_pattern(row_ptr, col_idx, row_order, v, device)
    check_tensor("values", values, torch.float16, 2, device=device)
    if values.shape[1] != col_idx.numel() * v:
        raise ValueError(f"values: expected [BH, nnz_pad*V = {col_idx.numel() * v}], got {_describe(values)}")
    if out_bits not in SOFTMAX_BITS:
        raise ValueError(f"out_bits: expected one of {SOFTMAX_BITS} (0 = fp16), got {out_bits!r}")
    return values.shape[0], row_ptr.numel() // 2 * v

def _attention_operand(name, t, dtype, heads, device):
    """Query, key or value: a contiguous [BH, rows, d'], or [B, heads, rows, d'] contiguous or at any
    strides with contiguous rows on strides of whole 16 bytes (per-head views of one Q/K/V
    projection output, read in place). Returns (BH, rows, d')."""
    check_tensor(name, t, dtype, device=device, contiguous=t.dim() == 3)
    if t.dim() == 3:
        return tuple(t.shape)
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 3-D [BH, rows, d] or 4-D [B, heads, rows, d] tensor, got {_describe(t)}")
    if t.shape[1] != heads:
        raise ValueError(f"{name}: a 4-D [B, heads, rows, d] tensor needs heads = {heads} in dim 1, got {_describe(t)}")
    if not rows_readable(t):
        raise ValueError(f"{name}: expected contiguous rows on strides of whole 16 bytes, got strides {t.stride()} "
                         f"for {_describe(t)}")
    return t.shape[0] * t.shape[1], t.shape[2], t.shape[3]

def check_sparse_attention(row_ptr, col_idx, row_order, query, key, value, scale_q, scale_k, scale_v, v,
                           softmax_scale, qk_bits, p_bits, heads, longest_row=-1):
    _check_longest_row(longest_row)
    device = query.device if isinstance(query, torch.Tensor) else None
    _check_pattern(row_ptr, col_idx, row_order, v, device)
    check_tensor("query", query, device=device, contiguous=False)
    _check_arithmetic("query", query)
    quantized = query.dtype != torch.float16
    if quantized and qk_bits not in SDDMM_BITS:
        raise ValueError(f"qk_bits: expected one of {SDDMM_BITS}, got {qk_bits!r}")
    if quantized and (p_bits, qk_bits) not in SPMM_PAIRS:
        raise ValueError(f"p_bits, qk_bits: the probabilities times value product must be one of the pairs "
                         f"{SPMM_PAIRS}, got ({p_bits}, {qk_bits})")
    if not quantized and p_bits != 0:
        raise ValueError(f"p_bits: fp16 attention keeps fp16 probabilities (0), got {p_bits!r}")
    if not quantized and qk_bits != 16:
        raise ValueError(f"qk_bits: fp16 inputs are multiplied in fp16 and take the default (16), got {qk_bits!r}; "
                         f"integer attention takes the containers of quantize_to_container")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key, value: expected all 3-D [BH, rows, d] or all 4-D [B, heads, rows, d], got "
                         f"{query.dim()}, {key.dim()} and {value.dim()} dims")
    dtype = container_dtype(qk_bits) if quantized else torch.float16
    operands = (("query", query), ("key", key), ("value", value))
    (bh, m, d), (bh_k, n, d_k), (bh_v, n_v, width_v) = (_attention_operand(name, t, dtype, heads, device)
                                                         for name, t in operands)
    if m != row_ptr.numel() // 2 * v:
        raise ValueError(f"query: expected {row_ptr.numel() // 2 * v} rows (M of the pattern), got {_describe(query)}")
    if (bh_k, d_k) != (bh, d):
        raise ValueError(f"key: expected BH = {bh} and d' = {d} like query, got {_describe(key)}")
    if (bh_v, n_v) != (bh, n):
        raise ValueError(f"value: expected BH = {bh} and N = {n} rows like key, got {_describe(value)}")
    for name, t, width in (("query", query, d), ("value", value, width_v)):
        if width == 0:
            raise ValueError(f"{name}: expected a head dim >= 1, got {_describe(t)}")
    if heads < 1 or bh % heads:
        raise ValueError(f"heads: expected a positive divisor of BH = {bh} (the batch x heads of query), got {heads!r}")
    dv = width_v * (2 if quantized and qk_bits == 4 else 1)
    scales = (("scale_q", scale_q, m), ("scale_k", scale_k, n), ("scale_v", scale_v, dv))
    if quantized:
        for name, s, rows in scales:
            if s is None:
                raise ValueError(f"{name}: integer inputs need scale_q, scale_k and scale_v")
            # [BH, rows] or [B, heads, rows], at any strides (a per-head scale expanded over the batch)
            shape = (bh // heads, heads, rows) if isinstance(s, torch.Tensor) and s.dim() == 3 else (bh, rows)
            check_tensor(name, s, torch.float32, shape=shape, device=device, contiguous=False)
    elif any(s is not None for _, s, _ in scales):
        raise ValueError("scale_q, scale_k, scale_v: fp16 inputs take no scales; pass None")
    return bh, m, dv


QUANTIZE_MAX_DIM = 5  # the kernel walks the rows over at most 4 leading dims


def rows_aligned(x) -> bool:
    """Whether the leading dims step x's rows by multiples of 16 bytes (the kernel reads 8
    elements per load), so that rows start on 16 bytes wherever the first one does."""
    return not any(st * x.element_size() % 16 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)


def rows_readable(x) -> bool:
    """Whether the fused attention reads x's rows where they lie: x contiguous, or its rows
    contiguous on 16-byte strides (per-head views of one projection output)."""
    return x.is_contiguous() or (x.stride(-1) == 1 and rows_aligned(x))


def check_quantize(x, scale, bits, is_signed):
    """Returns the output shape: x's, with the last dim halved for int4."""
    device = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, device=device, contiguous=False)
    if x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"x: expected float16 or float32 data, got {_describe(x)}")
    if not 1 <= x.dim() <= QUANTIZE_MAX_DIM:
        raise ValueError(f"x: expected 1 to {QUANTIZE_MAX_DIM} dims (rows over at most {QUANTIZE_MAX_DIM - 1} "
                         f"leading dims), got {_describe(x)}; merge leading dims first")
    if x.shape[-1] % 8:
        raise ValueError(f"x: expected a multiple of 8 columns (last dim), got {_describe(x)}")
    if x.stride(-1) != 1:
        raise ValueError(f"x: expected a contiguous last dim (stride 1), got strides {x.stride()} for "
                         f"{_describe(x)}")
    # The CUDA op copies an x whose first row is off 16 bytes; rows that are not 16 bytes apart it cannot read.
    if not rows_aligned(x):
        raise ValueError(f"x: rows must lie a multiple of 16 bytes apart; strides {x.stride()} (elements of "
                         f"{x.element_size()} bytes) do not, for {_describe(x)}")
    check_tensor("scale", scale, torch.float32, shape=x.shape[:-1], device=device, contiguous=False)
    check_bits(bits, is_signed)
    return (*x.shape[:-1], x.shape[-1] // 2 if bits == 4 else x.shape[-1])


def check_qkv_projection(x, weight, bias, scale, heads, bits):
    """Returns the output shape."""
    device = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, torch.float16, 3, device=device)
    e = x.shape[2]
    check_tensor("weight", weight, torch.float16, shape=(3 * e, e), device=device)
    if bias is not None:
        check_tensor("bias", bias, torch.float16, shape=(3 * e,), device=device)
    if heads < 1 or e % heads:
        raise ValueError(f"heads: expected a positive divisor of the embedding E = {e} (x's last dim), got {heads!r}")
    check_tensor("scale", scale, torch.float32, shape=(3, heads), device=device)
    if bits not in SDDMM_BITS:
        raise ValueError(f"bits: expected one of {SDDMM_BITS} (the SDDMM's Q/K widths), got {bits!r}")
    d = e // heads
    if bits == 4 and d % 2:
        raise ValueError(f"heads: 4-bit containers pack pairs along the head dim, which E / heads = {d} does not split")
    return (3, x.shape[0] * heads, x.shape[1], d // 2 if bits == 4 else d)


CHECKS = {"quantize": check_quantize, "qkv_projection": check_qkv_projection, "spmm": check_spmm, "sddmm": check_sddmm,
          "sparse_softmax": check_sparse_softmax, "sparse_attention": check_sparse_attention}

# ---------------------------------------------------------------------------------------------
# Implementations.

def _kernel_or_reference(name, *args):
    """The kernel of csrc/, or the reference where it cannot be built (with the extension's warning)."""
    kernels = extension.ops_or_none(name)
    return getattr(reference, name)(*args) if kernels is None else getattr(kernels, name)(*args)


# The kernels lay batch x heads along a grid dimension of at most 65535 blocks; a larger batch
# runs in slices of whole batches, a launch each.
MAX_BH = 65535
# The arguments of each op that hold batch x heads in dim 0: [BH, ...], or [B, heads, ...] (attention).
BATCHED_ARGS = {"spmm": (3, 4, 5, 6), "sddmm": (3, 4, 5, 6), "sparse_softmax": (3,),
                "sparse_attention": (3, 4, 5, 6, 7, 8)}


def in_batch_slices(run, name, args, bh, heads=1):
    """run(*args), or, where BH is past MAX_BH, run over slices of at most MAX_BH (whole batches of
    `heads`) with the outputs (batch-major in dim 0, or a tuple of such) joined."""
    if bh <= MAX_BH:
        return run(*args)
    step = MAX_BH // heads * heads
    parts = []
    for start in range(0, bh, step):
        sliced = list(args)
        for i in BATCHED_ARGS[name]:
            t = args[i]
            if t is not None:  # a [BH, ...] tensor, or one of whole batches ([B, heads, ...])
                per = 1 if t.shape[0] == bh else heads
                sliced[i] = t[start // per:(start + step) // per]
        parts.append(run(*sliced))
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def _qkv_projection_cuda(x, weight, bias, scale, heads, bits):
    """The Triton GEMM with the quantization in its epilogue; without Triton, the projection by cuBLAS
    in fp32 and then the one-pass quantize kernel."""
    shape = check_qkv_projection(x, weight, bias, scale, heads, bits)
    if qkv_gemm.available():
        out = x.new_empty(shape, dtype=container_dtype(bits))
        return qkv_gemm.qkv_projection(x, weight, bias, scale, heads, bits, out)
    from .functional import quantize_to_container  # (functional imports this module)

    # The reference's fp32 GEMM: an fp16 one may sum in fp16 (cuBLAS took such a kernel for an x off
    # 16 bytes under allow_fp16_reduced_precision_reduction, PyTorch's default), overflowing past 65504.
    y = reference.projection_heads(x, weight, bias, heads)
    return quantize_to_container(y, scale.view(3, 1, heads, 1, 1), bits).view(shape)


# The head dims the fused attention kernel is built for (csrc/attention.cu; value's equal to
# query's). Other shapes, and keys past its exact accumulation, run the three ops it fuses, each on
# its own kernel: the same function.
FUSED_HEAD_DIMS = (32, 64, 128)


def fused_sums_exact(n, qk_bits, p_bits):
    """Whether the fused kernel's int32 accumulators hold the probabilities times value sums of N
    keys exactly: the bound csrc/attention.cu checks. A row's 32-key blocks split over its 4 warps
    (where one warp's would not hold them), and the largest per-slot term of a precision pair
    times a warp's slots must stay under 2^31. fp16 accumulates in fp32: no bound."""
    if p_bits == 0:
        return True
    term = 255 * 255 + 255 * 128 if qk_bits == 16 else 255 * 128
    blocks = -(-n // 32)
    return -(-blocks // 4) * 32 * term < 1 << 31


def _sparse_attention_cuda(*args):
    bh = check_sparse_attention(*args)[0]
    query, key, value, qk_bits, p_bits = args[3], args[4], args[5], args[11], args[12]
    per_byte = 2 if qk_bits == 4 else 1  # int4 packed in pairs (fp16 inputs take qk_bits 16)
    d, dv = query.shape[-1] * per_byte, value.shape[-1] * per_byte
    if d in FUSED_HEAD_DIMS and dv == d and fused_sums_exact(key.shape[-2], qk_bits, p_bits):
        return in_batch_slices(partial(_kernel_or_reference, "sparse_attention"), "sparse_attention", args, bh,
                               heads=args[13])
    ops = getattr(torch.ops, NAMESPACE)
    return reference.compose_attention(ops.sddmm, ops.sparse_softmax, ops.spmm, *args)


# CUDA implementations that are not (only) a kernel of csrc/
CUDA_IMPLS = {"qkv_projection": _qkv_projection_cuda, "sparse_attention": _sparse_attention_cuda}


def _register(name):
    check, ref = CHECKS[name], getattr(reference, name)

    def cpu(*args):
        check(*args)
        return ref(*args)

    def cuda(*args):
        shape = check(*args)
        if name not in BATCHED_ARGS:
            return _kernel_or_reference(name, *args)
        return in_batch_slices(partial(_kernel_or_reference, name), name, args, bh=shape[0])

    torch.library.impl(f"{NAMESPACE}::{name}", "CPU")(cpu)
    torch.library.impl(f"{NAMESPACE}::{name}", "CUDA")(CUDA_IMPLS.get(name, cuda))

for _name in SCHEMAS:
    _register(_name)

@torch.library.register_fake(f"{NAMESPACE}::spmm")
def _spmm_fake(row_ptr, col_idx, row_order, a_values, b, scale_a, scale_b, v, m, a_bits, a_signed, b_bits,
               out_dtype, longest_row=-1):
    bh, m, n = check_spmm(row_ptr, col_idx, row_order, a_values, b, scale_a, scale_b, v, m, a_bits, a_signed,
                          b_bits, out_dtype, longest_row)
    return a_values.new_empty((bh, m, n), dtype=out_dtype)

@torch.library.register_fake(f"{NAMESPACE}::sddmm")
def _sddmm_fake(row_ptr, col_idx, row_order, a, b, scale_a, scale_b, v, bits, out_dtype, longest_row=-1):
    bh, width = check_sddmm(row_ptr, col_idx, row_order, a, b, scale_a, scale_b, v, bits, out_dtype, longest_row)
    return a.new_empty((bh, width), dtype=out_dtype)

@torch.library.register_fake(f"{NAMESPACE}::sparse_softmax")
def _sparse_softmax_fake(row_ptr, col_idx, row_order, values, v, scale, out_bits, longest_row=-1):
    bh, m = check_sparse_softmax(row_ptr, col_idx, row_order, values, v, scale, out_bits, longest_row)
    if out_bits == 0:
        probs = torch.empty_like(values)
    elif out_bits == 4:
        probs = values.new_empty((bh, values.shape[1] // 2), dtype=torch.uint8)
    else:
        probs = values.new_empty(values.shape, dtype=container_dtype(out_bits, signed=False))
    return probs, values.new_empty((bh, m), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::sparse_attention")
def _sparse_attention_fake(row_ptr, col_idx, row_order, query, key, value, scale_q, scale_k, scale_v, v,
                           softmax_scale, qk_bits, p_bits, heads, longest_row=-1):
    bh, m, dv = check_sparse_attention(row_ptr, col_idx, row_order, query, key, value, scale_q, scale_k, scale_v,
                                       v, softmax_scale, qk_bits, p_bits, heads, longest_row)
    return query.new_empty((bh // heads, m, heads, dv), dtype=torch.float16)


@torch.library.register_fake(f"{NAMESPACE}::quantize")
def _quantize_fake(x, scale, bits, is_signed):
    return x.new_empty(check_quantize(x, scale, bits, is_signed), dtype=container_dtype(bits, is_signed))


@torch.library.register_fake(f"{NAMESPACE}::qkv_projection")
def _qkv_projection_fake(x, weight, bias, scale, heads, bits):
    return x.new_empty(check_qkv_projection(x, weight, bias, scale, heads, bits), dtype=container_dtype(bits))
