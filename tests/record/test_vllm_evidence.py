"""The vLLM recorder keeps the evidence: a mistake planted in vLLM's own
CommonAttentionMetadata is recorded through the installed hook on vLLM's real
TritonAttentionMetadataBuilder, never refused, and `check` names it with its class and location;
the same step without the mistake (CUDA-graph padded steps included) has no finding at all.

Mistakes are planted with vLLM's own `CommonAttentionMetadata.replace`, in both the device tensor
and its host mirror where the runner writes both (it fills the host buffer and copies it over).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.record.session import RecordingSession
from attndbg.record.vllm.convert import convert_common
from attndbg.record.vllm.fields import ENGINE_FIELDS, FIELDS_BY_NAME, Trim
from attndbg.record.vllm.plan import plan_from_metadata
from attndbg.trace import io
from attndbg.trace.schema import ForwardMode, Trace
from tests.record.vllm_builder_env import HEAD_DIM, KV_HEADS, LAYERS, kv_cache_interface, new_builder, triton_attn, written
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import BLOCK_SIZE, NUM_BLOCKS, CommonAttentionMetadata, make_layout, trace_of

# Two decodes padded to a FULL-graph capture size of 4 (vLLM 0.33: padded rows seq_len 0,
# query_len 0, NULL_BLOCK_ID rows; padded tokens slot -1). Request 0: blocks 7, 3 (slots
# 112..127, 48..51, new token at column 19 -> 51); request 1: blocks 5, 1, 9 (new token at 32 -> 144).
PADDED = {"seq_lens": [20, 33], "query_lens": [1, 1], "blocks": [[7, 3], [5, 1, 9]], "pad_reqs": 2, "pad_tokens": 2}
MIXED = {"seq_lens": [30, 17, 25], "query_lens": [1, 1, 6], "seed": 11}
OUTSIDE_POOL = NUM_BLOCKS + 28  # a block id the 12-block pool does not have
NO_KERNELS = ("reference",)  # CheckOptions.backends: the reference is never a kernel under test


@pytest.fixture
def pool_config(vllm_config):
    """The engine process's config after profiling: cache_config.num_gpu_blocks is the pool."""
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    yield vllm_config
    vllm_config.cache_config.num_gpu_blocks = None


def record(session: RecordingSession, config: Any, cm: CommonAttentionMetadata) -> Trace:
    new_builder(config).build(0, cm)
    [trace] = written(session)
    assert session.stats.stopped_reason is None  # recorded, not refused
    return trace


def findings_of(session: RecordingSession, kinds: list[FindingClass], backends: tuple[str, ...] = ("triton",)) -> list[tuple[str, str, int | None, str | None]]:
    reports = check_steps(str(session.out_dir), kinds, CheckOptions(backends=backends))
    found = [f for report in reports for f in report.findings]
    return [(f.kind.value, f.check, f.location.request, f.location.field) for f in found]


@contextlib.contextmanager
def configured(section: Any, **values: Any) -> Iterator[None]:
    """A section of the engine's config (what the hook reads at build time) with `values` set
    while a step is recorded, as they were after."""
    before = {name: getattr(section, name) for name in values}
    for name, value in values.items():
        setattr(section, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(section, name, value)


def qsl(values: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor(values, dtype=torch.int32)
    return {"query_start_loc": t, "query_start_loc_cpu": t.clone()}


def seq_lens(values: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor(values, dtype=torch.int32)
    return {"seq_lens": t, "seq_lens_cpu_upper_bound": t.clone()}


def table_entry(cm: CommonAttentionMetadata, row: int, col: int, value: int) -> dict[str, torch.Tensor]:
    table = cm.block_table_tensor.clone()
    table[row, col] = value
    return {"block_table_tensor": table}


def slot(cm: CommonAttentionMetadata, token: int, value: int) -> dict[str, torch.Tensor]:
    slots = cm.slot_mapping.clone()
    slots[token] = value
    return {"slot_mapping": slots}


Plant = Callable[[CommonAttentionMetadata], dict[str, torch.Tensor]]
MISTAKES: list[tuple[str, dict[str, Any], Plant, tuple[str, str, int, str]]] = [
    # The padded tail zeroed instead of repeating query_start_loc[2] = 2.
    ("query-start-loc-tail-decreases", PADDED, lambda cm: qsl([0, 1, 2, 0, 0]), ("invariants", "indptr-decreases", 2, "plan.common.query_start_loc[3]")),
    # Padded rows left at 1 (Triton's build_for_cudagraph_capture fills 1) instead of vLLM's 0.
    ("padded-row-seq-len-1", PADDED, lambda cm: seq_lens([20, 33, 1, 1]), ("fill-value", "padded-seq-len-stale", 2, "graph.padded_seq_lens[2]")),
    # The padding fill (0) written from row 1 on: a live request gets seq_len 0.
    ("padded-seq-len-0-over-a-live-row", PADDED, lambda cm: seq_lens([20, 0, 0, 0]), ("invariants", "seq-lens", 1, "batch.seq_lens_raw[1]")),
    ("block-table-minus-1", PADDED, lambda cm: table_entry(cm, 1, 1, -1), ("invariants", "index-outside-cache", 1, "plan.common.block_table_tensor[1, 1]")),
    ("block-past-the-pool", MIXED, lambda cm: table_entry(cm, 2, 0, OUTSIDE_POOL), ("invariants", "index-outside-cache", 2, "plan.common.block_table_tensor[2, 0]")),
    ("null-block-in-a-live-row", PADDED, lambda cm: table_entry(cm, 0, 1, 0), ("invariants", "null-block-read", 0, "plan.common.block_table_tensor[0, 1]")),
    # Request 1's token written to request 0's slot 51; request 0's token never written (-1).
    ("slot-mapping-of-another-request", PADDED, lambda cm: slot(cm, 1, 51), ("invariants", "slot-mapping", 1, "plan.common.slot_mapping[1]")),
    ("slot-mapping-skips-a-live-token", MIXED, lambda cm: slot(cm, 4, -1), ("invariants", "slot-mapping", 2, "plan.common.slot_mapping[4]")),
    ("query-start-loc-host-mirror-stale", MIXED, lambda cm: {"query_start_loc_cpu": torch.tensor([0, 1, 2, 7], dtype=torch.int32)}, ("invariants", "host-mirror", 3, "plan.common.query_start_loc_cpu[3]")),
]


@pytest.mark.parametrize(("name", "layout", "plant", "expected"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_planted_mistake_is_recorded_and_named(
    session: RecordingSession, pool_config, name: str, layout: dict[str, Any], plant: Plant, expected: tuple[str, str, int, str]
) -> None:
    cm = make_layout(**layout).cm
    trace = record(session, pool_config, cm.replace(**plant(cm)))
    assert trace.plan.scalars["vllm.num_gpu_blocks"] == NUM_BLOCKS
    # The metadata detectors alone: no kernel runs (the clean steps below run them all, with Triton).
    assert findings_of(session, [FindingClass.INVARIANT, FindingClass.FILL_VALUE], backends=NO_KERNELS) == [expected]


def test_the_finding_names_the_first_bad_element(session: RecordingSession, pool_config) -> None:
    cm = make_layout(**PADDED).cm
    record(session, pool_config, cm.replace(**slot(cm, 1, 51)))
    [report] = list(check_steps(str(session.out_dir), [FindingClass.INVARIANT], CheckOptions(backends=NO_KERNELS)))
    [finding] = report.findings
    location = finding.location
    assert (location.step, location.request, location.row, location.column) == (0, 1, 1, 32)
    assert (finding.data["expected"], finding.data["found"]) == (144, 51)
    assert "= 51" in finding.evidence and "= 144" in finding.evidence and "request 0's KV column 19" in finding.cause


def test_a_padded_row_with_seq_len_1_is_padding_not_a_request(session: RecordingSession, pool_config) -> None:
    cm = make_layout(**PADDED).cm
    trace = record(session, pool_config, cm.replace(**seq_lens([20, 33, 1, 1])))
    assert trace.batch.forward_mode is ForwardMode.DECODE and trace.batch.batch_size == 2
    graph = trace.graph
    assert (graph.capture_bs, graph.fill_value) == (4, 0)
    assert graph.padded_seq_lens.tolist() == [20, 33, 1, 1]  # as the engine left them
    assert graph.padded_out_cache_loc.tolist() == [51, 144, -1, -1]


def test_a_decreasing_tail_is_recorded_verbatim(session: RecordingSession, pool_config) -> None:
    cm = make_layout(**PADDED).cm
    trace = record(session, pool_config, cm.replace(**qsl([0, 1, 2, 0, 0])))
    assert trace.plan.tensors["common.query_start_loc"].tolist() == [0, 1, 2, 0, 0]
    assert trace.plan.tensors["query_start_loc"].tolist() == [0, 1, 2, 0, 0]  # the builder passed it on
    assert trace.batch.batch_size == 2 and trace.batch.out_cache_loc.tolist() == [51, 144]


def test_a_padded_token_without_a_padded_row_that_writes_live_kv_is_named(session: RecordingSession, pool_config) -> None:
    """vLLM's uniform decode pads tokens past query_start_loc[-1] with no padded row: a padded token
    whose slot_mapping entry is live KV (request 0's new token, slot 51) instead of -1 is named,
    though no padded request exists to own it."""
    cm = make_layout(**{**PADDED, "pad_reqs": 0}).cm
    slots = cm.slot_mapping.clone()
    slots[2] = 51
    trace = record(session, pool_config, cm.replace(slot_mapping=slots))
    assert trace.batch.batch_size == 2 and trace.graph.padded_out_cache_loc.tolist() == [51, 144, 51, -1]
    assert findings_of(session, parse_only("fill-value")) == [("fill-value", "padded-kv-write", None, "graph.padded_out_cache_loc[2]")]


CLEAN = [
    ("decode", {"seq_lens": [20, 33], "query_lens": [1, 1], "blocks": [[7, 3], [5, 1, 9]]}),
    ("decode-graph-padded", PADDED),
    # Tokens padded past query_start_loc[-1] with no padded row: a FULL graph of a batch of
    # max_num_seqs requests (vLLM 0.33 pads the rows with the tokens up to max_num_seqs).
    ("decode-tokens-padded-at-max-num-seqs", {**PADDED, "pad_reqs": 0, "max_num_seqs": 2}),
    ("mixed", MIXED),
    ("mixed-graph-padded", {**MIXED, "pad_reqs": 1, "pad_tokens": 3}),
    ("prefill-after-prefix", {"seq_lens": [40, 9], "query_lens": [7, 9], "seed": 4}),
]


@contextlib.contextmanager
def clean_step(config: Any, layout: dict[str, Any]) -> Iterator[tuple[CommonAttentionMetadata, int]]:
    """A CLEAN layout's metadata and the max_num_seqs it is recorded under (the config's, unless the
    layout names its own), the config set to it meanwhile."""
    layout = dict(layout)
    rows = layout.pop("max_num_seqs", config.scheduler_config.max_num_seqs)
    with configured(config.scheduler_config, max_num_seqs=rows):
        yield make_layout(**layout).cm, rows


@pytest.mark.parametrize(("name", "layout"), CLEAN, ids=[c[0] for c in CLEAN])
def test_the_same_steps_without_the_mistake_are_clean(session: RecordingSession, pool_config, name: str, layout: dict[str, Any]) -> None:
    with clean_step(pool_config, layout) as (cm, rows):
        trace = record(session, pool_config, cm)
    assert trace.capture is not None and trace.capture.max_bs == rows  # the recorder keeps max_num_seqs
    padded = layout.get("pad_reqs", 0) or layout.get("pad_tokens", 0)
    assert (trace.graph is not None) == bool(padded)
    assert findings_of(session, parse_only(None)) == []


# num_actual_tokens past query_start_loc[-1]: vLLM 0.33 pads the tokens only in a FULL graph, and
# pads the rows with them (zero-length rows) up to max_num_seqs. MIXED with 4 tokens more than its
# requests' 8 and no padded row is the draft metadata of vLLM #56181 (DP padding, eager).
UNOWNED = {**MIXED, "pad_tokens": 4}
UNOWNED_CASES = [
    ("dp-padded-tokens-without-rows", UNOWNED, 128, [("invariants", "unowned-tokens", None, "plan.scalars.common.num_actual_tokens")]),
    ("the-same-step-unpadded", MIXED, 128, []),
    ("full-graph-decode-with-padded-rows", PADDED, 128, []),
    ("full-graph-of-max-num-seqs-requests", {**PADDED, "pad_reqs": 0}, 2, []),
    ("max-num-seqs-not-recorded", UNOWNED, None, []),
]


@pytest.mark.parametrize(("name", "layout", "rows", "expected"), UNOWNED_CASES, ids=[c[0] for c in UNOWNED_CASES])
def test_tokens_no_request_owns_outside_a_graphs_padding(
    session: RecordingSession, pool_config, name: str, layout: dict[str, Any], rows: int | None, expected: list[tuple[str, str, int | None, str]]
) -> None:
    builder = new_builder(pool_config)  # built with the config's max_num_seqs (Triton sizes buffers by it)
    with configured(pool_config.scheduler_config, max_num_seqs=rows):  # None: a config without it
        builder.build(0, make_layout(**layout).cm)
    [trace] = written(session)
    assert (trace.capture.max_bs if trace.capture is not None else None) == rows
    assert findings_of(session, [FindingClass.INVARIANT, FindingClass.FILL_VALUE], backends=NO_KERNELS) == expected


def test_the_unowned_tokens_finding_states_the_counts(session: RecordingSession, pool_config) -> None:
    record(session, pool_config, make_layout(**UNOWNED).cm)
    [report] = list(check_steps(str(session.out_dir), [FindingClass.INVARIANT], CheckOptions(backends=NO_KERNELS)))
    [finding] = report.findings
    assert (finding.data["found"], finding.data["expected"], finding.data["num_reqs"], finding.data["max_num_seqs"]) == (12, 8, 3, 128)
    assert "num_actual_tokens (12)" in finding.cause and "query_start_loc[-1] = 8" in finding.cause
    assert "num_reqs = 3" in finding.cause and "max_num_seqs = 128" in finding.cause


# vLLM V2's adaptive verification (speculative_config.enable_adaptive_verification): 3 verify
# requests of 1 bonus + up to 3 drafts, a draft budget of 6 admitted on the device as 3, 1, 2
# (query_start_loc 0, 4, 6, 9) while the host copy spreads it evenly, 2, 2, 2 (0, 3, 6, 9).
ADAPTIVE = {"seq_lens": [30, 17, 25], "query_lens": [4, 2, 3], "seed": 11}
ADAPTIVE_CASES = [
    ("boundaries-differ-totals-agree", True, [0, 3, 6, 9], []),
    ("boundaries-differ-without-adaptive-verification", False, [0, 3, 6, 9], [("invariants", "host-mirror", 1, "plan.common.query_start_loc_cpu[1]")]),
    ("the-total-differs", True, [0, 3, 6, 8], [("invariants", "host-mirror", 3, "plan.common.query_start_loc_cpu")]),
    ("a-request-missing", True, [0, 4, 9], [("invariants", "host-mirror", 2, "plan.common.query_start_loc_cpu")]),
]


@pytest.mark.parametrize(("name", "adaptive", "host", "expected"), ADAPTIVE_CASES, ids=[c[0] for c in ADAPTIVE_CASES])
def test_adaptive_verification_keeps_only_the_host_totals(
    session: RecordingSession, pool_config, name: str, adaptive: bool, host: list[int], expected: list[tuple[str, str, int, str]]
) -> None:
    builder = new_builder(pool_config)
    cm = make_layout(**ADAPTIVE).cm
    speculative = SimpleNamespace(enable_adaptive_verification=adaptive)  # the option alone: no draft model here
    with configured(pool_config, speculative_config=speculative):
        builder.build(0, cm.replace(query_start_loc_cpu=torch.tensor(host, dtype=torch.int32)))
    [trace] = written(session)
    assert trace.plan.scalars.get("vllm.adaptive_verification", False) is adaptive
    assert findings_of(session, [FindingClass.INVARIANT, FindingClass.FILL_VALUE], backends=NO_KERNELS) == expected


WINDOW = 16  # vLLM's sliding_window: a query sees itself and the 15 keys before it
# Request 0 (40 columns, new token at 39) sees columns 24..39: vLLM's worker nulls block 0 (columns
# 0..15), wholly below the window; block 1 (16..31) is still read.
WINDOWED = {"seq_lens": [40, 20], "query_lens": [1, 1], "blocks": [[0, 4, 6], [2, 8]]}


@pytest.mark.parametrize(("name", "plant", "expected"), [("clean", None, []), ("null-block-in-the-window", 1, [("invariants", "null-block-read", 0, "plan.common.block_table_tensor[0, 1]")])])
def test_sliding_window_null_blocks_before_the_window_are_not_read(
    session: RecordingSession, pool_config, name: str, plant: int | None, expected: list[tuple[str, str, int, str]]
) -> None:
    spec = kv_cache_interface.SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=WINDOW)
    builder = triton_attn.TritonAttentionMetadataBuilder(spec, LAYERS, pool_config, torch.device("cpu"))
    cm = make_layout(**WINDOWED).cm
    if plant is not None:
        cm = cm.replace(**table_entry(cm, 0, plant, 0))
    builder.build(0, cm)
    [trace] = written(session)
    assert trace.model.sliding_window == WINDOW - 1
    assert findings_of(session, parse_only(None) if plant is None else [FindingClass.INVARIANT], backends=("triton",) if plant is None else NO_KERNELS) == expected


def test_every_field_of_vllms_common_metadata_is_in_the_table_or_not_a_tensor() -> None:
    """A field vLLM adds shows up here: the table must say how it is recorded and who reads it."""
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata) if not f.name.startswith("_")}
    table = {f.name for f in ENGINE_FIELDS}
    scalars_or_host = {"num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal", "num_logits_indices", "max_logits_per_req"}
    not_tensors = {"encoder_seq_lens_cpu", "req_idx", "mm_req_doc_ranges"}  # numpy / dict: not recorded
    assert names - table - scalars_or_host - not_tensors == set()
    assert FIELDS_BY_NAME["block_table_tensor"].trim is Trim.TABLE


def test_recorded_common_metadata_is_verbatim_but_for_its_trim(session: RecordingSession, pool_config) -> None:
    layout = make_layout(**PADDED)
    trace = record(session, pool_config, layout.cm)
    plan, cm = trace.plan, layout.cm
    for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "slot_mapping", "positions", "is_prefilling", "seq_lens_cpu_upper_bound"):
        assert torch.equal(plan.tensors[f"common.{name}"], getattr(cm, name)), name
    # Columns past ceil(max_seq_len 33 / 16) = 3 are never read.
    assert torch.equal(plan.tensors["common.block_table_tensor"], cm.block_table_tensor[:, :3])
    assert (plan.scalars["common.num_reqs"], plan.scalars["common.num_actual_tokens"], plan.scalars["common.max_seq_len"]) == (4, 4, 33)
    assert not any(k.startswith("common.") and k.endswith("_data_ptr") for k in plan.scalars)


def test_a_recording_without_the_evidence_is_checked_on_the_builders_own_fields(vllm_config, tmp_path: Path) -> None:
    """Recordings made before `common.*` was kept: TritonAttentionMetadata passes query_start_loc
    and the block table on under its own names, and those are checked instead."""
    cm = make_layout(**PADDED).cm
    cm = cm.replace(**qsl([0, 1, 2, 0, 0]), **table_entry(cm, 1, 1, -1))
    metadata = new_builder(vllm_config).build(0, cm)
    plan = plan_from_metadata(metadata, backend="TRITON_ATTN", block_size=BLOCK_SIZE, max_seq_len=int(cm.max_seq_len))
    assert not any(name.startswith("common.") for name in plan.tensors)
    trace = trace_of(convert_common(cm, block_size=BLOCK_SIZE), plan=plan)
    path = io.save(trace, tmp_path / "old.pt")
    reports = check_steps(str(path), [FindingClass.INVARIANT], CheckOptions(backends=NO_KERNELS))
    found = [(f.check, f.location.request, f.location.field) for report in reports for f in report.findings]
    assert found == [("indptr-decreases", 2, "plan.query_start_loc[3]"), ("index-outside-cache", 1, "plan.block_table[1, 1]")]
