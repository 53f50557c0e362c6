"""fill-value, padding requirements as predictions confirmed or contradicted by running.

What a backend's kernels need of padded rows is declared as data (its `FillRequirement`: the
smallest padded seq_len they take, with the source of the fact; backends/engine_names.py for the
engine backends no adapter reproduces). The recorded-padding half judges a step by that table
alone. Here each padded replay of the step (padded as its engine pads it: the engine's adapter at
the recorded fill, every backend at its own fill) is the measurement the table predicts:

    predicted harmful   a fill below the declared minimum: the replay should crash, write NaN/Inf
                        into padded rows, write KV outside the dummy slot or change real rows
    predicted harmless  a fill at or above it: the replay should be clean

A run that does what was predicted confirms the table (the recorded padded-seq-len finding says so);
one that does not contradicts it: `fill-requirement-contradicted`, a hazard (the step's own harm,
where there is some, is the other padded-replay findings'), naming the declaration, the fill, the
capture size and what the run showed, so the table can be corrected for the library build at hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attndbg.backends.base import FillRequirement
from attndbg.detector_api.findings import Finding, FindingClass, Severity, finding
from attndbg.replay.runner import BackendRun, RunStatus
from attndbg.trace.schema import Trace

KIND = FindingClass.FILL_VALUE
# The recorded-padding finding whose prediction a replay confirms or not (detect.py makes it).
PREDICTION_CHECK = "padded-seq-len-unsupported"


@dataclass(frozen=True)
class PaddedOutcome:
    """What one padded replay of one backend did to the padding's bystanders."""

    backend: str
    fill: int
    capture_bs: int
    harm: tuple[str, ...]  # each harm in words; empty: clean

    @property
    def words(self) -> str:
        return "; ".join(self.harm) if self.harm else "padded rows finite, no KV written outside the dummy slot, real rows as eagerly"


def outcome(backend: str, fill: int, capture_bs: int, *, eager: BackendRun | None, graph: BackendRun | None) -> PaddedOutcome | None:
    """The padded replay `graph` judged (None when it did not run: not supported, not available)."""
    if graph is None or graph.status in (RunStatus.UNSUPPORTED, RunStatus.UNAVAILABLE):
        return None
    harm = []
    if graph.status is RunStatus.ERROR:
        harm.append(f"raised ({graph.reason})")
    run = graph.graph
    if run is not None and run.padded_nonfinite:
        harm.append(f"{run.padded_nonfinite} NaN/Inf values in the padded rows")
    if run is not None and run.stray_kv_slots:
        harm.append(f"KV written at slots {run.stray_kv_slots}")
    eager_ok = eager is not None and eager.status is RunStatus.PASSED
    if eager_ok and graph.comparison is not None and not graph.comparison.passed:
        harm.append(f"{graph.comparison.failing_rows} real rows fail the reference (right eagerly)")
    return PaddedOutcome(backend, fill, capture_bs, tuple(harm))


def contradictions(trace: Trace, outcomes: list[PaddedOutcome], needs: dict[str, FillRequirement]) -> list[Finding]:
    """A finding per replay whose outcome is not the one `needs` (backend -> its declared
    requirement) predicts."""
    found = []
    for seen in outcomes:
        need = needs.get(seen.backend)
        if need is None:
            continue
        predicted_harm = seen.fill < need.min_seq_len
        if predicted_harm == bool(seen.harm):
            continue
        declared = f"{seen.backend} declares padded seq_len >= {need.min_seq_len} ({need.why})"
        ran = f"replayed padded to capture_bs={seen.capture_bs} with padded seq_len {seen.fill}: {seen.words}"
        if predicted_harm:
            cause = (
                f"The declared requirement is not what this build of {seen.backend}'s kernels needs at this shape: seq_len "
                f"{seen.fill} did no harm here. It may hold for another release, path or shape; the recorded-padding "
                "finding that rests on it is a prediction this run does not confirm."
            )
        else:
            cause = (
                f"The declared requirement is too weak: padded seq_len {seen.fill} meets it, and the padded replay still did "
                "harm. Fill values that satisfy the table are not safe for these kernels at this shape."
            )
        found.append(
            finding(
                KIND,
                "fill-requirement-contradicted",
                step=trace.source.step,
                evidence=f"{declared}; {ran}",
                cause=cause,
                severity=Severity.HAZARD,
                field="graph.fill_value",
                backend=seen.backend,
                fill_value=seen.fill,
                capture_bs=seen.capture_bs,
                min_seq_len=need.min_seq_len,
                predicted="harmful" if predicted_harm else "harmless",
                observed=list(seen.harm),
            )
        )
    return found


def confirmed(prediction: Finding, outcomes: list[PaddedOutcome], engine_adapter: str | None) -> Finding:
    """The recorded padded-seq-len finding with what the replay of the engine's own adapter at
    the recorded fill showed: the table's prediction confirmed, or not (None: nothing ran it)."""
    if prediction.check != PREDICTION_CHECK or engine_adapter is None:
        return prediction
    padded = prediction.data.get("padded_seq_lens") or []
    if not padded or min(padded) < 0:
        return prediction  # a negative length is never replayed: it would read before the request's KV
    fill = min(padded)  # the smallest: the replay the prediction is about
    seen = next((o for o in outcomes if o.backend == engine_adapter and o.fill == fill), None)
    if seen is None:
        return prediction
    verdict = "confirmed" if seen.harm else "not confirmed"
    words = f"; {verdict} by running ({engine_adapter} padded with seq_len {fill} at capture_bs={seen.capture_bs}: {seen.words})"
    return replace(prediction, evidence=prediction.evidence + words, data={**prediction.data, "confirmed_by_run": bool(seen.harm)})
