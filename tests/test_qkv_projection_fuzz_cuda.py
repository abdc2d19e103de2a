"""The CUDA Q/K/V projection on random problems, bit-exact against the reference.

Every case draws its own (seeded by its number): the container (16, 8 or 4 bits), a head dim of 2 to
256 and 1 to 16 heads (E from 2 to 1024: rows that fill no tile, heads that straddle tiles or share
one, E off 8 elements, which the kernel reads padded with zeros), B and T (row tiles across
batches), a bias or none, x and W stored off 16 bytes, and scales per (Q/K/V, head) fitted to the
data's range, at powers of two, or outside [2^-60, 2^60] (the kernel's full division), a few zero or
negative. The data are small integers times a power of two, so that every partial sum of x @ W^T + b
is exact in fp32 and any accumulation order gives the reference's fp16 projection; the containers
must then match bit for bit.
`MAGICUBE_FUZZ_CASES` and `MAGICUBE_FUZZ_SEED` widen a run, as for tests/test_spmm_fuzz_cuda.py.
"""

import random

import pytest
import torch

from conftest import FUZZ_CASES, FUZZ_SEED, poison_allocator, shifted
from magicube import ops
from magicube.ops import qkv_gemm, quant

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FLOPS = 2 << 30  # bound on B x T x 3E x E, so that the CPU reference stays quick


def _case(seed: int, i: int) -> dict:
    rng = random.Random(f"qkv-{seed}-{i}")
    bits = rng.choice([16, 8, 4])
    d = rng.choice([2, 4, 5, 6, 8, 12, 16, 24, 32, 40, 64, 64, 96, 128, 256])
    d += d % 2 if bits == 4 else 0  # 4-bit containers pack pairs along the head dim
    heads = rng.choice([h for h in (1, 2, 3, 4, 6, 8, 12, 16) if h * d <= 1024])
    e = heads * d
    b = rng.choice([1, 1, 2, 3, 4])
    t = rng.randint(1, rng.choice([16, 200, 1024, 4096]))
    t = max(1, min(t, FLOPS // (b * 3 * e * e)))
    return dict(bits=bits, b=b, t=t, e=e, heads=heads, bias=rng.random() < 0.7,
                x_offset=rng.choice([0, 0, 0, 1, 4]), w_offset=rng.choice([0, 0, 0, 0, 8, 3]),
                magnitude=rng.choice([1, 8, 32]), exponents=(rng.randint(-6, 4), rng.randint(-6, 4)),
                scales=rng.choice(["fitted", "fitted", "fitted", "powers of two", "extreme", "signs"]),
                seed=rng.randrange(1 << 30))


def _data(c: dict, g: torch.Generator):
    """x [B, T, E], W [3E, E] and b [3E]: integers up to `magnitude` times 2^kx, 2^kw and 2^(kx + kw).
    A product's partial sums stay under 2^20 of its 2^(kx + kw) steps: exact in fp32."""
    a, (kx, kw), e = c["magnitude"], c["exponents"], c["e"]

    def ints(*shape, bound=a):
        return torch.randint(-bound, bound + 1, shape, generator=g).double()

    x = (ints(c["b"], c["t"], e) * 2.0 ** kx).half()
    w = (ints(3 * e, e) * 2.0 ** kw).half()
    bias = (ints(3 * e, bound=a * a) * 2.0 ** (kx + kw)).half() if c["bias"] else None
    return x, w, bias


def _scales(c: dict, x, w, bias, g: torch.Generator) -> torch.Tensor:
    """[3, heads] fp32: the largest finite |y| of each (Q/K/V, head) over the container's largest value,
    times 1/2 to 2 (so that some values saturate), or otherwise as the case's `scales` says."""
    heads, qmax = c["heads"], (1 << (c["bits"] - 1)) - 1
    y = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).half().float()
    amax = y.nan_to_num(posinf=0.0, neginf=0.0).view(-1, 3, heads, c["e"] // heads).abs().amax(dim=(0, 3))
    fitted = torch.where(amax > 0, amax, 1.0) / qmax * torch.exp2(torch.empty(3, heads).uniform_(-1, 1, generator=g))
    kind = c["scales"]
    if kind == "powers of two":  # quotients on .5 ties
        return torch.exp2(torch.round(torch.log2(fitted)) - 1)
    if kind == "extreme":  # past 2^+-60, zero, or one of them beside fitted ones
        pool = torch.tensor([1e-30, 2.0 ** -61, 2.0 ** 61, 1e30, 0.0])
        pick = pool[torch.randint(len(pool), (3, heads), generator=g)]
        return torch.where(torch.rand(3, heads, generator=g) < 0.6, pick, fitted)
    if kind == "signs":
        return torch.where(torch.rand(3, heads, generator=g) < 0.5, -fitted, fitted)
    return fitted


@pytest.mark.parametrize("i", range(FUZZ_CASES))
def test_random_problem(i):
    _check(FUZZ_SEED, i)


# (seed, case) of wider runs that found a fault, run every time on both paths. (1, 13): x off 16
# bytes, whose fp16 GEMM on the unfused path cuBLAS ran on a kernel that sums in fp16 (infinities
# for 43,392), now run in fp32; such an x now reaches the fused kernel as a copy.
FOUND_FAULTS = [(1, 13)]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("seed, i", FOUND_FAULTS)
def test_case_that_found_a_fault(seed, i, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(qkv_gemm, "available", lambda: False)
    _check(seed, i)


def _check(seed: int, i: int):
    c = _case(seed, i)
    g = torch.Generator().manual_seed(c["seed"])
    x, w, bias = _data(c, g)
    scale = _scales(c, x, w, bias, g)
    want = torch.ops.magicube.qkv_projection(x, w, bias, scale, c["heads"], c["bits"])  # CPU: the reference
    x_gpu, w_gpu = shifted(x.cuda(), c["x_offset"]), shifted(w.cuda(), c["w_offset"])
    poison_allocator(0x5A, torch.uint8)
    got = ops.qkv_projection(x_gpu, w_gpu, None if bias is None else bias.cuda(), scale.cuda(), heads=c["heads"],
                             bits=c["bits"])
    where = f"case {i} (MAGICUBE_FUZZ_SEED={seed}): {c}"
    assert got.dtype == want.dtype and got.shape == want.shape, where
    got = got.cpu()
    differ = got != want
    assert not differ.any(), (f"{where}: {int(differ.sum())} of {want.numel()} bytes differ, first at "
                              f"{tuple(differ.nonzero()[0].tolist())}")
    values = quant.from_container(want, c["bits"])
    assert values.abs().max() > 0 or c["scales"] == "extreme", where  # the data reach beyond zero
