"""invariants on a plan's sliding-window list (`PlanLayout.window_list`: SGLang's `window_kv_indptr`
/ `window_kv_indices` / `window_kv_offsets`, which its Triton backend builds for SWA layers in
`update_sliding_window_buffer`), which those layers' kernels read instead of the plan's own ids.

The rule, per real request with window W (`sliding_window_size`, a radius: a query at position p
sees keys [p - W, p], W + 1 of them, as FlashInfer's window_left, FA3's (W, 0) and the reference):

    decode (the list holds the query's own key):   n = min(kv_len, W + 1)
    extend, mixed, verify (the list is the prefix; the new tokens' keys come from the extend part):
                                                   n = min(prefix, W)
    window_kv_indptr[b+1] - window_kv_indptr[b] = n
    window_kv_indices of b = its req_to_token row, columns [L - n, L)   (L: kv_len or prefix)
    window_kv_offsets[b]  = L - n      (the first window column: where its mask rows start)

SGLang's Triton backend (through 0.5.23 at least) caps the decode list at min(kv_len, W): one key
short, so every decode step past the window drops the oldest in-window key (the decode kernel
applies no mask of its own); sglang PR #32087 describes it. That list is named as such, and its
indices and offsets are then judged by the length the engine used, so a wrong gather still shows.

Checked as `window-kv`, one finding at the first wrong element. A verify step's offsets index its
tree mask, so they are tree-mask's (window-offset); padded requests of a graph replay are
fill-value's. W is the layer's window (`model.sliding_window`) or, for a full-attention layer of a
hybrid model, the backend's (`plan.scalars.sliding_window`).

`window-off`: a sliding-window layer's plan whose kernel applies no window (the layout's window
scalar recorded as -1: FlashInfer's plan-time window_left, which compiles the per-element window in
or out, sglang#31501) while a real request's listed keys reach further back than its last query's
window: that query attends keys outside it. Judged for the modes whose engine passes the window
to the kernel (extend, mixed, decode); a verify's tree mask and a draft extend's causal block carry
the window themselves, and a layout with its own window list (SGLang's Triton) reads that list.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.plan_layout import PlanLayout, WindowList
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.plans.reading import PlanReading
from attndbg.plans.scalars import ScalarSource
from attndbg.trace.schema import ForwardMode, Trace

CAUSE_LENGTH = "the window list was built from other lengths than the batch's (seq_lens where the prefix is meant, or a stale length)"
CAUSE_INDICES = "the window list was gathered from the wrong columns of the request's row (a wrong window_kv_start_idx) or from another row"
CAUSE_OFFSET = "window_kv_offsets is not the window's first column (seq_len - window_len): the kernel reads the request's mask rows shifted"
CAUSE_ONE_SHORT = (
    "the decode window list holds sliding_window_size keys, but the window is sliding_window_size + 1 wide (the "
    "query's own key and the W before it, as FlashInfer and FA3 keep): the oldest in-window key is dropped on every "
    "decode step past the window (SGLang's Triton update_sliding_window_buffer caps decode at min(seq_len, W); "
    "sglang PR #32087)"
)


def _window(trace: Trace) -> int | None:
    if trace.model.sliding_window >= 0:
        return trace.model.sliding_window
    value = trace.plan.scalars.get("sliding_window")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


WINDOWED_BY_KERNEL = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE)


def check_kernel_window(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    """window-off (see the module docstring): the first real request one of whose queries the
    plan lets attend keys outside the layer's window."""
    window, layout = trace.model.sliding_window, reading.layout
    if window < 0 or layout is None or layout.window_list is not None or trace.batch.forward_mode not in WINDOWED_BY_KERNEL:
        return
    kernel = reading.scalars.get("window")
    coverage = reading.coverage
    if kernel is None or kernel.source is not ScalarSource.RECORDED or kernel.value >= 0 or coverage is None:
        return
    for b, span in enumerate(coverage):
        if span is None:
            continue
        last = int(trace.batch.kv_lens[b]) - 1  # the request's last query's position
        start = span[0]
        if start < last - window:
            out.append(
                finding(
                    KIND,
                    "window-off",
                    step=trace.source.step,
                    request=b,
                    field=f"plan.scalars.{kernel.name}",
                    evidence=f"plan.scalars.{kernel.name} = {kernel.value} on a layer with sliding window {window}, and request {b}'s "
                    f"listed keys start at column {start}: its query at position {last} attends {last - window - start} keys before "
                    f"its window [{last - window}, {last}]",
                    cause="the kernel was planned without the layer's window (FlashInfer compiles the per-element window in or out "
                    "at plan(); a window_left given at forward then only skips whole KV tiles, sglang#31501), and the list it was "
                    "given reaches past the window of the request's later queries: they attend keys outside their window",
                    expected=window,
                    found=kernel.value,
                )
            )
            return


def check_window_list(trace: Trace, layout: PlanLayout | None, out: list[Finding]) -> None:
    """`layout`: the recorded plan's (the step's plan reading's)."""
    plan = trace.plan
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
    decode = batch.forward_mode is ForwardMode.DECODE
    base = batch.kv_lens if decode else batch.prefix_lens
    # Decode lists hold the query's own key too: W + 1 of them; a prefix list, W (see the docstring).
    expected_lens = torch.clamp(base, max=window + 1 if decode else window)
    found_lens = indptr.diff()[:bs]
    b = _first(found_lens != expected_lens)
    if b >= 0 and decode and bool((found_lens == torch.clamp(base, max=window)).all()):
        evidence = (
            f"plan.{windows.indptr} gives request {b} {int(found_lens[b])} window entries for kv_len {int(base[b])}: "
            f"min(kv_len, window {window}) where a window of radius {window} holds min(kv_len, {window + 1}) = {int(expected_lens[b])}"
        )
        out.append(_wrong(trace, b, f"plan.{windows.indptr}[{b + 1}]", evidence, CAUSE_ONE_SHORT, int(expected_lens[b]), int(found_lens[b])))
        expected_lens = found_lens  # judge the gather by the engine's own convention
    elif b >= 0:
        what = "kv_len" if decode else "prefix"
        bound = window + 1 if decode else window
        evidence = f"plan.{windows.indptr} gives request {b} {int(found_lens[b])} window entries, expected min({what} {int(base[b])}, {bound}) = {int(expected_lens[b])}"
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
