"""Would this step break under mistake M? The mistake models run on a step without (or besides) the
engine's output, where the step's own metadata shows M's precondition (MistakeModel.shown_by_metadata):
each candidate's float64 output is compared with the reference, and a request whose output M would
move beyond the step's tolerance is exposed to M. No candidate is a claim that the engine made M: it
says what M would cost on this step, so a user can tell a harmless precondition (empty splits a
correct merge skips) from a live one (a plan that already differs from the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates
from attndbg.diagnose.diagnose import MODELS, Attribution, _ratio, by_summary
from attndbg.replay.step_data import StepData


@dataclass(frozen=True)
class Exposure(Attribution):
    """One mistake whose precondition the step shows, and what it would do to which requests."""

    worst: float  # largest |model - reference| / tolerance over the requests' rows (> 1)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "worst_over_tolerance": self.worst}


def exposures(data: StepData, models: tuple[MistakeModel, ...] = MODELS) -> list[Exposure]:
    """The mistakes this step's metadata exposes it to, the costliest first."""
    trace = data.trace
    ref = data.reference.output.double()
    tol = data.output_tolerance()
    requests = [b for b in range(trace.batch.batch_size) if int(trace.batch.extend_lens[b]) > 0]
    states = PartialStates(data)
    found: list[Exposure] = []
    for model in models:
        if not model.shown_by_metadata(trace):
            continue
        worst: dict[tuple[str, int], tuple[float, Candidate]] = {}
        for cand in model.candidates(states, requests):
            span = states.rows(cand.request)
            ratio = float(_ratio(cand.output, ref[span], tol[span]).max())
            key = (cand.summary, cand.request)
            if ratio > 1 and (key not in worst or ratio > worst[key][0]):
                worst[key] = (ratio, cand)
        for summary, hits in by_summary(worst).items():
            found.append(Exposure(**Attribution.of(model, summary, hits), worst=min(max(r for r, _ in hits), torch.finfo(torch.float64).max)))
    return sorted(found, key=lambda e: -e.worst)
