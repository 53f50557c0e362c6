"""Shared by the CLI tests: one invoke, fake backends that cannot run, the replay JSON's steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from attndbg.backends import registry
from attndbg.backends.reference import ReferenceBackend
from attndbg.cli import main


def invoke(*args: str, columns: int | None = None) -> Result:
    env = {"COLUMNS": str(columns)} if columns else None
    return CliRunner().invoke(main, list(args), env=env)


def one_line_error(result: Result, *needles: str) -> None:
    """Bad input: exit 2, one line on stderr, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def one_line_not_run(result: Result, *needles: str) -> None:
    """What cannot run on this machine (no CUDA GPU, a missing optional package): exit 3, one line
    on stderr, no traceback."""
    assert result.exit_code == 3, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("not run: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


class NoGpuBackend(ReferenceBackend):
    """A backend that cannot run on this machine, whatever the machine."""

    name = "nogpu"

    def unavailable_reason(self) -> str | None:
        return "no CUDA GPU: this backend runs only on NVIDIA GPUs"


@pytest.fixture
def with_nogpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register `nogpu` beside the reference, as the only backends (`all` = both)."""
    monkeypatch.setattr(registry, "backend_names", lambda: ["reference", "nogpu"])
    original = registry.create
    monkeypatch.setattr(registry, "create", lambda name, **kw: NoGpuBackend() if name == "nogpu" else original(name, **kw))


def replay_json(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert data["schema"] == "attndbg.replay/1"
    return data
