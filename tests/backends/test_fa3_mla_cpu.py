"""fa3 and mla adapters without a GPU: imports, reasons, and their plans against hand-computed values.

The plans are checked on small hand-built batches whose expected page tables, lengths and
draft-block orderings are written out below from the definitions (FA3: page ids of each
request's row; SGLang's two-call verify: allowed draft columns first), not from the code.
The two-call merge is checked on its own (disjoint halves merge to attention over the union); the
kernels themselves are judged on the real library only (tests/gpu/test_fa3.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attndbg import machine
from attndbg.backends import fa3, mla
from attndbg.backends.base import Padding
from attndbg.backends.fa3 import FA3Backend, FA3Options, Impl, flashinfer_paged_kv
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.triton import TritonBackend
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace.schema import AttentionKind, Batch, ForwardMode, MaskLayout, Model, Source, Spec, Trace
from tests.factories import make_trace


def _trace(
    rows: list[list[int]],
    extend: list[int],
    *,
    page_size: int = 1,
    mode: ForwardMode = ForwardMode.DECODE,
    parents: list[list[int]] | None = None,
    attention: AttentionKind = AttentionKind.MHA,
    kv_cache_size: int = 512,
) -> Trace:
    """A batch from explicit KV rows (slot ids per request) and query counts (the row's tail)."""
    kv = [len(r) for r in rows]
    prefix = [k - e for k, e in zip(kv, extend)]
    query_cols = torch.cat([torch.arange(p, k) for p, k in zip(prefix, kv)])
    out_cache_loc = torch.cat([torch.tensor(r[p:], dtype=torch.int64) for r, p in zip(rows, prefix)])
    mla_model = attention is AttentionKind.MLA
    model = Model(
        num_qo_heads=4,
        num_kv_heads=1 if mla_model else 2,
        head_dim=576 if mla_model else 64,
        v_head_dim=512 if mla_model else 64,
        attention=attention,
        kv_lora_rank=512 if mla_model else 0,
        qk_rope_head_dim=64 if mla_model else 0,
        sm_scale=0.125,
        logit_cap=0.0,
        sliding_window=-1,
        q_dtype="bfloat16",
        kv_dtype="bfloat16",
        page_size=page_size,
    )
    batch = Batch(
        forward_mode=mode,
        prefix_lens=torch.tensor(prefix),
        extend_lens=torch.tensor(extend),
        kv_lens=torch.tensor(kv),
        slot_indptr=torch.tensor([0] + list(torch.tensor(kv).cumsum(0).tolist())),
        slot_ids=torch.tensor([s for r in rows for s in r], dtype=torch.int64),
        query_cols=query_cols,
        out_cache_loc=out_cache_loc,
        positions=query_cols.clone(),
        seq_lens_raw=torch.tensor(prefix if mode is ForwardMode.TARGET_VERIFY else kv),
        kv_cache_size=kv_cache_size,
    )
    spec = None
    if parents is not None:
        spec = Spec(
            algorithm="EAGLE",
            draft_token_num=len(parents[0]),
            topk=2,
            steps=3,
            parents=torch.tensor(parents),
            custom_mask=None,
            mask_layout=MaskLayout.FULL,
        )
    source = Source("test", "0", "fa3", "cpu", 0, 0, "0")
    return Trace(source=source, model=model, batch=batch, seed=0, spec=spec)


def _no_gpu(monkeypatch: pytest.MonkeyPatch, *, libraries: tuple[str, ...] = ()) -> None:
    monkeypatch.setattr(machine, "gpu_info", lambda: None)
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    monkeypatch.setattr(machine, "module_available", lambda name: name in libraries or name == "triton")


# -- imports and reasons ----------------------------------------------------------------------


def test_modules_import_without_flashinfer_or_cuda() -> None:
    code = (
        "import sys; import attndbg.backends.fa3, attndbg.backends.mla\n"
        "from attndbg.backends import registry\n"
        "registry.create('fa3'); registry.create('mla')\n"
        "heavy = [m for m in ('flashinfer', 'flash_attn_interface', 'sgl_kernel', 'vllm', 'flash_mla') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fa3_unavailable_names_the_missing_gpu_and_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    reason = FA3Backend().unavailable_reason()
    assert "CUDA GPU" in reason
    for library in ("flash_attn_interface", "sgl-kernel", "vllm", "flashinfer"):
        assert library in reason


def test_fa3_flashinfer_path_needs_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    ampere = machine.GpuInfo(name="NVIDIA A100", capability=(8, 0), num_sms=108, total_memory=0)
    monkeypatch.setattr(machine, "gpu_info", lambda: ampere)
    monkeypatch.setattr(machine, "module_available", lambda name: name == "flashinfer")
    assert fa3.select_impl() is None
    reason = FA3Backend().unavailable_reason()
    assert "SM90" in reason and "sm80" in reason and "backend='fa3'" in reason


def test_fa3_picks_implementations_in_fa3_order(monkeypatch: pytest.MonkeyPatch) -> None:
    hopper = machine.GpuInfo(name="NVIDIA H200", capability=(9, 0), num_sms=132, total_memory=0)
    monkeypatch.setattr(machine, "gpu_info", lambda: hopper)
    for installed, expected in [
        ({"flashinfer", "vllm", "sgl_kernel", "flash_attn_interface"}, Impl.FLASH_ATTN_INTERFACE),
        ({"flashinfer", "vllm", "sgl_kernel"}, Impl.SGL_KERNEL),
        ({"flashinfer", "vllm"}, Impl.VLLM),
        ({"flashinfer"}, Impl.FLASHINFER),
    ]:
        monkeypatch.setattr(machine, "module_available", lambda name, s=installed: name in s)
        assert fa3.select_impl() is expected


def test_mla_unavailable_names_gpu_and_library(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    reason = MLABackend(MLAOptions("flashinfer")).unavailable_reason()
    assert "CUDA GPU" in reason and "flashinfer" in reason
    reason = MLABackend(MLAOptions("flashmla")).unavailable_reason()
    assert "CUDA GPU" in reason and "flash_mla" in reason
    auto = MLABackend()
    assert auto.impl() is mla.MLAImpl.TRITON  # auto falls back to our kernel, and says so
    assert "Triton" in auto.describe()


def test_options_reject_unknown_values() -> None:
    with pytest.raises(ValueError, match="two-call"):
        FA3Options(verify_path="cascade")
    with pytest.raises(ValueError, match="flashmla"):
        MLAOptions(impl="cutlass")


def test_unsupported_reasons_say_what_and_why() -> None:
    fa, mla_backend = FA3Backend(), MLABackend(MLAOptions("flashinfer"))
    assert "mla backend" in fa.unsupported_reason(make_trace("mla-decode"))
    assert "not an MLA model" in mla_backend.unsupported_reason(make_trace("decode-gqa"))
    assert "FA3 masks are causal or sliding-window only" in fa.unsupported_reason(make_trace("selective"))
    tree = make_trace("verify")
    assert fa.unsupported_reason(tree) is None  # auto: SGLang's two-call path
    masked = FA3Backend(FA3Options(verify_path="mask")).unsupported_reason(tree)
    assert "custom mask" in masked and "two-call" in masked
    assert "sliding window" in fa.unsupported_reason(make_trace("verify", "window=20"))
    mla_tree = make_trace("mla-decode", "mode=verify", "prefix_lens=10,20", "topk=2", "steps=2", "draft_tokens=4")
    assert "FlashInfer's MLA kernels take no custom mask" in mla_backend.unsupported_reason(mla_tree)
    mla_chain = make_trace("mla-decode", "mode=verify", "prefix_lens=10,20", "topk=1", "steps=3", "draft_tokens=4")
    assert mla_backend.unsupported_reason(mla_chain) is None
    assert "decode only" in MLABackend(MLAOptions("triton")).unsupported_reason(mla_chain)
    assert "64-token blocks" in MLABackend(MLAOptions("flashmla")).unsupported_reason(make_trace("mla-decode"))


# -- fa3 plans --------------------------------------------------------------------------------


def test_fa3_decode_plan_page_1() -> None:
    trace = _trace([[7, 3, 9], [12, 4, 5, 6, 30]], [1, 1])
    plan = FA3Backend().derive_plan(trace)
    t = plan.tensors
    assert t["page_table"].tolist() == [[7, 3, 9, 0, 0], [12, 4, 5, 6, 30]]
    assert t["cache_seqlens"].tolist() == [3, 5]
    assert t["cu_seqlens_q"].tolist() == [0, 1, 2]
    assert t["cu_seqlens_k"].tolist() == [0, 3, 8]
    assert all(v.dtype == torch.int32 for v in t.values())
    assert plan.scalars["causal"] is True and plan.scalars["max_seqlen_q"] == 1 and plan.scalars["max_seqlen_k"] == 5


def test_fa3_extend_plan_page_64() -> None:
    # Request 0: 70 columns on pages 5, 2; request 1: 3 columns on page 9. Two query tokens each.
    rows = [list(range(320, 384)) + list(range(128, 134)), [576, 577, 578]]
    trace = _trace(rows, [2, 2], page_size=64, mode=ForwardMode.EXTEND, kv_cache_size=640)
    plan = FA3Backend().derive_plan(trace)
    assert plan.tensors["page_table"].tolist() == [[5, 2], [9, 0]]
    assert plan.tensors["cache_seqlens"].tolist() == [70, 3]
    assert plan.tensors["cu_seqlens_q"].tolist() == [0, 2, 4]
    assert plan.scalars["page_size"] == 64 and plan.scalars["max_seqlen_q"] == 2


def test_fa3_padded_decode_rows() -> None:
    trace = _trace([[7, 3, 9], [12, 4]], [1, 1])
    plan = FA3Backend().derive_plan(trace, Padding(capture_bs=4, fill_value=1, dummy_slot=0))
    t = plan.tensors
    assert t["page_table"].tolist() == [[7, 3, 9], [12, 4, 0], [0, 0, 0], [0, 0, 0]]
    assert t["cache_seqlens"].tolist() == [3, 2, 1, 1]
    assert t["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]


def test_fa3_padded_chain_verify_rows_carry_their_draft_tokens() -> None:
    # Prefix [1, 2] + 3 chain drafts [5, 6, 7]; padded with fill 2: 2 + 3 columns at slot 0.
    trace = _trace([[1, 2, 5, 6, 7]], [3], mode=ForwardMode.TARGET_VERIFY, parents=[[-1, 0, 1]])
    plan = FA3Backend().derive_plan(trace, Padding(capture_bs=2, fill_value=2, dummy_slot=0))
    assert plan.scalars["verify_path"] == "causal" and plan.scalars["causal"] is True
    assert plan.tensors["page_table"].tolist() == [[1, 2, 5, 6, 7], [0, 0, 0, 0, 0]]
    assert plan.tensors["cache_seqlens"].tolist() == [5, 5]
    assert plan.tensors["cu_seqlens_q"].tolist() == [0, 3, 6]


def test_fa3_two_call_plan_for_a_known_tree() -> None:
    # Prefix slots [10, 11]; drafts 0..3 in slots [20, 21, 22, 23]; tree 0 -> {1, 2}, 1 -> {3}.
    # Each token sees itself and its ancestors: 0: {0}; 1: {0,1}; 2: {0,2}; 3: {0,1,3}.
    trace = _trace([[10, 11, 20, 21, 22, 23]], [4], mode=ForwardMode.TARGET_VERIFY, parents=[[-1, 0, 0, 1]])
    plan = FA3Backend().derive_plan(trace)
    t, s = plan.tensors, plan.scalars
    assert s["verify_path"] == "two-call"
    # Call 1: the four drafts over the prefix, non-causal.
    assert t["page_table"].tolist() == [[10, 11]]
    assert t["cache_seqlens"].tolist() == [2]
    assert t["cu_seqlens_q"].tolist() == [0, 4]
    assert s["causal"] is False and s["max_seqlen_q"] == 4
    # Call 2: one request per draft; its allowed draft slots first (column order), then the rest.
    assert t["expand_page_table"].tolist() == [
        [20, 21, 22, 23],
        [20, 21, 22, 23],
        [20, 22, 21, 23],
        [20, 21, 23, 22],
    ]
    assert t["expand_cache_seqlens"].tolist() == [1, 2, 2, 3]
    assert t["expand_cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert t["expand_cu_seqlens_k"].tolist() == [0, 1, 3, 5, 8]
    assert s["expand_causal"] is False and s["expand_page_size"] == 1 and s["expand_max_seqlen_q"] == 1


def test_fa3_two_call_is_forced_for_a_chain_when_asked() -> None:
    trace = _trace([[1, 2, 5, 6, 7]], [3], mode=ForwardMode.TARGET_VERIFY, parents=[[-1, 0, 1]])
    plan = FA3Backend(FA3Options(verify_path="two-call")).derive_plan(trace)
    assert plan.tensors["expand_page_table"].tolist() == [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    assert plan.tensors["expand_cache_seqlens"].tolist() == [1, 2, 3]


def test_flashinfer_translation_of_a_page_table() -> None:
    table = torch.tensor([[5, 2, 0], [9, 0, 0], [0, 0, 0]], dtype=torch.int32)
    indptr, indices, last = flashinfer_paged_kv(table, torch.tensor([70, 3, 0], dtype=torch.int32), 64)
    assert indptr.tolist() == [0, 2, 3, 3]
    assert indices.tolist() == [5, 2, 9]
    assert last.tolist() == [6, 3, 0]  # an empty request has no pages and last_page_len 0


def test_merge_of_disjoint_halves_is_attention_over_the_union() -> None:
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(2, 3, 10, generator=g, dtype=torch.float64), torch.randn(10, 8, generator=g, dtype=torch.float64)
    full = torch.softmax(scores, -1) @ values

    def part(cols: slice):
        s = scores[..., cols]
        return fa3.AttentionResult(output=torch.softmax(s, -1) @ values[cols], lse=torch.logsumexp(s, -1))

    merged = fa3.merge_states(part(slice(0, 4)), part(slice(4, 10)), dtype=torch.float64)
    assert torch.allclose(merged.output, full, atol=1e-6)
    assert torch.allclose(merged.lse, torch.logsumexp(scores, -1).float(), atol=1e-5)  # LSEs merge in float32
    empty = fa3.AttentionResult(output=torch.full_like(full, float("nan")), lse=torch.full((2, 3), float("-inf"), dtype=torch.float64))
    alone = fa3.merge_states(empty, part(slice(0, 10)), dtype=torch.float64)
    assert torch.allclose(alone.output, full, atol=1e-6)  # an empty side's NaN output is ignored


# -- mla plans --------------------------------------------------------------------------------


def test_mla_flashinfer_plan_page_1_and_64() -> None:
    backend = MLABackend(MLAOptions("flashinfer"))
    page1 = backend.derive_plan(_trace([[7, 3, 9], [12, 4]], [1, 1], attention=AttentionKind.MLA))
    assert page1.tensors["qo_indptr"].tolist() == [0, 1, 2]
    assert page1.tensors["kv_indptr"].tolist() == [0, 3, 5]
    assert page1.tensors["kv_indices"].tolist() == [7, 3, 9, 12, 4]
    assert page1.tensors["kv_len_arr"].tolist() == [3, 2]
    assert page1.scalars == {"impl": "flashinfer", "page_size": 1, "causal": False}
    rows = [list(range(320, 384)) + list(range(128, 134)), [576, 577, 578]]
    page64 = backend.derive_plan(_trace(rows, [1, 1], page_size=64, attention=AttentionKind.MLA, kv_cache_size=640))
    assert page64.tensors["kv_indptr"].tolist() == [0, 2, 3]
    assert page64.tensors["kv_indices"].tolist() == [5, 2, 9]
    assert page64.tensors["kv_len_arr"].tolist() == [70, 3]
    assert all(v.dtype == torch.int32 for v in page64.tensors.values())


def test_mla_flashinfer_padded_rows() -> None:
    backend = MLABackend(MLAOptions("flashinfer"))
    trace = _trace([[7, 3, 9], [12, 4]], [1, 1], attention=AttentionKind.MLA)
    plan = backend.derive_plan(trace, Padding(capture_bs=4, fill_value=1, dummy_slot=0))
    assert plan.tensors["qo_indptr"].tolist() == [0, 1, 2, 3, 4]
    assert plan.tensors["kv_indptr"].tolist() == [0, 3, 5, 6, 7]
    assert plan.tensors["kv_indices"].tolist() == [7, 3, 9, 12, 4, 0, 0]
    assert plan.tensors["kv_len_arr"].tolist() == [3, 2, 1, 1]


def test_mla_flashinfer_verify_chain_is_causal() -> None:
    trace = _trace([[1, 2, 5, 6, 7]], [3], mode=ForwardMode.TARGET_VERIFY, parents=[[-1, 0, 1]], attention=AttentionKind.MLA)
    plan = MLABackend(MLAOptions("flashinfer")).derive_plan(trace)
    assert plan.scalars["causal"] is True
    assert plan.tensors["qo_indptr"].tolist() == [0, 3] and plan.tensors["kv_len_arr"].tolist() == [5]


def test_mla_flashmla_plan_uses_64_token_blocks() -> None:
    rows = [list(range(320, 384)) + list(range(128, 134)), [576, 577, 578]]
    plan = MLABackend(MLAOptions("flashmla")).derive_plan(_trace(rows, [1, 1], page_size=64, attention=AttentionKind.MLA, kv_cache_size=640))
    assert plan.tensors["block_table"].tolist() == [[5, 2], [9, 0]]
    assert plan.tensors["cache_seqlens"].tolist() == [70, 3]
    assert plan.scalars["q_len"] == 1


def test_mla_triton_plan_is_the_triton_backends_plan() -> None:
    trace = make_trace("mla-decode")
    padding = Padding(capture_bs=5, fill_value=1)
    ours = MLABackend(MLAOptions("triton")).derive_plan(trace, padding)
    theirs = TritonBackend().derive_plan(trace, padding)
    assert ours.tensors.keys() == theirs.tensors.keys()
    assert all(torch.equal(ours.tensors[k], theirs.tensors[k]) for k in theirs.tensors)
    assert ours.scalars == {**theirs.scalars, "impl": "triton"}


@pytest.mark.skipif(machine.cuda_available(), reason="with a GPU, impl='auto' picks FlashInfer MLA (tests/gpu covers it)")
def test_mla_triton_decode_passes_on_the_cpu_interpreter() -> None:
    backend_trace = make_trace("mla-decode", "kv_lens=5,33", "heads=16")
    result = replay(backend_trace, "x", ["mla"])
    run = result.runs[0]
    assert run.status is RunStatus.PASSED, (run.reason, run.comparison)
    assert "Triton" in run.description  # auto without a GPU: our kernel, named
