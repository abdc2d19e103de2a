"""SDDMM and sparse-softmax kernel benchmark (after Figure 15 of the Magicube paper).

SDDMM: C = (A B^T) at a vector mask, A [BH, M, K], B [BH, N, K], M = N, for the integer
kernels (L16-R16, L8-R8, L4-R4, fp16 output with fused dequantization) and the fp16 sparse
kernel, against the dense cuBLAS fp16 batched product of the same shape (torch.bmm, which
writes the whole M x N output). Softmax: the fused quantizing softmax over the SDDMM's fp16
scores, its achieved bandwidth (bytes it must read and write / time) against a
device-to-device copy measured in the same run.

    python -m magicube.eval.bench_sddmm [--quick] [--out DIR]
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from magicube.eval.timing import cuda_time, device_slug, environment, kernel_bench_args, save_json
from magicube.ops import SRBCRS, extension, random_vector_mask

PRECISIONS = (("L16-R16", 16), ("L8-R8", 8), ("L4-R4", 4), ("fp16", 0))
# The shape the kernels are judged at: one attention layer's scores (32 batch x heads).
TARGET = dict(m=4096, k=64, bh=32, v=8, sparsity=0.9)


def _inputs(bh, m, n, k, bits, device):
    if bits == 0:
        return (torch.randn(bh, m, k, device=device).half(), torch.randn(bh, n, k, device=device).half())
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    kk = k // 2 if bits == 4 else k
    dtype = {16: torch.int16, 8: torch.int8, 4: torch.uint8}[bits]
    if bits == 4:
        return (torch.randint(0, 256, (bh, m, kk), device=device, dtype=torch.uint8),
                torch.randint(0, 256, (bh, n, kk), device=device, dtype=torch.uint8))
    return (torch.randint(lo, hi, (bh, m, kk), device=device, dtype=dtype),
            torch.randint(lo, hi, (bh, n, kk), device=device, dtype=dtype))


def copy_bandwidth(reps: int) -> float:
    """Device-to-device copy rate in GB/s, counting the bytes read plus the bytes written."""
    n = 1 << 29
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=5, reps=reps)
    return 2 * n / (t["median_ms"] * 1e-3) / 1e9


def run(cfg, reps: int, log=print) -> dict:
    extension.load("sddmm")
    extension.load("softmax")
    ops = torch.ops.magicube_cuda
    copy_gbs = copy_bandwidth(reps)
    log(f"device copy: {copy_gbs:.0f} GB/s (read + write)")
    records = []
    for (m, bh, k), v, sparsity in itertools.product(cfg["shapes"], cfg["v"], cfg["sparsity"]):
        n = m
        pat = SRBCRS.from_mask(random_vector_mask(m, n, v, sparsity, seed=0), stride=32).to("cuda")
        idx = (pat.row_ptr, pat.col_idx, pat.row_order)
        base = dict(m=m, n=n, k=k, bh=bh, v=v, sparsity=sparsity, nnz_pad=pat.nnz_pad)
        q, kt = torch.randn(bh, m, k, device="cuda").half(), torch.randn(bh, n, k, device="cuda").half()
        # the 1 GB output lives as long as the lambda that writes it
        dense = cuda_time(lambda out=torch.empty(bh, m, n, device="cuda", dtype=torch.float16):
                          torch.bmm(q, kt.transpose(1, 2), out=out), reps=reps)
        records.append(dict(base, kernel="dense fp16 (cuBLAS bmm)", **dense))
        sa = torch.rand(bh, m, device="cuda")
        sb = torch.rand(bh, n, device="cuda")
        scores = None
        for name, bits in PRECISIONS:
            a, b = _inputs(bh, m, n, k, bits, "cuda")
            if bits == 0:
                fn = lambda a=a, b=b: ops.sddmm(  # noqa: E731
                    *idx, a, b, None, None, v, 16, torch.float16, pat.longest_row)
            else:
                fn = lambda a=a, b=b: ops.sddmm(  # noqa: E731
                    *idx, a, b, sa, sb, v, bits, torch.float16, pat.longest_row)
            t = cuda_time(fn, reps=reps)
            records.append(dict(base, kernel=f"sddmm {name}", speedup_vs_dense=dense["median_ms"] / t["median_ms"],
                                **t))
            log(f"M=N={m} K={k} BH={bh} V={v} sp={sparsity}: sddmm {name} {t['median_ms'] * 1e3:.1f} us, "
                f"dense {dense['median_ms'] * 1e3:.1f} us, x{dense['median_ms'] / t['median_ms']:.2f}")
            if bits == 0:
                scores = fn()
            del a, b
        for out_bits in cfg["softmax_bits"]:
            fn = lambda scores=scores: ops.sparse_softmax(  # noqa: E731
                *idx, scores, v, k ** -0.5, out_bits, pat.longest_row)
            t = cuda_time(fn, reps=reps)
            elems = scores.numel()
            out_bytes = elems * {0: 2, 16: 2, 8: 1, 4: 0.5}[out_bits]
            moved = elems * 2 + out_bytes + bh * m * 4
            gbs = moved / (t["median_ms"] * 1e-3) / 1e9
            records.append(dict(base, kernel=f"softmax out_bits={out_bits}", bytes=moved, gb_per_s=gbs,
                                fraction_of_copy=gbs / copy_gbs, **t))
            log(f"  softmax out_bits={out_bits}: {t['median_ms'] * 1e3:.1f} us, {gbs:.0f} GB/s = "
                f"{100 * gbs / copy_gbs:.0f} % of copy")
        del scores
    return dict(environment=environment(), copy_gb_per_s=copy_gbs, config=cfg, summary=summarize(records),
                records=records)


def summarize(records) -> dict:
    """The target shape's figures: each SDDMM's speedup over the dense product, each softmax's
    fraction of the copy rate."""
    at = [r for r in records if all(r[key] == value for key, value in TARGET.items())]
    return dict(target=TARGET,
                sddmm_speedup_vs_dense={r["kernel"]: r["speedup_vs_dense"] for r in at if "speedup_vs_dense" in r},
                sddmm_us={r["kernel"]: r["median_ms"] * 1e3 for r in at if r["kernel"].startswith("sddmm")},
                softmax_fraction_of_copy={r["kernel"]: r["fraction_of_copy"] for r in at if "fraction_of_copy" in r})


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if "speedup_vs_dense" in r]
    groups = sorted({(r["m"], r["k"], r["bh"], r["v"]) for r in recs})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
    for ax, (m, k, bh, v) in zip(axes[0], groups):
        for name, _ in PRECISIONS:
            pts = sorted((r["sparsity"], r["speedup_vs_dense"]) for r in recs
                         if (r["m"], r["k"], r["bh"], r["v"]) == (m, k, bh, v) and r["kernel"] == f"sddmm {name}")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"M=N={m} K={k} BH={bh} V={v}", fontsize=9)
        ax.set_xlabel("sparsity")
        ax.set_ylabel("speedup vs dense fp16 bmm")
        ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"SDDMM on {result['environment'].get('device', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = kernel_bench_args("bench_sddmm", __doc__, argv, quick="a small subset (the target shape included)",
                             reps=50)
    if args is None:
        return 2
    if args.quick:
        cfg = dict(shapes=[(4096, 32, 64)], v=[2, 4, 8], sparsity=[0.5, 0.9, 0.98], softmax_bits=[0, 8, 4])
    else:
        cfg = dict(shapes=[(m, 32, k) for m in (1024, 2048, 4096) for k in (64, 128, 256)], v=[2, 4, 8],
                   sparsity=[0.5, 0.7, 0.8, 0.9, 0.95, 0.98], softmax_bits=[0, 16, 8, 4])
    result = run(cfg, args.reps)
    name = Path(args.out) / f"sddmm{'_quick' if args.quick else ''}_{device_slug(result['environment'])}"
    save_json(name.with_suffix(".json"), result)
    plot(result, name.with_suffix(".png"))
    print("summary:", result["summary"])
    print(f"wrote {name}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
