"""On the device: a hostile recorded plan is refused before any kernel sees it (an fa3 page table
pointing 10**9 pages into the cache would read arbitrary device memory), and a kernel FlashInfer
cannot compile is reported as unsupported with the compiler's reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attndbg.backends.fa3 import FA3Backend
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from tests.factories import make_trace

pytestmark = pytest.mark.gpu

RECORDED = ReplayOptions(plan=PlanSource.RECORDED)


def test_fa3_page_table_far_outside_the_cache_is_refused_not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FA3Backend()
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    trace = make_trace("decode-paged", "heads=8:2", "head_dim=128", "dtype=bfloat16")
    plan = backend.derive_plan(trace)
    table = plan.tensors["page_table"].clone()
    table[0, 0] = 10**9
    hostile = replace(trace, plan=replace(plan, tensors={**plan.tensors, "page_table": table}))
    launched = []
    run = FA3Backend.run

    def counting_run(self, trace, inputs, plan):
        launched.append(plan)
        return run(self, trace, inputs, plan)

    monkeypatch.setattr(FA3Backend, "run", counting_run)
    refused = replay(hostile, "t", ["fa3"], RECORDED).runs[0]
    assert refused.status is RunStatus.ERROR and launched == []
    assert refused.reason.startswith("recorded plan page_table[0, 0] = 1000000000 is outside [0, ") and refused.reason.endswith("(not launched)")
    torch.cuda.synchronize()  # the context is healthy: nothing faulted
    clean = replay(replace(trace, plan=plan), "t", ["fa3"], RECORDED).runs[0]
    assert clean.status is RunStatus.PASSED, (clean.reason, clean.comparison)
    assert len(launched) == 1


def test_flashinfer_head_dim_13_is_unsupported_with_the_compilers_reason() -> None:
    trace = make_trace("decode-mha", "head_dim=13", "kv_lens=5,9", "heads=4:4", "dtype=bfloat16")
    run = replay(trace, "t", ["flashinfer"], ReplayOptions()).runs[0]
    if run.status is RunStatus.UNAVAILABLE:
        pytest.skip(run.reason)
    assert run.status is RunStatus.UNSUPPORTED, (run.status, run.reason)
    assert run.reason.startswith("FlashInfer does not compile head_dim 13 ("), run.reason
