"""SpMM kernel benchmark: every precision of the SR-BCRS kernels against dense and sparse baselines.

    python -m magicube.eval.bench_spmm [--quick | --off-grid] [--kernel auto|tuned] [--ways] [--out DIR]

Sweeps sparsity, vector length V, N and M = K; times each kernel (fp16 output, dequantization
fused) with CUDA events after warm-up (back-to-back calls replayed from a CUDA graph, L2 warm)
and reports medians, effective TOPS (2*M*N*K*density / t, density = the kept fraction of the
mask), speedups over cuBLAS fp16 (`torch.matmul`) of the same dense shape (timed again beside
every case) and, for the project's kernels, the effective gather rate: the bytes of the B rows
that the kept vectors use (one row of N values per kept vector), over t. The gather kernel moves
about those bytes from L2, which bounds it (`eval/results/kernel_checks.md`, "What bounds the
two open speed targets"). Baselines in the same run: cuBLAS fp16, `torch._int_mm` int8, the
project's fp16 SR-BCRS kernel and cuSPARSE fp16 CSR SpMM (`to_sparse_csr() @ dense`). Then the
attention pipeline's P x V (32 batch x heads, M = K = 4096, N = 64), the narrow product the
resident-B kernel serves, with each SpMM kernel forced and with the automatic and tuned choices,
against cuBLAS fp16 bmm. The integer SpMM picks its way by its rules' estimates, or with `--kernel
tuned` by timing the ways at each problem's first call (MAGICUBE_SPMM_KERNEL=tuned). With `--ways`
every integer cell also times each way forced (`ways_of`) and checks that their outputs agree bit
for bit: the summary then says, per pair, how much more time the choice took than the fastest way
(the check of the rules' estimates on the GPU at hand). `--off-grid` times the cells beside the
sweep's grid instead (OFF_GRID), where the rules were not fitted. Writes
spmm[_quick|_offgrid][_tuned][_ways]_<device>.json and a plot of speedup over cuBLAS against
sparsity (one panel per V).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

from magicube.eval.timing import cuda_time, device_slug, environment, kernel_bench_args, save_json
from magicube.ops import SRBCRS, extension, random_vector_mask, to_container

PAIRS = [(8, 8), (4, 4), (16, 8), (16, 16), (8, 4), (16, 4), (12, 4)]
FULL = dict(sparsity=[0.5, 0.7, 0.8, 0.9, 0.95, 0.98], v=[2, 4, 8], n=[128, 256, 512], mk=[512, 1024, 2048, 4096])
QUICK = dict(sparsity=[0.7, 0.9, 0.98], v=[2, 8], n=[128, 256], mk=[1024, 4096])
# Cells beside FULL's grid (M = K and sparsity between its values, N 96-384, V 2 and 4): the rules'
# thresholds were fitted on FULL's cells, and on these, timed with every way forced, the choice took
# 1.4-7.6 % more time than the fastest way per pair, against 0.2-1.1 % on FULL's (H200, cd83177;
# `kernel_checks.md`, sixty-fourth round).
OFF_GRID = dict(sparsity=[0.93, 0.96, 0.985], v=[2, 4], n=[96, 128, 192, 256, 384], mk=[768, 1536, 3072])
INNER = 20
TARGET = dict(pair="L8-R8", v=8, sparsity=0.9, mk=4096, n=256)
# The attention pipeline's P x V (B 8 x H 4, L 4096, head dim 64), where B is narrow and the
# resident-B kernel serves: timed with each kernel forced and with the automatic and tuned choices.
PV = dict(bh=32, mk=4096, n=64, v=8, sparsity=[0.9, 0.95], pairs=[(8, 8), (16, 8), (8, 4)])
KERNEL_CHOICES = ("gather", "resident", "dense", "auto", "tuned")


def gathered_bytes(kernel: str, m: int, k: int, n: int, v: int, density: float) -> float | None:
    """Bytes of the B rows that the kept vectors of an M x K mask use, one row of N values of
    the kernel's B width per kept vector; None for kernels outside the SR-BCRS family."""
    if kernel == "sparse_fp16":
        b_bits = 16
    elif kernel.startswith("L") and "-R" in kernel:
        b_bits = int(kernel.split("-R")[1])
    else:
        return None
    return m * k * density / v * n * b_bits / 8


def ways_of(a_bits: int, b_bits: int, v: int) -> list[str]:
    """The ways MAGICUBE_SPMM_KERNEL can force on an integer pair of the sweep (signed A) at V v: the
    gather kernel, its stacked form (12- and 16-bit A at V 2, 12-bit A at V 4; unsigned 16-bit A
    would stack at V 4 too), its merged form (V 2 rows four at a time), the resident-B kernel (8-
    and 4-bit B) and the dense path. Where a forced way does not apply to a problem (the resident
    kernel's slice of B past shared memory, products past int32 on the dense path, stacking on
    8-bit B's narrow tile, merging where M is not a multiple of 8) the op runs the gather kernel
    instead."""
    ways = ["gather"]
    if (a_bits >= 12 and v == 2) or (a_bits == 12 and v == 4):
        ways.append("stacked")
    if v == 2:
        ways.append("merged")
    if b_bits != 16:
        ways.append("resident")
    return ways + ["dense"]


def _time_ways(spmm, a_bits: int, b_bits: int, v: int, reps: int) -> dict:
    """Each way of `ways_of` forced on `spmm`: its time (ms) and whether every way's output equals
    the one the current choice gives."""
    saved = os.environ.get("MAGICUBE_SPMM_KERNEL")
    chosen = spmm()
    times, equal = {}, True
    try:
        for way in ways_of(a_bits, b_bits, v):
            os.environ["MAGICUBE_SPMM_KERNEL"] = way
            equal &= torch.equal(spmm(), chosen)
            times[way] = _time(spmm, reps)
    finally:
        _restore_kernel(saved)
    return dict(ways=times, ways_equal=equal)


def _time(fn, reps, graph=True):
    """Median time (ms) of one fn() call.

    A single kernel here takes a few microseconds, less than the host needs to launch it from
    Python, so per-call events would time the launch path: INNER back-to-back calls are
    replayed from a CUDA graph (or, where a library cannot be captured, issued back to back).
    """
    return cuda_time(fn, warmup=3, reps=reps, calls=INNER if graph else max(2, INNER // 4), graph=graph)["median_ms"]


def _quantized_spmm(cp, emask, bh: int, n: int, ab: int, bb: int, g):
    """A call of the integer SpMM on random operands of the pattern cp (on the GPU), A of ab bits
    masked by emask (M x K), B (BH x K x N) of bb bits, fp16 output."""
    m, k, dev = cp.m, cp.k, emask.device
    qa = torch.randint(-(1 << (ab - 1)), 1 << (ab - 1), (bh, m, k), device=dev, dtype=torch.int32, generator=g)
    av = to_container(cp.pack_values(qa * emask), ab)
    del qa
    qb = torch.randint(-(1 << (bb - 1)), 1 << (bb - 1), (bh, k, n), device=dev, dtype=torch.int32, generator=g)
    bv = to_container(qb, bb)
    sa = torch.full((bh, m), 1e-3, device=dev)
    sb = torch.full((bh, n), 1e-3, device=dev)
    return lambda: torch.ops.magicube_cuda.spmm(cp.row_ptr, cp.col_idx, cp.row_order, av, bv, sa, sb, cp.v, m, ab,
                                                True, bb, torch.float16, cp.longest_row)


def run(cfg, reps: int, log=print, checkpoint=None, ways: bool = False):
    """Time every kernel over the sweep (with `ways`, each integer pair's ways forced as well);
    `checkpoint(records)` after each size (largest first)."""
    ops = torch.ops.magicube_cuda
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    records = []
    for mk in sorted(cfg["mk"], reverse=True):
        m = k = mk
        dense = {}
        for n in cfg["n"]:
            a16 = torch.randn(m, k, device=dev, generator=g).half()
            b16 = torch.randn(k, n, device=dev, generator=g).half()
            dense_ms = _time(lambda: torch.matmul(a16, b16), reps)
            a8 = torch.randint(-128, 128, (m, k), device=dev, dtype=torch.int8, generator=g)
            # B column-major, the layout cuBLASLt's int8 tensor-core GEMM takes: a row-major B sends
            # torch._int_mm to a far slower kernel, which would flatter every sparse kernel here.
            b8 = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8, generator=g).t()
            int_mm_ms = _time(lambda: torch._int_mm(a8, b8), reps)
            base = dict(m=m, k=k, n=n)
            records.append(dict(base, kernel="cublas_fp16", ms=dense_ms, tops=2 * m * n * k / dense_ms / 1e9,
                                speedup=1.0))
            records.append(dict(base, kernel="int_mm_int8", ms=int_mm_ms, tops=2 * m * n * k / int_mm_ms / 1e9,
                                speedup=dense_ms / int_mm_ms))
            dense[n] = (a16, b16)
            log(f"M=K={mk} N={n}: cuBLAS fp16 {dense_ms * 1e3:.1f} us, _int_mm {int_mm_ms * 1e3:.1f} us")
        for v in cfg["v"]:
            for sp in cfg["sparsity"]:
                mask = random_vector_mask(m, k, v, sp, seed=int(1000 * sp) + v)
                cp = SRBCRS.from_mask(mask, stride=32).to(dev)
                density = float(mask.mask.float().mean())
                emask = mask.to_dense().to(dev)
                for n in cfg["n"]:
                    a16, b16 = dense[n]
                    # The baseline again, beside the kernels it divides: timed once per (M, N), it moved
                    # between two processes on one H100 by 20 % (M = K = 1024, N 256: 4.45 and 5.30 us),
                    # and every geometric mean with it.
                    dense_ms = _time(lambda: torch.matmul(a16, b16), reps)
                    flops = 2 * m * n * k * density
                    rec = dict(m=m, k=k, n=n, v=v, sparsity=sp, density=density, cublas_fp16_ms=dense_ms)

                    def add(kernel, ms, **extra):
                        gathered = gathered_bytes(kernel, m, k, n, v, density)
                        if gathered is not None:
                            extra["gather_tbs"] = gathered / ms / 1e9
                        records.append(dict(rec, kernel=kernel, ms=ms, tops=flops / ms / 1e9,
                                            speedup=dense_ms / ms, **extra))

                    dense_a = a16 * emask
                    vals16 = cp.pack_values(dense_a)[None]
                    bb16 = b16[None]
                    add("sparse_fp16", _time(lambda: ops.spmm(cp.row_ptr, cp.col_idx, cp.row_order, vals16, bb16,
                                                              None, None, v, m, 16, True, 16, torch.float16,
                                                              cp.longest_row), reps))
                    csr = dense_a.to_sparse_csr()
                    add("cusparse_fp16", _time(lambda: csr @ b16, reps, graph=False))
                    for ab, bb in PAIRS:
                        spmm = _quantized_spmm(cp, emask, 1, n, ab, bb, g)
                        add(f"L{ab}-R{bb}", _time(spmm, reps), **(_time_ways(spmm, ab, bb, v, reps) if ways else {}))
                    row = [r for r in records if r.get("v") == v and r.get("sparsity") == sp and r["m"] == m
                           and r["n"] == n]
                    log(f"  N={n} V={v} s={sp}: " + ", ".join(
                        f"{r['kernel']} {r['ms'] * 1e3:.1f}us ({r['speedup']:.2f}x)" for r in row))
        if checkpoint is not None:
            checkpoint(records)
    return records


def run_pv(reps: int, log=print):
    """The PV product per pair and kernel choice (MAGICUBE_SPMM_KERNEL), against cuBLAS fp16 bmm."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    bh, m, n, v = PV["bh"], PV["mk"], PV["n"], PV["v"]
    k = m
    a16 = torch.randn(bh, m, k, device=dev, dtype=torch.float16, generator=g)
    b16 = torch.randn(bh, k, n, device=dev, dtype=torch.float16, generator=g)
    dense_ms = _time(lambda: torch.bmm(a16, b16), reps)
    base = dict(section="attention_pv", bh=bh, m=m, k=k, n=n, v=v)
    records = [dict(base, kernel="cublas_fp16", ms=dense_ms, speedup=1.0)]
    log(f"P x V, BH={bh} M=K={m} N={n}: cuBLAS fp16 bmm {dense_ms * 1e3:.1f} us")
    saved = os.environ.get("MAGICUBE_SPMM_KERNEL")
    try:
        for sp in PV["sparsity"]:
            mask = random_vector_mask(m, k, v, sp, seed=int(1000 * sp) + v)
            cp = SRBCRS.from_mask(mask, stride=32).to(dev)
            emask = mask.to_dense().to(dev)
            line = []
            for ab, bb in PV["pairs"]:
                spmm = _quantized_spmm(cp, emask, bh, n, ab, bb, g)
                for choice in KERNEL_CHOICES:
                    os.environ["MAGICUBE_SPMM_KERNEL"] = choice
                    ms = _time(spmm, reps)
                    records.append(dict(base, sparsity=sp, kernel=f"L{ab}-R{bb} {choice}", ms=ms,
                                        speedup=dense_ms / ms))
                    line.append(f"L{ab}-R{bb} {choice} {ms * 1e3:.1f}us")
            log(f"  V={v} s={sp}: " + ", ".join(line))
    finally:
        _restore_kernel(saved)
    return records


def _restore_kernel(saved: str | None):
    """MAGICUBE_SPMM_KERNEL as it was (`saved`, None where unset)."""
    if saved is None:
        os.environ.pop("MAGICUBE_SPMM_KERNEL", None)
    else:
        os.environ["MAGICUBE_SPMM_KERNEL"] = saved


def summarize(records):
    out = {}
    sparse = [r for r in records if "v" in r and "section" not in r]
    kernels = sorted({r["kernel"] for r in sparse})
    geo = {}
    for kern in kernels:
        xs = [r["speedup"] for r in sparse if r["kernel"] == kern and r["sparsity"] >= 0.7]
        if xs:
            geo[kern] = statistics.geometric_mean(xs)
    out["geomean_speedup_vs_cublas_fp16_sparsity_ge_0.7"] = geo
    t = [r for r in sparse if r["v"] == TARGET["v"] and r["sparsity"] == TARGET["sparsity"]
         and r["m"] == TARGET["mk"] and r["n"] == TARGET["n"]]
    if t:
        by = {r["kernel"]: r for r in t}
        tgt = by.get(TARGET["pair"])
        if tgt:
            out["target"] = dict(TARGET, us=tgt["ms"] * 1e3, speedup_vs_cublas_fp16=tgt["speedup"],
                                 speedup_vs_sparse_fp16=by["sparse_fp16"]["ms"] / tgt["ms"],
                                 cublas_fp16_us=tgt["ms"] * tgt["speedup"] * 1e3,
                                 sparse_fp16_us=by["sparse_fp16"]["ms"] * 1e3,
                                 gathered_mb=gathered_bytes(TARGET["pair"], tgt["m"], tgt["k"], tgt["n"], tgt["v"],
                                                            tgt["density"]) / 1e6,
                                 gather_tbs=tgt.get("gather_tbs"))
    pv = [r for r in records if r.get("section") == "attention_pv" and r.get("sparsity", 0.9) == 0.9]
    if pv:
        out["attention_pv_sparsity_0.9_us"] = {r["kernel"]: r["ms"] * 1e3 for r in pv}
    timed_ways = [r for r in sparse if "ways" in r]
    if timed_ways:
        out["choice_over_fastest_way"] = choice_over_fastest_way(timed_ways)
    return out


def choice_over_fastest_way(records):
    """Per pair, over the cells whose ways were timed (`--ways`): the geometric mean of the choice's
    time over the fastest forced way's, over every cell and at sparsity >= 0.7, the worst cell, and
    the count of cells whose ways' outputs differed (0 unless a kernel is wrong)."""
    out = {}
    for kern in sorted({r["kernel"] for r in records}):
        cells = [r for r in records if r["kernel"] == kern]
        over = [r["ms"] / min(r["ways"].values()) for r in cells]
        worst = max(range(len(cells)), key=over.__getitem__)
        w = cells[worst]
        sparse_cells = [x for x, r in zip(over, cells) if r["sparsity"] >= 0.7]
        out[kern] = dict(geomean=statistics.geometric_mean(over),
                         geomean_sparsity_ge_0_7=statistics.geometric_mean(sparse_cells) if sparse_cells else None,
                         worst=over[worst],
                         worst_cell=dict(m=w["m"], n=w["n"], v=w["v"], sparsity=w["sparsity"], ms=w["ms"],
                                         ways=w["ways"]),
                         unequal_cells=sum(not r["ways_equal"] for r in cells))
    return out


def plot(records, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = [r for r in records if "v" in r and "section" not in r]
    mk = max(r["m"] for r in sparse)
    ns = sorted({r["n"] for r in sparse})
    n = 256 if 256 in ns else ns[0]
    vs = sorted({r["v"] for r in sparse})
    fig, axes = plt.subplots(1, len(vs), figsize=(4.2 * len(vs), 3.6), sharey=True, squeeze=False)
    kernels = [f"L{a}-R{b}" for a, b in PAIRS] + ["sparse_fp16", "cusparse_fp16"]
    for ax, v in zip(axes[0], vs):
        for kern in kernels:
            pts = sorted((r["sparsity"], r["speedup"]) for r in sparse
                         if r["kernel"] == kern and r["v"] == v and r["m"] == mk and r["n"] == n)
            if pts:
                style = "--" if kern in ("sparse_fp16", "cusparse_fp16") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=kern)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("sparsity")
        ax.set_title(f"V={v}, M=K={mk}, N={n}")
    axes[0][0].set_ylabel("speedup over cuBLAS fp16")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    def kernel_arg(ap):
        ap.add_argument("--kernel", choices=("auto", "tuned"), default="auto",
                        help="the integer SpMM's way: by its rules (auto) or timed at a problem's first call (tuned)")
        ap.add_argument("--ways", action="store_true",
                        help="also time each way forced in every integer cell: the choice against the fastest way")
        ap.add_argument("--off-grid", action="store_true",
                        help="time the cells beside the sweep's grid instead (OFF_GRID), where no rule was fitted")

    args = kernel_bench_args("bench_spmm", __doc__, argv, quick="a small subset (the target shape included)",
                             reps=15, reps_help=f"timed replays of {INNER} back-to-back calls", extra=kernel_arg)
    if args is None:
        return 2
    if args.quick and args.off_grid:
        print("bench_spmm: --quick and --off-grid each name the cells to time; give one of them", file=sys.stderr)
        return 2
    extension.load("spmm")
    env = environment()
    cfg = QUICK if args.quick else OFF_GRID if args.off_grid else FULL
    print(f"bench_spmm on {env.get('device')}, torch {env['torch']}, CUDA {env['cuda']}", flush=True)
    out = Path(args.out)
    name = "_".join(["spmm"] + ["quick"] * args.quick + ["offgrid"] * args.off_grid
                    + ["tuned"] * (args.kernel == "tuned") + ["ways"] * args.ways + [device_slug(env)])

    def save(records, complete=False):
        save_json(out / f"{name}.json", dict(environment=env, config=cfg, quick=args.quick, off_grid=args.off_grid,
                                             kernel=args.kernel, ways=args.ways, complete=complete,
                                             timing=f"median of {args.reps} CUDA-graph replays of {INNER} calls",
                                             summary=summarize(records), records=records))

    log = lambda s: print(s, flush=True)  # noqa: E731
    saved = os.environ.get("MAGICUBE_SPMM_KERNEL")
    os.environ["MAGICUBE_SPMM_KERNEL"] = args.kernel
    try:
        records = run(cfg, args.reps, log=log, checkpoint=save, ways=args.ways)
    finally:
        _restore_kernel(saved)
    records += run_pv(args.reps, log=log)
    save(records, complete=True)
    print("summary:", summarize(records))
    plot(records, out / f"{name}.png", f"SR-BCRS SpMM on {env.get('device')} (fp16 output; dashed: fp16 baselines)")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
