"""The accuracy table: each cell from the report that owns it, quantized cells against fp16 of the same weights
where evaluated, else against fp16 sparse."""
import json

import pytest

from magicube.eval.cli import main
from magicube.eval.table import collect, to_markdown


def report(trained_with, mask_kind, sparsity, results, precision=None):
    return {"checkpoint": f"runs/{trained_with}-{mask_kind}-{sparsity}-{precision}", "trained_with": trained_with,
            "mask_kind": mask_kind, "sparsity": sparsity, "quant_precision": precision,
            "results": [{"backend": b, "accuracy": a} for b, a in results.items()]}


REPORTS = [
    report("dense", "random", 0.9, {"dense": 0.63, "dense-fp16": 0.6298, "sparse-masked": 0.55}),
    report("sparse", "random", 0.9, {"sparse-masked": 0.601, "sparse": 0.6, "8b-8b": 0.58}),
    report("sparse", "structured", 0.95, {"sparse": 0.62}),
    report("8b-4b", "structured", 0.95, {"8b-4b": 0.625}, precision="8b-4b"),
    report("8b-8b", "random", 0.9, {"sparse": 0.59, "8b-8b-fake": 0.597, "8b-8b": 0.596}, precision="8b-8b"),
]


def test_cells_come_from_the_report_that_owns_them():
    table = collect(REPORTS)
    assert table["columns"] == ["random 0.9", "structured 0.95"]
    cells = table["cells"]
    assert cells["dense fp32"] == {"dense": 0.63} and cells["dense fp16"] == {"dense": 0.6298}
    assert cells["sparse fp16"] == {"random 0.9": 0.6, "structured 0.95": 0.62}
    assert cells["8b-8b"] == {"random 0.9": 0.596}  # the finetuned checkpoint, not its fp16 or fake rows
    assert cells["fp16, 8b-8b weights"] == {"random 0.9": 0.59}
    assert cells["8b-8b (no finetuning)"] == {"random 0.9": 0.58}
    md = to_markdown(table)
    assert "| 8b-8b |  | 59.60 (+0.60 vs its fp16) |  |" in md and "| dense fp32 | 63.00 |  |  |" in md
    assert "| 8b-4b |  |  | 62.50 (+0.50 vs sparse fp16) |" in md
    rows = [line.split(" | ")[0] for line in md.splitlines()[2:] if line.startswith("| ")]
    assert rows == ["| dense fp32", "| dense fp16", "| sparse fp16", "| 8b-8b", "| fp16, 8b-8b weights", "| 8b-4b",
                    "| 8b-8b (no finetuning)"]


def test_two_reports_for_one_cell_are_an_error():
    with pytest.raises(ValueError, match="two reports give 'sparse fp16' for 'random 0.9'"):
        collect(REPORTS + [REPORTS[1]])


def test_command_writes_markdown_and_json(tmp_path):
    paths = []
    for i, r in enumerate(REPORTS):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert main(["table", *map(str, paths), "--out", str(tmp_path / "t5")]) == 0
    saved = json.loads((tmp_path / "t5.json").read_text())
    assert saved["cells"]["8b-8b"] == {"random 0.9": 0.596} and len(saved["sources"]) == len(REPORTS)
    assert (tmp_path / "t5.md").read_text().startswith("| precision | dense | random 0.9 | structured 0.95 |")


def test_command_names_a_file_that_is_not_a_report(tmp_path, capsys):
    """A file that holds no JSON, or JSON that is not an evaluate report, is named (before: a
    JSONDecodeError's message alone, and a KeyError traceback)."""
    cut, bench = tmp_path / "cut.json", tmp_path / "bench.json"
    cut.write_text('{"results": [')
    bench.write_text(json.dumps({"records": []}))
    for path, message in ((cut, "not a readable JSON file"), (bench, "not a report of `magicube evaluate`")):
        with pytest.raises(SystemExit):
            main(["table", str(path)])
        assert f"{path}: {message}" in capsys.readouterr().err
