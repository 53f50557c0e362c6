"""The recorded step shipped in traces/ (transformers continuous batching, real tensors) checks clean,
and the check that compares the engine's own output with the reference is sensitive on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from attndbg.checks.context import CheckContext, CheckOptions
from attndbg.checks.run import check_steps, parse_only
from attndbg.checks.split_merge_recorded import recorded_tensors
from attndbg.trace import io

SHIPPED = Path(__file__).resolve().parents[2] / "traces" / "transformers_step.pt"


def test_shipped_recording_is_a_real_engine_step_and_checks_clean() -> None:
    trace = io.load(SHIPPED)
    assert trace.source.engine == "transformers" and trace.batch.forward_mode.value == "DECODE"
    layer = trace.tensors[0]
    assert layer.output is not None and layer.q.shape[0] == trace.batch.num_tokens
    reports = list(check_steps(str(SHIPPED), parse_only(None), CheckOptions(backends=("reference",))))
    assert [f for r in reports for f in r.findings] == []


def test_a_foreign_key_in_one_request_is_caught_at_that_request() -> None:
    trace = io.load(SHIPPED)
    b = int(torch.argmax(trace.batch.kv_lens))
    other = (b + 1) % trace.batch.batch_size
    slots = trace.batch.slot_ids.clone()
    slots[int(trace.batch.slot_indptr[b])] = slots[int(trace.batch.slot_indptr[other])]
    wrong = replace(trace, batch=replace(trace.batch, slot_ids=slots))
    findings = recorded_tensors(CheckContext(trace=wrong, path="shipped", options=CheckOptions(backends=("reference",))))
    assert findings and {f.location.request for f in findings} == {b}
