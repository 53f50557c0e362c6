"""fa3's two-call tree verify, recorded at a CUDA-graph replay: its plan is padded to the capture
size in both calls (the expand_ call has one row per draft token), and replayed eagerly it must
keep the real requests' rows of both; a plan whose calls end short of the step's query rows is
refused, not launched into the merge. The fa3 kernels do not run on a CPU;
its plans and plan view are plain torch."""

from __future__ import annotations

from dataclasses import replace

import torch

from attndbg.backends.base import Padding
from attndbg.backends.fa3 import FA3Backend, FA3Options
from attndbg.plans.guard import out_of_bounds, real_requests_only, refusal
from attndbg.trace.schema import Plan
from tests.factories import make_trace

TWO_CALL = FA3Backend(FA3Options(verify_path="two-call"))
SPEC = ("verify", "prefix_lens=4,7", "heads=2:1", "head_dim=32", "capture_bs=4")
HUGE = 10**9


def _padded():
    trace = make_trace(*SPEC)
    plan = TWO_CALL.derive_plan(trace, Padding(trace.graph.capture_bs, trace.graph.fill_value))
    return replace(trace, plan=plan), plan


def _set(plan: Plan, name: str, at: int | tuple[int, int], value: int) -> Plan:
    tensor = plan.tensors[name].clone()
    tensor[at] = value
    return replace(plan, tensors={**plan.tensors, name: tensor})


def test_a_padded_two_call_plan_keeps_the_real_requests_of_both_calls() -> None:
    trace, padded = _padded()
    bs, n = trace.batch.batch_size, trace.spec.draft_token_num
    assert padded.tensors["expand_page_table"].shape[0] == trace.graph.capture_bs * n
    assert "padded to the graph's capture size" in out_of_bounds(trace, padded, TWO_CALL)
    real = real_requests_only(trace, padded)
    assert real.tensors["expand_page_table"].shape[0] == bs * n and real.tensors["expand_cu_seqlens_q"].numel() == bs * n + 1
    unpadded = TWO_CALL.derive_plan(trace)  # what the same backend builds for the real batch alone
    for name in ("cache_seqlens", "cu_seqlens_q", "cu_seqlens_k", "expand_page_table", "expand_cache_seqlens", "expand_cu_seqlens_q", "expand_cu_seqlens_k"):
        assert torch.equal(real.tensors[name], unpadded.tensors[name]), name
    assert out_of_bounds(trace, real, TWO_CALL) is None


def test_after_trimming_a_bad_real_row_is_refused_and_a_padded_row_is_not_launched() -> None:
    trace, padded = _padded()
    last_real = trace.batch.batch_size * trace.spec.draft_token_num - 1
    bad = real_requests_only(trace, _set(padded, "expand_page_table", (last_real, 0), HUGE))
    assert out_of_bounds(trace, bad, TWO_CALL).startswith(f"recorded plan expand_page_table[{last_real}, 0] = {HUGE} is outside")
    garbage_in_padding = real_requests_only(trace, _set(padded, "expand_page_table", (last_real + 1, 0), HUGE))
    assert out_of_bounds(trace, garbage_in_padding, TWO_CALL) is None


def test_a_call_ending_short_of_the_steps_rows_is_refused_in_one_line() -> None:
    """FA3's merge masks the first call's rows by request: ending short of the step, those masks no
    longer match the outputs, and the run raised a RuntimeError traceback."""
    trace = make_trace(*SPEC[:-1])
    plan = TWO_CALL.derive_plan(trace)
    tokens = trace.batch.num_tokens
    for prefix in ("", "expand_"):
        short = _set(plan, f"{prefix}cu_seqlens_q", -1, tokens - 1)
        found = refusal(trace, short, TWO_CALL)
        assert found is not None and found.field == f"{prefix}cu_seqlens_q"
        assert found.message == (
            f"recorded plan {prefix}cu_seqlens_q[-1] = {tokens - 1}, expected {tokens} "
            "(the two-call merge reads every query row of the step from both calls)"
        )
    assert refusal(trace, plan, TWO_CALL) is None
