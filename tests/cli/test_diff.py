"""`attndbg diff`: saved replays (digits, scale, bad pairs, different traces), recordings step by
step, and the options that only one kind takes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg.compare.saved import REFERENCE, save_replay
from attndbg.trace import io
from tests.cli.helpers import invoke, one_line_error
from tests.factories import make_trace, write_trace

QO = torch.tensor([0, 1, 3])  # two requests: 1 and 2 rows
T, HQ, DV = 3, 2, 4


def _saved(path: Path, *, lse_shift: float = 0.0, qo: torch.Tensor = QO, digest: str = "") -> Path:
    g = torch.Generator().manual_seed(0)
    ref = (torch.randn(int(qo[-1]), HQ, DV, generator=g), torch.randn(int(qo[-1]), HQ, generator=g) + 5.0)
    triton = (ref[0] + 1e-3, ref[1].clone())
    triton[1][2, 1] += lse_shift
    save_replay(path, trace_file="t.pt", qo_indptr=qo, results={REFERENCE: ref, "triton": triton}, trace_digest=digest)
    return path


def test_saved_replays_print_lse_to_the_digit_that_differs(tmp_path: Path) -> None:
    a, b = _saved(tmp_path / "a.replay"), _saved(tmp_path / "b.replay", lse_shift=2.0**-20)
    report = tmp_path / "d.json"
    result = invoke("diff", str(a), str(b), "--json", str(report), columns=200)
    assert result.exit_code == 1, result.output
    lse_a = float(torch.load(a, weights_only=True)["results"]["triton"]["lse"][2, 1])
    lse_b = float(torch.load(b, weights_only=True)["results"]["triton"]["lse"][2, 1])
    assert f"worst LSE: request 1 row 1 (step row 2) head 1: {lse_a:.9g} vs {lse_b:.9g}" in result.stdout
    assert f"{lse_a:.9g}" != f"{lse_b:.9g}"
    assert "judged bitwise" in result.stdout and "against the float64 reference, for scale: triton in" in result.stdout
    data = json.loads(report.read_text())
    assert data["schema"] == "attndbg.diff/1" and data["kind"] == "replays" and data["identical"] is False
    assert data["pairs"][1]["a_vs_reference"][0] == pytest.approx(1e-3, rel=1e-2)


def test_identical_saved_replays_exit_0(tmp_path: Path) -> None:
    result = invoke("diff", str(_saved(tmp_path / "a.replay")), str(_saved(tmp_path / "b.replay")))
    assert result.exit_code == 0 and "all pairs bitwise identical" in result.stdout


def test_pair_naming_a_backend_not_in_the_file_is_bad_input(tmp_path: Path) -> None:
    a, b = _saved(tmp_path / "a.replay"), _saved(tmp_path / "b.replay")
    one_line_error(invoke("diff", str(a), str(b), "--pair", "triton:flashinfer"), "has no 'flashinfer'", "it has reference, triton")
    one_line_error(invoke("diff", str(a), str(b), "--pair", "triton"), "--pair: expected BACKEND_A:BACKEND_B")


def test_replays_of_different_traces_are_bad_input(tmp_path: Path) -> None:
    a = _saved(tmp_path / "a.replay")
    one_line_error(invoke("diff", str(a), str(_saved(tmp_path / "b.replay", qo=torch.tensor([0, 2, 3])))), "replays of different traces", "qo_indptr")
    c, d = _saved(tmp_path / "c.replay", digest="aa" * 32), _saved(tmp_path / "d.replay", digest="bb" * 32)
    one_line_error(invoke("diff", str(c), str(d)), "different contents")


def test_replay_save_records_the_trace_digest(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "decode-mha", "kv_lens=3,20", "heads=2:1", "head_dim=32")
    other = write_trace(tmp_path / "u.pt", "decode-mha", "kv_lens=3,20", "heads=2:1", "head_dim=32", "seed=1")
    for name, path in (("a", trace), ("b", other)):
        assert invoke("replay", str(path), "--backend", "reference", "--save", str(tmp_path / f"{name}.replay")).exit_code == 0
    one_line_error(invoke("diff", str(tmp_path / "a.replay"), str(tmp_path / "b.replay")), "different contents")


def test_pair_on_traces_is_bad_input(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.pt", "decode-mha")
    one_line_error(invoke("diff", str(a), str(a), "--pair", "triton:triton"), "--pair compares backends of two saved replays")


def test_a_trace_against_a_saved_replay_is_bad_input(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.pt", "decode-mha")
    one_line_error(invoke("diff", str(a), str(_saved(tmp_path / "b.replay"))), "is a trace and", "is a saved replay")


def _recording(directory: Path, kv_lens: list[str]) -> Path:
    for step, lens in enumerate(kv_lens):
        trace = make_trace("decode-mha", f"kv_lens={lens}", "heads=2:1", "head_dim=32")
        io.append_to_recording(directory, replace(trace, source=replace(trace.source, step=step)))
    return directory


def test_recordings_step_by_step(tmp_path: Path) -> None:
    a = _recording(tmp_path / "a", ["3,20", "4,21", "5,22"])
    b = _recording(tmp_path / "b", ["3,20", "4,29", "5,22"])
    report = tmp_path / "d.json"
    result = invoke("diff", str(a), str(b), "--json", str(report), columns=200)
    assert result.exit_code == 1, result.output
    assert "1 of 3 steps differ; first at #1: 9 fields differ; first batch.prefix_lens" in result.stdout
    assert "first at [1] (request 1): 20 vs 28" in result.stdout
    data = json.loads(report.read_text())
    assert data["kind"] == "recordings" and data["first_difference"] == 1
    assert [s["identical"] for s in data["steps"]] == [True, False, True]


def test_identical_recordings_and_a_missing_step(tmp_path: Path) -> None:
    a = _recording(tmp_path / "a", ["3,20", "4,21"])
    assert invoke("diff", str(a), str(_recording(tmp_path / "b", ["3,20", "4,21"]))).exit_code == 0
    result = invoke("diff", str(a), str(_recording(tmp_path / "c", ["3,20"])), columns=200)
    assert result.exit_code == 1 and "first at #1: only in a" in result.stdout


def test_a_folder_against_a_file_is_bad_input(tmp_path: Path) -> None:
    a = _recording(tmp_path / "a", ["3,20"])
    one_line_error(invoke("diff", str(a), str(a / "step_000000.pt")), "is a folder and", "is a trace")


def test_replay_diff_table_fits_80_columns(tmp_path: Path) -> None:
    a, b = _saved(tmp_path / "a.replay"), _saved(tmp_path / "b.replay", lse_shift=2.0**-20)
    report = tmp_path / "d.json"
    result = invoke("diff", str(a), str(b), "--json", str(report), columns=80)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    triton = json.loads(report.read_text())["pairs"][1]
    row = next(line for line in lines if line.startswith("triton "))
    assert row.split()[1:5] == ["differ", "0", f"{triton['lse']['max_abs']:.3g}", "1/3"]


def test_trace_diff_ends_with_its_verdict(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.pt", "decode-mha", "kv_lens=3,20")
    b = write_trace(tmp_path / "b.pt", "decode-mha", "kv_lens=3,21")
    result = invoke("diff", str(a), str(b), columns=200)
    assert result.exit_code == 1
    assert result.stdout.strip().splitlines()[-1].startswith("traces differ: ") and "first batch.prefix_lens" in result.stdout.splitlines()[-1]
    assert invoke("diff", str(a), str(a)).stdout.strip().splitlines()[-1].startswith("traces are structurally identical")
