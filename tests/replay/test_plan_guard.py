"""Every recorded plan form is guarded through its backend's plan view.

For each backend's layout a hostile plan (an index past the KV cache, an offset past the tensor it
indexes or decreasing, a mask block past the mask) is refused with the exact element named, and
the clean plan of the same step passes. FlashInfer, FA3 and FlashMLA kernels do not run on this
CPU machine, but their plans and plan views are plain torch; the triton plans (and mla's triton
impl) also replay, and a refused one is never launched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends.base import Backend
from attndbg.backends.fa3 import FA3Backend, FA3Options
from attndbg.backends.flashinfer import FlashInferBackend, FlashInferOptions
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.reference import ReferenceBackend
from attndbg.backends.triton import TritonBackend
from attndbg.cli import main
from attndbg.plans.guard import out_of_bounds
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.trace import io
from attndbg.trace.schema import Plan, Trace
from tests.factories import make_trace

HUGE = 10**9
SMALL = ("heads=2:1", "head_dim=32")
# FA3's SM90 kernels take head_dim 64/128/192/256 only: on a GPU machine fa3 refuses head_dim 32.
FA3_SMALL = ("heads=2:1", "head_dim=64")


def _edit(plan: Plan, name: str, change: Callable[[torch.Tensor], None]) -> Plan:
    value = plan.tensors[name].clone()
    change(value)
    return replace(plan, tensors={**plan.tensors, name: value})


def _set(plan: Plan, name: str, at: tuple[int, ...] | int, value: int) -> Plan:
    def change(t: torch.Tensor) -> None:
        t[at] = value

    return _edit(plan, name, change)


def _planned(backend: Backend, *spec: str) -> tuple[Trace, Plan]:
    trace = make_trace(*spec)
    assert backend.unsupported_reason(trace) is None, backend.unsupported_reason(trace)
    plan = backend.derive_plan(trace)
    assert out_of_bounds(trace, plan, backend) is None  # the clean plan of the step passes
    return replace(trace, plan=plan), plan


def _pages(trace: Trace, page_size: int) -> str:
    return f"pages of the KV cache ({trace.batch.kv_cache_size} slots / page {page_size})"


# -- triton: kv_indices over slots, qo/kv/mask indptrs, split counts -------------------------------


def test_triton_verify_plan_forms() -> None:
    backend = TritonBackend()
    trace, plan = _planned(backend, "verify", "prefix_lens=4,7", *SMALL)
    slots = trace.batch.kv_cache_size
    assert out_of_bounds(trace, _set(plan, "kv_indices", 5, HUGE), backend) == (
        f"recorded plan kv_indices[5] = {HUGE} is outside [0, {slots}): slots of the KV cache"
    )
    kv_indptr = plan.tensors["kv_indptr"]
    assert out_of_bounds(trace, _set(plan, "kv_indptr", 1, int(kv_indptr[2]) + 1), backend) == (
        f"recorded plan kv_indptr[2] = {int(kv_indptr[2])} < kv_indptr[1] = {int(kv_indptr[2]) + 1}: offsets must not decrease"
    )
    length = plan.tensors["kv_indices"].numel()
    assert out_of_bounds(trace, _set(plan, "kv_indptr", 2, length + 3), backend) == (
        f"recorded plan kv_indptr[2] = {length + 3} exceeds kv_indices's length {length}"
    )
    mask_indptr = plan.tensors["mask_indptr"]
    mask_len = plan.tensors["custom_mask"].numel()
    assert out_of_bounds(trace, _set(plan, "mask_indptr", 2, mask_len + 1), backend) == (
        f"recorded plan mask_indptr[2] = {mask_len + 1} exceeds custom_mask's length {mask_len}"
    )
    # Request 1's block moved one element on: still inside the offsets, but its last row reads past the mask.
    start = int(mask_indptr[1]) + 1
    assert out_of_bounds(trace, _set(plan, "mask_indptr", 1, start), backend) == (
        f"recorded plan mask_indptr[1] = {start}: request 1's q_len x (kv_len + q_len) mask block of "
        f"{mask_len - start + 1} elements ends at {mask_len + 1}, past custom_mask's length {mask_len}"
    )


def test_triton_decode_split_counts_are_bounded_by_the_scratch() -> None:
    backend = TritonBackend()
    trace, plan = _planned(backend, "decode-mha", "kv_lens=3,20", *SMALL)
    top = int(plan.scalars["max_kv_splits"])
    assert out_of_bounds(trace, _set(plan, "num_kv_splits", 1, top + 1), backend) == (
        f"recorded plan num_kv_splits[1] = {top + 1} is outside [1, {top + 1}): split counts the stage-1 scratch holds (max_kv_splits {top})"
    )
    unscratched = replace(plan, scalars={k: v for k, v in plan.scalars.items() if k != "max_kv_splits"})
    assert out_of_bounds(trace, unscratched, backend) == "recorded plan not read: plan has no scalar max_kv_splits"


def test_a_refused_triton_plan_is_never_launched_and_the_clean_one_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    trace, plan = _planned(TritonBackend(), "verify", "prefix_lens=4,7", *SMALL)
    launched: list[Plan] = []
    run = TritonBackend.run

    def counting_run(self, trace, inputs, plan):
        launched.append(plan)
        return run(self, trace, inputs, plan)

    monkeypatch.setattr(TritonBackend, "run", counting_run)
    options = ReplayOptions(plan=PlanSource.RECORDED)
    hostile = replace(trace, plan=_set(plan, "mask_indptr", 1, int(plan.tensors["mask_indptr"][1]) + 1))
    refused = replay(hostile, "t", ["triton"], options).runs[0]
    assert refused.status is RunStatus.ERROR and refused.reason.startswith("recorded plan mask_indptr[1] = ")
    assert refused.reason.endswith("(not launched)") and launched == []
    assert refused.refused is not None and refused.reason == refused.refused.message + " (not launched)"
    clean = replay(trace, "t", ["triton"], options).runs[0]
    assert clean.status is RunStatus.PASSED, (clean.reason, clean.comparison)
    assert clean.refused is None
    assert len(launched) == 1


# -- flashinfer: page ids, kv_last_page_len, qo_indptr, a mask FlashInfer lays out itself -----------


def test_flashinfer_paged_plan_forms() -> None:
    backend = FlashInferBackend()
    trace, plan = _planned(backend, "verify", "prefix_lens=20,37", "page_size=4", *SMALL)
    assert out_of_bounds(trace, _set(plan, "kv_indices", 3, HUGE), backend) == (
        f"recorded plan kv_indices[3] = {HUGE} is outside [0, {trace.batch.kv_cache_size // 4}): {_pages(trace, 4)}"
    )
    assert out_of_bounds(trace, _set(plan, "kv_last_page_len", 1, 5), backend) == (
        "recorded plan kv_last_page_len[1] = 5 is outside [0, 5): tokens of a last page (page_size 4)"
    )
    qo = plan.tensors["qo_indptr"]
    assert out_of_bounds(trace, _set(plan, "qo_indptr", 1, int(qo[2]) + 1), backend) == (
        f"recorded plan qo_indptr[2] = {int(qo[2])} < qo_indptr[1] = {int(qo[2]) + 1}: offsets must not decrease"
    )
    # FlashInfer packs the mask at offsets it computes (cumsum of q_len x kv_len): one element short
    # and the last request's block runs past it, whatever the recorded mask_indptr says.
    mask = plan.tensors["custom_mask"]
    short = replace(plan, tensors={**plan.tensors, "custom_mask": mask[:-1]})
    n, kv = trace.spec.draft_token_num, int(trace.batch.kv_lens[1])
    assert out_of_bounds(trace, short, backend) == (
        f"recorded plan request 1's block starts at {mask.numel() - n * kv}: request 1's q_len x kv_len mask block of "
        f"{n * kv} elements ends at {mask.numel()}, past custom_mask's length {mask.numel() - 1}"
    )


def test_flashinfer_decode_and_ragged_plans() -> None:
    backend = FlashInferBackend()
    trace, plan = _planned(backend, "decode-paged", *SMALL)
    assert out_of_bounds(trace, _set(plan, "kv_indptr", 0, 1), backend) == "recorded plan kv_indptr[0] = 1: offsets must start at 0"
    # The cache is handed over in the plan's pages: SGLang's page-1 plan (slot ids) on a paged pool
    # is launchable; a page size whose page ids run past the cache is refused at the first one.
    page_size, slots = trace.model.page_size, trace.batch.kv_cache_size
    slot_level = backend.derive_plan(replace(trace, model=replace(trace.model, page_size=1)))
    assert int(slot_level.scalars["page_size"]) == 1 and out_of_bounds(trace, slot_level, backend) is None
    wrong = replace(plan, scalars={**plan.scalars, "page_size": page_size * 2})
    indices = plan.tensors["kv_indices"]
    first = int((indices >= slots // (page_size * 2)).nonzero()[0])
    assert out_of_bounds(trace, wrong, backend) == (
        f"recorded plan kv_indices[{first}] = {int(indices[first])} is outside [0, {slots // (page_size * 2)}): "
        f"pages of the KV cache ({slots} slots / page {page_size * 2})"
    )
    ragged = FlashInferBackend(FlashInferOptions(extend_path="ragged"))
    trace, plan = _planned(ragged, "extend-noprefix", *SMALL)
    tokens = trace.batch.num_tokens
    assert out_of_bounds(trace, _set(plan, "qo_indptr", 2, tokens + 1), ragged) == (
        f"recorded plan qo_indptr[2] = {tokens + 1} reads query rows past the step's {tokens}"
    )


# -- fa3: page_table rows read up to cache_seqlens, cu_seqlens_q, the two-call expand_ tables --------


def test_fa3_page_table_forms() -> None:
    backend = FA3Backend()
    trace, plan = _planned(backend, "decode-paged", *FA3_SMALL)
    pages = trace.batch.kv_cache_size // 16
    assert out_of_bounds(trace, _set(plan, "page_table", (0, 0), HUGE), backend) == (
        f"recorded plan page_table[0, 0] = {HUGE} is outside [0, {pages}): {_pages(trace, 16)}"
    )
    table = plan.tensors["page_table"]
    cols = table.shape[1]
    assert out_of_bounds(trace, _set(plan, "cache_seqlens", 1, cols * 16 + 1), backend) == (
        f"recorded plan cache_seqlens[1] = {cols * 16 + 1} is outside [0, {cols * 16 + 1}): tokens a page_table row of {cols} pages of 16 holds"
    )
    # Request 0 (5 tokens) reads one page: garbage in its row's unread columns is not read, not refused.
    assert out_of_bounds(trace, _set(plan, "page_table", (0, cols - 1), HUGE), backend) is None
    tokens = trace.batch.num_tokens
    last = trace.batch.batch_size
    assert out_of_bounds(trace, _set(plan, "cu_seqlens_q", last, tokens + 2), backend) == (
        f"recorded plan cu_seqlens_q[{last}] = {tokens + 2} reads query rows past the step's {tokens}"
    )
    missing = replace(plan, tensors={k: v for k, v in plan.tensors.items() if k != "page_table"})
    assert out_of_bounds(trace, missing, backend) == "recorded plan not read: plan has no page_table"


def test_fa3_two_call_expand_table_is_guarded() -> None:
    backend = FA3Backend(FA3Options(verify_path="two-call"))
    trace, plan = _planned(backend, "verify", "prefix_lens=4,7", *FA3_SMALL)
    slots = trace.batch.kv_cache_size
    assert out_of_bounds(trace, _set(plan, "expand_page_table", (3, 0), -1), backend) == (
        f"recorded plan expand_page_table[3, 0] = -1 is outside [0, {slots}): pages of the KV cache ({slots} slots / page 1)"
    )


# -- mla: FlashInfer MLA page indices and kv_len_arr, FlashMLA block tables, the triton impl ---------


def test_mla_flashinfer_plan_forms() -> None:
    backend = MLABackend(MLAOptions(impl="flashinfer"))
    trace, plan = _planned(backend, "mla-decode", "heads=2", "kv_lens=3,40", "page_size=16")
    assert out_of_bounds(trace, _set(plan, "kv_indices", 1, HUGE), backend) == (
        f"recorded plan kv_indices[1] = {HUGE} is outside [0, {trace.batch.kv_cache_size // 16}): {_pages(trace, 16)}"
    )
    assert out_of_bounds(trace, _set(plan, "kv_len_arr", 1, 49), backend) == (
        "recorded plan kv_len_arr[1] = 49 is outside [0, 49): tokens the request's kv_indptr pages hold (page_size 16)"
    )


def test_mla_flashmla_block_table() -> None:
    backend = MLABackend(MLAOptions(impl="flashmla"))
    trace, plan = _planned(backend, "mla-decode", "heads=2", "kv_lens=3,70", "page_size=64")
    assert out_of_bounds(trace, _set(plan, "block_table", (1, 1), HUGE), backend) == (
        f"recorded plan block_table[1, 1] = {HUGE} is outside [0, {trace.batch.kv_cache_size // 64}): {_pages(trace, 64)}"
    )


def test_mla_triton_plan_is_refused_unlaunched_and_the_clean_one_replays() -> None:
    backend = MLABackend(MLAOptions(impl="triton"))
    trace, plan = _planned(backend, "mla-decode", "heads=2", "kv_lens=3,9")
    hostile = replace(trace, plan=_set(plan, "kv_indices", 4, HUGE))
    assert out_of_bounds(hostile, hostile.plan, backend) == (
        f"recorded plan kv_indices[4] = {HUGE} is outside [0, {trace.batch.kv_cache_size}): slots of the KV cache"
    )
    if MLABackend().impl().value != "triton":
        pytest.skip("the mla backend runs another implementation here")
    options = ReplayOptions(plan=PlanSource.RECORDED)
    refused = replay(hostile, "t", ["mla"], options).runs[0]
    assert refused.status is RunStatus.ERROR and refused.reason.endswith("(not launched)")
    assert refused.refused is not None and refused.refused.field == "kv_indices"
    clean = replay(trace, "t", ["mla"], options).runs[0]
    assert clean.status is RunStatus.PASSED, (clean.reason, clean.comparison)


# -- a plan that cannot be viewed is refused, never launched unchecked ------------------------------


def test_a_backend_without_a_plan_view_is_refused() -> None:
    trace = make_trace("decode-mha", "kv_lens=3,20", *SMALL)
    plan = Plan(backend="reference", tensors={}, scalars={})
    assert out_of_bounds(trace, plan, ReferenceBackend()) == "recorded plan cannot be guarded: the reference backend declares no plan view"
    run = replay(replace(trace, plan=plan), "t", ["reference"], ReplayOptions(plan=PlanSource.RECORDED)).runs[0]
    assert run.status is RunStatus.ERROR and "cannot be guarded" in run.reason and run.result is None
    unknown = Plan(backend="FLASH_ATTN_VLLM_V1", tensors={}, scalars={})
    assert out_of_bounds(trace, unknown) == "recorded plan cannot be guarded: no backend is named 'FLASH_ATTN_VLLM_V1'"


def test_wrong_rank_or_dtype_cannot_be_viewed() -> None:
    backend = FlashInferBackend()
    trace, plan = _planned(backend, "decode-paged", *SMALL)
    flat = replace(plan, tensors={**plan.tensors, "kv_indices": plan.tensors["kv_indices"].reshape(1, -1)})
    assert out_of_bounds(trace, flat, backend) == (
        f"recorded plan not read: plan kv_indices has shape {list(flat.tensors['kv_indices'].shape)}, expected 1 dimension(s)"
    )
    floats = replace(plan, tensors={**plan.tensors, "kv_indptr": plan.tensors["kv_indptr"].float()})
    assert out_of_bounds(trace, floats, backend) == "recorded plan not read: plan kv_indptr has dtype float32, expected integer indices"


def test_replay_cli_reports_a_refused_plan_without_a_traceback(tmp_path) -> None:
    trace, plan = _planned(TritonBackend(), "verify", "prefix_lens=4,7", *SMALL)
    start = int(plan.tensors["mask_indptr"][1]) + 1
    path = io.save(replace(trace, plan=_set(plan, "mask_indptr", 1, start)), tmp_path / "hostile.pt")
    result = CliRunner().invoke(main, ["replay", str(path), "--backend", "triton", "--plan", "recorded"])
    assert result.exit_code == 1, result.output
    assert f"recorded plan mask_indptr[1] = {start}: request 1's" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception)


def test_hostile_scalars_are_refused_without_overflow() -> None:
    backend = FA3Backend()
    trace, plan = _planned(backend, "decode-paged", *FA3_SMALL)
    huge = replace(plan, scalars={**plan.scalars, "page_size": 2**62})
    assert out_of_bounds(trace, huge, backend) == f"recorded plan cannot be guarded: plan scalar page_size = {2**62}, expected a page size in [1, {2**31}]"
    triton = TritonBackend()
    trace, plan = _planned(triton, "decode-mha", "kv_lens=3,20", *SMALL)
    unbounded = _set(replace(plan, scalars={**plan.scalars, "max_kv_splits": 2**63 - 1}), "num_kv_splits", 0, 0)
    assert out_of_bounds(trace, unbounded, triton) == (
        f"recorded plan num_kv_splits[0] = 0 is outside [1, {2**63 - 1}): split counts the stage-1 scratch holds (max_kv_splits {2**63 - 1})"
    )
