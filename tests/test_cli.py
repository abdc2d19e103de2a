"""The `magicube` command line."""
import contextlib
import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import imdb_source, signal_at_forward
from magicube.eval.cli import main
from magicube.train import listops

SMALL = ["data.generate.num_train=128", "data.generate.num_val=16", "data.generate.num_test=24",
         "data.generate.max_length=60", "model.max_len=64", "model.emb_dim=32", "model.mlp_dim=64",
         "train.steps=4", "train.batch_size=16", "train.warmup=2", "train.eval_every=2", "train.log_every=1"]


def _paths(tmp_path):
    return [f"data.path={tmp_path / 'listops'}", f"data.cache_dir={tmp_path / 'cache'}"]


def test_demo_trains_finetunes_and_evaluates_every_backend(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out-dir", str(out), "--no-progress", *SMALL, *_paths(tmp_path),
                 "finetune.train.steps=3"]) == 0
    text = capsys.readouterr().out
    for backend in ("dense", "sparse-masked", "sparse", "16b-8b", "8b-8b", "8b-4b", "8b-8b-fake"):
        assert f"| {backend} |" in text
    assert "after 3 finetuning steps for 8b-8b: sparse " in text and ", 8b-8b " in text
    tuned = json.loads((out / "finetune_8b-8b" / "eval_test.json").read_text())
    assert tuned["quant_precision"] == "8b-8b" and tuned["step"] == 3
    assert [r["backend"] for r in tuned["results"]] == ["sparse-masked", "sparse", "8b-8b-fake", "8b-8b"]
    report = json.loads((out / "eval_test.json").read_text())
    assert report["step"] == 4 and report["split"] == "test"
    assert [r["examples"] for r in report["results"]] == [24] * 6
    assert [r["nonfinite"] for r in report["results"]] == [0] * 6
    rows = {r["backend"]: r for r in report["results"]}
    # the fp16 ops and the fp32 training path are the same function
    assert abs(rows["sparse"]["loss"] - rows["sparse-masked"]["loss"]) < 1e-2
    assert (out / "eval_test.md").read_text().startswith("listops test accuracy")

    # evaluate again from the run folder, with a chosen subset of backends ("sparse" alone is the ops
    # alone) and a report name with a dot in it (the suffixes are appended to it)
    assert main(["evaluate", str(out), "--backends", "dense", "sparse", "8b-8b", "dense-fp16", "--no-progress",
                 "--fused", "--out", str(tmp_path / "again_0.9")]) == 0
    again = json.loads((tmp_path / "again_0.9.json").read_text())
    assert (tmp_path / "again_0.9.md").is_file()
    assert again["fused"] and [r["backend"] for r in again["results"]] == ["dense", "sparse", "8b-8b", "dense-fp16"]
    assert [again["results"][i]["loss"] for i in (0, 2)] == [rows["dense"]["loss"], rows["8b-8b"]["loss"]]
    assert abs(again["results"][1]["loss"] - rows["sparse"]["loss"]) < 1e-2
    # fp16 is the same model with rounding: close to fp32, yet not bit-identical (it did run in fp16)
    half = again["results"][3]["loss"]
    assert half != rows["dense"]["loss"] and abs(half - rows["dense"]["loss"]) < 1e-2


def test_a_stopped_demo_says_how_to_go_on_and_exits_as_a_shell_would(tmp_path, capsys, monkeypatch):
    args = ["demo", "--out-dir", str(tmp_path / "demo"), "--no-progress", *SMALL, *_paths(tmp_path)]
    signal_at_forward(monkeypatch, call=2)  # Ctrl-C in the second training step; SMALL logs every step
    assert main(args) == 130
    out = capsys.readouterr().out
    assert "stopping at step 2: SIGINT received" in out and "add --resume to the same command" in out
    monkeypatch.undo()
    assert main([*args[:1], "--resume", *args[1:]]) == 0
    assert "resuming from" in capsys.readouterr().out


def test_train_resumes_and_data_listops(tmp_path, capsys):
    cfg = [*SMALL, *_paths(tmp_path), f"out_dir={tmp_path / 'run'}"]
    assert main(["train", "--config", "tiny", "--no-progress", *cfg]) == 0
    assert main(["train", "--config", "tiny", "--no-progress", *cfg, "train.steps=6"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert main(["data", "listops", "--config", "tiny", "--out", str(tmp_path / "lo"), "data.generate.num_train=10",
                 "data.generate.num_val=2", "data.generate.num_test=2"]) == 0
    assert len(listops.read_tsv(tmp_path / "lo" / "basic_train.tsv")[1]) == 10


def test_data_imdb_reports_the_archive(capsys):
    src = imdb_source()
    if src is None:
        pytest.skip("aclImdb_v1.tar.gz not found (set MAGICUBE_IMDB)")
    assert main(["data", "imdb", "--path", str(src)]) == 0
    out = capsys.readouterr().out
    assert "train: 25000 reviews, 12500 positive" in out and "is complete" in out


def test_finetune_command(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--no-progress", *SMALL, *_paths(tmp_path), f"out_dir={run}"]) == 0
    with pytest.raises(SystemExit):
        main(["finetune", "--precision", "8b-8b"])  # --from is required
    assert main(["finetune", "--from", str(tmp_path / "nothing"), "--no-progress"]) == 1
    assert "magicube train" in capsys.readouterr().err
    args = ["finetune", "--from", str(run), "--precision", "8b-4b", "--config", "tiny", "--no-progress",
            "train.steps=2", "finetune.scales=fixed", "finetune.granularity=tensor", "finetune.calibration_batches=1"]
    assert main(args) == 0
    assert "finetuned" in capsys.readouterr().out
    tuned = run / "finetune_8b-4b"
    assert main(args) == 0 and "resuming from" in capsys.readouterr().out
    assert main(["evaluate", str(tuned), "--backends", "8b-8b", "--no-progress"]) == 1
    assert "quantization-finetuned for 8b-4b" in capsys.readouterr().err
    assert main(["evaluate", str(tuned), "--backends", "8b-4b", "--no-progress", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["quant_scales"] == "fixed"


def test_evaluation_report_flags_non_finite_logits():
    from magicube.eval.evaluate import to_markdown

    rows = [dict(backend=b, description=b, accuracy=0.5, loss=x, examples=10, nonfinite=n, seconds=1.0)
            for b, x, n in (("sparse", 0.7, 0), ("8b-8b", float("nan"), 3))]
    report = dict(task="text", split="test", step=1, quant_precision=None, trained_with="sparse", mask_kind="random",
                  sparsity=0.9, v=8, device="cpu", majority_baseline=0.5, results=rows)
    md = to_markdown(report)
    assert "**8b-8b: 3 of 10 examples had non-finite logits**" in md and "sparse: " not in md


def test_cli_names_the_model_backends():
    from magicube.eval import cli
    from magicube.model import QUANTIZED

    assert cli.QUANTIZED == tuple(QUANTIZED)


def test_bench_checks_every_backend_and_says_cpu_timings_are_cpu_timings(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--anything"])
    with pytest.raises(SystemExit):  # it ran, and its JSON said the timings were CUDA graph replays
        main(["bench", "--device", "cpu", "--cuda-graph"])
    assert "--cuda-graph: CUDA graphs need a CUDA device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # a RuntimeError from deep in torch before
            main(["bench", "--device", "cuda"])
        assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--backends", "materialized", "sparse", "8b-8b", "--reps", "3",
                 "--out", str(tmp_path)]) == 0
    assert "these are CPU timings" in capsys.readouterr().err
    result = json.loads((tmp_path / "bench_model.json").read_text())
    rows = {r["backend"]: r for r in result["rows"]}
    assert set(rows) == {"materialized", "sparse", "8b-8b"} and (tmp_path / "bench_model.png").exists()
    # each backend's output was compared with an fp32 reference of the same masked model
    assert rows["materialized"]["model_rel_err"] < 1e-5 and rows["sparse"]["model_rel_err"] < 1e-2
    assert 0 < rows["8b-8b"]["layer_rel_err"] < 0.05
    assert result["environment"]["device"].startswith("CPU")


@pytest.mark.parametrize("args, message", [
    (["bench", "--reps", "0"], "argument --reps: expected a positive integer, got 0"),
    (["bench", "--batch", "2", "-1"], "argument --batch: expected a positive integer, got -1"),
    (["bench", "--heads", "two"], "argument --heads: expected a positive integer, got 'two'"),
    (["bench", "--sparsity", "1.5"], r"argument --sparsity: expected a fraction in \[0, 1\), got 1.5"),
    (["evaluate", "run", "--batch-size", "0"], "argument --batch-size: expected a positive integer, got 0"),
    (["evaluate", "run", "--max-batches", "-2"], "argument --max-batches: expected a positive integer, got -2"),
])
def test_counts_out_of_range_are_refused_by_option(args, message, capsys):
    """Refused as the command line is read, naming the option. Before, evaluate's --batch-size 0 fell
    back to the config's batch size and --max-batches -2 kept all but the last 2 x batch size examples
    of the shuffled split; the benchmark took such values into the run."""
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err
    assert re.search(message, err)
    assert f"magicube {args[0]}: error:" in err  # the command the user typed, not the module behind it


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path)]) == 1
    assert "magicube train" in capsys.readouterr().err
    assert main(["train", "--config", "nope"]) == 1
    (tmp_path / "a_file").touch()  # where a folder should go
    assert main(["data", "listops", "--config", "tiny", "--out", str(tmp_path / "a_file")]) == 1
    assert re.search(r"magicube data: error: .*a_file: cannot write files there \(a file, not a folder\)",
                     capsys.readouterr().err)


@pytest.mark.parametrize("args", [["evaluate", "run", "--out", "{f}/report"], ["table", "r.json", "--out", "{f}/t"],
                                  ["compare", "a.json", "b.json", "--out", "{f}/c"], ["bench", "--out", "{f}/b"],
                                  ["train", "--config", "tiny", "out_dir={f}/run"]])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(args, tmp_path, capsys):
    """Before, `evaluate` ran every backend over the split (minutes on LRA text) and then lost the
    report to "[Errno 17] File exists"; the benchmarks lost their first row."""
    (tmp_path / "a_file").touch()
    args = [a.format(f=tmp_path / "a_file") for a in args]
    with contextlib.suppress(SystemExit):
        assert main(args) == 1
    err = capsys.readouterr().err
    assert re.search(rf"magicube {args[0]}: error: (argument --out|out_dir): .*a_file.*: cannot write files there", err)


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "magicube.eval.cli", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout
