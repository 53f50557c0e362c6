"""A plan recorded at a CUDA-graph replay covers the capture size's requests, padding included.
Replayed eagerly it must run on the real requests only: launched as recorded, the padded requests
read query rows that do not exist (an abort in the Triton interpreter, an illegal memory access on
a GPU)."""

from __future__ import annotations

from dataclasses import replace

import torch

from attndbg.backends.base import Padding
from attndbg.backends.triton import TritonBackend
from attndbg.checks.selection import parse_only
from attndbg.checks.step import check_one
from attndbg.detector_api.context import CheckOptions
from attndbg.plans.guard import out_of_bounds, real_requests_only
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.trace import io
from tests.factories import make_trace


def _padded(*spec: str):
    trace = make_trace(*spec)
    plan = TritonBackend().derive_plan(trace, Padding(trace.graph.capture_bs, trace.graph.fill_value))
    return replace(trace, plan=plan)


def test_the_reported_step_replays_its_real_requests(tmp_path) -> None:
    trace = _padded("verify", "dtype=float16", "page_size=16", "seed=120", "capture_bs=6")
    real = real_requests_only(trace, trace.plan)
    bs = trace.batch.batch_size
    assert real.tensors["qo_indptr"].numel() == bs + 1 and real.tensors["kv_indptr"].numel() == bs + 1
    assert real.tensors["kv_indices"].numel() == int(trace.plan.tensors["kv_indptr"][bs])
    assert real.tensors["custom_mask"].numel() == int(trace.plan.tensors["mask_indptr"][bs])
    result = replay(trace, "t", ["triton"], ReplayOptions(plan=PlanSource.RECORDED))
    run = result.runs[0]
    assert run.status is RunStatus.PASSED, (run.reason, run.comparison)
    assert "padded to capture_bs=6" in run.description
    path = io.save(trace, tmp_path / "padded.pt")
    report = check_one(path, parse_only("tree-mask,invariants"), CheckOptions(backends=("triton",))).report
    assert report.checked and report.findings == []


def test_a_wrong_real_row_is_still_caught_after_trimming() -> None:
    trace = _padded("verify-chain", "prefix_lens=9,30", "heads=2:1", "head_dim=32", "capture_bs=4")
    mask = trace.plan.tensors["custom_mask"].clone()
    start = int(trace.plan.tensors["mask_indptr"][1])  # request 1's block, a real request
    mask[start : start + 40] = ~mask[start : start + 40]
    bad = replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "custom_mask": mask}))
    run = replay(bad, "t", ["triton"], ReplayOptions(plan=PlanSource.RECORDED)).runs[0]
    assert run.status is RunStatus.FAILED and run.comparison.worst.request == 1


def test_plans_reading_past_the_step_are_not_launched() -> None:
    trace = make_trace("verify", "prefix_lens=4,7", "heads=2:1", "head_dim=32", plan=True)
    plan = trace.plan
    extra = replace(plan, tensors={**plan.tensors, "qo_indptr": torch.cat([plan.tensors["qo_indptr"], plan.tensors["qo_indptr"][-1:] + 8])})
    assert "covers 3 requests, the step has 2" in out_of_bounds(trace, extra)
    rows = plan.tensors["qo_indptr"].clone()
    rows[-1] += 5
    past = replace(plan, tensors={**plan.tensors, "qo_indptr": rows})
    assert "reads query rows past the step's" in out_of_bounds(trace, past)
    run = replay(replace(trace, plan=past), "t", ["triton"], ReplayOptions(plan=PlanSource.RECORDED)).runs[0]
    assert run.status is RunStatus.ERROR and run.reason.endswith("(not launched)")
    assert run.refused is not None and run.reason == run.refused.message + " (not launched)"
    assert out_of_bounds(trace, plan) is None
