"""Training: configs, schedule, batching, checkpoints, and resume equivalence."""
import json
import math
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import signal_at_forward
from magicube.eval.evaluate import evaluate
from magicube.eval.timing import save_json
from magicube.model.lra import LRAClassifier
from magicube.train.config import apply_overrides, check_real, config_names, load_config
from magicube.train.checkpoint import latest_checkpoint, read_trainer_state, resolve_checkpoint
from magicube.train.files import check_writable, write_atomic
from magicube.train.listops import read_tsv, write_tsv
from magicube.train.trainer import StopSignals, accuracy, batch_indices, lr_lambda, lra_lr_lambda, train

TINY_OVERRIDES = [
    "data.generate.num_train=256", "data.generate.num_val=32", "data.generate.num_test=32",
    "data.generate.max_length=60", "model.max_len=64", "model.emb_dim=32", "model.mlp_dim=64",
    "model.dropout=0.1", "model.attention_dropout=0.1", "train.batch_size=16", "train.warmup=4",
    "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4", "train.keep_checkpoints=null",
]


def tiny_cfg(tmp_path, name, *extra, sizes=TINY_OVERRIDES):
    return load_config("tiny", [*sizes, f"data.path={tmp_path / 'listops'}",
                                f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / name}", *extra])


def test_configs_load_by_name_and_path(tmp_path, monkeypatch):
    assert {"tiny", "lra_text", "lra_listops"} <= set(config_names())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a run folder named like a config: the name still means the config
    assert load_config("tiny")["name"] == "tiny"
    text = load_config("lra_text")
    m, t = text["model"], text["train"]
    assert (m["max_len"], m["num_layers"], m["num_heads"], m["emb_dim"], m["mlp_dim"], m["sparsity"], m["v"]) == \
        (4096, 4, 4, 256, 1024, 0.9, 8)
    assert (t["lr"], t["warmup"], t["batch_size"], t["steps"], t["betas"], t["weight_decay"]) == \
        (0.05, 8000, 32, 20000, [0.9, 0.98], 0.1)
    lo = load_config("lra_listops")
    assert lo["model"]["max_len"] == 2000 and lo["data"]["task"] == "listops"
    p = tmp_path / "mine.yaml"
    p.write_text("a: {b: 1}\n")
    assert load_config(str(p), ["a.c=[1, 2]", "a.b=x"]) == {"a": {"b": "x", "c": [1, 2]}}
    with pytest.raises(FileNotFoundError, match="tiny"):
        load_config("no_such_config")
    with pytest.raises(ValueError, match="dotted.key=value"):
        apply_overrides({}, ["nonsense"])


def test_unknown_model_and_train_keys_are_refused_by_name(tmp_path):
    """A typo in an override would otherwise be kept and ignored (LRAConfig keeps any keyword)."""
    for extra, message in ((["train.max_minute=8"], r"train: unknown key max_minute; expected keys among steps"),
                           (["data.limt=8"], r"data: unknown key limt; expected keys among task"),
                           (["trian.steps=8"], r"config: unknown key trian; expected keys among name, seed"),
                           (["finetune.scale=fixed"], r"finetune: unknown key scale; expected keys among precision"),
                           (["model.heads=2", "model.sparsty=0.5"],
                            r"model: unknown keys heads, sparsty; expected keys among max_len")):
        with pytest.raises(ValueError, match=message):
            train(tiny_cfg(tmp_path, "typo", *extra), progress=False)
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("extra, message", [
    ("train.batch_size=0", r"train.batch_size: expected an integer >= 1, got 0"),
    ("train.steps=-1", r"train.steps: expected an integer >= 0, got -1"),
    ("train.steps=2.5", r"train.steps: expected an integer >= 0, got 2.5"),
    ("train.warmup=-1", r"train.warmup: expected an integer >= 0, got -1"),
    ("model.num_layers=0", r"num_layers: expected an integer >= 1, got 0"),
    ("train.log_every=0", r"train.log_every: expected an integer >= 1, got 0"),  # divided by zero
    ("train.keep_checkpoints=0", r"train.keep_checkpoints: expected an integer >= 1 or null"),
    ("train.eval_batches=-1", r"train.eval_batches: expected an integer >= 1 or null"),
    ("seed=x", r"seed: expected an integer >= 0, got 'x'"),
    # a negative clip norm scaled the gradients by a negative factor (an ascent, without a word)
    ("train.grad_clip=-1", r"train.grad_clip: expected a real number > 0 or null, got -1"),
    ("train.max_minutes=0", r"train.max_minutes: expected a real number > 0 or null, got 0"),
    ("train.lr=-0.1", r"train.lr: expected a real number >= 0, got -0.1"),
    ("train.lr=abc", r"train.lr: expected a real number >= 0, got 'abc'"),
    ("train.weight_decay=.nan", r"train.weight_decay: expected a real number >= 0, got nan"),
    ("train.scale_lr=true", r"train.scale_lr: expected a real number >= 0, got True"),
    ("train.betas=[0.9]", r"train.betas: expected two numbers in \[0, 1\)"),
    ("train.betas=[0.9, 1]", r"train.betas\[1\]: expected a real number >= 0 and < 1, got 1"),
    ("train.schedule=cosine", r"train.schedule: expected 'lra' or 'constant', got 'cosine'"),
    ("data.task=image", r"data.task: expected one of \('text', 'listops'\), got 'image'"),
    ("data.limit=0", r"data.limit: expected an integer >= 1 or null, got 0"),
    ("data.auto_generate=maybe", r"data.auto_generate: expected true or false, got 'maybe'"),  # not taken for true
    ("train.cpu=maybe", r"train.cpu: expected true or false, got 'maybe'"),
    ("train=5", r"train: expected a section of key: value settings, got 5"),
    ("model=[1]", r"model: expected a section of key: value settings, got \[1\]"),
    ("data=null", r"data: expected a section of key: value settings, got None"),
    ("eval.batch_size=0", r"eval.batch_size: expected an integer >= 1 or null, got 0"),
    ("eval.splt=val", r"eval: unknown key splt; expected keys among split, batch_size, backends"),
])
def test_settings_out_of_range_are_refused_by_name(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_cfg(tmp_path, "refused", extra), progress=False)
    assert not (tmp_path / "refused").exists()


def test_a_number_yaml_reads_as_a_string_is_the_number_it_spells():
    assert apply_overrides({}, ["train.lr=1e-3"])["train"]["lr"] == "1e-3"  # YAML 1.1 wants a dot
    assert check_real("train.lr", "1e-3", least=0) == 1e-3


def test_accelerator_settings_are_checked_by_name(tmp_path):
    """An unknown mixed precision is refused by name, and so is a run that asks for other settings
    than an earlier run in the process had (accelerate keeps one state a process)."""
    from accelerate import Accelerator

    with pytest.raises(ValueError, match=r"train.mixed_precision: expected one of \('no', 'fp16', 'bf16'\), "
                                         r"got 'fp32'"):
        train(tiny_cfg(tmp_path, "mixed", "train.mixed_precision=fp32"), progress=False)
    now = Accelerator().state.mixed_precision  # the process's, as earlier tests left it
    other = "fp16" if now == "bf16" else "bf16"
    with pytest.raises(ValueError, match=rf"train.mixed_precision='{other}', train.cpu=False: this process already "
                                         rf"trains with mixed precision '{now}'.* new process"):
        train(tiny_cfg(tmp_path, "mixed", f"train.mixed_precision={other}"), progress=False)
    assert not (tmp_path / "mixed").exists()


def test_lra_schedule():
    f = lra_lr_lambda(100)
    assert f(0) == pytest.approx(0.01 / 10)
    assert f(49) == pytest.approx(0.5 / 10)
    assert f(99) == pytest.approx(1 / 10)  # peak = lr / sqrt(warmup)
    assert f(399) == pytest.approx(1 / math.sqrt(400))
    flat = lr_lambda({"schedule": "constant", "warmup": 10})  # finetuning: warm-up, then the base lr
    assert (flat(0), flat(9), flat(500)) == (pytest.approx(0.1), 1.0, 1.0)
    assert lr_lambda({"warmup": 100})(99) == f(99)  # lra by default
    assert [lra_lr_lambda(0)(s) for s in (0, 3)] == [1.0, 0.5]  # no warm-up: rsqrt decay from the first step
    with pytest.raises(ValueError, match="schedule"):
        lr_lambda({"schedule": "cosine", "warmup": 1})


def test_batches_are_a_function_of_the_step():
    b = [batch_indices(s, 100, 32, seed=0) for s in range(3)]
    assert torch.equal(b[1], batch_indices(1, 100, 32, seed=0))
    assert len(set(torch.cat(b).tolist())) == 96  # one epoch without repeats
    assert not torch.equal(batch_indices(3, 100, 32, 0), b[0])  # next epoch reshuffled


def _weights(ckpt):
    return load_file(ckpt / "model.safetensors")


def _records(run):
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_matches_uninterrupted_run(tmp_path, capsys):
    full = train(tiny_cfg(tmp_path, "full", "train.steps=12"), progress=False)
    assert full["step"] == 12

    cfg = tiny_cfg(tmp_path, "cut", "train.steps=12")
    cut = train(cfg, progress=False, stop_after=6)  # interrupted between checkpoints 4 and 8
    assert cut["step"] == 6 and latest_checkpoint(tmp_path / "cut").name == "step_0000004"
    # a crash while writing a checkpoint leaves only a temporary folder, which resume ignores
    (tmp_path / "cut" / "checkpoints" / ".tmp_step_0000008").mkdir()
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:  # and a kill while logging, a torn last record
        f.write('{"step": 7, "lo')
    resumed = train(cfg, progress=False)
    assert resumed["step"] == 12

    a, b = tmp_path / "full" / "checkpoints" / "step_0000012", tmp_path / "cut" / "checkpoints" / "step_0000012"
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = read_trainer_state(a)["optimizer"]["state"], read_trainer_state(b)["optimizer"]["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)
    assert _records(tmp_path / "full") == _records(tmp_path / "cut")  # no duplicated or lost log lines
    assert full["eval_accuracy"] == resumed["eval_accuracy"]
    capsys.readouterr()
    assert train(cfg, progress=False)["step"] == 12  # a run at its end says so, rather than nothing
    assert "step_0000012 is at step 12 and train.steps=12: nothing to train" in capsys.readouterr().out


def test_deterministic_algorithms_for_the_run_only(tmp_path):
    """train.deterministic turns PyTorch's deterministic algorithms on for the run and gives the
    process its own setting back afterwards, also when the run fails; a non-bool is refused."""
    seen = []

    def init_model(config, split, device, resuming):
        seen.append(torch.are_deterministic_algorithms_enabled())
        if config.num_layers == 1:
            raise RuntimeError("a failing run")
        return LRAClassifier(config)

    assert load_config("tiny")["train"]["deterministic"] is True
    before = torch.are_deterministic_algorithms_enabled()
    for flag in ("true", "false"):
        train(tiny_cfg(tmp_path, f"det_{flag}", "train.steps=2", f"train.deterministic={flag}"), progress=False,
              init_model=init_model)
    with pytest.raises(RuntimeError, match="a failing run"):
        train(tiny_cfg(tmp_path, "det_fails", "model.num_layers=1"), progress=False, init_model=init_model)
    assert seen == [True, False, True] and torch.are_deterministic_algorithms_enabled() == before
    with pytest.raises(ValueError, match=r"train.deterministic: expected true or false, got 1"):
        train(tiny_cfg(tmp_path, "det_bad", "train.deterministic=1"), progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_runs_repeat_on_cuda(tmp_path):
    """At the tiny config's own sizes (batch 32, 128 tokens, a 20-token vocabulary: the
    embedding's backward adds many rows into each), two runs on a GPU give the same weights."""
    runs = []
    for name in ("one", "two"):
        train(tiny_cfg(tmp_path, name, "data.generate.num_train=512", "data.generate.num_val=32",
                       "data.generate.num_test=32", "train.warmup=4", "train.log_every=2", "train.steps=6",
                       "train.eval_every=0", "train.checkpoint_every=0", sizes=()), progress=False)
        runs.append(_weights(latest_checkpoint(tmp_path / name)))
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_time_limit_ends_a_part_with_a_checkpoint(tmp_path):
    cfg = tiny_cfg(tmp_path, "parts", "train.steps=12", "train.max_minutes=1e-9")
    part = train(cfg, progress=False)
    # stops at the first logging step past the deadline, between the scheduled checkpoints
    assert part["step"] == 2 and latest_checkpoint(tmp_path / "parts").name == "step_0000002"
    cfg["train"]["max_minutes"] = None
    assert train(cfg, progress=False)["step"] == 12


def test_resuming_with_another_model_is_refused_by_name(tmp_path):
    train(tiny_cfg(tmp_path, "run", "train.steps=4"), progress=False)
    with pytest.raises(ValueError, match=r"(?s)step_0000004: the checkpoint does not fit the model of this config "
                                         r"\(.*blocks.2.*\); pass --no-resume"):
        train(tiny_cfg(tmp_path, "run", "train.steps=8", "model.num_layers=3"), progress=False)


def test_a_signal_ends_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, "signalled", "train.steps=12")
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal_at_forward(monkeypatch, call=3, signum=signal.SIGTERM)
    part = train(cfg, progress=False)
    # one process stops after the step it was in (3), between logging steps (2, 4) and checkpoints (4, 8),
    # and logs the steps since the last record
    assert (part["step"], part["signal"]) == (3, "SIGTERM")
    assert latest_checkpoint(tmp_path / "signalled").name == "step_0000003"
    assert [r["step"] for r in _records(tmp_path / "signalled") if "loss" in r] == [2, 3]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    monkeypatch.undo()
    rest, whole = train(cfg, progress=False), train(tiny_cfg(tmp_path, "whole", "train.steps=12"), progress=False)
    assert (rest["step"], rest["signal"]) == (12, None)
    wa, wb = _weights(Path(rest["checkpoint"])), _weights(Path(whole["checkpoint"]))
    assert all(torch.equal(wa[k], wb[k]) for k in wb) and rest["eval_accuracy"] == whole["eval_accuracy"]


def test_a_second_signal_stops_at_once(tmp_path, monkeypatch):
    # two at once are one sent twice (a launcher passing the terminal's on to its workers)
    signal_at_forward(monkeypatch, call=3, times=2)
    assert train(tiny_cfg(tmp_path, "one", "train.steps=12"), progress=False)["step"] == 3
    monkeypatch.undo()
    signal_at_forward(monkeypatch, call=3, times=2)
    monkeypatch.setattr(StopSignals, "REPEAT_S", 0.0)  # as if a second had passed in between
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(tmp_path, "stopped", "train.steps=12"), progress=False)
    assert latest_checkpoint(tmp_path / "stopped") is None and signal.getsignal(signal.SIGINT) is before


def test_an_ignored_signal_stays_ignored(tmp_path, monkeypatch):
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a shell script's background job
    try:
        signal_at_forward(monkeypatch, call=3)
        run = train(tiny_cfg(tmp_path, "immune", "train.steps=6"), progress=False)
        assert (run["step"], run["signal"]) == (6, None) and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_init_from_takes_the_weights_and_keeps_its_own_masks(tmp_path):
    train(tiny_cfg(tmp_path, "dense", "train.steps=4", "model.attention=dense"), progress=False)
    # lr 0: the one step changes nothing, so the checkpoint shows what the run started from
    train(tiny_cfg(tmp_path, "sparse", "train.steps=1", "train.lr=0", "model.mask_kind=random",
                   "model.mask_seed=7", f"train.init_from={tmp_path / 'dense'}"), progress=False)
    src, dst = _weights(latest_checkpoint(tmp_path / "dense")), _weights(latest_checkpoint(tmp_path / "sparse"))
    masks = [k for k in src if k.endswith("attn.mask")]
    assert masks and all(not torch.equal(src[k], dst[k]) for k in masks)
    assert all(torch.equal(src[k], dst[k]) for k in src if k not in masks)
    with pytest.raises(ValueError, match="weights do not fit"):
        train(tiny_cfg(tmp_path, "wide", "train.steps=1", "model.emb_dim=48", f"train.init_from={tmp_path / 'dense'}"),
              progress=False)


def test_checkpoint_contents_and_retention(tmp_path):
    train(tiny_cfg(tmp_path, "run", "train.steps=8", "train.keep_checkpoints=1"), progress=False)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000008"]
    ckpt = root / "step_0000008"
    # what a shell completes to inside a run names its checkpoint too
    assert {resolve_checkpoint(p) for p in (tmp_path / "run", root, ckpt, ckpt / "model.safetensors")} == {ckpt}
    (root / "checkpoints" / "step_0000001").mkdir(parents=True)  # a run named "checkpoints" is still one
    (root / "checkpoints" / "step_0000001" / "trainer_state.json").write_text("{}")
    assert resolve_checkpoint(root) == root / "checkpoints" / "step_0000001"
    shutil.rmtree(root / "checkpoints")
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "config.json", "trainer_state.safetensors",
                                                "trainer_state.json", "run_config.yaml"}  # no pickles
    state = read_trainer_state(ckpt)
    assert state["step"] == 8 and state["scheduler"]["last_epoch"] == 8
    assert isinstance(state["rng"]["python"], tuple) and all(isinstance(k, int) for k in state["optimizer"]["state"])
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.98)
    assert any(k.endswith("attn.mask") for k in _weights(ckpt))
    recs = _records(tmp_path / "run")
    assert [r["step"] for r in recs if "eval_accuracy" in r] == [4, 8]
    assert all(r["lr"] > 0 for r in recs if "lr" in r)
    # A file damaged after the atomic write (a truncated copy) is an error that names it, wherever it is read.
    for name in ("model.safetensors", "trainer_state.safetensors"):
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[:1000])
        with pytest.raises(ValueError, match=rf"{name}: not a readable safetensors file"):
            train(tiny_cfg(tmp_path, "run", "train.steps=9", "train.keep_checkpoints=1"), progress=False)
        (ckpt / name).write_bytes(data)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        evaluate(ckpt, backends=["dense"], progress=False)


def test_files_are_written_whole_with_the_usual_permissions(tmp_path):
    old = tmp_path / "report.json"
    old.write_text("old")
    with pytest.raises(UnicodeEncodeError):  # fails while writing: the old file stays, nothing beside it
        write_atomic(old, "new \ud800")
    assert old.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    tsv = tmp_path / "basic_train.tsv"  # the ListOps writer, which streams its rows, likewise
    write_tsv(tsv, [("( 1 )", 1)])
    with pytest.raises(UnicodeEncodeError):
        write_tsv(tsv, [("( 2 )", 2)] * 10_000 + [("\ud800", 3)])
    assert read_tsv(tsv) == (["( 1 )"], [1]) and sorted(p.name for p in tmp_path.iterdir()) == [tsv.name, old.name]
    # what benchmarks and reports write can be read by whoever reads the folder, as with write_text
    saved = save_json(tmp_path / "bench" / "spmm.json", {"x": 1})
    assert json.loads(saved.read_text()) == {"x": 1}
    assert saved.stat().st_mode == old.stat().st_mode


def test_an_output_folder_is_checked_without_being_made(tmp_path, monkeypatch):
    assert check_writable(tmp_path / "a" / "b") == tmp_path / "a" / "b" and not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError, match=r"out_dir: .*/f: cannot write files there \(a file, not a folder\)"):
        check_writable(tmp_path / "f", "out_dir")
    with pytest.raises(OSError, match=r"f/run: cannot write files there \(.*/f is a file\)"):
        check_writable(tmp_path / "f" / "run")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as root, a mode bit forbids nothing
    with pytest.raises(OSError, match=r"a/b: cannot write files there \(.+ is not writable\)"):
        check_writable(tmp_path / "a" / "b")


@pytest.mark.parametrize("kwargs, message", [
    (dict(backends="dense"), r"backends: expected a list of backend names, got the string 'dense'"),
    (dict(batch_size=0), r"batch_size: expected an integer >= 1 or null, got 0"),
    (dict(max_batches=-2), r"max_batches: expected an integer >= 1 or null, got -2"),
])
def test_evaluate_checks_its_arguments_by_name(tmp_path, kwargs, message):
    """As the command line does: a batch size of 0 fell back to the config's, a negative count of
    batches cut the split short, and a string was read as backends of one letter each."""
    with pytest.raises(ValueError, match=message):
        evaluate(tmp_path, progress=False, **kwargs)


def test_text_task_end_to_end(tmp_path, monkeypatch):
    """The byte-level text path (vocab 257, 2 classes, test split as eval) on stand-in reviews."""
    from magicube.train import imdb

    (tmp_path / "aclImdb" / "train").mkdir(parents=True)
    fake = {s: {"text": [b"great film " * (i % 7 + 1) if i % 2 else b"awful \xc3\xa9 " * (i % 5 + 1)
                         for i in range(64)], "label": [i % 2 for i in range(64)]} for s in imdb.SPLITS}
    monkeypatch.setattr(imdb, "read_imdb", lambda path: fake)
    cfg = load_config("lra_text", [f"data.path={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
                                   f"out_dir={tmp_path / 'run'}", "model.max_len=64", "model.emb_dim=32",
                                   "model.mlp_dim=64", "model.num_layers=1", "train.steps=30", "train.warmup=5",
                                   "train.batch_size=16", "train.eval_every=30", "train.eval_batches=null",
                                   "train.mixed_precision=no", "train.log_every=10"])
    summary = train(cfg, progress=False)
    assert summary["step"] == 30 and summary["eval_accuracy"] > 0.9  # trivially separable
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_0000030" / "config.json").read_text())[
        "vocab_size"] == 257


@pytest.mark.slow
def test_data_parallel_on_two_cpu_processes(tmp_path):
    """DDP through accelerate (gloo): the global batch split over 2 processes, evaluation reduced over both."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "magicube.eval.cli",
            "train", "--config", "tiny", "--no-progress", *TINY_OVERRIDES, f"data.path={tmp_path / 'listops'}",
            f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}", "train.cpu=true"]
    # hide GPUs: with one device, two processes would both claim it before train.cpu applies
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([*args, "train.steps=4"], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("trained to step 4") == 1
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "eval_accuracy" in line]
    assert [e["step"] for e in evals] == [4] and evals[0]["eval_examples"] == 32
    assert latest_checkpoint(tmp_path / "run").name == "step_0000004"


class _NanForFirstIdZero(torch.nn.Module):
    """Logits favouring class 1, NaN for the examples whose first id is 0."""

    def forward(self, ids):
        logits = torch.tensor([0.0, 1.0], device=ids.device).expand(len(ids), 2)
        return SimpleNamespace(logits=logits.masked_fill((ids[:, 0] == 0)[:, None], float("nan")))


def test_accuracy_counts_non_finite_logits_as_wrong():
    """argmax of NaN logits is index 0, which would match a label 0 by chance: such an example
    counts as wrong and is reported."""
    from accelerate import Accelerator

    ids, labels = torch.tensor([[0], [1], [2], [0]]), torch.tensor([0, 1, 0, 1])
    # the process's accelerator, whatever its device: accelerate keeps one state a process
    r = accuracy(_NanForFirstIdZero(), ids, labels, batch_size=3, accelerator=Accelerator())
    assert r["accuracy"] == 0.25 and r["nonfinite"] == 2 and r["examples"] == 4 and math.isnan(r["loss"])
