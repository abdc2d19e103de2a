"""A few small fused-attention launches of every precision, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sanitize_attention.py
    compute-sanitizer --tool racecheck python tests/sanitize_attention.py

Covers an empty row, a row longer than the kernel's score cache (its recompute path), rows split
over 4 warps (N past a warp's exact int32 accumulation), a global token's row among short ones,
V = 2 and 8, head dims 32 and 64, shuffled and plain patterns, and the attention layer's call: the
output as [B, M, heads, dv] with per-(batch x head) scales expanded along their rows (stride 0,
read in place), also from Q, K, V as per-head views of token-major tensors with per-head scales
shared by the batch; rows of non-finite scores (NaN rows); and head dims the fused kernel is not
built for, which the public op runs as the sddmm, softmax and spmm kernels. Exits non-zero if a
result is far from the reference (the GPU tests hold it to the exact bounds).
"""

import sys

import torch

from magicube.ops import SRBCRS, VectorMask, absmax_scale, extension, quantize, to_container

PAIRS = [(8, 8), (16, 8), (8, 4), (4, 4), (16, 16), (16, 4), (0, 16)]


def inputs(bh, m, n, d, p_bits, qk_bits, g, per_head):
    """Q, K, V with per-row (Q, K) and per-column (V) scales, or one scale per batch x head as an
    expanded [BH, rows] view on the GPU."""
    q, k, v = (torch.randn(bh, rows, d, generator=g) for rows in (m, n, n))
    if p_bits == 0:
        return q.half(), k.half(), v.half(), None, None, None
    out = []
    for x, dim, rows in ((q, -1, m), (k, -1, n), (v, 1, d)):
        s = absmax_scale(x, qk_bits, dim=(1, 2) if per_head else dim)
        out.append(to_container(quantize(x, s, qk_bits), qk_bits))
        out.append(s.view(bh, 1).expand(bh, rows) if per_head else s.squeeze(dim).contiguous())
    return out[0], out[2], out[4], out[1], out[3], out[5]


def to_cuda(x):
    if x is not None and x.dim() == 2 and x.stride(1) == 0:  # an expanded scale stays a view
        return x[:, :1].cuda().expand_as(x)
    return None if x is None else x.cuda()


def mismatch(got, want, what) -> int:
    """1 (and a line saying so) if the kernel's result is far from the reference, else 0."""
    if torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2, equal_nan=True):
        return 0
    print(f"MISMATCH {what}: max diff {float((got.float() - want.float()).abs().max()):.3g}")
    return 1


def main() -> int:
    extension.load("attention")
    bad = 0
    g = torch.Generator().manual_seed(0)
    # n = 1100: the full row has 35 blocks, most past the score cache. n = 22500 at 16 bits: past
    # one warp's exact int32 accumulation over a row, so the kernel splits rows over 4 warps.
    # heads > 1: per-(batch x head) scales, BH = 6 leaves the last whole-row CTA half empty.
    # 24 rows of density 0.02 beside the full one: a global token's row, 35 blocks against one.
    for v, d, shuffle, n, pairs, bh, heads, rows, density in (
            (2, 32, False, 1100, PAIRS, 2, 1, 4, 0.2), (8, 64, True, 1100, PAIRS, 2, 1, 4, 0.2),
            (8, 64, False, 22_500, [(16, 16)], 2, 1, 4, 0.2), (8, 64, True, 1100, PAIRS, 6, 3, 4, 0.2),
            (8, 32, False, 22_500, [(16, 16)], 4, 2, 4, 0.2), (8, 64, False, 1100, PAIRS, 3, 1, 24, 0.02)):
        mask = torch.rand(rows, n, generator=g) < density
        mask[0] = False
        mask[2] = True
        vm = VectorMask(mask, v)
        p = SRBCRS.from_mask(vm, stride=32, shuffle=shuffle)
        cuda = p.to("cuda")
        for p_bits, qk_bits in pairs:
            args = inputs(bh, p.m, n, d, p_bits, qk_bits, g, per_head=heads > 1)
            dev = [to_cuda(x) for x in args]
            got = torch.ops.magicube_cuda.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, v,
                                                           d**-0.5, qk_bits, p_bits, heads).cpu()
            want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *args, v, d**-0.5,
                                                       qk_bits, p_bits, heads)
            bad += mismatch(got, want, f"v={v} d={d} heads={heads} p_bits={p_bits} qk_bits={qk_bits}")
    # Q, K, V as [B, heads, rows, d] views of token-major tensors, read at their strides (B = 2), with
    # one scale per head shared by the batch: [B, heads, rows] views, stride 0 along batch and rows.
    for heads, rows, density in ((2, 4, 0.2), (4, 24, 0.02)):
        mask = torch.rand(rows, 1100, generator=g) < density
        mask[0], mask[2] = False, True
        p = SRBCRS.from_mask(VectorMask(mask, 8), stride=32)
        cuda = p.to("cuda")
        for p_bits, qk_bits in ((8, 8), (16, 8), (0, 16)):
            args = list(inputs(2 * heads, p.m, 1100, 64, p_bits, qk_bits, g, per_head=True))
            scales = [None] * 3
            if p_bits:
                args[3:] = [s[:heads].repeat(2, 1) for s in args[3:]]  # the first batch's, as [BH, rows] copies
                scales = [s[:heads, :1].cuda().view(1, heads, 1).expand(2, heads, s.shape[1]) for s in args[3:]]
            qkv = [x.cuda().view(2, heads, *x.shape[1:]).transpose(1, 2).contiguous().transpose(1, 2)
                   for x in args[:3]]
            got = torch.ops.magicube_cuda.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order, *qkv, *scales,
                                                           8, 0.125, qk_bits, p_bits, heads).cpu()
            want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *args, 8, 0.125, qk_bits,
                                                       p_bits, heads)
            bad += mismatch(got, want, f"token-major heads={heads} p_bits={p_bits} qk_bits={qk_bits}")
    # Rows of non-finite scores (NaN rows): an overflow (Q row or its scale 1e4) in the full row, a NaN
    # in a short one.
    mask = torch.rand(4, 1100, generator=g) < 0.2
    mask[0], mask[2] = False, True
    p = SRBCRS.from_mask(VectorMask(mask, 8), stride=32)
    cuda = p.to("cuda")
    for p_bits, qk_bits in ((8, 8), (0, 16)):
        args = list(inputs(2, p.m, 1100, 64, p_bits, qk_bits, g, per_head=False))
        if p_bits:
            args[3] = args[3].clone()
            args[3][0, 16], args[3][0, 9] = 1e4, float("nan")
        else:
            args[0] = args[0].clone()
            args[0][0, 16] = args[0][0, 16].sign() * 1e4
            args[0][0, 9, 0] = float("nan")
        got = torch.ops.magicube_cuda.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order,
                                                       *(to_cuda(x) for x in args), 8, 0.125, qk_bits, p_bits, 1).cpu()
        want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *args, 8, 0.125, qk_bits,
                                                   p_bits, 1)
        bad += mismatch(got, want, f"non-finite scores p_bits={p_bits} qk_bits={qk_bits}")
        bad += int(not bool(want[0, [9, 16]].isnan().all()))  # the case is what it says
    bad += other_head_dims(g)
    torch.cuda.synchronize()
    print("sanitize_attention:", "ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


def other_head_dims(g) -> int:
    """The public op at head dims 8 and 48 (a value of 24 beside the 48): the three kernels."""
    mask = torch.rand(4, 300, generator=g) < 0.2
    mask[0], mask[2] = False, True
    p = SRBCRS.from_mask(VectorMask(mask, 8), stride=32, shuffle=True)
    cuda = p.to("cuda")
    bad = 0
    for d, dv in ((8, 8), (48, 24)):
        for p_bits, qk_bits in PAIRS:
            args = list(inputs(2, p.m, 300, d, p_bits, qk_bits, g, per_head=False))
            args[2] = args[2][..., :dv // (2 if qk_bits == 4 else 1)].contiguous()
            if p_bits:
                args[5] = args[5][:, :dv].contiguous()
            got = torch.ops.magicube.sparse_attention(cuda.row_ptr, cuda.col_idx, cuda.row_order,
                                                      *(to_cuda(x) for x in args), 8, d**-0.5, qk_bits, p_bits,
                                                      1).cpu()
            want = torch.ops.magicube.sparse_attention(p.row_ptr, p.col_idx, p.row_order, *args, 8, d**-0.5, qk_bits,
                                                       p_bits, 1)
            bad += mismatch(got, want, f"d={d} dv={dv} p_bits={p_bits} qk_bits={qk_bits}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
