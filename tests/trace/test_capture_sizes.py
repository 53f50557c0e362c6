"""The trace's capture sizes and engine-neutral graph fields: they round
trip through the file, traces written without them load unchanged, and a bad stored value is one
`error:` line naming the file, the field and its first bad element, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from attndbg.trace.schema import CaptureSizes, Trace, to_dict
from attndbg.trace.validate import from_dict
from tests.factories import make_trace, write_raw

CAPTURE_BS = 4
OLD_GRAPH_KEYS = {"is_graph_replay", "capture_bs", "fill_value", "padded_seq_lens", "padded_req_pool_indices", "padded_out_cache_loc", "padded_positions"}
SIZES = CaptureSizes(max_bs=8, max_num_tokens=8, max_kv_splits=8, mask_capacity=None, kv_indices_capacity=4096, block_table_width=16, workspace_bytes=128 << 20)


def padded_decode() -> Trace:
    """A decode of 3 requests replayed in a graph captured at bs 4 (synth pads like SGLang)."""
    return make_trace("decode-gqa", "kv_lens=5,9,12", f"capture_bs={CAPTURE_BS}")


def vllm_shaped(trace: Trace) -> Trace:
    """The same step with the graph fields vLLM records: no request pool, its padded query offsets
    (the tail repeating the last real entry) and block table (padded rows NULL_BLOCK_ID 0)."""
    bs = trace.batch.batch_size
    qo = torch.cat([trace.batch.qo_indptr, trace.batch.qo_indptr[-1:].expand(CAPTURE_BS - bs)])
    table = torch.zeros(CAPTURE_BS, 3, dtype=torch.int32)
    table[:bs] = torch.tensor([[4, 0, 0], [5, 6, 0], [7, 8, 9]], dtype=torch.int32)
    graph = replace(trace.graph, padded_req_pool_indices=None, padded_qo_indptr=qo.to(torch.int32), padded_block_table=table)
    return replace(trace, graph=graph, capture=SIZES)


def test_capture_sizes_and_vllm_graph_fields_round_trip_through_the_file(tmp_path: Path) -> None:
    trace = vllm_shaped(padded_decode())
    loaded = io.load(io.save(trace, tmp_path / "t.pt"))
    assert loaded.capture == SIZES
    graph = loaded.graph
    assert graph.padded_req_pool_indices is None
    assert graph.padded_qo_indptr.dtype == torch.int64 and graph.padded_qo_indptr.tolist() == [0, 1, 2, 3, 3]
    assert graph.padded_block_table.tolist() == [[4, 0, 0], [5, 6, 0], [7, 8, 9], [0, 0, 0]]


def test_traces_without_them_are_stored_and_loaded_as_before() -> None:
    trace = padded_decode()
    data = to_dict(trace)
    # Nothing new in the stored dict of a trace that has none of the new fields: such files stay
    # byte-identical to those written before the fields existed, and old readers still read them.
    assert "capture" not in data and set(data["graph"]) == OLD_GRAPH_KEYS
    loaded = from_dict(data)
    assert loaded.capture is None
    assert (loaded.graph.padded_qo_indptr, loaded.graph.padded_block_table) == (None, None)
    assert loaded.graph.padded_req_pool_indices.tolist() == trace.graph.padded_req_pool_indices.tolist()


def test_unknown_sizes_are_none_not_zero(tmp_path: Path) -> None:
    trace = replace(padded_decode(), capture=CaptureSizes(max_bs=4))
    loaded = io.load(io.save(trace, tmp_path / "t.pt"))
    assert loaded.capture.known() == {"max_bs": 4}
    assert loaded.capture.max_kv_splits is None


def _stored() -> dict:
    return to_dict(vllm_shaped(padded_decode()))


def _set(data: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("capture.max_bs", -1, "capture.max_bs: = -1, must be >= 0"),
        ("capture.max_kv_splits", 1.5, "capture.max_kv_splits: expected an int, found float"),
        ("capture.max_num_tokens", True, "capture.max_num_tokens: expected an int, found bool"),
        ("capture.mask_capacity", 2**60, "capture.mask_capacity: = 1152921504606846976, past any device's buffer"),
        ("capture.kv_indices_capacity", 2**64, "capture.kv_indices_capacity: = 18446744073709551616, does not fit in 64 bits"),
        ("capture.num_kv_splits", 3, "capture['num_kv_splits']: is not a capture size"),
        ("capture", [8], "capture: expected a dict, found list"),
        ("graph.padded_qo_indptr", torch.tensor([0, 1, 2]), "graph.padded_qo_indptr: has 3 elements, expected capture_bs + 1 = 5"),
        ("graph.padded_qo_indptr", torch.zeros(5), "graph.padded_qo_indptr: dtype float32, expected int32, int64"),
        ("graph.padded_block_table", torch.zeros(4, dtype=torch.int32), "graph.padded_block_table: has 1 dims [4], expected 2"),
        ("graph.padded_block_table", torch.zeros(3, 2, dtype=torch.int32), "graph.padded_block_table: has 3 rows [3, 2], expected capture_bs = 4"),
        ("graph.padded_block_table", torch.zeros(4, 2, dtype=torch.bool), "graph.padded_block_table: dtype bool"),
        ("graph.padded_req_pool_indices", _DELETE, "graph.padded_req_pool_indices: missing"),
        ("graph.padded_req_pool_indices", torch.zeros(4), "graph.padded_req_pool_indices: dtype float32"),
    ],
)
def test_a_bad_value_is_one_line_naming_file_and_field(tmp_path: Path, field: str, value, expected: str) -> None:
    path = write_raw(tmp_path / "t.pt", _set(_stored(), field, value))
    for command in ("show", "check"):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and expected in lines[0], result.output


def test_show_and_diff_carry_them(tmp_path: Path) -> None:
    a = io.save(vllm_shaped(padded_decode()), tmp_path / "a.pt")
    text = CliRunner().invoke(main, ["show", str(a)]).output
    assert "not recorded (the engine has no request pool)" in text and "real [0, 1, 2, 3]  padded [3]" in text
    assert "capture sizes" in text and "mask_capacity        not recorded" in text
    shown = CliRunner().invoke(main, ["show", str(a), "--json", "-"]).output
    data = json_object(shown)
    assert data["capture"] == {**SIZES.__dict__} and data["graph"]["padded_req_pool_indices"] is None
    b = io.save(replace(vllm_shaped(padded_decode()), capture=replace(SIZES, max_bs=16)), tmp_path / "b.pt")
    result = CliRunner().invoke(main, ["diff", str(a), str(b), "--json", "-"])
    assert result.exit_code == 1
    [diff] = json_object(result.output)["differences"]
    assert (diff["field"], diff["a"], diff["b"]) == ("capture.max_bs", 8, 16)


def json_object(output: str) -> dict:
    return json.loads(output[output.index("{") :])
