"""FlashInfer's own schedule of a planned wrapper: the plan-info vector `plan()` returns
(`wrapper._plan_info`) and the arrays it places in the int workspace, read back by their offsets.

`plan()` runs FlashInfer's scheduler on the host (include/flashinfer/attention/scheduler.cuh,
0.7.2.post1: DecodePlan / PrefillPlan), writes its arrays into the wrapper's pinned host buffer
(`_pin_memory_int_workspace_buffer`) at offsets from an AlignedAllocator over the int workspace,
copies the used head of that buffer to the device int workspace, and returns the offsets and sizes
as a vector of int64 (`DecodePlanInfo::ToVector`, `PrefillPlanInfo::ToVector`). Every kernel launch
of the wrapper reads the device copy: each thread block `bx < padded_batch_size` is one work item
(request_indices[bx], qo_tile_indices[bx], kv_tile_indices[bx]), skipped where block_valid_mask[bx]
is false (where plan() wrote a mask: split-KV plans, and with flashinfer#5176 every graph plan;
without one every block runs); a split-KV item covers the KV chunk [kv_tile * kv_chunk_size,
(kv_tile + 1) * kv_chunk_size) of its request and writes its partial state at o_indptr[request] +
kv_tile (decode) or per row (prefill), merged per row by merge_indptr (prefill) or o_indptr (decode).

Two vectors, told apart by their length (FromVector refuses any other):

    decode (10)   BatchDecodeWithPagedKVCacheWrapper without tensor cores
    prefill (15)  the paged and ragged prefill wrappers, and tensor-core decode (its plan() calls the
                  prefill scheduler with one query row per request)

Arrays are IdType (int32 in every wrapper SGLang and attndbg build); block_valid_mask is bool (one
byte); each offset counts bytes from the workspace's start. This module knows the layout and reads
it with bounds checks: nothing here trusts a stored vector.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ID_BYTES = 4  # IdType: int32 (SGLang and attndbg plan with int32 indptrs)
BOOL_BYTES = 1


class ScheduleKind(enum.Enum):
    DECODE = "decode"  # DecodePlanInfo
    PREFILL = "prefill"  # PrefillPlanInfo


# ToVector's order, per kind (scheduler.cuh).
FIELDS: dict[ScheduleKind, tuple[str, ...]] = {
    ScheduleKind.DECODE: (
        "padded_batch_size", "v_offset", "s_offset", "request_indices_offset", "kv_tile_indices_offset", "o_indptr_offset",
        "block_valid_mask_offset", "kv_chunk_size_ptr_offset", "enable_cuda_graph", "split_kv",
    ),
    ScheduleKind.PREFILL: (
        "padded_batch_size", "total_num_rows", "total_num_rows_offset", "cta_tile_q", "request_indices_offset", "qo_tile_indices_offset",
        "kv_tile_indices_offset", "merge_indptr_offset", "o_indptr_offset", "kv_chunk_size_ptr_offset", "v_offset", "s_offset",
        "block_valid_mask_offset", "enable_cuda_graph", "split_kv",
    ),
}  # fmt: skip
KIND_OF_LENGTH = {len(names): kind for kind, names in FIELDS.items()}
# FlashInfer's int workspace is 8 MiB (decode.py / prefill.py: `_int_workspace_buffer`); no offset of
# a real plan is past it.
MAX_WORKSPACE_BYTES = 8 * 1024 * 1024


class PlanInfoError(ValueError):
    """A stored plan-info vector or workspace that FlashInfer could not have written: `field` is
    where ("plan.plan_info.vector[4]" style, without the prefix: "vector[4]"), the message says what."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ArraySpec:
    """One array of the schedule: where its offset is in the vector, its element size, its length."""

    name: str  # e.g. "request_indices"
    offset_field: str  # the vector entry holding its byte offset
    item_bytes: int
    length: str  # "padded" (padded_batch_size), "requests + 1", "padded + 1", "rows + 1" (total_num_rows + 1), "one"


def arrays(kind: ScheduleKind, *, split_kv: bool, graph: bool, mask_offset: int = 0) -> tuple[ArraySpec, ...]:
    """The arrays plan() writes for this kind and these settings (the others' offsets are 0, unused).

    block_valid_mask: FlashInfer 0.7.2.post1 allocates it under split-KV only; with flashinfer#5176
    (the fix of #4002) every CUDA-graph plan has one, split-KV or not, and the kernels skip the
    padded blocks it switches off. `mask_offset` (block_valid_mask_offset) tells the two apart: a
    graph plan without split-KV has a mask where the offset is not 0 (an array plan() did not
    allocate keeps offset 0, and the first array, request_indices, takes byte 0)."""
    tiles = (ArraySpec("request_indices", "request_indices_offset", ID_BYTES, "padded"),)
    if kind is ScheduleKind.PREFILL:
        tiles += (ArraySpec("qo_tile_indices", "qo_tile_indices_offset", ID_BYTES, "padded"),)
    tiles += (ArraySpec("kv_tile_indices", "kv_tile_indices_offset", ID_BYTES, "padded"),)
    # DecodePlanImpl sizes o_indptr for padded_batch_size + 1 entries; PrefillPlanImpl for batch_size + 1.
    tiles += (ArraySpec("o_indptr", "o_indptr_offset", ID_BYTES, "padded + 1" if kind is ScheduleKind.DECODE else "requests + 1"),)
    tiles += (ArraySpec("kv_chunk_size", "kv_chunk_size_ptr_offset", ID_BYTES, "one"),)
    if kind is ScheduleKind.PREFILL and graph:
        tiles += (ArraySpec("total_num_rows_host", "total_num_rows_offset", ID_BYTES, "one"),)
    if split_kv and kind is ScheduleKind.PREFILL:
        tiles += (ArraySpec("merge_indptr", "merge_indptr_offset", ID_BYTES, "rows + 1"),)
    if split_kv or (graph and mask_offset != 0):
        tiles += (ArraySpec("block_valid_mask", "block_valid_mask_offset", BOOL_BYTES, "padded"),)
    return tiles


def _placed(kind: ScheduleKind, info: dict[str, int]) -> tuple[ArraySpec, ...]:
    """The arrays the vector `info` (by FIELDS name) places."""
    return arrays(kind, split_kv=bool(info["split_kv"]), graph=bool(info["enable_cuda_graph"]), mask_offset=info["block_valid_mask_offset"])


@dataclass(frozen=True)
class Schedule:
    """A wrapper's schedule as its kernels read it. Arrays are int64 copies (block_valid_mask bool),
    each as long as plan() sized it: entries past what the scheduler wrote hold whatever an earlier
    plan left there (FlashInfer writes only the work items and offsets of this batch)."""

    kind: ScheduleKind
    info: dict[str, int]  # the vector by FIELDS name
    arrays: dict[str, Tensor]  # by ArraySpec name

    @property
    def padded_batch_size(self) -> int:
        return self.info["padded_batch_size"]

    @property
    def split_kv(self) -> bool:
        return bool(self.info["split_kv"])

    @property
    def graph(self) -> bool:
        return bool(self.info["enable_cuda_graph"])

    @property
    def kv_chunk_size(self) -> int:
        """Tokens per KV tile (kv_chunk_size_ptr[0]: the scheduler's chunk in pages times page_size)."""
        return int(self.arrays["kv_chunk_size"][0])

    @property
    def cta_tile_q(self) -> int:
        """Packed query rows (rows x GQA group) per qo tile; 1 for the decode scheduler (one tile a request)."""
        return self.info.get("cta_tile_q", 0)


def tiles_needed(schedule: Schedule, *, kv_pages: Tensor, qo_lens: Tensor, page_size: int, group: int, window_left: int) -> tuple[Tensor, Tensor]:
    """(qo tiles, KV tiles) per request that the schedule's own settings need to cover the plan's
    batch exactly, by the scheduler's rules (scheduler.cuh, 0.7.2.post1):

    - qo tiles: decode 1 a request; prefill ceil(q_len x group / cta_tile_q) (PrefillSplitQOKVIndptr:
      packed_qo_len over cta_tile_q).
    - KV tiles: 1 without split-KV (the kernel reads the whole row); with it, ceil(max(pages, 1) x
      page_size / kv_chunk_size): the chunks [t x chunk, (t + 1) x chunk) for t < tiles cover the
      request's pages, and none starts past them (DecodeSplitKVIndptr; the prefill scheduler counts
      max(pages, 1) too). A prefill with a window counts only the pages the window can reach,
      min(ceil((window_left + cta_tile_q) / page_size), pages) (effective_kv_len_arr).
    The caller checks kv_chunk_size > 0 and cta_tile_q > 0 first."""
    requests = kv_pages.numel()
    if schedule.kind is ScheduleKind.DECODE:
        qo_tiles = torch.ones(requests, dtype=torch.int64)
    else:
        qo_tiles = -(-(qo_lens * group) // schedule.cta_tile_q)
    if not schedule.split_kv:
        return qo_tiles, torch.ones(requests, dtype=torch.int64)
    pages = kv_pages.clamp(min=0)
    if schedule.kind is ScheduleKind.PREFILL and window_left >= 0:
        pages = pages.clamp(max=-(-(window_left + schedule.cta_tile_q) // page_size))
    kv_tiles = -(-(pages.clamp(min=1) * page_size) // schedule.kv_chunk_size)
    return qo_tiles, kv_tiles


def kind_of(vector: list[int]) -> ScheduleKind:
    kind = KIND_OF_LENGTH.get(len(vector))
    if kind is None:
        raise PlanInfoError("vector", f"has {len(vector)} entries; FlashInfer's plan info has 10 (decode) or 15 (prefill)")
    return kind


def _lengths(spec: ArraySpec, info: dict[str, int], requests: int) -> int:
    padded = info["padded_batch_size"]
    return {
        "padded": padded,
        "padded + 1": padded + 1,
        "requests + 1": requests + 1,
        "rows + 1": info.get("total_num_rows", 0) + 1,
        "one": 1,
    }[spec.length]


def read_schedule(vector: list[int], workspace: Tensor, *, requests: int) -> Schedule:
    """The schedule `vector` describes, its arrays read from `workspace` (the int workspace's head,
    uint8); `requests`: the wrapper's batch size (the plan's kv_indptr entries - 1). Raises
    PlanInfoError naming the first entry FlashInfer could not have written: a negative size, an
    offset not aligned as the allocator aligns it, an array that reaches past the workspace."""
    kind = kind_of(vector)
    names = FIELDS[kind]
    info = dict(zip(names, (int(v) for v in vector)))
    for flag in ("enable_cuda_graph", "split_kv"):
        if info[flag] not in (0, 1):
            raise PlanInfoError(f"vector[{names.index(flag)}]", f"{flag} = {info[flag]}, expected 0 or 1")
    for size in ("padded_batch_size", "total_num_rows", "cta_tile_q"):
        if size in info and not 0 <= info[size] <= MAX_WORKSPACE_BYTES:
            raise PlanInfoError(f"vector[{names.index(size)}]", f"{size} = {info[size]}, expected 0 to {MAX_WORKSPACE_BYTES}")
    raw = workspace.reshape(-1)
    out: dict[str, Tensor] = {}
    for spec in _placed(kind, info):
        offset = info[spec.offset_field]
        count = _lengths(spec, info, requests)
        end = offset + count * spec.item_bytes
        where = f"vector[{names.index(spec.offset_field)}]"
        if offset < 0 or end > raw.numel():
            raise PlanInfoError(
                where, f"{spec.offset_field} = {offset}: {spec.name} ({count} x {spec.item_bytes} bytes) would end at byte {end}, past the recorded int workspace of {raw.numel()} bytes"
            )
        if spec.item_bytes > 1 and offset % spec.item_bytes:
            raise PlanInfoError(where, f"{spec.offset_field} = {offset} is not a multiple of {spec.item_bytes} (FlashInfer aligns {spec.name})")
        chunk = raw[offset:end].clone()
        out[spec.name] = chunk.view(torch.bool) if spec.item_bytes == BOOL_BYTES else chunk.view(torch.int32).to(torch.int64)
    return Schedule(kind, info, out)


def workspace_extent(vector: list[int]) -> int:
    """Bytes from the workspace's start that hold every array the vector places, without knowing the
    batch size: the allocator places arrays one after another (request_indices, [qo_tile_indices],
    kv_tile_indices, o_indptr, kv_chunk_size_ptr, [total_num_rows], [merge_indptr], [block_valid_mask]),
    so the prefill o_indptr (sized by the batch) ends before kv_chunk_size_ptr. 0 for a vector of no
    known kind; at most MAX_WORKSPACE_BYTES."""
    kind = KIND_OF_LENGTH.get(len(vector))
    if kind is None:
        return 0
    info = dict(zip(FIELDS[kind], (int(v) for v in vector)))
    ends = []
    for spec in _placed(kind, info):
        count = 1 if spec.length == "requests + 1" else _lengths(spec, info, 0)
        ends.append(info[spec.offset_field] + count * spec.item_bytes)
    return max(0, min(max(ends), MAX_WORKSPACE_BYTES))


def wrapper_plan_info(wrapper: Any) -> tuple[list[int], Tensor] | None:
    """(plan-info vector, host int workspace head) of a planned FlashInfer wrapper, read right after
    its plan(); None where it keeps none (not planned, a backend without a scheduler: trtllm-gen,
    cudnn, fa3's plan info has another layout). The head is a copy: the next plan() overwrites the
    pinned buffer in place."""
    vector = getattr(wrapper, "_plan_info", None)
    pinned = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
    if vector is None or not isinstance(pinned, Tensor) or getattr(wrapper, "_backend", "fa2") not in ("fa2", "auto"):
        return None
    try:
        values = [int(v) for v in vector]
    except (TypeError, ValueError):
        return None
    extent = workspace_extent(values)
    if not extent:
        return None
    return values, pinned.reshape(-1)[: min(extent, pinned.numel())].detach().cpu().clone()
