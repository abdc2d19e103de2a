"""End-to-end inference latency of the LRA model and of one attention layer, per backend.

Every backend's output is first compared with an fp32 reference of the same masked model
(dense attention for the dense backends, masked dense attention for the sparse ones), and
the error is printed beside its time: a fast wrong answer never enters the table.

    python -m magicube.eval.bench_model               # the full sweep on a GPU
    python -m magicube.eval.bench_model --quick       # B=8, L=4096, H=4, sparsity 0.9 only
    python -m magicube.eval.bench_model --quick --profile   # and where one layer's time goes
    python -m magicube.eval.bench_model --quick --compile --cuda-graph   # the leanest block PyTorch gives
    python -m magicube.eval.bench_model --quick --compile reduce-overhead   # torch.compile's own CUDA graphs
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from magicube.eval.args import fraction, output_folder, positive_int
from magicube.eval.timing import cpu_time, cuda_time, environment, save_json
from magicube.model.lra import QUANTIZED, LRAClassifier, LRAConfig
from magicube.train.finetune import calibrate, set_calibrated_scales

SPARSE = ("sparse", "16b-8b", "8b-8b", "8b-4b")
# "<backend>" runs the paper's three kernels (sddmm, softmax, spmm); "<backend>-fused" the one
# fused attention kernel, which computes the same function.
BACKENDS = ("materialized", "dense", *SPARSE, *(f"{b}-fused" for b in SPARSE))
DENSE = ("materialized", "dense")
# Largest relative error of one attention layer against its fp32 reference that a backend may
# show and still be timed: fp16 rounding, and the quantization error of its precision (4-bit
# Q/K/V with per-head absmax scales loses most).
TOLERANCE = {"materialized": 1e-2, "dense": 1e-2, "sparse": 1e-2, "16b-8b": 5e-2, "8b-8b": 5e-2, "8b-4b": 0.35}
TOLERANCE.update({f"{b}-fused": TOLERANCE[b] for b in SPARSE})


def build(backend: str, length: int, heads: int, sparsity: float, v: int, device, dtype,
          scales: str = "absmax") -> LRAClassifier:
    """The paper's LRA model (4 layers, head dim 64, MLP 1024) with one backend, in eval mode.

    scales="calibrated": a quantized backend holds fixed per-head Q/K/V scales, as a finetuned
    model does (see build_inputs); "absmax" computes them per batch x head on every forward.
    """
    attention = backend.removesuffix("-fused")
    quant = (dict(quant_precision=attention, quant_scales="fixed")
             if scales == "calibrated" and attention in QUANTIZED else {})
    config = LRAConfig(max_len=length, emb_dim=64 * heads, num_heads=heads, num_layers=4, mlp_dim=1024,
                       attention=attention, fused=backend.endswith("-fused"), sparsity=sparsity, v=v,
                       dropout=0.0, attention_dropout=0.0, **quant)
    torch.manual_seed(0)  # same weights and masks for every backend
    return LRAClassifier(config).to(device=device, dtype=dtype).eval()


def build_inputs(model: LRAClassifier, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids, and the input block 0's attention sees for them (the layer's timing input).

    A model with fixed scales is calibrated on these ids first (absmax per head through its
    float function), so that its scales fit the data the timing runs on.
    """
    device = next(model.parameters()).device
    ids = torch.randint(1, 257, (batch, model.config.input_len), generator=torch.Generator().manual_seed(0))
    if model.config.calibrated:
        set_calibrated_scales(model, calibrate(model, ids, batch, 1, 0, "sparse", device))
    seen = []
    hook = model.blocks[0].attn.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        model(ids.to(device))
    finally:
        hook.remove()
    return ids.to(device), seen[0]


def reference_for(model: LRAClassifier) -> LRAClassifier:
    """fp32 copy computing the same function: dense stays dense, sparse becomes masked dense."""
    ref = LRAClassifier(LRAConfig(**{**model.config.to_dict(), "attention": "dense" if model.config.attention in DENSE
                                     else "sparse", "sparse_impl": "masked"}))
    ref.load_state_dict({k: t.float() for k, t in model.state_dict().items()})
    return ref.to(next(model.parameters()).device).eval()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def kernel_breakdown(fn, on_gpu: bool, calls: int = 20, top: int = 10) -> list[dict]:
    """The `top` kernels (CPU: operators) by their own time per call of fn, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    events = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    ranked = sorted((e for e in events if own(e) > 0), key=own, reverse=True)
    return [{"name": e.key, "us_per_call": own(e) / calls, "launches_per_call": e.count / calls}
            for e in ranked[:top]]


def measure(fn, on_gpu: bool, reps: int, cuda_graph: bool) -> dict:
    if not on_gpu:
        return cpu_time(fn, warmup=1, reps=max(3, reps // 20))
    torch.cuda.reset_peak_memory_stats()
    timing = cuda_time(fn, warmup=10, reps=reps, graph=cuda_graph)
    timing["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return timing


@torch.inference_mode()
def run_case(backend, batch, length, heads, sparsity, v, args, device, dtype) -> dict:
    model = build(backend, length, heads, sparsity, v, device, dtype, getattr(args, "scales", "absmax"))
    ids, x_in = build_inputs(model, batch)
    ref = reference_for(model)
    x = x_in.float()
    layer, ref_layer = model.blocks[0].attn, ref.blocks[0].attn
    mode = getattr(args, "compile", None)
    if mode:
        # Every backend alike: inductor fuses the LayerNorms, GELU and residual adds around the
        # attention, whose ops stay opaque to it. The errors below are those of the compiled code.
        # Static shapes: the bit widths stay Python constants (a recompile must not make them symbolic).
        # A fresh cache per case: the code compiled for one backend guards on its config, and dynamo
        # stops compiling a function after a few recompiles (later backends would run eagerly).
        torch._dynamo.reset()
        # reduce-overhead: torch.compile's own CUDA graphs, the one-line way for eager users.
        mode = None if mode == "default" else mode
        model, layer = torch.compile(model, dynamic=False, mode=mode), torch.compile(layer, dynamic=False, mode=mode)
    row = dict(backend=backend, batch=batch, length=length, heads=heads, sparsity=sparsity, v=v)
    row["model_rel_err"] = relative_error(model(ids).logits, ref(ids).logits)
    row["layer_rel_err"] = relative_error(layer(x_in), ref_layer(x))
    if not row["layer_rel_err"] <= TOLERANCE[backend]:  # NaN fails too
        row["rejected"] = f"layer error {row['layer_rel_err']:.2e} over the tolerance {TOLERANCE[backend]:.0e}"
        return row
    on_gpu = device.type == "cuda"
    row["model"] = measure(lambda: model(ids), on_gpu, args.reps, args.cuda_graph)
    row["layer"] = measure(lambda: layer(x_in), on_gpu, args.reps, args.cuda_graph)
    if getattr(args, "profile", False):
        row["layer_kernels"] = kernel_breakdown(lambda: layer(x_in), on_gpu)
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over materialized fp16 attention per case, in the manner of the paper's Figure 16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "rejected" not in r]
    cases = sorted({(r["batch"], r["length"], r["heads"], r["sparsity"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(cases)), 4), sharey=False)
    for ax, part in zip(axes, ("model", "layer")):
        width = 0.8 / len(BACKENDS)
        for i, backend in enumerate(BACKENDS):
            speedups = []
            for case in cases:
                get = {r["backend"]: r[part]["median_ms"] for r in rows if (r["batch"], r["length"], r["heads"],
                                                                           r["sparsity"]) == case}
                speedups.append(get.get("materialized", float("nan")) / get.get(backend, float("nan")))
            ax.bar([j + i * width for j in range(len(cases))], speedups, width, label=backend)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"B{b} L{length}\nH{h} s{s}" for b, length, h, s in cases], fontsize=7)
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"{part}: speedup over materialized fp16")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None, prog: str = "python -m magicube.eval.bench_model") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[2, 8])
    parser.add_argument("--length", nargs="+", type=positive_int, default=[4096, 8192])
    parser.add_argument("--heads", nargs="+", type=positive_int, default=[4, 8], help="embedding = 64 x heads")
    parser.add_argument("--sparsity", nargs="+", type=fraction, default=[0.9, 0.95])
    parser.add_argument("--v", type=positive_int, default=8)
    parser.add_argument("--reps", type=positive_int, default=100)
    parser.add_argument("--cuda-graph", action="store_true", help="time replays of a captured CUDA graph")
    parser.add_argument("--scales", choices=("absmax", "calibrated"), default="absmax",
                        help="Q/K/V scales of the quantized backends: per batch x head on every forward, or "
                             "fixed per head after calibration, as the finetuned models run")
    parser.add_argument("--quick", action="store_true", help="only B=8, L=4096, H=4, sparsity 0.9")
    parser.add_argument("--compile", nargs="?", const="default", choices=("default", "reduce-overhead"),
                        help="torch.compile the model and the layer (every backend); reduce-overhead: with the "
                             "CUDA graphs torch.compile makes itself (instead of --cuda-graph)")
    parser.add_argument("--profile", action="store_true",
                        help="also list the kernels one layer spends its time in (torch.profiler, outside any graph)")
    parser.add_argument("--out", type=output_folder, default="runs/bench")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where there is one")
    args = parser.parse_args(argv)
    if args.compile == "reduce-overhead" and args.cuda_graph:
        parser.error("--compile reduce-overhead replays CUDA graphs of its own; drop --cuda-graph")

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device that PyTorch sees")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graph and device.type != "cuda":  # the CPU timer would ignore it, the JSON would not
        parser.error("--cuda-graph: CUDA graphs need a CUDA device, and this run times on the CPU")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.batch, args.length, args.heads, args.sparsity = [8], [4096], [4], [0.9]
    if device.type == "cpu":
        print("magicube: no CUDA device: timing the reference backends on a small size; these are CPU timings",
              file=sys.stderr)
        args.batch, args.length, args.heads, args.sparsity = [2], [256], [2], [0.9]
    rows = []
    payload = dict(environment=environment(device), cuda_graph=args.cuda_graph, compile=args.compile, dtype=str(dtype),
                   scales=args.scales, rows=rows)
    print(f"{'backend':>12} {'B':>2} {'L':>5} {'H':>2} {'sp':>4} | {'model ms':>9} {'err':>8} | "
          f"{'layer ms':>9} {'err':>8} | {'peak MB':>8}")
    for batch, length, heads, sparsity in itertools.product(args.batch, args.length, args.heads, args.sparsity):
        for backend in args.backends:
            row = run_case(backend, batch, length, heads, sparsity, args.v, args, device, dtype)
            rows.append(row)
            path = save_json(args.out / "bench_model.json", payload)  # an interrupted sweep keeps what it measured
            if "rejected" in row:
                print(f"{backend:>12} {batch:>2} {length:>5} {heads:>2} {sparsity:>4} | not timed: {row['rejected']}")
                continue
            print(f"{backend:>12} {batch:>2} {length:>5} {heads:>2} {sparsity:>4} | {row['model']['median_ms']:9.3f} "
                  f"{row['model_rel_err']:8.1e} | {row['layer']['median_ms']:9.3f} {row['layer_rel_err']:8.1e} | "
                  f"{row['model'].get('peak_mem_mb', float('nan')):8.0f}", flush=True)
            for k in row.get("layer_kernels", []):
                print(f"{'':>14}{k['us_per_call']:9.1f} us  x{k['launches_per_call']:<4g} {k['name'][:90]}")
    plot(rows, args.out / "bench_model.png")
    print(f"wrote {path} and {args.out / 'bench_model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
