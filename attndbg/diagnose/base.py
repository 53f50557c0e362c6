"""What every mistake model shares: the contract, its candidate outputs, and the float64 partial
states and merge they are built from.

A mistake model is our own float64 math of one named engine mistake, computed from the step's own
data (StepData): the output the buggy engine would have produced. It never calls a kernel: a match
with the engine's output is then exact up to the engine's rounding, and the model names the
mechanism, not a symptom.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from attndbg import numerics
from attndbg.backends import reference
from attndbg.backends.plan_view import RequestKV
from attndbg.plans.reading import PlanReading, read
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import Trace


@dataclass(frozen=True)
class Candidate:
    """One request's rows as the engine would have produced them under one instance of a mistake."""

    request: int
    output: Tensor  # [extend_len, Hq, Dv] float64
    summary: str  # the mistake, the same for every request it hits: "a split-KV merge that read ..."
    detail: str  # this request's parameters in words: "splits 5-7 of 8"
    params: dict[str, Any] = field(default_factory=dict)  # the same, machine-readable (JSON)


class MistakeModel(abc.ABC):
    """One known mechanism. `applies` is its precondition on the step; `candidates` yields, for the
    requests asked about, every parameter choice of the mistake that changes their output."""

    name: ClassVar[str]  # stable id, e.g. "split-lse-base"
    cause: ClassVar[str]  # one sentence: what the engine did wrong, and the public issue it resembles

    @abc.abstractmethod
    def applies(self, trace: Trace) -> bool:
        """Whether the step has what the mistake needs (its path merges splits, it verifies a tree, ...)."""

    def shown_by_metadata(self, trace: Trace) -> bool:
        """Whether the step's recorded metadata itself shows the mistake's precondition (empty
        splits in the recorded split plan, a split count past the scratch, a plan that differs from
        the batch), so that a step without the engine's output can be judged exposed to it. Models
        that could happen on any step (a base confusion, an index off by one) say False."""
        return False

    @abc.abstractmethod
    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        """Candidate outputs for `requests` (the requests whose rows fail the reference)."""


def merge(outputs: Tensor, lses: Tensor) -> Tensor:
    """Normalised partial states [K, ..., Dv] with their LSEs [K, ...] merged as a split-KV stage 2
    does (numerics.merge_states: a state with LSE -inf weighs 0, its output ignored). The LSEs are
    taken as natural log: a model that reproduces a base confusion rescales them before calling this."""
    return numerics.merge_states(outputs, lses)[0]


class PartialStates:
    """float64 partial states of single requests over ranges of their KV columns, and whole-batch
    attention under a changed batch, both from the reference (StepData.partial and
    reference.attention on the step's own inputs), memoised: models share the splits they ask for.

    `of` batches its requests: one reference pass computes one range for every request at once.
    """

    def __init__(self, data: StepData, plan: PlanReading | None = None):
        self.data = data
        self.trace = data.trace
        # What the step's recorded plan says (the check context's reading when a detector asks):
        # the models that judge the recorded plan read it here.
        self.plan = plan if plan is not None else read(data.trace)
        self._ranges: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self._batches: dict[Any, Tensor] = {}

    def rows(self, b: int) -> slice:
        qo = self.trace.batch.qo_indptr
        return slice(int(qo[b]), int(qo[b + 1]))

    def of(self, wanted: Iterable[tuple[int, int, int]]) -> dict[tuple[int, int, int], tuple[Tensor, Tensor]]:
        """(b, start, end) -> request b's output [e, Hq, Dv] and LSE [e, Hq] over columns [start, end)."""
        wanted = list(dict.fromkeys(wanted))
        missing: dict[int, list[tuple[int, int]]] = {}
        for b, start, end in wanted:
            if (b, start, end) not in self._ranges:
                missing.setdefault(b, []).append((start, end))
        while missing:
            columns = torch.zeros(self.trace.batch.batch_size, 2, dtype=torch.int64)
            taken = {b: ranges.pop() for b, ranges in missing.items()}
            for b, (start, end) in taken.items():
                columns[b] = torch.tensor([start, end])
            part = self.data.partial(columns)
            for b, (start, end) in taken.items():
                self._ranges[(b, start, end)] = (part.output[self.rows(b)].double(), part.lse[self.rows(b)].double())
            missing = {b: ranges for b, ranges in missing.items() if ranges}
        return {key: self._ranges[key] for key in wanted}

    def under(self, key: Any, trace: Trace, visible: reference.Visible | None = None) -> Tensor:
        """[T, Hq, Dv] float64: the whole batch's attention as a kernel told `trace` (the step's batch
        with the mistake applied: another request's slots, shifted query columns, a chain for a
        tree) computes it over the step's own q and KV cache; `visible`: the columns a kernel with a
        wrong mask let each query see (default: `trace`'s own). `key` names the variant for the memo."""
        if key not in self._batches:
            result = reference.attention(trace, self.data.inputs, torch.float64, visible=visible)
            self._batches[key] = result.output.cpu()
        return self._batches[key]


def with_batch(trace: Trace, **fields: Any) -> Trace:
    """The step with some batch fields replaced: what a kernel given the wrong metadata sees."""
    return replace(trace, batch=replace(trace.batch, **fields))


def with_rows(trace: Trace, rows: list[torch.Tensor], kv_lens: list[int]) -> Trace:
    """The step as a kernel sees it when request b's KV row is rows[b] (kv_lens[b] columns), its
    queries at the end of that row as the step's own are at the end of theirs."""
    batch = trace.batch
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    shift = torch.repeat_interleave(lens - batch.kv_lens, batch.extend_lens, output_size=batch.num_tokens)
    return with_batch(
        trace,
        slot_ids=torch.cat(rows) if rows else batch.slot_ids,
        slot_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        kv_lens=lens,
        prefix_lens=lens - batch.extend_lens,
        query_cols=batch.query_cols + shift,
    )


def plan_kv(plan: PlanReading) -> RequestKV | None:
    """The recorded plan's per-request KV ids for the step's real requests, as its kernel reads
    them, or None when the plan cannot be read safely (the plan guard refuses it, or no adapter has
    it) or its view gives none."""
    view = plan.launch_view
    if plan.adapter is None or view is None or view.kv is None or view.kv.lengths.numel() < plan.trace.batch.batch_size:
        return None
    return view.kv


def plan_slots(ids: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """The first `length` token slots of a request's ids (slot ids, or pages of page_size tokens)."""
    if page_size == 1:
        return ids[:length].to(torch.int64)
    return (ids.to(torch.int64)[:, None] * page_size + torch.arange(page_size)).flatten()[:length]


def spans(indices: list[int]) -> str:
    """[5, 6, 7, 9] -> "5-7, 9"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
