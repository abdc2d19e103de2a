"""The fused Q/K/V projection kernel run by Triton's interpreter on the CPU (`TRITON_INTERPRET=1`),
bit-exact against the reference: its addressing, in each store order and with 64-bit offsets
forced, on shapes whose row tiles straddle batches, T below a row tile, head rows of an odd number
of elements, and 4-, 8- and 16-bit containers. Run as a script (the interpreter must be chosen
before the kernel is defined); `tests/test_qkv_projection_interpreted.py` runs it.

Stand-ins for what the interpreter lacks: `float2int_rn` (rounding half to even by the 1.5 x 2^23
trick, exact for the test's |q| < 2^22), the device query and the device guard.
Exits non-zero if a container differs from the reference's.
"""

import contextlib
import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from magicube import ops  # noqa: E402
from magicube.ops import qkv_gemm  # noqa: E402


@triton.jit
def _float2int_rn(q):
    q = tl.minimum(tl.maximum(q, -4194304.0), 4194304.0)
    return ((q + 12582912.0) - 12582912.0).to(tl.int32)


class _Forced:
    """The kernel, launched with some constexprs overridden."""

    def __init__(self, kernel, **forced):
        self.kernel, self.forced = kernel, forced

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, **self.forced})


# (B, T, E, heads, bits): odd head rows (d 63 at 8 bits, d 15 at 16, d 86 at 4: 43 bytes) in row tiles
# that straddle batches (T 130-300) and with T below a tile (37); d 6 at T 9; d 40 at 4 bits; E 36 at
# 16 bits (padded); d 64
SHAPES = [(3, 200, 189, 3, 8), (2, 150, 126, 2, 8), (3, 130, 45, 3, 16), (2, 9, 30, 5, 8), (4, 37, 172, 2, 4),
          (2, 300, 172, 2, 4), (2, 131, 320, 8, 4), (2, 70, 36, 2, 16), (2, 256, 256, 4, 8)]


def main() -> int:
    qkv_gemm.libdevice = types.SimpleNamespace(float2int_rn=_float2int_rn)
    qkv_gemm._device = lambda index: (4, False)  # four SMs: every program loops over several tiles
    torch.cuda.device = lambda device: contextlib.nullcontext()
    kernel = qkv_gemm._qkv_quantize_kernel
    g = torch.Generator().manual_seed(0)
    bad = runs = 0
    for B, T, E, heads, bits in SHAPES:
        x = torch.randint(-8, 9, (B, T, E), generator=g).half()
        w = torch.randint(-8, 9, (3 * E, E), generator=g).half()
        b = torch.randint(-64, 65, (3 * E,), generator=g).half()
        scale = torch.rand(3, heads, generator=g) * 4 + 0.5
        want = ops.qkv_projection(x, w, b, scale, heads=heads, bits=bits)
        for ties_go_to_rows in (False, True):
            for wide in (False, True):
                qkv_gemm._TIES_GO_TO_ROWS = ties_go_to_rows
                qkv_gemm._qkv_quantize_kernel = _Forced(kernel, WIDE=True) if wide else kernel
                got = torch.full_like(want, 0x55)
                qkv_gemm.qkv_projection(x, w, b, scale, heads, bits, got)
                runs += 1
                if not torch.equal(got, want):
                    bad += 1
                    print(f"differs: B {B}, T {T}, E {E}, heads {heads}, {bits} bits, ties to rows "
                          f"{ties_go_to_rows}, 64-bit offsets {wide}")
    print(f"qkv_projection interpreted: {runs} runs,", "ok" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
