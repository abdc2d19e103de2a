"""The paper's accuracy table (its Table V) assembled from `magicube evaluate` reports.

    magicube table runs/*/eval_test.json runs/*/finetune_*/eval_test.json --out eval/results/table5

Rows are precisions, columns the mask kind x sparsity of the sparse models. Each cell comes
from the report that owns it: the dense rows from the dense model's report, "sparse fp16"
from a sparse model's, and a quantized row from the checkpoint finetuned for that precision
(its `quant_precision`); a quantized backend evaluated on the unfinetuned sparse model fills
the "no finetuning" row instead.

Finetuning trains the weights further, so a quantized model can beat the fp16 sparse model it
started from. A finetuned checkpoint evaluated with `sparse` as well fills the row "fp16, P
weights": the same weights through the fp16 kernels. A quantized cell shows its distance to
that row where it exists (the cost of the integer kernels alone), else to "sparse fp16".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from magicube.eval.args import output_prefix
from magicube.eval.evaluate import read_json, write_markdown_and_json
from magicube.model.lra import QUANTIZED

DENSE_ROWS = {"dense": "dense fp32", "dense-fp16": "dense fp16"}


def _column(report: dict) -> str:
    return f"{report['mask_kind']} {report['sparsity']}"


def collect(reports: list[dict]) -> dict:
    """{"columns": [...], "cells": {row: {column: accuracy}}} from evaluate reports."""
    cells: dict[str, dict[str, float]] = {}
    columns: list[str] = []

    def put(row, column, accuracy, where):
        if column in cells.setdefault(row, {}):
            raise ValueError(f"two reports give {row!r} for {column!r} (the second: {where})")
        cells[row][column] = accuracy

    for report in reports:
        where = report.get("checkpoint", "?")
        precision = report.get("quant_precision")
        for r in report["results"]:
            backend = r["backend"]
            if backend in DENSE_ROWS:
                if report["trained_with"] == "dense":
                    put(DENSE_ROWS[backend], "dense", r["accuracy"], where)
                continue
            column = _column(report)
            if backend == "sparse":
                put(fp16_row(precision) if precision else "sparse fp16", column, r["accuracy"], where)
            elif backend in QUANTIZED:
                put(backend if precision == backend else f"{backend} (no finetuning)", column, r["accuracy"], where)
            else:
                continue  # the training paths (masked, fake) are not rows of the table
            if column not in columns:
                columns.append(column)
    return {"columns": sorted(columns), "cells": cells}


def fp16_row(precision: str) -> str:
    return f"fp16, {precision} weights"


def row_order(cells: dict) -> list[str]:
    order = ["dense fp32", "dense fp16", "sparse fp16", *(r for p in QUANTIZED for r in (p, fp16_row(p))),
             *(f"{p} (no finetuning)" for p in QUANTIZED)]
    return [r for r in order if r in cells]


def to_markdown(table: dict) -> str:
    cols, cells = table["columns"], table["cells"]
    lines = ["| precision | dense | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * (len(cols) + 1)]
    for row in row_order(cells):
        out = [f"{100 * cells[row]['dense']:.2f}" if "dense" in cells[row] else ""]
        for col in cols:
            acc = cells[row].get(col)
            same_weights = cells.get(fp16_row(row), {}).get(col)
            base, name = ((same_weights, "its fp16") if same_weights is not None
                          else (cells.get("sparse fp16", {}).get(col), "sparse fp16"))
            if acc is None:
                out.append("")
            elif row.split()[0] in QUANTIZED and base is not None:
                out.append(f"{100 * acc:.2f} ({100 * (acc - base):+.2f} vs {name})")
            else:
                out.append(f"{100 * acc:.2f}")
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    note = ("\nTest accuracy in %. In parentheses, a quantized model's distance to its own weights through "
            "the fp16 kernels (row \"fp16, P weights\") where that was evaluated, else to the fp16 sparse model "
            "of the same mask and sparsity that finetuning started from.\n")
    return "\n".join(lines) + "\n" + note


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="magicube table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="JSON reports of `magicube evaluate`")
    parser.add_argument("--out", type=output_prefix, help="path without suffix: .md and .json are written")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        parser.error(f"no such report: {', '.join(missing)}")
    try:
        reports = [read_json(p) for p in args.reports]
    except ValueError as e:
        parser.error(str(e))
    for path, report in zip(args.reports, reports):
        if not (isinstance(report, dict) and isinstance(report.get("results"), list) and "trained_with" in report):
            parser.error(f"{path}: not a report of `magicube evaluate` (a report has 'results' and 'trained_with')")
    table = collect(reports)
    table["sources"] = [{"report": str(p), "checkpoint": r.get("checkpoint"), "commit": r.get("commit"),
                         "device": r.get("device")} for p, r in zip(args.reports, reports)]
    text = to_markdown(table)
    print(text)
    if args.out:
        write_markdown_and_json(text, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
