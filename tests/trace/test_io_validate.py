"""Loading: malformed files give one precise TraceError (exit 2 via the CLI), never code execution."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from attndbg.trace.validate import TraceError
from tests.factories import make_trace, stored, write_raw, write_trace


def _cli_error(path: Path) -> str:
    result = CliRunner().invoke(main, ["show", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and str(path) in lines[0]
    return lines[0]


def test_round_trip_is_exact(tmp_path: Path) -> None:
    trace = make_trace("verify", plan=True)
    loaded = io.load(io.save(trace, tmp_path / "t.pt"))
    assert torch.equal(loaded.batch.slot_ids, trace.batch.slot_ids)
    assert torch.equal(loaded.spec.custom_mask, trace.spec.custom_mask)
    assert loaded.plan is not None and set(loaded.plan.tensors) == set(trace.plan.tensors)
    assert loaded.model == trace.model and loaded.source == trace.source


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    write_trace(tmp_path / "a.pt", "decode-mha")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_truncated_file(tmp_path: Path) -> None:
    good = write_trace(tmp_path / "good.pt", "decode-mha")
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "not a readable attndbg trace" in _cli_error(bad)


def test_random_bytes(tmp_path: Path) -> None:
    bad = tmp_path / "random.pt"
    bad.write_bytes(os.urandom(4096))
    assert "not a readable attndbg trace" in _cli_error(bad)


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    data = stored("decode-mha")
    data["source"]["engine"] = _RunsCode(str(marker))
    torch.save(data, bad)
    line = _cli_error(bad)
    assert "refused" in line
    assert not marker.exists()


def test_plain_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned2"
    bad = tmp_path / "evil.pkl"
    bad.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    _cli_error(bad)
    assert not marker.exists()


def test_wrong_version(tmp_path: Path) -> None:
    data = stored("decode-mha")
    data["version"] = 99
    assert "version: = 99" in _cli_error(write_raw(tmp_path / "v.pt", data))


def test_not_a_trace(tmp_path: Path) -> None:
    assert "not an attndbg trace" in _cli_error(write_raw(tmp_path / "x.pt", {"hello": torch.zeros(2)}))
    assert "top level is list" in _cli_error(write_raw(tmp_path / "y.pt", [1, 2]))


def test_decreasing_slot_indptr_in_batch(tmp_path: Path) -> None:
    data = stored("decode-gqa")
    indptr = data["batch"]["slot_indptr"].clone()
    indptr[2] = indptr[1] - 1
    data["batch"]["slot_indptr"] = indptr
    line = _cli_error(write_raw(tmp_path / "d.pt", data))
    assert "batch.slot_indptr[2]" in line and "must not decrease" in line


def test_slot_outside_cache(tmp_path: Path) -> None:
    data = stored("decode-gqa")
    slots = data["batch"]["slot_ids"].clone()
    slots[5] = data["batch"]["kv_cache_size"] + 3
    data["batch"]["slot_ids"] = slots
    line = _cli_error(write_raw(tmp_path / "s.pt", data))
    assert "batch.slot_ids[5]" in line and "outside the KV cache" in line


def test_lengths_that_disagree() -> None:
    data = stored("extend-prefix")
    kv = data["batch"]["kv_lens"].clone()
    kv[1] += 1
    data["batch"]["kv_lens"] = kv
    from attndbg.trace.validate import from_dict

    with pytest.raises(TraceError, match=r"batch.kv_lens\[1\]: = \d+, expected prefix_lens \+ extend_lens"):
        from_dict(data)


def test_out_cache_loc_must_be_the_query_columns_slots() -> None:
    from attndbg.trace.validate import from_dict

    data = stored("extend-prefix")
    loc = data["batch"]["out_cache_loc"].clone()
    loc[3] = 0
    data["batch"]["out_cache_loc"] = loc
    with pytest.raises(TraceError, match=r"batch.out_cache_loc\[3\]"):
        from_dict(data)


def test_page_offsets_are_checked() -> None:
    from attndbg.trace.validate import from_dict

    data = stored("decode-paged")
    slots = data["batch"]["slot_ids"].clone()
    slots[[1, 2]] = slots[[2, 1]]  # swap two columns inside a page
    data["batch"]["slot_ids"] = slots
    with pytest.raises(TraceError, match=r"batch.slot_ids\[1\].*page offset"):
        from_dict(data)


def test_float_index_dtype_is_rejected() -> None:
    from attndbg.trace.validate import from_dict

    data = stored("decode-mha")
    data["batch"]["kv_lens"] = data["batch"]["kv_lens"].float()
    with pytest.raises(TraceError, match=r"batch.kv_lens: dtype float32, expected int32, int64"):
        from_dict(data)


def test_verify_without_spec_is_rejected() -> None:
    from attndbg.trace.validate import from_dict

    data = stored("verify")
    data["spec"] = None
    with pytest.raises(TraceError, match="spec: missing"):
        from_dict(data)


def test_bad_tree_parent_is_rejected() -> None:
    from attndbg.trace.validate import from_dict

    data = stored("verify")
    parents = data["spec"]["parents"].clone()
    parents[1, 3] = 5  # a parent after its child
    data["spec"]["parents"] = parents
    with pytest.raises(TraceError, match=r"spec.parents\[1, 3\]"):
        from_dict(data)


def test_malformed_recorded_plan_still_loads(tmp_path: Path) -> None:
    """A wrong plan is evidence: it loads, and checks report it later."""
    trace = make_trace("decode-gqa", plan=True)
    data = stored("decode-gqa")
    tensors = dict(trace.plan.tensors)
    indptr = tensors["kv_indptr"].clone()
    indptr[2] = indptr[1] - 7  # decreasing
    tensors["kv_indptr"] = indptr
    tensors["kv_indices"] = tensors["kv_indices"] + 10**6  # outside the cache
    data["plan"] = {"backend": "triton", "tensors": tensors, "scalars": dict(trace.plan.scalars)}
    loaded = io.load(write_raw(tmp_path / "p.pt", data))
    assert torch.equal(loaded.plan.tensors["kv_indptr"], indptr)


def test_recording_directory_manifest(tmp_path: Path) -> None:
    for step, preset in enumerate(["decode-mha", "extend-prefix"]):
        trace = make_trace(preset)
        from dataclasses import replace

        io.append_to_recording(tmp_path, replace(trace, source=replace(trace.source, step=step)))
    entries = io.read_manifest(tmp_path)
    assert [(e.step, e.mode) for e in entries] == [(0, "DECODE"), (1, "EXTEND")]
    assert [p.name for p in io.trace_paths(tmp_path)] == ["step_000000.pt", "step_000001.pt"]


def test_manifest_cannot_point_outside_the_recording(tmp_path: Path) -> None:
    (tmp_path / "manifest.jsonl").write_text('{"file": "../x.pt", "step": 0, "mode": "DECODE", "batch_size": 1, "graph": false, "layers": []}\n')
    with pytest.raises(TraceError, match="inside the recording"):
        io.read_manifest(tmp_path)


def test_trace_paths_manifest_first_else_pt_files_in_name_order(tmp_path: Path) -> None:
    """A recording lists its steps in manifest order (stray .pt files are not steps); a folder
    without a manifest is every .pt file in name order."""
    from dataclasses import replace

    rec = tmp_path / "rec"
    for step in (2, 0):
        trace = make_trace("decode-mha", "kv_lens=3")
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    io.save(make_trace("decode-mha", "kv_lens=3"), rec / "aaa_stray.pt")
    assert [p.name for p in io.trace_paths(rec)] == ["step_000002.pt", "step_000000.pt"]
    (rec / "manifest.jsonl").unlink()
    assert [p.name for p in io.trace_paths(rec)] == ["aaa_stray.pt", "step_000000.pt", "step_000002.pt"]
