"""The recorded step shipped in traces/ (transformers continuous batching, real tensors) checks clean,
and the check that compares the engine's own output with the reference is sensitive on it."""

from __future__ import annotations

from pathlib import Path

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detectors.split_merge.recorded import recorded_tensors
from attndbg.trace import io
from tests.record.corruptions import foreign_first_key

SHIPPED = Path(__file__).resolve().parents[2] / "traces" / "transformers_step.pt"


def test_shipped_recording_is_a_real_engine_step_and_checks_clean() -> None:
    trace = io.load(SHIPPED)
    assert trace.source.engine == "transformers" and trace.batch.forward_mode.value == "DECODE"
    layer = trace.tensors[0]
    assert layer.output is not None and layer.q.shape[0] == trace.batch.num_tokens
    reports = list(check_steps(str(SHIPPED), parse_only(None), CheckOptions(backends=("reference",))))
    assert [f for r in reports for f in r.findings] == []


def test_a_foreign_key_in_one_request_is_caught_at_that_request() -> None:
    wrong, b = foreign_first_key(io.load(SHIPPED))
    findings = recorded_tensors(CheckContext(trace=wrong, path="shipped", options=CheckOptions(backends=("reference",))))
    assert findings and {f.location.request for f in findings} == {b}
