"""The flashinfer backend on the real library, against the float64 reference (GPU only).

Each test records its errors (`record_property`: max_abs, max_lse_abs, failing_rows), so
`--junitxml` gives the numbers behind a green run. FlashInfer JIT-compiles every kernel variant on
first use (7-50 s each): run this file in one pytest call, `-n 8` spreads the compiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs, AttentionResult, GraphCapacity, Padding
from attndbg.backends.flashinfer import INSTALL_HINT, FlashInferBackend, FlashInferOptions
from attndbg.compare.tolerance import Comparison, compare_to_reference
from attndbg.machine import module_available
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace import synth
from attndbg.trace.schema import DTYPES, Plan, Trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]

LN2 = math.log(2.0)
# Attention presets (merge steps run through merge_state: tests/gpu/test_merge_state.py).
PRESETS = [name for name in synth.PRESETS if name != "mla-decode" and synth.PRESETS[name]["mode"] != "merge"]


def spec_trace(*words: str) -> Trace:
    return synth.build(synth.parse_spec(list(words)))


@dataclass(frozen=True)
class Checked:
    comparison: Comparison
    result: AttentionResult  # CPU copies
    reference: AttentionResult
    plan: Plan


def check(trace: Trace, backend: FlashInferBackend | None = None, plan: Plan | None = None) -> Checked:
    """Run the backend on `trace` (its own plan unless one is given) and compare with the reference."""
    backend = backend or FlashInferBackend()
    assert backend.unavailable_reason() is None
    reason = backend.unsupported_reason(trace)
    assert reason is None, reason
    cpu = build_inputs(trace)
    ref = reference.attention(trace, cpu, torch.float64)
    lowp = reference.attention(trace, cpu, DTYPES[trace.model.q_dtype])
    plan = plan or backend.derive_plan(trace)
    result = backend.run(trace, to_device(cpu, "cuda"), plan)
    torch.cuda.synchronize()
    result = AttentionResult(output=result.output.cpu(), lse=result.lse.cpu())
    comparison = compare_to_reference(trace, result, ref, lowp)
    return Checked(comparison=comparison, result=result, reference=ref, plan=plan)


def record(record_property, comparison: Comparison) -> None:
    record_property("max_abs", f"{comparison.max_abs:.3e}")
    record_property("max_lse_abs", f"{comparison.max_lse_abs:.3e}")
    record_property("failing_rows", f"{comparison.failing_rows}/{comparison.total_rows}")


def assert_passed(comparison: Comparison) -> None:
    assert comparison.passed, (
        f"{comparison.failing_rows}/{comparison.total_rows} rows fail, {comparison.nonfinite} non-finite, "
        f"max_abs {comparison.max_abs:.3e}, max_lse_abs {comparison.max_lse_abs:.3e}, worst {comparison.worst}"
    )


# -- every preset, through replay() -------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_replays_clean(preset, dtype, page_size, record_property):
    trace = spec_trace(preset, f"dtype={dtype}", f"page_size={page_size}")
    run = replay(trace, preset, ["flashinfer"]).runs[0]
    assert run.status in (RunStatus.PASSED, RunStatus.FAILED), f"{run.status.value}: {run.reason}"
    record_property("path", str(run.plan.scalars["path"]))
    record(record_property, run.comparison)
    assert_passed(run.comparison)


def test_mla_is_left_to_the_mla_backend():
    run = replay(spec_trace("mla-decode"), "mla-decode", ["flashinfer"]).runs[0]
    assert run.status is RunStatus.UNSUPPORTED
    assert "mla backend" in run.reason


# -- decode: tensor cores on and off ------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tc", "cuda-cores"])
@pytest.mark.parametrize("preset", ["decode-gqa", "decode-paged", "decode-long", "window-decode", "softcap"])
def test_decode_with_and_without_tensor_cores(preset, tensor_cores, page_size, record_property):
    backend = FlashInferBackend(FlashInferOptions(decode_tensor_cores=tensor_cores))
    checked = check(spec_trace(preset, f"page_size={page_size}"), backend)
    assert checked.plan.scalars["use_tensor_cores"] is tensor_cores
    record(record_property, checked.comparison)
    assert_passed(checked.comparison)


# -- extend: ragged, cascade, paged ---------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("path", ["ragged", "cascade", "paged"])
@pytest.mark.parametrize("preset", ["extend-noprefix", "extend-prefix", "extend-cached", "mixed", "fp16", "window", "selective"])
def test_extend_paths(preset, path, page_size, record_property):
    backend = FlashInferBackend(FlashInferOptions(extend_path=path))
    trace = spec_trace(preset, f"page_size={page_size}")
    reason = backend.unsupported_reason(trace)
    if reason is not None:
        # Only the combinations FlashInfer cannot express are refused, each with its reason.
        has_prefix = bool((trace.batch.prefix_lens > 0).any())
        assert (path == "ragged" and (has_prefix or trace.batch.selective)) or (
            path == "cascade" and (trace.model.sliding_window >= 0 or trace.batch.selective)
        ), reason
        return
    checked = check(trace, backend)
    assert checked.plan.scalars["path"] == path
    record(record_property, checked.comparison)
    assert_passed(checked.comparison)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix_lens", ["0,40,0,17", "0,0,0,0"], ids=["some-empty", "all-empty"])
def test_cascade_merges_empty_prefixes_without_nan(prefix_lens, page_size, record_property):
    trace = spec_trace("mode=extend", "heads=16:4", f"prefix_lens={prefix_lens}", "extend_lens=5,7,9,1", f"page_size={page_size}")
    checked = check(trace, FlashInferBackend(FlashInferOptions(extend_path="cascade")))
    assert checked.plan.scalars["path"] == "cascade"
    assert torch.isfinite(checked.result.output).all()
    assert torch.isfinite(checked.result.lse).all()
    record(record_property, checked.comparison)
    assert_passed(checked.comparison)


# -- verify: custom masks ---------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "words",
    [
        ("verify",),  # topk 4: a real tree
        ("verify-chain",),  # topk 1: the mask is causal
        ("verify", "draft_tokens=16", "steps=5"),
        ("verify", "topk=2", "steps=4", "draft_tokens=6", "prefix_lens=0,3"),  # empty prefix
        ("verify", "window=40"),  # window folded into the mask by depth
        ("verify-chain", "window=33"),
    ],
    ids=lambda w: " ".join(w),
)
def test_verify_custom_mask(words, page_size, record_property):
    checked = check(spec_trace(*words, f"page_size={page_size}"))
    assert "custom_mask" in checked.plan.tensors
    record(record_property, checked.comparison)
    assert_passed(checked.comparison)


def test_a_flipped_mask_bit_fails():
    trace = spec_trace("verify")
    backend = FlashInferBackend()
    plan = backend.derive_plan(trace)
    assert_passed(check(trace, backend, plan).comparison)
    # Request 0's root (row 0) sees no draft token but itself; open draft token 1 to it.
    column = int(trace.batch.prefix_lens[0]) + 1
    mask = plan.tensors["custom_mask"].clone()
    assert not mask[column]
    mask[column] = True
    wrong = Plan(backend=plan.backend, tensors={**plan.tensors, "custom_mask": mask}, scalars=plan.scalars)
    comparison = check(trace, backend, wrong).comparison
    assert not comparison.passed
    assert comparison.failing_rows == 1 and comparison.worst.row == 0


# -- fp8 KV ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "options"),
    [
        (("decode-gqa",), {}),  # SGLang: tensor cores for fp8 KV
        (("decode-gqa",), {"decode_tensor_cores": False}),
        (("extend-prefix",), {}),  # cascade: ragged over the (exact) bf16 new K/V + fp8 prefix
        (("extend-prefix",), {"extend_path": "paged"}),
        (("verify",), {}),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_fp8_kv_cache(words, options, record_property):
    trace = spec_trace(*words, "kv_dtype=float8_e4m3fn", "page_size=16")
    checked = check(trace, FlashInferBackend(FlashInferOptions(**options)))
    record(record_property, checked.comparison)
    assert_passed(checked.comparison)


# -- LSE base ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["decode-gqa", "extend-noprefix", "extend-prefix", "verify"])
def test_lse_is_natural_log(preset, record_property):
    checked = check(spec_trace(preset))
    ref = checked.reference.lse
    lse = checked.result.lse.to(torch.float64)
    seen = torch.isfinite(ref)
    error = float((lse - ref)[seen].abs().max())
    record_property("max_lse_abs", f"{error:.3e}")
    assert error < 0.02
    # The kernels' own base-2 value would be off by far more than that.
    assert float((lse / LN2 - ref)[seen].abs().max()) > 0.5


# -- CUDA graphs -------------------------------------------------------------------------------------


def _graph_capacity(backend: FlashInferBackend, traces: list[Trace], capture_bs: int, plans: list[Plan]) -> GraphCapacity:
    trace = traces[0]
    draft = trace.spec.draft_token_num if trace.is_tree_verify else 0
    per_request = draft or 1
    fill = backend.cuda_graph_fill_value
    slots = [int(t.batch.kv_lens.sum()) + (capture_bs - t.batch.batch_size) * (fill + draft) for t in traces]
    return GraphCapacity(
        capture_bs=capture_bs,
        max_tokens=capture_bs * per_request,
        max_kv_slots=max(slots),
        max_kv_len=max(int(t.batch.kv_lens.max()) for t in traces),
        max_mask=max(p.tensors["custom_mask"].numel() if "custom_mask" in p.tensors else 0 for p in plans),
    )


def _static_inputs(traces: list[Trace], tokens: int) -> AttentionInputs:
    m = traces[0].model
    q_dtype, kv_dtype = DTYPES[m.q_dtype], DTYPES[m.kv_dtype]
    slots = max(t.batch.kv_cache_size for t in traces)

    def zeros(n, heads, width, dtype):
        return torch.zeros(n, heads, width, dtype=dtype, device="cuda")

    return AttentionInputs(
        q=zeros(tokens, m.num_qo_heads, m.head_dim, q_dtype),
        k_new=zeros(tokens, m.num_kv_heads, m.head_dim, kv_dtype),
        v_new=zeros(tokens, m.num_kv_heads, m.v_head_dim, kv_dtype),
        k_cache=zeros(slots, m.num_kv_heads, m.head_dim, kv_dtype),
        v_cache=zeros(slots, m.num_kv_heads, m.v_head_dim, kv_dtype),
    )


def _copy_in(static: AttentionInputs, src: AttentionInputs) -> None:
    """In place, as a graph runner must: the captured kernels keep these pointers."""
    for name in ("q", "k_new", "v_new", "k_cache", "v_cache"):
        value = getattr(src, name)
        getattr(static, name)[: value.shape[0]].copy_(value)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("words", "decoy", "tensor_cores"),
    [
        (("decode-gqa",), ("kv_lens=600,3,90", "seed=5"), False),
        (("decode-gqa",), ("kv_lens=600,3,90", "seed=5"), True),
        (("verify",), ("prefix_lens=200,7", "seed=5"), None),
        (("verify-chain",), ("prefix_lens=9,40,11", "seed=5"), None),
    ],
    ids=["decode-cuda-cores", "decode-tc", "verify-tree", "verify-chain"],
)
def test_cuda_graph_replay(words, decoy, tensor_cores, page_size, record_property):
    backend = FlashInferBackend(FlashInferOptions(decode_tensor_cores=tensor_cores))
    trace = spec_trace(*words, f"page_size={page_size}")
    other = spec_trace(*words, *decoy, f"page_size={page_size}")
    capture_bs = max(trace.batch.batch_size, other.batch.batch_size) + 3
    padding = Padding(capture_bs=capture_bs, fill_value=backend.cuda_graph_fill_value)
    real_plan, decoy_plan = backend.derive_plan(trace, padding), backend.derive_plan(other, padding)
    capacity = _graph_capacity(backend, [trace, other], capture_bs, [real_plan, decoy_plan])
    assert backend.graph_unsupported_reason(trace) is None
    real = to_device(build_inputs(trace), "cuda")
    static = _static_inputs([trace, other], capacity.max_tokens)
    _copy_in(static, to_device(build_inputs(other), "cuda"))

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

    static.q.zero_()
    _copy_in(static, real)
    state.load_plan(real_plan)
    assert state.plan_pointers() == pointers
    captured.output.fill_(float("nan"))
    captured.lse.fill_(float("nan"))
    state.poison_scratch()  # split-KV partials: NaN unless the kernels write them first
    graph.replay()
    torch.cuda.synchronize()

    tokens = trace.batch.num_tokens
    out, lse = captured.output.cpu(), captured.lse.cpu()
    assert torch.isfinite(out[tokens:]).all() and torch.isfinite(lse[tokens:]).all(), "padded rows"
    eager = backend.run(trace, real, backend.derive_plan(trace))
    eager_out, eager_lse = eager.output.cpu(), eager.lse.cpu()
    record_property("bitwise_eager", str(torch.equal(out[:tokens], eager_out) and torch.equal(lse[:tokens], eager_lse)))
    torch.testing.assert_close(out[:tokens], eager_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:tokens], eager_lse, atol=1e-3, rtol=0)
    cpu = build_inputs(trace)
    ref = reference.attention(trace, cpu, torch.float64)
    lowp = reference.attention(trace, cpu, DTYPES[trace.model.q_dtype])
    comparison = compare_to_reference(trace, AttentionResult(output=out[:tokens], lse=lse[:tokens]), ref, lowp)
    record(record_property, comparison)
    assert_passed(comparison)


def test_graph_state_refuses_an_unpadded_plan():
    backend = FlashInferBackend()
    trace = spec_trace("decode-gqa")
    plan = backend.derive_plan(trace, Padding(capture_bs=8, fill_value=1))
    capacity = _graph_capacity(backend, [trace], 8, [plan])
    state = backend.graph_state(trace, capacity)
    with pytest.raises(ValueError, match="capture_bs=8"):
        state.load_plan(backend.derive_plan(trace))


def test_decode_at_head_dim_80_is_a_declared_defect_not_a_failure_or_a_fault() -> None:
    """FlashInfer 0.7.2's decode at head_dim 80 is wrong on CUDA cores and faults on tensor cores
    (docs/benchmarks.md): replay reports it unsupported with that reason."""
    from attndbg.backends.flashinfer import decode_head_dim_defect

    trace = spec_trace("decode-mha", "kv_lens=37,91", "heads=4:4", "head_dim=80", "page_size=1")
    if decode_head_dim_defect(80, False) is None:
        pytest.skip("the installed FlashInfer is not a release measured with this defect")
    result = replay(trace, "t.pt", ["flashinfer"])
    [run] = result.runs
    assert run.status is RunStatus.UNSUPPORTED and run.reason.startswith("known FlashInfer"), run.reason


# Server shapes of the issue-21 sweep: extends past one 128-row tile on long prefixes, and mixed
# steps whose decode rows ride the cascade; GQA 32:8, head_dim 128, bf16.
SERVER_CASCADE_SHAPES = [
    ("prefix_lens=2303", "extend_lens=1266", "page_size=16"),
    ("prefix_lens=0,376", "extend_lens=128,1864", "page_size=16"),
    ("mode=mixed", "prefix_lens=1198,1746", "extend_lens=1,1", "page_size=1"),
]


@pytest.mark.parametrize("shape", SERVER_CASCADE_SHAPES, ids=lambda s: "-".join(w.split("=")[1] for w in s))
def test_cascade_is_right_while_the_gpu_is_still_busy(shape, record_property):
    """The shapes of the false cascade-vs-single-pass findings once seen on server shapes (rows past the first 128-row
    tile inf; decode rows of mixed steps off by 1e-2), through the adapter's cascade while the GPU
    lags the host as in a check worker (0.3 s of work queued ahead of the plans, each wrapper made,
    planned and dropped per call: the case wait_for_pending_plans guards). Passed on the H100, as
    did bench/flashinfer_cascade_rows.py on the same shapes standalone; the sweep's failures were
    not reproduced this way, so this pins the shapes, not a found cause."""
    trace = spec_trace("extend-prefix", "heads=32:8", "head_dim=128", "dtype=bfloat16", "shared_prefix=0", *shape)
    backend = FlashInferBackend(FlashInferOptions(extend_path="cascade"))
    cpu = build_inputs(trace)
    inputs = to_device(cpu, "cuda")
    ref = reference.attention(trace, cpu, torch.float64)
    lowp = reference.attention(trace, cpu, DTYPES[trace.model.q_dtype])
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    result = backend.run(trace, inputs, backend.derive_plan(trace))
    torch.cuda.synchronize()
    comparison = compare_to_reference(trace, AttentionResult(result.output.cpu(), result.lse.cpu()), ref, lowp)
    record_property("max_abs", comparison.max_abs)
    assert comparison.passed, f"{comparison.failing_rows}/{comparison.total_rows} rows fail, max abs {comparison.max_abs}"
