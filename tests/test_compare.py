"""Two benchmark runs compared time against time, cell by cell."""
import json
import math

import pytest

from magicube.eval.cli import main
from magicube.eval.compare import compare, to_markdown


def run(times: dict, commit: str, field: str = "ms") -> dict:
    """A bench_spmm-like JSON: {(kernel, v, sparsity): time}, plus a baseline record without a pattern."""
    records = [{"m": 1024, "k": 1024, "n": 256, "kernel": "cublas_fp16", field: times["cublas"]}]
    records += [{"m": 1024, "k": 1024, "n": 256, "kernel": key[0], "v": key[1], "sparsity": key[2], field: t,
                 "speedup": 1.0} for key, t in times.items() if key != "cublas"]
    return {"environment": {"device": "GPU", "commit": commit, "time": "now"}, "records": records}


OLD = {"cublas": 10.0, ("L8-R8", 2, 0.7): 4.0, ("L8-R8", 8, 0.7): 2.0, ("L8-R8", 8, 0.9): 1.0,
       ("L16-R8", 8, 0.9): 3.0}


def test_ratios_are_geometric_means_of_new_over_old_time():
    new = {"cublas": 9.0, ("L8-R8", 2, 0.7): 2.0, ("L8-R8", 8, 0.7): 2.0, ("L8-R8", 8, 0.9): 1.5,
           ("L16-R8", 8, 0.9): 3.3}
    result = compare(run(OLD, "a"), run(new, "b"))
    rows = result["rows"]
    assert rows["L8-R8"]["cells"] == 3
    assert rows["L8-R8"]["all"] == pytest.approx((0.5 * 1.0 * 1.5) ** (1 / 3))
    assert rows["L8-R8"]["by"] == pytest.approx({"0.7": math.sqrt(0.5 * 1.0), "0.9": 1.5})
    assert rows["L16-R8"]["by"] == pytest.approx({"0.9": 1.1}) and "0.7" not in rows["L16-R8"]["by"]
    # the baseline is a kernel of its own, without a sparsity
    assert (rows["cublas_fp16"]["cells"], rows["cublas_fp16"]["by"]) == (1, {})
    assert rows["cublas_fp16"]["all"] == pytest.approx(0.9)
    assert result["groups"] == ["0.7", "0.9"] and (result["old"]["commit"], result["new"]["commit"]) == ("a", "b")
    by_v = compare(run(OLD, "a"), run(new, "b"), by="v")["rows"]["L8-R8"]["by"]
    assert by_v == pytest.approx({"2": 0.5, "8": math.sqrt(1.0 * 1.5)})


def test_cells_of_one_run_only_are_counted_not_compared():
    new = {"cublas": 10.0, ("L8-R8", 2, 0.7): 8.0, ("L4-R4", 2, 0.7): 1.0}
    result = compare(run(OLD, "a"), run(new, "b"))
    assert set(result["rows"]) == {"cublas_fp16", "L8-R8"}
    row = result["rows"]["L8-R8"]
    assert row["cells"] == 1 and row["all"] == pytest.approx(2.0) and row["by"] == pytest.approx({"0.7": 2.0})
    assert (result["only_old"], result["only_new"]) == (3, 1)


def test_median_ms_is_the_time_where_recorded():
    old, new = run(OLD, "a", "median_ms"), run(OLD, "b", "median_ms")
    for r in new["records"]:
        r["median_ms"] *= 2
        r["ms"] = 1e-9  # a field the benchmark did not mean as the time
    assert all(row["all"] == pytest.approx(2.0) for row in compare(old, new)["rows"].values())


def test_runs_without_common_cells_or_records_are_refused():
    with pytest.raises(ValueError, match="no cell in common"):
        compare(run(OLD, "a"), {"records": [{"kernel": "L4-R4", "m": 64, "ms": 1.0}]})
    with pytest.raises(ValueError, match="neither 'records'"):
        compare({"results": []}, run(OLD, "b"))


def test_model_bench_rows_are_a_model_and_a_layer_kernel_each():
    def bench(layer_ms: float) -> dict:
        shape = {"batch": 8, "length": 4096, "heads": 4, "sparsity": 0.9, "v": 8}
        return {"environment": {}, "cuda_graph": True,
                "rows": [{"backend": "dense", **shape, "model": {"median_ms": 4.0}, "layer": {"median_ms": 0.3}},
                         {"backend": "8b-8b", **shape, "model": {"median_ms": 3.0}, "layer": {"median_ms": layer_ms}}]}

    rows = compare(bench(0.2), bench(0.15))["rows"]
    assert set(rows) == {"dense model", "dense layer", "8b-8b model", "8b-8b layer"}
    assert rows["8b-8b layer"]["all"] == pytest.approx(0.75) and rows["dense layer"]["all"] == pytest.approx(1.0)
    assert rows["8b-8b model"]["by"] == pytest.approx({"0.9": 1.0})


def test_command_prints_and_writes_the_table(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(run(OLD, "a")))
    new.write_text(json.dumps(run({**OLD, ("L8-R8", 2, 0.7): 5.0}, "b")))
    assert main(["compare", str(old), str(new), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "| L8-R8 | 3 | 1.077 | 1.118 | 1.000 |" in printed
    assert (tmp_path / "cmp.md").read_text() == printed
    assert json.loads((tmp_path / "cmp.json").read_text())["rows"]["L8-R8"]["cells"] == 3
    with pytest.raises(SystemExit):
        main(["compare", str(old), str(tmp_path / "missing.json")])
    assert "no such benchmark JSON" in capsys.readouterr().err
    # a file that holds no JSON, and a --by that no cell has, are named (before: the decoder's
    # message alone, and a table without the breakdown)
    (tmp_path / "cut.json").write_text('{"records": [')
    with pytest.raises(SystemExit):
        main(["compare", str(old), str(tmp_path / "cut.json")])
    assert f"{tmp_path / 'cut.json'}: not a readable JSON file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(old), str(new), "--by", "sparsty"])
    assert "--by: no cell of the two runs has 'sparsty'; their cells have" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")  # JSON, but no benchmark's (an AttributeError before)
    with pytest.raises(SystemExit):
        main(["compare", str(tmp_path / "list.json"), str(new)])
    assert f"{tmp_path / 'list.json'}: neither 'records'" in capsys.readouterr().err


def test_markdown_leaves_groups_a_kernel_lacks_empty():
    result = compare(run(OLD, "a"), run(OLD, "b"))
    lines = to_markdown(result).splitlines()
    assert "| L16-R8 | 1 | 1.000 |  | 1.000 |" in lines
