"""invariants on a plan's sliding-window list (`PlanLayout.window_list`: SGLang's `window_kv_indptr`
/ `window_kv_indices` / `window_kv_offsets`, which its Triton backend builds for SWA layers in
`update_sliding_window_buffer`), which those layers' kernels read instead of the plan's own ids.

SGLang's rule, per real request with base length L (decode: its KV length; extend, mixed and
verify: its prefix, the part read from the cache) and window W (`sliding_window_size`):

    window_kv_indptr[b+1] - window_kv_indptr[b] = min(L, W)
    window_kv_indices of b = its req_to_token row, columns [L - min(L, W), L)
    window_kv_offsets[b]  = L - min(L, W)      (the first window column: where its mask rows start)

Checked as `window-kv`, one finding at the first wrong element. A verify step's offsets index its
tree mask, so they are tree-mask's (window-offset); padded requests of a graph replay are
fill-value's. W is the layer's window (`model.sliding_window`) or, for a full-attention layer of a
hybrid model, the backend's (`plan.scalars.sliding_window`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.plan_layout import WindowList
from attndbg.checks.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.detectors.invariants.plan_kv import plan_layout
from attndbg.trace.schema import ForwardMode, Trace

CAUSE_LENGTH = "the window list was built from other lengths than the batch's (seq_lens where the prefix is meant, or a stale length)"
CAUSE_INDICES = "the window list was gathered from the wrong columns of the request's row (a wrong window_kv_start_idx) or from another row"
CAUSE_OFFSET = "window_kv_offsets is not the window's first column (seq_len - window_len): the kernel reads the request's mask rows shifted"


def _window(trace: Trace) -> int | None:
    if trace.model.sliding_window >= 0:
        return trace.model.sliding_window
    value = trace.plan.scalars.get("sliding_window")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_window_list(trace: Trace, out: list[Finding]) -> None:
    plan = trace.plan
    layout = plan_layout(trace, plan) if plan is not None else None
    # A layout without a window list (every backend but SGLang's Triton) has none to judge.
    windows = layout.window_list if layout is not None else None
    if windows is None or windows.indptr not in plan.tensors or windows.indices not in plan.tensors:
        return
    window = _window(trace)
    indptr, indices = plan.tensors[windows.indptr], plan.tensors[windows.indices]
    batch = trace.batch
    bs = batch.batch_size
    if window is None or indptr.dim() != 1 or indices.dim() != 1 or indptr.numel() < bs + 1 or indptr.is_floating_point() or indices.is_floating_point():
        return  # no window to judge by, or a malformed list (plan-shape / plan-dtype / indptr-* say so)
    indptr, indices = indptr.to(torch.int64), indices.to(torch.int64)
    base = batch.kv_lens if batch.forward_mode is ForwardMode.DECODE else batch.prefix_lens
    expected_lens = torch.clamp(base, max=window)
    found_lens = indptr.diff()[:bs]
    b = _first(found_lens != expected_lens)
    if b >= 0:
        what = "kv_len" if batch.forward_mode is ForwardMode.DECODE else "prefix"
        evidence = f"plan.{windows.indptr} gives request {b} {int(found_lens[b])} window entries, expected min({what} {int(base[b])}, window {window}) = {int(expected_lens[b])}"
        out.append(_wrong(trace, b, f"plan.{windows.indptr}[{b + 1}]", evidence, CAUSE_LENGTH, int(expected_lens[b]), int(found_lens[b])))
        return
    starts = base - expected_lens
    if int(indptr[bs]) <= indices.numel():
        _check_indices(trace, windows, indptr, indices, starts, base, out)
    offsets = plan.tensors.get(windows.offsets)
    if offsets is None or trace.is_tree_verify or offsets.dim() != 1 or offsets.numel() < bs or offsets.is_floating_point():
        return
    found = offsets[:bs].to(torch.int64)
    b = _first(found != starts)
    if b >= 0:
        evidence = f"plan.{windows.offsets}[{b}] = {int(found[b])}, expected the window's first column {int(base[b])} - {int(expected_lens[b])} = {int(starts[b])}"
        out.append(_wrong(trace, b, f"plan.{windows.offsets}[{b}]", evidence, CAUSE_OFFSET, int(starts[b]), int(found[b])))


def _wrong(trace: Trace, b: int, field: str, evidence: str, cause: str, expected: int, found: int, column: int | None = None) -> Finding:
    return finding(KIND, "window-kv", step=trace.source.step, request=b, column=column, field=field, evidence=evidence, cause=cause, expected=expected, found=found)


def _check_indices(trace: Trace, windows: WindowList, indptr: Tensor, indices: Tensor, starts: Tensor, base: Tensor, out: list[Finding]) -> None:
    batch = trace.batch
    for b in range(batch.batch_size):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        row = batch.request_slots(b)[int(starts[b]) : int(base[b])]
        found = indices[lo:hi]
        j = _first(found != row)
        if j < 0:
            continue
        column = int(starts[b]) + j
        evidence = f"plan.{windows.indices}[{lo + j}] = {int(found[j])} (request {b}, window column {column}), expected its row's slot {int(row[j])}"
        out.append(_wrong(trace, b, f"plan.{windows.indices}[{lo + j}]", evidence, CAUSE_INDICES, int(row[j]), int(found[j]), column))
        return
