"""`attndbg replay`: verdicts that say what was compared, which data, --repeat, ignored options,
JSON to stdout, folders, and a table that fits 80 columns."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from attndbg.cli import EXIT_NOT_RUN
from attndbg.trace import io
from tests.cli.helpers import invoke, one_line_error, replay_json, with_nogpu  # noqa: F401  (fixture)
from tests.factories import make_trace, write_trace

TINY = ("heads=2:1", "head_dim=32")
SHIPPED_RECORDING = Path(__file__).resolve().parents[2] / "traces" / "transformers_step.pt"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "t.pt", "decode-mha", "kv_lens=3,20", *TINY)


def test_named_backend_that_cannot_run_exits_3_and_says_so(tiny: Path, tmp_path: Path, with_nogpu: None) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "reference,nogpu", "--json", str(report))
    assert result.exit_code == EXIT_NOT_RUN, result.output
    data = replay_json(report)
    assert data["passed"] is False and data["verdict"] == "incomplete"
    (step,) = data["steps"]
    assert step["compared"] == ["reference"]
    assert step["skipped"] == [{"backend": "nogpu", "variant": "eager", "status": "unavailable", "reason": "no CUDA GPU: this backend runs only on NVIDIA GPUs"}]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: 1 backend compared (reference)") and "nogpu unavailable: no CUDA GPU" in last


def test_only_a_named_backend_that_cannot_run(tiny: Path, tmp_path: Path, with_nogpu: None) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "nogpu", "--json", str(report))
    assert result.exit_code == EXIT_NOT_RUN and replay_json(report)["steps"][0]["compared"] == []
    assert "0 backends compared (none)" in result.stdout


def test_all_skips_what_cannot_run_but_names_it(tiny: Path, tmp_path: Path, with_nogpu: None) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "all", "--json", str(report))
    assert result.exit_code == 0, result.output
    data = replay_json(report)
    assert data["verdict"] == "passed" and [s["backend"] for s in data["steps"][0]["skipped"]] == ["nogpu"]
    assert "PASSED: 1 backend compared (reference), all passed; nogpu unavailable" in result.stdout


def test_seeded_data_is_said(tiny: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "reference", "--json", str(report))
    assert result.exit_code == 0 and "data: seeded data (seed 0)" in result.stdout
    assert replay_json(report)["steps"][0]["data"] == {"source": "seeded", "layer": None, "seed": 0}


def test_recorded_tensors_are_the_default(tmp_path: Path) -> None:
    """A step that carries tensors replays them without --layer, and says so."""
    report = tmp_path / "r.json"
    result = invoke("replay", str(SHIPPED_RECORDING), "--backend", "reference", "--json", str(report))
    assert result.exit_code == 0, result.output
    assert "data: recorded tensors of layer 0" in result.stdout
    assert replay_json(report)["steps"][0]["data"]["source"] == "recorded"


def test_a_layer_the_step_lacks_is_bad_input() -> None:
    one_line_error(invoke("replay", str(SHIPPED_RECORDING), "--backend", "reference", "--layer", "3"), "--layer 3", "has [0]")


def test_repeat_result_is_shown(tiny: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "reference", "--repeat", "3", "--json", str(report))
    assert result.exit_code == 0 and "--repeat 3: reference bitwise identical over 3 runs" in result.stdout
    (run,) = replay_json(report)["steps"][0]["backends"]
    assert run["repeat"] == {"runs": 3, "bitwise_identical": True}


@pytest.mark.parametrize("flag", [["--capture-bs", "8"], ["--fill-value", "1"]])
def test_graph_options_without_cuda_graph_are_bad_input(tiny: Path, flag: list[str]) -> None:
    one_line_error(invoke("replay", str(tiny), "--backend", "reference", *flag), flag[0], "--cuda-graph")


def test_num_kv_splits_without_triton_is_noted(tiny: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "reference", "--num-kv-splits", "2", "--json", str(report), columns=200)
    assert result.exit_code == 0
    (note,) = replay_json(report)["steps"][0]["notes"]
    assert note == "--num-kv-splits sets the triton backend's split count; triton is not among the backends run"
    assert f"note: {note}" in result.stdout


def test_num_kv_splits_note_names_the_mode(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "e.pt", "extend-prefix", "prefix_lens=0,5", "extend_lens=3,2", *TINY)
    report = tmp_path / "r.json"
    result = invoke("replay", str(trace), "--backend", "triton", "--num-kv-splits", "2", "--json", str(report), columns=200)
    assert result.exit_code == 0, result.output
    assert replay_json(report)["steps"][0]["notes"] == ["--num-kv-splits: only decode steps split the KV; this EXTEND step has no splits"]
    assert "note: --num-kv-splits: only decode steps split the KV" in result.stdout


def test_json_to_stdout_is_pure_json(tiny: Path) -> None:
    result = invoke("replay", str(tiny), "--backend", "reference", "--json", "-")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["schema"] == "attndbg.replay/1" and len(data["steps"]) == 1
    assert "data: seeded data" in result.stderr  # the table went to stderr


def test_folder_without_manifest_replays_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    write_trace(folder / "b.pt", "decode-mha", "kv_lens=4", *TINY)
    write_trace(folder / "a.pt", "decode-mha", "kv_lens=3,20", *TINY)
    (folder / "notes.txt").write_text("not a trace")
    report = tmp_path / "r.json"
    result = invoke("replay", str(folder), "--backend", "reference", "--json", str(report))
    assert result.exit_code == 0, result.output
    steps = replay_json(report)["steps"]
    assert [Path(s["trace"]).name for s in steps] == ["a.pt", "b.pt"] and [s["batch_size"] for s in steps] == [2, 1]
    assert "2 steps: 1 backend compared" in result.stdout


def test_empty_folder_is_bad_input(tmp_path: Path) -> None:
    one_line_error(invoke("replay", str(tmp_path), "--backend", "reference"), "no manifest.jsonl and no .pt files")


def test_a_saved_replay_where_a_trace_is_expected(tiny: Path, tmp_path: Path) -> None:
    saved = tmp_path / "a.replay"
    assert invoke("replay", str(tiny), "--backend", "reference", "--save", str(saved)).exit_code == 0
    copy = tmp_path / "a.pt"
    copy.write_bytes(saved.read_bytes())
    one_line_error(invoke("replay", str(copy)), "this is a saved replay", "attndbg diff")


def _wrong_plan_trace(tmp_path: Path) -> Path:
    """Request 1 of 3 (a decode row) reads one slot of request 2 in the recorded plan."""
    trace = make_trace("decode-gqa", "kv_lens=20,60,90", *TINY, plan=True)
    indices = trace.plan.tensors["kv_indices"].clone()
    indices[20 + 40] = indices[80 + 70]
    return io.save(replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "kv_indices": indices})), tmp_path / "p.pt")


def test_failure_is_located_by_row_within_its_request(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(_wrong_plan_trace(tmp_path)), "--backend", "reference,triton", "--plan", "both", "--json", str(report), columns=200)
    assert result.exit_code == 1, result.output
    runs = {(r["backend"], r["variant"]): r for r in replay_json(report)["steps"][0]["backends"]}
    worst = runs[("triton", "recorded plan")]["worst"]
    assert worst["request"] == 1 and worst["row_in_request"] == 0 and worst["step_row"] == 1
    assert "triton recorded plan: 1 of 3 rows miss the reference; worst at request 1 row 0 (step row 1) head" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("FAILED: 2 backends compared (reference, triton), failed: triton recorded plan")


NUMBER = re.compile(r"\d+\.\d+e[-+]\d+|\d+/\d+|\d+\.\d ms")


@pytest.mark.parametrize("columns", [80, 200])
def test_table_numbers_are_never_folded(tmp_path: Path, columns: int) -> None:
    """Every number of the JSON appears whole in the table, and no line is wider than the terminal."""
    report = tmp_path / "r.json"
    result = invoke("replay", str(_wrong_plan_trace(tmp_path)), "--backend", "triton,reference", "--plan", "both", "--json", str(report), columns=columns)
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    # The table fits $COLUMNS; piped, the verdict is one line whatever the width (a log's grep finds
    # it whole), ending with the time the command took.
    assert re.fullmatch(re.escape(replay_json(report)["summary"]) + r"; took \d+(\.\d)? s", lines[-1]), lines[-1]
    assert max(len(line) for line in lines[:-1]) <= columns
    for run in replay_json(report)["steps"][0]["backends"]:
        if "max_abs" not in run:
            continue
        name = run["backend"] if run["variant"] == "eager" else f"{run['backend']} {run['variant']}"
        row = next(line for line in lines if line.startswith(name.split()[0]) and f"{run['max_abs']:.3e}" in line)
        cells = [f"{run[k]:.3e}" for k in ("max_abs", "max_rel", "max_lse_abs")]
        cells += [f"{run['failing_rows']}/{run['total_rows']}", f"{run['seconds'] * 1e3:.1f} ms"]
        found = NUMBER.findall(row)
        assert all(cell in found for cell in cells), (cells, row)


@pytest.mark.parametrize("option", ["--json", "--save"])
def test_output_in_a_missing_folder_is_refused_before_the_run(tiny: Path, tmp_path: Path, option: str) -> None:
    one_line_error(invoke("replay", str(tiny), "--backend", "reference", option, str(tmp_path / "nope" / "out")), option, "does not exist")


def test_a_folder_as_json_output_is_one_line(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "out.json").mkdir()  # a folder where the file should go
    one_line_error(invoke("replay", str(tiny), "--backend", "reference", "--json", str(tmp_path / "out.json")), "is a directory")


def test_backend_list_naming_nothing_is_bad_input(tiny: Path) -> None:
    one_line_error(invoke("replay", str(tiny), "--backend", ","), "names no backend")


@pytest.mark.parametrize("command", [["diff", "A", "A"], ["show", "A"]])
def test_json_into_a_missing_folder_is_refused(tiny: Path, tmp_path: Path, command: list[str]) -> None:
    args = [str(tiny) if word == "A" else word for word in command]
    one_line_error(invoke(*args, "--json", str(tmp_path / "nope" / "x.json")), "does not exist")
