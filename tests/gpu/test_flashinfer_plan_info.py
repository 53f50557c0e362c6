"""FlashInfer's own schedule of real wrappers (GPU only): decode, tensor-core decode and paged prefill
wrappers planned by the real library, eager and with CUDA graphs, on batches where split-KV engages;
the schedule read off each wrapper as the SGLang recorder reads it (`plan_from_backend`:
`_plan_info` and the pinned int workspace -> plan.plan_info) and judged by invariants/plan-info-*.

What the CPU tests (tests/checks/test_plan_schedule.py, whose schedules follow scheduler.cuh's rules
written out) cannot show: that the layout read here is the one the installed FlashInfer writes, and
that its schedule for a batch is clean by our rules. A schedule reused for a changed batch, whether
another wrapper's or a graph wrapper's buffers refilled in place without plan(), must be caught.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from attndbg.backends.base import Padding
from attndbg.backends.flashinfer import INSTALL_HINT, ExtendPath, FlashInferBackend, FlashInferOptions, _plan_decode, _plan_paged
from attndbg.backends.flashinfer_plan_info import ScheduleKind
from attndbg.detectors.invariants.detect import check_trace
from attndbg.machine import module_available
from attndbg.plans.reading import read
from attndbg.detectors.invariants.schedule import judged
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.trace import synth
from attndbg.trace.schema import DTYPES, Trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]

CAPTURE_BS = 8
HEADS = "heads=32:8"
# Long rows on few requests: batch x KV heads is far below the grid, so the schedulers split the KV.
DECODE = {"now": "kv_lens=6100,5000,7000", "earlier": "kv_lens=3000,5000,7000"}
PREFILL = {"now": "prefix_lens=6100,5000,7000", "earlier": "prefix_lens=3000,5000,7000"}
CASES = {
    "decode": ("decode", False, False),
    "decode-graph": ("decode", False, True),
    "tensor-core-decode": ("decode", True, False),
    "tensor-core-decode-graph": ("decode", True, True),
    "paged-prefill": ("prefill", False, False),
    "paged-prefill-graph": ("prefill", False, True),
}


def step(kind: str, which: str, graph: bool) -> Trace:
    if kind == "decode":
        spec = ["mode=decode", HEADS, DECODE[which]]
    else:
        # under a graph: one query a request (the padded plan is made in `planned`)
        spec = ["mode=extend", HEADS, PREFILL[which], "extend_lens=1,1,1" if graph else "extend_lens=7,1,30"]
    spec += ["page_size=1", "dtype=bfloat16", "head_dim=128"] + ([f"capture_bs={CAPTURE_BS}", "fill_value=1"] if graph and kind == "decode" else [])
    trace = synth.build(synth.parse_spec(spec))
    return replace(trace, source=replace(trace.source, backend="flashinfer"))


def wrapper_for(kind: str, tensor_cores: bool, graph: bool, max_kv: int):
    import flashinfer

    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    if not graph:
        if kind == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    buffers = {
        "indptr": torch.zeros(CAPTURE_BS + 1, dtype=torch.int32, device="cuda"),
        "indices": torch.zeros(max_kv, dtype=torch.int32, device="cuda"),
        "last": torch.zeros(CAPTURE_BS, dtype=torch.int32, device="cuda"),
    }
    if kind == "decode":
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=buffers["indptr"], paged_kv_indices_buffer=buffers["indices"], paged_kv_last_page_len_buffer=buffers["last"],
        )  # fmt: skip
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, backend="fa2",
        qo_indptr_buf=torch.zeros(CAPTURE_BS + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indptr_buf=buffers["indptr"], paged_kv_indices_buf=buffers["indices"], paged_kv_last_page_len_buf=buffers["last"],
    )  # fmt: skip


def planned(trace: Trace, kind: str, tensor_cores: bool, graph: bool, wrapper=None):
    """A real wrapper planned with the plan SGLang's backend builds for `trace` (the adapter's
    derived plan: the same arrays; graph steps padded to CAPTURE_BS)."""
    # Prefill: one causal paged pass over the whole row (the paged path), the plan SGLang's paged and verify steps build.
    adapter = FlashInferBackend(FlashInferOptions(decode_tensor_cores=tensor_cores, extend_path=ExtendPath.PAGED))
    if graph and kind == "decode":
        plan = adapter.derive_plan(trace, Padding(capture_bs=CAPTURE_BS, fill_value=1))
    else:
        plan = adapter.derive_plan(trace)
        if graph:  # padded rows as a full graph pads them: one query and one key (the dummy slot 0) each
            plan = replace(plan, tensors=padded_prefill(plan.tensors, CAPTURE_BS - trace.batch.batch_size))
    plan = replace(plan, tensors={k: v.cuda() for k, v in plan.tensors.items()})
    wrapper = wrapper or wrapper_for(kind, tensor_cores, graph, max(int(plan.tensors["kv_indices"].numel()), 1) * 2)
    dtype = DTYPES[trace.model.q_dtype]
    (_plan_decode if kind == "decode" else _plan_paged)(wrapper, trace.model, plan, q_dtype=dtype, kv_dtype=dtype)
    torch.cuda.synchronize()
    return wrapper


def padded_prefill(t: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    def grown(indptr: torch.Tensor) -> torch.Tensor:
        return torch.cat([indptr, indptr[-1] + torch.arange(1, pad + 1, dtype=indptr.dtype)])

    return {
        "qo_indptr": grown(t["qo_indptr"]),
        "kv_indptr": grown(t["kv_indptr"]),
        "kv_indices": torch.cat([t["kv_indices"], torch.zeros(pad, dtype=t["kv_indices"].dtype)]),
        "kv_last_page_len": torch.cat([t["kv_last_page_len"], torch.ones(pad, dtype=t["kv_last_page_len"].dtype)]),
    }


def recorded(trace: Trace, wrapper, kind: str, tensor_cores: bool) -> Trace:
    """The step as the SGLang recorder writes it from the live wrapper."""
    md = SimpleNamespace(decode_wrappers=[wrapper]) if kind == "decode" else SimpleNamespace(prefill_wrappers=[wrapper], use_ragged=False, extend_no_prefix=False)
    plan = plan_from_backend(SimpleNamespace(forward_metadata=md, decode_use_tensor_cores=tensor_cores, page_size=1), model=trace.model)
    assert plan is not None and plan.plan_info is not None, "the recorder kept no plan info"
    return replace(trace, plan=plan)


def schedule_findings(trace: Trace) -> list[tuple[str, str, str]]:
    return [(f.check, f.location.field or "", f.evidence) for f in check_trace(trace) if f.check.startswith("plan-info")]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_real_schedules_are_clean_and_a_reused_one_is_caught(case) -> None:
    kind, cores, graph = case
    now, earlier = step(kind, "now", graph), step(kind, "earlier", graph)
    trace = recorded(now, planned(now, kind, cores, graph), kind, cores)
    facts = read(trace).schedule
    assert facts is not None, "the recorded plan info was not read"
    schedule = facts.schedule
    assert schedule.kind is (ScheduleKind.DECODE if kind == "decode" and not cores else ScheduleKind.PREFILL)
    assert schedule.split_kv, f"split-KV did not engage: {schedule.info}"
    assert bool(schedule.graph) == graph
    assert schedule_findings(trace) == []

    # Another wrapper's schedule, planned for the earlier batch, with this batch's indices.
    stale = planned(earlier, kind, cores, graph)
    reused = replace(trace, plan=replace(trace.plan, plan_info=recorded(earlier, stale, kind, cores).plan.plan_info))
    if judged(facts):
        assert schedule_findings(reused), "a schedule planned for the earlier batch was not caught"
    else:  # an eager prefill-kind schedule is read, not judged (invariants/schedule.py says why)
        assert schedule_findings(reused) == []


@pytest.mark.parametrize("case", [CASES["decode-graph"], CASES["tensor-core-decode-graph"], CASES["paged-prefill-graph"]], ids=["decode", "tensor-core-decode", "paged-prefill"])
def test_a_graph_wrapper_refilled_without_plan_is_caught(case) -> None:
    """An engine that copies the new batch into the captured buffers but skips plan(): the buffers
    describe this batch, the schedule the last one."""
    kind, cores, graph = case
    now, earlier = step(kind, "now", graph), step(kind, "earlier", graph)
    # Both captured with room for the larger batch, as an engine sizes its graph buffers.
    room = 2 * max(int(t.batch.kv_lens.sum()) + CAPTURE_BS for t in (now, earlier))
    wrapper = planned(earlier, kind, cores, graph, wrapper_for(kind, cores, graph, room))
    fresh = planned(now, kind, cores, graph, wrapper_for(kind, cores, graph, room))  # the same arrays a correct plan() would copy in
    for name in ("_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf", "_qo_indptr_buf"):
        if getattr(wrapper, name, None) is not None and getattr(fresh, name, None) is not None:
            source = getattr(fresh, name)
            getattr(wrapper, name)[: source.numel()].copy_(source)
    torch.cuda.synchronize()
    found = schedule_findings(recorded(now, wrapper, kind, cores))
    assert found, "the stale schedule of a refilled graph wrapper was not caught"
    assert schedule_findings(recorded(now, fresh, kind, cores)) == []
