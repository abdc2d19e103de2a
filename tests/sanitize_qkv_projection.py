"""Small launches of the Q/K/V projection's quantizing GEMM, for compute-sanitizer (memcheck,
racecheck): partial tiles, one row, a head dim of 6, rows of E 36 (padded to whole 16-byte chunks),
head rows of an odd number of elements in row tiles that straddle batches, 4-bit containers, and more
tiles than the persistent grid.

Exits non-zero if a result differs from the reference (integer data: exact in any order).
"""

import sys

import torch

from magicube import ops


def main() -> int:
    bad = 0
    g = torch.Generator().manual_seed(0)
    for B, T, E, heads, bits in ((2, 100, 96, 3, 8), (1, 1, 128, 2, 16), (1, 77, 48, 8, 8), (2, 70, 36, 2, 8),
                                 (2, 150, 126, 2, 8), (3, 130, 45, 3, 16),
                                 (2, 50, 64, 2, 4), (8, 4096, 64, 1, 8)):
        x = torch.randint(-8, 9, (B, T, E), generator=g).half()
        w = torch.randint(-8, 9, (3 * E, E), generator=g).half()
        b = torch.randint(-64, 65, (3 * E,), generator=g).half()
        scale = torch.rand(3, heads, generator=g) * 4 + 0.5
        got = ops.qkv_projection(x.cuda(), w.cuda(), b.cuda(), scale.cuda(), heads=heads, bits=bits).cpu()
        bad += not torch.equal(got, ops.qkv_projection(x, w, b, scale, heads=heads, bits=bits))
    print("qkv_projection sanitizer cases:", "ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
