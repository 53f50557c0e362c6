"""tree-mask on the mask a verify step's recorded plan hands its kernel, as the plan reading found
it (attndbg/plans/visibility.py): its structural problems worded as findings (mask-indptr,
mask-length, window-offset, plan-mask-missing), then the visibility the plan gives each draft row
against the draft tree's (window-ignored, window-offset, window-cascade, plan-mask-missing,
mask-prefix-hidden, mask-mismatch), one finding per check at its first (request, row, column).
"""

from __future__ import annotations

import torch

from attndbg.backends.plan_layout import PlanLayout
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.tree_mask.base import KIND
from attndbg.detectors.tree_mask.blocks import describe_column, mismatch_cause, prefix_hidden_cause, tree_block
from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.plans.reading import PlanReading
from attndbg.plans.visibility import PlanVisibility, index_window
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility


def recorded_plan_findings(reading: PlanReading) -> list[Finding]:
    """The mask problems of the step's recorded plan, then its visibility against the truth."""
    trace = reading.trace
    out = [_worded(trace, reading.layout, problem) for problem in reading.mask_problems]
    view = reading.visibility
    if view is not None:
        _compare_plan(reading, view, out)
    return out


def _worded(trace: Trace, layout: PlanLayout | None, problem: PlanProblem) -> Finding:
    step = trace.source.step
    kind, detail = problem.kind, problem.detail
    if kind is ProblemKind.MASK_OFFSETS_MISSING:
        present, missing = detail["present"], problem.field
        cause = (
            "the kernel cannot find each request's block: mask_indptr was not passed with the mask"
            if present == "custom_mask"
            else "the kernel cannot find each request's packed block: the mask and its byte offsets were not recorded together"
        )
        return finding(KIND, "mask-indptr", step=step, field=f"plan.{missing}", evidence=f"the plan carries {present} but no {missing}", cause=cause)
    if kind is ProblemKind.MASK_BLOCK_SIZE:
        return _block_size(trace, problem)
    if kind is ProblemKind.PACKED_BLOCK_BYTES:
        b, name = problem.request, problem.field
        return finding(
            KIND,
            "mask-indptr",
            step=step,
            request=b,
            field=f"plan.{name}[{problem.index}]",
            evidence=f"plan.{name} gives request {b} {problem.found} byte(s) of packed mask, but its block of {detail['rows']} x {detail['columns']} = {detail['bits']} elements packs to {problem.expected}",
            cause="the mask was packed for other lengths than the KV the plan lists (FlashInfer packs each q_len x kv_len block into whole bytes at these offsets)",
            expected=problem.expected,
            found=problem.found,
        )
    if kind is ProblemKind.MASK_LENGTH:
        return _mask_length(trace, problem)
    if kind is ProblemKind.WINDOW_OFFSET:
        b, start, offset, present = problem.request, problem.expected, problem.found, detail["present"]
        field = f"plan.{problem.field}[{b}]" if present else f"plan.{problem.field}"
        return finding(
            KIND,
            "window-offset",
            step=step,
            request=b,
            field=field,
            evidence=(
                f"plan.{detail['listed']} hold request {b}'s prefix from column {start} (the sliding window's), but "
                + (f"plan.{problem.field}[{b}] = {offset}" if present else f"the plan has no {problem.field}")
                + f": the kernel reads the mask {abs(start - offset)} column(s) off"
            ),
            cause="the mask is indexed as if the plan held the whole prefix: the sliding window's KV offset (SGLang's window_kv_offsets) is missing or wrong",
            expected=start,
            found=offset,
        )
    if kind is ProblemKind.EXPAND_MISSING:
        table = problem.field
        return finding(
            KIND,
            "plan-mask-missing",
            step=step,
            field=f"plan.{table}",
            evidence=f"a two-call verify plan without {table} / {detail['lengths']}",
            cause="the second (draft-block) call of the two-call verify was not planned",
        )
    if kind is ProblemKind.EXPAND_ROWS:
        table = problem.field
        return finding(
            KIND,
            "mask-length",
            step=step,
            field=f"plan.{table}",
            evidence=f"plan.{table} has {detail['rows']} rows and {detail['lengths']} {detail['entries']}, expected one per draft token = {problem.expected}",
            cause="the draft-block call was planned for another batch or draft_token_num",
        )
    raise ValueError(f"not a mask problem: {kind}")


def _block_size(trace: Trace, problem: PlanProblem) -> Finding:
    b, found, expected = problem.request, problem.found, problem.expected
    n, prefix, width = problem.detail["n"], problem.detail["prefix"], problem.detail["width"]
    if found == n * n:
        cause = "mask_indptr counts only the n x n draft block (QLEN_ONLY sizes) while the mask is in the FULL layout"
    elif found == n * prefix:
        cause = "mask_indptr leaves out the draft columns: it was computed from seq_lens without draft_token_num"
    elif found == n * (prefix + 2 * n):
        cause = "mask_indptr counts the draft tokens twice (seq_lens that already included them, plus n)"
    else:
        cause = "mask_indptr is not cumsum(n * (prefix + n)): computed from another batch's lengths"
    return finding(
        KIND,
        "mask-indptr",
        step=trace.source.step,
        request=b,
        field=f"plan.mask_indptr[{b + 1}]",
        evidence=f"plan.mask_indptr gives request {b} a block of {found} elements (mask_indptr[{b + 1}] - mask_indptr[{b}]), expected "
        + (f"n·(prefix+n) = {n}·({prefix}+{n})" if width == prefix + n else f"n·(KV the plan covers) = {n}·{width}")
        + f" = {expected}",
        cause=cause,
        expected=expected,
        found=found,
    )


def _mask_length(trace: Trace, problem: PlanProblem) -> Finding:
    length, end, detail = problem.found, problem.expected, problem.detail
    stale, computed, short = detail["stale"], detail.get("computed", False), length < end
    name = f"plan.{problem.field}"
    unit = "byte(s)" if detail.get("packed") else "element(s)"
    if detail.get("packed"):
        evidence = f"{name} holds {length} bytes but {PACKED_OFFSETS_WORDS} end at {end} (short by {end - length})"
    else:
        evidence = f"{name} has {length} elements but mask_indptr[-1] = {end} ({'short' if short else 'long'} by {abs(end - length)})"
    if short and "request" in detail:
        b = detail["request"]
        block = f"{detail['rows']} x {detail['columns']}" + (" bits" if detail.get("packed") else "")
        evidence += (
            f"; request {b}'s {block} block is read at {name}[{detail['start']}:{detail['stop']}], so the kernel reads {detail['stop'] - length} {unit} past the end, "
            f"from {name}[{length}] (the block's element {detail['element']}: row {detail['row']}, column {detail['column']})"
        )
    elif not short:
        evidence += f"; {name}[{end}:] " + (f"holds {stale} False element(s)" if stale else "is all True")
    if computed:
        # What was compared: the mask's size with the blocks the kernel reads (the lengths alone).
        evidence += "; compared: the mask's size with the q_len x kv_len blocks the kernel reads at the offsets plan() computes from qo_indptr and the KV the plan lists (a mask that does not fit them is not compared with the draft tree)"
    if short:
        cause = "the mask was built for fewer KV columns than the plan's requests have; the kernel reads past the buffer (FlashInfer #3176: plan() packed it unchecked, no error, a wrong output or an illegal memory access)"
    elif computed:
        cause = "the mask was laid out for other lengths than the plan's requests have: the library reads each request's block at offsets of its own (cumsum(q_len x kv_len)), so its rows are read where they were not written (FlashInfer #3176; plan() checks the length since #3503)"
    elif stale:
        cause = "a stale tail: the engine sized the mask for this step but it holds an earlier, larger step's tree rows past its offsets (a reused buffer, not refilled)"
    else:
        cause = "the mask buffer is longer than its offsets: sized from other lengths (a wrong seq_lens_sum) than the ones mask_indptr was built from"
    return finding(KIND, "mask-length", step=trace.source.step, request=problem.request, field=f"{name}[{problem.index}]", evidence=evidence, cause=cause, expected=end, found=length)


# How a packed mask's blocks are placed: FlashInfer's plan() packs each on whole bytes.
PACKED_OFFSETS_WORDS = "the requests' packed blocks (each q_len x kv_len bits on whole bytes, as plan() lays them out)"


# -- the plan's visibility against the draft tree's ---------------------------------------------------


def _compare_plan(reading: PlanReading, view: PlanVisibility, out: list[Finding]) -> None:
    """One finding per check id at its first (request, row, column), against the true visibility."""
    trace, layout = reading.trace, reading.layout
    assert layout is not None  # a visibility is read only by a layout
    batch = trace.batch
    first: dict[str, tuple] = {}
    counts: dict[str, int] = {}
    for b, seen in sorted(view.blocks.items()):
        truth = visibility(trace, b)
        unwindowed = tree_block(trace, b)
        # Columns before the plan's KV start are outside every row's window (the coverage rule),
        # so a difference is always in what the plan's kernel will do with what it reads.
        for r, c in torch.nonzero(seen != truth).tolist():
            found = bool(seen[r, c])
            check = _classify(reading, view, b, r, c, found, bool(unwindowed[r, c]))
            counts[check] = counts.get(check, 0) + 1
            first.setdefault(check, (b, r, c, found))
    for check, (b, r, c, found) in first.items():
        prefix = int(batch.prefix_lens[b])
        row = int(batch.qo_indptr[b]) + r
        field = _plan_field(reading, view, b, r, c)
        if check == "window-offset":
            field = "plan.scalars." + layout.window
        if check == "window-cascade":
            window = trace.model.sliding_window
            cause = (
                f"a sliding-window layer (window {window}) ran the full layers' two-call cascade: its prefix call gives all {trace.spec.draft_token_num} "
                "draft rows one window, aligned to the prefix's last keys, not at each draft token's own position (prefix + depth); "
                "FA3 takes one window per call, so these layers need their own per-draft-token tables (SGLang's swa_spec_metadata, sglang#9658)"
            )
        elif check == "window-ignored":
            cause = "the kernel's window is off (window_left = -1), so the mask must fold the sliding window in by position, and it was built without it"
        elif check == "window-offset":
            cause = "the kernel applies the sliding window by KV index (query i at column prefix + i), but draft token i sits at prefix + its depth: fold the window into the mask by position and turn the kernel's window off"
        elif check == "plan-mask-missing":
            cause = "the plan runs the verify step as causal attention by token index with no tree mask, but the draft tree is not a chain"
        elif check == "mask-prefix-hidden":
            cause = prefix_hidden_cause("the plan's FULL mask hides prefix columns that the kernel reads")
        else:
            found_draft = view.blocks[b][:, prefix:] if view.kind != "causal" else None
            cause = mismatch_cause(trace, b, r, c, found, found_draft)
        out.append(
            finding(
                KIND,
                check,
                step=trace.source.step,
                request=b,
                row=row,
                column=c,
                field=field,
                evidence=(
                    f"with the recorded {trace.plan.backend} plan, draft row {r} of request {b} (step row {row}) {'sees' if found else 'cannot see'} "
                    f"{describe_column(trace, b, c)}; it should {'not ' if found else ''}see it ({field}); {counts[check]} such (row, column) pair(s)"
                ),
                cause=cause,
                expected=not found,
                found=found,
                pairs=counts[check],
            )
        )


def _classify(reading: PlanReading, view: PlanVisibility, b: int, r: int, c: int, found: bool, tree_allows: bool) -> str:
    trace = reading.trace
    prefix = int(trace.batch.prefix_lens[b])
    window = trace.model.sliding_window
    kernel_window = reading.scalars["window"].value
    if view.kind == "expand" and c < prefix and window >= 0 and kernel_window >= 0:
        return "window-cascade"  # the prefix call's one window, aligned by index for every draft row
    if view.kind == "window" and (kernel_window >= 0 or not (found and c < prefix and tree_allows)):
        return "mask-mismatch"  # each row's own causal window is right by construction: its table is not
    if found and c < prefix and tree_allows and window >= 0:
        return "window-ignored"
    if not found and view.kind != "expand" and window >= 0:
        n = trace.spec.draft_token_num
        if not bool(index_window(prefix, n, prefix + n, reading.scalars["window"].value)[r, c]):
            return "window-offset"
    if view.kind == "causal":
        return "plan-mask-missing"
    if view.kind == "mask" and not found and c < prefix:
        return "mask-prefix-hidden"
    return "mask-mismatch"


def _plan_field(reading: PlanReading, view: PlanVisibility, b: int, r: int, c: int) -> str:
    trace, layout = reading.trace, reading.layout
    plan = trace.plan
    n = trace.spec.draft_token_num
    if view.kind == "mask" and "custom_mask" not in plan.tensors and layout.packed_mask is not None:
        # Packed: the byte of the request's block holding (r, c), and its bit (little-endian).
        coverage = reading.coverage
        start = coverage[b][0] if coverage is not None and coverage[b] is not None else 0
        width = trace.batch.prefix_lens[b] + n - start
        element = r * int(width) + c - start
        byte = int(plan.tensors[layout.packed_mask.indptr][b]) + element // 8
        return f"plan.{layout.packed_mask.tensor}[{byte}] bit {element % 8}"
    if view.kind == "mask":
        geometry = MaskGeometry.from_indptr(plan.tensors["mask_indptr"], rows=n, prefix_lens=trace.batch.prefix_lens)
        return f"plan.custom_mask[{geometry.element(b, r, c)}]"
    if view.kind == "expand" and layout.expand is not None and c < trace.batch.prefix_lens[b]:
        return f"plan.{layout.ids}[{b}]"  # the prefix call's row of the request
    if view.kind in ("expand", "window") and layout.expand is not None:
        return f"plan.{layout.expand.table}[{b * n + r}]"
    return "plan.scalars.causal" if "causal" in plan.scalars else "plan.custom_mask"
