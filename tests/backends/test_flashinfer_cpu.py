"""The flashinfer adapter without a GPU: import, availability, and the plans it derives.

Every expected plan below is written out by hand from the rows chosen here (SGLang's FlashInfer
vocabulary: page ids, int32 indptrs, last-page lengths, FULL-layout masks), not read back from the
code under test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attndbg import machine
from attndbg.backends import registry
from attndbg.backends.base import Padding
from attndbg.backends.flashinfer import (
    INSTALL_HINT,
    ExtendPath,
    FlashInferBackend,
    FlashInferOptions,
    sglang_uses_tensor_cores,
)
from attndbg.trace.schema import AttentionKind, Batch, ForwardMode, MaskLayout, Model, Source, Spec, Trace
from attndbg.trace.schema import to_dict
from attndbg.trace.validate import TraceError, from_dict
from tests.factories import make_trace

T, F = True, False


def hand_trace(
    *,
    mode: ForwardMode,
    rows: list[list[int]],
    extend_lens: list[int],
    page_size: int = 1,
    window: int = -1,
    parents: list[list[int]] | None = None,
    query_cols: list[list[int]] | None = None,
    q_dtype: str = "bfloat16",
) -> Trace:
    """A trace whose KV rows (slot ids) are exactly `rows`; new tokens are each row's tail unless
    `query_cols` says otherwise (selective recompute)."""
    kv = [len(r) for r in rows]
    prefix = [k - e for k, e in zip(kv, extend_lens)]
    cols = query_cols or [list(range(p, k)) for p, k in zip(prefix, kv)]
    slots = [torch.tensor(r, dtype=torch.int64) for r in rows]
    spec = None
    if parents is not None:
        spec = Spec(
            algorithm="EAGLE",
            draft_token_num=len(parents[0]),
            topk=2,
            steps=2,
            parents=torch.tensor(parents, dtype=torch.int64),
            custom_mask=None,
            mask_layout=MaskLayout.FULL,
        )
    biggest = max(max(r) for r in rows) + 1
    batch = Batch(
        forward_mode=mode,
        prefix_lens=torch.tensor(prefix),
        extend_lens=torch.tensor(extend_lens),
        kv_lens=torch.tensor(kv),
        slot_indptr=torch.nn.functional.pad(torch.cumsum(torch.tensor(kv), 0), (1, 0)),
        slot_ids=torch.cat(slots),
        query_cols=torch.tensor([c for cs in cols for c in cs], dtype=torch.int64),
        out_cache_loc=torch.cat([s[torch.tensor(c, dtype=torch.int64)] for s, c in zip(slots, cols)]),
        positions=torch.tensor([c for cs in cols for c in cs], dtype=torch.int64),
        seq_lens_raw=torch.tensor(kv),
        kv_cache_size=-(-biggest // page_size) * page_size,
        selective=query_cols is not None,
    )
    model = Model(
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=32,  # FlashInfer's prefill kernels need head_dim >= 32
        v_head_dim=32,
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=32**-0.5,
        logit_cap=0.0,
        sliding_window=window,
        q_dtype=q_dtype,
        kv_dtype=q_dtype,
        page_size=page_size,
    )
    source = Source("test", "0", "flashinfer", "cpu", 0, 0, "0")
    return Trace(source=source, model=model, batch=batch, seed=0, spec=spec)


def page_slots(pages: list[int], n: int, page_size: int = 16) -> list[int]:
    """The first n slots of the given pages laid end to end."""
    return [p * page_size + j for p in pages for j in range(page_size)][:n]


def ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32, t.dtype
    return t.tolist()


def plan_of(trace: Trace, padding: Padding | None = None, **options):
    return FlashInferBackend(FlashInferOptions(**options)).derive_plan(trace, padding)


# -- import and availability ------------------------------------------------------------------


def test_module_imports_without_importing_flashinfer():
    code = "import sys, attndbg.backends.flashinfer; print('flashinfer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_registry_builds_it_with_no_arguments():
    backend = registry.create("flashinfer")
    assert isinstance(backend, FlashInferBackend)
    assert backend.options == FlashInferOptions()
    assert backend.device() == "cuda"


def test_unavailable_without_a_gpu(monkeypatch):
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    assert "no CUDA GPU" in FlashInferBackend().unavailable_reason()


def test_unavailable_without_the_library(monkeypatch):
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(machine, "module_available", lambda name: name != "flashinfer")
    monkeypatch.setattr(machine, "gpu_info", lambda: machine.GpuInfo("H100", (9, 0), 132, 80 << 30))
    assert FlashInferBackend().unavailable_reason() == "flashinfer is not installed: `pip install 'attndbg[flashinfer]'`"
    assert INSTALL_HINT == "flashinfer is not installed: `pip install 'attndbg[flashinfer]'`"


def test_unavailable_on_a_pre_ampere_gpu(monkeypatch):
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(machine, "module_available", lambda name: True)
    monkeypatch.setattr(machine, "gpu_info", lambda: machine.GpuInfo("T4", (7, 5), 40, 16 << 30))
    assert "sm75" in FlashInferBackend().unavailable_reason()
    monkeypatch.setattr(machine, "gpu_info", lambda: machine.GpuInfo("H100", (9, 0), 132, 80 << 30))
    assert FlashInferBackend().unavailable_reason() is None


@pytest.mark.skipif(machine.cuda_available(), reason="checks this machine's missing GPU")
def test_this_cpu_machine_is_told_why():
    assert "no CUDA GPU" in FlashInferBackend().unavailable_reason()


# -- options and SGLang's choices -------------------------------------------------------------


def test_options_take_strings_and_reject_unknown_paths():
    assert FlashInferOptions(extend_path="paged").extend_path is ExtendPath.PAGED
    with pytest.raises(ValueError, match="extend_path='sideways'"):
        FlashInferOptions(extend_path="sideways")


def test_sglang_tensor_core_rule():
    assert sglang_uses_tensor_cores("bfloat16", 32, 8) is False  # group 4: SGLang needs > 4
    assert sglang_uses_tensor_cores("float16", 32, 4) is True  # group 8
    assert sglang_uses_tensor_cores("float8_e4m3fn", 8, 8) is True  # fp8 KV always
    assert sglang_uses_tensor_cores("float32", 32, 4) is False
    trace = make_trace("decode-gqa")  # 32:8
    assert FlashInferBackend().derive_plan(trace).scalars["use_tensor_cores"] is False
    assert plan_of(trace, decode_tensor_cores=True).scalars["use_tensor_cores"] is True
    assert plan_of(make_trace("decode-gqa", "heads=32:4")).scalars["use_tensor_cores"] is True


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        (("decode-gqa",), "decode"),
        (("extend-noprefix",), "ragged"),
        (("extend-prefix",), "cascade"),
        (("mixed",), "cascade"),
        (("window",), "paged"),  # SGLang: "window attention use paged only"
        (("selective",), "paged"),
        (("verify",), "paged"),
    ],
)
def test_auto_picks_sglangs_path(spec, path):
    assert FlashInferBackend().derive_plan(make_trace(*spec)).scalars["path"] == path


# -- decode plans -----------------------------------------------------------------------------


def test_decode_page1_indices_are_slot_ids():
    # Two requests sharing the prefix slots [7, 3], as a radix cache shares them.
    trace = hand_trace(mode=ForwardMode.DECODE, rows=[[7, 3, 9], [7, 3, 4, 11, 12]], extend_lens=[1, 1])
    plan = plan_of(trace)
    assert ints(plan.tensors["kv_indptr"]) == [0, 3, 8]
    assert ints(plan.tensors["kv_indices"]) == [7, 3, 9, 7, 3, 4, 11, 12]
    assert ints(plan.tensors["kv_last_page_len"]) == [1, 1]
    assert plan.scalars["page_size"] == 1 and plan.scalars["window_left"] == -1


def test_decode_page16_indices_are_page_ids():
    # Request 0: 20 tokens on pages 2, 5; request 1: 33 tokens on pages 2 (shared), 7, 3.
    rows = [page_slots([2, 5], 20), page_slots([2, 7, 3], 33)]
    plan = plan_of(hand_trace(mode=ForwardMode.DECODE, rows=rows, extend_lens=[1, 1], page_size=16))
    assert ints(plan.tensors["kv_indptr"]) == [0, 2, 5]
    assert ints(plan.tensors["kv_indices"]) == [2, 5, 2, 7, 3]
    assert ints(plan.tensors["kv_last_page_len"]) == [4, 1]  # 20 = 16 + 4, 33 = 32 + 1


def test_decode_pages_match_a_slot_walk_on_a_synth_trace():
    trace = make_trace("decode-paged")
    plan = plan_of(trace)
    expected_pages, expected_last = [], []
    for b in range(trace.batch.batch_size):
        pages: list[int] = []
        for slot in trace.batch.request_slots(b).tolist():
            if slot % 16 == 0:
                pages.append(slot // 16)
        expected_pages += pages
        expected_last.append(int(trace.batch.kv_lens[b]) - 16 * (len(pages) - 1))
    assert ints(plan.tensors["kv_indices"]) == expected_pages
    assert ints(plan.tensors["kv_last_page_len"]) == expected_last


def test_decode_sliding_window_passes_only_the_window():
    trace = hand_trace(mode=ForwardMode.DECODE, rows=[[5, 6, 7, 8, 9]], extend_lens=[1], window=2)
    plan = plan_of(trace)
    assert ints(plan.tensors["kv_indices"]) == [7, 8, 9]  # the query (col 4) sees cols 2..4
    assert plan.scalars["window_left"] == 2
    # Page 16: 40 tokens on pages 4, 1, 6, window 20 -> cols 19..39 -> whole pages from col 16.
    paged = hand_trace(mode=ForwardMode.DECODE, rows=[page_slots([4, 1, 6], 40)], extend_lens=[1], page_size=16, window=20)
    plan = plan_of(paged)
    assert ints(plan.tensors["kv_indices"]) == [1, 6]
    assert ints(plan.tensors["kv_last_page_len"]) == [8]  # 24 columns passed = 16 + 8


def test_decode_padded_rows():
    trace = hand_trace(mode=ForwardMode.DECODE, rows=[[7, 3, 9], [7, 3, 4, 11, 12]], extend_lens=[1, 1])
    plan = plan_of(trace, Padding(capture_bs=4, fill_value=1, dummy_slot=0))
    assert ints(plan.tensors["kv_indptr"]) == [0, 3, 8, 9, 10]
    assert ints(plan.tensors["kv_indices"]) == [7, 3, 9, 7, 3, 4, 11, 12, 0, 0]
    assert ints(plan.tensors["kv_last_page_len"]) == [1, 1, 1, 1]


def test_decode_padded_rows_page16_read_the_dummy_slots_page():
    rows = [page_slots([2, 5], 20), page_slots([2, 7, 3], 33)]
    trace = hand_trace(mode=ForwardMode.DECODE, rows=rows, extend_lens=[1, 1], page_size=16)
    plan = plan_of(trace, Padding(capture_bs=3, fill_value=1, dummy_slot=0))
    assert ints(plan.tensors["kv_indptr"]) == [0, 2, 5, 6]
    assert ints(plan.tensors["kv_indices"]) == [2, 5, 2, 7, 3, 0]
    assert ints(plan.tensors["kv_last_page_len"]) == [4, 1, 1]
    plan = plan_of(trace, Padding(capture_bs=3, fill_value=1, dummy_slot=35))
    assert ints(plan.tensors["kv_indices"])[-1] == 2  # slot 35 lives on page 2


def test_padding_smaller_than_the_batch_is_refused():
    trace = hand_trace(mode=ForwardMode.DECODE, rows=[[1], [2]], extend_lens=[1, 1])
    with pytest.raises(ValueError, match="capture_bs 1 < batch size 2"):
        plan_of(trace, Padding(capture_bs=1, fill_value=1))


# -- extend plans -----------------------------------------------------------------------------


def extend_rows_page16():
    # r0: prefix 16 on page 2 + 4 new on page 9; r1: no prefix, 3 new on page 11;
    # r2: prefix 20 on page 2 (shared) and page 4, + 1 new on page 4.
    rows = [page_slots([2, 9], 20), page_slots([11], 3), page_slots([2, 4], 21)]
    return hand_trace(mode=ForwardMode.EXTEND, rows=rows, extend_lens=[4, 3, 1], page_size=16)


def test_cascade_plans_the_paged_pass_over_the_prefix_only():
    plan = plan_of(extend_rows_page16())
    assert plan.scalars["path"] == "cascade" and plan.scalars["causal"] is False
    assert ints(plan.tensors["qo_indptr"]) == [0, 4, 7, 8]
    assert ints(plan.tensors["kv_indptr"]) == [0, 1, 1, 3]
    assert ints(plan.tensors["kv_indices"]) == [2, 2, 4]
    # 16 = one full page; the empty prefix gets no pages (its last_page_len, 16, is never read);
    # 20 = 16 + 4.
    assert ints(plan.tensors["kv_last_page_len"]) == [16, 16, 4]


def test_paged_extend_plans_the_whole_row_causal():
    plan = plan_of(extend_rows_page16(), extend_path="paged")
    assert plan.scalars["path"] == "paged" and plan.scalars["causal"] is True
    assert ints(plan.tensors["qo_indptr"]) == [0, 4, 7, 8]
    assert ints(plan.tensors["kv_indptr"]) == [0, 2, 3, 5]
    assert ints(plan.tensors["kv_indices"]) == [2, 9, 11, 2, 4]
    assert ints(plan.tensors["kv_last_page_len"]) == [4, 3, 5]
    assert "custom_mask" not in plan.tensors


def test_cascade_page1():
    trace = hand_trace(mode=ForwardMode.EXTEND, rows=[[10, 11, 12], [13, 14]], extend_lens=[1, 2])
    plan = plan_of(trace)
    assert ints(plan.tensors["qo_indptr"]) == [0, 1, 3]
    assert ints(plan.tensors["kv_indptr"]) == [0, 2, 2]
    assert ints(plan.tensors["kv_indices"]) == [10, 11]
    assert ints(plan.tensors["kv_last_page_len"]) == [1, 1]


def test_ragged_when_no_request_has_a_prefix():
    trace = hand_trace(mode=ForwardMode.EXTEND, rows=[[10, 11, 12], [13, 14]], extend_lens=[3, 2])
    plan = plan_of(trace)
    assert plan.scalars["path"] == "ragged"
    assert ints(plan.tensors["qo_indptr"]) == [0, 3, 5]
    assert ints(plan.tensors["kv_indptr"]) == [0, 0, 0]


def test_extend_is_never_padded():
    with pytest.raises(ValueError, match="only decode and verify"):
        plan_of(make_trace("extend-prefix"), Padding(capture_bs=8, fill_value=1))


# -- masks --------------------------------------------------------------------------------------


def verify_trace(**kw):
    # r0: prefix [20, 21], drafts [22, 23, 24] with tree root -> {1, 2}; r1: prefix [30], chain.
    return hand_trace(
        mode=ForwardMode.TARGET_VERIFY,
        rows=[[20, 21, 22, 23, 24], [30, 31, 32, 33]],
        extend_lens=[3, 3],
        parents=[[-1, 0, 0], [-1, 0, 1]],
        **kw,
    )


R0_MASK = [T, T, T, F, F,
           T, T, T, T, F,
           T, T, T, F, T]  # fmt: skip
R1_MASK = [T, T, F, F,
           T, T, T, F,
           T, T, T, T]  # fmt: skip


def test_verify_plan_full_layout_mask():
    plan = plan_of(verify_trace())
    assert plan.scalars["path"] == "paged"
    assert ints(plan.tensors["qo_indptr"]) == [0, 3, 6]
    assert ints(plan.tensors["kv_indptr"]) == [0, 5, 9]  # prefix + drafts, all read from the cache
    assert ints(plan.tensors["kv_indices"]) == [20, 21, 22, 23, 24, 30, 31, 32, 33]
    assert ints(plan.tensors["kv_last_page_len"]) == [1, 1]
    mask = plan.tensors["custom_mask"]
    assert mask.dtype == torch.bool
    assert mask.tolist() == R0_MASK + R1_MASK
    assert mask.numel() == 3 * 5 + 3 * 4  # sum(qo_len * kv_len)
    assert ints(plan.tensors["mask_indptr"]) == [0, 15, 27]


def test_verify_mask_length_on_a_synth_tree():
    trace = make_trace("verify", "page_size=16")
    plan = plan_of(trace)
    n = trace.spec.draft_token_num
    assert plan.tensors["custom_mask"].numel() == sum(n * int(kv) for kv in trace.batch.kv_lens)


def test_verify_padded_requests_get_a_chain_over_the_dummy_slot():
    plan = plan_of(verify_trace(), Padding(capture_bs=3, fill_value=1, dummy_slot=0))
    assert ints(plan.tensors["qo_indptr"]) == [0, 3, 6, 9]
    assert ints(plan.tensors["kv_indptr"]) == [0, 5, 9, 13]  # fill 1 + 3 drafts
    assert ints(plan.tensors["kv_indices"])[9:] == [0, 0, 0, 0]
    assert ints(plan.tensors["kv_last_page_len"]) == [1, 1, 1]
    assert plan.tensors["custom_mask"].tolist() == R0_MASK + R1_MASK + R1_MASK  # same shape: prefix 1, chain
    assert ints(plan.tensors["mask_indptr"]) == [0, 15, 27, 39]


def test_verify_folds_the_window_into_the_mask():
    # Prefix 3, chain of 3 at positions 3, 4, 5; window 2: each token sees positions >= its own - 2.
    trace = hand_trace(
        mode=ForwardMode.TARGET_VERIFY, rows=[[1, 2, 3, 4, 5, 6]], extend_lens=[3], parents=[[-1, 0, 1]], window=2
    )
    plan = plan_of(trace)
    assert plan.tensors["custom_mask"].tolist() == [
        F, T, T, T, F, F,
        F, F, T, T, T, F,
        F, F, F, T, T, T,
    ]  # fmt: skip
    assert plan.scalars["window_left"] == -1


def test_selective_recompute_masks_by_query_column():
    # Row of 5 columns; columns 1 and 4 are recomputed.
    trace = hand_trace(mode=ForwardMode.EXTEND, rows=[[40, 41, 42, 43, 44]], extend_lens=[2], query_cols=[[1, 4]])
    plan = plan_of(trace)
    assert plan.scalars["path"] == "paged"
    assert ints(plan.tensors["qo_indptr"]) == [0, 2]
    assert ints(plan.tensors["kv_indices"]) == [40, 41, 42, 43, 44]
    assert plan.tensors["custom_mask"].tolist() == [T, T, F, F, F, T, T, T, T, T]


# -- what it refuses, and why -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "options", "needle"),
    [
        (("mla-decode",), {}, "use the mla backend"),
        (("extend-prefix",), {"extend_path": "ragged"}, "request 1 has a cached prefix of 40"),
        (("window",), {"extend_path": "cascade"}, "window_left counts back"),
        (("selective",), {"extend_path": "cascade"}, "only the paged path"),
        (("decode-gqa", "dtype=float32"), {}, "fp16 or bf16"),
        (("decode-gqa", "head_dim=128", "v_head_dim=64"), {}, "one head_dim"),
        (("extend-noprefix", "head_dim=16"), {}, "head_dim >= 32"),
    ],
)
def test_unsupported_reasons(spec, options, needle):
    reason = FlashInferBackend(FlashInferOptions(**options)).unsupported_reason(make_trace(*spec))
    assert reason is not None and needle in reason


def test_a_row_that_is_not_page_aligned_never_reaches_the_backend():
    """Paged kernels read whole pages; trace validation is the one place that guarantees them."""
    rows = [page_slots([2], 16) + [99]]  # column 16 starts a page at slot 99, not a page boundary
    trace = hand_trace(mode=ForwardMode.DECODE, rows=rows, extend_lens=[1], page_size=16)
    with pytest.raises(TraceError, match=r"batch.slot_ids\[16\]: = 99 sits at page offset 3"):
        from_dict(to_dict(trace))


def test_graph_modes():
    backend = FlashInferBackend()
    assert backend.graph_unsupported_reason(make_trace("decode-gqa")) is None
    assert backend.graph_unsupported_reason(make_trace("verify")) is None
    assert "engines capture only decode and verify steps" in backend.graph_unsupported_reason(make_trace("extend-prefix"))
