"""Build and load the CUDA kernels of `csrc/`, one extension per op family.

Each family `csrc/<family>.cu` compiles on first use through torch's ninja JIT into a cached
extension `magicube_<family>` that registers its ops under `torch.ops.magicube_cuda`; the
ahead-of-time build is `magicube build` (`main` below; `python -m magicube.eval.cli build` where
the command is not on PATH). One extension per family keeps rebuilds small and lets a machine run
the families it can build.

Targets sm_80 (A100) and sm_90a (Hopper; the `a` admits wgmma and setmaxnreg). Set
MAGICUBE_CUDA_ARCHS (e.g. "90a") to build fewer.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from filelock import FileLock

FAMILIES = ("quantize", "spmm", "sddmm", "softmax", "attention")
OP_FAMILY = {"quantize": "quantize", "spmm": "spmm", "sddmm": "sddmm", "sparse_softmax": "softmax",
             "sparse_attention": "attention"}
DEFAULT_ARCHS = ("80", "90a")

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def available() -> bool:
    """True where the kernels can run: a CUDA build of torch and a visible device."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def toolchain() -> str | None:
    """Why the kernels cannot be compiled here, or None if they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return None


def _arch_flags() -> list[str]:
    chosen = os.environ.get("MAGICUBE_CUDA_ARCHS", ",".join(DEFAULT_ARCHS))
    archs = [a.strip() for a in chosen.replace(";", ",").split(",")]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    # The host code launches wgmma kernels on Hopper only where the build holds their sm_90a code.
    return flags + ["-DMAGICUBE_SM90A"] if "90a" in archs else flags


def _include_paths() -> list[str]:
    # torch's CUDA headers include cusparse.h and friends, which a bare toolkit may lack but
    # the nvidia wheels that a CUDA build of torch depends on carry.
    paths = []
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cu12"):
                inc = Path(root) / sub / "include"
                if inc.is_dir():
                    paths.append(str(inc))
    except ImportError:
        pass
    return [str(CSRC)] + paths


def sources(family: str) -> list[Path]:
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    return [CSRC / f"{family}.cu"]


@functools.cache
def load(family: str) -> None:
    """Compile (first use) and load one family; its ops appear under torch.ops.magicube_cuda."""
    from torch.utils import cpp_extension

    srcs = sources(family)
    missing = [str(s) for s in srcs if not s.exists()]
    if missing:
        raise FileNotFoundError(f"family {family!r}: kernel source missing: {', '.join(missing)}")
    reason = toolchain()
    if reason:
        raise RuntimeError(f"cannot build the {family!r} kernels: {reason}")
    name = f"magicube_{family}"
    root = os.environ.get("MAGICUBE_BUILD_DIR")
    build_dir = str(Path(root) / name) if root else cpp_extension._get_build_directory(name, verbose=False)
    os.makedirs(build_dir, exist_ok=True)
    print(f"magicube: loading the {family} kernels (compiled on first use, which takes a few minutes; "
          "cached afterwards)", file=sys.stderr, flush=True)
    # An OS lock, which dies with its holder: builds of one family wait for each other here, and
    # a torch baton (below) seen while holding it is a leftover.
    with FileLock(os.path.join(build_dir, "magicube.lock")):
        _remove_stale_baton(Path(build_dir), family)
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in srcs],
            # --threads=0: nvcc compiles the target archs in parallel
            extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "--threads=0",
                               *_arch_flags()],
            extra_cflags=["-O3", "-std=c++20"],
            extra_include_paths=_include_paths(),
            build_directory=build_dir,
            is_python_module=False,
            verbose=bool(os.environ.get("MAGICUBE_VERBOSE_BUILD")),
        )


def _remove_stale_baton(build_dir: Path, family: str) -> None:
    """torch before 2.14 marks a build in progress by a file `lock` whose existence alone makes
    every later load wait, silently and forever where the build was killed (Ctrl-C during a first
    build). Called under the family's OS lock, so no build of ours is running."""
    from torch.utils import cpp_extension

    baton = build_dir / "lock"
    if hasattr(cpp_extension, "FileBaton") and baton.exists():
        print(f"magicube: removing {baton}, left by a build of the {family} kernels that was stopped",
              file=sys.stderr, flush=True)
        baton.unlink()


@functools.cache
def ops_or_none(op: str):
    """torch.ops.magicube_cuda if the family of `op` can be loaded here, else None (with a warning).

    A missing toolchain or kernel source falls back to the reference, which also runs on the
    GPU; a compile error in a present source is raised, never hidden.
    """
    family = OP_FAMILY[op]
    if not sources(family)[0].exists() or toolchain():
        why = toolchain() or f"no kernel source for {family!r}"
        warnings.warn(f"magicube: {op} runs the pure-PyTorch reference on the GPU ({why}); it is slow",
                      stacklevel=3)
        return None
    load(family)
    return torch.ops.magicube_cuda


def _build_one(family: str) -> tuple[str, int, str]:
    # A process per family: each loads what it built, so parallel builds never share a dispatcher.
    entry = "import sys; from magicube.ops.extension import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", entry, "--sequential", family], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # one stream, in the order it was written
    return family, run.returncode, run.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="magicube build",
                                     description="Build the CUDA kernels ahead of time.")
    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help=f"any of {FAMILIES} (default: all)")
    parser.add_argument("--sequential", action="store_true", help="build in this process, one family at a time "
                        "(default: a process per family, as many at once as half the CPUs allow)")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}: expected any of {FAMILIES}")
    args.families = args.families or list(FAMILIES)
    reason = toolchain()
    if reason:
        print(f"magicube: cannot build the kernels: {reason}", file=sys.stderr)
        return 1
    workers = min(len(args.families), (os.cpu_count() or 1) // 2)
    if args.sequential or workers <= 1:
        failed = []
        for family in args.families:
            try:
                load(family)
                print(f"magicube: {family} kernels built", flush=True)
            except (RuntimeError, FileNotFoundError) as err:
                print(f"magicube: building the {family} kernels failed:\n{err}", file=sys.stderr, flush=True)
                failed.append(family)
        return 1 if failed else 0
    print(f"magicube: building {', '.join(args.families)} ({workers} at a time)", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(_build_one, args.families))
    for _, _, output in results:
        print(output, end="", flush=True)
    return 1 if any(code for _, code, _ in results) else 0
