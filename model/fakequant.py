"""Fake quantization: the integer attention backends as a differentiable function of fp32 tensors.

`attention` computes, from dense Q, K, V and an element mask, what the integer ops compute on
SR-BCRS (the elementwise steps on the kept entries only, as the ops):

    Q, K, V -> q = clamp(round_half_even(x / s), qmin, qmax)               (signed, bits)
    scores  = fp16(fp32(q_Q @ q_K^T) * (s_Q * s_K))                        (SDDMM)
    x = fp32(scores) * d^-0.5; e = exp(x - rowmax); S = sum e over the kept entries
    p = round_half_even(e * pmax),  row_scale = 1 / (S * pmax)             (softmax, unsigned p_bits)
    out = fp16(fp32(p @ q_V) * (row_scale * s_V))                          (SpMM)

Every rounding passes its gradient straight through (STE), and the clamp stops it at
saturation. Scales are either the per-(batch x head) absmax of the current tensors (what
`Attention.quantize` does at inference, gradient-free) or given per head / per tensor; a
scale tensor that requires grad is learned LSQ-style: its gradient is the STE derivative of
the dequantized values (q - x/s inside the range, qmin or qmax outside), times 1/sqrt(n qmax).

Exactness, against the integer kernels:
- Q K^T: integers of at most 2^(2(bits-1)) summed over the head dim d, below 2^24 for d <= 1024
  at 8 bits: fp32 (and TF32, whose 11-bit significand holds 8-bit integers) sums them exactly,
  in any order, so the scores are bit-identical to the SDDMM's.
- p: the same fp32 exp(x - max) elementwise, so the same integers as the softmax op.
- p @ q_V: a row of a chunk sums at most `longest` (the chunk's longest row) products of |p| <=
  pmax and |q_V| <= 2^(bits-1). Where that bound stays within 2^24 (8-bit p on 8-bit V up to 514
  kept entries a row, on 4-bit V up to 8224) and p and q_V have at most 11 bits (TF32's
  significand, should it be switched on), fp32 sums it exactly, with half the bytes of fp64 in the
  dense block of p, its product and their gradients. Otherwise (16-bit p, longer rows) the sum is
  in fp64, exact below 2^53, and fp32(acc) is then the same round-to-nearest the kernels apply to
  the int64.
- The one inexact quantity is S, a sum of fp32 terms in another order than the op's: a few
  fp32 ulps relative, so row_scale and the output agree to far below the fp16 output rounding
  (the output is almost always bit-identical, otherwise one fp16 ulp off).
"""
from __future__ import annotations

import itertools
import math

import torch
from torch.utils.checkpoint import checkpoint

from magicube.ops import absmax_scale, qrange, scale_of_absmax

SCALE_MODES = ("absmax", "fixed", "learned")  # absmax: per (batch x head) of each batch, as inference
GRANULARITIES = ("head", "tensor")
# A longer attention runs in chunks of query rows, recomputed in the backward pass. The budget
# counts a chunk's dense [B, H, rows, T] elements, which bound its kept entries too. A chunk peaks
# at about 16 bytes a dense element (p in fp64 and its gradient, 8 where p @ q_V is exact in fp32;
# the fp32 product and its gradient come and go apart from them) plus 20 a kept entry (the compact
# values and gradients): 2^27 is 2.3 GiB at 10 % kept, 4.5 GiB for a full mask, and at B=32, H=4,
# T=4096 16 chunks of 256 rows, whose kernels are large enough that launches do not count.
CHUNK_ELEMENTS = 1 << 27


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)  # half to even, as the ops

    @staticmethod
    def backward(ctx, grad):
        return grad


class _HalfSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.half().float()  # round to nearest even, as the ops' fp16 outputs

    @staticmethod
    def backward(ctx, grad):
        return grad


def round_ste(x: torch.Tensor) -> torch.Tensor:
    return _RoundSTE.apply(x)


def fp16_ste(x: torch.Tensor) -> torch.Tensor:
    return _HalfSTE.apply(x)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.clone()  # the value itself: (x - g x) + g x would not always round back to x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.g, None


def grad_scale(x: torch.Tensor, g: float) -> torch.Tensor:
    """x in the forward pass, g times its gradient in the backward (LSQ's step-size gradient scale)."""
    return _GradScale.apply(x, g)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, bits: int, signed: bool = True) -> torch.Tensor:
    """ops.quantize as integer-valued fp32 with straight-through gradients, zero where it saturates."""
    qmin, qmax = qrange(bits, signed)
    r = round_ste(x.float() / scale)
    # not torch.clamp: its gradient also stops at values that round exactly to qmin or qmax
    return torch.where(r > qmax, qmax, torch.where(r < qmin, qmin, r))


def qkv_scales(q, k, v, bits: int, scales: torch.Tensor | None):
    """Scales of Q, K, V as [B, H, 1, 1] each: absmax per (batch x head), or the given positive
    [3, H] / [3, 1] (`positive` keeps a learned one so)."""
    if scales is None:
        return [absmax_scale(t, bits, dim=(-2, -1)) for t in (q, k, v)]
    _, qmax = qrange(bits)
    if scales.requires_grad:
        # LSQ: a step size sees the gradient of every element it quantizes; 1/sqrt(n qmax) keeps
        # its steps in proportion to those of the weights.
        n = q[..., 0, :, :].numel() * (q.shape[1] if scales.shape[1] == 1 else 1)
        scales = grad_scale(scales, 1.0 / math.sqrt(n * qmax))
    return [s.view(1, -1, 1, 1) for s in scales]


def positive(scales: torch.Tensor) -> torch.Tensor:
    """A learned scale could step to or below zero; the smallest normal keeps the division finite."""
    return scales.float().clamp_min(torch.finfo(torch.float32).tiny)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, p_bits: int, bits: int,
              softmax_scale: float, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantized sparse attention. q, k, v: [B, H, T, d]; keep: [T, T] bools (the element mask).

    Returns fp32 holding the fp16 values the integer ops would return.
    """
    with torch.autocast(q.device.type, enabled=False):  # integer products need fp32, never bf16/fp16
        q, k, v = q.float(), k.float(), v.float()
        if q.shape[0] == 0:  # an empty batch: LSQ's gradient factor and the segment reductions need elements
            return v.new_zeros(*q.shape[:-1], v.shape[-1])
        sq, sk, sv = qkv_scales(q, k, v, bits, scales)
        qi, ki, vi = fake_quantize(q, sq, bits), fake_quantize(k, sk, bits), fake_quantize(v, sv, bits)
        score_scale = (sq * sk)[..., 0]  # fp32 product first, as the kernels; [B or 1, H, 1] for the kept entries
        B, H, T, _ = q.shape
        # The kept entries in row-major order: those of rows [r, r + n) are one run, offsets[r]:offsets[r + n].
        row, col = keep.nonzero(as_tuple=True)
        lengths = keep.sum(dim=1)
        counts = lengths.tolist()
        offsets = list(itertools.accumulate(counts, initial=0))
        rows = max(1, CHUNK_ELEMENTS // max(1, B * H * k.shape[2]))
        # Each chunk of rows [r, e) sums p @ q_V in the dtype its longest row needs (fp32 where that
        # is exact), so a CLS row takes fp64 for its chunk alone.
        chunks = [(r, min(r + rows, T), pv_dtype(p_bits, bits, max(counts[r:r + rows], default=0)))
                  for r in range(0, max(T, 1), rows)]
        v_as = {dtype: vi.to(dtype) for dtype in {dtype for *_, dtype in chunks}}

        def args(r, e, dtype):
            lo, hi = offsets[r], offsets[e]
            return (qi[:, :, r:e], row[lo:hi] - r, col[lo:hi], lengths[r:e], ki, v_as[dtype], score_scale, sv,
                    p_bits, softmax_scale)

        if len(chunks) == 1:
            return _rows(*args(*chunks[0]))
        recompute = torch.is_grad_enabled()
        return torch.cat([checkpoint(_rows, *args(*c), use_reentrant=False) if recompute else _rows(*args(*c))
                          for c in chunks], dim=2)


def pv_dtype(p_bits: int, bits: int, longest: int) -> torch.dtype:
    """The dtype that sums p @ q_V exactly for rows of at most `longest` kept entries (see above)."""
    pmax, vmax = (1 << p_bits) - 1, 1 << (bits - 1)
    exact_in_fp32 = max(p_bits, bits) <= 11 and pmax * vmax * longest <= 1 << 24
    return torch.float32 if exact_in_fp32 else torch.float64


def _rows(qi, row, col, lengths, ki, vi, score_scale, sv, p_bits: int, softmax_scale: float) -> torch.Tensor:
    """SDDMM -> softmax -> SpMM for a block of query rows (rows are independent), whose kept entries
    are (row, col), row-major, lengths[i] of them in row i. p @ vi is summed in vi's dtype."""
    B, H, n, _ = qi.shape
    T = ki.shape[2]
    at = row * T + col
    # The product stays dense (tensor cores); every elementwise step runs on the kept entries only.
    # index_select, not gather: its backward needs the product's shape, not the product itself.
    acc = (qi @ ki.transpose(-2, -1)).flatten(2).index_select(-1, at)
    scores = fp16_ste(acc * score_scale)
    p, row_scale = quantized_softmax(scores, row, lengths, softmax_scale, p_bits)
    dense = p.new_zeros(B, H, n * T, dtype=vi.dtype).scatter_(-1, at.expand(B, H, -1), p.to(vi.dtype))
    out = (dense.view(B, H, n, T) @ vi).float()
    return fp16_ste(out * (row_scale * sv))


def quantized_softmax(scores: torch.Tensor, row: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
                      p_bits: int):
    """ops.sparse_softmax on the kept scores [B, H, E] of a block of rows, in row-major order: entry i
    in row row[i], row r a run of lengths[r] entries. Returns (integer-valued p [B, H, E], row_scale
    [B, H, rows, 1]); a row with nothing kept has row_scale 0."""
    x = scores * softmax_scale
    # Per-row reductions over the runs: segment_reduce reads each run once and without atomics, so
    # a finetuning run repeats itself (a scatter_reduce's atomics on one address per row took 6.8x
    # as long on an H200). It takes the lengths for every leading index.
    runs = lengths.expand(*x.shape[:-1], -1).contiguous()
    # The max only shifts the exponent (the output is invariant to it): no gradient through it.
    m = torch.segment_reduce(x.detach(), "max", lengths=runs, axis=-1, initial=float("-inf"))
    m = torch.where(torch.isfinite(m), m, 0.0)  # an infinite max would make exp(x - m) NaN
    e = torch.exp(x - m.index_select(-1, row))
    # The one sum in another order than the op's.
    s = torch.segment_reduce(e, "sum", lengths=runs, axis=-1, initial=0.0)
    pmax = (1 << p_bits) - 1
    p = round_ste(e * pmax)  # e <= 1: never saturates
    row_scale = torch.where(s > 0, 1.0 / (torch.where(s > 0, s, 1.0) * pmax), 0.0)
    return p, row_scale.unsqueeze(-1)


@torch.no_grad()
def observe_absmax(qkv_out: torch.Tensor, heads: int) -> torch.Tensor:
    """The qkv projection's output [B, T, 3 E] -> the absmax of Q, K, V per head, [3, H]."""
    B, T, E3 = qkv_out.shape
    return qkv_out.detach().float().view(B, T, 3, heads, E3 // (3 * heads)).abs().amax(dim=(0, 1, 4))


def scales_from_absmax(absmax: torch.Tensor, bits: int, granularity: str) -> torch.Tensor:
    """Calibrated absmax [3, H] -> scales [3, H] (per head) or [3, 1] (per tensor), as ops.absmax_scale."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        absmax = absmax.amax(dim=1, keepdim=True)
    return scale_of_absmax(absmax, bits)
