"""--timeline on the command line: refused before any work where it cannot run, one line and exit 3
(not run here); no GPU is said first, before the package a CPU could not use anyway."""

from __future__ import annotations

import types

import pytest

from attndbg import machine
from attndbg.timeline import availability
from tests.cli.helpers import invoke, one_line_error, one_line_not_run


@pytest.mark.parametrize("command", ["replay", "check"])
def test_refused_without_cupti_python_before_reading_the_trace(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    result = invoke(command, "no/such/trace.pt", "--timeline", "t.json")
    one_line_not_run(result, "--timeline needs the cupti-python package", "pip install 'attndbg[timeline]'")


@pytest.mark.parametrize("installed", [True, False])
def test_refused_on_a_machine_without_a_gpu_first(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """Said first whether or not cupti-python is installed: installing it would not help here."""
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: types.SimpleNamespace(name=name) if installed else None)
    monkeypatch.setattr(availability.importlib, "import_module", lambda name: types.ModuleType(name))
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    result = invoke("replay", "traces/decode_gqa.pt", "--timeline", "t.json")
    one_line_not_run(result, "there is no CUDA GPU here: no GPU timeline on this machine")
    assert "cupti" not in result.stderr


def test_an_output_folder_that_does_not_exist_is_refused_first() -> None:
    one_line_error(invoke("replay", "traces/decode_gqa.pt", "--timeline", "no/such/dir/t.json"), "--timeline no/such/dir/t.json: the folder no/such/dir does not exist")


def test_record_is_refused_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    ran = tmp_path / "engine_ran"
    result = invoke("record", "-o", str(tmp_path / "rec"), "--timeline", "t.json", "--", "python", "-c", f"open({str(ran)!r}, 'w')")
    one_line_not_run(result, "--timeline needs the cupti-python package", "pip install 'attndbg[timeline]'")
    assert not ran.exists() and not (tmp_path / "rec").exists()
