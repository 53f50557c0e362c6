"""How the detectors read a plan, as data: which tensors hold a request's KV ids and its length,
which columns of its KV row they cover, and how a verify step's visibility is encoded (a mask, a
second call's tables, or none).

A backend declares its plan once (`Backend.plan_declaration`, backends/plan_declaration.py); the
strict reading of that declaration is the replay guard's `plan_view.PlanView` (a plan lacking a
field cannot be viewed), the lenient one this `PlanLayout`, for the invariants and tree-mask
detectors and the injections that plant mistakes in it: a plan missing a field still has a
layout, and the detectors say what is missing or wrong in it. There is one per plan, since a
plan's own scalars choose among its forms (FlashInfer's `path`, FA3's `verify_path`, MLA's
`impl`). The detectors switch on these enums, never on a backend's name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.trace.schema import Plan


class KvIds(enum.Enum):
    """How a plan lists each request's KV."""

    SLOTS = "slot ids over an indptr; a request reads as many tokens as it has ids"
    PAGES_LAST_PAGE_LEN = "page ids over an indptr; a request reads (pages - 1) * page_size + its last page's tokens"
    PAGES_LENGTHS = "page ids over an indptr; a per-request tensor gives the tokens read"
    TABLE = "a dense table of page ids, one row per request, and a per-request tensor of tokens read"


class KvEnd(enum.Enum):
    """Where the columns a plan lists for a request end, on an extend or verify step (decode and
    selective steps read whole rows whatever the backend)."""

    PREFIX = "prefix"  # the cached prefix: the step's new K/V reach the kernel another way
    KV = "kv"  # the whole row, this step's tokens included


class MaskReading(enum.Enum):
    """How a verify step's plan encodes what each draft row sees."""

    FULL_BLOCKS = "per request a row-major [n, prefix + n] block at mask_indptr[b], indexed from the first listed column by window offsets"
    COVERED_BLOCKS = "per request a row-major [n, listed KV] block at mask_indptr[b], over the columns the plan lists"
    EXPAND_CALL = "a second call whose table lists, per draft token, the draft slots it sees; the first call reads the prefix"
    WINDOW_CALL = "one causal call with a row per draft token whose table lists the prefix and the draft slots it sees, cut by the kernel's window"
    CAUSAL = "no mask: causal by token index"


@dataclass(frozen=True)
class WindowList:
    """A second KV list that sliding-window layers read instead of the plan's ids (SGLang's Triton SWA)."""

    indptr: str
    indices: str
    offsets: str  # per request, the first listed column: where its mask rows start


@dataclass(frozen=True)
class ExpandTables:
    """A verify call with one table row per draft token: a two-call verify's draft-block call
    (EXPAND_CALL), or a sliding-window layer's only call (WINDOW_CALL)."""

    table: str
    lengths: str
    cu_seqlens_k: str


@dataclass(frozen=True)
class PackedMask:
    """A custom mask as FlashInfer keeps it once planned: each request's row-major [q_len, kv_len]
    bool block packed eight to a byte, little-endian (bit i of byte j = element 8j + i of the block:
    `segment_packbits(mask, indptr, bitorder="little")`), every block starting on a new byte, at the
    byte offsets of `indptr` (what plan() stores as `_mask_indptr_buf`)."""

    tensor: str  # the bytes, e.g. "packed_custom_mask"
    indptr: str  # [requests+1] byte offsets, e.g. "packed_mask_indptr"

    @staticmethod
    def byte_sizes(bit_sizes: Tensor) -> Tensor:
        """[n] bytes each block of `bit_sizes` elements packs to."""
        return (bit_sizes + 7) // 8

    @staticmethod
    def unpack(packed: Tensor, byte_offsets: Tensor, bit_sizes: Tensor) -> Tensor:
        """The bool blocks back to back ([sum(bit_sizes)]): block b is the first bit_sizes[b] bits of
        packed[byte_offsets[b]:], little-endian. The caller has checked that every block's bytes
        lie inside `packed`."""
        bits = torch.arange(8, dtype=torch.int64)
        blocks = []
        for b in range(bit_sizes.numel()):
            start, size = int(byte_offsets[b]), int(bit_sizes[b])
            data = packed[start : start + (size + 7) // 8].to(torch.int64)
            blocks.append(((data[:, None] >> bits) & 1).flatten()[:size].to(torch.bool))
        return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)


@dataclass(frozen=True)
class PlanLayout:
    kv: KvIds
    ids: str  # the tensor of ids, e.g. "kv_indices"
    count: str  # the per-request tensor a request count is read from (an indptr, or a table's lengths)
    length: str | None  # the per-request length tensor (last page lengths, lengths); None: SLOTS count ids
    length_field: str  # how a wrong length is named, e.g. "kv_indptr/kv_last_page_len"
    page_size: int | None  # tokens per id; None: the plan's page_size scalar, else the model's
    ends: tuple[KvEnd, ...]  # extend and verify steps: the ends a request's listed columns may have, in order
    mask: MaskReading
    window: str  # the plan scalar holding the kernel's own window, e.g. "window_left"
    window_list: WindowList | None = None
    skip_prefix: str | None = None  # FULL_BLOCKS: the scalar saying the kernel ignores the prefix columns (default true)
    expand: ExpandTables | None = None  # EXPAND_CALL's and WINDOW_CALL's per-draft-token tables
    packed_mask: PackedMask | None = None  # where the plan holds its mask packed instead of as bools (custom_mask)
    # FULL_BLOCKS / COVERED_BLOCKS: the library lays the blocks out itself, back to back from the
    # lengths (FlashInfer's plan()), whatever offsets the plan records; a mask of another length was
    # laid out for other lengths, so its blocks are read at other offsets.
    mask_offsets_computed: bool = False

    @property
    def csr(self) -> bool:
        return self.kv is not KvIds.TABLE

    def vectors(self) -> tuple[str, ...]:
        """The index tensors of this layout that must be flat vectors."""
        return (self.count, self.ids) if self.csr else (self.count,)

    def page_size_of(self, plan: Plan, model_page_size: int) -> int:
        if self.page_size is not None:
            return self.page_size
        return int(plan.scalars.get("page_size", model_page_size))


# Plan fields that hold indices, across the kernel libraries' vocabularies, by a word of their
# name: a float or bool tensor there is a wrong dtype whatever the backend (invariants plan-dtype).
INDEX_WORDS = ("indptr", "indices", "cu_seqlens", "page_table", "block_table", "cache_seqlens", "kv_len", "last_page_len", "num_kv_splits")
# Index fields with one row per request ([bs, pages]); every other index field is flat.
TABLE_WORDS = ("page_table", "block_table", "block_kv_indices")


def expected_dims(name: str) -> int | None:
    """The rank of an index field (None: `name` is not an index field)."""
    if any(w in name for w in TABLE_WORDS):
        return 2
    return 1 if is_index(name) else None


def is_index(name: str) -> bool:
    return any(w in name for w in INDEX_WORDS)
