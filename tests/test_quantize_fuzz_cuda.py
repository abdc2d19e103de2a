"""The CUDA quantization on random problems, bit-exact against the reference.

Every case draws its own (seeded by its number): the container (16/12/8/4-bit signed, 16/8/4-bit
unsigned), fp16 or fp32 input of one to five dims with rows of 8 to 4096 columns, and a layout as
the op accepts it (leading dims permuted, broadcast with stride 0 or padded apart, the first row
off 16 bytes); a scale per row over scales from subnormal to huge, itself broadcast or transposed;
and inputs that test the rounding: quotients on and a few ulp beside the .5 ties, values past the
range, zeros of both signs, infinities and NaNs. Each case equals the reference (the CPU op) and
the kernel's own output on contiguous copies. `MAGICUBE_FUZZ_CASES` and `MAGICUBE_FUZZ_SEED` widen
a run, as for tests/test_spmm_fuzz_cuda.py.
"""

import math
import random

import pytest
import torch

from conftest import FUZZ_CASES, FUZZ_SEED, load_kernels
from magicube.ops import quant
from test_quantize_cuda import KINDS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ELEMENTS = 4 << 20  # bound on x's elements, so that the CPU reference stays quick


def _case(i: int) -> dict:
    rng = random.Random(f"quantize-{FUZZ_SEED}-{i}")
    bits, signed = rng.choice(KINDS)
    cols = 8 * rng.randint(1, rng.choice([2, 8, 64, 512]))
    lead = [rng.choice([1, 1, 2, 3, 4, 5, 7, 16, 33, 100, 1000]) for _ in range(rng.randint(0, 4))]
    while lead and math.prod(lead) * cols > ELEMENTS:
        lead[lead.index(max(lead))] = 1
    return dict(bits=bits, signed=signed, dtype=rng.choice([torch.float16, torch.float32]), shape=(*lead, cols),
                order=rng.sample(range(len(lead)), len(lead)), broadcast=[n > 1 and rng.random() < 0.2 for n in lead],
                pad=rng.choice([0, 0, 8, 24]), offset=rng.choice([0, 0, 0, 1, 3, 8]),
                scale_range=rng.choice([(-3, 3), (-10, 10), (-40, 40), (-140, -120), (110, 126)]),
                scale_layout=rng.choice(["rows", "rows", "per-tensor", "transposed"]), seed=rng.randrange(1 << 30))


def _layout(data: torch.Tensor, order, broadcast, pad: int, offset: int) -> torch.Tensor:
    """A view of data's shape: its leading dims stored in `order`, those marked in `broadcast`
    holding data's first slice read with stride 0, rows `pad` elements apart past their width, the
    first row `offset` elements into its buffer; data's values elsewhere."""
    *lead, cols = data.shape
    one = data[tuple(slice(0, 1) if b else slice(None) for b in broadcast)]
    stored = [one.shape[d] for d in order]
    buf = data.new_zeros(math.prod(stored) * (cols + pad) + offset)
    x = buf[offset:].view(*stored, cols + pad)[..., :cols].permute(*[order.index(d) for d in range(len(lead))], -1)
    x.copy_(one)
    return x.expand(data.shape)


def _scales(shape, low: int, high: int, layout: str, g) -> torch.Tensor:
    """Positive fp32 scales of `shape`, 2^low to 2^high, per row, one for all, or stored transposed."""
    s = torch.exp2(torch.empty(shape).uniform_(low, high, generator=g)) * (1 + torch.rand(shape, generator=g))
    if layout == "per-tensor":
        return s.reshape(-1)[:1].reshape([1] * len(shape)).expand(shape) if shape else s
    if layout == "transposed" and len(shape) > 1:
        return s.transpose(0, -1).contiguous().transpose(0, -1)
    return s


def _inputs(shape, scale: torch.Tensor, bits: int, signed: bool, g) -> torch.Tensor:
    """Values around the range, a tenth of them quotients near .5 ties, a hundredth special."""
    qmin, qmax = quant.qrange(bits, signed)
    s = scale[..., None].double()
    q = torch.empty(shape, dtype=torch.float64).uniform_(qmin - 4, qmax + 4, generator=g)
    tie = (q.floor() + 0.5) * s
    ulps = int(torch.randint(-3, 4, (), generator=g))  # a few ulp (of fp32) beside the tie, or on it
    for _ in range(abs(ulps)):
        tie = torch.nextafter(tie.float(), torch.full_like(tie.float(), math.copysign(math.inf, ulps))).double()
    x = torch.where(torch.rand(shape, generator=g) < 0.1, tie, q * s)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 1e-40])
    pick = torch.randint(len(special), shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.01, special[pick].double(), x)


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("quantize")


@pytest.mark.parametrize("i", range(FUZZ_CASES))
def test_random_problem(kernels, i):
    c = _case(i)
    g = torch.Generator().manual_seed(c["seed"])
    shape, bits, signed = c["shape"], c["bits"], c["signed"]
    s = _scales(shape[:-1], *c["scale_range"], c["scale_layout"], g)
    data = _inputs(shape, s.expand(shape[:-1]).contiguous(), bits, signed, g).to(c["dtype"])
    x = _layout(data.cuda(), c["order"], c["broadcast"], c["pad"], c["offset"])
    got = kernels.quantize(x, s.cuda(), bits, signed)
    want = torch.ops.magicube.quantize(x.cpu(), s, bits, signed)  # CPU: the reference
    where = f"case {i} (MAGICUBE_FUZZ_SEED={FUZZ_SEED}): {c}, strides {x.stride()}"
    assert got.dtype == want.dtype and got.is_contiguous(), where
    assert torch.equal(got.cpu(), want), f"{where}: {(got.cpu() != want).sum()} of {want.numel()} differ"
    assert torch.equal(got, kernels.quantize(x.contiguous(), s.cuda().contiguous(), bits, signed)), where
