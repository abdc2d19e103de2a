"""Task data as `datasets` tables: encoded once, cached as Arrow, handed to training as tensors.

`data` config keys: task ("text" | "listops"), path (IMDB archive/folder, or the folder of
ListOps TSVs), cache_dir, limit (a fixed random N examples per split, for quick runs), and for ListOps
`generate` (a ListOpsSpec as a dict) with `auto_generate` (write the TSVs when missing).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from . import imdb, listops

NUM_CLASSES = {"text": 2, "listops": 10}
VOCAB_SIZE = {"text": 257, "listops": len(listops.VOCAB)}
EVAL_SPLIT = {"text": "test", "listops": "val"}  # LRA text has no validation split
CACHE_VERSION = 2


def check_task(task) -> str:
    """data.task, refused by name unless it is one of the tasks."""
    if task not in NUM_CLASSES:
        raise ValueError(f"data.task: expected one of {tuple(NUM_CLASSES)}, got {task!r}")
    return task


def listops_spec(cfg: dict) -> listops.ListOpsSpec:
    return listops.ListOpsSpec(**(cfg.get("generate") or {}))


def prepare_listops(cfg: dict) -> Path:
    """The ListOps folder; with auto_generate, (re)generated unless it holds exactly cfg['generate']."""
    directory = Path(cfg.get("path") or "data/listops")
    if cfg.get("auto_generate"):
        spec = listops_spec(cfg)
        record = directory / "spec.json"
        want = json.dumps(asdict(spec), sort_keys=True)
        missing = [s for s in listops.SPLITS if not listops.tsv_path(directory, s).is_file()]
        if missing or not record.is_file() or record.read_text() != want:
            listops.write_splits(directory, spec)
            record.write_text(want)
    return directory


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stat(p: Path) -> list:
    if p.is_dir():
        return [str(p.resolve())]
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def _encode_batch(length: int, encode):
    def fn(batch):
        col = "text" if "text" in batch else "source"
        ids = np.zeros((len(batch[col]), length), dtype=np.int16)
        for i, x in enumerate(batch[col]):
            ids[i] = encode(x, length)
        return {"input_ids": ids}
    return fn


def _text_encode(text: bytes, length: int) -> np.ndarray:
    ids = np.frombuffer(text[:length], dtype=np.uint8).astype(np.int16) + 1
    return np.pad(ids, (0, length - len(ids)))


def build_datasets(cfg: dict, length: int):
    """{split: datasets.Dataset with columns input_ids (int16, `length` wide) and label}."""
    import datasets

    task = check_task(cfg.get("task"))
    limit = cfg.get("limit")
    if task == "text":
        src = imdb.find_imdb(cfg.get("path"))
        splits, key_src = imdb.SPLITS, _stat(src)
    else:
        src = prepare_listops(cfg)
        splits = listops.SPLITS
        key_src = [_stat(listops.tsv_path(src, s)) if listops.tsv_path(src, s).is_file() else None
                   for s in splits]
    cache = Path(cfg.get("cache_dir") or "runs/cache") / f"{task}-{length}-" \
        f"{_fingerprint(CACHE_VERSION, task, key_src, length, limit)}"
    if not (cache / "done").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        # An OS lock, which dies with its holder: runs that want the same cache at once build it
        # once, and a build folder seen while holding the lock was left by a build killed outright.
        with FileLock(cache.with_name(cache.name + ".lock")):
            if not (cache / "done").is_file():
                _build(task, src, splits, limit, length, cache)
    return {s: datasets.load_from_disk(str(cache / s)) for s in splits}


def _build(task: str, src: Path, splits: tuple[str, ...], limit: int | None, length: int, cache: Path) -> None:
    import datasets

    if task == "text":
        raw = imdb.read_imdb(src)
        tables = {s: {"text": raw[s]["text"], "label": raw[s]["label"]} for s in splits}
        encode = _text_encode
    else:
        tables = {}
        for s in splits:
            sources, targets = listops.read_tsv(listops.tsv_path(src, s))
            tables[s] = {"source": sources, "label": targets}
        encode = listops.encode
    for s in splits:
        if not tables[s]["label"]:
            raise ValueError(f"data: the {s} split of {src} holds no examples")
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int16"), length=length),
                                  "label": datasets.Value("int64")})
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # seconds of work: the training bar is the one to watch
    try:
        for s in splits:
            t = tables[s]
            n = len(t["label"])
            if limit is not None and limit < n:
                # a fixed random subset: IMDB splits are sorted by label, so a prefix would be one class
                keep = sorted(random.Random(0).sample(range(n), limit))
                t = {k: [v[i] for i in keep] for k, v in t.items()}
            ds = datasets.Dataset.from_dict(t)
            ds = ds.map(_encode_batch(length, encode), batched=True, batch_size=1000,
                        remove_columns=[c for c in ds.column_names if c != "label"], features=features)
            ds.save_to_disk(str(tmp / s))
    except BaseException:  # Ctrl-C too: a half-built cache is hundreds of MB for IMDB
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            datasets.enable_progress_bars()
    (tmp / "done").write_text(json.dumps({"task": task, "length": length, "limit": limit}))
    shutil.rmtree(cache, ignore_errors=True)  # a folder without "done": an interrupted older layout
    os.replace(tmp, cache)


def load_tensors(cfg: dict, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{split: (input_ids int16 [N, length], labels int64 [N])}, held in memory."""
    out = {}
    for split, ds in build_datasets(cfg, length).items():
        t = ds.with_format("torch")[:]
        out[split] = (t["input_ids"].to(torch.int16), t["label"].to(torch.int64))
    return out
