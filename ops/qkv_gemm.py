"""The Q/K/V projection with quantization in its epilogue: a Triton GEMM that writes the integer
containers of the attention ops directly.

With fixed (calibrated) scales, quantizing Q, K and V is elementwise, so it can happen where the
projection's fp32 accumulator is still in registers. The unfused path writes the fp16
projection (3 x B x T x E x 2 bytes, 50 MB at B 8, T 4096, E 256), then reads it back to write
the containers: one pass over 75 MB that the attention layer spends outside its GEMMs. Here
the GEMM writes the containers alone (a third of the bytes at 8 bits).

Semantics (the reference in `reference.qkv_projection`): y = fp16(x @ W^T + b) with fp32
accumulation, then the ops' quantization of y with one scale per (Q/K/V, head). Accumulation
order differs from any other GEMM's, so y can differ from cuBLAS's in its last bits (within the
error bound of fp32 sums), and a quantized value then by a step at 8 bits, a few at 16.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a CPU-only torch (or a Triton without tensor descriptors or GDC): the fallback serves
    triton = None


def available() -> bool:
    """Whether the kernel can run: Triton with tensor descriptors is here."""
    return triton is not None


# Tiles of 128 x 128 (two heads of d 64) over the reduction in 64-wide steps, loaded by TMA; two
# CTAs an SM loop over the tiles, with the loop nest flattened and warp-specialized (loads in
# producer warps), so that one tile's epilogue overlaps the next tile's loads. The tiles of one
# row block come together: x is read from memory once and from L2 after. H200, B 8, T 4096,
# E 256, int8: 41.9 us, against 60.0 for cuBLAS (30.9) and the quantize pass (int4: 45.8 against
# 61.8); pointer loads 48.3, one CTA a tile 53 (H100), 128 x 256 tiles 43.9, x kept for all of
# a row's tiles 65.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
NUM_WARPS, NUM_STAGES, CTAS_PER_SM = 4, 3, 2

TRITON_VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2]) if triton is not None else None
# Head rows of an odd number of elements (VEC 1) give the store's pointers runs of one element along
# both axes. Triton before 3.7 breaks that tie by giving neighbouring threads neighbouring rows:
# each warp store then writes 32 rows a byte apiece, and each thread holds a row's 128 column
# offsets, spilled. The kernel then stores the transposed tile, whose first axis is the columns.
_TIES_GO_TO_ROWS = triton is not None and TRITON_VERSION < (3, 7)

if triton is not None:

    @triton.jit
    def _markstein_ok(s):
        """Whether Markstein's step in `_quantize` is exact for scale s: 2^-60 <= |s| <= 2^60."""
        return (tl.abs(s) >= 8.673617379884035e-19) & (tl.abs(s) <= 1.152921504606847e18)

    @triton.jit
    def _quantize(y, rn, c0, s_ptr, E: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The ops' quantization of y (fp16 values as fp32) with column rn's scale, as int32; c0 is the
        tile's first column. Column n (Q/K/V n // E, head (n % E) // D) takes scale n // D."""
        if BLOCK_N % D == 0 and BLOCK_N // D <= 8:
            # The tile holds BLOCK_N // D whole heads: their scales and reciprocals are taken once, as
            # scalars, and spread over the columns by selects (a select each per head: heads of
            # fewer than 16 dims take the per-column path). A reciprocal per column and a reduction
            # over the columns for `fast` cost 4 of 40 us at 8 bits and 8 of 43 at 4 bits (H100,
            # B 8, T 4096, E 256).
            h0 = c0 // D
            s = tl.full((1, BLOCK_N), 1.0, tl.float32)
            r = s
            for i in tl.static_range(BLOCK_N // D):
                si = tl.load(s_ptr + h0 + i, mask=h0 + i < 3 * E // D, other=1.0)
                sel = ((rn - c0) // D == i)[None, :]
                s = tl.where(sel, si, s)
                r = tl.where(sel, tl.math.div_rn(1.0, si), r)
                # Unrolled at compile time: `fast` exists from i == 0 on (a linter cannot tell).
                fast = _markstein_ok(si) if i == 0 else fast & _markstein_ok(si)  # noqa: F821
        else:
            s = tl.load(s_ptr + rn // D, mask=rn < 3 * E, other=1.0)[None, :]
            r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            fast = tl.min(tl.min(_markstein_ok(s).to(tl.int32), axis=1), axis=0)
        # y / s rounded as an IEEE division, by Markstein's step: with r = RN(1 / s), q0 = RN(y r) is
        # within an ulp of y / s and q0 + r (y - s q0) rounds exactly. No step leaves the normal
        # range for fp16 y and 2^-60 <= |s| <= 2^60; a division per element cost more than the GEMM.
        if fast:
            q0 = y * r
            q = tl.where(tl.abs(y) <= 65504.0, tl.fma(r, tl.fma(-s, q0, y), q0), q0)  # q0 keeps inf and NaN
        else:
            q = tl.math.div_rn(y, s)
        q = libdevice.float2int_rn(q)  # cvt.rni: half to even, NaN to 0 (as the reference), inf saturated
        return tl.minimum(tl.maximum(q, -(1 << (BITS - 1))), (1 << (BITS - 1)) - 1)

    @triton.jit
    def _qkv_quantize_kernel(x_desc, w_desc, b_ptr, s_ptr, out_ptr, M, T,
                             E: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                             HAS_BIAS: tl.constexpr, WIDE: tl.constexpr, SMALL_T: tl.constexpr, VEC: tl.constexpr,
                             COLUMNS_FIRST: tl.constexpr, PDL: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n_tiles: tl.constexpr = (3 * E + BLOCK_N - 1) // BLOCK_N
        # container [3, B, H, T, Dc]: row m = (b, t), column n = (Q/K/V, h, dd); Dc = D / 2 at 4 bits
        Dc: tl.constexpr = D // 2 if BITS == 4 else D
        batch = (M // T).to(tl.int64) if WIDE else M // T
        plane = batch * H * T * Dc  # one of Q, K, V
        if PDL:
            # The ops that read Q, K and V next launch overlapped (launch.cuh) and wait for this
            # grid's writes; letting them launch now hides their launch as the last tiles finish
            # (H200, the calibrated 8b-8b layer in a CUDA graph: 0.7 us of 183).
            gdc_launch_dependents()
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * n_tiles, tl.num_programs(0), flatten=True,
                             warp_specialize=True):
            pid_m, pid_n = tile // n_tiles, tile % n_tiles
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, E, BLOCK_K):  # rows and columns past x and W load as zeros
                acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < 3 * E, other=0.0).to(tl.float32)[None, :]
            y = acc.to(tl.float16).to(tl.float32)  # the fp16 projection output, rounded once
            q = _quantize(y, rn, pid_n * BLOCK_N, s_ptr, E, D, BITS, BLOCK_N)
            if BITS == 4:
                lo, hi = tl.split(tl.reshape(q, (BLOCK_M, BLOCK_N // 2, 2)))
                q = ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)  # element 2t in the low nibble
                rn = pid_n * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)  # each byte's first column
            else:
                q = q.to(out_ptr.dtype.element_ty)
            rc = pid_n * (BLOCK_N * Dc // D) + tl.arange(0, BLOCK_N * Dc // D)  # the container's columns
            # Row m0 + r = (b, t) and column n = (Q/K/V, h, dd) lie at (Q/K/V) plane + (b H + h) T Dc + t Dc +
            # dd: the tile's first row's offset and the column's, plus r Dc, plus (H - 1) T Dc for each
            # batch boundary passed. In that form r Dc becomes the stores' immediate offsets; a vector of
            # row offsets per thread spilled where a thread holds a column (VEC 1).
            m0 = tl.cast(pid_m, tl.int64) * BLOCK_M if WIDE else pid_m * BLOCK_M
            t0 = m0 % T
            r = tl.arange(0, BLOCK_M)
            boundaries = ((t0 + r) // T if SMALL_T else t0 + r >= T).to(tl.int32)  # T >= BLOCK_M: one at most
            row_off = r * Dc + boundaries * ((H - 1) * T * Dc)
            cols = rn.to(tl.int64) if WIDE else rn
            col_off = ((m0 // T) * (H * T * Dc) + t0 * Dc + (cols // E) * plane + ((cols % E) // D) * (T * Dc)
                       + (cols % D) * Dc // D)
            # Runs of VEC elements (a divisor of Dc) lie in one head's row: vector stores, not bytes.
            row_off = tl.multiple_of(row_off, VEC)
            col_ptr = out_ptr + tl.max_contiguous(tl.multiple_of(col_off, VEC), VEC)
            mask = (rm < M)[:, None] & (rc < 3 * H * Dc)[None, :]
            if COLUMNS_FIRST:
                tl.store(col_ptr[:, None] + row_off[None, :], tl.trans(q), mask=tl.trans(mask))
            else:
                tl.store(col_ptr[None, :] + row_off[:, None], q, mask=mask)


@functools.cache
def _device(index: int) -> tuple[int, bool]:
    """The SM count of CUDA device `index`, and whether it lets the next kernel launch early (sm_90+):
    looked up once, as the eager layer launches this kernel on every forward (8.8-9.4 us a call)."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major >= 9


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    """t [rows, E] as the tensor-memory accelerator loads it: from a 16-byte boundary, in rows of whole
    16-byte chunks. A slice that starts elsewhere is copied, and rows of E off 8 elements are padded
    with zeros, which add nothing to the fp32 sums (the kernel's loop over E reads the padding as
    part of its last 64-wide step, and TMA fills past it with zeros as well). H200, T 4096, int8,
    against cuBLAS in fp32 and the quantize pass (the path without Triton): B 8, E 256, 51.8 us with
    x copied (35.6 aligned) against 396; B 2, E 516 padded, 66 against 602; B 8, E 252, 85 against
    773 (its head dim of 63 takes byte stores)."""
    pad = -t.shape[1] % 8
    if pad == 0 and t.data_ptr() % 16 == 0:
        return t
    return torch.nn.functional.pad(t, (0, pad))  # a new allocation, at the allocator's alignment


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
                   heads: int, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Launch on validated arguments (where the kernel is `available`): x [B, T, E] fp16, weight [3E, E],
    bias [3E] or None, scale [3, heads] fp32, all contiguous; out the [3, B * heads, T, E / heads]
    container (E / (2 heads) bytes at 4 bits)."""
    B, T, E = x.shape
    M = B * T
    if M == 0:
        return out
    sms, pdl = _device(x.device.index)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(3 * E, BLOCK_N)
    grid = (min(tiles, CTAS_PER_SM * sms),)
    x_desc = TensorDescriptor.from_tensor(_tma_operand(x.view(M, E)), [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(_tma_operand(weight), [BLOCK_N, BLOCK_K])
    vec = math.gcd(out.shape[-1] * out.element_size(), 16) // out.element_size()
    with torch.cuda.device(x.device):
        _qkv_quantize_kernel[grid](x_desc, w_desc, bias if bias is not None else x, scale, out, M, T, E=E, H=heads,
                                   D=E // heads, BITS=bits, HAS_BIAS=bias is not None, WIDE=out.numel() >= 2**31,
                                   SMALL_T=T < BLOCK_M, VEC=vec, COLUMNS_FIRST=vec == 1 and _TIES_GO_TO_ROWS,
                                   PDL=pdl, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
                                   num_stages=NUM_STAGES)
    return out
