"""Test accuracy of a trained checkpoint under every attention backend, as Markdown and JSON.

The backends share the checkpoint's weights and masks:

    dense          full attention, no mask (shows what the mask takes away or not)
    dense-fp16     the same in fp16 (autocast), as a dense model would be served
    sparse-masked  the training function: masked dense attention in fp32
    sparse         fp16 sparse attention through magicube.ops (SDDMM -> softmax -> SpMM)
    16b-8b, 8b-8b, 8b-4b   quantized sparse attention through the integer ops
    16b-8b-fake, ...       their fake-quantized twin (the finetuning path), masked dense in fp32

The ops run the CUDA kernels when the model is on a GPU and the reference elsewhere.

A quantization-finetuned checkpoint (config quant_precision) is only evaluated under the
integer backend it was finetuned for (its weights and Q/K/V scales are for those bits) and
under the float backends; its calibrated scales replace the per-batch absmax of the ops.
"""
from __future__ import annotations

import contextlib
import json
import platform
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from transformers.utils import logging as hf_logging

from magicube.eval.timing import git_commit
from magicube.model.lra import QUANTIZED, LRAClassifier
from magicube.train import data as data_mod
from magicube.train.config import check_count, load_config
from magicube.train.checkpoint import resolve_checkpoint, unreadable
from magicube.train.files import write_atomic
from magicube.train.trainer import accuracy

# name -> (attention, sparse_impl); "-fp16" rows run the whole model under fp16 autocast
BACKENDS = {"dense": ("dense", "auto"), "dense-fp16": ("dense", "auto"), "sparse-masked": ("sparse", "masked"),
            "sparse": ("sparse", "ops"),
            **{name: (name, "ops") for name in QUANTIZED}, **{f"{name}-fake": (name, "masked") for name in QUANTIZED}}
_BITS = {"16b-8b": "P u16 / QKV s8", "8b-8b": "P u8 / QKV s8", "8b-4b": "P u8 / QKV s4"}
DESCRIPTION = {"dense": "dense softmax(QK^T)V, no mask", "dense-fp16": "dense, no mask, fp16 autocast",
               "sparse-masked": "masked dense, fp32 (training path)",
               "sparse": "sparse ops, fp16", **{name: f"sparse ops, {bits}" for name, bits in _BITS.items()},
               **{f"{name}-fake": f"fake-quantized, {bits} (finetuning path)" for name, bits in _BITS.items()}}


def check_precision(ckpt, precision: str | None, backends) -> None:
    """A finetuned checkpoint runs only its own integer precision (and the float backends)."""
    if precision is None:
        return
    wrong = [b for b in backends if BACKENDS[b][0] in QUANTIZED and BACKENDS[b][0] != precision]
    if wrong:
        raise ValueError(f"{ckpt} was quantization-finetuned for {precision}; its weights and Q/K/V scales do not "
                         f"serve backend(s) {', '.join(wrong)}. Evaluate it with --backends {precision} "
                         f"{precision}-fake (or dense / sparse), or finetune the source checkpoint for those "
                         f"bits: magicube finetune --from SOURCE --precision {BACKENDS[wrong[0]][0]}")


def evaluate(path: str | Path, backends=None, split: str | None = None, batch_size: int | None = None,
             max_batches: int | None = None, progress: bool = True, data_overrides: dict | None = None,
             accelerator: Accelerator | None = None, fused: bool = False) -> dict:
    if isinstance(backends, str):
        raise ValueError(f"backends: expected a list of backend names, got the string {backends!r}")
    check_count("batch_size", batch_size, 1, optional=True)
    check_count("max_batches", max_batches, 1, optional=True)
    ckpt = resolve_checkpoint(path)
    cfg = load_config(ckpt / "run_config.yaml")
    data_cfg = {**cfg["data"], **(data_overrides or {})}
    ecfg = cfg.get("eval", {})
    backends = list(backends or ecfg.get("backends") or BACKENDS)
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
    except SafetensorError as err:
        raise unreadable(ckpt / "model.safetensors", err) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    trained_with = model.config.attention
    precision = model.config.quant_precision
    check_precision(ckpt, precision, backends)
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
        with (torch.autocast(accelerator.device.type, dtype=torch.float16) if name.endswith("-fp16")
              else contextlib.nullcontext()):
            r = accuracy(model, ids, labels, batch_size, accelerator, max_batches, progress=progress, desc=name)
        rows.append({"backend": name, "description": DESCRIPTION[name], "accuracy": r["accuracy"],
                     "loss": r["loss"], "examples": r["examples"], "nonfinite": r["nonfinite"],
                     "seconds": round(time.time() - t0, 2)})
    meta = ckpt / "trainer_state.json"
    state = {"step": json.loads(meta.read_text())["step"]} if meta.is_file() else {}
    return {
        "checkpoint": str(ckpt), "step": state.get("step"), "task": data_cfg["task"], "split": split,
        "trained_with": trained_with, "quant_precision": precision,
        "quant_scales": model.config.quant_scales if precision else None, "majority_baseline": majority,
        "sparsity": model.config.sparsity, "v": model.config.v,
        "mask_kind": model.config.mask_kind, "fused": fused, "device": _device_name(accelerator.device),
        "torch": torch.__version__, "python": platform.python_version(), "commit": git_commit(), "results": rows,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def to_markdown(report: dict) -> str:
    tuned = (f"quantization-finetuned for `{report['quant_precision']}` with {report['quant_scales']} scales"
             if report.get("quant_precision") else f"trained with `{report['trained_with']}` attention")
    head = (f"{report['task']} {report['split']} accuracy, checkpoint step {report['step']} "
            f"({tuned}, {report['mask_kind']} mask, sparsity {report['sparsity']}, V={report['v']}), "
            f"on {report['device']}\n\n")
    lines = ["| backend | attention | accuracy | loss | examples | seconds |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['backend']} | {r['description']} | {100 * r['accuracy']:.2f} % | {r['loss']:.4f} | "
                     f"{r['examples']} | {r['seconds']:.1f} |")
    foot = f"\nChance (always the most frequent training label): {100 * report['majority_baseline']:.2f} %\n"
    for r in report["results"]:
        if r.get("nonfinite"):
            foot += (f"\n**{r['backend']}: {r['nonfinite']} of {r['examples']} examples had non-finite logits** "
                     "(an attention score past the fp16 range makes its row NaN); they count as wrong.\n")
    return head + "\n".join(lines) + "\n" + foot


def report_paths(out: str | Path) -> tuple[Path, Path]:
    """`<out>.md` and `<out>.json`. The suffixes are appended, not substituted: a name such as
    `random_0.9_8b-8b` has a dot that `with_suffix` would take for a suffix."""
    out = Path(out)
    return out.with_name(out.name + ".md"), out.with_name(out.name + ".json")


def read_json(path: str | Path):
    """The JSON in `path`, or a ValueError that names the file."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None


def write_markdown_and_json(text: str, data: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `text` to `<out>.md` and `data` to `<out>.json`, each whole (`write_atomic`)."""
    md, js = report_paths(out)
    write_atomic(md, text)
    write_atomic(js, json.dumps(data, indent=2) + "\n")
    return md, js


def write_report(report: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `<out>.md` and `<out>.json`."""
    return write_markdown_and_json(to_markdown(report), report, out)
