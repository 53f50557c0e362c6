"""Where the elements of a flat tree mask lie: block sizes per layout, the offsets of the
concatenated blocks, the bit-packed layout's words and bit order, and the flat index of a request's
row and KV column.

A verify step's mask holds, per request b with n draft rows (the root first) and p_b prefix KV
columns before them, one row-major block, the blocks concatenated in batch order (SGLang's
build_tree_kernel_efficient; ../shared/reference/engines.md, "Tree mask construction"):

    FULL                  [n, p_b + n] bool   every KV column of the request, prefix columns True
    QLEN_ONLY             [n, n] bool         the draft columns only
    QLEN_ONLY_BITPACKED   [n] words           row r's word has bit j set iff r sees draft token j:
                                              little-endian, bit 0 = the root; 1, 2 or 4 bytes by n

A plan's mask is FULL-like blocks at offsets of its own (`mask_indptr`): Triton's over the whole
row, FlashInfer's over only the KV the plan lists (the row's last columns), an extend or
selective-recompute step's over e_b query rows. `MaskGeometry` describes every one of them the same
way: request b's block is `rows[b]` rows, each covering the request's last `columns[b]` KV columns,
starting at element `indptr[b]`. Columns are always the request's KV columns (prefix first), so a
QLEN_ONLY element and a FULL element of the same (row, key) have the same column.

This module knows nothing of trees (trace/tree.py builds masks from parents) nor of traces: the
report, the diff, the recorder, the tree-mask detector and its injections all locate mask elements
through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attndbg.trace.schema import MaskLayout, Spec
from attndbg.trace.schema import indptr as csr_indptr

PACKED = MaskLayout.QLEN_ONLY_BITPACKED


def as_bool(mask: Tensor) -> Tensor:
    """A mask of bools, whatever integer dtype it was stored in (nonzero: visible)."""
    return mask if mask.dtype is torch.bool else mask != 0


# --- bit-packed words ---------------------------------------------------------------------------


def word_dtype(draft_token_num: int) -> torch.dtype:
    """The word of one bit-packed row: SGLang picks 1, 2 or 4 bytes by n (QLEN_ONLY_BITPACKING)."""
    if draft_token_num <= 8:
        return torch.uint8
    if draft_token_num <= 16:
        return torch.uint16
    return torch.uint32


def word_bits(dtype: torch.dtype) -> int:
    """Bits a stored word of `dtype` holds."""
    return torch.empty(0, dtype=dtype).element_size() * 8


def pack_bits(visible: Tensor) -> Tensor:
    """[rows, width] bool -> [rows] int64 words, little-endian: bit j = column j (SGLang's and
    FlashInfer's packbits order). `width` must be at most 63: bit 63 is int64's sign."""
    weights = torch.tensor([1 << j for j in range(visible.shape[1])], dtype=torch.int64)
    return (visible.to(torch.int64) * weights).sum(1)


def unpack_bits(words: Tensor, width: int) -> Tensor:
    """[rows] words (any integer dtype) -> [rows, width] bool, bit j (little-endian) = column j."""
    return ((words.to(torch.int64)[:, None] >> torch.arange(width)) & 1).to(torch.bool)


def reverse_bits(words: Tensor, width: int) -> Tensor:
    """[rows] words -> [rows] int64: the same rows packed big-endian in `width`-bit words (bit 0 =
    the last column), the mistake tree-mask's mask-bit-order names."""
    bits = (words.to(torch.int64)[:, None] >> torch.arange(width)) & 1
    return (bits.flip(1) << torch.arange(width)).sum(1)


# --- lengths from host scalars ------------------------------------------------------------------


def mask_length(layout: MaskLayout, *, batch_size: int, draft_token_num: int, prefix_sum: int) -> int:
    """Elements (bools or words) of a whole verify mask of `layout`, from host numbers only (a
    recorder knows the prefixes' sum without a device sync; SGLang sizes a FULL mask
    seq_lens_sum·n + bs·n²). A block's size is linear in its prefix, so the whole sum may sit on
    one request: the length is the same."""
    prefixes = [prefix_sum] + [0] * (batch_size - 1) if batch_size else []
    return MaskGeometry.verify(layout, draft_token_num=draft_token_num, prefix_lens=torch.tensor(prefixes, dtype=torch.int64)).length


def full_prefix_sum(length: int, *, batch_size: int, draft_token_num: int) -> int | None:
    """The prefix sum a FULL mask of `length` elements was sized for (mask_length's inverse), None
    when no whole prefix sum gives that length."""
    n = draft_token_num
    rest = length - mask_length(MaskLayout.FULL, batch_size=batch_size, draft_token_num=n, prefix_sum=0)
    return rest // n if rest % n == 0 else None


# --- per-request blocks -------------------------------------------------------------------------


class MaskElement(NamedTuple):
    """Where a flat mask index lies."""

    request: int
    row: int  # row of the request's block (draft token index in a verify step)
    column: int  # the request's KV column (prefix columns first); bit-packed: the word's bit 0


def _row_size(layout: MaskLayout, columns: Tensor) -> Tensor:
    """[bs] elements one row takes: its columns as bools, or one word (bit-packed)."""
    return torch.ones_like(columns) if layout is PACKED else columns


@dataclass(frozen=True)
class MaskGeometry:
    """Per request b, a row-major block of `rows[b]` rows at element `indptr[b]`; each row covers
    the request's last `columns[b]` KV columns, as bools, or as one word (bit-packed)."""

    layout: MaskLayout
    rows: Tensor  # [bs] int64: rows of each block (query tokens: n in a verify step)
    prefix_lens: Tensor  # [bs] int64: KV columns before the request's own tokens
    columns: Tensor  # [bs] int64: KV columns a row covers, the request's last ones (FULL: prefix + rows; QLEN layouts: rows)
    indptr: Tensor  # [bs+1] int64: where each block starts, in elements (bools or words)

    def __post_init__(self) -> None:
        bs = self.rows.numel()
        shapes = (self.rows.shape, self.prefix_lens.shape, self.columns.shape, self.indptr.shape)
        if shapes != ((bs,), (bs,), (bs,), (bs + 1,)):
            raise ValueError(f"MaskGeometry: rows, prefix_lens, columns must be [bs] and indptr [bs+1], got {[list(s) for s in shapes]}")

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def verify(cls, layout: MaskLayout, *, draft_token_num: int, prefix_lens: Tensor) -> MaskGeometry:
        """A verify step's mask in `layout`: n rows per request, blocks packed back to back."""
        prefix = prefix_lens.to(torch.int64)
        rows = torch.full_like(prefix, draft_token_num)
        columns = prefix + rows if layout is MaskLayout.FULL else rows
        return cls(layout, rows, prefix, columns, csr_indptr(rows * _row_size(layout, columns)))

    @classmethod
    def of_spec(cls, spec: Spec, prefix_lens: Tensor) -> MaskGeometry:
        """The geometry of `spec.custom_mask` in its tagged layout."""
        return cls.verify(spec.mask_layout, draft_token_num=spec.draft_token_num, prefix_lens=prefix_lens)

    @classmethod
    def full(cls, *, rows: Tensor, prefix_lens: Tensor, columns: Sequence[int] | Tensor | None = None) -> MaskGeometry:
        """FULL blocks packed back to back, `rows[b]` query rows each (an extend or selective step's
        plan mask, or a verify plan's); `columns` when a row covers fewer than prefix + rows KV
        columns (FlashInfer: only the KV the plan lists)."""
        rows, prefix = rows.to(torch.int64), prefix_lens.to(torch.int64)
        cols = prefix + rows if columns is None else torch.as_tensor(columns, dtype=torch.int64)
        return cls(MaskLayout.FULL, rows, prefix, cols, csr_indptr(rows * cols))

    @classmethod
    def from_indptr(cls, indptr: Tensor, *, rows: int, prefix_lens: Tensor) -> MaskGeometry:
        """FULL blocks of `rows` rows where a plan's `mask_indptr` puts them, a row as wide as its
        block allows (size // rows): what a kernel reading through those offsets sees. Entries past
        the batch (CUDA-graph padding) are left out."""
        prefix = prefix_lens.to(torch.int64)
        bs = prefix.numel()
        offsets = indptr.to(torch.int64)[: bs + 1]
        rows_t = torch.full_like(prefix, rows)
        return cls(MaskLayout.FULL, rows_t, prefix, offsets.diff() // rows, offsets)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.rows.numel()

    @property
    def row_size(self) -> Tensor:
        """[bs] int64 elements one row takes: its columns as bools, or one word."""
        return _row_size(self.layout, self.columns)

    @property
    def sizes(self) -> Tensor:
        """[bs] int64 elements of each block."""
        return self.rows * self.row_size

    @property
    def length(self) -> int:
        """Elements a buffer must have for the last block to fit: indptr[-1]."""
        return int(self.indptr[-1])

    # -- one request ---------------------------------------------------------------------------

    def span(self, b: int) -> tuple[int, int]:
        """[start, end) of request b's block in the flat mask."""
        start = int(self.indptr[b])
        return start, start + int(self.sizes[b])

    def first_column(self, b: int) -> int:
        """The KV column of a row's first element (bit-packed: of bit 0)."""
        return int(self.prefix_lens[b] + self.rows[b] - self.columns[b])

    def prefix_columns(self, b: int) -> int:
        """Prefix columns a row of request b holds before its first draft (own) column."""
        return int(self.columns[b] - self.rows[b])

    def block(self, mask: Tensor, b: int) -> Tensor:
        """Request b's block of the flat `mask`: [rows, columns] elements, or [rows] words
        (bit-packed). A view of a contiguous mask, so writing it writes the mask."""
        start, end = self.span(b)
        part = mask[start:end]
        return part if self.layout is PACKED else part.reshape(int(self.rows[b]), int(self.columns[b]))

    def visible(self, mask: Tensor, b: int) -> Tensor:
        """[rows, columns] bool: which of its columns each row of request b sees (words unpacked;
        bits above the columns are ignored)."""
        block = self.block(mask, b)
        return unpack_bits(block, int(self.columns[b])) if self.layout is PACKED else block.to(torch.bool)

    def element(self, b: int, row: int, column: int) -> int:
        """Flat index of request b's (row, KV column): bit-packed, the word holding it, whose bit is
        column - first_column(b)."""
        within = column - self.first_column(b)
        if not (0 <= row < int(self.rows[b]) and 0 <= within < int(self.columns[b])):
            raise ValueError(f"request {b}'s block has no row {row}, KV column {column}: {int(self.rows[b])} rows over columns [{self.first_column(b)}, {self.first_column(b) + int(self.columns[b])})")
        return int(self.indptr[b]) + row * int(self.row_size[b]) + (0 if self.layout is PACKED else within)

    def locate(self, index: int) -> MaskElement | None:
        """Which request, row and KV column flat element `index` belongs to; None past every block."""
        if not int(self.indptr[0]) <= index < self.length:
            return None
        b = int(torch.searchsorted(self.indptr, torch.tensor(index), right=True)) - 1
        row, within = divmod(index - int(self.indptr[b]), int(self.row_size[b]))
        if row >= int(self.rows[b]):
            return None  # a gap between blocks (offsets not a multiple of the rows)
        return MaskElement(b, row, self.first_column(b) + within)

    def with_block(self, mask: Tensor, b: int, block: Tensor) -> Tensor:
        """The flat mask with request b's block replaced by `block`, flattened: a block of another
        size moves every later request's (the mistake of a mask built for other lengths)."""
        start, end = self.span(b)
        return torch.cat([mask[:start], block.flatten(), mask[end:]])
