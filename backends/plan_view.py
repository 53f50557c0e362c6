"""What a plan will make a kernel read, as data: every index tensor with the bound it must respect.

Each backend declares its plan once (`Backend.plan_declaration`, backends/plan_declaration.py:
kv_indices, page tables, block tables, MLA page indices, qo/kv/mask indptrs), from which shared
code derives a `PlanView` with the bounds and helpers here. The plan guard (attndbg/plans/guard.py) checks a
recorded plan's view before launching it, and knows no backend: a wrong engine plan is evidence,
but a kernel handed indices past an allocation reads arbitrary device memory or faults.

Views are built from untrusted plans: building one never indexes with the plan's own values
(offsets are clamped before slicing), so a hostile plan gives a view whose bounds name its first
bad element, never an exception. A plan that cannot be viewed raises `PlanViewError`, naming the
field: `PlanUnreadable` where a field the declaration names is missing or cannot be read as its
kernel takes it (wrong rank or type, an unknown setting), which makes the plan incomplete, not
unsafe: it is not read and not launched, and no claim about memory is made; the base class where
a field holds a value no kernel could be handed safely (a page size past any page).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.trace.schema import Plan


class PlanViewError(ValueError):
    """The plan cannot be viewed, so it cannot be guarded: a field holds a value no kernel could take."""

    def __init__(self, message: str, *, field: str = ""):
        super().__init__(message)
        self.field = field  # the plan tensor at fault, or "scalars.<name>"


class PlanUnreadable(PlanViewError):
    """The plan lacks a tensor or scalar its layout declares, or holds one that cannot be read as
    the kernel takes it (wrong rank or dtype, not an integer, an unknown setting): it is incomplete,
    not unsafe. Not read, never launched, and not a finding."""


@dataclass(frozen=True)
class Offsets:
    """A CSR offsets tensor (an "indptr"): starts at 0, never decreases, no entry past `limit`."""

    field: str  # plan tensor name, e.g. "kv_indptr"
    values: Tensor  # [n+1] int64
    limit: int  # length of what it indexes
    past: str  # what an entry past `limit` does, e.g. "exceeds kv_indices's length 40"


@dataclass(frozen=True)
class Entries:
    """Entries of an index tensor that the kernel reads, each in [low, high)."""

    field: str  # plan tensor name
    values: Tensor  # the whole tensor (int64), so an element is named by its own index
    used: Tensor | None  # bool, values' shape: the entries the kernel reads (None: all)
    low: int
    high: int | Tensor  # exclusive; a tensor of values' shape when the bound differs per entry
    meaning: str  # what [low, high) is, e.g. "pages of the KV cache"


@dataclass(frozen=True)
class Extents:
    """Per request, a block [start, start + size) of a flat tensor must lie inside it."""

    field: str | None  # the tensor holding the starts, e.g. "mask_indptr"; None: the library computes them
    starts: Tensor  # [n] int64
    sizes: Tensor  # [n] int64: elements the kernel reads from each start
    limit: int  # length of the flat tensor
    block: str  # what a block is, e.g. "q_len x (kv_len + q_len) mask block"
    target: str  # the flat tensor, e.g. "custom_mask"


@dataclass(frozen=True)
class Equals:
    """A size or setting the kernel assumes: the plan's must be `expected`."""

    field: str  # e.g. "kv_last_page_len.numel()", "scalars.page_size"
    found: int
    expected: int
    why: str  # e.g. "one entry per request of kv_indptr"


Bound = Offsets | Entries | Extents | Equals


@dataclass(frozen=True)
class RequestKV:
    """Per request, the KV ids its kernel reads (CSR over `ids`) and the tokens they hold: the one
    per-request KV type. The strict view builds it for the guard and the mistake models (meaningful
    once the view's bounds hold: built from clamped offsets before that); the plan reading
    (attndbg/plans/kv.py) builds it leniently for the detectors, from a plan the guard may refuse.

    `field` names where the ids are read from, so a detector can name an entry: a flat tensor
    (entry j of request b is field[indptr[b] + j]) or, with `table`, a dense table's rows (entry j
    of request b is field[b, j])."""

    page_size: int  # tokens per id: 1 for slot ids
    indptr: Tensor  # [requests+1] int64 into ids
    ids: Tensor  # [sum] int64: slot ids or page ids
    lengths: Tensor  # [requests] int64: tokens read
    field: str = ""  # the plan tensor holding the ids, e.g. "kv_indices", "page_table"
    table: bool = False  # `field` is a [requests, width] table, request b's ids its row b

    @property
    def requests(self) -> int:
        return self.indptr.numel() - 1

    def of(self, b: int) -> tuple[Tensor, int]:
        return self.ids[int(self.indptr[b]) : int(self.indptr[b + 1])], int(self.lengths[b])

    def name(self, b: int, j: int) -> str:
        """The plan element holding request b's j-th id, e.g. "plan.kv_indices[17]", "plan.page_table[2, 0]"."""
        return f"plan.{self.field}[{b}, {j}]" if self.table else f"plan.{self.field}[{int(self.indptr[b]) + j}]"


@dataclass(frozen=True)
class RequestRows:
    """Plan tensors laid out request by request, `per_request` entries each (a two-call verify's
    expand_ call has one per draft token), so the first b requests are the first b * per_request
    rows of each of `rows`, and the first b * per_request + 1 entries of each of `offsets` (an
    indptr over those rows, with the flat tensor it indexes, which keeps what the kept offsets reach)."""

    per_request: int
    rows: tuple[str, ...]  # e.g. ("page_table", "cache_seqlens")
    offsets: tuple[tuple[str, str | None], ...] = ()  # (indptr, the flat tensor it indexes; None: query rows)


# Per-request offsets by name and the flat tensor each one indexes (None: query rows), as SGLang's
# and FlashAttention's plans name them: what keeps a padded plan's real requests when its view
# declares no `layout`.
USUAL_OFFSETS: dict[str, str | None] = {"kv_indptr": "kv_indices", "qo_indptr": None, "cu_seqlens_q": None, "cu_seqlens_k": None, "mask_indptr": "custom_mask"}


@dataclass(frozen=True)
class PlanView:
    """A plan as its kernel will read it. Bounds are in checking order: sizes and offsets first,
    so the first violation reported is the cause, not a consequence."""

    requests: int  # the most requests any of its per-request tensors describes (query rows: the Offsets)
    bounds: tuple[Bound, ...]
    kv: RequestKV | None = None  # None where not cheap to give
    # Which tensors are per request, and how: what keeps a graph-padded plan's real requests
    # (attndbg/plans/guard.py real_requests_only). None: USUAL_OFFSETS and every tensor with a row per request.
    layout: tuple[RequestRows, ...] | None = None


# -- reading an untrusted plan ------------------------------------------------------------------


def index(plan: Plan, name: str, *, dims: int = 1) -> Tensor:
    """plan.tensors[name] as int64, if it is an integer tensor of `dims` dimensions."""
    value = plan.tensors.get(name)
    if value is None:
        raise PlanUnreadable(f"plan has no {name}", field=name)
    if value.layout is not torch.strided or value.device.type == "meta":
        raise PlanUnreadable(f"plan {name} is a {value.layout} tensor on {value.device}, expected a dense tensor", field=name)
    if value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
        raise PlanUnreadable(f"plan {name} has dtype {str(value.dtype).replace('torch.', '')}, expected integer indices", field=name)
    if value.dim() != dims:
        raise PlanUnreadable(f"plan {name} has shape {list(value.shape)}, expected {dims} dimension(s)", field=name)
    return value.to(torch.int64)


def scalar(plan: Plan, name: str) -> int:
    """An integer (or bool) plan scalar the kernel call needs."""
    value = plan.scalars.get(name)
    if value is None:
        raise PlanUnreadable(f"plan has no scalar {name}", field=f"scalars.{name}")
    if not isinstance(value, (int, bool)):
        raise PlanUnreadable(f"plan scalar {name} = {value!r}, expected an integer", field=f"scalars.{name}")
    return int(value)


def require(plan: Plan, *names: str) -> None:
    """Scalars the kernel call reads (any type): their absence would be a KeyError at launch."""
    for name in names:
        if name not in plan.scalars:
            raise PlanUnreadable(f"plan has no scalar {name}", field=f"scalars.{name}")


# Larger page sizes are not pages but hostile numbers: bounds computed from them (columns x page)
# must stay inside int64.
MAX_PAGE_SIZE = 2**31


def page_size(plan: Plan, name: str = "page_size") -> int:
    ps = scalar(plan, name)
    if not 1 <= ps <= MAX_PAGE_SIZE:
        raise PlanViewError(f"plan scalar {name} = {ps}, expected a page size in [1, {MAX_PAGE_SIZE}]", field=f"scalars.{name}")
    return ps


def requests_of(offsets: Tensor, name: str) -> int:
    if offsets.numel() == 0:
        raise PlanViewError(f"plan {name} is empty, expected one offset per request plus one", field=name)
    return offsets.numel() - 1


def covered(*, offsets: tuple[Tensor | None, ...] = (), rows: tuple[Tensor, ...] = ()) -> int:
    """The most requests any per-request tensor describes: an indptr's entries - 1, the rows of a
    per-request vector or table."""
    return max([t.numel() - 1 for t in offsets if t is not None] + [t.shape[0] for t in rows] + [0])


def counts(offsets: Tensor) -> Tensor:
    """[n] entries per request of an indptr, clamped at 0 (a decreasing indptr is its own bound)."""
    return offsets.diff().clamp(min=0)


# -- bounds every layout uses -------------------------------------------------------------------


def query_offsets(name: str, values: Tensor, tokens: int) -> Offsets:
    return Offsets(name, values, tokens, f"reads query rows past the step's {tokens}")


def offsets_into(name: str, values: Tensor, target: str, length: int) -> Offsets:
    return Offsets(name, values, length, f"exceeds {target}'s length {length}")


def used_prefix(indices: Tensor, offsets: Tensor) -> Tensor:
    """The entries a CSR kernel reads: indices[:offsets[-1]] (clamped), as a mask over `indices`."""
    end = int(offsets[-1].clamp(0, indices.numel())) if offsets.numel() else 0
    return torch.arange(indices.numel()) < end


def csr_kv(indices: Tensor, offsets: Tensor, lengths: Tensor, page_size: int, field: str = "") -> RequestKV:
    """Per-request ids of a CSR plan, offsets clamped into `indices`."""
    clamped = offsets.clamp(0, indices.numel())
    return RequestKV(page_size, clamped, indices, lengths, field)


def page_table_bounds(
    plan: Plan, *, table: str, lens: str, cu_seqlens_q: str | None, tokens: int, kv_cache_size: int, page_size: int
) -> tuple[int, list[Bound], RequestKV]:
    """(requests covered, bounds, per-request pages) of a dense page table [bs, max_pages] + per-request lengths (FA3, FlashMLA, vLLM block tables).

    Row b's first ceil(lens[b] / page) entries are read; columns past them are never read (SGLang
    leaves the dummy page 0 there), so they are not judged."""
    table_t = index(plan, table, dims=2)
    lens_t = index(plan, lens)
    rows, cols = table_t.shape
    bounds: list[Bound] = [Equals(f"{lens}.numel()", lens_t.numel(), rows, f"one length per row of {table}")]
    cu = None
    if cu_seqlens_q is not None:
        cu = index(plan, cu_seqlens_q)
        bounds += [Equals(f"{cu_seqlens_q}.numel()", cu.numel(), rows + 1, f"one offset per row of {table}, plus one"), query_offsets(cu_seqlens_q, cu, tokens)]
    bounds.append(Entries(lens, lens_t, None, 0, cols * page_size + 1, f"tokens a {table} row of {cols} pages of {page_size} holds"))
    lens_used = lens_t[:rows].clamp(0, cols * page_size) if lens_t.numel() >= rows else torch.zeros(rows, dtype=torch.int64)
    pages = (lens_used + page_size - 1) // page_size  # [rows]
    used = torch.arange(cols)[None, :] < pages[:, None]
    bounds.append(Entries(table, table_t, used, 0, kv_cache_size // page_size, f"pages of the KV cache ({kv_cache_size} slots / page {page_size})"))
    kv = RequestKV(page_size, torch.nn.functional.pad(pages.cumsum(0), (1, 0)), table_t[used], lens_used, table, table=True)
    return covered(offsets=(cu,), rows=(table_t, lens_t)), bounds, kv
