"""A recorded plan the plan detectors cannot read (no adapter has its backend's name, or the adapter
declares no plan view) is named on the verdict line and in the JSON, never checked less silently;
it is not a finding (nothing is wrong in the step) and leaves the exit code alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends import registry
from attndbg.cli import main
from attndbg.trace import io
from tests.checks.shapes import SMALL
from tests.factories import make_trace

VIEWLESS = "viewless=tests.checks.viewless_backend:ViewlessBackend"


def _step(tmp_path: Path, backend: str) -> Path:
    trace = make_trace("decode-mha", "kv_lens=3,20", *SMALL, plan=True)
    trace = replace(trace, plan=replace(trace.plan, backend=backend), source=replace(trace.source, backend=backend))
    return io.save(trace, tmp_path / "t.pt")


@pytest.mark.parametrize(
    "backend,why",
    [("viewless", "the viewless adapter declares no plan view"), ("SOME_ENGINE_BACKEND", "no adapter here")],
)
def test_a_plan_no_adapter_can_view_is_named_on_the_verdict_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backend: str, why: str) -> None:
    monkeypatch.setenv(registry.ENVIRONMENT_VARIABLE, VIEWLESS)
    path = _step(tmp_path, backend)
    trace = io.load(path)
    assert registry.create("viewless").plan_view(trace, trace.plan) is None
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants,tree-mask", "--json", str(report)])
    assert result.exit_code == 0, result.output
    line = f"recorded plan not read by the plan detectors on 1 step ({backend}: {why})"
    assert line in " ".join(result.output.split())
    assert json.loads(report.read_text())["verdict"]["plans_unread"] == {f"{backend}: {why}": 1}


def test_an_engines_own_metadata_is_named_as_judged_by_its_builder_rules(tmp_path: Path) -> None:
    """A vLLM plan is the builder's metadata, judged against the engine's own fields; the verdict
    line says so rather than that nothing here knows it."""
    trace = make_trace("decode-mha", "kv_lens=3,20", *SMALL, plan=True)
    trace = replace(trace, plan=replace(trace.plan, backend="FLASHINFER"), source=replace(trace.source, engine="vllm", backend="FLASHINFER"))
    path = io.save(trace, tmp_path / "t.pt")
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants"])
    assert result.exit_code == 0, result.output
    why = "the engine's own metadata, judged by its builder rules; no adapter's plan layout reads it"
    assert f"recorded plan not read by the plan detectors on 1 step (FLASHINFER: {why})" in " ".join(result.output.split())


def test_a_plan_its_adapter_views_is_not_named(tmp_path: Path) -> None:
    path = _step(tmp_path, "triton")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "not read by the plan detectors" not in result.output
    assert json.loads(report.read_text())["verdict"]["plans_unread"] == {}


def test_only_the_plan_detectors_say_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(registry.ENVIRONMENT_VARIABLE, VIEWLESS)
    result = CliRunner().invoke(main, ["check", str(_step(tmp_path, "viewless")), "--only", "fill-value"])
    assert result.exit_code == 0, result.output
    assert "not read by the plan detectors" not in result.output
