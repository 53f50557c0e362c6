"""Plans as the SGLang recorder writes them, replayed through the real kernels (GPU only): the
recorder's reader (`plan_from_backend`) given SGLang's FlashInfer metadata for a synth step (the
wrapper attributes FlashInfer's plan() leaves: `_paged_kv_*_buf`, `_qo_indptr_buf`, and for a verify
step the mask packed little-endian per request in `_custom_mask_buf` / `_mask_indptr_buf`), the
recorded plan replayed beside the derived one and compared with the float64 reference: each must
pass. What the CPU round trips (tests/record/test_sglang_plan_contract.py) cannot show: that the
scalars and the packed mask the recorder writes drive FlashInfer to the right output.

The metadata objects are namespaces with the attribute names SGLang and FlashInfer use (no SGLang
import: the GPU machine need not have it); the values are the adapter's own derived plan, which the
clean sweep holds to the reference.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from attndbg.backends import fa3
from attndbg.backends.fa3 import FA3Backend
from attndbg.backends.flashinfer import INSTALL_HINT, FlashInferBackend
from attndbg.machine import module_available
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.trace import io, synth
from attndbg.trace.schema import Trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]


def packed(mask: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_packbits(mask, cumsum(sizes), bitorder="little"), written out."""
    out, offsets, start = [], [0], 0
    for size in sizes:
        bits = torch.nn.functional.pad(mask[start : start + size].to(torch.int64), (0, (-size) % 8)).view(-1, 8)
        start += size
        out.append((bits << torch.arange(8)).sum(1).to(torch.uint8))
        offsets.append(offsets[-1] + bits.shape[0])
    return torch.cat(out), torch.tensor(offsets, dtype=torch.int32)


def sglang_backend(trace: Trace) -> SimpleNamespace:
    """SGLang's FlashInferAttnBackend holding the metadata of `trace`'s step, built from the adapter's
    derived plan: DecodeMetadata(decode_wrappers) or PrefillMetadata(prefill_wrappers, use_ragged,
    extend_no_prefix), the wrapper's buffers as plan() leaves them."""
    plan = FlashInferBackend().derive_plan(trace)
    t = plan.tensors
    wrapper = SimpleNamespace(
        _paged_kv_indptr_buf=t["kv_indptr"],
        _paged_kv_indices_buf=torch.cat([t["kv_indices"], torch.zeros(256, dtype=t["kv_indices"].dtype)]),  # SGLang's slack
        _paged_kv_last_page_len_buf=t["kv_last_page_len"],
        _use_tensor_cores=bool(plan.scalars.get("use_tensor_cores", False)),
        is_cuda_graph_enabled=False,
    )
    if "qo_indptr" in t:
        wrapper._qo_indptr_buf = t["qo_indptr"]
    if "custom_mask" in t:
        pages = t["kv_indptr"].to(torch.int64).diff()
        sizes = (t["qo_indptr"].to(torch.int64).diff() * pages).tolist()  # page size 1: pages are tokens
        wrapper._custom_mask_buf, wrapper._mask_indptr_buf = packed(t["custom_mask"], sizes)
    path = plan.scalars["path"]
    if path == "decode":
        md = SimpleNamespace(decode_wrappers=[wrapper])
    else:
        md = SimpleNamespace(prefill_wrappers=[wrapper], use_ragged=path in ("ragged", "cascade"), extend_no_prefix=path == "ragged")
    return SimpleNamespace(forward_metadata=md, decode_use_tensor_cores=wrapper._use_tensor_cores, page_size=1)


@pytest.mark.parametrize("preset", ["decode-gqa", "extend-noprefix", "extend-prefix", "verify"])
def test_recorded_flashinfer_plan_passes_the_reference(preset: str, tmp_path) -> None:
    trace = synth.build(synth.parse_spec([preset, "page_size=1"]))
    verify = trace.is_tree_verify
    spec_info = SimpleNamespace(draft_token_num=trace.spec.draft_token_num) if verify else None
    recorded = plan_from_backend(sglang_backend(trace), model=trace.model, verify=verify, spec_info=spec_info)
    assert ("packed_custom_mask" in recorded.tensors) == verify
    trace = replace(trace, source=replace(trace.source, backend="flashinfer"), plan=recorded)
    path = io.save(trace, tmp_path / f"{preset}.pt")
    result = replay(io.load(path), str(path), ["reference", "flashinfer"], ReplayOptions(plan=PlanSource.BOTH))
    runs = {(run.name, run.variant.label): run for run in result.runs if run.name == "flashinfer"}
    assert ("flashinfer", "recorded plan") in runs, list(runs)
    for run in runs.values():
        assert run.status is RunStatus.PASSED, (run.variant, run.reason, run.comparison)


def sglang_fa3_backend(trace: Trace) -> SimpleNamespace:
    """SGLang's FlashAttentionBackend holding FlashAttentionMetadata for `trace`'s step (and, for a
    tree verify, forward_metadata_spec_decode_expand), built from the fa3 adapter's derived plan."""
    plan = FA3Backend().derive_plan(trace)
    t, s = plan.tensors, plan.scalars

    def metadata(prefix: str) -> SimpleNamespace:
        return SimpleNamespace(
            cache_seqlens_int32=t[f"{prefix}cache_seqlens"],
            cu_seqlens_q=t[f"{prefix}cu_seqlens_q"],
            cu_seqlens_k=t[f"{prefix}cu_seqlens_k"],
            page_table=t[f"{prefix}page_table"],
            max_seq_len_q=s[f"{prefix}max_seqlen_q"],
            max_seq_len_k=s[f"{prefix}max_seqlen_k"],
        )

    expand = metadata("expand_") if "expand_page_table" in t else None
    topk = trace.spec.topk if trace.spec is not None else 0
    return SimpleNamespace(forward_metadata=metadata(""), forward_metadata_spec_decode_expand=expand, topk=topk, page_size=trace.model.page_size)


@pytest.mark.skipif(fa3.select_impl() is None, reason="no FlashAttention-3 implementation on this machine")
@pytest.mark.parametrize("preset", ["decode-gqa", "extend-prefix", "verify", "verify-chain"])
def test_recorded_fa3_plan_passes_the_reference(preset: str, tmp_path) -> None:
    trace = synth.build(synth.parse_spec([preset]))
    verify = trace.spec is not None
    spec_info = SimpleNamespace(draft_token_num=trace.spec.draft_token_num) if verify else None
    recorded = plan_from_backend(sglang_fa3_backend(trace), model=trace.model, verify=verify, spec_info=spec_info)
    trace = replace(trace, source=replace(trace.source, backend="fa3"), plan=recorded)
    path = io.save(trace, tmp_path / f"{preset}.pt")
    result = replay(io.load(path), str(path), ["reference", "fa3"], ReplayOptions(plan=PlanSource.BOTH))
    runs = {(run.name, run.variant.label): run for run in result.runs if run.name == "fa3"}
    assert ("fa3", "recorded plan") in runs, list(runs)
    for run in runs.values():
        assert run.status is RunStatus.PASSED, (run.variant, run.reason, run.comparison)
