"""How a plan's tensors divide into per-request pieces, read from what its backend declares
(backends/plan_declaration.py), never guessed from a tensor's name:

    OFFSETS   [requests * k + 1] offsets (an indptr over the call's ids or query rows): the start,
              then k lengths per request
    SEGMENTS  flat data cut by an OFFSETS tensor (kv_indices by kv_indptr, a mask by its offsets):
              request r's part lies between its offsets
    ROWS      [requests * k] or [requests * k, width]: k entries or table rows per request

k (`per_request`) is 1 but where a declaration says otherwise (a two-call verify's expand_ tables
have one row per draft token). What keeps a minimised step's recorded plan consistent with its
smaller batch (attndbg/minimize/plan.py). A plan no adapter reads (an engine's own backend) has
the pieces of the attention metadata its engine declares (trace/engines.py MetadataFields). A
tensor neither names has no pieces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from attndbg.backends.plan_declaration import Call, PlanDeclaration
from attndbg.backends.plan_layout import KvIds
from attndbg.trace.engines import MetadataFields


class Cut(enum.Enum):
    OFFSETS = "[requests * k + 1] offsets: the start, then k lengths per request"
    SEGMENTS = "flat data, one segment per request, at the offsets of its companion tensor"
    ROWS = "[requests * k] or [requests * k, width]: k entries or table rows per request"


@dataclass(frozen=True)
class Piece:
    cut: Cut
    per_request: int = 1
    offsets: str | None = None  # SEGMENTS: the OFFSETS tensor that cuts it


def pieces_of(declaration: PlanDeclaration | None) -> dict[str, Piece]:
    """Each tensor the declaration names with how it divides per request."""
    if declaration is None or declaration.call is None:
        return {}
    found: dict[str, Piece] = {}
    for call in (declaration.call, declaration.second_call):
        if call is not None:
            _call_pieces(call, found)
    if declaration.splits is not None:
        found[declaration.splits.field] = Piece(Cut.ROWS)
    if declaration.mask_offsets is not None:
        _segmented(declaration.mask_offsets, "custom_mask", 1, found)
    if declaration.packed_mask is not None:
        _segmented(declaration.packed_mask.indptr, declaration.packed_mask.tensor, 1, found)
    windows = declaration.window_list
    if windows is not None:
        _segmented(windows.indptr, windows.indices, 1, found)
        found[windows.offsets] = Piece(Cut.ROWS)
    for rows in declaration.rows or ():  # the declaration's own per-request layout has the last word
        for name in rows.rows:
            found[name] = Piece(Cut.ROWS, rows.per_request)
        for offsets, target in rows.offsets:
            if target is None:
                found[offsets] = Piece(Cut.OFFSETS, rows.per_request)
            else:
                _segmented(offsets, target, rows.per_request, found)
    return found


def _call_pieces(call: Call, found: dict[str, Piece]) -> None:
    if call.kv is KvIds.TABLE:
        for name in (call.ids, call.count, call.length):
            if name is not None:
                found[name] = Piece(Cut.ROWS)
    else:
        _segmented(call.count, call.ids, 1, found)
        if call.length is not None:
            found[call.length] = Piece(Cut.ROWS)
    if call.queries is not None:
        found[call.queries] = Piece(Cut.OFFSETS)


def _segmented(offsets: str, target: str, per_request: int, found: dict[str, Piece]) -> None:
    found[offsets] = Piece(Cut.OFFSETS, per_request)
    found[target] = Piece(Cut.SEGMENTS, per_request, offsets)


def metadata_pieces(fields: MetadataFields) -> dict[str, Piece]:
    """The per-request tensors of an engine's own attention metadata, under every name it may be
    recorded by (the slot mapping is per token: it has none)."""
    found: dict[str, Piece] = {}
    for name in (*fields.query_start_loc, fields.query_start_loc_cpu):
        found[name] = Piece(Cut.OFFSETS)
    for name in (*fields.seq_lens, *fields.block_table, fields.seq_lens_cpu, fields.num_computed_tokens_cpu, fields.seq_lens_cpu_upper_bound):
        found[name] = Piece(Cut.ROWS)
    return found
