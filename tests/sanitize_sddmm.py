"""A few small SDDMM and sparse-softmax launches of every mode, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sanitize_sddmm.py
    compute-sanitizer --tool racecheck python tests/sanitize_sddmm.py

Exits non-zero if a result differs from the reference.
"""

import sys

import torch

from magicube.ops import SRBCRS, VectorMask, extension, from_container, random_vector_mask, to_container


def main() -> int:
    extension.load("sddmm")
    extension.load("softmax")
    ops, ref = torch.ops.magicube_cuda, torch.ops.magicube
    bad = 0
    g = torch.Generator().manual_seed(0)
    # N = 1000: rows of several stride blocks; K = 128 two k chunks, K = 300 rows with
    # 4-byte units (int8, int16, fp16) and 2-byte units (int4, 150 bytes). 24 rows of one block
    # beside a full one of 35: a row past 8 mean rows, split over a CTA's warps by both kernels.
    for v, n, ks, rows, sparsity in ((2, 130, (64, 38), 5, 0.7), (8, 130, (64, 38), 5, 0.7),
                                     (8, 1000, (128,), 5, 0.7), (4, 1000, (300,), 5, 0.7),
                                     (8, 1100, (64,), 24, 0.98)):
        mask = random_vector_mask(rows * v, n, v, sparsity, seed=v).mask.clone()
        mask[0] = False
        mask[2] = True
        p = SRBCRS.from_mask(VectorMask(mask, v), stride=32, shuffle=v == 8)
        cuda = p.to("cuda")
        idx = (p.row_ptr, p.col_idx, p.row_order)
        didx = (cuda.row_ptr, cuda.col_idx, cuda.row_order)
        bh = 2
        # K = 64: 16-byte loads; K = 38: the 2- and 1-byte tail paths.
        for k in ks:
            for bits in (16, 8, 4, 0):
                if bits == 0:
                    a = torch.randn(bh, p.m, k, generator=g).half()
                    b = torch.randn(bh, n, k, generator=g).half()
                    args = (a, b, None, None, v, 16, torch.float16)
                else:
                    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
                    a = to_container(torch.randint(lo, hi, (bh, p.m, k), generator=g), bits)
                    b = to_container(torch.randint(lo, hi, (bh, n, k), generator=g), bits)
                    args = (a, b, torch.rand(bh, p.m, generator=g), torch.rand(bh, n, generator=g), v, bits,
                            torch.float16)
                dev = [x.cuda() if isinstance(x, torch.Tensor) else x for x in args]
                got = ops.sddmm(*didx, *dev).cpu()
                want = ref.sddmm(*idx, *args)
                ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2) if bits == 0 else \
                    torch.equal(got, want)
                if not ok:
                    print(f"sddmm v={v} k={k} bits={bits}: MISMATCH")
                    bad += 1
        values = (torch.randn(bh, p.nnz_pad * v, generator=g) * 3).half()
        for out_bits in (0, 16, 8, 4):
            got, rs = ops.sparse_softmax(*didx, values.cuda(), v, 0.125, out_bits)
            want, want_rs = ref.sparse_softmax(*idx, values, v, 0.125, out_bits)
            got = got.cpu()
            if out_bits == 0:
                ok = torch.allclose(got.float(), want.float(), rtol=2e-3, atol=1e-6)
            else:
                ok = (from_container(got, out_bits, False) - from_container(want, out_bits, False)).abs().max() <= 1
            ok = ok and torch.allclose(rs.cpu(), want_rs, rtol=1e-5)
            if not ok:
                print(f"softmax v={v} out_bits={out_bits}: MISMATCH")
                bad += 1
    torch.cuda.synchronize()
    print("sanitize_sddmm:", "FAILED" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
