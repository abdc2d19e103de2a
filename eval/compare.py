"""Two runs of one benchmark, cell by cell.

    magicube compare eval/results/spmm_nvidia_h200.json new/spmm_nvidia_h200.json [--by v]

A benchmark's speedups are against a baseline timed in the same run (cuBLAS, SDPA flash), and a
baseline's own time moves from machine to machine by a few percent: two runs' speedups can move
apart while every kernel of ours ran as fast as before. This compares the times themselves: for
each kernel (or method), the geometric mean over the cells both runs timed of new time / old
time, overall and by one of the cells' parameters (sparsity by default). Under 1 is faster. The
baselines are kernels of their own in the table, so their drift shows beside ours.

Cells are matched on the parameters that name them (`IDENTITY`); a cell that only one run timed
is counted, not compared. Times are `median_ms` where a benchmark records it, else `ms`. A
`magicube bench` JSON gives each backend's model and layer as two kernels; compare runs of the
same options (`--cuda-graph`, `--compile`, `--scales`), which the JSON records but this does not
match.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from magicube.eval.args import output_prefix
from magicube.eval.evaluate import read_json, write_markdown_and_json

# Record fields that name a cell (those a record has): what it runs, then its shape and pattern.
IDENTITY = ("section", "kernel", "method", "kind", "mask", "b", "h", "seq", "d", "bh", "m", "k", "n", "v",
            "sparsity")
LABELS = ("kernel", "method")


def _time(record: dict) -> float | None:
    t = record.get("median_ms", record.get("ms"))
    return t if isinstance(t, (int, float)) and t > 0 else None


def _records(run: dict, where: str) -> list[dict]:
    """The kernel benchmarks' records; `magicube bench`'s rows as two records each, the model and
    the layer of one backend."""
    if isinstance(run, dict) and isinstance(run.get("records"), list):
        return run["records"]
    if isinstance(run, dict) and isinstance(run.get("rows"), list):
        return [{"kernel": f"{row['backend']} {part}", "b": row.get("batch"), "seq": row.get("length"),
                 "h": row.get("heads"), "sparsity": row.get("sparsity"), "v": row.get("v"),
                 "median_ms": row[part].get("median_ms")}
                for row in run["rows"] for part in ("model", "layer") if isinstance(row.get(part), dict)]
    raise ValueError(f"{where}: neither 'records' (bench_spmm, bench_sddmm, bench_attention) nor 'rows' "
                     "(magicube bench)")


def _cells(run: dict, where: str) -> dict[tuple, dict]:
    cells = {}
    for r in _records(run, where):
        if _time(r) is not None and any(label in r for label in LABELS):
            cells[tuple((f, r[f]) for f in IDENTITY if f in r)] = r
    return cells


def compare(old: dict, new: dict, by: str = "sparsity", names: tuple[str, str] = ("old run", "new run")) -> dict:
    """Geometric means of new / old time per kernel, overall and by the parameter `by`; `names`
    are the runs' in messages (their files)."""
    a, b = _cells(old, names[0]), _cells(new, names[1])
    common = a.keys() & b.keys()
    if not common:
        raise ValueError("the two runs time no cell in common (different benchmarks or configurations?)")
    ratios: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for key in common:
        label = " / ".join(str(b[key][f]) for f in ("section", *LABELS) if f in b[key])
        ratio = _time(b[key]) / _time(a[key])
        ratios[label]["all"].append(ratio)
        if by in b[key]:
            ratios[label][b[key][by]].append(ratio)

    if not any(by in b[key] for key in common):
        named = sorted({f for key in common for f, _ in key if f not in LABELS})
        raise ValueError(f"--by: no cell of the two runs has {by!r}; their cells have {', '.join(named)}")
    geomean = statistics.geometric_mean
    groups = sorted({g for per in ratios.values() for g in per if g != "all"}, key=lambda g: (str(type(g)), g))
    rows = {label: {"cells": len(per["all"]), "all": geomean(per["all"]),
                    "by": {str(g): geomean(per[g]) for g in groups if g in per}}
            for label, per in sorted(ratios.items())}
    return {"old": _environment(old), "new": _environment(new), "by": by, "groups": [str(g) for g in groups],
            "rows": rows, "only_old": len(a.keys() - common), "only_new": len(b.keys() - common)}


def _environment(run: dict) -> dict:
    return {k: run.get("environment", {}).get(k) for k in ("device", "commit", "time")}


def to_markdown(result: dict) -> str:
    head = ["kernel", "cells", "all", *(f"{result['by']} {g}" for g in result["groups"])]
    lines = ["new / old time, geometric means over the cells both runs timed (under 1: faster)", "",
             f"- old: {result['old']['device']}, commit {result['old']['commit']}, {result['old']['time']}",
             f"- new: {result['new']['device']}, commit {result['new']['commit']}, {result['new']['time']}",
             f"- cells timed by one run only: {result['only_old']} (old), {result['only_new']} (new)", "",
             "| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    for label, row in result["rows"].items():
        cells = [f"{row['by'][g]:.3f}" if g in row["by"] else "" for g in result["groups"]]
        lines.append("| " + " | ".join([label, str(row["cells"]), f"{row['all']:.3f}", *cells]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="magicube compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="a benchmark JSON (bench_spmm, bench_sddmm, bench_attention, "
                        "magicube bench)")
    parser.add_argument("new", type=Path, help="a JSON of the same benchmark to compare with it")
    parser.add_argument("--by", default="sparsity", help="the cell parameter of the columns (default: sparsity)")
    parser.add_argument("--out", type=output_prefix, help="path without suffix: .md and .json are written")
    args = parser.parse_args(argv)
    for path in (args.old, args.new):
        if not path.is_file():
            parser.error(f"no such benchmark JSON: {path}")
    try:
        result = compare(read_json(args.old), read_json(args.new), args.by, (str(args.old), str(args.new)))
    except ValueError as e:
        parser.error(str(e))
    text = to_markdown(result)
    print(text, end="")
    if args.out:
        write_markdown_and_json(text, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
