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
        # rows 48 bytes apart, the first one 2 bytes off 16: the op copies x first
        odd = x.view(-1)[1:97].view(4, 24)
        got = torch.ops.magicube_cuda.quantize(odd, s[:4], bits, signed).cpu()
        bad += not torch.equal(got, quant.quantize_to_container(odd.cpu(), s.cpu()[:4, None], bits, signed))
        # Q, K, V read in place: a [3, B, H, T, d] view of one [B, T, 3, H, d] projection, one scale
        # per (batch x head) broadcast over T; the larger one wraps the resident grid
        for B, T, H, d in ((2, 5, 2, 24), (2, 3000, 4, 64)):
            qkv = (torch.randn(B, T, 3, H, d, device="cuda", dtype=torch.float16) * 50).permute(2, 0, 3, 1, 4)
            qkv = qkv if signed else qkv.abs()
            s = (torch.rand(3, B, H, 1, device="cuda") + 0.1).expand(3, B, H, T)
            got = torch.ops.magicube_cuda.quantize(qkv, s, bits, signed).cpu()
            want = quant.quantize_to_container(qkv.cpu(), s.cpu()[..., None], bits, signed)
            bad += not torch.equal(got, want.contiguous())
    print("quantize sanitizer cases:", "ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
