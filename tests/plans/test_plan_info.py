"""plan.plan_info: stored and loaded as recorded, read by its offsets with bounds checks, and a
vector that places an array outside its workspace is bad input (one line, exit 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends.flashinfer_plan_info import FIELDS, ScheduleKind, workspace_extent
from attndbg.cli import main
from attndbg.plans.reading import read
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import PlanInfo, to_dict
from attndbg.trace.validate import from_dict
from tests.checks.test_invariants import build, with_plan
from tests.plans.flashinfer_scheduler import STALE_BYTE, decode_plan_info, scheduled, with_plan_info

TRACES = Path(__file__).resolve().parents[2] / "traces"


def decode_trace(**options):
    return scheduled(with_plan(build("decode-paged"), "flashinfer"), **options)


def test_plan_info_round_trips_and_older_traces_store_as_before(tmp_path) -> None:
    trace = decode_trace(graph=True)
    back = io.load(io.save(trace, tmp_path / "t.pt"))
    assert torch.equal(back.plan.plan_info.vector, trace.plan.plan_info.vector)
    assert torch.equal(back.plan.plan_info.workspace, trace.plan.plan_info.workspace)
    # A plan without it keeps no key, so a file written before the field existed re-saves to the same bytes.
    assert "plan_info" not in to_dict(dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, plan_info=None)))["plan"]
    original = TRACES / "decode_gqa.pt"
    assert io.save(io.load(original), tmp_path / "again.pt").read_bytes() == original.read_bytes()


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("vector", torch.zeros(10, dtype=torch.int32), "plan.plan_info.vector"),
        ("vector", torch.zeros(100, dtype=torch.int64), "plan.plan_info.vector"),
        ("workspace", torch.zeros(4, dtype=torch.int32), "plan.plan_info.workspace"),
        ("extra", torch.zeros(1), "plan.plan_info['extra']"),
    ],
)
def test_a_malformed_plan_info_is_refused_on_load(key, value, field) -> None:
    data = to_dict(decode_trace())
    data["plan"]["plan_info"][key] = value
    with pytest.raises(TraceError) as e:
        from_dict(data)
    assert e.value.field == field


def test_the_reading_parses_the_arrays_the_vector_places() -> None:
    trace = decode_trace()
    s = read(trace).schedule.schedule
    assert s.kind is ScheduleKind.DECODE and s.split_kv and not s.graph
    # decode-paged: pages 1, 1, 3, 17 of 16 tokens; the chunk is max(128 / 16, 1) = 8 pages.
    assert s.kv_chunk_size == 128
    assert s.arrays["request_indices"].tolist() == [0, 1, 2, 3, 3, 3]
    assert s.arrays["kv_tile_indices"].tolist() == [0, 0, 0, 0, 1, 2]
    # o_indptr is sized padded_batch_size + 1; the scheduler writes batch + 1 entries, the rest is stale.
    assert s.arrays["o_indptr"][:5].tolist() == [0, 1, 2, 3, 6]
    assert s.arrays["o_indptr"][5:].tolist() == [int.from_bytes(bytes([STALE_BYTE]) * 4, "little", signed=True)] * 2
    assert s.arrays["block_valid_mask"].tolist() == [True] * 6
    assert workspace_extent(trace.plan.plan_info.vector.tolist()) == trace.plan.plan_info.workspace.numel()


def test_the_prefill_layout_is_read_with_its_graph_arrays() -> None:
    trace = scheduled(with_plan(build("extend-prefix"), "flashinfer"), graph=True)
    s = read(trace).schedule.schedule
    assert s.kind is ScheduleKind.PREFILL and s.graph and s.split_kv
    rows = int(trace.plan.tensors["qo_indptr"][-1])
    assert s.info["total_num_rows"] == rows and int(s.arrays["total_num_rows_host"][0]) == rows
    assert s.arrays["merge_indptr"].numel() == rows + 1


def _moved(trace, field: str, to: int):
    vector = trace.plan.plan_info.vector.clone()
    vector[FIELDS[ScheduleKind.DECODE].index(field)] = to
    info = PlanInfo(vector=vector, workspace=trace.plan.plan_info.workspace)
    return dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, plan_info=info))


@pytest.mark.parametrize(("field", "to", "words"), [("request_indices_offset", 1 << 20, "past the recorded int workspace"), ("kv_tile_indices_offset", -16, "past"), ("o_indptr_offset", 18, "not a multiple of 4")])
def test_an_offset_outside_the_workspace_is_bad_input(field, to, words) -> None:
    trace = _moved(decode_trace(), field, to)
    with pytest.raises(TraceError) as e:
        read(trace).schedule
    index = FIELDS[ScheduleKind.DECODE].index(field)
    assert e.value.field == f"plan.plan_info.vector[{index}]" and words in e.value.message


def test_check_names_the_bad_offset_in_one_line_and_exits_2(tmp_path) -> None:
    path = io.save(_moved(decode_trace(), "request_indices_offset", 1 << 20), tmp_path / "bad.pt")
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants"])
    assert result.exit_code == 2, result.output
    assert "plan.plan_info.vector[3]" in result.output and "Traceback" not in result.output


def test_a_vector_of_no_known_length_is_bad_input() -> None:
    vector, workspace = decode_plan_info([1, 2], 1, max_grid_size=264, gdy=4, graph=False)
    trace = with_plan_info(with_plan(build("decode-paged"), "flashinfer"), vector[:9], workspace)
    with pytest.raises(TraceError, match="10 \\(decode\\) or 15 \\(prefill\\)"):
        read(trace).schedule


@pytest.mark.parametrize("graph_mask", [False, True])
def test_a_graph_plan_without_split_kv_has_its_mask_read_where_plan_placed_one(graph_mask) -> None:
    """flashinfer#5176 writes block_valid_mask under every graph plan; 0.7.2.post1 only under
    split-KV, leaving block_valid_mask_offset 0. Read where the offset is not 0."""
    trace = scheduled(with_plan(build("decode-paged"), "flashinfer"), tensor_cores=True, graph=True, disable_split_kv=True, graph_mask=graph_mask)
    s = read(trace).schedule.schedule
    assert s.graph and not s.split_kv and (s.info["block_valid_mask_offset"] != 0) is graph_mask
    assert ("block_valid_mask" in s.arrays) is graph_mask
    if graph_mask:
        assert s.arrays["block_valid_mask"].tolist() == [True] * 4 + [False] * (s.padded_batch_size - 4)
    assert workspace_extent(trace.plan.plan_info.vector.tolist()) == trace.plan.plan_info.workspace.numel()
