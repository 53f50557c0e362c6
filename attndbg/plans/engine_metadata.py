"""What an engine that records its own attention metadata (vLLM) handed its kernels beside it: the
builder's copies of the engine's fields, its request and token counts, and its paged-KV lists, read
by the names the engine's conventions declare (attndbg/trace/engines.py `MetadataFields`).

Facts, not findings: the invariants detector judges each copy against the field it copies and the
counts against the query offsets (attndbg/detectors/invariants/vllm_builder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.trace.engines import BuilderTensor, MetadataFields
from attndbg.trace.schema import Plan


@dataclass(frozen=True)
class EngineField:
    """One of the engine's own fields as recorded: its plan name and values (int64)."""

    name: str
    values: Tensor


@dataclass(frozen=True)
class BuilderCopy:
    """A builder tensor that copies an engine field for the requests from `first_row` on."""

    declared: BuilderTensor
    values: Tensor  # int64, as recorded
    first_row: int  # the request its row 0 is


@dataclass(frozen=True)
class SplitSchedule:
    """A split-KV schedule the builder computed ahead of time for this step (outside any graph),
    and the bound on its split count it was given (0: none)."""

    schedule: str  # plan.tensors name of the schedule
    bound_name: str  # plan.scalars name of the bound
    bound: int


@dataclass(frozen=True)
class PagedKv:
    """A builder's paged-KV lists (FlashInfer's layout, AITER MLA's): per request, its pages'
    offsets and the tokens in its last page."""

    prefix: str  # "" or "decode.": where the builder keeps them
    indptr: Tensor | None  # [requests + 1] int64, or None when not recorded
    last_page_len: Tensor | None  # [requests] int64, or None
    first_row: int  # the request its row 0 is


def _ints(value: Tensor | None) -> Tensor | None:
    if value is None or value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
        return None
    return value.to(torch.int64)


# Host copies the builder plans from carry the suffix (vLLM 0.10-0.11's FlashInferMetadata:
# paged_kv_indptr_cpu, paged_kv_last_page_len_cpu); either is what the kernel is planned with.
HOST_SUFFIX = "_cpu"


def _first_ints(plan: Plan, name: str) -> Tensor | None:
    """The integer tensor `name` (else its host copy `name_cpu`) the plan holds."""
    value = _ints(plan.tensors.get(name))
    return value if value is not None else _ints(plan.tensors.get(name + HOST_SUFFIX))


def engine_field(plan: Plan, names: tuple[str, ...]) -> EngineField | None:
    """The first of `names` the plan holds as an integer tensor."""
    for name in names:
        value = _ints(plan.tensors.get(name))
        if value is not None:
            return EngineField(name, value)
    return None


def _scalar(plan: Plan, name: str) -> int | None:
    value = plan.scalars.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def counts(plan: Plan, fields: MetadataFields) -> dict[str, int]:
    """The builder's counts it recorded (num_decodes, num_decode_tokens, ...), by name."""
    found = {name: _scalar(plan, name) for name in fields.counts}
    return {name: value for name, value in found.items() if value is not None}


def transforms_batch(plan: Plan, fields: MetadataFields) -> bool:
    """The builder makes a batch of its own (its tensors copy none of the engine's fields)."""
    return bool(fields.builder_name) and plan.scalars.get(fields.builder_name) in fields.transforming_builders


def _first_row(rows: str, plan: Plan) -> int | None:
    """Request index of a part's row 0; None when the part's start is not recorded."""
    if rows == "all" or rows == "decodes":
        return 0
    return _scalar(plan, "num_decodes")


def builder_copies(plan: Plan, fields: MetadataFields) -> list[BuilderCopy]:
    """Every builder tensor the plan holds that copies an engine field, with the request its row 0
    is; none when the builder transforms the batch."""
    if transforms_batch(plan, fields):
        return []
    found = []
    for declared in fields.builder_tensors:
        values = _ints(plan.tensors.get(declared.name))
        first = _first_row(declared.rows, plan)
        if values is not None and first is not None:
            found.append(BuilderCopy(declared, values, first))
    return found


def paged_kv(plan: Plan, fields: MetadataFields) -> list[PagedKv]:
    """The builder's paged-KV lists, per prefix that holds one (none when the builder transforms
    the batch)."""
    if transforms_batch(plan, fields):
        return []
    found = []
    for prefix in fields.paged_kv_prefixes:
        indptr = _first_ints(plan, f"{prefix}paged_kv_indptr")
        last = _first_ints(plan, f"{prefix}paged_kv_last_page_len")
        if indptr is None and last is None:
            continue
        found.append(PagedKv(prefix, indptr, last, 0))
    return found


def split_schedule(plan: Plan, fields: MetadataFields) -> SplitSchedule | None:
    """The builder's ahead-of-time split schedule and its bound, where it recorded both."""
    schedule = next((name for name in fields.split_schedule if plan.tensors.get(name) is not None), None)
    bound = next(((name, value) for name in fields.split_bound if (value := _scalar(plan, name)) is not None), None)
    if schedule is None or bound is None:
        return None
    return SplitSchedule(schedule, bound[0], bound[1])
