"""Vector-sparse masks and the SR-BCRS format of the paper.

A sparse M x K matrix keeps whole V x 1 column vectors (V in {2, 4, 8}): its mask is an
(M/V) x K boolean matrix of "vector rows". SR-BCRS stores each vector row's kept vectors
padded to a multiple of the stride S (the MMA reduction size), and inside every block of S
slots the V x S values row-major, so that a warp reads operand fragments contiguously:

    value of row i*V + r at slot p = start_i + j*S + c  ->  flat offset (start_i + j*S)*V + r*S + c

Padding slots carry column -1 and value 0 and follow a row's kept slots (the int4 shuffle aside,
which permutes inside groups of 8 slots). One pattern is shared by every (batch x head);
the values carry the leading batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VECTOR_LENGTHS = (2, 4, 8)
STRIDES = (8, 16, 32, 64)

# Slot s of an 8-slot group holds logical column INT4_SHUFFLE[s]: with this order the low
# nibbles of a packed 32-bit word are logical columns 0..3 and the high nibbles 4..7, so a
# kernel unpacks int4 to int8 with one mask and one shift per word instead of a transpose.
INT4_SHUFFLE = (0, 4, 1, 5, 2, 6, 3, 7)

# The resident-B SpMM kernel (csrc/spmm_kernel.cuh) holds a column slice of B in shared memory, B
# row r in bank group r % 8, and reads a block's 32 gathered rows by ldmatrix, 8 rows a phase: rows
# of one phase in one bank group are read one after another. BANK_GROUP[s] is the group that slot s
# of a 32-slot block asks for. It differs among the 8 slots of every phase under both of the
# kernel's slot-to-phase maps (8- and 16-bit A: a phase fixes bits 1 and 4 of s; 4-bit A: bits 0
# and 2), so a block whose columns fill every group's asks reads each phase without a conflict.
BANK_GROUP = tuple(((s ^ s >> 1) & 1) | ((s >> 2 ^ s >> 4) & 1) << 1 | (s >> 3 & 1) << 2 for s in range(32))
_GROUP = torch.tensor(BANK_GROUP)
# how often a block of c slots asks for each group (column 8: empty slots, never asked for), and so
# slot s's rank among the slots of its block that ask for its group
_BLOCK_ASKS = torch.cat([torch.zeros(1, 9, dtype=torch.int64), torch.nn.functional.one_hot(_GROUP, 9).cumsum(0)])
_SLOT_RANK = _BLOCK_ASKS[torch.arange(32), _GROUP]


def _check_vector_length(v: int) -> None:
    if v not in VECTOR_LENGTHS:
        raise ValueError(f"v: expected one of {VECTOR_LENGTHS}, got {v!r}")


def _described(x) -> str:
    """A tensor's dtype and shape, or what else was given, for an error message."""
    return f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class VectorMask:
    """Which V x 1 column vectors of an M x K matrix are kept.

    `mask` is a bool tensor of shape (M/V, K): mask[i, k] keeps rows i*V .. i*V+V-1 of column k.
    """

    mask: torch.Tensor
    v: int

    def __post_init__(self):
        _check_vector_length(self.v)
        if not isinstance(self.mask, torch.Tensor) or self.mask.dtype != torch.bool or self.mask.dim() != 2:
            raise ValueError(f"mask: expected a 2-D bool tensor of shape (M/V, K), got {_described(self.mask)}")

    @property
    def m(self) -> int:
        return self.mask.shape[0] * self.v

    @property
    def k(self) -> int:
        return self.mask.shape[1]

    @property
    def density(self) -> float:
        return float(self.mask.float().mean()) if self.mask.numel() else 0.0

    def to_dense(self) -> torch.Tensor:
        """The element mask, (M, K) bool."""
        return self.mask.repeat_interleave(self.v, dim=0)


def random_vector_mask(m: int, k: int, v: int, sparsity: float, seed: int = 0) -> VectorMask:
    """Keep round((1 - sparsity) * K) random vectors in each vector row, as in the paper.

    Every vector row keeps the same count, so rows are balanced; the columns differ per row.
    """
    _check_vector_length(v)
    if m <= 0 or m % v:
        raise ValueError(f"m: expected a positive multiple of v={v}, got {m}")
    if k <= 0:
        raise ValueError(f"k: expected a positive number of columns, got {k}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity: expected a fraction in [0, 1], got {sparsity}")
    keep = round((1.0 - sparsity) * k)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(m // v, k, generator=gen)
    idx = scores.argsort(dim=1)[:, :keep]
    mask = torch.zeros(m // v, k, dtype=torch.bool)
    mask.scatter_(1, idx, True)
    return VectorMask(mask, v)


def vector_mask_from_dense(dense: torch.Tensor, v: int) -> VectorMask:
    """Validate an (M, K) bool mask made of whole V x 1 vectors and return its VectorMask."""
    _check_vector_length(v)
    if not isinstance(dense, torch.Tensor) or dense.dtype != torch.bool or dense.dim() != 2:
        raise ValueError(f"dense: expected a 2-D bool tensor (M, K), got {_described(dense)}")
    m, k = dense.shape
    if m % v:
        raise ValueError(f"dense: its {m} rows are not a multiple of v={v}")
    groups = dense.reshape(m // v, v, k)
    kept = groups.any(dim=1)
    if not torch.equal(groups.all(dim=1), kept):
        i, col = (kept & ~groups.all(dim=1)).nonzero()[0].tolist()
        raise ValueError(
            f"dense: not a V x 1 vector mask for v={v}: rows {i * v}..{i * v + v - 1} of column {col} "
            "are partly kept")
    return VectorMask(kept.cpu(), v)


@dataclass(frozen=True)
class SRBCRS:
    """The index part of an SR-BCRS matrix; values live in separate [..., nnz_pad*V] tensors.

    row_ptr:   int32 [2*(M/V)], pairs (start of the padded vector row, start + kept count),
               in slots.
    col_idx:   int32 [nnz_pad], each vector row's kept columns (in bank order or ascending, see
               from_mask; any order is valid), then -1 for padding (before the int4 shuffle,
               if `shuffled`).
    row_order: int32 [M/V], vector rows by decreasing padded length, for load balance.
    longest_row: the most vectors a vector row keeps (derived), which lets a kernel know without
               reading the pattern on the GPU whether any row is long enough to need other work.
    """

    m: int
    k: int
    v: int
    stride: int
    row_ptr: torch.Tensor
    col_idx: torch.Tensor
    row_order: torch.Tensor
    shuffled: bool = False
    longest_row: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """Validate the index arrays once, so that kernels never index through a bad entry."""
        _check_vector_length(self.v)
        if self.stride not in STRIDES:
            raise ValueError(f"stride: expected one of {STRIDES}, got {self.stride!r}")
        if self.m <= 0 or self.m % self.v:
            raise ValueError(f"m: expected a positive multiple of v={self.v}, got {self.m}")
        rows = self.m // self.v
        for name, t, n in (("row_ptr", self.row_ptr, 2 * rows), ("col_idx", self.col_idx, None),
                           ("row_order", self.row_order, rows)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                raise ValueError(f"{name}: expected a 1-D int32 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
            if n is not None and t.numel() != n:
                raise ValueError(f"{name}: expected {n} entries for m={self.m}, v={self.v}, got {t.numel()}")
        starts, ends = self.row_ptr[0::2].long(), self.row_ptr[1::2].long()
        padded = torch.diff(starts, append=starts.new_tensor([self.nnz_pad]))
        if (rows and int(starts[0]) != 0) or bool((starts % self.stride != 0).any()) or bool((padded < 0).any()):
            raise ValueError(f"row_ptr: row starts must begin at 0, ascend and be multiples of the stride "
                             f"{self.stride}")
        if bool(((ends < starts) | (ends - starts > padded) | (padded - (ends - starts) >= self.stride)).any()):
            raise ValueError("row_ptr: each pair must be (start, start + kept count) with the count padded by less "
                             "than one stride")
        if self.col_idx.numel() and (int(self.col_idx.min()) < -1 or int(self.col_idx.max()) >= self.k):
            raise ValueError(f"col_idx: entries must be -1 (padding) or columns in [0, {self.k}), got range "
                             f"[{int(self.col_idx.min())}, {int(self.col_idx.max())}]")
        if not torch.equal(torch.sort(self.row_order.long()).values, torch.arange(rows, device=self.row_order.device)):
            raise ValueError(f"row_order: expected a permutation of the {rows} vector rows")
        # A kernel may find a row's kept slots from its count (the softmax does, reading col_idx
        # only in the 8-slot group where the count ends), so padding may lie nowhere else.
        row, _ = slot_coordinates(self.row_ptr, self.col_idx)
        kept = torch.arange(self.nnz_pad, device=row.device) < ends[row]
        if self.shuffled:
            kept = kept[_shuffle_permutation(self.nnz_pad).to(row.device)]
        wrong = (self.col_idx >= 0) != kept
        if bool(wrong.any()):
            r = int(row[wrong.nonzero()[0]])
            raise ValueError(f"col_idx: vector row {r} must keep columns (>= 0) in exactly its first "
                             f"{int(ends[r] - starts[r])} slots (row_ptr's count) and -1 in the rest"
                             + (", before the int4 shuffle of every 8 slots" if self.shuffled else ""))
        object.__setattr__(self, "longest_row", int((ends - starts).max()) if rows else 0)

    @classmethod
    def from_mask(cls, mask: VectorMask, stride: int = 32, shuffle: bool = False,
                  bank_order: bool = True) -> SRBCRS:
        """The pattern of `mask`. Each vector row's kept columns go ascending, then permuted inside
        each 32-slot block into bank order (BANK_GROUP, _bank_order) unless bank_order=False;
        shuffle then applies INT4_SHUFFLE inside every group of 8 slots (the paper's int4 layout;
        the kernels do not need it)."""
        if not isinstance(mask, VectorMask):
            raise TypeError(f"mask: expected a VectorMask, got {type(mask).__name__}")
        if stride not in STRIDES:
            raise ValueError(f"stride: expected one of {STRIDES}, got {stride!r}")
        bits = mask.mask.cpu()
        rows, k = bits.shape
        counts = bits.sum(dim=1).to(torch.int64)
        padded = (counts + stride - 1) // stride * stride
        starts = torch.cumsum(padded, 0) - padded
        row_ptr = torch.stack([starts, starts + counts], dim=1).reshape(-1)
        nnz_pad = int(padded.sum())
        if nnz_pad >= 2**31:
            raise ValueError(f"mask: {nnz_pad} padded vectors exceed the int32 indices of the format")
        col_idx = torch.full((nnz_pad,), -1, dtype=torch.int64)
        row_of, col_of = bits.nonzero(as_tuple=True)
        # position of each kept vector inside its row = running index minus the row's first one
        first = torch.cumsum(counts, 0) - counts
        slot = starts[row_of] + torch.arange(row_of.numel()) - first[row_of]
        col_idx[slot] = col_of
        if bank_order:
            col_idx = _bank_order(col_idx, counts)
        if shuffle:
            col_idx = col_idx[_shuffle_permutation(nnz_pad)]
        row_order = torch.sort(padded, descending=True, stable=True).indices
        return cls(mask.m, k, mask.v, stride, row_ptr.to(torch.int32), col_idx.to(torch.int32),
                   row_order.to(torch.int32), shuffle)

    @property
    def nnz_pad(self) -> int:
        return self.col_idx.numel()

    @property
    def device(self) -> torch.device:
        return self.col_idx.device

    def to(self, device) -> SRBCRS:
        return SRBCRS(self.m, self.k, self.v, self.stride, self.row_ptr.to(device),
                      self.col_idx.to(device), self.row_order.to(device), self.shuffled)

    def vector_mask(self) -> VectorMask:
        mask = torch.zeros(self.m // self.v, self.k, dtype=torch.bool)
        row, col = slot_coordinates(self.row_ptr.cpu(), self.col_idx.cpu())
        keep = col >= 0
        mask[row[keep], col[keep]] = True
        return VectorMask(mask, self.v)

    def element_coordinates(self) -> tuple[torch.Tensor, torch.Tensor]:
        return value_coordinates(self.row_ptr, self.col_idx, self.v, self.stride)

    def pack_values(self, dense: torch.Tensor) -> torch.Tensor:
        """[..., M, K] dense -> [..., nnz_pad*V] values in the SR-BCRS layout (0 on padding)."""
        if dense.dim() < 2 or tuple(dense.shape[-2:]) != (self.m, self.k):
            raise ValueError(f"dense: expected shape [..., {self.m}, {self.k}], got {tuple(dense.shape)}")
        row, col = self.element_coordinates()
        row, col = row.to(dense.device), col.to(dense.device)
        pad = col < 0
        out = dense[..., row, col.clamp(min=0)]
        return out.masked_fill(pad, 0)

    def to_dense(self, values: torch.Tensor) -> torch.Tensor:
        """[..., nnz_pad*V] values -> [..., M, K] dense with zeros outside the mask."""
        if values.dim() < 1 or values.shape[-1] != self.nnz_pad * self.v:
            raise ValueError(
                f"values: expected last dimension nnz_pad*V = {self.nnz_pad * self.v}, got shape {tuple(values.shape)}")
        row, col = self.element_coordinates()
        row, col = row.to(values.device), col.to(values.device)
        keep = col >= 0
        out = values.new_zeros(*values.shape[:-1], self.m, self.k)
        out[..., row[keep], col[keep]] = values[..., keep]
        return out


def _bank_order(col_idx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """col_idx (each row's `counts` kept columns ascending, the rows in order, padding -1) with the
    columns of each 32-slot block of a row permuted so that slot s holds a column in bank group
    BANK_GROUP[s % 32] wherever the block has one left.

    Per block and group, the first min(asked, held) slots that ask for the group take the group's
    columns in ascending order; the slots left over take the columns left over, their groups
    interleaved (a group's first spare column, then every group's second, ...), so that a phase
    that must repeat a group repeats it as few times as the block allows. On random rows at
    density 0.1 a phase reads 1.9 rows of its most-read group on average, ascending columns 2.5.
    Each block keeps the columns it holds in ascending order, so the kernels that gather a block's
    rows (SpMM's gather kernel, the fused attention) read the same rows block by block; across a
    whole row the groups balance better (1.25) and the resident kernel ran faster still, but a
    block's columns then spread over four times the range of K (kernel_checks.md,
    sixty-seventh round)."""
    if not int(counts.sum()):
        return col_idx
    # the rows' 32-slot blocks as rows of a [blocks, 32] table, the slots past a block's size empty
    row_blocks = (counts + 31) // 32
    row = torch.repeat_interleave(torch.arange(counts.numel()), row_blocks)
    local = 32 * (torch.arange(row.numel()) - (torch.cumsum(row_blocks, 0) - row_blocks)[row])
    size = torch.clamp(counts[row] - local, max=32)
    slot = torch.arange(32)
    valid = slot < size[:, None]
    kept = col_idx >= 0  # the rows' kept slots in order: the table's valid slots, row-major
    col = torch.full(valid.shape, -1, dtype=col_idx.dtype).masked_scatter_(valid, col_idx[kept])
    group = torch.where(valid, col % 8, 8)  # group 8: no column
    by_group = torch.sort(group, dim=1, stable=True)
    holds = torch.zeros(valid.shape[0], 9, dtype=torch.int64).scatter_add_(1, group, torch.ones_like(group))
    first = torch.cumsum(holds, 1) - holds  # where each group starts in by_group
    col_rank = torch.empty_like(group).scatter_(1, by_group.indices, slot - first.gather(1, by_group.values))
    matched = torch.minimum(_BLOCK_ASKS[size], holds)
    slot_fits = valid & (_SLOT_RANK < matched[:, _GROUP])
    fitted = col.gather(1, by_group.indices).gather(1, (first[:, _GROUP] + _SLOT_RANK).clamp(max=31))
    # the spare columns, spare index first and group second, into the open slots in slot order
    spare_rank = col_rank - matched.gather(1, group)
    spare_key = torch.where(valid & (spare_rank >= 0), spare_rank * 8 + group, 1 << 20)
    spares = col.gather(1, torch.sort(spare_key, dim=1).indices)
    open_slots = torch.sort(torch.where(valid & ~slot_fits, slot, 32), dim=1).indices
    spread = torch.empty_like(col).scatter_(1, open_slots, spares)
    return col_idx.masked_scatter(kept, torch.where(slot_fits, fitted, spread)[valid])


def _shuffle_permutation(n: int) -> torch.Tensor:
    """Index map that applies INT4_SHUFFLE inside every aligned group of 8 slots."""
    if n % 8:
        raise ValueError(f"shuffle: needs padded rows that are a multiple of 8 slots, got {n} slots")
    base = torch.arange(n).reshape(-1, 8)
    return base[:, list(INT4_SHUFFLE)].reshape(-1)


def slot_coordinates(row_ptr: torch.Tensor, col_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(vector row, column) of every slot; column -1 on padding."""
    starts = row_ptr[0::2].long()
    padded = torch.diff(starts, append=starts.new_tensor([col_idx.numel()]))
    rows = torch.repeat_interleave(torch.arange(starts.numel(), device=col_idx.device), padded)
    return rows, col_idx.long()


def value_coordinates(row_ptr: torch.Tensor, col_idx: torch.Tensor, v: int, stride: int):
    """(row, col) in the M x K matrix of every flat value offset; col is -1 on padding."""
    row, col = slot_coordinates(row_ptr, col_idx)
    offset = torch.arange(col_idx.numel() * v, device=col_idx.device)
    slot = offset // (v * stride) * stride + offset % stride
    return row[slot] * v + offset // stride % v, col[slot]
