"""invariants over what a vLLM metadata builder handed its kernels (vllm_builder.py), each with its
correct twin, on small and server-shaped steps recorded through the vLLM converter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from attndbg.detectors.invariants.detect import check_trace
from attndbg.trace import io
from tests.corpus import vllm_engine as vl
from tests.record.engines import import_engine

flash_attn = import_engine("vllm.v1.attention.backends.flash_attn")

MIXED = dict(seq_lens=[20, 33, 40], query_lens=[1, 1, 24], blocks=[[7, 3], [5, 1, 9], [2, 4, 6]])


def _checked(tmp_path: Path, cm: Any, metadata: Any, **kwargs: Any) -> list:
    out = tmp_path / "rec"
    vl.record(out, cm, metadata, **kwargs)
    (entry,) = io.read_manifest(out)
    return check_trace(io.load(out / entry.file))


def _labels(found: list) -> list[str]:
    return [f.check for f in found]


def _fa(cm: Any, **overrides: Tensor) -> Any:
    fields = dict(seq_lens=cm.seq_lens, block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping, query_start_loc=cm.query_start_loc)
    fields.update(overrides)
    return flash_attn.FlashAttentionMetadata(
        num_actual_tokens=cm.num_actual_tokens, max_query_len=int(cm.max_query_len), max_seq_len=cm.max_seq_len, causal=True, **fields
    )


def test_a_builder_copy_that_disagrees_with_the_common_metadata_is_named(tmp_path: Path) -> None:
    cm = vl.Step(**MIXED).common()
    stale = cm.seq_lens.clone()
    stale[1] -= 1  # a persistent seq_lens buffer one step behind for request 1
    found = [f for f in _checked(tmp_path, cm, _fa(cm, seq_lens=stale), backend="FLASH_ATTN", model=vl.mha_model()) if f.check == "builder-copy"]
    assert len(found) == 1 and found[0].location.request == 1 and found[0].location.field == "plan.seq_lens[1]", found
    assert "= 32, but plan.common.seq_lens gives 33" in found[0].evidence


def test_a_block_table_copy_missing_a_real_entry_is_named(tmp_path: Path) -> None:
    cm = vl.Step(**MIXED).common()
    table = cm.block_table_tensor.clone()
    table[2, 1] = 11  # another block than the step's table gives request 2's second page
    found = [f for f in _checked(tmp_path, cm, _fa(cm, block_table=table), backend="FLASH_ATTN", model=vl.mha_model()) if f.check == "builder-copy"]
    assert len(found) == 1 and found[0].location.field == "plan.block_table[2, 1]" and found[0].location.request == 2, found


def test_the_builders_own_copies_are_clean(tmp_path: Path) -> None:
    cm = vl.Step(**MIXED).common()
    assert _checked(tmp_path, cm, _fa(cm), backend="FLASH_ATTN", model=vl.mha_model()) == []


def _counts(cm: Any, *, decodes: int, decode_tokens: int, prefills: int, prefill_tokens: int) -> Any:
    # FlashInferMetadata's fields as the builder fills them (its module imports FlashInfer).
    return SimpleNamespace(
        num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens,
        block_table_tensor=cm.block_table_tensor, num_decodes=decodes, num_decode_tokens=decode_tokens, num_prefills=prefills,
        num_prefill_tokens=prefill_tokens, use_cascade=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("counts", "field"),
    [
        (dict(decodes=2, decode_tokens=1, prefills=1, prefill_tokens=24), "num_decode_tokens"),  # one decode's token given to the prefill part
        (dict(decodes=2, decode_tokens=2, prefills=1, prefill_tokens=25), "num_prefill_tokens"),
        (dict(decodes=2, decode_tokens=2, prefills=2, prefill_tokens=24), "num_prefills"),
    ],
)
def test_builder_counts_against_the_query_offsets(tmp_path: Path, counts: dict, field: str) -> None:
    cm = vl.Step(**MIXED).common()
    found = _checked(tmp_path, cm, _counts(cm, **counts), backend="FLASHINFER", model=vl.mha_model())
    named = [f for f in found if f.check == "builder-counts"]
    assert len(named) == 1 and named[0].location.field == f"plan.scalars.{field}", _labels(found)


def test_right_builder_counts_are_clean(tmp_path: Path) -> None:
    cm = vl.Step(**MIXED).common()
    assert _checked(tmp_path, cm, _counts(cm, decodes=2, decode_tokens=2, prefills=1, prefill_tokens=24), backend="FLASHINFER", model=vl.mha_model()) == []


def _paged(cm: Any, page: int, *, host_names: bool) -> Any:
    seq = cm.seq_lens.to(torch.int64)
    pages = (seq + page - 1) // page
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    last = (seq - (pages - 1) * page).to(torch.int32)
    suffix = "_cpu" if host_names else ""
    base = _counts(cm, decodes=2, decode_tokens=2, prefills=1, prefill_tokens=24)
    setattr(base, f"paged_kv_indptr{suffix}", indptr)
    setattr(base, f"paged_kv_last_page_len{suffix}", last)
    return base


@pytest.mark.parametrize("host_names", [False, True])
def test_paged_kv_lists_at_another_page_size_are_named(tmp_path: Path, host_names: bool) -> None:
    """The lists vLLM's FlashInfer builder derives (0.11's `_cpu` host copies too) at 32 over a
    cache of 16-token pages: kv-length and kv-last-page-len; at 16 they are clean."""
    cm = vl.Step(**MIXED).common()
    found = _checked(tmp_path, cm, _paged(cm, 32, host_names=host_names), backend="FLASHINFER", model=vl.mha_model())
    assert {"kv-length", "kv-last-page-len"} <= set(_labels(found)), _labels(found)
    assert _checked(tmp_path / "twin", cm, _paged(cm, 16, host_names=host_names), backend="FLASHINFER", model=vl.mha_model()) == []


@dataclass
class _Prefill:
    """MLACommonPrefillMetadata's index fields (test fixture: its module needs vLLM's GPU build)."""

    block_table: Tensor
    query_start_loc: Tensor


@dataclass
class _Decode:
    """MLACommonDecodeMetadata's index fields."""

    block_table: Tensor
    seq_lens: Tensor


@dataclass
class _Mla:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: Tensor
    slot_mapping: Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: _Decode
    prefill: _Prefill


def _server_mixed() -> vl.Step:
    """48 decodes and 16 chunked prefills (vLLM orders decodes first) with long prefixes on a
    pool large enough to hold them."""
    decodes, prefills = 48, 16
    seq = [900 + 37 * b for b in range(decodes)] + [1500 + 61 * b for b in range(prefills)]
    query = [1] * decodes + [64 + b for b in range(prefills)]
    blocks, next_block = [], 1
    for s in seq:
        n = -(-s // 64)
        blocks.append(list(range(next_block, next_block + n)))
        next_block += n
    return vl.Step(seq_lens=seq, query_lens=query, blocks=blocks, block_size=64)


def test_a_server_shaped_mixed_mla_step_with_decode_and_prefill_parts_is_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = _server_mixed()
    monkeypatch.setattr(vl, "NUM_BLOCKS", sum(len(b) for b in step.blocks) + 1)
    cm = step.common()
    d = 48
    qsl = cm.query_start_loc
    metadata = _Mla(
        num_reqs=cm.num_reqs, num_actual_tokens=cm.num_actual_tokens, query_start_loc=qsl, slot_mapping=cm.slot_mapping, num_decodes=d,
        num_decode_tokens=int(qsl[d]), num_prefills=16, decode=_Decode(cm.block_table_tensor[:d], cm.seq_lens[:d]),
        prefill=_Prefill(cm.block_table_tensor[d:], qsl[d:] - qsl[d]),
    )  # fmt: skip
    assert _checked(tmp_path, cm, metadata, backend="FLASHMLA", model=vl.mla_model(block_size=64), builder="FlashMLAMetadataBuilder") == []
    # The prefill part's table one row off (the decodes' last row first): named at its request.
    metadata.prefill = _Prefill(cm.block_table_tensor[d - 1 : -1], qsl[d:] - qsl[d])
    found = [f for f in _checked(tmp_path / "bug", cm, metadata, backend="FLASHMLA", model=vl.mla_model(block_size=64)) if f.check == "builder-copy"]
    assert found and found[0].location.request == d and found[0].location.field.startswith("plan.prefill.block_table[0, "), found


def test_a_server_shaped_graph_padded_decode_batch_is_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 decodes padded to a 72-row FULL graph (vLLM's padding: seq_len 0, null block rows): the
    builder's copies span the padded rows, which are fill-value's to judge, not a copy mismatch."""
    seq = [300 + 53 * b for b in range(64)]
    blocks, next_block = [], 1
    for s in seq:
        n = -(-s // 16)
        blocks.append(list(range(next_block, next_block + n)))
        next_block += n
    monkeypatch.setattr(vl, "NUM_BLOCKS", next_block)
    cm = vl.Step(seq_lens=seq, query_lens=[1] * 64, blocks=blocks, pad_reqs=8).common()
    capture = vl.CaptureSizes(max_bs=72, max_num_tokens=72, block_table_width=int(cm.block_table_tensor.shape[1]))
    found = _checked(tmp_path, cm, _fa(cm), backend="FLASH_ATTN", model=vl.mha_model(), capture=capture)
    assert [f for f in found if f.check.startswith("builder-") or f.check.startswith("kv-")] == [], _labels(found)


DECODES = dict(seq_lens=[20, 33, 40], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2, 4, 6]])


@pytest.mark.parametrize(
    ("bound", "scheduled", "padded", "named"),
    [
        (0, True, True, True),  # scheduled each step, no bound, graph replay: vLLM #20301
        (16, True, True, False),  # the fix: the capture's bound
        (0, False, True, False),  # no ahead-of-time schedule (FA2): nothing is scheduled outside the graph
        (0, True, False, False),  # eager: nothing was captured
    ],
)
def test_split_bound_of_an_ahead_of_time_schedule_under_a_graph(tmp_path: Path, bound: int, scheduled: bool, padded: bool, named: bool) -> None:
    """FlashAttentionMetadata of a FULL-graph decode with FA3's ahead-of-time schedule (vLLM's
    persistent buffer at FA3's size; its contents are FA3's, made on the GPU) and a split bound."""
    cm = vl.Step(**DECODES, pad_reqs=1 if padded else 0).common()
    schedule = {"scheduler_metadata": torch.zeros(1 + -(-int(cm.num_reqs) // 4) * 4 * 4, dtype=torch.int32)} if scheduled else {}
    metadata = _fa(cm, **schedule)
    metadata.max_num_splits = bound
    capture = vl.CaptureSizes(max_bs=64, max_num_tokens=64, block_table_width=int(cm.block_table_tensor.shape[1]))
    found = _checked(tmp_path, cm, metadata, backend="FLASH_ATTN", model=vl.mha_model(), capture=capture)
    assert ("split-bound" in _labels(found)) is named, _labels(found)
    assert [c for c in _labels(found) if c != "split-bound"] == [], _labels(found)


def _decode_lists(cm: Any, tail: list[int], *, decode_tokens: int) -> Any:
    """FlashInfer's native-decode lists (0.11 host names) for cm's rows, then `tail` more indptr
    entries (rows the builder planned past the requests) and last-page lengths of 1 for them."""
    seq = cm.seq_lens.to(torch.int64)
    pages = (seq + 15) // 16
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0), torch.tensor(tail, dtype=torch.int64)]).to(torch.int32)
    last = torch.cat([torch.where(seq > 0, seq - (pages - 1) * 16, 0), torch.ones(len(tail), dtype=torch.int64)]).to(torch.int32)
    rows = int(cm.num_reqs)
    return SimpleNamespace(
        num_actual_tokens=int(cm.num_actual_tokens), paged_kv_indptr_cpu=indptr, paged_kv_last_page_len_cpu=last, num_decodes=rows,
        num_decode_tokens=decode_tokens, num_prefills=0, num_prefill_tokens=0, seq_lens=cm.seq_lens, block_table_tensor=cm.block_table_tensor,
    )  # fmt: skip


def test_paged_kv_rows_past_the_requests_that_list_pages_are_named(tmp_path: Path) -> None:
    # A PIECEWISE draft decode (vLLM #39773): 3 requests, tokens padded to 4; the builder planned 4
    # rows, the 4th from a stale persistent entry (11 past the 8 listed pages).
    padded = vl.Step(**DECODES).common()
    padded.num_actual_tokens = 4
    found = [f for f in _checked(tmp_path, padded, _decode_lists(padded, [11], decode_tokens=4), backend="FLASHINFER", model=vl.mha_model()) if f.check == "builder-rows"]
    assert len(found) == 1 and found[0].location.field == "plan.paged_kv_indptr[4]" and found[0].location.row == 3, found
    assert "5 entries for 3 requests (num_decode_tokens = 4): row 3 is no request, yet plan.paged_kv_indptr[4] = 11 lists pages past the 8" in found[0].evidence
    # Rows past the requests that list no page, and a FULL graph's padded requests (seq_len 0): clean.
    assert [f for f in _checked(tmp_path / "empty", padded, _decode_lists(padded, [8], decode_tokens=4), backend="FLASHINFER", model=vl.mha_model()) if f.check == "builder-rows"] == []
    graph = vl.Step(**DECODES, pad_reqs=5).common()
    capture = vl.CaptureSizes(max_bs=8, max_num_tokens=8, block_table_width=int(graph.block_table_tensor.shape[1]))
    found = _checked(tmp_path / "graph", graph, _decode_lists(graph, [], decode_tokens=3), backend="FLASHINFER", model=vl.mha_model(), capture=capture)
    assert [f for f in found if f.check.startswith("builder-") or f.check.startswith("kv-")] == [], _labels(found)
