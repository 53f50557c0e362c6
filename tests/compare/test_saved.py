"""Saved-replay files: bitwise round trip, atomic writes, and one-line errors for bad files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from attndbg.compare.saved import (
    FORMAT_NAME,
    FORMAT_VERSION,
    REFERENCE,
    BackendResult,
    SavedReplay,
    is_saved_replay,
    load_replay,
    save_replay,
)
from attndbg.trace import io as trace_io
from attndbg.trace.synth import build, parse_spec
from attndbg.trace.validate import TraceError

QO_INDPTR = torch.tensor([0, 3, 3, 7], dtype=torch.int64)  # request 1 is empty
T, HQ, DV = 7, 4, 8


def _results(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ref_out, ref_lse = torch.randn(T, HQ, DV, generator=g), torch.randn(T, HQ, generator=g)
    out = torch.randn(T, HQ, DV, generator=g)
    # Values whose bits a lossy round trip would change: NaN payloads, -0.0, Inf, a subnormal.
    out[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("-inf"), 1e-45])
    lse = torch.randn(T, HQ, generator=g)
    lse[2, 1] = float("-inf")
    return {REFERENCE: (ref_out, ref_lse), "triton": (out, lse)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    results = _results()
    path = tmp_path / "run.pt"
    save_replay(path, trace_file="traces/verify.pt", qo_indptr=QO_INDPTR, results=results)
    saved = load_replay(path)
    assert saved.trace_file == "traces/verify.pt"
    assert saved.path == str(path)
    assert torch.equal(saved.qo_indptr, QO_INDPTR) and saved.qo_indptr.dtype == torch.int64
    assert saved.names == [REFERENCE, "triton"]
    assert (saved.batch_size, saved.num_tokens) == (3, T)
    for name, (out, lse) in results.items():
        assert torch.equal(_bits(saved.results[name].output), _bits(out))
        assert torch.equal(_bits(saved.results[name].lse), _bits(lse))


def test_low_precision_and_int32_inputs_are_stored_as_float32_and_int64(tmp_path: Path) -> None:
    out = torch.randn(T, HQ, DV).to(torch.bfloat16)
    lse = torch.randn(T, HQ).to(torch.float16)
    save_replay(tmp_path / "r.pt", trace_file="t.pt", qo_indptr=QO_INDPTR.to(torch.int32), results={"fa3": (out, lse)})
    saved = load_replay(tmp_path / "r.pt")
    assert saved.qo_indptr.dtype == torch.int64
    assert saved.results["fa3"].output.dtype == torch.float32
    assert torch.equal(saved.results["fa3"].output, out.float())  # bf16 -> fp32 is exact
    assert torch.equal(saved.results["fa3"].lse, lse.float())


def test_views_are_stored_without_their_base_storage(tmp_path: Path) -> None:
    # A CUDA-graph output buffer is a view of a larger static buffer; only the view belongs in the file.
    big_out, big_lse = torch.randn(64, HQ, DV), torch.randn(64, HQ)
    save_replay(tmp_path / "r.pt", trace_file="t.pt", qo_indptr=QO_INDPTR, results={"x": (big_out[:T], big_lse[:T])})
    saved = load_replay(tmp_path / "r.pt")
    assert saved.results["x"].output.untyped_storage().nbytes() == T * HQ * DV * 4
    assert torch.equal(saved.results["x"].output, big_out[:T])


def test_save_is_atomic_and_refuses_inconsistent_results(tmp_path: Path) -> None:
    save_replay(tmp_path / "r.pt", trace_file="t.pt", qo_indptr=QO_INDPTR, results=_results())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pt"]  # no temp file left behind
    bad = {"x": (torch.zeros(T + 1, HQ, DV), torch.zeros(T + 1, HQ))}
    with pytest.raises(TraceError) as e:
        save_replay(tmp_path / "bad.pt", trace_file="t.pt", qo_indptr=QO_INDPTR, results=bad)
    assert e.value.field == "results['x'].output" and e.value.path == str(tmp_path / "bad.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pt"]


def test_saved_replay_checks_itself_when_built() -> None:
    with pytest.raises(TraceError, match="differs from the other results"):
        SavedReplay(
            trace_file="t.pt",
            qo_indptr=QO_INDPTR,
            results={
                "a": BackendResult(torch.zeros(T, HQ, DV), torch.zeros(T, HQ)),
                "b": BackendResult(torch.zeros(T, HQ, DV + 1), torch.zeros(T, HQ)),
            },
        )


def _valid_dict() -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "trace_file": "t.pt",
        "qo_indptr": QO_INDPTR.clone(),
        "results": {"x": {"output": torch.zeros(T, HQ, DV), "lse": torch.zeros(T, HQ)}},
    }


def _with(**changes) -> dict:
    data = _valid_dict()
    data.update(changes)
    return data


def _entry(output: torch.Tensor, lse: torch.Tensor) -> dict:
    return {"x": {"output": output, "lse": lse}}


class _RunsCode:
    """Unpickling this would create a file: proof that loading did not execute it."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def test_the_code_payload_is_live(tmp_path: Path) -> None:
    """Sanity check of the test below: an ordinary unpickler does run the payload."""
    marker = tmp_path / "code_ran"
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists()


def _bad_result(out_shape: tuple[int, ...], lse_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> dict:
    return _with(results=_entry(torch.zeros(out_shape, dtype=dtype), torch.zeros(lse_shape)))


MALFORMED = {
    "wrong_format_tag": (lambda: _with(format="something.else"), "format"),
    "newer_version": (lambda: _with(version=2), "version"),
    "missing_results": (lambda: {k: v for k, v in _valid_dict().items() if k != "results"}, "results"),
    "results_not_a_dict": (lambda: _with(results=[1, 2]), "results"),
    "entry_without_lse": (lambda: _with(results={"x": {"output": torch.zeros(T, HQ, DV)}}), "results['x']"),
    "output_rows_disagree_with_qo_indptr": (lambda: _bad_result((T - 1, HQ, DV), (T - 1, HQ)), "results['x'].output"),
    "lse_heads_disagree": (lambda: _bad_result((T, HQ, DV), (T, HQ + 1)), "results['x'].lse"),
    "output_2d": (lambda: _bad_result((T, HQ), (T, HQ)), "results['x'].output"),
    "output_float16": (lambda: _bad_result((T, HQ, DV), (T, HQ), torch.float16), "results['x'].output"),
    "output_not_a_tensor": (lambda: _with(results=_entry([[0.0]], torch.zeros(T, HQ))), "results['x'].output"),
    "qo_indptr_decreasing": (lambda: _with(qo_indptr=torch.tensor([0, 5, 3, 7])), "qo_indptr[2]"),
    "qo_indptr_float": (lambda: _with(qo_indptr=QO_INDPTR.float()), "qo_indptr"),
    "trace_file_not_a_string": (lambda: _with(trace_file=3), "trace_file"),
    "top_level_list": (lambda: [1, 2, 3], "file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_content_is_a_one_line_trace_error(tmp_path: Path, case: str) -> None:
    make, field = MALFORMED[case]
    path = tmp_path / f"{case}.pt"
    torch.save(make(), path)
    with pytest.raises(TraceError) as e:
        load_replay(path)
    assert e.value.field == field
    assert e.value.path == str(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(path))


def _write_random_bytes(path: Path) -> None:
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("writer", ["random_bytes", "empty", "truncated", "raw_pickle_with_code", "torch_save_with_code"])
def test_unreadable_files_are_refused_without_running_code(tmp_path: Path, writer: str) -> None:
    path, marker = tmp_path / "bad.pt", tmp_path / "code_ran"
    if writer == "random_bytes":
        _write_random_bytes(path)
    elif writer == "empty":
        path.write_bytes(b"")
    elif writer == "truncated":
        save_replay(path, trace_file="t.pt", qo_indptr=QO_INDPTR, results=_results())
        path.write_bytes(path.read_bytes()[:300])
    elif writer == "raw_pickle_with_code":
        path.write_bytes(pickle.dumps({"format": FORMAT_NAME, "evil": _RunsCode(marker)}))
    else:
        torch.save({"format": FORMAT_NAME, "version": FORMAT_VERSION, "results": _RunsCode(marker)}, path)
    with pytest.raises(TraceError) as e:
        load_replay(path)
    assert e.value.field == "file" and "\n" not in str(e.value)
    assert not marker.exists()
    if writer == "torch_save_with_code":
        assert "that would run code when loaded; refused" in str(e.value)


def test_a_trace_is_not_a_saved_replay(tmp_path: Path) -> None:
    path = trace_io.save(build(parse_spec(["decode-mha"])), tmp_path / "trace.pt")
    with pytest.raises(TraceError, match="replay it with") as e:
        load_replay(path)
    assert e.value.field == "format"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read") as e:
        load_replay(tmp_path / "nope.pt")
    assert e.value.field == "file"


def test_file_mode_round_trip_leaves_no_partial_file_on_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash mid-write leaves the old file intact and no temp file."""
    path = tmp_path / "r.pt"
    save_replay(path, trace_file="old.pt", qo_indptr=QO_INDPTR, results=_results())

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_replay(path, trace_file="new.pt", qo_indptr=QO_INDPTR, results=_results(1))
    monkeypatch.undo()
    assert load_replay(path).trace_file == "old.pt"
    assert sorted(os.listdir(tmp_path)) == ["r.pt"]


def test_is_saved_replay_tells_replays_from_traces_without_loading(tmp_path: Path) -> None:
    save_replay(tmp_path / "run.pt", trace_file="t.pt", qo_indptr=QO_INDPTR, results=_results())
    trace_path = trace_io.save(build(parse_spec(["verify"])), tmp_path / "trace.pt")
    _write_random_bytes(tmp_path / "noise.pt")
    marker = tmp_path / "code_ran"
    torch.save({"format": FORMAT_NAME, "x": _RunsCode(marker)}, tmp_path / "evil.pt")
    assert is_saved_replay(tmp_path / "run.pt")
    assert not is_saved_replay(trace_path)
    assert not is_saved_replay(tmp_path / "noise.pt")
    assert not is_saved_replay(tmp_path / "missing.pt")
    assert is_saved_replay(tmp_path / "evil.pt") and not marker.exists()  # judged by its tag, never run
    assert is_saved_replay(tmp_path / "damaged.replay")  # by name, so load_replay explains the damage
