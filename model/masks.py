"""Attention masks of V x 1 column vectors, one per layer, shared by batch and heads.

`random`: every vector row keeps the same number of random columns (the paper's setting).
`structured`: a local window around the diagonal, position 0 (CLS) as a global row and
column, then random columns up to the same per-row budget; everything in V x 1 vectors.
"""
from __future__ import annotations

import torch

from magicube.ops import VectorMask, random_vector_mask

KINDS = ("random", "structured")


def structured_vector_mask(length: int, v: int, sparsity: float, window: int, seed: int = 0) -> VectorMask:
    """Local window of `window` tokens each side + global CLS row/column + random fill."""
    if length % v:
        raise ValueError(f"length: expected a multiple of v={v}, got {length}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity: expected a fraction in [0, 1], got {sparsity}")
    rows = length // v
    budget = round((1.0 - sparsity) * length)
    cols = torch.arange(length)
    first = torch.arange(rows)[:, None] * v  # first token row of each vector row
    mask = (cols >= first - window) & (cols <= first + v - 1 + window)
    mask[:, 0] = True  # every token attends to CLS
    mask[0, :] = True  # CLS (and the rest of its vector row) attends to every token
    # Random fill: the lowest-scored free columns of each row until the row reaches the budget.
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, length, generator=gen).masked_fill(mask, 2.0)
    extra = (budget - mask.sum(1)).clamp(min=0)
    rank = scores.argsort(dim=1).argsort(dim=1)
    mask |= rank < extra[:, None]
    return VectorMask(mask, v)


def layer_mask(kind: str, length: int, v: int, sparsity: float, seed: int, window: int = 32) -> VectorMask:
    if kind == "random":
        return random_vector_mask(length, length, v=v, sparsity=sparsity, seed=seed)
    if kind == "structured":
        return structured_vector_mask(length, v, sparsity, window, seed)
    raise ValueError(f"mask kind: expected one of {KINDS}, got {kind!r}")
