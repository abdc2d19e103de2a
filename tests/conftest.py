"""Shared fixtures and strategies: random SR-BCRS problems of awkward shapes."""

import os
import random
import signal
from dataclasses import dataclass

import torch

from magicube.ops import SRBCRS, VectorMask, random_vector_mask, to_container
from magicube.ops.format import value_coordinates

def awkward_mask(m: int, k: int, v: int, sparsity: float, seed: int) -> VectorMask:
    """A random vector mask with an empty vector row and one full ("huge") row when possible."""
    mask = random_vector_mask(m, k, v, sparsity, seed).mask.clone()
    rows = mask.shape[0]
    if rows >= 2:
        mask[0] = False
        mask[rows // 2] = True
    return VectorMask(mask, v)


def random_ints(shape, bits: int, signed: bool = True, generator=None) -> torch.Tensor:
    """Uniform integers over the whole range of the type, extremes included (on the generator's
    device)."""
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1))) if signed else (0, 1 << bits)
    device = generator.device if generator is not None else None
    return torch.randint(lo, hi, shape, generator=generator, dtype=torch.int64, device=device)


def problem(bh, rows, k, v, sparsity, seed, shuffle=False):
    """A pattern (stride 32, the ops' stride) with its dense element mask; its columns in bank
    order for half the seeds (seed % 4 < 2) and ascending for the others."""
    mask = awkward_mask(rows * v, k, v, sparsity, seed)
    return SRBCRS.from_mask(mask, stride=32, shuffle=shuffle, bank_order=seed % 4 < 2), mask.to_dense()


def kept_slots(p: SRBCRS, r: int) -> torch.Tensor:
    """The flat value offsets (SR-BCRS values) of element row r's kept entries."""
    row, col = value_coordinates(p.row_ptr, p.col_idx, p.v, p.stride)
    return ((row == r) & (col >= 0)).nonzero().flatten()


def with_columns_shuffled(p: SRBCRS, generator) -> SRBCRS:
    """p with each row's kept columns in a random order over its kept slots: from_mask lists them
    in bank order or ascending, but SRBCRS accepts any order, so no kernel may rely on either."""
    col = p.col_idx.clone()
    starts = p.row_ptr[0::2].tolist()
    for s, e in zip(starts, starts[1:] + [p.nnz_pad]):
        kept = s + (col[s:e] >= 0).nonzero().flatten()  # with the int4 shuffle, not the first count slots
        col[kept] = col[kept][torch.randperm(kept.numel(), generator=generator)]
    return SRBCRS(p.m, p.k, p.v, p.stride, p.row_ptr, col, p.row_order, p.shuffled)


def with_row_order(p: SRBCRS, order: torch.Tensor) -> SRBCRS:
    """p walked in another row_order: the function is the same for any permutation of the rows."""
    return SRBCRS(p.m, p.k, p.v, p.stride, p.row_ptr, p.col_idx, order.contiguous(), p.shuffled)


def reordered(p: SRBCRS, generator) -> dict[str, SRBCRS]:
    """p in a shuffled and in a reversed row_order, orders that do not put the longest rows first."""
    rows = p.row_order.numel()
    return {"shuffled": with_row_order(p, p.row_order[torch.randperm(rows, generator=generator)]),
            "reversed": with_row_order(p, p.row_order.flip(0))}


def shifted(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A copy of t that starts `elements` past the start of a larger buffer, as a slice would."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    return view


# The fuzz tests' case count and seed (tests/test_*_fuzz_cuda.py).
FUZZ_CASES = int(os.environ.get("MAGICUBE_FUZZ_CASES", "48"))
FUZZ_SEED = int(os.environ.get("MAGICUBE_FUZZ_SEED", "0"))
FUZZ_SIZES = [64, 512, 2048, 4608]  # the fuzz cases' largest rows and columns


def fuzz_extent(rng: random.Random, v: int) -> tuple[int, int]:
    """A fuzz case's vector rows (of V) and columns, each from one up to one of FUZZ_SIZES elements."""
    rows = rng.randint(1, max(1, rng.choice(FUZZ_SIZES) // v))
    return rows, rng.randint(1, rng.choice(FUZZ_SIZES))


@dataclass
class RandomPattern:
    """One fuzz case's pattern: `rows` vector rows of V over `cols` columns, each keeping a random
    share of them (the case's density, or, where rows vary, a density of its own between none and
    twice that), with empty rows and a full one where drawn; its columns in any order the format
    allows (bank order, ascending, int4-shuffled, or random), a row order, and the kernels' inputs
    as views `offset` elements past a buffer's start (off the 16-byte boundaries that wide copies
    like) with a `longest_row` hint that may be wrong."""
    rows: int
    cols: int
    v: int
    density: float
    rows_vary: bool
    full_row: bool
    empty_rows: bool
    shuffle: bool
    bank_order: bool
    columns_shuffled: bool
    row_order: str
    offset: int
    hint: str
    seed: int

    @classmethod
    def draw(cls, rng: random.Random, rows: int, cols: int, v: int) -> "RandomPattern":
        return cls(rows, cols, v, density=rng.choice([0.005, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0]),
                   rows_vary=rng.random() < 0.5, full_row=rng.random() < 0.3, empty_rows=rng.random() < 0.3,
                   shuffle=rng.random() < 0.25, bank_order=rng.random() < 0.5,
                   columns_shuffled=rng.random() < 0.15,
                   row_order=rng.choice(["built", "built", "reversed", "shuffled"]),
                   offset=rng.choice([0, 0, 0, 1, 2, 3]),
                   hint=rng.choice(["exact", "exact", "unknown", "zero", "short", "long"]), seed=rng.randrange(1 << 30))

    def build(self) -> tuple[SRBCRS, torch.Tensor]:
        """The pattern (on the CPU) and its dense element mask."""
        g = torch.Generator().manual_seed(self.seed)
        density = torch.full((self.rows, 1), self.density)
        if self.rows_vary:
            density = (density * 2 * torch.rand(self.rows, 1, generator=g)).clamp(max=1.0)
        mask = torch.rand(self.rows, self.cols, generator=g) < density
        if self.empty_rows:
            mask[torch.rand(self.rows, generator=g) < 0.2] = False
        if self.full_row:
            mask[int(torch.randint(self.rows, (1,), generator=g))] = True
        vmask = VectorMask(mask, self.v)
        p = SRBCRS.from_mask(vmask, stride=32, shuffle=self.shuffle, bank_order=self.bank_order)
        if self.columns_shuffled:
            p = with_columns_shuffled(p, g)
        if self.row_order == "reversed":
            p = with_row_order(p, p.row_order.flip(0))
        elif self.row_order == "shuffled":
            p = with_row_order(p, p.row_order[torch.randperm(self.rows, generator=g)])
        return p, vmask.to_dense()

    def longest_row(self, p: SRBCRS) -> int:
        """The hint the kernels get for p: its longest row, or wrong in one of four ways."""
        return {"exact": p.longest_row, "unknown": -1, "zero": 0, "short": p.longest_row // 2,
                "long": p.longest_row + 100}[self.hint]

    def view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """t as the kernels get it: shifted by `offset` elements."""
        return t if t is None or self.offset == 0 else shifted(t, self.offset)


def load_kernels(family: str):
    """Build and load one kernel family; its ops are then under torch.ops.magicube_cuda."""
    from magicube.ops import extension

    extension.load(family)
    return torch.ops.magicube_cuda


def poison_allocator(value, dtype) -> None:
    """Leave a freed block of garbage for the caching allocator to hand out next, so that an
    output element a kernel fails to write shows up as that garbage."""
    junk = torch.full((1 << 22,), value, dtype=dtype, device="cuda")
    del junk


def imdb_source():
    """The IMDB archive for the data tests: $MAGICUBE_IMDB, ./data, or the copy beside the checkout."""
    from pathlib import Path

    from magicube.train import imdb

    repo = Path(__file__).resolve().parents[1]
    for c in (os.environ.get("MAGICUBE_IMDB"), repo / "data", repo.parent / "shared" / "data"):
        if c:
            try:
                return imdb.find_imdb(c)
            except FileNotFoundError:
                pass
    return None


__all__ = ["FUZZ_CASES", "FUZZ_SEED", "RandomPattern", "imdb_source", "load_kernels", "poison_allocator", "SRBCRS",
           "awkward_mask", "random_ints", "shifted", "to_container", "problem"]


def signal_at_forward(monkeypatch, call: int, signum=signal.SIGINT, times: int = 1) -> None:
    """Send this process `signum` (`times` over) during the model's `call`-th forward pass: Ctrl-C
    in the middle of a training step, at a point that does not depend on the machine's speed."""
    from magicube.model.lra import LRAClassifier  # here: the kernels' test files need no transformers

    calls = []
    forward = LRAClassifier.forward

    def signalling(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            for _ in range(times):
                signal.raise_signal(signum)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LRAClassifier, "forward", signalling)
