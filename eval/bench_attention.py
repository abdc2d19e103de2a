"""Attention-core benchmark: the fused sparse attention kernel against dense and unfused baselines.

    python -m magicube.eval.bench_attention [--quick] [--mask structured] [--out DIR]

One attention layer's core, out = softmax(Q K^T / sqrt(d)) V, for Q, K, V of [B*H, L, 64] in fp16
(views of one projection output [B, L, 3, H, 64], as the layer has them), with a vector-sparse mask
of V = 8: random (the paper's; every vector row keeps the same count) or structured (a window of
32 tokens each side, a global CLS row and column, random fill: one row keeps every key). Rows,
side by side:

- dense: PyTorch materialized fp16 softmax(QK^T)V, SDPA (flash) fp16 on [B, H, L, d], SDPA with an
  additive -inf mask of the same sparsity (the dense way to run the sparse model);
- the three-op pipeline magicube sddmm -> sparse_softmax -> spmm, in fp16 and 8b-8b / 16b-8b / 8b-4b
  (probability bits - Q/K/V bits);
- the fused op (one kernel), same precisions, writing [B, L, H, d] (the layout an output projection
  reads; the dense and pipeline rows return [B*H, L, d]).

Quantized rows include quantizing Q, K and V from the projection output as the model's layer
does (absmax scales per batch x head, model.lra.quantize_qkv), which is also timed on its own.
Every output is first compared with an fp32 reference on the first heads (dense softmax for the
dense rows, the masked one for the sparse rows) and the relative error is printed beside the
time. Medians of CUDA-event timings of CUDA-graph replays after warm-up (no Python launch
overhead, as in `magicube bench --cuda-graph`). The fused rows also report their effective
gather rate: the key and value rows their kept slots use (one of each per slot), over the time;
the kernel fetches about those bytes from L2, which bounds it (`eval/results/kernel_checks.md`,
last section). Writes attention_<device>.json and a plot of time per method.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from magicube.eval.timing import cuda_time, device_slug, environment, kernel_bench_args, save_json
from magicube.model.lra import quantize_qkv
from magicube.model.masks import KINDS, layer_mask
from magicube.ops import SRBCRS, extension

FULL = dict(b=[2, 8], h=[4, 8], seq=[4096, 8192], sparsity=[0.9, 0.95])
QUICK = dict(b=[8], h=[4], seq=[4096], sparsity=[0.9, 0.95])
TARGET = dict(b=8, h=4, seq=4096, sparsity=0.9, mask="random", method="fused 8b-8b", qk_bits=8)
D, V = 64, 8
QUANT = [(8, 8), (16, 8), (8, 4)]  # (probability bits, Q/K/V bits)
REF_HEADS = 2  # heads compared with the fp32 reference


def _label(p_bits, qk_bits):
    return f"{p_bits}b-{qk_bits}b"


def rel_err(out, ref):
    if out.dim() == 4:  # the fused op's [B, L, H, D], as an attention layer takes it
        out = out.transpose(1, 2).flatten(0, 1)
    out = out[:ref.shape[0]].float()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def gathered_bytes(bh: int, seq: int, density: float, d: int, bits: int) -> float:
    """Bytes of the key and value rows (d values of `bits` each) that the kept slots of a seq x seq
    mask of V-vectors use in each of bh batch x heads."""
    return bh * seq * seq * density / V * 2 * d * bits / 8


def run_config(b, h, seq, sparsity, mask_kind, reps, pipeline, log):
    ops = torch.ops.magicube_cuda
    dev = "cuda"
    bh = b * h
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(b, seq, 3, h, D, device=dev, generator=g, dtype=torch.float16).permute(2, 0, 3, 1, 4)
    q, k, v = (x.reshape(bh, seq, D) for x in qkv)  # contiguous copies for the fp16 rows
    scale = D ** -0.5
    mask = layer_mask(mask_kind, seq, V, sparsity, seed=1)
    pat = SRBCRS.from_mask(mask, stride=32).to(dev)
    emask = mask.to_dense().to(dev)  # [L, L] bool
    density = float(mask.mask.float().mean())
    pattern = (pat.row_ptr, pat.col_idx, pat.row_order)

    # fp32 references on the first heads.
    qr, kr, vr = (x[:REF_HEADS].float() for x in (q, k, v))
    s = qr @ kr.transpose(1, 2) * scale
    ref_dense = torch.softmax(s, -1) @ vr
    ref_sparse = torch.softmax(s.masked_fill(~emask, float("-inf")), -1) @ vr
    del s

    records = []
    base = dict(b=b, h=h, seq=seq, d=D, v=V, sparsity=sparsity, mask=mask_kind, density=density)

    def add(method, fn, ref, quant_ms=0.0, kind="sparse", gather_bits=None):
        err = rel_err(fn(), ref)
        ms = cuda_time(fn, warmup=max(5, reps // 5), reps=reps, graph=True)["median_ms"]
        rec = dict(base, method=method, kind=kind, ms=ms, quant_ms=quant_ms, total_ms=ms + quant_ms, rel_err=err)
        if gather_bits is not None:
            rec["gather_tbs"] = gathered_bytes(bh, seq, density, D, gather_bits) / ms / 1e9
        records.append(rec)
        extra = f" (+ quantization {quant_ms * 1e3:.1f} us = {rec['total_ms'] * 1e3:.1f} us)" if quant_ms else ""
        log(f"  {method:24s} {ms * 1e3:9.1f} us{extra}   rel. error {err:.2e}")
        torch.cuda.empty_cache()
        return rec

    log(f"B={b} H={h} L={seq} sparsity={sparsity}, {mask_kind} mask (density {density:.3f})")
    mat_reps = max(5, reps // 5)

    def materialized():
        return torch.softmax((q @ k.transpose(1, 2)) * scale, -1) @ v

    if bh * seq * seq * 2 * 3 < torch.cuda.mem_get_info()[0]:
        err = rel_err(materialized(), ref_dense)
        ms = cuda_time(materialized, warmup=2, reps=mat_reps, graph=True)["median_ms"]
        records.append(dict(base, method="materialized fp16", kind="dense", ms=ms, quant_ms=0.0, total_ms=ms,
                            rel_err=err))
        log(f"  {'materialized fp16':24s} {ms * 1e3:9.1f} us   rel. error {err:.2e}")
        torch.cuda.empty_cache()
    q4, k4, v4 = (x.view(b, h, seq, D) for x in (q, k, v))
    add("SDPA flash fp16", lambda: F.scaled_dot_product_attention(q4, k4, v4).view(bh, seq, D), ref_dense,
        kind="dense")
    additive = torch.zeros(seq, seq, device=dev, dtype=torch.float16).masked_fill(~emask, float("-inf"))
    add("SDPA masked fp16", lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=additive).view(bh, seq, D),
        ref_sparse, kind="masked")

    def pipeline_fp16():
        sc = ops.sddmm(*pattern, q, k, None, None, V, 16, torch.float16, pat.longest_row)
        pr, _ = ops.sparse_softmax(*pattern, sc, V, scale, 0, pat.longest_row)
        return ops.spmm(*pattern, pr, v, None, None, V, seq, 16, True, 16, torch.float16, pat.longest_row)

    if pipeline:
        add("pipeline fp16", pipeline_fp16, ref_sparse)
    add("fused fp16", lambda: ops.sparse_attention(*pattern, q, k, v, None, None, None, V, scale, 16, 0, h,
                                                   pat.longest_row), ref_sparse,
        gather_bits=16)

    for p_bits, qk_bits in QUANT:
        quant_ms = cuda_time(lambda: quantize_qkv(qkv, qk_bits), warmup=3, reps=max(10, reps // 2),
                             graph=True)["median_ms"]
        (qq, kq, vq), scales = quantize_qkv(qkv, qk_bits)
        # per batch x head, read in place by the fused op; the pipeline's kernels take them contiguous
        sq, sk, sv = (s[:, None].expand(bh, n) for s, n in zip(scales, (seq, seq, D)))
        label = _label(p_bits, qk_bits)
        log(f"  {'quantize Q,K,V ' + str(qk_bits) + 'b':24s} {quant_ms * 1e3:9.1f} us")
        records.append(dict(base, method=f"quantize {qk_bits}b", kind="quant", ms=quant_ms, quant_ms=0.0,
                            total_ms=quant_ms, rel_err=None))

        def three_ops(qq=qq, kq=kq, vq=vq, sq=sq.contiguous(), sk=sk.contiguous(), sv=sv.contiguous(),
                      p_bits=p_bits, qk_bits=qk_bits):
            sc = ops.sddmm(*pattern, qq, kq, sq, sk, V, qk_bits, torch.float16, pat.longest_row)
            pr, rs = ops.sparse_softmax(*pattern, sc, V, scale, p_bits, pat.longest_row)
            return ops.spmm(*pattern, pr, vq, rs, sv, V, seq, p_bits, False, qk_bits, torch.float16, pat.longest_row)

        if pipeline:
            add(f"pipeline {label}", three_ops, ref_sparse, quant_ms)
        add(f"fused {label}", lambda qq=qq, kq=kq, vq=vq, sq=sq, sk=sk, sv=sv, p_bits=p_bits, qk_bits=qk_bits:
            ops.sparse_attention(*pattern, qq, kq, vq, sq, sk, sv, V, scale, qk_bits, p_bits, h, pat.longest_row),
            ref_sparse, quant_ms,
            gather_bits=qk_bits)
        del qq, kq, vq, sq, sk, sv, scales
    flash = next(r["total_ms"] for r in records if r["method"] == "SDPA flash fp16")
    for r in records:
        r["speedup_vs_flash"] = flash / r["total_ms"]
    return records


def summarize(records):
    out = {}
    t = [r for r in records if all(r[key] == TARGET[key] for key in ("b", "h", "seq", "sparsity", "mask"))]
    by = {r["method"]: r for r in t}
    if TARGET["method"] in by:
        r = by[TARGET["method"]]
        out["target"] = dict(TARGET, fused_us=r["ms"] * 1e3, with_quantization_us=r["total_ms"] * 1e3,
                             flash_us=by["SDPA flash fp16"]["ms"] * 1e3,
                             speedup_vs_flash_with_quantization=r["speedup_vs_flash"],
                             speedup_vs_flash_kernel_only=by["SDPA flash fp16"]["ms"] / r["ms"],
                             pipeline_us=by.get("pipeline 8b-8b", {}).get("total_ms", math.nan) * 1e3,
                             gathered_mb=gathered_bytes(r["b"] * r["h"], r["seq"], r["density"], r["d"],
                                                         TARGET["qk_bits"]) / 1e6,
                             gather_tbs=r.get("gather_tbs"))
    return out


def plot(records, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["b"], r["h"], r["seq"], r["sparsity"]) for r in records})
    fig, axes = plt.subplots(1, len(configs), figsize=(4.6 * len(configs), 4.2), sharey=True, squeeze=False)
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if not m.startswith("quantize")]
    colors = {"dense": "tab:gray", "masked": "tab:brown"}
    for ax, cfg in zip(axes[0], configs):
        rs = {r["method"]: r for r in records if (r["b"], r["h"], r["seq"], r["sparsity"]) == cfg}
        ys = range(len(methods))
        for y, m in zip(ys, methods):
            if m not in rs:
                continue
            r = rs[m]
            c = colors.get(r["kind"], "tab:blue" if m.startswith("fused") else "tab:orange")
            ax.barh(y, r["ms"] * 1e3, color=c)
            if r["quant_ms"]:
                ax.barh(y, r["quant_ms"] * 1e3, left=r["ms"] * 1e3, color=c, alpha=0.4, hatch="//")
            ax.text(r["total_ms"] * 1e3, y, f" {r['total_ms'] * 1e3:.0f}", va="center", fontsize=6)
        if "SDPA flash fp16" in rs:
            ax.axvline(rs["SDPA flash fp16"]["ms"] * 1e3, color="k", lw=0.8, ls="--")
        ax.set_xscale("symlog", linthresh=100)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(methods, fontsize=7)
        ax.set_xlabel("us (hatched: Q/K/V quantization)")
        ax.set_title(f"B={cfg[0]} H={cfg[1]} L={cfg[2]} s={cfg[3]}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    def mask_option(ap):
        ap.add_argument("--mask", choices=KINDS, default="random",
                        help="the vector-sparse mask (default: random, the paper's and the target's)")

    args = kernel_bench_args("bench_attention", __doc__, argv, quick="B=8, H=4, L=4096 only (the target shape)",
                             reps=50, extra=mask_option)
    if args is None:
        return 2
    extension.load("attention")
    pipeline = True
    for family in ("sddmm", "softmax", "spmm"):
        try:
            extension.load(family)
        except Exception as exc:  # the fused rows still run without the three-op baseline
            print(f"bench_attention: no {family} kernels ({exc}); skipping the pipeline rows", file=sys.stderr)
            pipeline = False
    env = environment()
    cfg = QUICK if args.quick else FULL
    print(f"bench_attention on {env.get('device')}, torch {env['torch']}, CUDA {env['cuda']}", flush=True)
    records = []
    for b in cfg["b"]:
        for h in cfg["h"]:
            for seq in cfg["seq"]:
                for sp in cfg["sparsity"]:
                    records += run_config(b, h, seq, sp, args.mask, args.reps, pipeline,
                                          log=lambda s: print(s, flush=True))
    summary = summarize(records)
    print("summary:", summary)
    out = Path(args.out)
    mask = "" if args.mask == "random" else f"_{args.mask}"
    name = f"attention{'_quick' if args.quick else ''}{mask}_{device_slug(env)}"
    save_json(out / f"{name}.json", dict(environment=env, config=cfg, quick=args.quick, mask=args.mask,
                                         summary=summary, records=records))
    plot(records, out / f"{name}.png", f"Attention core, d={D}, V={V}, {args.mask} mask on {env.get('device')} "
                                       "(dashed: SDPA flash fp16)")
    print(f"wrote {out / (name + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
