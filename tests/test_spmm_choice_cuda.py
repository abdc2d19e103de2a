"""Which way the integer SpMM runs (csrc/spmm.cu: estimates, launch_resident, launch_integer), read
from the names of the kernels that a profiled call launches: the ways give equal answers, so the
other tests cannot tell them apart. The automatic choice's cells lie far from its thresholds (by
its own estimates at least 1.2x between the ways it weighs, mostly 2-20x), so they hold on any
GPU that fits B's slice in shared memory; a forced way runs where it applies, whatever the
estimates say; the tuned choice runs the way it timed fastest.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import load_kernels, random_ints
from magicube.ops import SRBCRS, random_vector_mask, to_container

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The cases whose dense estimate is our wgmma GEMM's, which runs on Hopper only.
wgmma_estimate = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                    reason="the dense path's estimate here is its wgmma GEMM's (Hopper)")

# The resident kernel's grid (CTAs of 4 or 16 warps, its busy warps an SM) depends on the SM count
# (launch_resident); the cases that rely on it hold on GPUs of 108-143 SMs (the H100 PCIe has 114,
# SXM and H200 132).
sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
resident_grid = pytest.mark.skipif(not 108 <= sms < 144, reason="the case's resident grid holds for 108-143 SMs")
# Rows of A of at most two blocks merge from 7/4 merged CTAs an SM, of up to four blocks from 21/8
# on the wide tile (launch_merged): 256 and 384 of them on GPUs of up to 146 SMs.
merged_grid = pytest.mark.skipif(not 0 < sms <= 146, reason="the case's 256 or 384 merged CTAs pay on up to 146 SMs")


def on_resident_grid(shape, bh, way, case_id):
    """A batched case whose resident grid holds on GPUs of 108-143 SMs only (resident_grid)."""
    return pytest.param(shape, bh, way, id=case_id, marks=resident_grid)


def resident_or_dense(shape, bh, way, case_id):
    """A case whose resident kernel's estimate is weighed against the dense path's (launch_resident):
    it holds where the resident grid is that of 108-143 SMs and the dense estimate our wgmma GEMM's."""
    return pytest.param(shape, bh, way, id=case_id, marks=[resident_grid, wgmma_estimate])


# A way, by a kernel that only it launches (the dense path's GEMM is cuBLAS's or one of ours).
WAY_KERNELS = {"gather": "spmm_kernel<", "resident": "spmm_resident_kernel<", "dense": "expand_kernel<"}


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("spmm")


def _problem(a_bits, b_bits, v, sparsity, mk, n, a_signed=True, out_dtype=torch.int64, bh=1):
    """One call of the integer SpMM on random operands (M = K = mk, `bh` batch x heads of one
    pattern; int64 output, or fp16 dequantized by random scales) and the exact integer product."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mask = random_vector_mask(mk, mk, v, sparsity, seed=1)
    p = SRBCRS.from_mask(mask, stride=32).to("cuda")
    qa = random_ints((bh, mk, mk), a_bits, a_signed, g) * mask.to_dense().to("cuda")
    qb = random_ints((bh, mk, n), b_bits, True, g)
    a_values = to_container(p.pack_values(qa), a_bits, a_signed)
    b = to_container(qb, b_bits)
    fp16 = out_dtype == torch.float16
    sa = torch.rand(bh, mk, device="cuda", generator=g) if fp16 else None
    sb = torch.rand(bh, n, device="cuda", generator=g) if fp16 else None

    def call():
        return torch.ops.magicube_cuda.spmm(p.row_ptr, p.col_idx, p.row_order, a_values, b, sa, sb, v, mk,
                                            a_bits, a_signed, b_bits, out_dtype, p.longest_row)

    # Exact in float64: every partial sum stays below 2^53.
    return call, (qa.double() @ qb.double()).long()


def _kernels_run(*shape, call=None):
    """The names of the kernels that one call launched (_problem's arguments, or `call`)."""
    call = call or _problem(*shape)[0]
    call()  # loads cuBLAS and settles the allocator outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def _template_args(name, way):
    """The template arguments of a launched kernel of `way` (WAY_KERNELS), in order, from its name."""
    return name.split(WAY_KERNELS[way])[1].split(">")[0].split(", ")


def _gather_args(name):
    """A launched gather kernel's template arguments, by name: AB, AS, BB, TB, STACK, MERGE,
    PAIR_RING."""
    args = _template_args(name, "gather")
    return dict(zip(("AB", "AS", "BB", "TB", "STACK", "MERGE", "PAIR_RING"), args, strict=True))


def _gather_instance(*shape):
    """The template arguments of the one gather kernel that a call launched (_problem's
    arguments; _gather_args)."""
    names = _kernels_run(*shape)
    gathers = [name for name in names if WAY_KERNELS["gather"] in name]
    others = [name for name in names for way in ("resident", "dense") if WAY_KERNELS[way] in name]
    assert len(gathers) == 1 and not others, names
    return _gather_args(gathers[0])


def _ways_run(*shape, call=None):
    """The ways that one call launched (_kernels_run's arguments)."""
    names = _kernels_run(*shape, call=call)
    return {way for way, kernel in WAY_KERNELS.items() if any(kernel in name for name in names)}


# (a_bits, b_bits, V, sparsity, M = K, N, the way): rows of B in bytes are N x b_bits / 8.
AUTO_CASES = {
    # The SpMM target: rows of 256 bytes, wider than the resident kernel takes, and few gathers.
    "target-gather": (8, 8, 8, 0.9, 4096, 256, "gather"),
    # Low V and sparsity: each row of B gathered 512 times, dense by far (both pairs).
    "low-sparsity-dense": (8, 8, 2, 0.5, 2048, 256, "dense"),
    "low-sparsity-dense-16-bit-a": (16, 8, 2, 0.5, 2048, 256, "dense"),
    # Rows of 32 bytes and some 27 KB of gathers an SM (132 SMs): the resident kernel, which pays
    # from 12 KB.
    "narrow-resident": (8, 8, 2, 0.9, 2048, 32, "resident"),
    # Rows of 24 bytes, padded to 32 (spmm_cuda): the same.
    "unaligned-narrow-resident": (8, 8, 2, 0.9, 2048, 24, "resident"),
    # 8-bit B's rows of a whole narrow tile at BH 1 take the gather kernel, whatever the count (here
    # 101 KB against 96; forced on an H200, the resident kernel took 13.0 us, the gather kernel 10.0).
    "whole-tile-8-bit-b-gather": (8, 8, 4, 0.9, 4096, 128, "gather"),
    # Few gathers of narrow rows: neither the resident kernel (0.5 KB against 12) nor the dense path.
    "narrow-few-gathers-gather": (8, 8, 8, 0.98, 2048, 32, "gather"),
}


@pytest.mark.parametrize("case", AUTO_CASES.values(), ids=AUTO_CASES.keys())
def test_automatic_choice(kernels, monkeypatch, case):
    *shape, way = case
    monkeypatch.delenv("MAGICUBE_SPMM_KERNEL", raising=False)
    assert _ways_run(*shape) == {way}


@wgmma_estimate
def test_automatic_choice_4_bit_b_dense(kernels, monkeypatch):
    """4-bit B's rows count at 0.85 of the gather estimate's rate, and the dense estimate at 0.8 on
    our wgmma GEMM (estimates): L16-R4 at V 2, sparsity 0.7, M = K = 2048, N 256 takes the dense
    path, by its estimates 15.7 us against 22.1 (with neither, 19.6 against 19.3: the resident
    kernel, which took 1.5x the dense path's time in the sweep's cell of this shape)."""
    monkeypatch.delenv("MAGICUBE_SPMM_KERNEL", raising=False)
    assert _ways_run(16, 4, 2, 0.7, 2048, 256) == {"dense"}


@wgmma_estimate
def test_automatic_choice_split_gemm_dense(kernels, monkeypatch):
    """Where none of our wgmma GEMM's tiles fills the SMs, its least tile with K split in two
    counts at the least tile's constants (estimates): L8-R4 at V 2, sparsity 0.5, M = K = 2048,
    N 128 (rows of 64 bytes) takes the dense path before the resident kernel, its estimate as
    weighed against the resident kernel's (launch_resident) 10.3 us against 12.3 (with cuBLAS's GEMM
    counted, as before the split, about 1.3x as much: the resident kernel, which took 1.3x the dense
    path's time there; H200, kernel_checks.md, sixty-second and eighty-ninth rounds)."""
    monkeypatch.delenv("MAGICUBE_SPMM_KERNEL", raising=False)
    assert _ways_run(8, 4, 2, 0.5, 2048, 128) == {"dense"}


@wgmma_estimate
@pytest.mark.parametrize("shape", [(8, 8, 2, 0.8, 1024, 512), (8, 4, 2, 0.9, 2048, 512)], ids=["L8-R8", "L8-R4"])
def test_automatic_choice_wgmma_dense(kernels, monkeypatch, shape):
    """The dense path's estimate counts at 0.8 on our wgmma GEMM (estimates). L8-R8 at V 2,
    sparsity 0.8, M = K = 1024, N 512 takes the dense path, by its estimates 9.6 us against 10.8
    (unscaled, 12.0: the gather kernel, which took 1.38x the dense path's time in the sweep's cell
    of this shape); L8-R4 at V 2, sparsity 0.9, M = K = 2048, N 512 too, by 12.5 against 14.1
    (unscaled, 15.7: the resident kernel, 1.45x the dense path's time there)."""
    monkeypatch.delenv("MAGICUBE_SPMM_KERNEL", raising=False)
    assert _ways_run(*shape) == {"dense"}


# (a_bits, b_bits, V, sparsity, M = K, N), BH, the way. The dense estimate counts 1.3x from BH 16
# (batched_dense; its estimate is our wgmma GEMM's): L8-R8 at V 4, sparsity 0.9, M = K = 2048, N 128
# takes the resident kernel, by the estimates 60.7 us against 47.8 (unscaled, 46.7: the dense path,
# which took 1.52x the resident kernel's time in this cell); at V 2, sparsity 0.5, N 256 the dense
# path still runs, by 117 against 664. Rows of up to half a narrow tile, and 4-bit B's rows of a
# whole one at V 8, take the resident kernel from a quarter of BH 1's count of gathers from BH 4
# (launch_resident). 8-bit B's rows of 64 bytes count from 60 KB (its gather kernel's quarter tile).
# L8-R8 at V 8, sparsity 0.7, M = K = 1024 (132 SMs): rows of 64 bytes at BH 1 gather 2.5 KB an SM
# against 60 KB (the gather kernel); at BH 8, 19.9 KB against 15 (before the batched counts, 24: the
# gather kernel, 1.53x the resident kernel's time in the forced run); rows of 32 bytes at BH 8, 9.9
# KB against 3 (before, 12: 1.55x). At V 2, M = K = 2048, BH 1, rows of 64 bytes: sparsity 0.95,
# 31.8 KB against 60 (29.3-38.8 on 108-143 SMs; before the quarter tile, against 24: the resident
# kernel, 1.12x the gather kernel's time on that tile in a cell of this shape); sparsity 0.8, 103 KB
# (95-126), the resident kernel. L8-R4 of N 256 (rows of 128 bytes) at BH 8: 38.8 KB against 24
# (before, 96: 1.08x). 12- and 16-bit A at V 4 on such rows take a quarter from BH 8 where A's rows
# average four blocks or more: L16-R4 at N 256, sparsity 0.85, M = K = 1024 (five blocks a row), BH
# 8: 77.6 KB against 24 (before, 96); at sparsity 0.95 (two blocks a row), BH 16: 62.1 KB, still
# against 96 (the gather kernel). 4- and 8-bit A take it on rows of up to 96 bytes to BH 16: L8-R4
# and L4-R4 at N 192, sparsity 0.8, M = K = 768 (five blocks a row), BH 8: 43.6 KB against 24
# (before, 96); L8-R4 at N 224 (rows of 112 bytes), M = K = 640, BH 16: 67.9 KB, still against 96.
# Rows of 65-96 bytes of either B take it from BH 8 where the resident grid runs CTAs of 4 warps (on
# GPUs of 108-143 SMs at these shapes, test_resident_cta_warps): L8-R4 at N 160, M = K = 640, BH 24
# (72.7 KB, three slices, ten rows a warp in 16-warp CTAs, six in 4-warp ones) and L8-R8 at V 4, N
# 96, sparsity 0.75, M = K = 512, BH 24 (69.8 KB), against 24 (before, 96); L8-R8 at V 8, N 128
# (rows of 128 bytes), M = K = 768, BH 24: 52.4 KB, still against 96. So do 4-bit B's rows of up to
# 112 bytes where A's rows average four blocks or more: L8-R4 at N 224, sparsity 0.8, M = K = 704
# (five blocks a row), BH 12: 70.0 KB against 24 (six rows a warp in 16-warp CTAs, four in 4-warp).
# 4-bit B's rows of at most 64 bytes count against the quarter tile: rows of 48 (below) and 64 bytes
# from 80 KB, a quarter of it at any BH where the resident grid keeps ten warps an SM or more in
# rows, with 4-bit A, and with 12- and 16-bit A where the gather kernel's grid ends in a wave under
# half full (7 CTAs an SM), not with 8-bit A. L4-R4 at V 2, N 128, sparsity 0.85, M = K = 1536 (768
# vector rows, a row a warp, 11 busy warps an SM on 132 SMs), BH 1: 46.5 KB against 20 (L8-R4 there
# against 80); at sparsity 0.96: 11.6 KB, under 20 (14.2 on 108 SMs). L16-R4 at sparsity 0.85,
# M = K = 1408: 37.3 KB against 80, its gather grid of 704 CTAs one wave (before, against 20: the
# resident kernel, which took 1.13x the gather kernel's time in a cell beside it); at sparsity 0.9,
# M = K = 2048: 54.3 KB against 20, 1024 CTAs leaving 100 in a second wave of 924 (on 108-143 SMs
# 50-66 KB, at most 268 of 756-1001). L4-R4 at sparsity 0.9, M = K = 1024 (7 busy warps an SM): 15.5
# KB against 80.
# Rows of 48 bytes where A's rows average eight blocks or more count from 8 KB (8-bit B) and 32 KB
# (4-bit B under 4- and 8-bit A), not 24 and 80. L8-R8 at V 8, sparsity 0.6, M = K = 3072, N 48 (39
# blocks a row), BH 1: 21.3 KB (19.6-26.0 on 108-143 SMs), the resident kernel (before, the gather
# kernel, 1.61x its time in a forced run); at V 4, sparsity 0.98, M = K = 4608 (three blocks a row):
# 9.8 KB, still against 24 (the gather kernel, which took 0.63x the resident kernel's time in a
# forced run). L8-R4 at V 8, sparsity 0.8, M = K = 2048, N 96 (13 blocks a row), BH 4: 18.9 KB
# against 8, the resident kernel (before, against 20: the gather kernel, 1.30x its time forced);
# L8-R4 at V 4, sparsity 0.98, M = K = 896 (one block a row), BH 8: 5.1 KB, over the 4 of long rows
# and under the 10 of short ones (the gather kernel, 0.73x the resident kernel's time forced).
# Rows of at most 64 bytes where the dense path pays against the gather kernel take the resident
# kernel where it pays and its estimate is under the dense path's as weighed against it
# (launch_resident; H200, us). L16-R8 at V 2, sparsity 0.6, M = K = 2048, N 64: the resident kernel,
# 9.5 against 13.0; L16-R4 there, BH 4: 21.7 against 27.9. L8-R8 at sparsity 0.5, M = K = 4096, N
# 64: the dense path, 20.1 against 27.8; L16-R4 at sparsity 0.6, M = K = 2048, N 96, BH 4: 29.3
# against 39.0 (the dense estimate 0.63 of the gather's, where before the dense path ran first
# only under 0.6: the resident kernel, which took 1.33x the dense path's time in a forced run).
# So do wider rows (8-bit B's of 65-128 bytes, 4-bit B's of 65-256) at BH 2-15, where until the
# ninety-fifth round the dense path ran wherever it paid: L16-R8 at BH 4, V 4, sparsity 0.7, M = K =
# 3072, N 96, the resident kernel, 34.1 against 51.4 (before, the dense path, which took 1.66x its
# time in a forced run); at V 2, sparsity 0.9, N 128: 29.0 against 45.5 (1.70x). L8-R8 at V 2,
# sparsity 0.7, M = K = 2048, N 112, BH 4: the dense path, 17.4 against 32.7; L8-R4 at sparsity 0.6,
# N 256: 21.4 against 56.5. BH 2 and 3 since the ninety-sixth round (M = K = 4096 in each):
# L16-R8 at V 4, sparsity 0.7, N 96, the resident kernel, 28.9 against 46.7 at BH 2 and 44.6 against
# 66.1 at BH 3; L8-R8 at BH 2, V 4, sparsity 0.8, N 96: 18.9 against 24.1; at BH 3, V 8, sparsity
# 0.7, N 128: 25.9 against 39.6; L4-R4 at BH 3, V 8, sparsity 0.7, N 256: 33.7 against 45.8 (before,
# the dense path in each). From BH 16 the dense path runs first again wherever it pays against the
# gather kernel (weighed by 1.3): L8-R8 at M = K = 1024, N 128, V 2, sparsity 0.9, 23.6 against
# 28.8, and V 4, sparsity 0.5, 33.9 against 54.2; L16-R8 at V 2, sparsity 0.7, 39.0 against 66.8
# (before, the resident kernel in each).
# Rows of 65-96 bytes count from 32 KB, not 96, at BH 2 and up and where A keeps a quarter of its
# columns or more (ninety-seventh round): L16-R8 at V 8, sparsity 0.7, M = K = 4096, N 96, BH 1: 56.7
# KB (52.4-69.3 on 108-143 SMs), the resident kernel (before, the gather kernel, which took 1.24x its
# time in a forced run of that shape); at V 4, sparsity 0.85, M = K = 1536, BH 3: 52.4 KB
# (48.3-64.0), the resident kernel (before, 1.27x), and so L16-R4 at N 192 (1.29x). L8-R8 at V 4,
# sparsity 0.85, M = K = 3072, BH 1 (A keeps 16 % of its columns): 65.5 KB (60.4-80.0), still
# against 96 (the gather kernel, which took 0.86x the resident kernel's time forced), and so L8-R4 at
# N 192 (0.89x).
BATCHED_CASES = [
    pytest.param((8, 8, 4, 0.9, 2048, 128), 16, "resident", id="dense-factor-resident", marks=wgmma_estimate),
    pytest.param((8, 8, 2, 0.5, 2048, 256), 16, "dense", id="dense-factor-dense", marks=wgmma_estimate),
    pytest.param((8, 8, 8, 0.7, 1024, 64), 1, "gather", id="64-byte-rows-bh1"),
    pytest.param((8, 8, 8, 0.7, 1024, 64), 8, "resident", id="64-byte-rows-bh8"),
    pytest.param((8, 8, 8, 0.7, 1024, 32), 8, "resident", id="32-byte-rows-bh8"),
    on_resident_grid((8, 8, 2, 0.95, 2048, 64), 1, "gather", "64-byte-rows-quarter-tile-bh1"),
    on_resident_grid((8, 8, 2, 0.8, 2048, 64), 1, "resident", "64-byte-rows-many-gathers-bh1"),
    pytest.param((8, 4, 8, 0.7, 1024, 256), 8, "resident", id="4-bit-b-128-byte-rows-bh8"),
    pytest.param((16, 4, 4, 0.85, 1024, 256), 8, "resident", id="16-bit-a-v4-long-rows-bh8"),
    pytest.param((16, 4, 4, 0.95, 1024, 256), 16, "gather", id="16-bit-a-v4-short-rows-bh16"),
    pytest.param((8, 4, 4, 0.8, 768, 192), 8, "resident", id="8-bit-a-v4-long-rows-bh8"),
    pytest.param((4, 4, 4, 0.8, 768, 192), 8, "resident", id="4-bit-a-v4-long-rows-bh8"),
    pytest.param((8, 4, 4, 0.8, 640, 224), 16, "gather", id="8-bit-a-v4-112-byte-rows-bh16"),
    on_resident_grid((8, 4, 4, 0.8, 640, 160), 24, "resident", "8-bit-a-v4-4-warp-ctas-bh24"),
    on_resident_grid((8, 8, 4, 0.75, 512, 96), 24, "resident", "8-bit-b-96-byte-rows-4-warp-ctas-bh24"),
    pytest.param((16, 8, 8, 0.7, 4096, 96), 1, "resident", id="8-bit-b-96-byte-rows-dense-a-bh1"),
    pytest.param((16, 8, 4, 0.85, 1536, 96), 3, "resident", id="8-bit-b-96-byte-rows-bh3"),
    pytest.param((8, 8, 4, 0.85, 3072, 96), 1, "gather", id="8-bit-b-96-byte-rows-sparse-a-bh1"),
    pytest.param((16, 4, 4, 0.85, 1536, 192), 3, "resident", id="4-bit-b-96-byte-rows-bh3"),
    pytest.param((8, 4, 4, 0.85, 3072, 192), 1, "gather", id="4-bit-b-96-byte-rows-sparse-a-bh1"),
    on_resident_grid((8, 4, 4, 0.8, 704, 224), 12, "resident", "4-bit-b-112-byte-long-rows-4-warp-ctas-bh12"),
    pytest.param((8, 8, 8, 0.75, 768, 128), 24, "gather", id="8-bit-b-128-byte-rows-bh24"),
    on_resident_grid((4, 4, 2, 0.85, 1536, 128), 1, "resident", "4-bit-b-64-byte-rows-busy-warps-bh1"),
    on_resident_grid((8, 4, 2, 0.85, 1536, 128), 1, "gather", "8-bit-a-64-byte-rows-busy-warps-bh1"),
    on_resident_grid((4, 4, 2, 0.96, 1536, 128), 1, "gather", "4-bit-b-64-byte-rows-busy-warps-few-gathers-bh1"),
    on_resident_grid((16, 4, 2, 0.85, 1408, 128), 1, "gather", "16-bit-a-64-byte-rows-busy-warps-one-wave-bh1"),
    on_resident_grid((16, 4, 2, 0.9, 2048, 128), 1, "resident", "16-bit-a-64-byte-rows-busy-warps-tail-bh1"),
    on_resident_grid((4, 4, 2, 0.9, 1024, 128), 1, "gather", "4-bit-b-64-byte-rows-few-warps-bh1"),
    pytest.param((8, 8, 8, 0.6, 3072, 48), 1, "resident", id="8-bit-b-48-byte-long-rows-bh1"),
    pytest.param((8, 8, 4, 0.98, 4608, 48), 1, "gather", id="8-bit-b-48-byte-short-rows-bh1"),
    pytest.param((8, 4, 8, 0.8, 2048, 96), 4, "resident", id="4-bit-b-48-byte-long-rows-bh4"),
    pytest.param((8, 4, 4, 0.98, 896, 96), 8, "gather", id="4-bit-b-48-byte-short-rows-bh8"),
    resident_or_dense((16, 8, 2, 0.6, 2048, 64), 1, "resident", "resident-before-dense-bh1"),
    resident_or_dense((16, 4, 2, 0.6, 2048, 64), 4, "resident", "resident-before-dense-4-bit-b-bh4"),
    resident_or_dense((8, 8, 2, 0.5, 4096, 64), 1, "dense", "dense-before-resident-bh1"),
    resident_or_dense((16, 4, 2, 0.6, 2048, 96), 4, "dense", "dense-before-resident-4-bit-b-bh4"),
    resident_or_dense((16, 8, 4, 0.7, 3072, 96), 4, "resident", "resident-before-dense-96-byte-rows-bh4"),
    resident_or_dense((16, 8, 2, 0.9, 3072, 128), 4, "resident", "resident-before-dense-128-byte-rows-bh4"),
    resident_or_dense((8, 8, 2, 0.7, 2048, 112), 4, "dense", "dense-before-resident-112-byte-rows-bh4"),
    resident_or_dense((8, 4, 2, 0.6, 2048, 256), 4, "dense", "dense-before-resident-4-bit-b-128-byte-rows-bh4"),
    resident_or_dense((16, 8, 4, 0.7, 4096, 96), 2, "resident", "resident-before-dense-96-byte-rows-bh2"),
    resident_or_dense((8, 8, 4, 0.8, 4096, 96), 2, "resident", "resident-before-dense-8-bit-a-96-byte-rows-bh2"),
    resident_or_dense((16, 8, 4, 0.7, 4096, 96), 3, "resident", "resident-before-dense-96-byte-rows-bh3"),
    resident_or_dense((8, 8, 8, 0.7, 4096, 128), 3, "resident", "resident-before-dense-128-byte-rows-bh3"),
    resident_or_dense((4, 4, 8, 0.7, 4096, 256), 3, "resident", "resident-before-dense-4-bit-b-128-byte-rows-bh3"),
    pytest.param((8, 8, 2, 0.9, 1024, 128), 16, "dense", id="dense-first-128-byte-rows-bh16", marks=wgmma_estimate),
    pytest.param((8, 8, 4, 0.5, 1024, 128), 16, "dense", id="dense-first-128-byte-rows-v4-bh16", marks=wgmma_estimate),
    pytest.param((16, 8, 2, 0.7, 1024, 128), 16, "dense", id="dense-first-16-bit-a-bh16", marks=wgmma_estimate),
]


@pytest.mark.parametrize("shape, bh, way", BATCHED_CASES)
def test_automatic_choice_batched(kernels, monkeypatch, shape, bh, way):
    monkeypatch.delenv("MAGICUBE_SPMM_KERNEL", raising=False)
    call, reference = _problem(*shape, bh=bh)
    assert torch.equal(call(), reference)
    assert _ways_run(call=call) == {way}


@pytest.mark.parametrize("way", ["gather", "resident", "dense"])
def test_forced_way_runs(kernels, monkeypatch, way):
    """MAGICUBE_SPMM_KERNEL runs the way it names, whatever the automatic choice would take (here
    the gather kernel)."""
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", way)
    assert _ways_run(8, 8, 8, 0.9, 2048, 64) == {way}


# (a_bits, b_bits, V, sparsity, M = K, N, False where A is unsigned, MAGICUBE_SPMM_KERNEL, the V at
# which the gather kernel stacks A's planes, 0 where it does not): by default 16-bit A at V 2 where
# rows average two blocks or more (here 4) and the grid holds four CTAs an SM or more (1024 here, on
# GPUs of up to 256 SMs), not on 8-bit B's narrow tile (rows of 65-128 bytes) nor on the quarter
# tile (rows of at most 64 bytes of 8- and 4-bit B; here 15.5 KB of gathers an SM with 4-bit B,
# under the resident kernel's 20, and 31.8 with 8-bit B, under 60), nor on rows of one block
# (sparsity 0.99; M = K = 2044, not a multiple of 8, so that no rows merge) but with 16-bit B, whose
# two-MMA form takes the 1022 CTAs in more than one wave, nor on a grid of 384 CTAs (under four an
# SM on GPUs of over 96 SMs; on grids of at most two an SM 8-bit B's rows take the narrow tile,
# where nothing stacks: `launch`); and 12-bit A and unsigned 16-bit A at V 4 where the grid holds
# ten or more (2048 here, on GPUs of up to 204 SMs) or where the stacked form's occupancy runs it in
# fewer waves (12-bit A with 4-bit B: six CTAs an SM against four; 640 CTAs, one wave against two on
# GPUs of 107-159 SMs; not 896, two waves either way on 112-149 SMs, nor 384), never signed 16-bit A
# at V 4. `stacked` stacks wherever it can, `gather` never does.
STACK_CASES = {
    "L16-R8-wide": (16, 8, 2, 0.95, 2048, 256, "auto", 2),
    "L16-R16": (16, 16, 2, 0.95, 2048, 128, "auto", 2),
    "L16-R4": (16, 4, 2, 0.95, 2048, 256, "auto", 2),
    "L16-R8-narrow": (16, 8, 2, 0.95, 2048, 128, "auto", 0),
    "L16-R8-v4": (16, 8, 4, 0.98, 4096, 512, "auto", 0),
    "L16-R4-v4-stacked": (16, 4, 4, 0.95, 2048, 256, "stacked", 0),
    "L16u-R8-v4": (16, 8, 4, 0.98, 4096, 512, False, "auto", 4),
    "L16u-R16-v4": (16, 16, 4, 0.98, 4096, 256, False, "auto", 4),
    "L16u-R4-v4": (16, 4, 4, 0.98, 4096, 512, False, "auto", 4),
    "L16u-R8-v4-few-ctas": (16, 8, 4, 0.95, 1536, 256, False, "auto", 0),
    "L16u-R8-v4-stacked": (16, 8, 4, 0.95, 2048, 256, False, "stacked", 4),
    "L16u-R8-v4-narrow-stacked": (16, 8, 4, 0.95, 2048, 128, False, "stacked", 0),
    "L12-R4-v4": (12, 4, 4, 0.98, 4096, 512, "auto", 4),
    "L12-R4-v4-few-ctas": (12, 4, 4, 0.95, 1536, 256, "auto", 0),
    "L12-R4-v4-fewer-waves": (12, 4, 4, 0.95, 2560, 256, "auto", 4),
    "L12-R4-v4-two-waves-either-way": (12, 4, 4, 0.95, 3584, 256, "auto", 0),
    "L12-R4-v4-gather": (12, 4, 4, 0.95, 2048, 256, "gather", 0),
    "L12-R4-v8-stacked": (12, 4, 8, 0.95, 2048, 256, "stacked", 0),
    "L16-R8-one-block-rows": (16, 8, 2, 0.99, 2044, 256, "auto", 0),
    "L16-R16-one-block-rows": (16, 16, 2, 0.99, 2044, 128, "auto", 2),
    "L16-R8-few-ctas": (16, 8, 2, 0.9, 768, 256, "auto", 0),
    "L16-R8-few-ctas-stacked": (16, 8, 2, 0.9, 768, 256, "stacked", 2),
    "L16-R8-wide-gather": (16, 8, 2, 0.95, 2048, 256, "gather", 0),
    "L16-R4-quarter-tile": (16, 4, 2, 0.95, 2048, 64, "auto", 0),
    "L16-R4-quarter-tile-stacked": (16, 4, 2, 0.95, 2048, 64, "stacked", 2),
    "L16-R8-quarter-tile": (16, 8, 2, 0.95, 2048, 64, "auto", 0),
    "L16-R8-quarter-tile-stacked": (16, 8, 2, 0.95, 2048, 64, "stacked", 2),
}


@pytest.mark.parametrize("case", STACK_CASES.values(), ids=STACK_CASES.keys())
def test_stacked_planes(kernels, monkeypatch, case):
    """The gather kernel runs, and its instance (the last template argument, STACK) is the one the
    case names."""
    *shape, way, stack = case
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", way)
    instance = _gather_instance(*shape)
    assert (instance["STACK"], instance["MERGE"]) == (str(stack), "false")


# (a_bits, b_bits, V, sparsity, M = K, N, the gather kernel's tile TB in bytes): rows of at most 64
# bytes of 8- and 4-bit B take the quarter tile (on_tile), rows of 65-128 bytes the narrow one;
# 8-bit B's rows of 256 bytes the wide one (4-bit B's tile is 128 bytes at most). Rows whose last
# tile would be at most half full take the tile of half the width: 8- and 16-bit B's rows of
# 257-384 and 513-640 bytes the narrow tile, 4-bit B's of 129-192 bytes the quarter tile (not under
# 4-bit A); not rows whose last tile is fuller (448 bytes) or of more tiles (896 bytes; 4-bit B's
# 320). Rows not on 16 bytes take the tile of their padded width (spmm_cuda pads them). 8- and 4-bit
# B's rows of whole tiles take half the tile where the grid on the whole one holds at most 2.5 CTAs
# an SM for 8-bit A and B, 2 for 4-bit B under 4- and 8-bit A, 1.5 for 12- and 16-bit A (2 on rows
# of A of at most two blocks; `launch`): 128 CTAs here, on GPUs of 64 SMs or more; on GPUs of
# 116-149 SMs (`half_tile_grid`), L8-R8 on 288 CTAs and L16-R8 on 224 CTAs of rows of two blocks
# take half the tile, L16-R8 on 224 CTAs of rows of 17 blocks the whole one; the other cases of
# such rows hold 384, or 512 at BH 4, past the bounds on GPUs of up to 153 SMs. Not rows of part
# tiles (448 bytes).
half_tile_grid = pytest.mark.skipif(not 116 <= sms <= 149, reason="the cases' grids sit about the half-tile "
                                    "bounds on 116-149 SMs")
TILE_CASES = {
    "L8-R4-64-byte-rows": (8, 4, 8, 0.9, 1024, 128, 64),
    "L16-R4-32-byte-rows": (16, 4, 4, 0.9, 1024, 64, 64),
    "L4-R4-128-byte-rows": (4, 4, 8, 0.9, 3072, 256, 128),
    "L4-R4-128-byte-rows-small-grid": (4, 4, 8, 0.9, 1024, 256, 64),
    "L8-R4-256-byte-rows-small-grid": (8, 4, 8, 0.9, 512, 512, 64),
    "L8-R8-64-byte-rows": (8, 8, 8, 0.9, 1024, 64, 64),
    "L16-R8-48-byte-rows": (16, 8, 4, 0.9, 1024, 48, 64),
    "L8-R8-128-byte-rows": (8, 8, 8, 0.9, 1024, 128, 128),
    "L8-R8-256-byte-rows": (8, 8, 8, 0.9, 3072, 256, 256),
    "L8-R8-256-byte-rows-small-grid": (8, 8, 8, 0.9, 1024, 256, 128),
    "L8-R8-256-byte-rows-small-grid-bh4": (8, 8, 8, 0.9, 1024, 256, True, torch.int64, 4, 256),
    "L8-R8-256-byte-rows-288-ctas": pytest.param((8, 8, 8, 0.9, 2304, 256, 128), marks=half_tile_grid),
    "L16-R8-256-byte-rows-224-ctas-long-rows": pytest.param((16, 8, 8, 0.7, 1792, 256, 256), marks=half_tile_grid),
    "L16-R8-256-byte-rows-224-ctas-short-rows": pytest.param((16, 8, 8, 0.98, 1792, 256, 128), marks=half_tile_grid),
    "L16-R8-512-byte-rows-small-grid": (16, 8, 4, 0.9, 256, 512, 128),
    "L8-R8-40-byte-rows": (8, 8, 8, 0.9, 1024, 40, 64),
    "L16-R8-120-byte-rows": (16, 8, 4, 0.9, 1024, 120, 128),
    "L8-R4-50-byte-rows": (8, 4, 8, 0.9, 1024, 100, 64),
    "L16-R16-200-byte-rows": (16, 16, 8, 0.9, 1024, 100, 256),
    "L8-R8-384-byte-rows": (8, 8, 8, 0.9, 1024, 384, 128),
    "L16-R8-288-byte-rows": (16, 8, 4, 0.9, 1024, 288, 128),
    "L8-R8-640-byte-rows": (8, 8, 2, 0.9, 1024, 640, 128),
    "L16-R16-384-byte-rows": (16, 16, 8, 0.9, 1024, 192, 128),
    "L8-R8-448-byte-rows": (8, 8, 8, 0.9, 1024, 448, 256),
    "L8-R8-896-byte-rows": (8, 8, 8, 0.9, 1024, 896, 256),
    "L8-R4-192-byte-rows": (8, 4, 8, 0.9, 1024, 384, 64),
    "L16-R4-136-byte-rows": (16, 4, 2, 0.9, 1024, 272, 64),
    "L4-R4-192-byte-rows": (4, 4, 8, 0.9, 1024, 384, 128),
    "L8-R4-320-byte-rows": (8, 4, 8, 0.9, 1024, 640, 128),
}


@pytest.mark.parametrize("case", TILE_CASES.values(), ids=TILE_CASES.keys())
def test_gather_tile(kernels, monkeypatch, case):
    """The gather kernel runs exactly, on the tile (its fifth template argument, TB) the case names."""
    *shape, tile = case
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "gather")
    call, reference = _problem(*shape)
    assert torch.equal(call(), reference)
    assert _gather_instance(*shape)["TB"] == str(tile)


# The resident-B kernel's CTAs: 16 warps, or 4 (four an SM) where one wave of 16-warp CTAs would give
# its warps more rows (launch_resident). Rows of 96 bytes (three 32-byte slices) of 8- and 4-bit B, 88
# vector rows: at BH 24, 72 (slice, batch x head) pairs, which one 16-warp CTA an SM covers once (16
# warps a pair, 6 rows a warp), 4-warp CTAs six times or more (24 warps or more, 4 rows or fewer); at
# BH 1, 3 pairs, which 16-warp CTAs already split to a row a warp.
@resident_grid
@pytest.mark.parametrize("a_bits, b_bits, v", [(8, 8, 8), (16, 8, 4), (8, 4, 4), (4, 4, 8)],
                         ids=["L8-R8-v8", "L16-R8-v4", "L8-R4-v4", "L4-R4-v8"])
@pytest.mark.parametrize("bh, warps", [(24, 4), (1, 16)], ids=["bh24", "bh1"])
def test_resident_cta_warps(kernels, monkeypatch, a_bits, b_bits, v, bh, warps):
    """The resident kernel runs exactly, its instance's last template argument (WARPS) the case's."""
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "resident")
    call, reference = _problem(a_bits, b_bits, v, 0.8, 88 * v, 96 * 8 // b_bits, bh=bh)
    assert torch.equal(call(), reference)
    names = [name for name in _kernels_run(call=call) if WAY_KERNELS["resident"] in name]
    assert len(names) == 1, names
    assert _template_args(names[0], "resident")[-1] == str(warps)


# (a_bits, b_bits, V, sparsity, M = K, N[, A signed, output dtype], MAGICUBE_SPMM_KERNEL, whether
# the gather kernel merges V 2 rows four at a time): by default on rows of B of 128 bytes or more
# (4-bit B: fp16 output only, and rows of 96 bytes, except under 8-bit A), rows of A of at most four
# blocks on the mean and three merged CTAs an SM or more (512 here, on GPUs of up to 170 SMs), not
# on rows of seven blocks (M = K = 4096, sparsity 0.95) nor on a grid of 256 CTAs; rows of at most
# two blocks from 7/4 CTAs an SM (256 here: GPUs of up to 146 SMs; 384 on rows of 96 bytes: up to
# 219), but not on 128 CTAs (GPUs of 74 SMs or more) nor on 8-bit B's narrow tile; rows of four
# blocks from 21/8 CTAs an SM on the wide tile and with 4-bit B under 12- and 16-bit A (384 here: up
# to 146 SMs); `merged` merges wherever M is a multiple of 8, `gather` never.
MERGE_CASES = {
    "L8-R8": (8, 8, 2, 0.98, 4096, 256, "auto", True),
    "L16-R4-fp16": (16, 4, 2, 0.98, 4096, 256, True, torch.float16, "auto", True),
    "L16-R4-int64": (16, 4, 2, 0.98, 4096, 256, True, torch.int64, "auto", False),
    "L16-R16-two-tiles": (16, 16, 2, 0.95, 2048, 256, "auto", True),
    "L16-R16-narrow-rows": (16, 16, 2, 0.98, 4096, 64, "auto", True),
    "L16-R16-rows-of-64-bytes": (16, 16, 2, 0.98, 4096, 32, "auto", False),
    "L16-R8-long-rows": (16, 8, 2, 0.95, 4096, 256, "auto", False),
    # Merged rows run before the resident kernel, which pays here too (launch_integer).
    "L8-R4-fp16-before-resident": (8, 4, 2, 0.98, 2048, 512, True, torch.float16, "auto", True),
    "L8-R8-before-resident": (8, 8, 2, 0.975, 4096, 128, "auto", True),
    "L16-R8-few-ctas": (16, 8, 2, 0.95, 2048, 256, "auto", False),
    "L16-R8-short-rows": pytest.param((16, 8, 2, 0.98, 2048, 256, "auto", True), marks=merged_grid),
    "L16-R8-short-rows-128-ctas": (16, 8, 2, 0.98, 1024, 256, "auto", False),
    "L8-R8-short-rows-narrow-tile": (8, 8, 2, 0.98, 2048, 128, "auto", False),
    "L16-R4-fp16-rows-of-96-bytes": (16, 4, 2, 0.985, 3072, 192, True, torch.float16, "auto", True),
    "L16-R8-four-blocks": pytest.param((16, 8, 2, 0.96, 3072, 256, "auto", True), marks=merged_grid),
    # 4-bit B's rows of 160 bytes (the last narrow tile a quarter full) under rows of A of two blocks
    # (768 merged CTAs: GPUs of up to 256 SMs).
    "L4-R4-fp16-rows-of-160-bytes-two-blocks": (4, 4, 2, 0.98, 3072, 320, True, torch.float16, "auto", True),
    "L8-R8-merged": (8, 8, 2, 0.9, 1024, 64, "merged", True),
    "L8-R8-merged-m-not-multiple-of-8": (8, 8, 2, 0.9, 1004, 64, "merged", False),
    "L8-R8-gather": (8, 8, 2, 0.98, 4096, 256, "gather", False),
}


@pytest.mark.parametrize("case", MERGE_CASES.values(), ids=MERGE_CASES.keys())
def test_merged_rows(kernels, monkeypatch, case):
    """The gather kernel runs, merging V 2 rows (its last template argument, MERGE, and then its
    planes not stacked) where the case says."""
    *shape, way, merged = case
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", way)
    instance = _gather_instance(*shape)
    assert instance["MERGE"] == str(merged).lower() and (instance["STACK"] == "0" or not merged)


# (a_bits, b_bits, V, sparsity, M = K, N[, A signed, output dtype]) where V 2 rows do not merge,
# whichever way runs instead (launch_merged): 8-bit B's rows of 96 bytes and 4-bit B's under 8-bit
# A; rows of four blocks on 384 merged CTAs (under three an SM on GPUs of over 128 SMs) on 16-bit
# B's narrow tile and with 4-bit B under 8-bit A; 4-bit B's rows of 129-192 bytes under rows of A of
# three and four blocks (on 768 merged CTAs, which would pay).
over_three_an_sm = pytest.mark.skipif(not sms > 128, reason="384 merged CTAs are three an SM on up to 128 SMs")
UNMERGED_CASES = {
    "L8-R8-rows-of-96-bytes": (8, 8, 2, 0.985, 3072, 96),
    "L8-R4-fp16-rows-of-96-bytes": (8, 4, 2, 0.985, 3072, 192, True, torch.float16),
    "L16-R16-four-blocks-narrow-tile": pytest.param((16, 16, 2, 0.96, 3072, 64), marks=over_three_an_sm),
    "L8-R4-fp16-four-blocks": pytest.param((8, 4, 2, 0.96, 3072, 256, True, torch.float16), marks=over_three_an_sm),
    "L4-R4-fp16-rows-of-160-bytes-three-blocks": (4, 4, 2, 0.97, 3072, 320, True, torch.float16),
    "L16-R4-fp16-rows-of-192-bytes-four-blocks": (16, 4, 2, 0.96, 3072, 384, True, torch.float16),
}


@pytest.mark.parametrize("shape", UNMERGED_CASES.values(), ids=UNMERGED_CASES.keys())
def test_merged_rows_left_out(kernels, shape):
    """No gather kernel that the call launched merges rows (its MERGE argument)."""
    names = _kernels_run(*shape)
    merges = [_gather_args(name)["MERGE"] == "true" for name in names if WAY_KERNELS["gather"] in name]
    assert names and not any(merges), names


# (a_bits, b_bits, V, sparsity, M = K, N[, A signed], the gather kernel's ring of slots for two
# blocks a step, 0 for one block a step): the integer kinds where rows average two blocks or more,
# on either tile and past one wave, but not on rows of one block nor with 4-bit B under 4-bit A,
# nor where the paired kernel's grid takes more waves than the one-block kernel's; five slots for
# 8-bit A and B and 16-bit A and B on the wide tile in one wave (rows of 87 blocks among them,
# past the 54 and 44 blocks whose indices that ring stages); 4-bit B under 8-bit A four slots on
# rows of more than three blocks in one wave (384 CTAs), not past it (1024) nor on rows of three
# blocks. The cases of 8- and 4-bit B's rows of whole tiles at V 8 hold 384 CTAs, past the bounds
# under which those rows take half the tile (`launch`) on GPUs of up to 153 SMs. The cases of
# L8-R8's and L16-R16's narrow tile past one wave are sized by the SM count (V 2 rows there make
# M / 2 CTAs), from the CTAs an SM that ptxas gives their kernels (sm_90a): L8-R8 10 one-block and 8
# paired, L16-R16 8 and 8. Past one wave: 15.5 CTAs an SM, two waves of either kernel; between
# L8-R8's waves: 9 CTAs an SM, one wave of the one-block kernel only; L16-R16 at 7.5 CTAs an SM,
# one wave of either, pairs.
PAIR_CASES = {
    "L8-R8": (8, 8, 8, 0.9, 2048, 128, 4),
    "L8u-R8-n64": (8, 8, 8, 0.9, 2048, 64, False, 4),
    "L8-R8-past-one-wave": (8, 8, 2, 0.9, 31 * sms, 128, 4),
    "L8-R8-between-the-waves": (8, 8, 2, 0.9, 18 * sms, 128, 0),
    "L8-R8-rows-of-one-block": (8, 8, 8, 0.98, 1024, 128, 0),
    "L8-R8-wide-tile": (8, 8, 8, 0.9, 3072, 256, 5),
    "L8-R8-wide-tile-long-rows": (8, 8, 8, 0.1, 3072, 256, 5),
    "L8-R8-wide-tile-past-one-wave": (8, 8, 2, 0.9, 4096, 256, 4),
    "L16-R8": (16, 8, 8, 0.9, 2048, 128, 4),
    "L16-R8-wide-tile": (16, 8, 8, 0.9, 3072, 256, 4),
    "L16-R16-two-wide-tiles": (16, 16, 8, 0.9, 1024, 256, 5),
    "L16-R16-wide-tile-long-rows": (16, 16, 8, 0.1, 2048, 128, 5),
    "L16-R16-narrow-tile-one-wave": (16, 16, 2, 0.9, 15 * sms, 64, 4),
    "L16-R4": (16, 4, 8, 0.9, 3072, 256, 4),
    "L12-R4": (12, 4, 8, 0.9, 3072, 256, 4),
    "L8-R4": (8, 4, 8, 0.9, 3072, 256, 4),
    "L8u-R4": (8, 4, 8, 0.9, 3072, 256, False, 4),
    "L8-R4-past-one-wave": (8, 4, 2, 0.9, 2048, 256, 0),
    "L8-R4-rows-of-three-blocks": (8, 4, 8, 0.98, 4096, 256, 0),
    "L4-R4": (4, 4, 8, 0.9, 3072, 256, 0),
}


@pytest.mark.parametrize("case", PAIR_CASES.values(), ids=PAIR_CASES.keys())
def test_paired_steps(kernels, monkeypatch, case):
    """The gather kernel runs exactly, taking two blocks a step over the ring the case says (its
    last template argument, PAIR_RING)."""
    *shape, ring = case
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "gather")
    call, reference = _problem(*shape)
    assert torch.equal(call(), reference)
    assert _gather_instance(*shape)["PAIR_RING"] == str(ring)


# (a_bits, b_bits, V, sparsity, M = K, N, the ways the tuned choice may take): cells where the
# other ways take several times as long, so timing noise cannot flip the choice.
TUNED_CASES = {
    # Each row of B gathered 512 times: the dense path.
    "low-sparsity-dense": (8, 8, 2, 0.5, 2048, 256, {"dense"}),
    # Few gathers, where the dense path would expand all of A: a gather kernel.
    "few-gathers": (16, 8, 8, 0.98, 2048, 256, {"gather", "resident"}),
}


@pytest.mark.parametrize("case", TUNED_CASES.values(), ids=TUNED_CASES.keys())
def test_tuned_choice(kernels, monkeypatch, case):
    """MAGICUBE_SPMM_KERNEL=tuned: the first call times the ways and returns the product; later
    calls run one way, the fastest."""
    *shape, fastest = case
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "tuned")
    call, reference = _problem(*shape)
    assert torch.equal(call(), reference)
    ways = _ways_run(call=call)
    assert len(ways) == 1 and ways <= fastest, ways
    assert torch.equal(call(), reference)


def test_tuned_inside_graph_capture(kernels, monkeypatch):
    """A problem first met inside a CUDA graph capture, where nothing can be timed, takes the
    automatic choice there; its first call outside is tuned."""
    shape = (8, 8, 4, 0.9, 1024, 96)  # met nowhere else in the session
    call, reference = _problem(*shape)
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "auto")
    call()  # the kernels' attributes are set outside the capture
    torch.cuda.synchronize()
    monkeypatch.setenv("MAGICUBE_SPMM_KERNEL", "tuned")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference)
    assert torch.equal(call(), reference)
    assert len(_ways_run(call=call)) == 1
