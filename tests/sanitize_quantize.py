"""Small quantization launches of every container, for compute-sanitizer (memcheck, racecheck).

Exits non-zero if a result differs from the definition.
"""

import sys

import torch

from magicube.ops import extension, quant


def main() -> int:
    extension.load("quantize")
    bad = 0
    for bits, signed in [(16, True), (12, True), (8, True), (4, True), (16, False), (8, False), (4, False)]:
        x = torch.randn(5, 24, device="cuda", dtype=torch.float16) * 50
        x = x if signed else x.abs()
        s = torch.rand(5, device="cuda") + 0.1
        got = torch.ops.magicube_cuda.quantize(x, s, bits, signed).cpu()
        bad += not torch.equal(got, quant.quantize_to_container(x.cpu(), s.cpu()[:, None], bits, signed))
    print("quantize sanitizer cases:", "ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
