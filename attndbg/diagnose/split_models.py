"""Mistakes of merging partial states: LSEs read in the wrong base, and empty splits merged from
whatever their scratch slots held (zeros, or a larger earlier split count's partials).

Split-KV decode follows SGLang's Triton rule (our kernels' too): request b's KV is cut into
num_kv_splits[b] splits of cdiv(cdiv(len, s), 32) * 32 tokens; stage 1 writes each non-empty
split's normalised partial and natural-log LSE into a scratch slot and writes nothing for an empty
one; stage 2 merges the non-empty slots by their LSEs. Each partial here is the reference's own
partial state over the split's columns (StepData.partial), so the only thing a model changes is
the merge's mistake.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from attndbg.backends.engine_names import merge_path
from attndbg.backends.triton import DEFAULT_MAX_KV_SPLITS
from attndbg.backends.triton_kernels.split_rule import split_length
from attndbg.numerics import LN2, LOG2E
from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, merge, spans
from attndbg.trace.schema import ForwardMode, Trace

# A larger earlier split count is searched up to this many splits (SGLang's graph buffers hold 8 by
# default, our split-count sweep forces 16) or twice the request's own count.
STALE_MAX_SPLITS = 16

_READINGS = {
    LOG2E: ("base-2 LSEs read as natural log", "log2 e"),
    LN2: ("natural-log LSEs read as base 2", "ln 2"),
}


def engine_splits(trace: Trace) -> tuple[list[int], list[int], str]:
    """Per request: KV length and num_kv_splits the engine's split kernel used, and the source."""
    plan, bs = trace.plan, trace.batch.batch_size
    if plan is not None and "num_kv_splits" in plan.tensors and "kv_indptr" in plan.tensors:
        lengths = plan.tensors["kv_indptr"].to(torch.int64).diff()[:bs].tolist()
        return lengths, plan.tensors["num_kv_splits"][:bs].tolist(), "the recorded plan's num_kv_splits"
    window = trace.model.sliding_window
    lengths = [min(int(n), window + 1) if window >= 0 else int(n) for n in trace.batch.kv_lens]
    return lengths, [DEFAULT_MAX_KV_SPLITS] * bs, f"no recorded split plan: SGLang's graph default of {DEFAULT_MAX_KV_SPLITS}"


def split_columns(trace: Trace, b: int, length: int, splits: int) -> list[tuple[int, int] | None]:
    """Request b's KV columns [start, end) of each of `splits` splits (None: empty). The split kernel
    reads the last `length` columns of the row (a sliding-window layer reads only its window)."""
    first = max(0, int(trace.batch.kv_lens[b]) - length)
    per_split = split_length(length, splits)
    return [
        (first + s * per_split, first + min((s + 1) * per_split, length)) if per_split and s * per_split < length else None
        for s in range(splits)
    ]


def _splits(indices: list[int]) -> str:
    return f"split{'s' if len(indices) > 1 else ''} {spans(indices)}"


class _Splits:
    """The engine's splits of the requests asked about, with their partial states."""

    def __init__(self, states: PartialStates, requests: list[int]):
        self.trace = states.trace
        self.lengths, self.counts, self.source = engine_splits(self.trace)
        self.states = states
        self.requests = [b for b in requests if b < len(self.counts) and int(self.counts[b]) > 0]

    def columns(self, b: int, splits: int | None = None) -> list[tuple[int, int] | None]:
        return split_columns(self.trace, b, int(self.lengths[b]), int(self.counts[b]) if splits is None else splits)

    def partly_empty(self) -> Iterator[tuple[int, list[tuple[int, int] | None], list[int]]]:
        """(b, its splits' columns, its empty splits) for the requests with empty and non-empty splits."""
        for b in self.requests:
            slots = self.columns(b)
            empty = [s for s, c in enumerate(slots) if c is None]
            if empty and len(empty) < len(slots):
                yield b, slots, empty

    def stack(self, b: int, slots: list[tuple[int, int] | None]) -> tuple[Tensor, Tensor]:
        """The states of `slots` ([start, end) partials; None: a slot holding zeros with LSE 0) as
        [K, e, Hq, Dv] outputs and [K, e, Hq] LSEs."""
        got = self.states.of((b, *cols) for cols in slots if cols is not None)
        rows = self.states.rows(b)
        e, hq, dv = rows.stop - rows.start, self.trace.model.num_qo_heads, self.trace.model.v_head_dim
        zero = (torch.zeros(e, hq, dv, dtype=torch.float64), torch.zeros(e, hq, dtype=torch.float64))
        picked = [got[(b, *cols)] if cols is not None else zero for cols in slots]
        return torch.stack([o for o, _ in picked]), torch.stack([lse for _, lse in picked])


class _SplitDecodeModel(MistakeModel):
    """Precondition of every split-KV decode mistake: a decode step whose path merges KV splits."""

    def applies(self, trace: Trace) -> bool:
        return trace.batch.forward_mode is ForwardMode.DECODE and merge_path(trace) is not None


class _ShownBySplitPlan(_SplitDecodeModel):
    """A split mistake whose precondition (empty splits, a count past the scratch) the recorded split
    plan shows; without one, the split counts are SGLang's default, an assumption, not evidence."""

    def shown_by_metadata(self, trace: Trace) -> bool:
        return self.applies(trace) and trace.plan is not None and "num_kv_splits" in trace.plan.tensors


class SplitLseBase(_SplitDecodeModel):
    """Split-KV decode whose merge weighed every split by its LSE in the wrong base."""

    name = "split-lse-base"
    cause = (
        "The merge of the KV splits weighed each split by its LSE in the wrong base (FlashInfer writes "
        "base-2 LSEs, Triton and FA3 natural log: FlashInfer #2113, SGLang #40903), mis-weighting the splits."
    )

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        splits = _Splits(states, requests)
        for b in splits.requests:
            used = [c for c in splits.columns(b) if c is not None]
            if len(used) < 2:
                continue  # one split is its own merge: no weight to get wrong
            outputs, lses = splits.stack(b, used)
            for factor, (reading, ratio) in _READINGS.items():
                yield Candidate(
                    request=b,
                    output=merge(outputs, lses * factor),
                    summary=f"a split-KV merge that weighed the splits by {reading} (each LSE x {ratio})",
                    detail=f"request {b}, {len(used)} splits of kv {splits.lengths[b]}",
                    params={"factor": factor, "splits": len(used), "num_kv_splits": int(splits.counts[b])},
                )


class EmptySplitsZeros(_ShownBySplitPlan):
    """Split-KV decode whose merge did not skip the splits past the request's KV, and whose scratch
    slots for them held zeros (a zeroed or freshly allocated buffer): output 0, LSE 0."""

    name = "empty-splits-zeros"
    cause = (
        "The merge did not skip the splits past the request's KV (stage 1 writes nothing for them), and their "
        "scratch slots held zeros, merged as partial states of output 0 and LSE 0 (FlashInfer #4051's empty states)."
    )

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        splits = _Splits(states, requests)
        for b, slots, empty in splits.partly_empty():
            yield Candidate(
                request=b,
                output=merge(*splits.stack(b, slots)),
                summary="a split-KV merge that read its empty splits' uninitialised partials as zeros with LSE 0",
                detail=f"request {b}, {_splits(empty)} of {len(slots)}, kv {splits.lengths[b]}",
                params={"empty_splits": empty, "num_kv_splits": len(slots)},
            )


class EmptySplitsStale(_ShownBySplitPlan):
    """Split-KV decode whose merge did not skip the splits past the request's KV, and whose scratch
    slots for them still held the partials a launch with a larger split count wrote over the same
    KV (slots that launch left empty too hold zeros, LSE 0)."""

    name = "empty-splits-stale"
    cause = (
        "The merge did not skip the splits past the request's KV, and their scratch slots still held the partial "
        "states of an earlier launch with more splits (scratch shared across launches, as SGLang's CUDA-graph "
        "buffers are), so keys were counted twice."
    )

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        splits = _Splits(states, requests)
        for b, now, empty in splits.partly_empty():
            # Earlier split counts that leave the same stale slots are one candidate, named by their range.
            earlier: dict[tuple, list[int]] = {}
            for count in range(len(now) + 1, max(STALE_MAX_SPLITS, 2 * len(now)) + 1):
                old = splits.columns(b, count)
                slots = tuple(now[s] if now[s] is not None else old[s] for s in range(len(now)))
                if any(old[s] is not None for s in empty):
                    earlier.setdefault(slots, []).append(count)
            for slots, counts in earlier.items():
                stale = [s for s in empty if slots[s] is not None]
                yield Candidate(
                    request=b,
                    output=merge(*splits.stack(b, list(slots))),
                    summary="a split-KV merge that read its empty splits' stale partials, left by an earlier launch with more splits over the same KV",
                    detail=f"request {b}, {_splits(stale)} of {len(now)} holding a {spans(counts)}-split launch's, kv {splits.lengths[b]}",
                    params={"stale_splits": stale, "num_kv_splits": len(now), "earlier_num_kv_splits": counts},
                )


# Which partials of a prefix + new-token merge a base confusion rescales (0: prefix, 1: new tokens).
MERGE_PARTS: dict[str, tuple[int, ...]] = {"both": (0, 1), "prefix": (0,), "new-token": (1,)}


def merged_lses(part: str) -> str:
    """"both partials' LSEs", "the prefix partial's LSE": the LSEs a `part` confusion rescales."""
    return "both partials' LSEs" if part == "both" else f"the {part} partial's LSE"


class PrefixMergeLseBase(MistakeModel):
    """A step that merges each request's prefix partial with its new tokens' partial (FlashInfer's
    cascade, FA3's two-call verify, vLLM's cascade, DeepSeek's chunked prefix) with LSEs in the
    wrong base: both (SGLang #40903: both partials from FlashInfer's or trtllm-gen's base-2 kernels,
    merged by the natural-log merge_state_v2), or one (the two partials from kernels of different
    conventions: #40903's table lists base-2 FlashInfer and trtllm-gen beside base-e FA4).

    Tried on every extend, mixed or verify step with a cached prefix, whatever merge_path says: the
    recording backend may run such a merge where we do not know its path by name."""

    name = "prefix-merge-lse-base"
    cause = (
        "The partials' LSEs entered the merge of the prefix and new-token partials in the wrong base (FlashInfer "
        "writes base-2 LSEs, merge code expected natural log: FlashInfer #2113, SGLang #40903), mis-weighting the two parts."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        if batch.forward_mode is ForwardMode.DECODE or batch.selective:
            return False
        return bool(((batch.prefix_lens > 0) & (batch.extend_lens > 0)).any())

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        batch = states.trace.batch
        for b in requests:
            prefix, kv = int(batch.prefix_lens[b]), int(batch.kv_lens[b])
            if prefix == 0 or int(batch.extend_lens[b]) == 0:
                continue
            got = states.of([(b, 0, prefix), (b, prefix, kv)])
            outputs = torch.stack([got[(b, 0, prefix)][0], got[(b, prefix, kv)][0]])
            lses = torch.stack([got[(b, 0, prefix)][1], got[(b, prefix, kv)][1]])
            for part, scaled in MERGE_PARTS.items():
                for factor, (reading, ratio) in _READINGS.items():
                    scale = torch.ones(2, 1, 1, dtype=torch.float64)
                    scale[list(scaled)] = factor
                    yield Candidate(
                        request=b,
                        output=merge(outputs, lses * scale),
                        summary=f"the merge of the prefix and new-token partials with {merged_lses(part)} x {ratio} ({reading if part == 'both' else reading.replace('LSEs', 'LSE')})",
                        detail=f"request {b}, prefix {prefix}, {kv - prefix} new",
                        params={"part": part, "factor": factor},
                    )


class SplitsBeyondCapture(_ShownBySplitPlan):
    """Split-KV decode whose split count exceeded the splits the captured scratch holds
    (max_kv_splits): the split length was cut for num_kv_splits splits, but only the first
    max_kv_splits were launched and merged, so the keys of the rest were never seen."""

    name = "splits-beyond-capture"
    cause = (
        "The request's num_kv_splits exceeded the max_kv_splits its stage-1 scratch and grid were sized for at "
        "capture, so only the first max_kv_splits splits ran and were merged and the keys past them were dropped."
    )

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        top = _captured_splits(states.trace)
        if top is None:
            return
        splits = _Splits(states, requests)
        for b in splits.requests:
            slots = splits.columns(b)
            ran = [c for c in slots[:top] if c is not None]
            if len(slots) <= top or not ran or len(ran) == len([c for c in slots if c is not None]):
                continue
            yield Candidate(
                request=b,
                output=merge(*splits.stack(b, ran)),
                summary=f"a split-KV decode that ran and merged only the first {top} of its splits (max_kv_splits at capture)",
                detail=f"request {b}, {len(slots)} splits of kv {splits.lengths[b]}, keys from column {ran[-1][1]} dropped",
                params={"max_kv_splits": top, "num_kv_splits": len(slots), "kept_columns": ran[-1][1]},
            )


def _captured_splits(trace: Trace) -> int | None:
    """max_kv_splits the step's scratch was sized for: the recorded plan's, or the capture's (Trace.capture)."""
    value = trace.plan.scalars.get("max_kv_splits") if trace.plan is not None else None
    if value is None and trace.capture is not None:
        value = trace.capture.max_kv_splits
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class SplitCountMismatch(_SplitDecodeModel):
    """Split-KV decode whose two stages used different split counts: stage 1 cut the request's KV
    into the plan's num_kv_splits splits and wrote each one's partial, stage 2 computed the splits
    from another count (a stale or another layer's num_kv_splits buffer) and merged only the slots
    that count makes non-empty: fewer than stage 1 wrote, so the keys of the splits past them were
    never merged. (A count that merges more slots than stage 1 wrote reads empty scratch:
    empty-splits-zeros / -stale; the captured maximum is splits-beyond-capture's.)"""

    name = "split-count-mismatch"
    cause = (
        "The merge (stage 2) used another num_kv_splits than stage 1 (a split-count buffer left from another "
        "batch or layer), so it merged only the first of the splits stage 1 wrote and the keys of the rest were lost."
    )

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        splits = _Splits(states, requests)
        captured = _captured_splits(states.trace)
        for b in splits.requests:
            wrote = [c for c in splits.columns(b) if c is not None]
            # Stage 2 merges slot s of a count's split geometry when that count makes it non-empty.
            merged_by: dict[int, list[int]] = {}  # slots merged -> the counts that merge that many
            for count in range(1, max(STALE_MAX_SPLITS, int(splits.counts[b])) + 1):
                merged = min(sum(1 for c in splits.columns(b, count) if c is not None), count)
                if merged < len(wrote) and merged != captured:
                    merged_by.setdefault(merged, []).append(count)
            for merged, counts in merged_by.items():
                kept = wrote[:merged]
                yield Candidate(
                    request=b,
                    output=merge(*splits.stack(b, kept)),
                    summary="a split-KV decode whose merge used another split count than stage 1, merging only the first of the splits stage 1 wrote",
                    detail=f"request {b}, {merged} of {len(wrote)} splits merged (stage 2 count {spans(counts)}, stage 1 {int(splits.counts[b])}), kv {splits.lengths[b]}",
                    params={"num_kv_splits": int(splits.counts[b]), "merged_splits": merged, "stage2_num_kv_splits": counts, "kept_columns": kept[-1][1]},
                )
