"""invariants reports a recorded plan the replay guard refuses when no other finding explains it:
such a plan is never launched, so without this finding `check` would say nothing about it. A plan
the guard cannot read (a field its layout declares is missing) is incomplete, not unsafe: no
finding, and the verdict names it (tests/checks/test_incomplete_plans.py)."""

from __future__ import annotations

from dataclasses import replace

from attndbg.backends.fa3 import FA3Backend
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.detector_api.context import CheckContext
from attndbg.detectors.invariants import detect as invariants
from attndbg.plans.reading import read
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")


def _findings(trace):
    return [(f.check, f.location.field, f.evidence) for f in invariants.detect(CheckContext(trace=trace, path="t.pt"))]


def test_unsafe_plans_are_findings_and_incomplete_ones_are_not() -> None:
    trace = make_trace("decode-paged", *SMALL)
    fa3 = FA3Backend().derive_plan(trace)
    assert _findings(replace(trace, plan=fa3)) == []
    no_table = replace(fa3, tensors={k: v for k, v in fa3.tensors.items() if k != "page_table"})
    assert _findings(replace(trace, plan=no_table)) == []
    assert read(replace(trace, plan=no_table)).unread == "plan has no page_table"
    flashinfer = FlashInferBackend().derive_plan(trace)
    assert _findings(replace(trace, plan=flashinfer)) == []
    # SGLang plans FlashInfer at page 1 on any pool: slot ids, read in the plan's pages, are clean.
    slot_level = FlashInferBackend().derive_plan(replace(trace, model=replace(trace.model, page_size=1)))
    assert _findings(replace(trace, plan=slot_level)) == []
    # Twice the pool's page size: the page ids run past the cache, named where the guard refuses
    # (plan-unsafe is not repeated on a field a finding already names).
    doubled = replace(flashinfer, scalars={**flashinfer.scalars, "page_size": 32})
    found = _findings(replace(trace, plan=doubled))
    assert found[0] == (
        "index-outside-cache",
        "plan.kv_indices[1]",
        "plan.kv_indices[1] = 18 (request 1, KV column 0) is outside the KV cache: page ids are in [0, 13)",
    )
    assert not [f for f in found if f[0] == "plan-unsafe"]


def test_a_refusal_another_finding_explains_is_not_repeated() -> None:
    trace = make_trace("decode-paged", *SMALL)
    plan = FA3Backend().derive_plan(trace)
    table = plan.tensors["page_table"].clone()
    table[0, 0] = 10**9
    found = _findings(replace(trace, plan=replace(plan, tensors={**plan.tensors, "page_table": table})))
    assert [(check, field) for check, field, _ in found] == [("index-outside-cache", "plan.page_table[0, 0]")]
