"""Test fixture: FlashInfer's host scheduler written out from its documented rules
(include/flashinfer/attention/scheduler.cuh, 0.7.2.post1: DecodePlanImpl with
DecodeSplitKVIndptr and PartitionPagedKVCacheBinarySearchMinNumPagePerBatch; PrefillPlanImpl with
PrefillSplitQOKVIndptr and PrefillBinarySearchKVChunkSize; AlignedAllocator's offsets), so the CPU
tests can make the plan info a real plan() would leave, where FlashInfer cannot run. The device
facts plan() asks the GPU for (max grid size, SM count, cta_tile_q) are parameters. Unwritten
workspace bytes hold a stale pattern, as a reused pinned buffer does. Not a kernel library."""

from __future__ import annotations

import dataclasses

import torch

from attndbg.trace.schema import Plan, PlanInfo, Trace

STALE_BYTE = 0xA7


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Allocator:
    """AlignedAllocator over a workspace starting at an aligned address: offsets only."""

    def __init__(self) -> None:
        self.used = 0

    def offset(self, size: int, alignment: int) -> int:
        start = _cdiv(self.used, alignment) * alignment
        self.used = start + size
        return start


def _write(workspace: bytearray, offset: int, values: list[int], item_bytes: int = 4) -> None:
    data = torch.tensor(values, dtype=torch.int32 if item_bytes == 4 else torch.uint8).numpy().tobytes()
    workspace[offset : offset + len(data)] = data


def decode_plan_info(kv_pages: list[int], page_size: int, *, max_grid_size: int, gdy: int, graph: bool) -> tuple[list[int], bytes]:
    batch = len(kv_pages)
    if batch * gdy >= max_grid_size:
        split, chunk, new_batch = False, max([1, *kv_pages]), batch
    else:
        low, high = max(128 // page_size, 1), max([0, *kv_pages])
        while low < high:
            mid = (low + high) // 2
            if sum(_cdiv(p, mid) for p in kv_pages) * gdy > max_grid_size:
                low = mid + 1
            else:
                high = mid
        chunk = low
        new_batch = sum(_cdiv(max(p, 1), chunk) for p in kv_pages)
        split = not (new_batch == batch and not graph)
    padded = (max_grid_size // gdy if split else batch) if graph else new_batch
    request, tiles, o_indptr = [], [], [0]
    for b, p in enumerate(kv_pages):
        n = _cdiv(max(p, 1), chunk)
        request += [b] * n
        tiles += list(range(n))
        o_indptr.append(o_indptr[-1] + n)
    alloc = _Allocator()
    ri = alloc.offset(padded * 4, 16)
    kt = alloc.offset(padded * 4, 16)
    oi = alloc.offset((padded + 1) * 4, 16)
    kc = alloc.offset(4, 1)
    bvm = alloc.offset(padded, 16) if split else 0
    workspace = bytearray([STALE_BYTE]) * alloc.used
    _write(workspace, ri, request)
    _write(workspace, kt, tiles)
    _write(workspace, oi, o_indptr)
    _write(workspace, kc, [chunk * page_size])
    if split:
        _write(workspace, bvm, [int(i < new_batch) for i in range(padded)], 1)
    vector = [padded, 0, 4096, ri, kt, oi, bvm, kc, int(graph), int(split)]
    return vector, bytes(workspace)


def prefill_plan_info(
    qo_lens: list[int],
    kv_pages: list[int],
    page_size: int,
    *,
    group: int,
    num_kv_heads: int,
    num_sm: int,
    cta_tile_q: int,
    graph: bool,
    window_left: int = -1,
    disable_split_kv: bool = False,
    exact_grid: bool = False,
    previous: bytes = b"",
    graph_mask: bool = False,
) -> tuple[list[int], bytes]:
    """`disable_split_kv`: one KV tile a request, split-KV off, kv_chunk_size int64 max (its low 32
    bits stored); under a graph the grid is still padded and, without split-KV, no block_valid_mask
    is written (FlashInfer 0.7.2.post1). `exact_grid`: the proposed fix for a graph plan without
    split-KV, the grid exactly the work items (padded_batch_size = their count). `previous`: what the
    pinned workspace held before this plan (an earlier plan's bytes); bytes this plan does not
    write keep it, the rest past it hold STALE_BYTE. `graph_mask`: flashinfer#5176's layout, a graph
    plan writes block_valid_mask (true on the work items, false on the padding) without split-KV too,
    placed where a split-KV plan's is (after total_num_rows; no merge_indptr without split-KV)."""
    batch = len(qo_lens)
    total_rows = sum(qo_lens)
    max_batch_if_split = (2 * num_sm) // num_kv_heads
    packed = [q * group for q in qo_lens]
    if graph:
        tiles_q = _cdiv(total_rows * group, cta_tile_q) + batch - 1
    else:
        tiles_q = sum(_cdiv(p, cta_tile_q) for p in packed)
    effective = [min(_cdiv(window_left + cta_tile_q, page_size), p) if window_left >= 0 else p for p in kv_pages]
    max_kv = max([1, *effective])
    low, high = max(128 // page_size, 1), max_kv
    while low < high:
        mid = (low + high) // 2
        if sum(_cdiv(p, cta_tile_q) * _cdiv(max(e, 1), mid) for p, e in zip(packed, effective)) > max_batch_if_split:
            low = mid + 1
        else:
            high = mid
    split, chunk = graph or low < max_kv, low
    if disable_split_kv:
        split, chunk = False, max_kv
    request, qo_tiles, kv_tiles, o_indptr = [], [], [], [0]
    for b in range(batch):
        nq, nk = _cdiv(packed[b], cta_tile_q), _cdiv(max(effective[b], 1), chunk)
        for qt in range(nq):
            for kt in range(nk):
                request.append(b)
                qo_tiles.append(qt)
                kv_tiles.append(kt)
        o_indptr.append(o_indptr[-1] + qo_lens[b] * nk)
    new_batch = len(request)
    padded = max(max_batch_if_split, tiles_q) if graph and not (exact_grid and disable_split_kv) else new_batch
    assert new_batch <= padded
    alloc = _Allocator()
    ri, qt_off, kt = (alloc.offset(padded * 4, 16) for _ in range(3))
    oi = alloc.offset((batch + 1) * 4, 16)
    kc = alloc.offset(4, 1)
    rows_off = alloc.offset(4, 16) if graph else 0
    merge_off = alloc.offset((total_rows + 1) * 4, 16) if split else 0
    masked = split or (graph and graph_mask)
    bvm = alloc.offset(padded, 16) if masked else 0
    workspace = bytearray(previous[: alloc.used]) + bytearray([STALE_BYTE]) * max(alloc.used - len(previous), 0)
    _write(workspace, ri, request)
    _write(workspace, qt_off, qo_tiles)
    _write(workspace, kt, kv_tiles)
    _write(workspace, oi, o_indptr)
    # kv_chunk_size * page_size in int64, stored as IdType: int64 max x page_size (split-KV off) wraps to -page_size
    _write(workspace, kc, [-page_size if disable_split_kv else chunk * page_size])
    if graph:
        _write(workspace, rows_off, [total_rows])
    if split:
        # merge indptr as PrefillSplitQOKVIndptr builds it: each row adds its request's chunks
        rows = []
        for b in range(batch):
            nk = _cdiv(max(effective[b], 1), chunk)
            rows += [nk] * qo_lens[b]
        _write(workspace, merge_off, torch.tensor([0, *rows]).cumsum(0).tolist())
    if masked:
        _write(workspace, bvm, [int(i < new_batch) for i in range(padded)], 1)
    vector = [padded, total_rows, rows_off, cta_tile_q, ri, qt_off, kt, merge_off, oi, kc, 0, 8192, bvm, int(graph), int(split)]
    return vector, bytes(workspace)


def plan_lists(plan: Plan) -> tuple[list[int], list[int]]:
    """(qo rows, KV pages) per request of a flashinfer plan (decode: one row a request)."""
    pages = plan.tensors["kv_indptr"].to(torch.int64).diff().tolist()
    qo = plan.tensors.get("qo_indptr")
    rows = qo.to(torch.int64).diff().tolist() if qo is not None else [1] * len(pages)
    return rows, pages


def with_plan_info(trace: Trace, vector: list[int], workspace: bytes) -> Trace:
    info = PlanInfo(vector=torch.tensor(vector, dtype=torch.int64), workspace=torch.frombuffer(bytearray(workspace), dtype=torch.uint8).clone())
    return dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, plan_info=info))


def scheduled(
    trace: Trace,
    *,
    for_plan: Plan | None = None,
    tensor_cores: bool | None = None,
    graph: bool = False,
    max_grid_size: int = 264,
    num_sm: int = 132,
    cta_tile_q: int = 16,
    disable_split_kv: bool = False,
    graph_mask: bool = False,
    previous: bytes = b"",
) -> Trace:
    """`trace` with the plan info FlashInfer's plan() would leave for `for_plan` (default: the trace's
    own plan). Decode plans use the decode scheduler unless `tensor_cores` (the plan's
    use_tensor_cores scalar when None); the rest the prefill scheduler, with disable_split_kv,
    graph_mask and previous as prefill_plan_info takes them."""
    plan = for_plan if for_plan is not None else trace.plan
    rows, pages = plan_lists(plan)
    model = trace.model
    ps = int(plan.scalars["page_size"])
    decode = plan.scalars["path"] == "decode"
    cores = bool(plan.scalars.get("use_tensor_cores", False)) if tensor_cores is None else tensor_cores
    if decode and not cores:
        vector, workspace = decode_plan_info(pages, ps, max_grid_size=max_grid_size, gdy=model.num_kv_heads, graph=graph)
    else:
        window = int(plan.scalars.get("window_left", -1)) if not decode else -1
        vector, workspace = prefill_plan_info(
            rows, pages, ps, group=model.num_qo_heads // model.num_kv_heads, num_kv_heads=model.num_kv_heads, num_sm=num_sm, cta_tile_q=cta_tile_q, graph=graph, window_left=window,
            disable_split_kv=disable_split_kv, graph_mask=graph_mask, previous=previous,
        )  # fmt: skip
    return with_plan_info(trace, vector, workspace)
