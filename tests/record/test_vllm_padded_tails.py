"""vLLM's padded query offsets and block-table rows, recorded through vLLM 0.33's real
`CommonAttentionMetadata` and builder hook, judged once, by the detector that
owns them (invariants reads the engine's own query_start_loc and block table, padded rows
included; fill-value the padded seq_lens and slots): vLLM's own padding (query_start_loc's tail
repeating its last entry, null block 0, seq_len 0) is clean; a -1 block-table fill is clean while
no kernel reads it (seq_len 0) and one finding once a padded seq_len makes the kernel read it; a
query_start_loc tail left falling is one finding naming the entry."""

from __future__ import annotations

import torch

from attndbg.record.session import RecordingSession
from tests.record.check_cli import check_json
from tests.record.test_vllm_evidence import PADDED, pool_config  # noqa: F401  (fixture)
from tests.record.test_vllm_graph_fields import _record
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import make_layout


def fill_findings(session: RecordingSession) -> list[tuple[str, str]]:
    """(check, field) of the last recorded step's metadata findings."""
    steps = check_json(session.out_dir, only="invariants,fill-value")["steps"]
    step = [s for s in steps if s["step"] >= 0][-1]  # the last recorded step, not the recording's own entry
    return [(f["check"], f["location"].get("field")) for f in step["findings"]]


def test_vllms_own_padding_is_clean(session: RecordingSession, pool_config) -> None:  # noqa: F811
    _record(session, pool_config, make_layout(**PADDED).cm)
    assert fill_findings(session) == []


def test_a_minus_one_block_table_fill_matters_only_when_read(session: RecordingSession, pool_config) -> None:  # noqa: F811
    cm = make_layout(**PADDED).cm
    table = cm.block_table_tensor.clone()
    table[2:] = -1
    _record(session, pool_config, cm.replace(block_table_tensor=table))
    assert fill_findings(session) == []  # seq_len 0: no kernel reads the row
    seq = cm.seq_lens.clone()
    seq[2:] = 1  # a runner that pads with seq_len 1 makes the kernel read each padded row's first block
    _record(session, pool_config, cm.replace(block_table_tensor=table, seq_lens=seq))
    assert fill_findings(session) == [("index-outside-cache", "plan.common.block_table_tensor[2, 0]"), ("padded-seq-len-stale", "graph.padded_seq_lens[2]")]


def test_a_query_offsets_tail_left_from_a_larger_batch(session: RecordingSession, pool_config) -> None:  # noqa: F811
    # A tail that falls back below the real requests' end (the buffer's initial values, or offsets
    # of another batch). A tail that rises instead gives its rows query tokens, and vLLM's metadata
    # then calls them requests (the converter's real_rows): invariants judges those, not fill-value.
    cm = make_layout(**PADDED).cm
    assert cm.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    falling = torch.tensor([0, 1, 2, 1, 1], dtype=cm.query_start_loc.dtype)
    _record(session, pool_config, cm.replace(query_start_loc=falling))
    assert fill_findings(session) == [("indptr-decreases", "plan.common.query_start_loc[3]"), ("host-mirror", "plan.common.query_start_loc_cpu[3]")]
