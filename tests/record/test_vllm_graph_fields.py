"""vLLM's CUDA-graph padding recorded as vLLM fills it, and the capture sizes its config gives.

Steps are vLLM 0.33's real `CommonAttentionMetadata` padded the way its FULL-graph runner pads
(2 decodes padded to 4 rows: query_start_loc's tail repeats its last entry, padded block-table
rows NULL_BLOCK_ID 0, padded tokens slot -1), recorded through the installed hook on vLLM's real
`TritonAttentionMetadataBuilder.build` and read back from the file:

- the graph section holds the engine's query offsets and block table as filled, padded rows
  included, and no request-pool indices (vLLM has no request pool; nothing is made up for it);
- the trace's capture sizes come from the real VllmConfig (max_num_seqs, cudagraph_capture_sizes)
  and the builder's untrimmed block table width; a padded step past the largest captured graph is
  a `capture-num-tokens` finding from `attndbg check`.
"""

from __future__ import annotations

from typing import Any

import torch

from attndbg.detector_api.context import CheckContext
from attndbg.detectors import registry
from attndbg.record.session import RecordingSession
from attndbg.trace.schema import Trace
from tests.record.check_cli import check_json
from tests.record.test_vllm_evidence import PADDED, pool_config  # noqa: F401  (fixture)
from tests.record.vllm_builder_env import new_builder, written
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import CommonAttentionMetadata, make_layout

CAPTURE_BS = len(PADDED["seq_lens"]) + PADDED["pad_reqs"]  # 4 rows, 4 tokens


def _record(session: RecordingSession, config: Any, cm: CommonAttentionMetadata) -> Trace:
    before = len(written(session))
    new_builder(config).build(0, cm)
    traces = written(session)
    assert len(traces) == before + 1 and session.stats.stopped_reason is None
    return traces[-1]


def test_the_padded_query_offsets_and_block_table_are_recorded_as_filled(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(**PADDED).cm
    trace = _record(session, pool_config, cm)
    graph = trace.graph
    assert (graph.is_graph_replay, graph.capture_bs, trace.batch.batch_size) == (True, CAPTURE_BS, 2)
    assert graph.padded_req_pool_indices is None  # no request pool in vLLM
    assert graph.padded_qo_indptr.tolist() == cm.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    # Cut to the ceil(max_seq_len / 16) = 3 columns any kernel reads; rows 2 and 3 are vLLM's null block.
    assert graph.padded_block_table.tolist() == cm.block_table_tensor[:, :3].tolist() == [[7, 3, 0], [5, 1, 9], [0, 0, 0], [0, 0, 0]]


def test_a_minus_one_padded_block_table_is_recorded_as_it_is(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(**PADDED).cm
    table = cm.block_table_tensor.clone()
    table[2:] = -1
    trace = _record(session, pool_config, cm.replace(block_table_tensor=table))
    assert trace.graph.padded_block_table[2:].eq(-1).all() and trace.graph.padded_block_table[:2].tolist() == [[7, 3, 0], [5, 1, 9]]


def test_an_unpadded_step_has_no_graph_section(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(PADDED["seq_lens"], PADDED["query_lens"], blocks=PADDED["blocks"]).cm
    assert _record(session, pool_config, cm).graph is None


def test_capture_sizes_come_from_the_config(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(**PADDED).cm
    compilation = pool_config.compilation_config
    before = (compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size)
    try:
        # On a CPU vLLM captures no graph (no sizes): max_num_tokens is unknown, never guessed.
        trace = _record(session, pool_config, cm)
        assert trace.capture.max_num_tokens is None
        assert trace.capture.max_bs == pool_config.scheduler_config.max_num_seqs
        assert trace.capture.block_table_width == cm.block_table_tensor.shape[1] == 4  # untrimmed, as the builder got it
        assert (trace.capture.max_kv_splits, trace.capture.mask_capacity, trace.capture.kv_indices_capacity) == (None, None, None)
        # What a GPU config holds: the graphs' sizes in tokens (vLLM sets the list and its maximum).
        compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = [1, 2, 4], 4
        trace = _record(session, pool_config, cm)
        assert trace.capture.max_num_tokens == 4
        # 4 padded tokens fit a graph of 4: the step's own invariants name no capture size.
        found = registry.load("invariants").run(CheckContext(trace=trace, path="t"))
        assert [f.check for f in found if f.check.startswith("capture-")] == []
    finally:
        compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = before


def test_a_padded_step_past_the_largest_captured_graph_is_a_finding(session: RecordingSession, pool_config) -> None:  # noqa: F811
    compilation = pool_config.compilation_config
    before = (compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size)
    compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = [1, 2], 2
    try:
        trace = _record(session, pool_config, make_layout(**PADDED).cm)
    finally:
        compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = before
    assert trace.capture.max_num_tokens == 2
    [step] = check_json(session.out_dir, only="invariants")["steps"]
    [found] = [f for f in step["findings"] if f["check"].startswith("capture-")]
    assert (found["class"], found["check"], found["location"]["field"]) == ("invariants", "capture-num-tokens", "graph.padded_out_cache_loc[2]")
    assert "runs 4 tokens" in found["evidence"] and "capture.max_num_tokens = 2" in found["evidence"]
    assert torch.equal(trace.graph.padded_out_cache_loc[2:], torch.tensor([-1, -1]))


def test_a_block_table_narrower_than_a_request_is_named_once(session: RecordingSession, pool_config) -> None:  # noqa: F811
    # Request 1 (33 tokens) needs 3 blocks of 16; the engine's table is 2 wide. The recorded table
    # and the captured width say the same thing: block-table-short names it, capture-block-table
    # stays quiet rather than reporting it twice.
    cm = make_layout(**PADDED).cm
    trace = _record(session, pool_config, cm.replace(block_table_tensor=cm.block_table_tensor[:, :2].clone()))
    assert trace.capture.block_table_width == 2
    [step] = check_json(session.out_dir, only="invariants")["steps"]
    checks = [(f["check"], f["location"].get("request")) for f in step["findings"]]
    assert ("block-table-short", 1) in checks and not any(c.startswith("capture-") for c, _ in checks), checks
