"""`attndbg check` as the recorder tests call it: through the command line (in this process, with
click's CliRunner) and its JSON, so the tests follow the detectors wherever their modules live.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from attndbg.cli import main

Found = tuple[str, str, str]  # (class, check, location.field)


def check_json(path: str | Path, *, only: str | None = None, backend: str = "triton") -> dict:
    """The attndbg.check/1 object of `attndbg check PATH`; asserts every step was checked."""
    args = ["check", str(path), "--backend", backend, "--in-process", "--jobs", "1", "--json", "-"]
    if only:
        args += ["--only", only]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), (result.exit_code, result.output)
    report = json.loads(result.stdout)
    assert all(step["checked"] for step in report["steps"]), [step["error"] for step in report["steps"]]
    return report


def findings(path: str | Path, *, only: str | None = None, backend: str = "triton") -> set[Found]:
    """(class, check, field) of every finding `attndbg check` reports."""
    report = check_json(path, only=only, backend=backend)
    return {(f["class"], f["check"], f["location"].get("field") or "") for step in report["steps"] for f in step["findings"]}


def finding_texts(path: str | Path, *, only: str | None = None, backend: str = "triton") -> list[dict]:
    """Every finding's JSON object (evidence, cause, data)."""
    report = check_json(path, only=only, backend=backend)
    return [f for step in report["steps"] for f in step["findings"]]
