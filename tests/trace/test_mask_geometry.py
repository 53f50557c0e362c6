"""trace/mask_geometry.py: block sizes and offsets per layout, words and bit order, locating
elements. Every expected value is worked out by hand from the layouts' definitions."""

from __future__ import annotations

import pytest
import torch

from attndbg.trace import mask_geometry as mg
from attndbg.trace.mask_geometry import MaskElement, MaskGeometry
from attndbg.trace.schema import MaskLayout

PREFIX = torch.tensor([2, 0, 5])  # n = 3 draft tokens per request


@pytest.mark.parametrize(
    ("layout", "columns", "indptr"),
    [
        (MaskLayout.FULL, [5, 3, 8], [0, 15, 24, 48]),  # n·(prefix + n) = 15, 9, 24
        (MaskLayout.QLEN_ONLY, [3, 3, 3], [0, 9, 18, 27]),  # n·n each
        (MaskLayout.QLEN_ONLY_BITPACKED, [3, 3, 3], [0, 3, 6, 9]),  # one word per row
    ],
)
def test_verify_sizes_and_offsets(layout: MaskLayout, columns: list[int], indptr: list[int]) -> None:
    g = MaskGeometry.verify(layout, draft_token_num=3, prefix_lens=PREFIX)
    assert g.batch_size == 3
    assert g.columns.tolist() == columns
    assert g.indptr.tolist() == indptr and g.indptr.dtype == torch.int64
    assert g.sizes.tolist() == [b - a for a, b in zip(indptr, indptr[1:])]
    assert g.length == indptr[-1]
    assert [g.span(b) for b in range(3)] == list(zip(indptr, indptr[1:]))
    # The recorder's host-only length agrees with the per-request geometry.
    assert mg.mask_length(layout, batch_size=3, draft_token_num=3, prefix_sum=7) == indptr[-1]


def test_empty_batch_has_one_offset() -> None:
    g = MaskGeometry.verify(MaskLayout.FULL, draft_token_num=4, prefix_lens=torch.zeros(0, dtype=torch.int64))
    assert g.indptr.tolist() == [0] and g.length == 0


def test_full_prefix_sum_inverts_the_full_length() -> None:
    assert mg.full_prefix_sum(48, batch_size=3, draft_token_num=3) == 7
    assert mg.full_prefix_sum(27, batch_size=3, draft_token_num=3) == 0
    assert mg.full_prefix_sum(49, batch_size=3, draft_token_num=3) is None


def test_word_dtype_by_draft_tokens() -> None:
    assert [mg.word_dtype(n) for n in (1, 8, 9, 16, 17, 32)] == [torch.uint8, torch.uint8, torch.uint16, torch.uint16, torch.uint32, torch.uint32]
    assert [mg.word_bits(d) for d in (torch.uint8, torch.uint16, torch.uint32)] == [8, 16, 32]


def test_pack_is_little_endian_and_round_trips() -> None:
    rows = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    words = mg.pack_bits(rows)
    assert words.tolist() == [0b1101, 0b0010, 0b0001]  # bit j = column j: column 0 is bit 0
    assert words.dtype == torch.int64
    assert torch.equal(mg.unpack_bits(words, 4), rows)
    assert torch.equal(mg.unpack_bits(words.to(torch.uint8), 4), rows)
    assert mg.unpack_bits(torch.tensor([0b1101]), 2).tolist() == [[True, False]]  # higher bits are cut


def test_reverse_bits_is_big_endian_in_the_word() -> None:
    words = torch.tensor([0b1101, 0b0001], dtype=torch.uint8)
    assert mg.reverse_bits(words, 4).tolist() == [0b1011, 0b1000]
    assert mg.reverse_bits(words, 8).tolist() == [0b10110000, 0b10000000]
    assert mg.reverse_bits(mg.reverse_bits(words, 8), 8).tolist() == words.tolist()


@pytest.mark.parametrize(
    ("layout", "element", "back"),
    [
        # request 1 (prefix 3), row 1, KV column 4 = draft column 1
        (MaskLayout.FULL, 6 + 1 * 5 + 4, MaskElement(1, 1, 4)),  # blocks [2, 3] and [2, 5]
        (MaskLayout.QLEN_ONLY, 4 + 1 * 2 + 1, MaskElement(1, 1, 4)),  # blocks [2, 2]: column 4 is the 2nd
        (MaskLayout.QLEN_ONLY_BITPACKED, 2 + 1, MaskElement(1, 1, 3)),  # the word; locate names its bit 0
    ],
)
def test_element_and_locate(layout: MaskLayout, element: int, back: MaskElement) -> None:
    g = MaskGeometry.verify(layout, draft_token_num=2, prefix_lens=torch.tensor([1, 3]))
    assert g.element(1, 1, 4) == element
    assert g.locate(element) == back
    assert g.locate(g.length) is None
    assert g.first_column(1) == (0 if layout is MaskLayout.FULL else 3)
    assert g.prefix_columns(1) == (3 if layout is MaskLayout.FULL else 0)


def test_element_outside_the_block_is_refused() -> None:
    g = MaskGeometry.verify(MaskLayout.QLEN_ONLY, draft_token_num=2, prefix_lens=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"request 1's block has no row 0, KV column 2"):
        g.element(1, 0, 2)  # a prefix column: QLEN_ONLY holds none
    with pytest.raises(ValueError, match="no row 2"):
        g.element(0, 2, 1)


def test_locate_every_full_element() -> None:
    g = MaskGeometry.verify(MaskLayout.FULL, draft_token_num=2, prefix_lens=torch.tensor([1, 3]))
    where = [g.locate(k) for k in range(g.length)]
    assert where[:6] == [MaskElement(0, r, c) for r in range(2) for c in range(3)]
    assert where[6:] == [MaskElement(1, r, c) for r in range(2) for c in range(5)]
    assert all(g.element(*w) == k for k, w in enumerate(where))


def test_blocks_are_views_and_visible_unpacks() -> None:
    g = MaskGeometry.verify(MaskLayout.FULL, draft_token_num=2, prefix_lens=torch.tensor([1, 3]))
    mask = torch.zeros(g.length, dtype=torch.bool)
    g.block(mask, 1)[:, : g.prefix_columns(1)] = True
    assert torch.nonzero(mask).flatten().tolist() == [6, 7, 8, 11, 12, 13]
    packed = MaskGeometry.verify(MaskLayout.QLEN_ONLY_BITPACKED, draft_token_num=2, prefix_lens=torch.tensor([1, 3]))
    words = torch.tensor([0b01, 0b11, 0b01, 0b10], dtype=torch.uint8)
    assert packed.block(words, 1).tolist() == [0b01, 0b10]
    assert packed.visible(words, 1).tolist() == [[True, False], [False, True]]


def test_with_block_moves_later_blocks() -> None:
    g = MaskGeometry.verify(MaskLayout.QLEN_ONLY, draft_token_num=2, prefix_lens=torch.tensor([0, 0, 0]))
    mask = torch.arange(12)
    assert g.with_block(mask, 1, g.block(mask, 1)[:, :-1]).tolist() == [0, 1, 2, 3, 4, 6, 8, 9, 10, 11]


def test_plan_offsets_with_covered_blocks() -> None:
    # FlashInfer: each block covers only the KV the plan lists, the row's last columns; the last
    # entry belongs to a CUDA-graph padded request and is left out.
    g = MaskGeometry.from_indptr(torch.tensor([0, 8, 18, 30], dtype=torch.int32), rows=2, prefix_lens=torch.tensor([4, 3]))
    assert g.batch_size == 2 and g.columns.tolist() == [4, 5] and g.indptr.tolist() == [0, 8, 18]
    assert (g.first_column(0), g.prefix_columns(0)) == (2, 2)  # columns 2..5 of prefix 4 + 2 drafts
    assert g.element(0, 1, 5) == 4 + 3
    assert g.locate(7) == MaskElement(0, 1, 5)


def test_full_blocks_of_extend_rows() -> None:
    # An extend step's plan mask: e_b rows of prefix + e_b columns; empty blocks are skipped.
    g = MaskGeometry.full(rows=torch.tensor([2, 0, 1]), prefix_lens=torch.tensor([1, 4, 0]))
    assert g.sizes.tolist() == [6, 0, 1] and g.indptr.tolist() == [0, 6, 6, 7]
    assert g.locate(6) == MaskElement(2, 0, 0)


def test_shapes_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match=r"indptr \[bs\+1\]"):
        MaskGeometry(MaskLayout.FULL, torch.ones(2), torch.ones(2), torch.ones(2), torch.zeros(2))
