"""`check DIR` names why each step it did not check was not checked, on the verdict line and in the
JSON: a long check's per-step lines scroll away."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from attndbg.checks.step import StepReport
from attndbg.detector_api.findings import FindingClass
from attndbg.report.checks import check_verdict
from attndbg.trace import io
from tests.cli.helpers import invoke
from tests.factories import make_trace


def test_each_reason_names_its_steps() -> None:
    steps = [
        StepReport("rec/a.pt", 0, "DECODE", []),
        StepReport("rec/b.pt", 1, "DECODE", [], error="batch.kv_cache_size: = 8589934592 slots need 1024 GiB (more than --max-memory 8 GiB)"),
        StepReport("rec/c.pt", 2, "DECODE", [], error="batch.kv_cache_size: = 8589934592 slots need 1024 GiB (more than --max-memory 8 GiB)"),
        StepReport("rec/d.pt", -1, "unreadable", [], error="file: not a readable attndbg trace: not a torch.save file (it starts with b'junk')", bad_input=True),
        StepReport("rec/e.pt", 4, "DECODE", [], error="the worker checking this step died (exit code -9)"),
    ]
    verdict = check_verdict(steps, [FindingClass.INVARIANT], None)
    assert verdict.line.startswith(
        "checked 1 of 5 steps; not checked: steps 1, 2 (batch.kv_cache_size: = 8589934592 slots need 1024 GiB); "
        "d.pt (file: not a readable attndbg trace: not a torch.save file); step 4 (the worker checking this step died); detectors: invariants;"
    ), verdict.line
    assert verdict.not_checked == {
        "batch.kv_cache_size: = 8589934592 slots need 1024 GiB": ["1", "2"],
        "file: not a readable attndbg trace: not a torch.save file": ["d.pt"],
        "the worker checking this step died": ["4"],
    }
    assert verdict.incomplete and verdict.unchecked_steps == 4
    clean = check_verdict(steps[:1], [FindingClass.INVARIANT], None)
    assert "not checked" not in clean.line and clean.not_checked == {}


def test_many_reasons_are_counted_past_the_first_four() -> None:
    steps = [StepReport(f"rec/{i}.pt", i, "DECODE", [], error=f"reason number {i}") for i in range(6)]
    line = check_verdict(steps, [FindingClass.INVARIANT], None).line
    assert "not checked: step 0 (reason number 0); step 1 (reason number 1); step 2 (reason number 2); step 3 (reason number 3); and 2 more reasons (above);" in line


def test_check_dir_says_why_on_the_verdict_and_in_json(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    trace = make_trace("decode-mha", "kv_lens=3,20", "heads=2:1", "head_dim=32")
    for step in range(3):
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    (rec / "step_000001.pt").write_bytes(b"junk")
    result = invoke("check", str(rec), "--only", "invariants", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 3, result.output
    why = "not checked: step_000001.pt (file: not a readable attndbg trace: not a torch.save file)"
    assert why in result.stdout.splitlines()[-1]
    assert json.loads((tmp_path / "r.json").read_text())["verdict"]["not_checked"] == {"file: not a readable attndbg trace: not a torch.save file": ["step_000001.pt"]}
