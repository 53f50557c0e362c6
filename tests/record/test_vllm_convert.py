"""vLLM CommonAttentionMetadata (the real class) -> Trace, per kind of step.

Each test builds a step the way vLLM's runner does, checks lengths, slots, out_cache_loc and
positions against values worked out by hand from the blocks it handed out, then proves the trace
is usable: it saves and loads (validation), replays clean through the reference and our Triton
kernels, and the detectors find nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attndbg.record.vllm.convert import Speculation, batch_from_common_metadata, convert_common, parents_from_tree_bias
from attndbg.trace.schema import ForwardMode, Trace
from tests.record.vllm_env import BLOCK_SIZE, NUM_BLOCKS, STALE_POSITION, Layout, make_layout, trace_of, usable

EAGLE3 = Speculation(method="eagle3", num_speculative_tokens=3)


def lists(t: torch.Tensor) -> list[int]:
    return t.tolist()


def assert_rows(trace: Trace, layout: Layout) -> None:
    batch = trace.batch
    assert lists(batch.kv_lens) == layout.seq_lens
    assert lists(batch.extend_lens) == layout.query_lens
    assert lists(batch.prefix_lens) == layout.context_lens
    for b in range(batch.batch_size):
        assert lists(batch.request_slots(b)) == layout.slots(b), b
    assert lists(batch.out_cache_loc) == layout.new_token_slots()
    assert lists(batch.positions) == layout.positions()
    assert lists(batch.seq_lens_raw) == layout.seq_lens  # vLLM's seq_lens count this step's tokens


def test_decode_slots_by_hand(tmp_path: Path) -> None:
    # Request 0: 20 columns in blocks 7, 3 -> slots 112..127, 48..51; its new token (column 19) is 51.
    # Request 1: 33 columns in blocks 5, 1, 9 -> 80..95, 16..31, 144; its new token is 144.
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    trace = usable(trace_of(convert_common(layout.cm, block_size=BLOCK_SIZE, kv_cache_size=NUM_BLOCKS * BLOCK_SIZE)), tmp_path / "d.pt")
    batch = trace.batch
    assert batch.forward_mode is ForwardMode.DECODE
    assert lists(batch.prefix_lens) == [19, 32] and lists(batch.extend_lens) == [1, 1]
    assert lists(batch.request_slots(0)) == list(range(112, 128)) + [48, 49, 50, 51]
    assert lists(batch.request_slots(1)) == list(range(80, 96)) + list(range(16, 32)) + [144]
    assert lists(batch.out_cache_loc) == [51, 144]
    assert lists(batch.positions) == [19, 32]
    assert lists(batch.seq_lens_raw) == [20, 33]
    assert batch.kv_cache_size == 192 and trace.graph is None and trace.spec is None


@pytest.mark.parametrize(
    ("name", "seq_lens", "query_lens", "mode"),
    [
        ("prefill", [8, 21], [8, 21], ForwardMode.EXTEND),
        ("prefill-after-prefix", [40, 9], [7, 9], ForwardMode.EXTEND),
        ("mixed-decodes-first", [30, 17, 25], [1, 1, 6], ForwardMode.MIXED),
    ],
)
def test_extend_and_mixed(tmp_path: Path, name: str, seq_lens: list[int], query_lens: list[int], mode: ForwardMode) -> None:
    layout = make_layout(seq_lens, query_lens, seed=len(name))
    trace = usable(trace_of(convert_common(layout.cm, block_size=BLOCK_SIZE, kv_cache_size=NUM_BLOCKS * BLOCK_SIZE)), tmp_path / f"{name}.pt")
    assert trace.batch.forward_mode is mode
    assert_rows(trace, layout)


def test_verify_chain_is_target_verify_with_chain_parents(tmp_path: Path) -> None:
    # Two requests verifying 1 + 3 tokens: seq_lens count the drafts, so the prefixes are 20 and 36.
    layout = make_layout([24, 40], [4, 4], seed=3)
    converted = convert_common(layout.cm, block_size=BLOCK_SIZE, kv_cache_size=NUM_BLOCKS * BLOCK_SIZE, speculation=EAGLE3)
    trace = usable(trace_of(converted), tmp_path / "verify.pt")
    assert trace.batch.forward_mode is ForwardMode.TARGET_VERIFY
    assert lists(trace.batch.prefix_lens) == [20, 36]
    assert trace.spec.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, 1, 2]]
    assert (trace.spec.draft_token_num, trace.spec.topk, trace.spec.steps, trace.spec.algorithm) == (4, 1, 3, "eagle3")
    assert trace.spec.custom_mask is None
    assert_rows(trace, layout)


def test_drafts_outside_an_all_verify_batch_stay_causal_extend() -> None:
    """Without the engine's speculative config, with a prefilling row, or next to a prefill, a
    verify-shaped row is an ordinary causal extend row (a chain is causal: same attention)."""
    plain = make_layout([24, 40], [4, 4], seed=3)
    assert convert_common(plain.cm, block_size=BLOCK_SIZE).batch.forward_mode is ForwardMode.EXTEND
    prefilling = make_layout([24, 40], [4, 4], seed=3, prefilling=[False, True])
    assert convert_common(prefilling.cm, block_size=BLOCK_SIZE, speculation=EAGLE3).spec is None
    with_prefill = make_layout([24, 9], [4, 9], seed=4)
    converted = convert_common(with_prefill.cm, block_size=BLOCK_SIZE, speculation=EAGLE3)
    assert converted.spec is None and converted.batch.forward_mode is ForwardMode.EXTEND


def test_graph_padded_decode(tmp_path: Path) -> None:
    # vLLM 0.33 FULL graph: 2 real decodes padded to 4 rows; padded rows seq_len 0, slot -1.
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]], pad_reqs=2, pad_tokens=2)
    trace = usable(trace_of(convert_common(layout.cm, block_size=BLOCK_SIZE, kv_cache_size=NUM_BLOCKS * BLOCK_SIZE)), tmp_path / "g.pt")
    assert trace.batch.batch_size == 2 and lists(trace.batch.out_cache_loc) == [51, 144]
    graph = trace.graph
    assert graph.is_graph_replay and graph.capture_bs == 4 and graph.fill_value == 0
    assert lists(graph.padded_seq_lens) == [20, 33, 0, 0]
    assert lists(graph.padded_out_cache_loc) == [51, 144, -1, -1]
    assert lists(graph.padded_positions) == [19, 32, STALE_POSITION, STALE_POSITION]
    # vLLM has no request pool: nothing is made up for it. Its padded query offsets and block table
    # are recorded as the engine filled them (the table cut at ceil(max_seq_len / 16) = 3 columns).
    assert graph.padded_req_pool_indices is None
    assert lists(graph.padded_qo_indptr) == [0, 1, 2, 2, 2]
    assert lists(graph.padded_block_table) == [[7, 3, 0], [5, 1, 9], [0, 0, 0], [0, 0, 0]]


def test_a_one_token_prompt_among_decodes_is_a_decode_step_as_vllm_runs_it(tmp_path: Path) -> None:
    """vLLM takes a batch of query length 1 throughout as a uniform decode and replays it in its FULL
    graph, a request's first (one-token) prefill among them; SGLang's rule would call the step MIXED,
    and fill-value, which replays graphs of decode and verify steps only, would skip its padding."""
    layout = make_layout([20, 1, 33], [1, 1, 1], seed=5, pad_reqs=1, pad_tokens=1)
    trace = usable(trace_of(convert_common(layout.cm, block_size=BLOCK_SIZE, kv_cache_size=NUM_BLOCKS * BLOCK_SIZE)), tmp_path / "p.pt")
    assert trace.batch.forward_mode is ForwardMode.DECODE
    assert lists(trace.batch.prefix_lens) == [19, 0, 32] and lists(trace.batch.extend_lens) == [1, 1, 1]
    assert trace.graph is not None and trace.graph.capture_bs == 4
    assert_rows(trace, layout)


def test_a_row_without_tokens_before_a_real_row_is_recorded() -> None:
    # Padding before a real row is the engine's mistake (vLLM pads only after): recorded, not refused.
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    cm = layout.cm.replace(seq_lens=torch.tensor([0, 33], dtype=torch.int32), query_start_loc=torch.tensor([0, 0, 1], dtype=torch.int32))
    batch = batch_from_common_metadata(cm, BLOCK_SIZE)
    assert lists(batch.kv_lens) == [0, 33] and lists(batch.extend_lens) == [0, 1] and lists(batch.out_cache_loc) == [144]


def test_pool_size_is_at_least_what_the_step_references() -> None:
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    assert batch_from_common_metadata(layout.cm, BLOCK_SIZE).kv_cache_size == 10 * BLOCK_SIZE  # block 9 is the highest
    assert batch_from_common_metadata(layout.cm, BLOCK_SIZE, kv_cache_size=4096).kv_cache_size == 4096


def test_positions_are_derived_when_vllm_does_not_pass_them() -> None:
    layout = make_layout([30, 17, 25], [1, 1, 6], seed=5, with_positions=False)
    assert lists(batch_from_common_metadata(layout.cm, BLOCK_SIZE).positions) == layout.positions()


def test_tree_parents_from_vllms_tree_bias() -> None:
    # speculative_token_tree [(0,), (1,), (0, 0), (0, 1), (1, 0)] in level order after the root:
    # token 1 = (0,), 2 = (1,), 3 = (0,0), 4 = (0,1), 5 = (1,0).
    parents = [-1, 0, 0, 1, 1, 2]
    n = len(parents)
    bias = torch.full((n, n), float("-inf"))
    for i in range(n):
        j = i
        while j >= 0:
            bias[i, j] = 0.0
            j = parents[j]
    assert parents_from_tree_bias(bias).tolist() == parents


def test_tree_verify_from_vllms_tree_attention(tmp_path: Path) -> None:
    # Classic tree attention: 1 + 5 tokens per request, tree as above, positions by depth.
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    layout = make_layout([26, 38], [6, 6], seed=7, with_positions=False)
    speculation = Speculation(method="eagle", num_speculative_tokens=5)
    converted = convert_common(layout.cm, block_size=BLOCK_SIZE, speculation=speculation, tree_parents=parents)
    trace = usable(trace_of(converted), tmp_path / "tree.pt")
    assert trace.batch.forward_mode is ForwardMode.TARGET_VERIFY
    assert (trace.spec.topk, trace.spec.parents.tolist()) == (2, [parents.tolist()] * 2)
    depth = [0, 1, 1, 2, 2, 2]
    assert lists(trace.batch.positions) == [20 + d for d in depth] + [32 + d for d in depth]
