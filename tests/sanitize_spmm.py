"""A few small SpMM launches of every precision, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sanitize_spmm.py
    compute-sanitizer --tool racecheck python tests/sanitize_spmm.py

Exits non-zero if a result differs from the reference.
"""

import os
import sys

import torch

from magicube.ops import SRBCRS, VectorMask, extension, random_vector_mask, to_container

KINDS = [(8, 8, True), (8, 8, False), (4, 4, True), (16, 8, False), (16, 16, True), (16, 16, False), (8, 4, True),
         (16, 4, False), (12, 4, True)]


def check(g, p, emask, bh, k, n, v, a_bits, b_bits, a_signed, longest_row=-1) -> bool:
    """The launches of one problem against the reference (integer operands: the int64 output and
    the fp16 one), the kernels given `longest_row`; True where they agree."""
    cuda = p.to("cuda")

    def agree(*args) -> bool:
        dev = [x.cuda() if isinstance(x, torch.Tensor) else x for x in args]
        got = torch.ops.magicube_cuda.spmm(cuda.row_ptr, cuda.col_idx, cuda.row_order, *dev, longest_row).cpu()
        want = torch.ops.magicube.spmm(p.row_ptr, p.col_idx, p.row_order, *args)
        if a_bits == 0:
            return torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        return torch.equal(got, want)

    if a_bits == 0:
        a = (torch.randn(bh, p.m, k, generator=g) * emask).half()
        b = torch.randn(bh, k, n, generator=g).half()
        return agree(p.pack_values(a), b, None, None, v, p.m, 16, True, 16, torch.float16)
    lo, hi = (-(1 << (a_bits - 1)), 1 << (a_bits - 1)) if a_signed else (0, 1 << a_bits)
    a = to_container(p.pack_values(torch.randint(lo, hi, (bh, p.m, k), generator=g) * emask), a_bits, a_signed)
    b = to_container(torch.randint(-(1 << (b_bits - 1)), 1 << (b_bits - 1), (bh, k, n), generator=g), b_bits)
    sa, sb = torch.rand(bh, p.m, generator=g) / 2 ** a_bits, torch.rand(bh, n, generator=g) / 2 ** b_bits
    return (agree(a, b, None, None, v, p.m, a_bits, a_signed, b_bits, torch.int64)
            and agree(a, b, sa, sb, v, p.m, a_bits, a_signed, b_bits, torch.float16))


def main() -> int:
    extension.load("spmm")
    bad = 0
    g = torch.Generator().manual_seed(0)
    # Every way: the gather kernel with 16-bit A's planes stacked (V 2, 16-byte rows; unsigned and
    # 12-bit A's at V 4) and on V 2 rows merged four at a time (below), the resident-B kernel (8-
    # and 4-bit B on 16-byte rows) and the dense path (integer operands) run on problems this small
    # only when asked for (on Hopper with one or two plane products the wgmma GEMM's least tile, K
    # split between two CTAs of a cluster); on Hopper also the dense path with its wgmma GEMM, whose
    # smaller tile runs here when forced (within one wave, its deeper ring), its larger one on the
    # first batched problem at the end (12 x 3 x 3 tiles) and, with one plane product, its smaller
    # tile past one wave on the second (40 x 2 x 2 tiles), each also at an N of whole 16-byte fp16
    # chunks (the two-warpgroup tiles' staged stores); the fifth's expansion takes groups of 8
    # vector rows a CTA, the last of 5 rows; with one or two plane products the last two take the
    # least tile (64 x 64) within one wave of 132 SMs and past it.
    kernels = ["gather", "stacked", "resident", "dense"]
    if torch.cuda.get_device_capability()[0] == 9:
        kernels.append("dense_wgmma")
    for kernel in kernels:
        os.environ["MAGICUBE_SPMM_KERNEL"] = kernel
        for v in (2, 4, 8):
            mask = random_vector_mask(5 * v, 130, v, 0.7, seed=v).mask.clone()
            mask[0] = False
            mask[2] = True
            vm = VectorMask(mask, v)
            p = SRBCRS.from_mask(vm, stride=32)
            # N = 36: rows not on 16 bytes (padded); N = 48: the quarter tile (8- and 4-bit B)
            # and 16-bit B's narrow tile; N = 96: 8-bit B's narrow tile; N = 128: 4-bit B's quarter
            # tile, whole; N = 160: a partial tile (for every B).
            for n in (36, 48, 96, 128, 160):
                for a_bits, b_bits, a_signed in KINDS + [(0, 0, True)]:
                    if not check(g, p, vm.to_dense(), 2, 130, n, v, a_bits, b_bits, a_signed):
                        bad += 1
                        print(f"MISMATCH {kernel} v={v} n={n} a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    # The resident-B kernel's CTAs of 4 warps: rows of 96 bytes (three slices) at BH 24, 40 vector
    # rows (an empty one and a full one).
    os.environ["MAGICUBE_SPMM_KERNEL"] = "resident"
    for v in (2, 8):
        mask = random_vector_mask(40 * v, 130, v, 0.7, seed=v).mask.clone()
        mask[0], mask[5] = False, True
        vm = VectorMask(mask, v)
        p = SRBCRS.from_mask(vm, stride=32)
        for a_bits, b_bits, a_signed in KINDS:
            n = 96 * 8 // b_bits
            if b_bits in (8, 4) and not check(g, p, vm.to_dense(), 24, 130, n, v, a_bits, b_bits, a_signed):
                bad += 1
                print(f"MISMATCH resident, 4-warp CTAs: v={v} a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    # V 2 rows merged four at a time, an empty row and a full one among them: the union in one
    # window, and (the longest row understated) in windows of 32 columns; N = 272 on three narrow
    # tiles of 8-bit B (on_tile), five of 16-bit B.
    os.environ["MAGICUBE_SPMM_KERNEL"] = "merged"
    mask = random_vector_mask(16, 130, 2, 0.7, seed=4).mask.clone()
    mask[1], mask[6] = False, True
    vm = VectorMask(mask, 2)
    p = SRBCRS.from_mask(vm, stride=32)
    for n, hint in ((64, p.longest_row), (160, 0), (272, p.longest_row)):
        for a_bits, b_bits, a_signed in KINDS:
            if not check(g, p, vm.to_dense(), 2, 130, n, 2, a_bits, b_bits, a_signed, hint):
                bad += 1
                print(f"MISMATCH merged: n={n} longest_row={hint} a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    # The gather kernel's paired steps (every kind but 4-bit B under 4-bit A; the quarter, narrow
    # and wide tiles, the wide one's 8-bit A and B and 16-bit A and B on the ring of five here) on
    # a row of 70 blocks, whose column indices past the 44-64 blocks copied to shared memory
    # come from global memory, an empty row and one of 4 blocks; N = 272 on rows of several narrow
    # tiles (8- and 16-bit B, 4-bit B under 4-bit A) and quarter tiles (4-bit B; on_tile); N = 256
    # on rows of whole tiles, which on a grid this small take half the tile (8- and 4-bit B; launch).
    os.environ["MAGICUBE_SPMM_KERNEL"] = "gather"
    mask = torch.zeros(3, 2240, dtype=torch.bool)
    mask[1], mask[2, :100] = True, True
    vm = VectorMask(mask, 8)
    p = SRBCRS.from_mask(vm, stride=32)
    for n in (48, 128, 160, 256, 272):
        for a_bits, b_bits, a_signed in KINDS:
            if not check(g, p, vm.to_dense(), 2, 2240, n, 8, a_bits, b_bits, a_signed):
                bad += 1
                print(f"MISMATCH paired steps: n={n} a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    # The tuned choice: every way that applies runs, timed, before the fastest (V 2, N = 160; the
    # rows merge).
    os.environ["MAGICUBE_SPMM_KERNEL"] = "tuned"
    vm = random_vector_mask(16, 130, 2, 0.7, seed=2)
    p = SRBCRS.from_mask(vm, stride=32)
    for a_bits, b_bits, a_signed in KINDS:
        if not check(g, p, vm.to_dense(), 2, 130, 160, 2, a_bits, b_bits, a_signed):
            bad += 1
            print(f"MISMATCH tuned: a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    os.environ["MAGICUBE_SPMM_KERNEL"] = "dense"
    for bh, m, k, n, v in ((12, 300, 160, 300, 4), (12, 300, 160, 296, 4), (40, 240, 96, 100, 8),
                           (40, 240, 96, 104, 8), (64, 106, 200, 40, 2), (16, 250, 136, 120, 2),
                           (24, 250, 136, 118, 2)):
        vm = random_vector_mask(m, k, v, 0.5, seed=3)
        p = SRBCRS.from_mask(vm, stride=32)
        for a_bits, b_bits, a_signed in KINDS:
            if not check(g, p, vm.to_dense(), bh, k, n, v, a_bits, b_bits, a_signed):
                bad += 1
                print(f"MISMATCH dense, batched {bh}: a_bits={a_bits} b_bits={b_bits} signed={a_signed}")
    # A row past the int32 accumulators' fold interval (513 blocks) in the gather kernel: on 8-bit
    # B's narrow tile (N = 96), where it keeps the folds in local memory, and its quarter tile (N =
    # 48), and with 16-bit A's planes stacked into one MMA (at V 2 on the quarter tile, and N = 160:
    # the wide tile for 8- and 16-bit B), unsigned 16-bit and 12-bit A's at V 4 (N = 128 too: 4-bit
    # B's quarter tile).
    os.environ["MAGICUBE_SPMM_KERNEL"] = "stacked"
    k = 32 * 513
    mask = torch.zeros(2, k, dtype=torch.bool)
    mask[1] = True
    for a_bits, b_bits, a_signed, n, v in ((8, 8, True, 96, 2), (16, 8, False, 96, 2), (8, 8, True, 48, 2),
                                           (16, 8, False, 48, 2), (16, 8, True, 160, 2),
                                           (16, 16, True, 160, 2), (16, 4, True, 160, 2), (12, 4, True, 160, 4),
                                           (12, 4, True, 128, 4), (16, 8, False, 160, 4)):
        vm = VectorMask(mask, v)
        p = SRBCRS.from_mask(vm, stride=32)
        if not check(g, p, vm.to_dense(), 1, k, n, v, a_bits, b_bits, a_signed):
            bad += 1
            print(f"MISMATCH gather, long row: a_bits={a_bits} b_bits={b_bits} signed={a_signed} n={n}")
    torch.cuda.synchronize()
    print("sanitize_spmm:", "ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
