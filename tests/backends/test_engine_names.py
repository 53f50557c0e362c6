"""Engine backend names: each resolves to the adapter that declares it (or to engine_names.py's
table), so fill-value judges a vLLM step's padding by the kernel that consumes it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.backends import engine_names
from attndbg.backends.fa3 import FA3Backend
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends.mla import MLABackend
from attndbg.backends.triton import TritonBackend
from attndbg.detector_api.findings import Severity
from attndbg.detectors.fill_value import detect as fill_value
from tests.checks.test_fill_value import decode, on, with_graph


@pytest.mark.parametrize(
    "name,adapter",
    [("flashinfer", FlashInferBackend), ("FLASHINFER", FlashInferBackend), ("fa3", FA3Backend), ("FLASH_ATTN", FA3Backend), ("triton", TritonBackend), ("flashmla", MLABackend), ("trtllm_mla", MLABackend), ("mla", MLABackend)],
)
def test_each_engine_name_answers_to_its_adapter(name: str, adapter: type) -> None:
    assert engine_names.adapter_for(name) is adapter
    assert engine_names.fill_requirement(name) is not None


def test_names_no_adapter_reproduces_are_data_and_unknown_names_are_not_judged() -> None:
    assert engine_names.adapter_for("TRITON_ATTN") is None
    assert engine_names.fill_requirement("TRITON_ATTN").min_seq_len == 0
    assert engine_names.fill_requirement("ascend").min_seq_len == 0
    assert engine_names.fill_requirement("no-such-backend") is None


@pytest.mark.parametrize("name,unsupported", [("FLASHINFER", True), ("FLASH_ATTN", False), ("TRITON_ATTN", False)])
def test_a_vllm_step_padded_with_seq_len_0_is_judged_by_its_kernel(name: str, unsupported: bool) -> None:
    """vLLM pads with seq_len 0: FlashInfer's kernels cannot take it (vLLM #38436), FlashAttention's
    and vLLM's unified Triton attention can."""
    trace = on(decode(4), name, engine="vllm")
    bs = trace.batch.batch_size
    seq_lens = trace.graph.padded_seq_lens.clone()
    seq_lens[bs:] = 0
    findings = fill_value.recorded_padding(with_graph(trace, padded_seq_lens=seq_lens, fill_value=0))
    hits = [f for f in findings if f.check == "padded-seq-len-unsupported"]
    assert bool(hits) is unsupported, [f.check for f in findings]
    if unsupported:
        assert f"ran on {name}, which needs >= 1" in hits[0].evidence and "#38436" in hits[0].cause


def _padded_zero(name: str, *, kv_dtype: str = "bfloat16", fill: int = 0):
    trace = on(decode(4), name, engine="vllm")
    trace = replace(trace, model=replace(trace.model, kv_dtype=kv_dtype), plan=None)
    seq_lens = trace.graph.padded_seq_lens.clone()
    seq_lens[trace.batch.batch_size :] = fill
    return with_graph(trace, padded_seq_lens=seq_lens, fill_value=fill)


def test_flashmla_fp8_padding_of_seq_len_0_reads_out_of_bounds() -> None:
    """vLLM's runner pads with seq_len 0; FlashMLA's FP8 decode computes n_block = -1 from it and
    reads block_table[-1] (vLLM #35969): a defect there, nothing on its bf16 path, and a clamped
    padding (seq_len 1, the fix) is clean on both."""
    found = [f for f in fill_value.recorded_padding(_padded_zero("FLASHMLA", kv_dtype="float8_e4m3fn")) if f.check == "padded-seq-len-unsupported"]
    assert len(found) == 1 and found[0].severity is Severity.DEFECT
    assert "n_block = -1" in found[0].cause and "#35969" in found[0].cause
    assert not [f for f in fill_value.recorded_padding(_padded_zero("FLASHMLA")) if f.check == "padded-seq-len-unsupported"]
    for kv_dtype in ("float8_e4m3fn", "bfloat16"):
        assert fill_value.recorded_padding(_padded_zero("FLASHMLA", kv_dtype=kv_dtype, fill=1)) == []


def test_triton_mla_padding_of_seq_len_0_gives_nan_rows() -> None:
    """vLLM's Triton MLA decode divides by an empty softmax sum at seq_len 0 (vLLM #57017): NaN
    padded rows, a hazard while nothing mixes rows."""
    found = [f for f in fill_value.recorded_padding(_padded_zero("TRITON_MLA")) if f.check == "padded-seq-len-unsupported"]
    assert len(found) == 1 and found[0].severity is Severity.HAZARD and "0/0" in found[0].cause


# Every name the installed engines can report (SGLang's --attention-backend choices, vLLM's
# AttentionBackendEnum): each has an adapter, padding rules, or is named by unknown_name.
def _engine_names() -> list[str]:
    names = []
    choices = pytest.importorskip("sglang.srt.arg_groups.choices", reason="SGLang not installed")
    names += list(choices.ATTENTION_BACKEND_CHOICES)
    registry = pytest.importorskip("vllm.v1.attention.backends.registry", reason="vLLM not installed")
    names += [member.name for member in registry.AttentionBackendEnum]
    return names


def test_every_engine_backend_name_is_known_or_named() -> None:
    known, unknown = [], []
    for name in _engine_names():
        trace = on(decode(4), name)
        (unknown if engine_names.unknown_name(trace) == name else known).append(name)
        if engine_names.unknown_name(trace) is None:
            assert engine_names.fill_requirement(name, trace.model.kv_dtype) is not None
    assert {"flashinfer", "fa3", "triton", "flashmla", "trtllm_mla", "FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLASHMLA", "TRITON_MLA"} <= set(known)
    assert "ROCM_AITER_MLA" in unknown  # no fact about its kernels' padding here: named, never judged


def test_a_graph_step_of_an_unknown_backend_is_named_on_the_verdict_line(tmp_path) -> None:
    """Its padded rows get no kernel's rules (not another backend's): the verdict says so; a known
    backend's step does not get the note."""
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import parse_only
    from attndbg.detector_api.context import CheckOptions
    from attndbg.detectors import registry as detectors
    from attndbg.report.checks import check_verdict
    from attndbg.trace import io

    for name, named in (("ROCM_AITER_MLA", True), ("FLASH_ATTN", False)):
        path = tmp_path / f"{name}.pt"
        io.save(_padded_zero(name, fill=1), path)
        reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("reference",))))
        verdict = check_verdict(reports, [d for d in detectors.BUILTIN], None)
        assert (f"engine backend {name}: no adapter or padding rules here" in verdict.line) is named, verdict.line
        assert verdict.unknown_engine_backends == ({name: 1} if named else {})
        assert not [f for r in reports for f in r.findings if f.check == "padded-seq-len-unsupported"]


def test_a_step_whose_engine_kernels_run_nowhere_here_says_so_on_the_verdict_line(tmp_path) -> None:
    """trtllm_mla maps to the mla adapter (its padding rules: fill 1) but its trtllm-gen kernels run
    only on SM100: the verdict says why no kernel of it ran, and a step of a backend whose kernels
    run here gets no such note."""
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import parse_only
    from attndbg.detector_api.context import CheckOptions
    from attndbg.detectors import registry as detectors
    from attndbg.report.checks import check_verdict
    from attndbg.trace import io

    assert engine_names.adapter_for("trtllm_mla") is MLABackend and engine_names.fill_requirement("trtllm_mla").min_seq_len == 1
    for name, named in (("trtllm_mla", True), ("flashmla", False)):
        path = tmp_path / f"{name}.pt"
        io.save(_padded_zero(name, fill=1), path)
        reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("reference",))))
        verdict = check_verdict(reports, [d for d in detectors.BUILTIN], None)
        assert ("engine kernels not run on 1 step (trtllm_mla: FlashInfer's trtllm-gen MLA kernels, which run only on SM100" in verdict.line) is named, verdict.line
        assert bool(verdict.engine_kernels_elsewhere) is named
        assert verdict.unknown_engine_backends == {}
