"""SR-BCRS and vector masks: layout, round trips and validation."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import awkward_mask
from magicube.ops import BANK_GROUP, INT4_SHUFFLE, SRBCRS, VectorMask, random_vector_mask, vector_mask_from_dense


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 7), k=st.integers(1, 90), v=st.sampled_from([2, 4, 8]),
       stride=st.sampled_from([8, 16, 32]), sparsity=st.floats(0, 1), seed=st.integers(0, 2**16),
       shuffle=st.booleans(), bank_order=st.booleans(), bh=st.integers(1, 3))
def test_round_trip(rows, k, v, stride, sparsity, seed, shuffle, bank_order, bh):
    mask = awkward_mask(rows * v, k, v, sparsity, seed)
    p = SRBCRS.from_mask(mask, stride=stride, shuffle=shuffle, bank_order=bank_order)
    dense = torch.randint(-100, 100, (bh, rows * v, k))
    values = p.pack_values(dense)
    assert values.shape == (bh, p.nnz_pad * v)
    assert torch.equal(p.to_dense(values), dense * mask.to_dense())
    assert torch.equal(p.vector_mask().mask, mask.mask)
    # padded rows are multiples of the stride, pads are -1 and carry 0
    starts, ends = p.row_ptr[0::2].long(), p.row_ptr[1::2].long()
    padded = torch.diff(starts, append=starts.new_tensor([p.nnz_pad]))
    assert torch.equal(ends - starts, mask.mask.sum(1))
    assert bool((padded % stride == 0).all()) and bool((padded - (ends - starts) < stride).all())
    assert int((p.col_idx == -1).sum()) == int((padded - (ends - starts)).sum())
    _, col = p.element_coordinates()
    assert bool((values[:, col < 0] == 0).all())
    # row_order sorts vector rows by padded length, longest first
    assert bool((padded[p.row_order.long()].diff() <= 0).all())


def test_value_layout_is_row_major_inside_each_stride_block():
    v, s = 4, 8
    mask = VectorMask(torch.ones(1, 16, dtype=torch.bool), v)
    p = SRBCRS.from_mask(mask, stride=s, bank_order=False)
    dense = torch.arange(4 * 16).reshape(1, 4, 16)
    values = p.pack_values(dense)[0]
    # block 0: rows 0..3 of columns 0..7, row-major; then block 1: columns 8..15
    expected = torch.cat([dense[0, :, 0:8].reshape(-1), dense[0, :, 8:16].reshape(-1)])
    assert torch.equal(values, expected)


def test_int4_shuffle_permutes_slots_within_groups_of_eight():
    mask = VectorMask(torch.ones(1, 32, dtype=torch.bool), 2)
    plain = SRBCRS.from_mask(mask, stride=32, bank_order=False)
    shuffled = SRBCRS.from_mask(mask, stride=32, shuffle=True, bank_order=False)
    assert shuffled.col_idx[:8].tolist() == list(INT4_SHUFFLE)
    assert torch.equal(shuffled.col_idx.view(-1, 8).sort(1).values, plain.col_idx.view(-1, 8))
    dense = torch.randn(3, 2, 32)
    assert torch.equal(shuffled.to_dense(shuffled.pack_values(dense)), dense)


def phase_repeats(p: SRBCRS, phase_of) -> float:
    """Mean over the ldmatrix phases of the resident-B kernel (8 slots each, phase_of(slot)) of the
    most kept columns that one phase holds in one bank group (column % 8): 1 is conflict-free."""
    worst = []
    for s, e in zip(p.row_ptr[0::2].tolist(), p.row_ptr[1::2].tolist()):
        phases: dict = {}
        for i, c in enumerate(p.col_idx[s:e].tolist()):
            phases.setdefault(phase_of(i), []).append(c % 8)
        worst += [max(g.count(x) for x in g) for g in phases.values()]
    return sum(worst) / len(worst)


def phase_8bit_a(i):  # slots a phase reads: 8- and 16-bit A fix bits 1 and 4 (Kind::smem_row)
    return i // 32, i >> 4 & 1, i >> 1 & 1


def phase_4bit_a(i):  # 4-bit A: bits 0 and 2
    return i // 32, i & 1, i >> 2 & 1


def test_bank_group_differs_within_every_phase():
    for phase_of in (phase_8bit_a, phase_4bit_a):
        phases: dict = {}
        for s in range(32):
            phases.setdefault(phase_of(s), []).append(BANK_GROUP[s])
        assert len(phases) == 4 and all(sorted(g) == list(range(8)) for g in phases.values())


@pytest.mark.parametrize("m, k, v, sparsity, bound", [(1024, 4096, 8, 0.9, 2.1), (512, 1024, 4, 0.95, 1.95),
                                                      (256, 2048, 2, 0.7, 2.0)])
def test_bank_order_permutes_each_block_and_spreads_the_banks(m, k, v, sparsity, bound):
    mask = random_vector_mask(m, k, v, sparsity, seed=5)
    banked, ascending = SRBCRS.from_mask(mask), SRBCRS.from_mask(mask, bank_order=False)
    assert torch.equal(banked.row_ptr, ascending.row_ptr) and torch.equal(banked.row_order, ascending.row_order)
    # every 32-slot block (the rows start at multiples of 32) holds the columns it holds ascending
    assert torch.equal(banked.col_idx.view(-1, 32).sort(1).values, ascending.col_idx.view(-1, 32).sort(1).values)
    assert not torch.equal(banked.col_idx, ascending.col_idx)
    for phase_of in (phase_8bit_a, phase_4bit_a):
        assert phase_repeats(banked, phase_of) <= bound < phase_repeats(ascending, phase_of)


def test_bank_order_is_conflict_free_where_every_group_fills_its_asks():
    # 64 columns, 8 of each group: every slot gets the group it asks for
    p = SRBCRS.from_mask(VectorMask(torch.ones(2, 64, dtype=torch.bool), 2))
    assert [c % 8 for c in p.col_idx[:32].tolist()] == list(BANK_GROUP)
    assert phase_repeats(p, phase_8bit_a) == phase_repeats(p, phase_4bit_a) == 1


def bank_order_of_block(cols: list[int]) -> list[int]:
    """_bank_order's rule for one block, slot by slot: each group's asking slots, in slot order, take
    its columns ascending while both last; the spare columns (each group's leftovers ascending, then
    by spare index and group) fill the open slots in slot order."""
    out: list = [None] * len(cols)
    spare = []
    for g in range(8):
        held = [c for c in cols if c % 8 == g]
        asking = [s for s in range(len(cols)) if BANK_GROUP[s] == g]
        for s, c in zip(asking, held):
            out[s] = c
        spare += [(i, g, c) for i, c in enumerate(held[len(asking):])]
    for s, (_, _, c) in zip([s for s, c in enumerate(out) if c is None], sorted(spare)):
        out[s] = c
    return out


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), k=st.integers(1, 300), v=st.sampled_from([2, 4, 8]),
       stride=st.sampled_from([8, 16, 32, 64]), sparsity=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_bank_order_follows_its_rule_block_by_block(rows, k, v, stride, sparsity, seed):
    mask = awkward_mask(rows * v, k, v, sparsity, seed)
    banked, ascending = SRBCRS.from_mask(mask, stride=stride), SRBCRS.from_mask(mask, stride=stride, bank_order=False)
    for start, end in banked.row_ptr.view(-1, 2).tolist():
        for b in range(start, end, 32):
            block = ascending.col_idx[b:min(b + 32, end)].tolist()
            assert banked.col_idx[b:min(b + 32, end)].tolist() == bank_order_of_block(block)
    assert torch.equal(banked.col_idx < 0, ascending.col_idx < 0)  # the padding stays where it was


def test_random_mask_keeps_the_same_count_in_every_row_and_is_seeded():
    a = random_vector_mask(64, 100, 8, 0.9, seed=3)
    assert a.mask.shape == (8, 100)
    assert a.mask.sum(1).tolist() == [10] * 8
    assert torch.equal(a.mask, random_vector_mask(64, 100, 8, 0.9, seed=3).mask)
    assert not torch.equal(a.mask, random_vector_mask(64, 100, 8, 0.9, seed=4).mask)


def test_empty_and_full_masks():
    for fill in (False, True):
        mask = VectorMask(torch.full((3, 20), fill), 2)
        p = SRBCRS.from_mask(mask)
        dense = torch.randn(2, 6, 20)
        assert torch.equal(p.to_dense(p.pack_values(dense)), dense * fill)
    assert SRBCRS.from_mask(VectorMask(torch.zeros(3, 20, dtype=torch.bool), 2)).nnz_pad == 0


def test_longest_row_is_the_most_vectors_a_row_keeps():
    mask = torch.zeros(4, 100, dtype=torch.bool)
    mask[0, :3], mask[2, 10:47] = True, True  # 3 and 37 kept (64 slots padded), two empty rows
    p = SRBCRS.from_mask(VectorMask(mask, 2), stride=32)
    assert p.longest_row == 37
    assert p.to("cpu").longest_row == 37
    again = SRBCRS(p.m, p.k, p.v, p.stride, p.row_ptr, p.col_idx, p.row_order.flip(0).contiguous())
    assert again.longest_row == 37
    assert SRBCRS.from_mask(VectorMask(torch.zeros(3, 20, dtype=torch.bool), 2)).longest_row == 0


def test_mask_from_dense_checks_whole_vectors():
    dense = torch.zeros(8, 5, dtype=torch.bool)
    dense[4:8, 2] = True
    assert vector_mask_from_dense(dense, 4).mask.tolist() == [[False] * 5, [False, False, True, False, False]]
    dense[5, 3] = True
    with pytest.raises(ValueError, match=r"rows 4\.\.7 of column 3 are partly kept"):
        vector_mask_from_dense(dense, 4)
    with pytest.raises(ValueError, match="not a multiple of v=8"):
        vector_mask_from_dense(torch.zeros(12, 3, dtype=torch.bool), 8)
    with pytest.raises(ValueError, match=r"dense: expected a 2-D bool tensor \(M, K\), got torch.float32 tensor of "
                                         r"shape \(8, 3\)"):
        vector_mask_from_dense(torch.zeros(8, 3), 4)
    with pytest.raises(ValueError, match="dense: expected a 2-D bool tensor .*, got list"):
        vector_mask_from_dense([[True]], 4)


@pytest.mark.parametrize("mask, got", [(torch.zeros(2, 3), r"torch.float32 tensor of shape \(2, 3\)"),
                                       (torch.zeros(4, dtype=torch.bool), r"torch.bool tensor of shape \(4,\)"),
                                       ([[True]], "list")])
def test_vector_mask_names_what_it_was_given(mask, got):
    with pytest.raises(ValueError, match=r"mask: expected a 2-D bool tensor of shape \(M/V, K\), got " + got):
        VectorMask(mask, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(m=64, k=10, v=3, sparsity=0.5), r"v: expected one of \(2, 4, 8\), got 3"),
    (dict(m=60, k=10, v=8, sparsity=0.5), "m: expected a positive multiple of v=8, got 60"),
    (dict(m=64, k=10, v=8, sparsity=1.5), r"sparsity: expected a fraction in \[0, 1\], got 1.5"),
    (dict(m=64, k=0, v=8, sparsity=0.5), "k: expected a positive number of columns, got 0"),
])
def test_random_mask_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        random_vector_mask(**kwargs)


def test_pattern_validation_names_the_bad_argument():
    p = SRBCRS.from_mask(random_vector_mask(16, 40, 4, 0.5, 0))
    fields = dict(m=p.m, k=p.k, v=p.v, stride=p.stride, row_ptr=p.row_ptr, col_idx=p.col_idx, row_order=p.row_order)
    bad_col = p.col_idx.clone()
    bad_col[0] = 40
    cases = [
        (dict(col_idx=bad_col), r"col_idx: entries must be -1 \(padding\) or columns in \[0, 40\)"),
        (dict(col_idx=p.col_idx.long()), "col_idx: expected a 1-D int32 tensor"),
        (dict(stride=12), r"stride: expected one of"),
        (dict(v=5), r"v: expected one of"),
        (dict(row_order=p.row_order.flip(0)[:-1]), "row_order: expected 4 entries"),
        (dict(row_order=torch.zeros(4, dtype=torch.int32)), "row_order: expected a permutation"),
        (dict(row_ptr=p.row_ptr + 1), "row_ptr: row starts must begin at 0"),
        (dict(m=12), "row_ptr: expected 6 entries"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            SRBCRS(**{**fields, **change})
    with pytest.raises(ValueError, match=r"stride: expected one of"):
        SRBCRS.from_mask(random_vector_mask(16, 40, 4, 0.5, 0), stride=20)
    with pytest.raises(ValueError, match=r"dense: expected shape \[\.\.\., 16, 40\]"):
        p.pack_values(torch.zeros(16, 41))
    with pytest.raises(ValueError, match="values: expected last dimension"):
        p.to_dense(torch.zeros(3))


def test_padding_lies_only_past_each_rows_count():
    """A row's kept columns fill exactly its first (end - start) slots, in the slots' order before
    the int4 shuffle: the kernels read which slots are kept from the count."""
    p = SRBCRS.from_mask(random_vector_mask(16, 40, 4, 0.5, 0))  # 20 kept slots of 32 a row
    fields = dict(m=p.m, k=p.k, v=p.v, stride=p.stride, row_ptr=p.row_ptr, row_order=p.row_order)
    gap, extra = p.col_idx.clone(), p.col_idx.clone()
    gap[[19, 20]] = gap[[20, 19]]  # row 0: -1 at slot 19, a column at slot 20
    extra[2 * 32 + 25] = 3  # row 2: a column among the padding
    for col, row in ((gap, 0), (extra, 2)):
        with pytest.raises(ValueError, match=rf"col_idx: vector row {row} must keep columns \(>= 0\) in exactly its "
                                             "first 20 slots"):
            SRBCRS(**fields, col_idx=col)
    shuffled = SRBCRS.from_mask(random_vector_mask(16, 40, 4, 0.5, 0), shuffle=True)
    assert (shuffled.col_idx[16:24] < 0).tolist() == [False, True] * 4  # the group where the count ends
    with pytest.raises(ValueError, match="vector row 0 must keep"):
        SRBCRS(**fields, col_idx=shuffled.col_idx)  # the shuffled slots, read unshuffled
    with pytest.raises(ValueError, match="before the int4 shuffle"):
        SRBCRS(**fields, col_idx=p.col_idx, shuffled=True)
