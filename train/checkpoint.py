"""Checkpoints: written atomically, without pickles, and read back with errors that name the file.

A checkpoint is a directory `<run>/checkpoints/step_NNNNNNN` holding the model (safetensors and
its config.json, as `save_pretrained` writes them), the trainer's state (optimizer, scheduler,
loss scaler, RNGs: tensors in safetensors, the rest in JSON) and the run's config. It is written
to a temporary directory and renamed into place, so a run killed at any moment leaves the last
complete checkpoint as it was; `<run>/checkpoints/latest` names the newest.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.utils import logging as hf_logging

from magicube.model.lra import LRAClassifier
from magicube.train.config import dump_config
from magicube.train.files import write_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (a directory is complete once renamed into place)."""
    root = Path(out_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        p = root / pointer.read_text().strip()
        if (p / "trainer_state.json").is_file():
            return p
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the run directory whose latest checkpoint is meant. The paths a
    shell completes to inside them (a checkpoint's model.safetensors, a run's checkpoints/) mean
    the same."""
    path = Path(path)
    if path.name == "model.safetensors" and path.is_file():
        path = path.parent
    if (path / "model.safetensors").is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None and path.name == CHECKPOINTS:  # (a run may be named "checkpoints" too)
        ckpt = latest_checkpoint(path.parent)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint (model.safetensors) nor a run directory with "
                                "checkpoints/; train one with `magicube train --config NAME`")
    return ckpt


def unreadable(file: Path, err: SafetensorError) -> ValueError:
    """The error for a checkpoint's safetensors file that does not read. Checkpoints are written
    atomically, so such a file was damaged afterwards (truncated in a copy, overwritten)."""
    return ValueError(f"{file}: not a readable safetensors file ({err})")


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file, on the CPU; a damaged one is an error that names it."""
    try:
        return load_file(file, device="cpu")
    except SafetensorError as err:
        raise unreadable(file, err) from None


def load_weights(model: LRAClassifier, source: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Weights of a checkpoint (or a run's latest) into `model`, less the keys ending with `skip`,
    which keep the model's own values. Anything else that does not fit is an error."""
    path = resolve_checkpoint(source)
    state = {k: v for k, v in read_tensors(path / "model.safetensors").items() if not k.endswith(skip)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes differ
        raise ValueError(f"{path}: weights do not fit the model: {err}") from None
    if unexpected or any(not k.endswith(skip) for k in missing):
        raise ValueError(f"{path}: weights do not fit the model (missing {missing}, unexpected {unexpected})")


def _encode(obj, tensors: dict, key: str = "t"):
    """A nested state (dicts, lists, tuples, numbers, tensors, numpy arrays) -> JSON, tensors set aside.

    Checkpoints thus hold no pickles: tensors go to safetensors, everything else to JSON, and
    container types (int dict keys, tuples) survive the round trip exactly.
    """
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _encode(v, tensors, f"{key}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return {k: _decode(v, tensors) for k, v in obj["__dict__"]}


def save_checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, accelerator, cfg: dict,
                    keep: int | None) -> Path:
    """Write everything to a temporary directory, then rename it into place: never half a checkpoint."""
    root = out_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one file: a bar per checkpoint only clutters the training bar
    try:
        accelerator.unwrap_model(model).save_pretrained(tmp, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None, "rng": rng}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors)
    save_file(tensors, tmp / "trainer_state.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "state": skeleton}))
    dump_config(cfg, tmp / "run_config.yaml")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_atomic(root / LATEST, final.name)
    if keep:
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_trainer_state(path: Path) -> dict:
    """The optimizer, scheduler, scaler, RNG and step state of a checkpoint."""
    tensors = read_tensors(path / "trainer_state.safetensors")
    return _decode(json.loads((path / "trainer_state.json").read_text())["state"], tensors)


def load_checkpoint(path: Path, model, optimizer, scheduler, accelerator) -> int:
    weights, state = read_tensors(path / "model.safetensors"), read_trainer_state(path)
    try:
        accelerator.unwrap_model(model).load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError) as err:  # the config's model changed since: other weights
        raise ValueError(f"{path}: the checkpoint does not fit the model of this config ({err}); pass "
                         "--no-resume to start over, or give the run another out_dir") from None
    scheduler.load_state_dict(state["scheduler"])
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]
