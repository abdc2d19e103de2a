"""Byte-level IMDB reviews (LRA text classification) from the official aclImdb archive.

Takes `aclImdb_v1.tar.gz` or its unpacked folder (`aclImdb/{train,test}/{pos,neg}/{id}_{rating}.txt`).
The archive is streamed once: every review is read in a single sequential pass.
"""
from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

SPLITS = ("train", "test")
LABELS = {"neg": 0, "pos": 1}
ARCHIVE = "aclImdb_v1.tar.gz"
HOW_TO_GET = ("download https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz and pass the archive "
              "(or the folder it unpacks to) as data.path, or set MAGICUBE_IMDB to it")
_MEMBER = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")


def find_imdb(path: str | os.PathLike | None = None) -> Path:
    """Resolve the IMDB source: an explicit path, else $MAGICUBE_IMDB, else ./data."""
    candidates = [path] if path else [os.environ.get("MAGICUBE_IMDB"), Path("data")]
    for c in candidates:
        if not c:
            continue
        p = Path(c).expanduser()
        for q in (p, p / ARCHIVE, p / "aclImdb"):
            if q.is_file() and q.name.endswith((".tar.gz", ".tgz", ".tar", ".tar.xz", ".tar.bz2")):
                return q
            if q.is_dir() and q.name == "aclImdb" and (q / "train").is_dir():
                return q
    where = path or "$MAGICUBE_IMDB or ./data"
    raise FileNotFoundError(f"IMDB reviews not found at {where}; {HOW_TO_GET}")


def read_imdb(path: str | os.PathLike) -> dict[str, dict[str, list]]:
    """{split: {"text": [bytes], "label": [0/1], "id": [int], "rating": [int]}}, sorted by (label, id)."""
    path = Path(path)
    rows: dict[str, list[tuple[int, int, int, bytes]]] = {s: [] for s in SPLITS}
    if path.is_dir():
        for split in SPLITS:
            for name, label in LABELS.items():
                for f in (path / split / name).glob("*_*.txt"):
                    m = _MEMBER.search(f"aclImdb/{split}/{name}/{f.name}")
                    if m:
                        rows[split].append((label, int(m[3]), int(m[4]), f.read_bytes()))
    else:
        # "r|*" streams the archive (one pass, no seeking back to a member index).
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                m = _MEMBER.search(member.name) if member.isfile() else None
                if m:
                    data = tar.extractfile(member).read()
                    rows[m[1]].append((LABELS[m[2]], int(m[3]), int(m[4]), data))
    out = {}
    for split, r in rows.items():
        if not r:
            raise ValueError(f"{path}: no reviews under aclImdb/{split}/{{pos,neg}}; {HOW_TO_GET}")
        r.sort(key=lambda x: (x[0], x[1]))
        out[split] = {"text": [x[3] for x in r], "label": [x[0] for x in r],
                      "id": [x[1] for x in r], "rating": [x[2] for x in r]}
    return out


def encode(text: bytes, length: int) -> list[int]:
    """UTF-8 bytes -> byte + 1 (0 is padding), truncated or padded to `length`."""
    ids = [b + 1 for b in text[:length]]
    return ids + [0] * (length - len(ids))
