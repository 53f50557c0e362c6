"""fill-value on vLLM's padded query offsets and block-table rows, recorded through vLLM 0.33's real
`CommonAttentionMetadata` and builder hook (issue 13, item 2): vLLM's own padding (query_start_loc's
tail repeating its last entry, null block 0, seq_len 0) is clean; a -1 block-table fill is clean
while no kernel reads it (seq_len 0) and a finding once a padded seq_len makes the kernel read it;
a query_start_loc tail left from a larger batch is a finding naming the entry."""

from __future__ import annotations

import torch

from attndbg.record.session import RecordingSession
from tests.record.check_cli import check_json
from tests.record.test_vllm_evidence import PADDED, pool_config  # noqa: F401  (fixture)
from tests.record.test_vllm_graph_fields import _record
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import make_layout


def fill_findings(session: RecordingSession) -> list[tuple[str, str]]:
    step = check_json(session.out_dir, only="fill-value")["steps"][-1]
    return [(f["check"], f["location"].get("field")) for f in step["findings"]]


def test_vllms_own_padding_is_clean(session: RecordingSession, pool_config) -> None:  # noqa: F811
    _record(session, pool_config, make_layout(**PADDED).cm)
    assert [c for c, _ in fill_findings(session) if c in ("padded-block-table-entry", "padded-query-offsets")] == []


def test_a_minus_one_block_table_fill_matters_only_when_read(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(**PADDED).cm
    table = cm.block_table_tensor.clone()
    table[2:] = -1
    _record(session, pool_config, cm.replace(block_table_tensor=table))
    assert ("padded-block-table-entry", "graph.padded_block_table[2, 0]") not in fill_findings(session)
    seq = cm.seq_lens.clone()
    seq[2:] = 1  # a runner that pads with seq_len 1 makes the kernel read each padded row's first block
    _record(session, pool_config, cm.replace(block_table_tensor=table, seq_lens=seq))
    assert ("padded-block-table-entry", "graph.padded_block_table[2, 0]") in fill_findings(session)


def test_a_query_offsets_tail_left_from_a_larger_batch(session: RecordingSession, pool_config) -> None:  # noqa: F811
    # A tail that falls back below the real requests' end (the buffer's initial values, or offsets
    # of another batch). A tail that rises instead gives its rows query tokens, and vLLM's metadata
    # then calls them requests (the converter's real_rows): invariants judges those, not fill-value.
    cm = make_layout(**PADDED).cm
    assert cm.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    falling = torch.tensor([0, 1, 2, 1, 1], dtype=cm.query_start_loc.dtype)
    _record(session, pool_config, cm.replace(query_start_loc=falling))
    assert ("padded-query-offsets", "graph.padded_qo_indptr[3]") in fill_findings(session)


# -- the same checks on a synth graph step (SGLang-shaped, 3 requests padded to 4) -----------------


def _padded(qo: list[int] | None = None, table_row: list[int] | None = None, fill: int = 1):
    from dataclasses import replace

    from tests.factories import make_trace

    trace = make_trace("decode-gqa", "heads=2:1", "head_dim=32", "kv_lens=5,9,12", "capture_bs=4", f"fill_value={fill}")
    graph = trace.graph
    table = None
    if table_row is not None:
        table = torch.zeros(4, len(table_row), dtype=torch.int64)
        for b in range(3):
            table[b] = trace.batch.request_slots(b)[: len(table_row)]
        table[3] = torch.tensor(table_row)
    return replace(trace, graph=replace(graph, padded_qo_indptr=None if qo is None else torch.tensor(qo), padded_block_table=table))


def _checks(trace) -> list[tuple[str, str]]:
    from attndbg.detectors.fill_value.detect import recorded_padding

    return [(f.check, f.location.field) for f in recorded_padding(trace) if f.check in ("padded-query-offsets", "padded-block-table-entry")]


def test_query_offsets_tail_on_a_synth_step() -> None:
    assert _checks(_padded([0, 1, 2, 3, 3])) == [] and _checks(_padded([0, 1, 2, 3, 4])) == []
    assert _checks(_padded([0, 1, 2, 3, 9])) == [("padded-query-offsets", "graph.padded_qo_indptr[4]")]
    assert _checks(_padded([0, 1, 2, 3, 1])) == [("padded-query-offsets", "graph.padded_qo_indptr[4]")]


def test_block_table_row_read_by_its_padded_seq_len_on_a_synth_step() -> None:
    assert _checks(_padded(table_row=[0, 0])) == []
    assert _checks(_padded(table_row=[-1, -1], fill=0)) == []  # seq_len 0 reads no entry
    assert _checks(_padded(table_row=[-1, -1], fill=1)) == [("padded-block-table-entry", "graph.padded_block_table[3, 0]")]
