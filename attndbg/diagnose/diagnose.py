"""Diagnosis by reproduction: which known mistake, run on the step's own data, gives the engine's output.

A candidate reproduces request b when its float64 output equals the engine's on every row of b that
is judged, within the step's output tolerance (the error a correct engine may commit: the engine
rounds, the model does not), and some of those rows fail the reference. Requests are judged one by
one, so a mistake that hit two requests (or one request only) is reproduced as such; a model whose
output differs from the engine's anywhere in a request does not claim it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates
from attndbg.diagnose.kv_models import KeyOffByOne, NewTokensTwice, OtherRequestRow, PlanFromCapture, RecordedPlanKV, StalePositions
from attndbg.diagnose.mask_models import MaskBitOrder, MaskIgnored, MaskIgnoredPastCausalTile, MaskRowStride, MaskTransposed, RecordedPlanMask, WindowWithoutDraftOffset
from attndbg.diagnose.page_models import LastPageDropped
from attndbg.diagnose.split_models import EmptySplitsStale, EmptySplitsZeros, PrefixMergeLseBase, SplitCountMismatch, SplitLseBase, SplitsBeyondCapture
from attndbg.diagnose.stale_models import StalePlanMask
from attndbg.plans.reading import PlanReading
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import Trace

# The mistakes a verify kernel's mask can make: what tree-mask also tries on a failing run's output.
MASK_MODELS: tuple[MistakeModel, ...] = (
    MaskIgnored(),
    MaskTransposed(),
    MaskBitOrder(),
    MaskIgnoredPastCausalTile(),
    MaskRowStride(),
    RecordedPlanMask(),
    WindowWithoutDraftOffset(),
)
MODELS: tuple[MistakeModel, ...] = (
    SplitLseBase(),
    EmptySplitsZeros(),
    EmptySplitsStale(),
    SplitsBeyondCapture(),
    SplitCountMismatch(),
    PrefixMergeLseBase(),
    OtherRequestRow(),
    RecordedPlanKV(),
    NewTokensTwice(),
    PlanFromCapture(),
    StalePlanMask(),
    KeyOffByOne(),
    LastPageDropped(),
    StalePositions(),
    *MASK_MODELS,
)


@dataclass(frozen=True)
class Attribution:
    """One instance of a mistake (a model's candidates with one summary) over the requests it
    concerns, each with its parameters: what a reproduction and an exposure both name."""

    mechanism: str  # the model's name
    summary: str  # "a split-KV merge that read ..."
    cause: str  # the model's one-sentence cause
    requests: tuple[int, ...]
    details: tuple[str, ...]  # per request, its parameters in words
    params: tuple[dict[str, Any], ...]  # per request, machine-readable

    @staticmethod
    def of(model: MistakeModel, summary: str, hits: list[tuple[float, Candidate]]) -> dict[str, Any]:
        """The fields of `model`'s instance `summary` over the candidates `hits` (in request order)."""
        return {
            "mechanism": model.name,
            "summary": summary,
            "cause": model.cause,
            "requests": tuple(c.request for _, c in hits),
            "details": tuple(c.detail for _, c in hits),
            "params": tuple(c.params for _, c in hits),
        }

    def describe(self) -> str:
        return f"{self.summary} ({'; '.join(self.details)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "summary": self.summary,
            "requests": list(self.requests),
            "params": [{"request": b, **p} for b, p in zip(self.requests, self.params)],
        }


@dataclass(frozen=True)
class Reproduction(Attribution):
    """One mistake that reproduces the engine's output on some requests, with each one's parameters."""

    rows: tuple[int, ...]  # the failing rows it reproduces
    error: float  # worst |engine - model| / tolerance over the requests' judged rows (<= 1)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "rows": list(self.rows[:32]), "error": self.error}


def applicable(trace: Trace, models: tuple[MistakeModel, ...] = MODELS) -> list[MistakeModel]:
    """The models whose precondition this step meets."""
    return [m for m in models if m.applies(trace)]


def diagnose(
    data: StepData, engine_output: Tensor, *, rows: Tensor | None = None, models: tuple[MistakeModel, ...] = MODELS, plan: PlanReading | None = None
) -> list[Reproduction]:
    """The mistakes that reproduce `engine_output` [T, Hq, Dv] on the requests whose rows fail the
    reference; `rows` [T] bool: the rows to judge (default all; a non-finite row is another
    finding's). `plan`: the step's plan reading (a detector passes `ctx.plan()`; default: read
    here). Most rows reproduced first."""
    trace = data.trace
    ref = data.reference.output.double()
    tol = data.output_tolerance()
    out = engine_output.detach().to("cpu", torch.float64)
    judged = torch.ones(trace.batch.num_tokens, dtype=torch.bool) if rows is None else rows.cpu()
    failing = (_ratio(out, ref, tol) > 1).any(-1) & judged
    if not bool(failing.any()):
        return []
    qo = trace.batch.qo_indptr
    requests = sorted({int(torch.searchsorted(qo, torch.tensor(r), right=True)) - 1 for r in torch.nonzero(failing).flatten().tolist()})
    states = PartialStates(data, plan)
    found: list[Reproduction] = []
    for model in applicable(trace, models):
        best: dict[tuple[str, int], tuple[float, Candidate]] = {}
        for cand in model.candidates(states, requests):
            span = states.rows(cand.request)
            keep = judged[span]
            err = float(_ratio(out[span], cand.output, tol[span])[keep].max()) if bool(keep.any()) else float("inf")
            key = (cand.summary, cand.request)
            if err <= 1 and (key not in best or err < best[key][0]):
                best[key] = (err, cand)
        found += _grouped(model, best, failing, states)
    return sorted(found, key=lambda r: (-len(r.rows), r.error))


def _ratio(out: Tensor, model: Tensor, tol: Tensor) -> Tensor:
    """[rows, Hq]: |out - model| / tolerance, NaN anywhere in a head counted as infinitely off."""
    return torch.nan_to_num((out - model).abs().amax(-1) / tol, nan=float("inf"))


def by_summary(best: dict[tuple[str, int], tuple[float, Candidate]]) -> dict[str, list[tuple[float, Candidate]]]:
    """(summary, request) -> (score, candidate) regrouped per summary (the mistake with the same
    non-request parameters), each group's requests in order."""
    groups: dict[str, list[tuple[float, Candidate]]] = {}
    for (summary, _), hit in sorted(best.items(), key=lambda item: item[0][1]):
        groups.setdefault(summary, []).append(hit)
    return groups


def _grouped(model: MistakeModel, best: dict[tuple[str, int], tuple[float, Candidate]], failing: Tensor, states: PartialStates) -> list[Reproduction]:
    """One Reproduction per summary, its requests in order."""
    out = []
    for summary, hits in by_summary(best).items():
        rows = [r for _, c in hits for r in range(states.rows(c.request).start, states.rows(c.request).stop) if bool(failing[r])]
        out.append(Reproduction(**Attribution.of(model, summary, hits), rows=tuple(rows), error=max(err for err, _ in hits)))
    return out
