"""One CliRunner test per command, and the exit-code contract (0 ok, 1 failed, 2 bad input)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends import registry
from attndbg.backends.triton import TritonBackend
from attndbg.cli import EXIT_NOT_RUN, main
from tests.factories import write_trace


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_synth_writes_a_loadable_trace_with_a_plan(tmp_path: Path) -> None:
    out = tmp_path / "v.pt"
    result = invoke("synth", "verify", "prefix_lens=5,9", "-o", str(out))
    assert result.exit_code == 0, result.output
    from attndbg.trace import io

    trace = io.load(out)
    assert trace.batch.prefix_lens.tolist() == [5, 9]
    assert trace.plan is not None and trace.plan.backend == "triton"
    assert torch.equal(trace.plan.tensors["custom_mask"], trace.spec.custom_mask)


def test_synth_bad_spec_is_one_line_exit_2(tmp_path: Path) -> None:
    result = invoke("synth", "decode-gqa", "kv_lenz=1", "-o", str(tmp_path / "x.pt"))
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "unknown key 'kv_lenz'" in result.output


def test_synth_list() -> None:
    result = invoke("synth", "--list")
    assert result.exit_code == 0 and "verify" in result.output and "draft_tokens" in result.output


def test_replay_passes_and_writes_json(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "decode-mha")
    report = tmp_path / "r.json"
    result = invoke("replay", str(trace), "--backend", "triton,reference", "--json", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["schema"] == "attndbg.replay/1" and data["passed"] is True and data["verdict"] == "passed"
    (step,) = data["steps"]
    assert [b["backend"] for b in step["backends"]] == ["triton", "reference"]
    assert step["compared"] == ["triton", "reference"] and step["skipped"] == []
    assert all(b["status"] == "passed" and b["failing_rows"] == 0 for b in step["backends"])
    assert "PASSED: 2 backends compared (triton, reference)" in result.output


def test_replay_unknown_backend_exit_2(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "decode-mha")
    result = invoke("replay", str(trace), "--backend", "tritonn")
    assert result.exit_code == 2 and "unknown backend 'tritonn'" in result.output


def test_replay_missing_file_exit_2(tmp_path: Path) -> None:
    result = invoke("replay", str(tmp_path / "nope.pt"))
    assert result.exit_code == 2 and "nope.pt" in result.output and "cannot read" in result.output


class _WrongMaskTriton(TritonBackend):
    """Triton with an engine-style bug: every draft token also sees the last draft token."""

    name = "triton-wrong-mask"

    def derive_plan(self, trace):
        plan = super().derive_plan(trace)
        mask = plan.tensors["custom_mask"].clone()
        n = trace.spec.draft_token_num
        start = 0
        for prefix in trace.batch.prefix_lens.tolist():
            block = mask[start : start + n * (prefix + n)].view(n, prefix + n)
            block[:, -1] = True
            start += n * (prefix + n)
        return replace(plan, tensors={**plan.tensors, "custom_mask": mask})


def test_replay_exit_1_when_a_backend_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = write_trace(tmp_path / "t.pt", "verify", "prefix_lens=6,10")
    monkeypatch.setattr(registry, "backend_names", lambda: ["reference", "triton", "triton-wrong-mask"])
    original = registry.create
    monkeypatch.setattr(registry, "create", lambda name, **kw: _WrongMaskTriton() if name == "triton-wrong-mask" else original(name, **kw))
    report = tmp_path / "r.json"
    result = invoke("replay", str(trace), "--backend", "triton,triton-wrong-mask", "--json", str(report))
    assert result.exit_code == 1, result.output
    runs = {b["backend"]: b for b in _steps(report)[0]["backends"]}
    assert runs["triton"]["status"] == "passed"
    assert runs["triton-wrong-mask"]["status"] == "failed" and runs["triton-wrong-mask"]["failing_rows"] > 0


def test_replay_reports_unsupported_features(tmp_path: Path) -> None:
    """triton, named explicitly, cannot run an MLA extend: reported, and the exit code says so."""
    trace = write_trace(tmp_path / "t.pt", "mla-decode", "mode=extend", "prefix_lens=3", "extend_lens=4", plan=False)
    report = tmp_path / "r.json"
    result = invoke("replay", str(trace), "--backend", "triton,reference", "--json", str(report))
    assert result.exit_code == EXIT_NOT_RUN, result.output
    (step,) = _steps(report)
    runs = {b["backend"]: b for b in step["backends"]}
    assert runs["triton"]["status"] == "unsupported" and runs["triton"]["reason"] == "MLA extend: our Triton kernels run MLA decode only"
    assert step["compared"] == ["reference"] and [s["backend"] for s in step["skipped"]] == ["triton"]
    assert step["verdict"] == "incomplete" and "triton unsupported" in result.output


def test_backends_lists_triton_and_its_mode() -> None:
    result = invoke("backends")
    assert result.exit_code == 0
    assert "reference" in result.output and "triton" in result.output


def test_python_dash_m_runs() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "attndbg", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "replay" in proc.stdout


def _trace_with_plan_change(tmp_path: Path, change) -> Path:
    from attndbg.trace import io
    from tests.factories import make_trace

    trace = make_trace("decode-gqa", "kv_lens=20,60,90", plan=True)
    tensors = dict(trace.plan.tensors)
    change(tensors)
    return io.save(replace(trace, plan=replace(trace.plan, tensors=tensors)), tmp_path / "p.pt")


def _steps(report: Path) -> list[dict]:
    data = json.loads(report.read_text())
    assert data["schema"] == "attndbg.replay/1"
    return data["steps"]


def _rows(report: Path) -> dict[tuple[str, str], dict]:
    (step,) = _steps(report)
    return {(b["backend"], b["variant"]): b for b in step["backends"]}


def test_recorded_plan_replays_beside_the_derived_one(tmp_path: Path) -> None:
    path = _trace_with_plan_change(tmp_path, lambda t: None)
    report = tmp_path / "r.json"
    result = invoke("replay", str(path), "--backend", "triton", "--plan", "both", "--repeat", "2", "--json", str(report))
    assert result.exit_code == 0, result.output
    rows = _rows(report)
    assert rows[("triton", "eager")]["status"] == "passed"
    assert rows[("triton", "recorded plan")]["status"] == "passed"


def test_wrong_recorded_plan_fails_at_its_request(tmp_path: Path) -> None:
    def swap(t):  # request 1 reads one slot of request 2: a wrong index still inside the cache
        indices = t["kv_indices"].clone()
        # Column 40 of request 1 and column 70 of request 2: past the 16 shared prefix columns.
        assert indices[20 + 40] != indices[80 + 70]
        indices[20 + 40] = indices[80 + 70]
        t["kv_indices"] = indices

    report = tmp_path / "r.json"
    result = invoke("replay", str(_trace_with_plan_change(tmp_path, swap)), "--backend", "triton", "--plan", "recorded", "--json", str(report))
    assert result.exit_code == 1
    row = _rows(report)[("triton", "recorded plan")]
    assert row["status"] == "failed" and row["failing_rows"] == 1 and row["worst"]["request"] == 1


def test_recorded_plan_outside_the_cache_is_not_launched(tmp_path: Path) -> None:
    def outside(t):
        indices = t["kv_indices"].clone()
        indices[7] = 10**9
        t["kv_indices"] = indices

    report = tmp_path / "r.json"
    result = invoke("replay", str(_trace_with_plan_change(tmp_path, outside)), "--backend", "triton", "--plan", "recorded", "--json", str(report))
    assert result.exit_code == 1
    row = _rows(report)[("triton", "recorded plan")]
    assert row["status"] == "error" and "kv_indices[7] = 1000000000" in row["reason"] and "not launched" in row["reason"]


def test_recorded_plan_of_another_backend_is_reported(tmp_path: Path) -> None:
    path = _trace_with_plan_change(tmp_path, lambda t: None)
    report = tmp_path / "r.json"
    result = invoke("replay", str(path), "--backend", "reference", "--plan", "recorded", "--json", str(report))
    assert result.exit_code == EXIT_NOT_RUN, result.output  # nothing of reference was compared
    assert "built by 'triton'" in _rows(report)[("reference", "recorded plan")]["reason"]
    assert "0 backends compared" in result.output


def test_check_a_recording_directory(tmp_path: Path) -> None:
    """A directory is checked step by step; only the step carrying a mistake has findings."""
    from attndbg.detectors import registry as detectors
    from attndbg.trace import io
    from tests.factories import make_trace

    small = ("heads=2:1", "head_dim=32")
    steps = [
        make_trace("decode-mha", "kv_lens=3,20", *small, plan=True),
        detectors.inject(make_trace("verify", "prefix_lens=4,7", *small, plan=True), "tree-mask:sibling-visible"),
        make_trace("extend-prefix", "prefix_lens=0,9", "extend_lens=5,3", *small, plan=True),
    ]
    for step, trace in enumerate(steps):
        io.append_to_recording(tmp_path / "rec", replace(trace, source=replace(trace.source, step=step)))
    report = tmp_path / "findings.json"
    result = invoke("check", str(tmp_path / "rec"), "--only", "tree-mask,invariants", "--json", str(report))
    assert result.exit_code == 1, result.output
    data = json.loads(report.read_text())
    by_step = {s["step"]: s["findings"] for s in data["steps"]}
    assert by_step[0] == [] and by_step[2] == []
    assert by_step[1] and all(f["class"] == "tree-mask" for f in by_step[1])
    assert "summary" in result.output


def test_check_unknown_detector_exit_2(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.pt", "decode-mha")
    result = invoke("check", str(path), "--only", "fill-values")
    assert result.exit_code == 2 and "unknown detector 'fill-values'" in result.output
