"""The `magicube` command: data, train, finetune, evaluate, bench, build, table, compare, demo."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from magicube.eval.args import output_prefix, positive_int

# the integer backends of magicube.model.QUANTIZED, named here so that `magicube --help` needs no torch
QUANTIZED = ("16b-8b", "8b-8b", "8b-4b")


def _cmd_data(args) -> int:
    from magicube.train import data, imdb, listops
    from magicube.train.config import load_config

    if args.what == "listops":
        cfg = load_config(args.config, args.overrides)["data"]
        if cfg.get("task") != "listops":
            raise SystemExit(f"config {args.config!r} is a {cfg.get('task')!r} task, not listops")
        spec = data.listops_spec(cfg)
        out = Path(args.out or cfg.get("path") or "data/listops")
        t0 = time.time()
        print(f"generating ListOps {spec} into {out} ...", flush=True)
        paths = listops.write_splits(out, spec)
        for p in paths.values():
            print(f"  {p}  ({len(listops.read_tsv(p)[1])} examples)")
        print(f"done in {time.time() - t0:.1f} s")
        return 0
    src = imdb.find_imdb(args.path)
    t0 = time.time()
    reviews = imdb.read_imdb(src)
    for split, d in reviews.items():
        n = len(d["label"])
        print(f"{split}: {n} reviews, {sum(d['label'])} positive, {sum(map(len, d['text'])) / max(n, 1):.0f} bytes "
              "on average")
    print(f"IMDB at {src} is complete ({time.time() - t0:.1f} s)")
    return 0


def _exit_status(summary: dict) -> int:
    """0, or a shell's status for the signal that ended the run early (130 for Ctrl-C), so that a
    script does not go on from a run that stopped short of its steps."""
    return 128 + signal.Signals[summary["signal"]] if summary["signal"] else 0


def _cmd_train(args) -> int:
    from magicube.train.config import load_config
    from magicube.train.trainer import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, resume=not args.no_resume, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:  # one line, not one per process of a distributed run
        print(f"trained to step {summary['step']} in {summary['seconds']} s; eval accuracy {summary['eval_accuracy']}; "
              f"checkpoint {summary['checkpoint']}")
    return _exit_status(summary)


def _cmd_finetune(args) -> int:
    from magicube.train.finetune import finetune

    summary = finetune(args.source, precision=args.precision, config=args.config, overrides=args.overrides,
                       resume=not args.no_resume, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"finetuned {summary['from']} for {summary['precision']} to step {summary['step']} in "
              f"{summary['seconds']} s; eval accuracy {summary['eval_accuracy']} (fake-quantized); "
              f"checkpoint {summary['checkpoint']}\nevaluate it: magicube evaluate {summary['out_dir']}")
    return _exit_status(summary)


def _cmd_evaluate(args) -> int:
    from magicube.eval.evaluate import evaluate, to_markdown, write_report

    report = evaluate(args.checkpoint, backends=args.backends, split=args.split, batch_size=args.batch_size,
                      max_batches=args.max_batches, progress=not args.no_progress, fused=args.fused)
    out = args.out or Path(report["checkpoint"]).parent.parent / f"eval_{report['split']}"
    md, js = write_report(report, out)
    print(to_markdown(report))
    print(f"written to {md} and {js}")
    return 0


def _demo_stopped(summary: dict) -> bool:
    if summary["signal"]:  # the trainer's "run the same command again" would start the demo over
        print("the demo stopped early; add --resume to the same command to go on where it stopped")
    return bool(summary["signal"])


def _cmd_demo(args) -> int:
    import torch

    from magicube.eval.evaluate import evaluate, to_markdown, write_report
    from magicube.ops import extension
    from magicube.train.config import load_config
    from magicube.train.finetune import finetune, is_finetune_override
    from magicube.train.trainer import train

    cfg = load_config(args.config, [f"out_dir={args.out_dir}", *args.overrides])
    run_dir = Path(cfg["out_dir"])
    precision = args.precision
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    kernels = "the CUDA kernels" if extension.available() else "the reference ops (no GPU)"
    print(f"magicube demo: {cfg['data']['task']} / {cfg['name']} on {device}; sparse attention runs {kernels}")
    if not args.resume:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(run_dir / f"finetune_{precision}" / "checkpoints", ignore_errors=True)
    t0 = time.time()
    summary = train(cfg, resume=args.resume, progress=not args.no_progress)
    if _demo_stopped(summary):
        return _exit_status(summary)
    t_train = time.time() - t0
    report = evaluate(run_dir, progress=not args.no_progress)
    md, js = write_report(report, run_dir / f"eval_{report['split']}")
    print()
    print(to_markdown(report))
    t1 = time.time()
    # the source run's config carries the other overrides (sizes, paths) into the finetuning run
    tuned = finetune(run_dir, precision=precision, overrides=[o for o in args.overrides if is_finetune_override(o)],
                     resume=args.resume, progress=not args.no_progress)
    if _demo_stopped(tuned):
        return _exit_status(tuned)
    t_tune = time.time() - t1
    tuned_report = evaluate(tuned["out_dir"], progress=not args.no_progress)
    tmd, tjs = write_report(tuned_report, Path(tuned["out_dir"]) / f"eval_{tuned_report['split']}")
    print(to_markdown(tuned_report))
    before = {r["backend"]: r["accuracy"] for r in report["results"]}
    after = {r["backend"]: r["accuracy"] for r in tuned_report["results"]}
    # the fp16 row beside the integer one: finetuning also trains on, so part of a gain is not the bits'
    print(f"after {tuned['step']} finetuning steps for {precision}: " + ", ".join(
        f"{b} {100 * before[b]:.2f} % -> {100 * after[b]:.2f} %" for b in ("sparse", precision)
        if b in before and b in after))
    print(f"training {t_train:.0f} s ({summary['step']} steps), evaluation {t1 - t0 - t_train:.0f} s, "
          f"finetuning {t_tune:.0f} s, evaluation {time.time() - t1 - t_tune:.0f} s; results in {md}, {js}, "
          f"{tmd} and {tjs}")
    return 0


def _cmd_bench(args) -> int:
    from magicube.eval import bench_model

    return bench_model.main(args.rest, prog="magicube bench")


def _cmd_build(args) -> int:
    from magicube.ops import extension

    return extension.main(args.rest)


def _cmd_table(args) -> int:
    from magicube.eval import table

    return table.main(args.rest)


def _cmd_compare(args) -> int:
    from magicube.eval import compare

    return compare.main(args.rest)


PASS_THROUGH = ("bench", "build", "table", "compare")  # their own parsers take the remaining arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicube", description="Sparse, quantized attention: LRA data, training, "
                                "quantization finetuning, evaluation.")
    sub = p.add_subparsers(dest="command", required=True)
    overrides = {"nargs": "*", "default": [], "metavar": "KEY=VALUE",
                 "help": "config overrides, e.g. train.steps=100 model.attention=dense"}

    d = sub.add_parser("data", help="generate ListOps TSVs or check the IMDB archive")
    dsub = d.add_subparsers(dest="what", required=True)
    dl = dsub.add_parser("listops", help="write basic_{train,val,test}.tsv as the config's data.generate says")
    dl.add_argument("--config", default="lra_listops")
    dl.add_argument("--out", help="folder for the TSVs (default: the config's data.path)")
    dl.add_argument("overrides", **overrides)
    di = dsub.add_parser("imdb", help="read the IMDB archive or folder once and report what is there")
    di.add_argument("--path", help="aclImdb_v1.tar.gz or the aclImdb folder (default: $MAGICUBE_IMDB, then ./data)")
    d.set_defaults(func=_cmd_data)

    t = sub.add_parser("train", help="train from a YAML config (resumes from the last checkpoint; Ctrl-C or "
                       "SIGTERM stops it with one)")
    t.add_argument("--config", required=True, help="a built-in config name (tiny, lra_text, lra_listops) or a path")
    t.add_argument("--no-resume", action="store_true", help="start from scratch even if checkpoints exist")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("overrides", **overrides)
    t.set_defaults(func=_cmd_train)

    f = sub.add_parser("finetune", help="quantization-aware finetuning of a trained checkpoint for one integer "
                       "backend (calibrated scales, fake quantization; resumes)")
    f.add_argument("--from", dest="source", required=True, metavar="RUN_OR_CKPT",
                   help="a trained run folder (its latest checkpoint) or a checkpoint folder")
    f.add_argument("--precision", choices=list(QUANTIZED), help="default: the config's finetune.precision")
    f.add_argument("--config", help="take the finetune section from this config (default: the source run's, "
                   "else the built-in config of its name)")
    f.add_argument("--no-resume", action="store_true", help="start over even if finetuning checkpoints exist")
    f.add_argument("--no-progress", action="store_true")
    f.add_argument("overrides", **{**overrides, "help": "overrides of the finetuning run's config, e.g. "
                   "train.steps=50 finetune.scales=fixed finetune.granularity=tensor"})
    f.set_defaults(func=_cmd_finetune)

    e = sub.add_parser("evaluate", help="test accuracy of a checkpoint under each attention backend")
    e.add_argument("checkpoint", help="a checkpoint folder or a run folder (its latest checkpoint)")
    e.add_argument("--backends", nargs="+",
                   help="dense dense-fp16 sparse-masked sparse 16b-8b 8b-8b 8b-4b, or 16b-8b-fake 8b-8b-fake "
                   "8b-4b-fake (the fake-quantized finetuning path) (default: the config's)")
    e.add_argument("--split", help="default: the config's eval.split (test)")
    e.add_argument("--batch-size", type=positive_int)
    e.add_argument("--max-batches", type=positive_int,
                   help="evaluate N batches only (a fixed random subset of the split, the same for every backend)")
    e.add_argument("--out", type=output_prefix, help="report path without suffix (.md and .json are written)")
    e.add_argument("--fused", action="store_true", help="run the sparse backends as the one fused attention op")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_cmd_evaluate)

    b = sub.add_parser("bench", add_help=False,
                       help="end-to-end latency of the model and one attention layer per backend "
                            "(magicube bench --help; kernel benchmarks: python -m magicube.eval.bench_spmm, "
                            "bench_sddmm, bench_attention)")
    b.set_defaults(func=_cmd_bench)
    k = sub.add_parser("build", add_help=False, help="compile the CUDA kernels ahead of time (magicube build --help)")
    k.set_defaults(func=_cmd_build)
    tb = sub.add_parser("table", add_help=False, help="the paper's accuracy table (Table V) from evaluation reports "
                       "(magicube table --help)")
    tb.set_defaults(func=_cmd_table)
    cm = sub.add_parser("compare", add_help=False, help="two runs of a benchmark, time against time cell by cell "
                        "(magicube compare --help)")
    cm.set_defaults(func=_cmd_compare)

    m = sub.add_parser("demo", help="generate a small ListOps set, train the tiny config, evaluate every backend, "
                       "quantization-finetune one precision and evaluate it")
    m.add_argument("--config", default="tiny")
    m.add_argument("--out-dir", default="runs/demo")
    m.add_argument("--precision", choices=list(QUANTIZED), default="8b-8b", help="the backend to finetune for")
    m.add_argument("--resume", action="store_true", help="continue a previous demo run instead of starting over")
    m.add_argument("--no-progress", action="store_true")
    m.add_argument("overrides", **overrides)
    m.set_defaults(func=_cmd_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.rest = extra
    if extra and args.command not in PASS_THROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (OSError, ValueError) as e:  # a bad path or setting, not a fault of the program: no traceback
        print(f"magicube {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        dist = sys.modules.get("torch.distributed")  # only a command that imported torch can have a group
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a data-parallel run (accelerate launch) ends its group first


if __name__ == "__main__":
    sys.exit(main())
