"""The CUDA SpMM on random problems across the automatic choice's whole range, against the reference.

The other SpMM tests fix their shapes to reach one kernel path each; here every case draws its own
(seeded by its number): any precision pair and signedness, V, M and K from a few columns to 4608,
N at and around the tiles' widths, batch x heads, per-row densities from empty to full (rows of
very different lengths, long rows past the staged indices), column orders the format allows, a
row order, inputs as views off 16-byte boundaries, a `longest_row` hint that may be wrong, and a
way of computing it (the automatic or the tuned choice, or one way forced). Each case is bit-exact
against the reference, run on the GPU in float64 (int64 output and the fp16 dequantized one) or,
for fp16 operands, within the fp32 accumulation bound.

`MAGICUBE_FUZZ_CASES` (default 48) and `MAGICUBE_FUZZ_SEED` (default 0) widen a run, e.g.
`MAGICUBE_FUZZ_CASES=2000 MAGICUBE_FUZZ_SEED=7 python -m pytest -x tests/test_spmm_fuzz_cuda.py`;
a failure names its case, which reruns alone with the same two variables.
"""

import os
import random

import pytest
import torch

from conftest import load_kernels, poison_allocator, random_ints, with_columns_shuffled
from magicube.ops import SRBCRS, VectorMask, to_container
from magicube.ops import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = int(os.environ.get("MAGICUBE_FUZZ_CASES", "48"))
SEED = int(os.environ.get("MAGICUBE_FUZZ_SEED", "0"))

# (a_bits, b_bits, a_signed); a_bits 0: fp16 x fp16.
KINDS = [(8, 8, True), (8, 8, False), (4, 4, True), (4, 4, False), (16, 8, True), (16, 8, False),
         (16, 16, True), (16, 16, False), (8, 4, True), (8, 4, False), (16, 4, True), (16, 4, False),
         (12, 4, True), (0, 0, True)]
WAYS = ["auto", "auto", "auto", "tuned", "gather", "stacked", "merged", "resident", "dense", "dense_wgmma"]
# Widths of B around the kernels' tiles (rows of 16-512 bytes) and a few odd ones.
NS = [1, 3, 8, 16, 31, 32, 40, 48, 63, 64, 65, 96, 100, 112, 127, 128, 129, 160, 192, 224, 255, 256, 257, 272,
      320, 384, 511, 512, 513, 640, 1000]
ELEMENTS = 48 << 20  # bound on BH x M x K, so that a case's float64 reference stays small


def _case(i: int) -> dict:
    rng = random.Random(f"{SEED}-{i}")
    a_bits, b_bits, a_signed = rng.choice(KINDS)
    v = rng.choice([2, 4, 8])
    size = rng.choice([64, 512, 2048, 4608])
    rows = rng.randint(1, max(1, size // v))
    k = rng.randint(1, size)
    bh = rng.choice([1, 1, 1, 2, 3, 5, 8, 12, 24, 40])
    bh = max(1, min(bh, ELEMENTS // (rows * v * k)))
    n = rng.choice(NS)
    n += n % 2 if b_bits == 4 else 0  # 4-bit B packs two values a byte
    return dict(a_bits=a_bits, b_bits=b_bits, a_signed=a_signed, v=v, rows=rows, k=k, n=n, bh=bh,
                density=rng.choice([0.005, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0]),
                rows_vary=rng.random() < 0.5, full_row=rng.random() < 0.3, empty_rows=rng.random() < 0.3,
                shuffle=rng.random() < 0.25, bank_order=rng.random() < 0.5, columns_shuffled=rng.random() < 0.15,
                row_order=rng.choice(["kept", "kept", "reversed", "shuffled"]), offset=rng.choice([0, 0, 0, 1, 2, 3]),
                hint=rng.choice(["exact", "exact", "unknown", "zero", "short", "long"]), way=rng.choice(WAYS),
                seed=rng.randrange(1 << 30))


def _mask(c: dict, g: torch.Generator) -> VectorMask:
    """Each vector row keeps a random share of K: the case's density, or, where rows vary, a
    density of its own between none and twice the case's; a full row and empty rows where asked."""
    rows, k = c["rows"], c["k"]
    density = torch.full((rows, 1), c["density"])
    if c["rows_vary"]:
        density = (density * 2 * torch.rand(rows, 1, generator=g)).clamp(max=1.0)
    mask = torch.rand(rows, k, generator=g) < density
    if c["empty_rows"]:
        mask[torch.rand(rows, generator=g) < 0.2] = False
    if c["full_row"]:
        mask[int(torch.randint(rows, (1,), generator=g))] = True
    return VectorMask(mask, c["v"])


def _hint(c: dict, p: SRBCRS) -> int:
    return {"exact": p.longest_row, "unknown": -1, "zero": 0, "short": p.longest_row // 2,
            "long": p.longest_row + 100}[c["hint"]]


def _offset(t: torch.Tensor | None, elements: int) -> torch.Tensor | None:
    """t as a view `elements` past the start of a larger buffer, as a slice would be (off the
    16-byte boundaries that the kernels' wide copies like)."""
    if t is None or elements == 0:
        return t
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("spmm")


@pytest.mark.parametrize("i", range(CASES))
def test_random_problem(kernels, monkeypatch, i):
    c = _case(i)
    if c["way"] == "dense_wgmma" and torch.cuda.get_device_capability()[0] != 9:
        c["way"] = "dense"
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", c["way"])
    g = torch.Generator().manual_seed(c["seed"])
    mask = _mask(c, g)
    p = SRBCRS.from_mask(mask, stride=32, shuffle=c["shuffle"], bank_order=c["bank_order"])
    if c["columns_shuffled"]:
        p = with_columns_shuffled(p, g)
    if c["row_order"] != "kept":
        order = p.row_order.flip(0) if c["row_order"] == "reversed" else p.row_order[torch.randperm(c["rows"], generator=g)]
        p = SRBCRS(p.m, p.k, p.v, p.stride, p.row_ptr, p.col_idx, order.contiguous(), p.shuffled)
    cuda = p.to("cuda")
    emask = mask.to_dense().cuda()
    bh, m, k, n, a_bits, b_bits, a_signed = c["bh"], p.m, c["k"], c["n"], c["a_bits"], c["b_bits"], c["a_signed"]
    gd = torch.Generator(device="cuda").manual_seed(c["seed"])
    pattern = (cuda.row_ptr, cuda.col_idx, cuda.row_order)

    def run(a_values, b, sa, sb, bits, out_dtype):
        args = (a_values, b, sa, sb, c["v"], m, bits[0], a_signed, bits[1], out_dtype)
        views = [_offset(x, c["offset"]) for x in (*pattern, a_values, b, sa, sb)]
        poison_allocator(-0x5A5A5A5A5A5A5A5A, torch.int64)
        got = kernels.spmm(*views, *args[4:], _hint(c, p))
        return got, reference.spmm(*pattern, *args)

    where = f"case {i} (MAGICUBE_FUZZ_SEED={SEED}): {c}"
    if a_bits == 0:
        a = (torch.randn(bh, m, k, device="cuda", generator=gd) * emask).half()
        b = torch.randn(bh, k, n, device="cuda", generator=gd).half()
        got, want = run(cuda.pack_values(a), b, None, None, (16, 16), torch.float16)
        exact = a.double() @ b.double()
        # fp32 accumulation (K terms) plus one rounding to fp16 (half an ulp, 2^-11 relative).
        bound = exact.abs() * 2.0**-11 + (a.double().abs() @ b.double().abs()) * k * 2.0**-23 + 2.0**-24
        assert bool(((got.double() - exact).abs() <= bound).all()), where
        return
    a = random_ints((bh, m, k), a_bits, a_signed, gd) * emask
    a_values = to_container(cuda.pack_values(a), a_bits, a_signed)
    b = to_container(random_ints((bh, k, n), b_bits, True, gd), b_bits)
    got, want = run(a_values, b, None, None, (a_bits, b_bits), torch.int64)
    assert got.shape == want.shape and torch.equal(got, want), f"{where}: {(got != want).sum()} of {want.numel()} differ"
    sa = (torch.rand(bh, m, device="cuda", generator=gd) + 0.01) / 2 ** (a_bits - 1)
    sb = (torch.rand(bh, n, device="cuda", generator=gd) + 0.01) / 2 ** (b_bits - 1)
    got, want = run(a_values, b, sa, sb, (a_bits, b_bits), torch.float16)
    assert torch.equal(got, want), f"{where}: fp16 output differs in {(got != want).sum()} of {want.numel()}"
