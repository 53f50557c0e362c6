"""The plan detectors and injections read a plan through the layout its backend declares
(Backend.plan_layout), so a layout no detector names by backend is checked like the others."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.detectors.invariants import detect as invariants
from attndbg.detectors.invariants.injections import index_outside_cache, wrong_req_row
from tests.factories import make_trace


def _flashmla_step():
    trace = make_trace("mla-decode", "kv_lens=70,140,200", "page_size=64")
    plan = MLABackend(MLAOptions(impl="flashmla")).derive_plan(trace)
    return replace(trace, plan=plan, source=replace(trace.source, backend="flashmla"))


@pytest.mark.parametrize("inject,check", [(wrong_req_row, "kv-index"), (index_outside_cache, "index-outside-cache")])
def test_a_mistake_planted_in_a_flashmla_block_table_is_named_there(inject, check: str) -> None:
    trace = _flashmla_step()
    assert invariants.check_trace(trace) == []
    findings = invariants.check_trace(inject(trace))
    assert [f.check for f in findings] == [check]
    assert findings[0].location.field.startswith("plan.block_table[")
