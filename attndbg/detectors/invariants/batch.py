"""invariants on the batch's own bookkeeping: the engine's recorded `positions` and raw `seq_lens`
(and a plan's `seq_lens_sum` scalar) against the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import DRAFT_EXTEND_QUERIES, KIND, _first, _request_of
from attndbg.trace import tree
from attndbg.trace.engines import draft_decode, engine_conventions
from attndbg.trace.schema import ForwardMode, Trace


def expected_positions(trace: Trace) -> Tensor:
    """[T] the rope position of every query token: its column, or prefix + depth for a draft token."""
    batch = trace.batch
    if not trace.is_tree_verify:
        return batch.query_cols.clone()
    depth = torch.cat([tree.depths(p) for p in trace.spec.parents]) if batch.batch_size else torch.zeros(0, dtype=torch.int64)
    return torch.repeat_interleave(batch.prefix_lens, batch.extend_lens) + depth


def _check_positions(trace: Trace, out: list[Finding]) -> None:
    batch = trace.batch
    if batch.cross:
        return  # a cross-attention query's rope position is the decoder's own, no column of the encoder's row
    expected = expected_positions(trace)
    found = batch.positions
    t = _first(found != expected)
    if t < 0:
        return
    qo = batch.qo_indptr
    b = _request_of(qo, t)
    i = t - int(qo[b])
    rows = slice(int(qo[b]), int(qo[b + 1]))
    diff = (found[rows] - expected[rows]).unique()
    prefix = int(batch.prefix_lens[b])
    if trace.is_tree_verify:
        rule = f"prefix + depth = {prefix} + {int(expected[t]) - prefix}"
        by_index = prefix + torch.arange(rows.stop - rows.start)
        if torch.equal(found[rows], by_index):
            cause = "the engine computed draft positions as prefix + token index; a draft token sits at prefix + its tree depth (EAGLE's spec_info.positions)"
        else:
            cause = None
    else:
        rule = "kv_len - 1" if batch.forward_mode is ForwardMode.DECODE else ("its KV column" if batch.selective else f"prefix + {i}")
        cause = None
    if cause is None:
        if diff.numel() == 1 and int(diff) == -1:
            cause = "the positions are one step stale: computed before this step's seq_lens update"
        elif diff.numel() == 1 and int(diff) == 1:
            cause = "the positions are one ahead: computed from seq_lens that already count the current token (position = seq_len - 1)"
        elif diff.numel() == 1:
            cause = f"the positions are off by {int(diff)}: computed from another request's or another step's lengths"
        else:
            cause = "the engine's positions were not computed from this batch's lengths (a stale buffer or rows out of order)"
    count = int((found != expected).sum())
    out.append(
        finding(
            KIND,
            "positions",
            step=trace.source.step,
            request=b,
            row=t,
            field=f"batch.positions[{t}]",
            evidence=f"batch.positions[{t}] = {int(found[t])} (request {b}, token {i}), expected {int(expected[t])} ({rule}); {count} of {found.numel()} positions differ",
            cause=cause,
            expected=int(expected[t]),
            found=int(found[t]),
            differing=count,
        )
    )


def expected_seq_lens(trace: Trace) -> Tensor:
    """The raw seq_lens a correct engine records: kv_len, except a verify step's of an engine whose
    verify seq_lens exclude the drafts (SGLang's): the prefix; and a draft decode step's, whose
    seq_lens are the requests' committed prefixes (one per branch row): kv_len less the step's
    draft tokens (the multi-step backend adds them to each branch)."""
    batch = trace.batch
    if trace.is_tree_verify and not engine_conventions(trace).verify_seq_lens.includes_drafts:
        return batch.prefix_lens.clone()
    draft = draft_decode(trace)
    if draft is not None:
        return batch.kv_lens - (draft[1] + 1)
    return batch.kv_lens.clone()


def _check_seq_lens(trace: Trace, out: list[Finding]) -> None:
    batch = trace.batch
    expected = expected_seq_lens(trace)
    found = batch.seq_lens_raw
    b = _first(found != expected)
    if b >= 0:
        kv, prefix = int(batch.kv_lens[b]), int(batch.prefix_lens[b])
        verify = engine_conventions(trace).verify_seq_lens
        draft = draft_decode(trace)
        if trace.is_tree_verify:
            rule = verify.rule
        elif draft is not None:
            rule = f"draft decode step {draft[1]}: the committed prefix, without the branch's {draft[1] + 1} draft tokens"
        else:
            rule = f"{batch.forward_mode.value}: prefix + extend = {kv}"
        # A verify step's seq_lens that follow the other convention: the prefix where the drafts
        # belong, or the whole row where they do not (a verify step is never a decode).
        if trace.is_tree_verify and int(found[b]) == (prefix if verify.includes_drafts else kv):
            cause = verify.mixup_cause
        elif batch.forward_mode is ForwardMode.DECODE and int(found[b]) == kv - 1:
            cause = "seq_lens were taken before the decode step's seq_lens += 1 (the current token is missing)"
        elif batch.forward_mode is ForwardMode.DRAFT_EXTEND and prefix <= int(found[b]) != kv:
            cause = f"seq_lens count {int(found[b]) - prefix} new tokens past the prefix where the step runs {kv - prefix}: {DRAFT_EXTEND_QUERIES}"
        else:
            cause = "the engine's seq_lens buffer holds another step's or another request's lengths"
        out.append(
            finding(
                KIND,
                "seq-lens",
                step=trace.source.step,
                request=b,
                field=f"batch.seq_lens_raw[{b}]",
                evidence=f"batch.seq_lens_raw[{b}] = {int(found[b])}, expected {int(expected[b])} ({rule})",
                cause=cause,
                expected=int(expected[b]),
                found=int(found[b]),
            )
        )
    _check_sums(trace, expected, out)


def _check_sums(trace: Trace, expected: Tensor, out: list[Finding]) -> None:
    """The engine's host sums (plan scalars, as the backend received them) against sum(seq_lens):
    `seq_lens_sum` (with graph padding, + pad x fill_value; the raw sum alone under padding is
    fill-value's finding) and a verify step's `spec_seq_lens_sum` (EagleVerifyInput's own, over
    the real requests: it sizes SGLang's FULL tree mask)."""
    batch, plan = trace.batch, trace.plan
    if plan is None:
        return
    draft = draft_decode(trace)
    for name in ("seq_lens_sum", "spec_seq_lens_sum"):
        value = plan.scalars.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        # A draft decode's seq_lens_sum is over its requests, each of which has topk branch rows
        # (its graph section's padded rows too).
        per_request = draft[0] if draft else 1
        want = int(expected.sum()) // per_request
        accepted = {want}
        graph = trace.graph
        if name == "seq_lens_sum" and graph is not None and graph.is_graph_replay and graph.capture_bs > batch.batch_size:
            padded = want + (graph.capture_bs - batch.batch_size) // per_request * graph.fill_value
            accepted = {padded, want}  # `want` alone under padding is fill-value's finding
            want = padded
        if int(value) in accepted:
            continue
        bs = batch.batch_size
        if batch.forward_mode is ForwardMode.DECODE and int(value) == want - bs:
            cause = f"{name} was computed before the decode step's seq_lens += 1"
        elif trace.is_tree_verify and int(value) == want + bs * trace.spec.draft_token_num:
            cause = f"{name} counts the draft tokens, which SGLang's verify seq_lens exclude"
        else:
            cause = f"{name} was not updated with this batch's seq_lens (a stale host-side sum); buffers sized from it (kv_indices, the FULL tree mask) are too long or too short"
        out.append(
            finding(
                KIND,
                "seq-lens-sum",
                step=trace.source.step,
                field=f"plan.scalars.{name}",
                evidence=f"plan.scalars.{name} = {int(value)}, expected sum(seq_lens) = {want}",
                cause=cause,
                expected=want,
                found=int(value),
            )
        )
