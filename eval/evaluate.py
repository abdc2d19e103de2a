"""Test accuracy of a trained checkpoint under every attention backend, as Markdown and JSON.

The backends share the checkpoint's weights and masks:

    dense          full attention, no mask (shows what the mask takes away or not)
    sparse-masked  the training function: masked dense attention in fp32
    sparse         fp16 sparse attention through magicube.ops (SDDMM -> softmax -> SpMM)
    16b-8b, 8b-8b, 8b-4b   quantized sparse attention through the integer ops

The ops run the CUDA kernels when the model is on a GPU and the reference elsewhere.
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers.utils import logging as hf_logging

from magicube.model.lra import QUANTIZED, LRAClassifier
from magicube.train import data as data_mod
from magicube.train.config import load_config
from magicube.train.trainer import accuracy, latest_checkpoint

BACKENDS = {"dense": ("dense", "auto"), "sparse-masked": ("sparse", "masked"), "sparse": ("sparse", "ops"),
            **{name: (name, "ops") for name in QUANTIZED}}
DESCRIPTION = {"dense": "dense softmax(QK^T)V, no mask", "sparse-masked": "masked dense, fp32 (training path)",
               "sparse": "sparse ops, fp16", "16b-8b": "sparse ops, P u16 / QKV s8",
               "8b-8b": "sparse ops, P u8 / QKV s8", "8b-4b": "sparse ops, P u8 / QKV s4"}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the run directory whose latest checkpoint is meant."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint (model.safetensors) nor a run directory with "
                                "checkpoints/; train one with `magicube train --config NAME`")
    return ckpt


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def evaluate(path: str | Path, backends=None, split: str | None = None, batch_size: int | None = None,
             max_batches: int | None = None, progress: bool = True, data_overrides: dict | None = None,
             accelerator: Accelerator | None = None, fused: bool = False) -> dict:
    ckpt = resolve_checkpoint(path)
    cfg = load_config(ckpt / "run_config.yaml")
    data_cfg = {**cfg["data"], **(data_overrides or {})}
    ecfg = cfg.get("eval", {})
    backends = list(backends or ecfg.get("backends") or BACKENDS)
    # "sparse" in a config means both sparse rows: the training function and the ops.
    backends = [b for name in backends for b in (("sparse-masked", "sparse") if name == "sparse" else (name,))]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; choose from {list(BACKENDS)}")
    split = split or ecfg.get("split", "test")
    batch_size = batch_size or ecfg.get("batch_size", 64)
    # No mixed precision asked for: a training run in this process may already have set it.
    accelerator = accelerator or Accelerator()

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one small file
    try:
        model = LRAClassifier.from_pretrained(ckpt).to(accelerator.device)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    trained_with = model.config.attention
    model.config.fused = fused
    splits = data_mod.load_tensors(data_cfg, model.config.input_len)
    if split not in splits:
        raise ValueError(f"split {split!r} not in the {data_cfg['task']} data (has {sorted(splits)})")
    ids, labels = splits[split]
    # Chance as a classifier that always answers the most frequent training label would score it.
    top = torch.bincount(splits["train"][1]).argmax()
    majority = float((labels == top).float().mean()) if len(labels) else 0.0
    rows = []
    for name in dict.fromkeys(backends):
        attention, impl = BACKENDS[name]
        model.set_attention(attention, impl)
        t0 = time.time()
        r = accuracy(model, ids, labels, batch_size, accelerator, max_batches, progress=progress, desc=name)
        rows.append({"backend": name, "description": DESCRIPTION[name], "accuracy": r["accuracy"],
                     "loss": r["loss"], "examples": r["examples"], "seconds": round(time.time() - t0, 2)})
    meta = ckpt / "trainer_state.json"
    state = {"step": json.loads(meta.read_text())["step"]} if meta.is_file() else {}
    return {
        "checkpoint": str(ckpt), "step": state.get("step"), "task": data_cfg["task"], "split": split,
        "trained_with": trained_with, "majority_baseline": majority, "sparsity": model.config.sparsity, "v": model.config.v,
        "mask_kind": model.config.mask_kind, "fused": fused, "device": _device_name(accelerator.device),
        "torch": torch.__version__, "python": platform.python_version(), "commit": _commit(), "results": rows,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def to_markdown(report: dict) -> str:
    head = (f"{report['task']} {report['split']} accuracy, checkpoint step {report['step']} "
            f"(trained with `{report['trained_with']}` attention, {report['mask_kind']} mask, "
            f"sparsity {report['sparsity']}, V={report['v']}), on {report['device']}\n\n")
    lines = ["| backend | attention | accuracy | loss | examples | seconds |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['backend']} | {r['description']} | {100 * r['accuracy']:.2f} % | {r['loss']:.4f} | "
                     f"{r['examples']} | {r['seconds']:.1f} |")
    foot = f"\nChance (always the most frequent training label): {100 * report['majority_baseline']:.2f} %\n"
    return head + "\n".join(lines) + "\n" + foot


def write_report(report: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `<out>.md` and `<out>.json`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(to_markdown(report))
    js.write_text(json.dumps(report, indent=2) + "\n")
    return md, js
