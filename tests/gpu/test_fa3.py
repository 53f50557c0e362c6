"""The fa3 backend on a real FA3 implementation (FlashInfer backend="fa3" on our SM90 machine).

Each test records its errors with `record_property` (max_abs, max_lse_abs): run with
`-o junit_family=xunit1 --junitxml=...` to keep the numbers behind a green run. FlashInfer
JIT-compiles every kernel variant on first use (about 50 s each on an H200 for the fa3 prefill
variants): `-n 4` (pytest-xdist) compiles them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, GraphCapacity, Padding
from attndbg.backends.fa3 import FA3Backend, FA3Options, Impl, select_impl
from attndbg.compare.tolerance import Comparison, compare_to_reference
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace import synth
from attndbg.trace.schema import DTYPES, AttentionKind, Plan, Trace

pytestmark = pytest.mark.gpu


def spec_trace(*words: str) -> Trace:
    return synth.build(synth.parse_spec(list(words)))


@dataclass(frozen=True)
class Checked:
    comparison: Comparison
    result: AttentionResult  # CPU copies
    reference: AttentionResult
    plan: Plan


def check(backend: Backend, trace: Trace, plan: Plan | None = None) -> Checked:
    """Run `backend` on `trace` (its own plan unless one is given) and compare with the reference."""
    assert backend.unavailable_reason() is None
    reason = backend.unsupported_reason(trace)
    assert reason is None, reason
    cpu = build_inputs(trace)
    plan = plan or backend.derive_plan(trace)
    result = backend.run(trace, to_device(cpu, backend.device()), plan)
    torch.cuda.synchronize()
    result = AttentionResult(output=result.output.cpu(), lse=result.lse.cpu())
    ref = reference.attention(trace, cpu, torch.float64)
    return Checked(comparison=compare_with_reference(trace, result, cpu, ref), result=result, reference=ref, plan=plan)


def compare_with_reference(trace: Trace, result: AttentionResult, cpu: AttentionInputs, ref: AttentionResult) -> Comparison:
    lowp = reference.attention(trace, cpu, DTYPES[trace.model.q_dtype])
    return compare_to_reference(trace, result, ref, lowp)


def record_and_assert(record_property, comparison: Comparison) -> None:
    record_property("max_abs", f"{comparison.max_abs:.3e}")
    record_property("max_lse_abs", f"{comparison.max_lse_abs:.3e}")
    assert comparison.passed, (
        f"{comparison.failing_rows}/{comparison.total_rows} rows fail, {comparison.nonfinite} non-finite, "
        f"max_abs {comparison.max_abs:.3e}, max_lse_abs {comparison.max_lse_abs:.3e}, worst {comparison.worst}"
    )


def test_the_implementation_is_named():
    assert select_impl() is Impl.FLASHINFER  # the only FA3 implementation on our GPU machine
    words = FA3Backend().describe()
    assert "backend='fa3'" in words and "two calls" in words


# -- every supported preset, through replay() --------------------------------------------------

PRESETS = [
    ("decode-gqa",),
    ("decode-paged",),
    ("decode-long", "head_dim=128"),
    ("extend-noprefix",),
    ("extend-prefix",),
    ("extend-cached",),
    ("mixed",),
    ("verify-chain",),
    ("verify",),  # topk 4: SGLang's two-call path
    ("window",),
    ("window-decode",),
    ("softcap",),
    ("fp16",),
]
# One dtype is enough for the window and soft-cap variants (each is one more kernel build).
ONE_DTYPE = {"window": "bfloat16", "window-decode": "bfloat16", "softcap": "bfloat16", "fp16": "float16"}
CASES = [
    (words, dtype, page_size)
    for words in PRESETS
    for dtype in ("bfloat16", "float16")
    for page_size in (1, 16)
    if ONE_DTYPE.get(words[0], dtype) == dtype
]


@pytest.mark.parametrize(("words", "dtype", "page_size"), CASES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v))
def test_preset_replays_clean(words, dtype, page_size, record_property):
    trace = spec_trace(*words, f"dtype={dtype}", f"page_size={page_size}")
    run = replay(trace, words[0], ["fa3"]).runs[0]
    assert run.status in (RunStatus.PASSED, RunStatus.FAILED), f"{run.status.value}: {run.reason}"
    record_property("verify_path", str(run.plan.scalars["verify_path"]))
    record_and_assert(record_property, run.comparison)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("words", [("verify-chain",), ("verify", "topk=2", "steps=4", "draft_tokens=7")], ids=lambda w: " ".join(w))
def test_two_call_path_forced(words, page_size, record_property):
    checked = check(FA3Backend(FA3Options(verify_path="two-call")), spec_trace(*words, f"page_size={page_size}"))
    assert checked.plan.scalars["verify_path"] == "two-call"
    record_and_assert(record_property, checked.comparison)


# -- what FA3 cannot take ------------------------------------------------------------------------


def test_custom_mask_is_reported_unsupported_exactly():
    trace = spec_trace("verify")
    reason = FA3Backend(FA3Options(verify_path="mask")).unsupported_reason(trace)
    assert reason.startswith("tree verify (topk=4) with verify_path='mask' needs a custom mask in one call")
    assert "FlashInfer's backend='fa3' rejects custom masks at run time ('operation not supported'" in reason
    assert "verify_path='two-call'" in reason


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("selective",), "FA3 masks are causal or sliding-window only"),
        (("mla-decode",), "use the mla backend"),
        (("verify", "window=40"), "sliding window"),
        (("decode-gqa", "dtype=float32"), "fp16 or bf16"),
    ],
)
def test_unsupported_cases_say_why(words, expected):
    run = replay(spec_trace(*words), words[0], ["fa3"]).runs[0]
    assert run.status is RunStatus.UNSUPPORTED
    assert expected in run.reason


# -- CUDA graphs ------------------------------------------------------------------------------------


def graph_capacity(traces: list[Trace], capture_bs: int, fill: int) -> GraphCapacity:
    trace = traces[0]
    draft = trace.spec.draft_token_num if trace.is_tree_verify else 0
    slots = [int(t.batch.kv_lens.sum()) + (capture_bs - t.batch.batch_size) * (fill + draft) for t in traces]
    return GraphCapacity(
        capture_bs=capture_bs,
        max_tokens=capture_bs * (draft or 1),
        max_kv_slots=max(slots),
        max_kv_len=max(int(t.batch.kv_lens.max()) for t in traces) + fill + draft,
        max_mask=0,
    )


def static_inputs(traces: list[Trace], tokens: int) -> AttentionInputs:
    """Garbage-filled static buffers at capture size (MLA: values a view of the keys)."""
    m = traces[0].model
    q_dtype, kv_dtype = DTYPES[m.q_dtype], DTYPES[m.kv_dtype]
    slots = max(t.batch.kv_cache_size for t in traces)
    g = torch.Generator(device="cuda").manual_seed(1234)

    def garbage(n, heads, width, dtype):
        return torch.randn(n, heads, width, generator=g, device="cuda").to(dtype)

    k_cache = garbage(slots, m.num_kv_heads, m.head_dim, kv_dtype)
    k_new = garbage(tokens, m.num_kv_heads, m.head_dim, kv_dtype)
    if m.attention is AttentionKind.MLA:
        v_cache, v_new = k_cache[..., : m.kv_lora_rank], k_new[..., : m.kv_lora_rank]
    else:
        v_cache, v_new = garbage(slots, m.num_kv_heads, m.v_head_dim, kv_dtype), garbage(tokens, m.num_kv_heads, m.v_head_dim, kv_dtype)
    q = garbage(tokens, m.num_qo_heads, m.head_dim, q_dtype)
    return AttentionInputs(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)


def copy_in(static: AttentionInputs, src: AttentionInputs) -> None:
    """In place, as a graph runner must: the captured kernels keep these pointers."""
    names = ("q", "k_cache") if static.v_cache.data_ptr() == static.k_cache.data_ptr() else ("q", "k_cache", "v_cache")
    for name in names:
        value = getattr(src, name)
        getattr(static, name)[: value.shape[0]].copy_(value)


def graph_replay_check(backend: Backend, trace: Trace, decoy: Trace, record_property) -> None:
    """The runner's sequence: static inputs at capture size, load_plan(decoy padded plan),
    forward twice on a side stream, capture forward, replay the decoy, copy the real inputs in
    place, load_plan(real padded plan), NaN-poison the outputs and scratch, replay. Real rows
    must match an eager run() and pass against the reference; padded rows must be finite; plan
    buffers must never move."""
    assert backend.graph_unsupported_reason(trace) is None
    capture_bs = max(trace.batch.batch_size, decoy.batch.batch_size) + 3
    fill = backend.cuda_graph_fill_value
    padding = Padding(capture_bs=capture_bs, fill_value=fill)
    real_plan, decoy_plan = backend.derive_plan(trace, padding), backend.derive_plan(decoy, padding)
    capacity = graph_capacity([trace, decoy], capture_bs, fill)
    static = static_inputs([trace, decoy], capacity.max_tokens)
    copy_in(static, to_device(build_inputs(decoy), "cuda"))

    state = backend.graph_state(trace, capacity)
    state.load_plan(decoy_plan)
    pointers = state.plan_pointers()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            state.forward(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = state.forward(static)
    state.poison_scratch()
    graph.replay()  # the decoy batch first, so stale state would show
    torch.cuda.synchronize()

    cpu = build_inputs(trace)
    real = to_device(cpu, "cuda")
    copy_in(static, real)
    state.load_plan(real_plan)
    assert state.plan_pointers() == pointers, "plan buffers moved after capture"
    captured.output.fill_(float("nan"))
    captured.lse.fill_(float("nan"))
    state.poison_scratch()  # NaN workspace / split scratch: read only what this replay wrote
    graph.replay()
    torch.cuda.synchronize()

    tokens = trace.batch.num_tokens
    out, lse = captured.output.cpu(), captured.lse.cpu()
    assert out.shape[0] == capacity.max_tokens
    assert torch.isfinite(out[tokens:]).all() and torch.isfinite(lse[tokens:]).all(), "padded rows are not finite"
    eager = backend.run(trace, real, backend.derive_plan(trace))
    eager_out, eager_lse = eager.output.cpu(), eager.lse.cpu()
    bitwise = torch.equal(out[:tokens], eager_out) and torch.equal(lse[:tokens], eager_lse)
    record_property("bitwise_eager", str(bitwise))
    record_property("graph_vs_eager_max_abs", f"{float((out[:tokens].float() - eager_out.float()).abs().max()):.3e}")
    torch.testing.assert_close(out[:tokens], eager_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:tokens], eager_lse, atol=1e-3, rtol=0)
    ref = reference.attention(trace, cpu, torch.float64)
    comparison = compare_with_reference(trace, AttentionResult(output=out[:tokens], lse=lse[:tokens]), cpu, ref)
    record_and_assert(record_property, comparison)


@pytest.mark.parametrize(
    ("words", "decoy"),
    [
        (("decode-gqa",), ("kv_lens=600,3,90,1,17", "seed=5")),
        (("decode-paged",), ("kv_lens=600,3,90", "seed=5")),
        (("verify-chain",), ("prefix_lens=9,40,11", "seed=5")),
        (("verify-chain", "page_size=16"), ("prefix_lens=9,40,11", "seed=5")),
    ],
    ids=["decode", "decode-page16", "verify-chain", "verify-chain-page16"],
)
def test_cuda_graph_replay(words, decoy, record_property):
    graph_replay_check(FA3Backend(), spec_trace(*words), spec_trace(*words, *decoy), record_property)


def runner_graph_replay_check(backend: Backend, trace: Trace, record_property) -> None:
    """The same through the project's graph runner (attndbg.replay.graph), which also writes this
    step's K/V inside the graph, fills padded query rows with garbage and checks stray KV writes."""
    graph = pytest.importorskip("attndbg.replay.graph")
    cpu = build_inputs(trace)
    padding = Padding(capture_bs=graph.default_capture_bs(trace), fill_value=backend.cuda_graph_fill_value)
    outcome = graph.graph_replay(backend, trace, to_device(cpu, "cuda"), padding=padding, capture=True, seed=0)
    assert outcome.captured and outcome.pointers_stable
    assert outcome.padded_nonfinite == 0 and outcome.stray_kv_slots == []
    record_property("bitwise_eager", str(outcome.eager_bitwise_equal))
    ref = reference.attention(trace, cpu, torch.float64)
    record_and_assert(record_property, compare_with_reference(trace, outcome.result, cpu, ref))


@pytest.mark.parametrize("words", [("decode-gqa",), ("verify-chain", "page_size=16")], ids=lambda w: " ".join(w))
def test_the_runners_graph_replay(words, record_property):
    runner_graph_replay_check(FA3Backend(), spec_trace(*words), record_property)


def test_two_call_verify_is_not_captured():
    reason = FA3Backend().graph_unsupported_reason(spec_trace("verify"))
    assert "two-call" in reason


# Last: a request with no prefix gives the prefix call an empty KV range.
@pytest.mark.parametrize("page_size", [1, 16])
def test_two_call_with_an_empty_prefix(page_size, record_property):
    trace = spec_trace("verify", "topk=2", "steps=3", "draft_tokens=6", "prefix_lens=0,17", f"page_size={page_size}")
    checked = check(FA3Backend(), trace)
    assert checked.plan.scalars["verify_path"] == "two-call"
    assert torch.isfinite(checked.result.output).all() and torch.isfinite(checked.result.lse).all()
    record_and_assert(record_property, checked.comparison)


# Last of all: a refused launch (the fact fa3's mask reason states), measured.
def test_flashinfer_fa3_rejects_a_custom_mask_at_run_time():
    """The fact the reason above states, measured: plan takes the mask, run refuses it."""
    import flashinfer

    q = torch.randn(4, 4, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(8, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend="fa3"
    )
    i32 = dict(dtype=torch.int32)
    wrapper.plan(
        qo_indptr=torch.tensor([0, 4], **i32),
        paged_kv_indptr=torch.tensor([0, 8], **i32),
        paged_kv_indices=torch.arange(8, **i32),
        paged_kv_last_page_len=torch.tensor([1], **i32),
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim_qk=128,
        page_size=1,
        packed_custom_mask=torch.full((4,), 0xFF, dtype=torch.uint8, device="cuda"),  # 4 rows x 8 keys
        q_data_type=torch.bfloat16,
    )
    with pytest.raises(RuntimeError, match="(?i)not supported"):
        wrapper.run(q, (k, k))
        torch.cuda.synchronize()
