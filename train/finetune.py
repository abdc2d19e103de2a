"""Quantization-aware finetuning: from a trained sparse checkpoint to one integer backend.

    magicube finetune --from runs/tiny --precision 8b-8b [--config tiny] [train.steps=50 ...]

1. The run config is the source run's (the checkpoint's run_config.yaml) with the `finetune`
   section of --config (or the source's own, or the built-in config of the source's name):
   its `train` keys over the source's train section, the model switched to the precision
   (model.attention and quant_precision / quant_scales / quant_granularity), out_dir
   `<source run>/finetune_<precision>` unless finetune.out_dir is set. Overrides apply last,
   `finetune.*` ones before the composition.
2. The model starts from the source weights and masks. Calibrated scales ("fixed" or
   "learned") start at the running absmax of each layer's Q, K and V, per head, over
   finetune.calibration_batches training batches run through the source's own attention
   function (no dropout), so that calibration does not depend on the bits being learned;
   "tensor" granularity keeps the largest over the heads.
3. Training is the ordinary trainer (accelerate, atomic checkpoints, resume, metrics) on the
   fake-quantized forward of model/fakequant.py. The checkpoint's config.json records the
   precision and scale mode, its weights the scales (`blocks.<i>.attn.qkv_scale`).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from magicube.model import fakequant
from magicube.model.lra import QUANTIZED, LRAClassifier
from magicube.train.config import apply_overrides, check_count, config_names, load_config
from magicube.train.checkpoint import load_weights, resolve_checkpoint
from magicube.train.trainer import FINETUNE_KEYS, batch_indices, check_keys, train


def finetune_section(source: dict, config: str | Path | None) -> dict:
    if config is not None:
        section = load_config(config).get("finetune")
        where = f"config {config!r}"
    elif "finetune" in source:
        # a finetuned source: its section, less where that run went and came from
        return {k: v for k, v in copy.deepcopy(source["finetune"]).items()
                if k not in ("out_dir", "from", "source_attention")}
    elif source.get("name") in config_names():
        section, where = load_config(source["name"]).get("finetune"), f"built-in config {source['name']!r}"
    else:
        section, where = None, "the source run's config"
    if not section:
        raise ValueError(f"{where} has no finetune section; pass --config with one (e.g. --config tiny)")
    return copy.deepcopy(section)


def is_finetune_override(override: str) -> bool:
    """`finetune.key=value` or `finetune=...`: applied before the composition that reads the section."""
    return override.partition("=")[0].split(".")[0] == "finetune"


def finetune_config(ckpt: Path, precision: str | None = None, config: str | Path | None = None,
                    overrides=()) -> dict:
    """The run config of a finetuning run from checkpoint `ckpt` (see the module docstring)."""
    source = load_config(ckpt / "run_config.yaml")
    source["finetune"] = finetune_section(source, config)
    early = [o for o in overrides if is_finetune_override(o)]
    cfg = apply_overrides(source, early)
    check_keys(cfg, "finetune", FINETUNE_KEYS, required=True)
    ft = cfg["finetune"]
    precision = precision or ft.get("precision")
    if precision not in QUANTIZED:
        raise ValueError(f"precision: expected one of {list(QUANTIZED)}, got {precision!r}")
    scales, granularity = ft.get("scales", "learned"), ft.get("granularity", "head")
    if scales not in fakequant.SCALE_MODES:
        raise ValueError(f"finetune.scales: expected one of {fakequant.SCALE_MODES}, got {scales!r}")
    if granularity not in fakequant.GRANULARITIES:
        raise ValueError(f"finetune.granularity: expected one of {fakequant.GRANULARITIES}, got {granularity!r}")
    check_count("finetune.calibration_batches", ft.get("calibration_batches", 8), 1)  # 0: every scale 1
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    # calibration runs the source's float function (that of a finetuned source: its sparse one)
    attention = cfg["model"].get("attention", "dense")
    ft.update({"precision": precision, "scales": scales, "granularity": granularity, "from": str(ckpt),
               "source_attention": "sparse" if attention in QUANTIZED else attention})
    cfg["train"] = {**cfg.get("train", {}), **(ft.get("train") or {})}
    cfg["model"] = {**cfg["model"], "attention": precision, "quant_precision": precision, "quant_scales": scales,
                    "quant_granularity": granularity}
    cfg["name"] = f"{source.get('name', 'run')}-{precision}"
    cfg["out_dir"] = str(ft.get("out_dir") or run_dir / f"finetune_{precision}")
    cfg["eval"] = {**cfg.get("eval", {}), "backends": ["sparse-masked", "sparse", f"{precision}-fake", precision]}
    return apply_overrides(cfg, [o for o in overrides if not is_finetune_override(o)])


@torch.no_grad()
def calibrate(model: LRAClassifier, ids: torch.Tensor, batch_size: int, batches: int, seed: int,
              attention: str, device) -> torch.Tensor:
    """Running absmax of Q, K, V per layer and head over the first `batches` training batches: [L, 3, H].

    The batches are those of training steps 0..batches-1, so calibration is a pure function of
    the weights, the data and the seed.
    """
    c = model.config
    saved = (c.attention, c.sparse_impl)
    amax = torch.zeros(c.num_layers, 3, c.num_heads, device=device)
    hooks = []
    for i, block in enumerate(model.blocks):
        def observe(module, inputs, out, i=i):
            amax[i] = torch.maximum(amax[i], fakequant.observe_absmax(out, c.num_heads))
        hooks.append(block.attn.qkv.register_forward_hook(observe))
    was_training = model.training
    model.eval()
    model.set_attention(attention, "masked")
    try:
        for step in range(batches):
            model(ids[batch_indices(step, len(ids), batch_size, seed)].to(device))
    finally:
        for h in hooks:
            h.remove()
        model.set_attention(*saved)
        model.train(was_training)
    return amax


def init_from(cfg: dict):
    """The trainer's init_model for finetuning: source weights, then calibrated scales."""
    ft = cfg["finetune"]

    def init(mcfg, train_split, device, resuming: bool) -> LRAClassifier:
        model = LRAClassifier(mcfg)
        if resuming:  # the finetuning checkpoint holds the weights and scales
            return model
        load_weights(model, ft["from"], skip=("qkv_scale",))  # a finetuned source: recalibrate
        if mcfg.calibrated:
            model.to(device)
            set_calibrated_scales(model, calibrate(model, train_split[0], int(cfg["train"]["batch_size"]),
                                                   int(ft.get("calibration_batches", 8)), int(cfg.get("seed", 0)),
                                                   ft["source_attention"], device))
        return model

    return init


def set_calibrated_scales(model: LRAClassifier, amax: torch.Tensor) -> None:
    """Each layer's qkv_scale from calibrate's absmax [L, 3, H], for the model's precision and granularity."""
    c = model.config
    bits = QUANTIZED[c.quant_precision][1]
    for block, a in zip(model.blocks, amax):
        block.attn.qkv_scale.data.copy_(fakequant.scales_from_absmax(a, bits, c.quant_granularity))


def finetune(source: str | Path, precision: str | None = None, config: str | Path | None = None, overrides=(),
             resume: bool = True, progress: bool = True, stop_after: int | None = None) -> dict:
    """Calibrate and finetune; returns the trainer's summary plus the run config."""
    ckpt = resolve_checkpoint(source)
    cfg = finetune_config(ckpt, precision, config, overrides)
    summary = train(cfg, resume=resume, progress=progress, stop_after=stop_after, init_model=init_from(cfg))
    return {**summary, "precision": cfg["finetune"]["precision"], "from": str(ckpt), "config": cfg}
