"""Eager replay of every synth mode through reference and Triton, and proof the comparison can fail."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attndbg.backends import reference
from attndbg.backends.triton import TritonBackend, TritonOptions, sglang_num_kv_splits
from attndbg.backends.base import AttentionResult
from attndbg.compare.tolerance import compare_to_reference
from attndbg.machine import kernel_device
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace import synth
from attndbg.trace.schema import DTYPES
from tests.factories import make_trace

@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_every_mode_passes_reference_and_triton(preset: str) -> None:
    result = replay(make_trace(preset), preset, ["reference", "triton"])
    for run in result.runs:
        assert run.status is RunStatus.PASSED, (run.name, run.reason, run.comparison)
        assert run.comparison.nonfinite == 0


@pytest.mark.parametrize("extra", [("dtype=float16",), ("dtype=float32",), ("page_size=16", "shared_prefix=32"), ("heads=8:1",)])
def test_decode_variants_pass(extra: tuple[str, ...]) -> None:
    result = replay(make_trace("decode-gqa", "kv_lens=1,40,333", *extra), "x", ["triton"])
    assert result.runs[0].status is RunStatus.PASSED, result.runs[0].comparison


def _compare(trace, inputs, output, lse):
    ref = reference.attention(trace, inputs)
    lowp = reference.attention(trace, inputs, DTYPES[trace.model.q_dtype])
    return compare_to_reference(trace, AttentionResult(output=output, lse=lse), ref, lowp)


def test_a_wrong_tree_mask_is_caught_at_its_row() -> None:
    """Make one draft token see a sibling it must not see; exactly that row must fail."""
    trace = make_trace("verify", "prefix_lens=12,20", "topk=2", "steps=3", "draft_tokens=6")
    backend = TritonBackend()
    plan = backend.derive_plan(trace)
    mask = plan.tensors["custom_mask"].clone()
    n, prefix = 6, 12
    block = mask[: n * (prefix + n)].view(n, prefix + n)
    hidden = [(i, j) for i in range(n) for j in range(n) if not block[i, prefix + j]]
    row, col = hidden[len(hidden) // 2]
    block[row, prefix + col] = True
    wrong = replace(plan, tensors={**plan.tensors, "custom_mask": mask})
    inputs = to_device(build_inputs(trace), backend.device())
    good = backend.run(trace, inputs, plan)
    bad = backend.run(trace, inputs, wrong)
    cpu = build_inputs(trace)
    assert _compare(trace, cpu, good.output.cpu(), good.lse.cpu()).passed
    c = _compare(trace, cpu, bad.output.cpu(), bad.lse.cpu())
    assert not c.passed
    failing = torch.nonzero((c.row_errors > 1).any(-1) | (c.lse_errors > 1).any(-1)).flatten().tolist()
    assert failing == [row]
    assert c.worst.request == 0 and c.worst.row == row


def test_a_wrong_split_merge_is_caught() -> None:
    """Stage 2 told a larger split count than stage 1 used merges stale partials of a previous step."""
    from attndbg.backends.triton_kernels import decode

    trace = make_trace("decode-gqa", "kv_lens=100,300")
    backend = TritonBackend(TritonOptions(num_kv_splits=2))
    plan = backend.derive_plan(trace)
    inputs = to_device(build_inputs(trace), backend.device())
    device = inputs.q.device
    m = trace.model
    t = {k: v.to(device) for k, v in plan.tensors.items()}
    max_splits = 8
    logits = torch.zeros(2, m.num_qo_heads, max_splits, m.v_head_dim, device=device)
    lse_scratch = torch.zeros(2, m.num_qo_heads, max_splits, device=device)
    # A previous step with 8 splits leaves partials behind in the scratch buffers.
    stale_q = torch.randn_like(inputs.q)
    eight = torch.full_like(t["num_kv_splits"], max_splits)
    common = dict(k_buffer=inputs.k_cache, v_buffer=inputs.v_cache, kv_indptr=t["kv_indptr"], kv_indices=t["kv_indices"],
                  attn_logits=logits, attn_lse=lse_scratch, max_kv_splits=max_splits, sm_scale=m.sm_scale)
    decode.decode_stage1(q=stale_q, num_kv_splits=eight, **common)
    decode.decode_stage1(q=inputs.q, num_kv_splits=t["num_kv_splits"], **common)
    out = torch.empty(2, m.num_qo_heads, m.v_head_dim, dtype=inputs.q.dtype, device=device)
    lse = torch.empty(2, m.num_qo_heads, device=device)
    stage2 = dict(attn_logits=logits, attn_lse=lse_scratch, o=out, lse=lse, kv_indptr=t["kv_indptr"], max_kv_splits=max_splits)
    decode.decode_stage2(num_kv_splits=t["num_kv_splits"], **stage2)
    cpu = build_inputs(trace)
    assert _compare(trace, cpu, out.cpu(), lse.cpu()).passed
    decode.decode_stage2(num_kv_splits=eight, **stage2)
    c = _compare(trace, cpu, out.cpu(), lse.cpu())
    assert not c.passed and c.failing_rows == 2


def test_lse_in_base_2_is_caught() -> None:
    trace = make_trace("decode-gqa", "kv_lens=5,60")
    inputs = build_inputs(trace)
    ref = reference.attention(trace, inputs)
    c = _compare(trace, inputs, ref.output.to(torch.bfloat16), (ref.lse / torch.log(torch.tensor(2.0))).float())
    assert not c.passed and c.max_abs < 1e-2 and c.max_lse_abs > 0.1


def test_nan_output_always_fails() -> None:
    trace = make_trace("decode-mha")
    inputs = build_inputs(trace)
    ref = reference.attention(trace, inputs)
    out = ref.output.clone()
    out[1, 3, 0] = float("nan")
    c = _compare(trace, inputs, out, ref.lse)
    assert c.nonfinite == 1 and c.failing_rows == 1 and (c.worst.row, c.worst.head) == (1, 3)


def test_split_heuristic_follows_sglang() -> None:
    # Uniform long batch on 132 SMs: splits2 = min(cdiv(132*log2(4096/64), 64*8), 8) = 2 each.
    assert sglang_num_kv_splits([4096] * 64, num_qo_heads=32, num_kv_heads=8, max_kv_splits=8, core_count=132) == [2] * 64
    # One short and one long request: chunk1 = cdiv(2000, min(cdiv(2000, 10), 8)) = 250.
    splits = sglang_num_kv_splits([10, 2000], num_qo_heads=32, num_kv_heads=8, max_kv_splits=8, core_count=132)
    assert splits == [1, 8]
    assert sglang_num_kv_splits([1], num_qo_heads=8, num_kv_heads=8, max_kv_splits=8, core_count=132) == [1]


def test_forced_split_counts_agree() -> None:
    trace = make_trace("decode-gqa", "kv_lens=1,31,32,33,300")
    outs = []
    for splits in (1, 2, 16):
        result = replay(trace, "x", ["triton"], replace_options(splits))
        assert result.runs[0].status is RunStatus.PASSED, (splits, result.runs[0].comparison)
        outs.append(result.runs[0].result.output.float())
    for other in outs[1:]:
        assert (other - outs[0]).abs().max() < 2e-2


def replace_options(splits: int):
    from attndbg.backends.options import BackendOptions
    from attndbg.replay.runner import ReplayOptions

    triton = TritonOptions(num_kv_splits=splits, max_kv_splits=max(8, splits))
    return ReplayOptions(backend_options=BackendOptions((("triton", triton),)))


def test_kernel_device_matches_mode() -> None:
    assert kernel_device() in ("cpu", "cuda")
