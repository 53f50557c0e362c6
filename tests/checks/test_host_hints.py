"""invariants' host-hint: a host-side hint a kernel sizes its grid or block-table walk by, judged
against the batch for the engines and backends whose adapters declare it (backends/host_hints.py).
Each mistake has its correct twin: the exact hint, one rounded up, and a graph's captured maximum
over a table that wide stay clean, on small and server-shaped steps."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from attndbg.backends import registry
from attndbg.detectors.invariants.detect import check_trace
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.replay.variants import Recorded
from attndbg.trace import io, synth
from attndbg.trace.schema import Plan, Trace
from tests.corpus import vllm_engine as vl
from tests.record.engines import import_engine

flash_attn = import_engine("vllm.v1.attention.backends.flash_attn")

MAX_MODEL_LEN = 4096


def _hints(found: list) -> list:
    return [f for f in found if f.check == "host-hint"]


# -- SGLang: our adapters' plans, as the engine's Triton and FA3 backends record them ---------------


def _sglang(spec: tuple[str, ...], backend: str, **scalars: int) -> Trace:
    trace = synth.build(synth.parse_spec(list(spec)))
    trace = dataclasses.replace(trace, source=dataclasses.replace(trace.source, backend=backend))
    plan = registry.create(backend).derive_plan(trace)
    return dataclasses.replace(trace, plan=Plan(plan.backend, dict(plan.tensors), {**plan.scalars, **scalars}))


@pytest.mark.parametrize("backend, scalar", [("triton", "max_extend_len"), ("fa3", "max_seqlen_q")])
@pytest.mark.parametrize("spec", [("extend-prefix",), ("verify-chain", "page_size=16")])
def test_a_query_hint_below_the_longest_request_is_a_defect_and_an_exact_or_rounded_up_one_is_clean(backend: str, scalar: str, spec: tuple[str, ...]) -> None:
    trace = _sglang(spec, backend)
    longest = int(trace.batch.extend_lens.max())
    assert trace.plan is not None and trace.plan.scalars[scalar] == longest  # what the engine computes
    for value in (longest, -(-longest // 64) * 64, 8192):  # exact, rounded up, a static bound
        assert _hints(check_trace(_sglang(spec, backend, **{scalar: value}))) == [], value
    (found,) = _hints(check_trace(_sglang(spec, backend, **{scalar: longest - 1})))
    b = int(torch.argmax(trace.batch.extend_lens))
    assert found.severity.value == "defect" and found.location.request == b and found.location.field == f"plan.scalars.{scalar}"
    assert f"= {longest - 1} but request {b} has {longest} query tokens" in found.evidence
    assert "query tokens past the last block the hint launches are never read (up to its last 1" in found.cause
    assert "--plan both" in found.cause


def test_a_decode_plan_without_the_hint_is_not_judged() -> None:
    trace = _sglang(("decode-gqa",), "triton")
    assert trace.plan is not None and "max_extend_len" not in trace.plan.scalars
    assert _hints(check_trace(trace)) == []


# -- vLLM: the builder's metadata through the recorder's converter -----------------------------------


def _checked(tmp_path: Path, cm: Any, metadata: Any, *, backend: str, block: int = 16, capture: Any = None) -> list:
    out = Path(tempfile.mkdtemp(dir=tmp_path))  # one recording per call
    vl.record(out, cm, metadata, backend=backend, model=vl.mha_model(block_size=block), capture=capture, builder=f"{backend} builder")
    (entry,) = io.read_manifest(out)
    return check_trace(io.load(out / entry.file))


def _trtllm(step: vl.Step, *, hint: int, common_hint: int | None = None, prefill_q: int | None = None) -> tuple[Any, Any]:
    """FlashInferMetadata (vLLM 0.33) of a step on FlashInfer's trtllm-gen kernels: decodes first,
    then prefills; `hint` the decode part's max_seq_len (and the common one's, unless given)."""
    cm = dataclasses.replace(step, max_seq_len=common_hint or hint).common()
    lens = [q for q in step.query_lens]
    decodes = sum(1 for q in lens if q == 1)
    rows = len(step.seq_lens) + step.pad_reqs
    decode = vl.FlashInferTrtllmAPIDecode(
        kernel=vl.FlashInferDecodeKernel.TRTLLM_GEN, block_tables=cm.block_table_tensor[:decodes] if decodes < len(lens) else cm.block_table_tensor,
        seq_lens=cm.seq_lens[:decodes] if decodes < len(lens) else cm.seq_lens, max_seq_len=hint,
    )  # fmt: skip
    prefill = None
    if decodes < len(lens):
        qsl = cm.query_start_loc[decodes:] - cm.query_start_loc[decodes]
        kv = torch.nn.functional.pad(torch.cumsum(cm.seq_lens[decodes:], 0), (1, 0)).to(torch.int32)
        prefill = vl.TRTLLMPrefill(
            block_tables=cm.block_table_tensor[decodes:], seq_lens=cm.seq_lens[decodes:], cum_seq_lens_q=qsl, cum_seq_lens_kv=kv,
            max_q_len=prefill_q if prefill_q is not None else max(lens[decodes:]), max_seq_len=hint,
        )  # fmt: skip
    metadata = SimpleNamespace(
        num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping, num_decodes=decodes if decodes < len(lens) else rows,
        num_decode_tokens=sum(lens[:decodes]), num_prefills=len(lens) - decodes, num_prefill_tokens=sum(lens[decodes:]), causal=True,
        prefill=prefill, decode=decode,
    )  # fmt: skip
    return cm, metadata


DECODE = vl.Step(seq_lens=[20, 33, 7], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]])
MIXED = vl.Step(seq_lens=[20, 33, 70], query_lens=[1, 1, 30], blocks=[[7, 3], [5, 1, 9], [2, 4, 6, 8, 10]])


def test_a_trtllm_decode_hint_that_walks_past_the_block_table_is_a_defect(tmp_path: Path) -> None:
    found = _hints(_checked(tmp_path, *_trtllm(DECODE, hint=MAX_MODEL_LEN), backend="FLASHINFER"))
    assert len(found) == 1 and found[0].severity.value == "defect", found
    assert found[0].location.field == "plan.scalars.decode.max_seq_len"
    assert "walks ceil(4096 / 16) = 256 entries of each plan.decode.block_tables row, which has 4 columns" in found[0].evidence
    assert "#43991" in found[0].cause


@pytest.mark.parametrize("hint", [33, 48, 64])  # exact, rounded up to a page, the table's whole width
def test_a_trtllm_decode_hint_within_the_block_table_is_clean(tmp_path: Path, hint: int) -> None:
    assert _checked(tmp_path, *_trtllm(DECODE, hint=hint), backend="FLASHINFER") == []


def test_max_model_len_over_a_table_that_wide_is_clean_under_a_full_graph(tmp_path: Path) -> None:
    # vLLM's persistent block table holds ceil(max_model_len / block) columns; a FULL graph's
    # capture passes max_model_len over it (64 graph-padded decodes with long prefixes).
    seq = [int(x) for x in torch.randint(900, 4000, (60,), generator=torch.Generator().manual_seed(0))]
    blocks = [[1 + (b * 250 + j) % 1000 for j in range(-(-s // 16))] for b, s in enumerate(seq)]
    step = vl.Step(seq_lens=seq, query_lens=[1] * 60, blocks=blocks, pad_reqs=4, width=MAX_MODEL_LEN // 16)
    capture = vl.CaptureSizes(max_bs=64, max_num_tokens=64, block_table_width=MAX_MODEL_LEN // 16)
    vl_blocks = 1024
    original, vl.NUM_BLOCKS = vl.NUM_BLOCKS, vl_blocks
    try:
        found = _checked(tmp_path, *_trtllm(step, hint=MAX_MODEL_LEN), backend="FLASHINFER", capture=capture)
    finally:
        vl.NUM_BLOCKS = original
    assert _hints(found) == [], [(f.check, f.evidence) for f in found]


def test_a_trtllm_decode_hint_below_the_decodes_longest_is_a_defect(tmp_path: Path) -> None:
    # The decode part's max_seq_len from another maximum than the step's (the common one is right).
    found = _hints(_checked(tmp_path, *_trtllm(DECODE, hint=32, common_hint=33), backend="FLASHINFER"))
    assert len(found) == 1 and found[0].location.request == 1, found
    assert "= 32 but request 1 has 33 KV columns" in found[0].evidence


def test_a_common_max_seq_len_below_the_longest_is_reported_once_by_seq_lens_max(tmp_path: Path) -> None:
    found = _checked(tmp_path, *_trtllm(DECODE, hint=32), backend="FLASHINFER")
    assert [f.check for f in found if f.check in ("host-hint", "seq-lens-max")] == ["seq-lens-max"], [(f.check, f.evidence) for f in found]


def test_a_trtllm_prefill_max_q_len_below_the_prefills_longest_query_is_a_defect(tmp_path: Path) -> None:
    assert _checked(tmp_path, *_trtllm(MIXED, hint=70), backend="FLASHINFER") == []
    found = _hints(_checked(tmp_path, *_trtllm(MIXED, hint=70, prefill_q=16), backend="FLASHINFER"))
    assert len(found) == 1 and found[0].location.field == "plan.scalars.prefill.max_q_len" and found[0].location.request == 2, found


def test_flashinfer_wrapper_steps_carry_no_hint_to_judge(tmp_path: Path) -> None:
    # Without a trtllm-gen part the FLASHINFER builder's max_seq_len reaches no kernel of ours to judge.
    cm = dataclasses.replace(DECODE, max_seq_len=MAX_MODEL_LEN).common()
    metadata = SimpleNamespace(num_actual_tokens=3, slot_mapping=cm.slot_mapping, max_seq_len=MAX_MODEL_LEN, num_decodes=3, num_decode_tokens=3, num_prefills=0, num_prefill_tokens=0)
    assert _hints(_checked(tmp_path, cm, metadata, backend="FLASHINFER")) == []


def _fa(step: vl.Step, max_query_len: int | None = None) -> tuple[Any, Any]:
    cm = step.common()
    metadata = flash_attn.FlashAttentionMetadata(
        num_actual_tokens=cm.num_actual_tokens, max_query_len=max_query_len if max_query_len is not None else int(cm.max_query_len),
        query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
        slot_mapping=cm.slot_mapping, causal=True,
    )  # fmt: skip
    return cm, metadata


def test_flash_attn_max_query_len_below_the_longest_query_is_a_defect(tmp_path: Path) -> None:
    assert _checked(tmp_path, *_fa(MIXED), backend="FLASH_ATTN") == []
    assert _hints(_checked(tmp_path, *_fa(MIXED, max_query_len=64), backend="FLASH_ATTN")) == []  # rounded up
    found = _hints(_checked(tmp_path, *_fa(MIXED, max_query_len=1), backend="FLASH_ATTN"))  # a decode-only maximum
    assert len(found) == 1 and found[0].location.request == 2 and "= 1 but request 2 has 30 query tokens" in found[0].evidence, found


def test_a_walk_past_the_columns_the_recorder_kept_is_not_judged(tmp_path: Path) -> None:
    # The recorder keeps ceil(common max_seq_len / block) = 3 of the table's 4 columns: a decode
    # hint of 64 walks 4, which the engine's table had (its width past the kept ones is unknown).
    found = _checked(tmp_path, *_trtllm(DECODE, hint=64, common_hint=33), backend="FLASHINFER")
    assert _hints(found) == [], [(f.check, f.evidence) for f in found]


def test_the_triton_replay_runs_the_hint_as_recorded_and_as_the_batch_implies() -> None:
    # `attndbg replay --plan both`: the derived plan launches max_extend_len = the longest extend
    # (40); the recorded one, 16, leaves request 0's tokens past the launched query blocks unwritten.
    spec = ("extend-prefix", "heads=4:2", "head_dim=32", "prefix_lens=8,3", "extend_lens=40,3", "shared_prefix=0")
    short = _sglang(spec, "triton", max_extend_len=16)
    runs = {isinstance(run.variant, Recorded): run for run in replay(short, "t", ["triton"], ReplayOptions(plan=PlanSource.BOTH)).runs}
    derived, recorded = runs[False], runs[True]
    assert derived.status is RunStatus.PASSED, derived.reason
    assert recorded.status is RunStatus.FAILED and recorded.comparison is not None, (recorded.status, recorded.reason)
    assert _hints(check_trace(short))[0].location.request == 0
