"""What every benchmark shares: CUDA-event timing, the run's environment, JSON output, and the kernel
benchmarks' command line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from magicube.eval.args import output_folder, positive_int
from magicube.train.files import write_atomic


def capture(fn, calls: int = 1):
    """Replay of a CUDA graph holding `calls` back-to-back fn() calls, or None if fn cannot be captured.

    Replays remove the host's launch path from the timing: a kernel of a few microseconds is
    shorter than launching it from Python.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph.replay


def cuda_time(fn, warmup: int = 10, reps: int = 100, flush_l2: bool = False, calls: int = 1,
              graph: bool = False) -> dict:
    """Median and 95 % interval (ms per fn() call) over `reps` samples timed with CUDA events.

    Each sample has its own pair of events, so one slow sample does not smear into the others;
    a sample runs `calls` back-to-back calls (from a CUDA graph with graph=True, falling back
    to plain calls where fn cannot be captured). With flush_l2 a buffer larger than the L2 is
    overwritten before every sample, so inputs smaller than the cache are not timed from it.
    """
    replay = capture(fn, calls) if graph else None
    if replay is None:
        def replay():
            for _ in range(calls):
                fn()
    for _ in range(warmup):
        replay()
    scratch = None
    if flush_l2:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        scratch = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if scratch is not None:
            scratch.zero_()
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    out = summarize([s.elapsed_time(e) / calls for s, e in zip(starts, ends)])
    out["calls_per_sample"], out["graph"] = calls, replay is not None and graph
    return out


def cpu_time(fn, warmup: int = 2, reps: int = 10) -> dict:
    """The same summary from the host clock, for runs on a machine without CUDA."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)


def summarize(times_ms: list[float]) -> dict:
    ordered = sorted(times_ms)
    n = len(ordered)
    return {
        "median_ms": statistics.median(ordered),
        "p025_ms": ordered[int(0.025 * (n - 1))],
        "p975_ms": ordered[int(round(0.975 * (n - 1)))],
        "reps": n,
    }


def git_commit() -> str:
    """The checkout's commit (-dirty with local changes), or $MAGICUBE_COMMIT where the copy has no git data."""
    if os.environ.get("MAGICUBE_COMMIT"):
        return os.environ["MAGICUBE_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device=None) -> dict:
    """Device, versions and commit: what a reader needs to trust or reproduce a number.

    `device` is where the timed work ran (default: the current CUDA device where there is one).
    """
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, sm=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
    else:
        env.update(device=f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores")
    return env


def device_slug(env: dict) -> str:
    """The device of `environment()` as a file-name part: "NVIDIA H200" -> "nvidia_h200"."""
    return "".join(c if c.isalnum() else "_" for c in env.get("device", "gpu")).strip("_").lower()


def save_json(path, obj) -> Path:
    """Write JSON whole (`write_atomic`)."""
    return write_atomic(path, json.dumps(obj, indent=1, default=str))


def kernel_bench_args(module: str, doc: str, argv, *, quick: str, reps: int, reps_help: str | None = None,
                      extra=None):
    """The kernel benchmarks' command line (--quick, --out, --reps, and what `extra(parser)` adds),
    or None where there is no CUDA device to time on (said on stderr):
    `python -m magicube.eval.<module>`."""
    ap = argparse.ArgumentParser(prog=f"python -m magicube.eval.{module}", description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=output_folder, default="eval/results", help="directory for the JSON and the plot")
    ap.add_argument("--reps", type=positive_int, default=reps, help=reps_help)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{module}: needs a CUDA device (the kernels it times run on the GPU only)", file=sys.stderr)
        return None
    return args
