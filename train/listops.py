"""ListOps (Nangia & Bowman 2018) as Long Range Arena generates and reads it.

Generation follows LRA's public rules: operators MIN, MAX, MED, SM (sum mod 10); an
operator node (instead of a digit) with probability 0.25 at every depth below the maximum;
2..max_args arguments per operator; only expressions whose token count lies strictly
between min_length and max_length are kept; duplicates are dropped. Files are LRA's TSVs
(`basic_{train,val,test}.tsv`, header `Source<TAB>Target`).
"""
from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass
from pathlib import Path

from magicube.train.config import check_count
from magicube.train.files import check_writable, open_atomic

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUE_P = 0.25
SPLITS = ("train", "val", "test")
# id 0 is padding; LRA's own files wrap every sub-expression in "( ... )", which carry no
# information and are skipped when reading.
VOCAB = ("<pad>",) + OPERATORS + (END,) + tuple(str(d) for d in range(10))
TOKEN_TO_ID = {t: i for i, t in enumerate(VOCAB)}
IGNORED_TOKENS = frozenset({"(", ")"})
HOW_TO_GET = "generate it with `magicube data listops --out {dir}`"


@dataclass(frozen=True)
class ListOpsSpec:
    """What to generate; the defaults are LRA's full setting."""

    num_train: int = 96_000
    num_val: int = 2_000
    num_test: int = 2_000
    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    seed: int = 0

    def __post_init__(self):
        for name in ("num_train", "num_val", "num_test", "max_depth", "max_args", "min_length"):
            check_count(f"data.generate.{name}", getattr(self, name), 0 if name.startswith("num_") else 1)
        if not isinstance(self.max_length, int) or self.max_length < self.min_length:
            raise ValueError(f"data.generate.max_length: expected an integer >= min_length = {self.min_length}, "
                             f"got {self.max_length!r}")

    def counts(self) -> dict[str, int]:
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}


def _apply(op: str, args: list[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        # LRA takes int(np.median(...)): the mean of the two middle values, truncated.
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    return sum(args) % 10


def _tree(rng: random.Random, depth: int, spec: ListOpsSpec, out: list[str]) -> int:
    """Append one random expression's tokens to `out`; return its value."""
    r = rng.random() if depth < spec.max_depth else 1.0
    if r > VALUE_P:
        value = rng.randrange(10)
        out.append(str(value))
        return value
    head = len(out)
    out.append("")  # the operator is drawn after its arguments, as LRA does
    args = [_tree(rng, depth + 1, spec, out) for _ in range(rng.randint(2, spec.max_args))]
    op = rng.choice(OPERATORS)
    out[head] = op
    out.append(END)
    return _apply(op, args)


def generate(spec: ListOpsSpec) -> dict[str, list[tuple[str, int]]]:
    """Deterministic (by spec.seed) ListOps splits: {split: [(source, target), ...]}."""
    rng = random.Random(spec.seed)
    total = sum(spec.counts().values())
    seen: dict[str, int] = {}
    while len(seen) < total:
        tokens: list[str] = []
        value = _tree(rng, 1, spec, tokens)
        if spec.min_length < len(tokens) < spec.max_length:
            seen.setdefault(" ".join(tokens), value)
    items = list(seen.items())
    out, start = {}, 0
    for split, n in spec.counts().items():
        out[split] = items[start:start + n]
        start += n
    return out


def tsv_path(directory: str | os.PathLike, split: str) -> Path:
    return Path(directory) / f"basic_{split}.tsv"


def write_tsv(path: str | os.PathLike, rows: list[tuple[str, int]]) -> None:
    """Write one LRA TSV whole (a reader never sees half a file)."""
    with open_atomic(path, newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["Source", "Target"])
        w.writerows(rows)


def write_splits(directory: str | os.PathLike, spec: ListOpsSpec) -> dict[str, Path]:
    check_writable(directory)  # before the minute that generating takes; write_tsv makes it
    data = generate(spec)
    paths = {}
    for split, rows in data.items():
        paths[split] = tsv_path(directory, split)
        write_tsv(paths[split], rows)
    return paths


def read_tsv(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Read an LRA ListOps TSV; errors name the file and say how to get a good one."""
    path = Path(path)
    hint = HOW_TO_GET.format(dir=path.parent)
    if not path.is_file():
        raise FileNotFoundError(f"ListOps file {path} not found; {hint}")
    sources, targets = [], []
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header != ["Source", "Target"]:
            raise ValueError(f"{path}: expected the header 'Source<TAB>Target', got {header!r}; {hint}")
        for lineno, row in enumerate(reader, start=2):
            if len(row) != 2:
                raise ValueError(f"{path}:{lineno}: expected 2 tab-separated fields, got {len(row)}; {hint}")
            src, tgt = row
            try:
                target = int(tgt)
            except ValueError:
                target = -1
            if not 0 <= target <= 9:
                raise ValueError(f"{path}:{lineno}: target {tgt!r} is not a digit 0-9; {hint}")
            bad = [t for t in src.split() if t not in TOKEN_TO_ID and t not in IGNORED_TOKENS]
            if bad or not src.strip():
                raise ValueError(f"{path}:{lineno}: unknown tokens {bad[:5]!r} in the expression; {hint}")
            sources.append(src)
            targets.append(target)
    return sources, targets


def encode(source: str, length: int) -> list[int]:
    """Whitespace tokens -> ids, truncated or padded with 0 to `length`."""
    ids = [TOKEN_TO_ID[t] for t in source.split() if t not in IGNORED_TOKENS][:length]
    return ids + [0] * (length - len(ids))
