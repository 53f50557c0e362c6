"""A backend's plan, declared once, as data: which tensors are offsets, ids, lengths, tables and
masks, what each indexes, and the kernel's quirks. Each adapter's `Backend.plan_declaration`
returns one `PlanDeclaration` per plan (a plan's own scalars choose among its forms: FlashInfer's
`path`, FA3's `verify_path`, MLA's `impl`); from it this module derives both readings:

- `view(...)`, strict: every index tensor with the bound a kernel needs (backends/plan_view.py),
  for the replay guard. A declared field that is missing or cannot be read raises PlanUnreadable.
- `layout(...)`, lenient: which tensors hold a request's KV ids and length, how a verify step's
  visibility is encoded (backends/plan_layout.py), for the detectors and the injections. A plan
  missing a field still has a layout.

The declaration reads scalars and asks which tensors a plan holds, never a tensor's values, so it
exists for any plan; only `view` reads values, and it never indexes with them (plan_view.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attndbg.backends import plan_layout as pl
from attndbg.backends import plan_view as pv
from attndbg.trace.schema import Plan, Trace


@dataclass(frozen=True)
class Call:
    """One kernel call's per-request KV list, in the library's names.

    `kv` says how the fields relate (plan_layout.KvIds): SLOTS `ids` over the `count` indptr;
    PAGES_* page `ids` over the `count` indptr with a `length` per request (a last page's tokens, or
    the request's); TABLE a `ids` table [requests, pages] read up to `length` tokens per row
    (`count` is that length too)."""

    kv: pl.KvIds
    ids: str  # e.g. "kv_indices", "page_table"
    count: str  # the indptr over `ids`, or a table's per-row lengths
    length: str | None  # per-request lengths (last page lengths for PAGES_LAST_PAGE_LEN); None: SLOTS
    page_size: int | str | None  # tokens per id: an int is fixed (slot ids: 1); a str the plan scalar holding it; None: the model's
    queries: str | None = None  # per-request offsets over the step's query rows (qo_indptr, cu_seqlens_q); None: not read
    scalars: tuple[str, ...] = ()  # this call's scalars the launch reads
    # Where the kernel reads the cache in pages of its own size whatever the plan says (FlashMLA's
    # 64-token blocks): that size, and why; the plan's page size scalar must equal it.
    cache_page: tuple[int, str] | None = None


@dataclass(frozen=True)
class SplitCounts:
    """Split-KV decode: per request, the count of splits stage 1 writes, each in [1, the scalar `top`]
    (its scratch holds `top` partials per row)."""

    field: str  # e.g. "num_kv_splits"
    top: str  # e.g. "max_kv_splits"


@dataclass(frozen=True)
class UnknownSetting:
    """A scalar choosing the plan's form holds a value the backend does not know: the plan cannot be
    read (PlanUnreadable), though a form's layout may still be declared for the detectors."""

    scalar: str
    found: object
    expected: tuple[str, ...]

    def error(self) -> pv.PlanUnreadable:
        return pv.PlanUnreadable(f"plan scalar {self.scalar} = {self.found!r}, expected one of {', '.join(self.expected)}", field=f"scalars.{self.scalar}")


# The block a custom mask holds per request, by how the mask is read.
_MASK_BLOCK = {pl.MaskReading.FULL_BLOCKS: "q_len x (kv_len + q_len) mask block", pl.MaskReading.COVERED_BLOCKS: "q_len x kv_len mask block"}


@dataclass(frozen=True)
class PlanDeclaration:
    """One plan form of one backend: what its kernels read (strict) and how the detectors read it
    (lenient), in one object. Fields past `window` are the form's quirks, each absent by default."""

    call: Call | None  # the (first) call's KV; None: no form is declared (an unknown setting), so no layout
    ends: tuple[pl.KvEnd, ...]  # extend and verify steps: where a request's listed columns may end
    mask: pl.MaskReading  # how a verify step's visibility is encoded
    window: str  # the plan scalar holding the kernel's own window, e.g. "window_left"
    scalars: tuple[str, ...] = ()  # plan-wide scalars the launch reads, required before any tensor
    unknown: UnknownSetting | None = None  # the plan cannot be read: its form's setting is unknown
    queries_only: bool = False  # the kernels read `call.queries` alone (FlashInfer's ragged pass); its KV is the detectors'
    splits: SplitCounts | None = None
    # FULL_BLOCKS / COVERED_BLOCKS: the plan tensor of each request's block offset into custom_mask;
    # None: the library computes them as the cumulative block sizes (FlashInfer's plan()).
    mask_offsets: str | None = None
    packed_mask: pl.PackedMask | None = None  # where a plan may hold its mask packed instead of custom_mask
    window_list: pl.WindowList | None = None
    skip_prefix: str | None = None  # FULL_BLOCKS: the scalar saying the kernel skips the prefix columns
    expand: pl.ExpandTables | None = None  # the detectors' names of a two-call verify's expand_ tables
    second_call: Call | None = None  # a two-call verify's expand_ call, as the kernel reads it
    merged_rows: str | None = None  # why every call's queries must end at the step's token count (a merge reads them all)
    # Which tensors are per request, and how: what keeps a graph-padded plan's real requests
    # (plan_view.PlanView.layout). None: the usual offsets and every tensor with a row per request.
    rows: tuple[pv.RequestRows, ...] | None = None


def layout(declaration: PlanDeclaration | None) -> pl.PlanLayout | None:
    """The lenient reading: what the detectors need to find a request's KV and its visibility."""
    call = declaration.call if declaration is not None else None
    if call is None:
        return None
    if call.kv is pl.KvIds.SLOTS:
        length_field = call.count
    elif call.kv is pl.KvIds.PAGES_LAST_PAGE_LEN:
        length_field = f"{call.count}/{call.length}"
    else:
        length_field = call.length or call.count
    return pl.PlanLayout(
        kv=call.kv,
        ids=call.ids,
        count=call.count,
        length=call.length,
        length_field=length_field,
        page_size=call.page_size if isinstance(call.page_size, int) else None,
        ends=declaration.ends,
        mask=declaration.mask,
        window=declaration.window,
        window_list=declaration.window_list,
        skip_prefix=declaration.skip_prefix,
        expand=declaration.expand,
        packed_mask=declaration.packed_mask,
        mask_offsets_computed=declaration.mask in _MASK_BLOCK and declaration.mask_offsets is None,
    )


def view(declaration: PlanDeclaration | None, trace: Trace, plan: Plan) -> pv.PlanView | None:
    """The strict reading: every index tensor the kernels read with its bound, in checking order.
    Raises PlanUnreadable / PlanViewError as plan_view.py says; None where nothing is declared."""
    if declaration is None:
        return None
    if declaration.unknown is not None:
        raise declaration.unknown.error()
    pv.require(plan, *declaration.scalars)
    call = declaration.call
    assert call is not None, "a declaration with no call names its unknown setting"
    tokens = trace.batch.num_tokens
    if declaration.queries_only:
        qo = pv.index(plan, call.queries)
        return pv.PlanView(pv.requests_of(qo, call.queries), (pv.query_offsets(call.queries, qo, tokens),))
    read = _read_call(call, trace, plan)
    bounds = read.bounds + _merged_rows(declaration, call, plan, tokens)
    covered = [read.covered]
    if declaration.splits is not None:
        covered.append(_split_bounds(declaration.splits, call, plan, read.requests, bounds))
    if read.queries is not None and declaration.mask in _MASK_BLOCK:
        covered.append(_mask_bounds(declaration, plan, read, bounds))
    if declaration.second_call is not None:
        bounds += _read_call(declaration.second_call, trace, plan).bounds + _merged_rows(declaration, declaration.second_call, plan, tokens)
    return pv.PlanView(max(covered), tuple(bounds), read.kv, layout=declaration.rows)


@dataclass(frozen=True)
class _Read:
    covered: int  # the most requests any of the call's per-request tensors describes
    requests: int  # requests of its KV list (an indptr's entries - 1, a table's rows)
    bounds: list[pv.Bound]
    kv: pv.RequestKV
    lengths: torch.Tensor  # [requests] tokens each request reads
    queries: torch.Tensor | None  # the query offsets, when read


def _page_size(call: Call, trace: Trace, plan: Plan) -> int:
    if isinstance(call.page_size, int):
        return call.page_size
    return trace.model.page_size if call.page_size is None else pv.page_size(plan, call.page_size)


def _read_call(call: Call, trace: Trace, plan: Plan) -> _Read:
    """One call's KV bounds. Each KvIds form checks in its own order (sizes before what they size
    within the form), which the guard's first reported violation depends on."""
    pv.require(plan, *call.scalars)
    ps = _page_size(call, trace, plan)
    batch = trace.batch
    if call.kv is pl.KvIds.TABLE:
        head: list[pv.Bound] = []
        if call.cache_page is not None:
            head.append(pv.Equals(f"scalars.{call.page_size}", ps, call.cache_page[0], call.cache_page[1]))
            ps = call.cache_page[0]
        rows, bounds, kv = pv.page_table_bounds(
            plan, table=call.ids, lens=call.length or call.count, cu_seqlens_q=call.queries, tokens=batch.num_tokens, kv_cache_size=batch.kv_cache_size, page_size=ps
        )
        queries = pv.index(plan, call.queries) if call.queries is not None else None
        return _Read(rows, kv.lengths.numel(), head + bounds, kv, kv.lengths, queries)
    # FlashInfer MLA's reading takes the query offsets first; the others after the KV list.
    queries_first = call.queries is not None and call.kv is pl.KvIds.PAGES_LENGTHS
    queries = pv.index(plan, call.queries) if queries_first else None
    offsets = pv.index(plan, call.count)
    ids = pv.index(plan, call.ids)
    length = pv.index(plan, call.length) if call.length is not None else None
    if call.queries is not None and not queries_first:
        queries = pv.index(plan, call.queries)
    requests = pv.requests_of(offsets, call.count)
    pages = pv.counts(offsets)
    ids_bound = pv.offsets_into(call.count, offsets, call.ids, ids.numel())
    used = pv.used_prefix(ids, offsets)
    pages_bound = pv.Entries(call.ids, ids, used, 0, batch.kv_cache_size // ps, f"pages of the KV cache ({batch.kv_cache_size} slots / page {ps})")
    query_bounds = _query_bounds(call, queries, requests, batch.num_tokens)
    if call.kv is pl.KvIds.SLOTS:
        bounds = [ids_bound, pv.Entries(call.ids, ids, used, 0, batch.kv_cache_size, "slots of the KV cache"), *query_bounds]
        lens, ps = pages, 1
    elif call.kv is pl.KvIds.PAGES_LAST_PAGE_LEN:
        assert length is not None
        last = length[:requests].clamp(0, ps) if length.numel() >= requests else None
        lens = torch.where(pages > 0, (pages - 1) * ps + last if last is not None else pages * ps, 0)
        bounds = [
            pv.Equals(f"{call.length}.numel()", length.numel(), requests, f"one entry per request of {call.count}"),
            ids_bound,
            pages_bound,
            pv.Entries(call.length, length, None, 0, ps + 1, f"tokens of a last page (page_size {ps})"),
            *query_bounds,
        ]
    else:  # PAGES_LENGTHS: sizes, then offsets, then entries
        assert length is not None
        holds = (pages[: length.numel()] * ps + 1) if length.numel() <= requests else length.new_ones(length.shape)
        bounds = [
            *query_bounds[:1],
            pv.Equals(f"{call.length}.numel()", length.numel(), requests, f"one length per request of {call.count}"),
            *query_bounds[1:],
            ids_bound,
            pages_bound,
            pv.Entries(call.length, length, None, 0, holds, f"tokens the request's {call.count} pages hold (page_size {ps})"),
        ]
        lens = length[:requests].clamp(min=0) if length.numel() >= requests else pages * ps
    rows = (length,) if length is not None else ()
    return _Read(pv.covered(offsets=(offsets, queries), rows=rows), requests, bounds, pv.csr_kv(ids, offsets, lens, ps, call.ids), lens, queries)


def _query_bounds(call: Call, queries: torch.Tensor | None, requests: int, tokens: int) -> list[pv.Bound]:
    if queries is None or call.queries is None:
        return []
    return [
        pv.Equals(f"{call.queries}.numel()", queries.numel(), requests + 1, f"one offset per request of {call.count}, plus one"),
        pv.query_offsets(call.queries, queries, tokens),
    ]


def _merged_rows(declaration: PlanDeclaration, call: Call, plan: Plan, tokens: int) -> list[pv.Bound]:
    """Where a merge reads every query row of the step from each call (FA3's two-call verify): a
    call's queries short of the step's rows no longer match the outputs' shape."""
    if declaration.merged_rows is None or call.queries is None:
        return []
    cu = pv.index(plan, call.queries)
    return [pv.Equals(f"{call.queries}[-1]", int(cu[-1]), tokens, declaration.merged_rows)] if cu.numel() else []


def _split_bounds(splits: SplitCounts, call: Call, plan: Plan, requests: int, bounds: list[pv.Bound]) -> int:
    """Appends the split counts' bounds; returns the requests they describe."""
    counts = pv.index(plan, splits.field)
    top = pv.scalar(plan, splits.top)
    bounds += [
        pv.Equals(f"{splits.field}.numel()", counts.numel(), requests, f"one split count per request of {call.count}"),
        pv.Entries(splits.field, counts, None, 1, top + 1, f"split counts the stage-1 scratch holds ({splits.top} {top})"),
    ]
    return counts.numel()


def _mask_bounds(declaration: PlanDeclaration, plan: Plan, read: _Read, bounds: list[pv.Bound]) -> int:
    """Appends a custom mask's bounds (bools, else the packed bytes); returns the requests its
    offsets describe (0: none read)."""
    assert read.queries is not None
    requests = read.requests
    q_lens = pv.counts(read.queries)[:requests]
    columns = read.lengths[: q_lens.numel()]
    if declaration.mask is pl.MaskReading.FULL_BLOCKS:
        columns = columns + q_lens  # the step's own tokens follow the listed columns
    block = _MASK_BLOCK[declaration.mask]
    if "custom_mask" in plan.tensors:
        mask_len = plan.tensors["custom_mask"].numel()
        name = declaration.mask_offsets
        if name is None:
            # The library computes the blocks' offsets (FlashInfer's plan(): cumsum(q_len * kv_len),
            # _compute_page_mask_indptr) and ignores a recorded mask_indptr.
            sizes = q_lens * columns
            starts = torch.nn.functional.pad(sizes.cumsum(0), (1, 0))[:-1]
            bounds.append(pv.Extents(None, starts, sizes, mask_len, block, "custom_mask"))
            return 0
        offsets = pv.index(plan, name)  # the kernel reads a mask only with its offsets
        bounds += [
            pv.Equals(f"{name}.numel()", offsets.numel(), requests + 1, f"one offset per request of {declaration.call.count}, plus one"),
            pv.offsets_into(name, offsets, "custom_mask", mask_len),
            pv.Extents(name, offsets[:requests], q_lens * columns, mask_len, block, "custom_mask"),
        ]
        return offsets.numel() - 1
    packed = declaration.packed_mask
    if packed is not None and packed.tensor in plan.tensors:
        # The mask as plan() left it: block b's bytes at packed.indptr[b], ceil(q_len x kv_len / 8) of them.
        size = plan.tensors[packed.tensor].numel()
        offsets = pv.index(plan, packed.indptr)
        bounds += [
            pv.Equals(f"{packed.indptr}.numel()", offsets.numel(), requests + 1, f"one byte offset per request of {declaration.call.count}, plus one"),
            pv.offsets_into(packed.indptr, offsets, packed.tensor, size),
        ]
        if offsets.numel() == requests + 1 and read.queries.numel() == requests + 1:
            sizes = pv.counts(read.queries) * read.lengths
            bounds.append(pv.Extents(packed.indptr, offsets[:-1], pl.PackedMask.byte_sizes(sizes), size, f"packed {block} (bytes)", packed.tensor))
    return 0
