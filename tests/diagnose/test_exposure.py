"""`check --only exposure`: a step without the engine's output, judged exposed to a mistake where its
metadata shows the precondition and the mistake would move an output beyond tolerance; silent where
the metadata shows none, and never run by the default check. An exposure is a hazard: a correct
step that shows one checks with exit 0 and the hazard named on the verdict line (`--strict`: 1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Severity
from attndbg.detectors import registry
from attndbg.detectors.exposure.detect import detect
from attndbg.trace import io
from tests.checks.shapes import SMALL
from tests.diagnose.test_diagnose import DECODE
from tests.factories import make_trace


def metadata_only(*spec: str, splits: list[int] | None = None, max_kv_splits: int | None = None):
    trace = make_trace(*spec, plan=True)
    tensors, scalars = dict(trace.plan.tensors), dict(trace.plan.scalars)
    if splits is not None:
        tensors["num_kv_splits"] = torch.tensor(splits, dtype=torch.int32)
    if max_kv_splits is not None:
        scalars["max_kv_splits"] = max_kv_splits
    return replace(trace, plan=replace(trace.plan, tensors=tensors, scalars=scalars))


def exposed(trace) -> dict[str, list[int]]:
    return {f.check: f.data["exposure"]["requests"] for f in detect(CheckContext(trace=trace, path="t"))}


def test_empty_splits_in_the_recorded_split_plan() -> None:
    # Requests of 5, 33 and 70 keys in 8 splits of 32: the short ones have empty splits whose
    # zero states would outweigh their keys; with one split each, nothing is empty.
    trace = metadata_only("decode-gqa", *SMALL, "kv_lens=5,33,70", "shared_prefix=0", splits=[8, 8, 8])
    found = exposed(trace)
    assert found["exposed-to-empty-splits-zeros"] == [0, 1, 2]
    assert set(found) <= {"exposed-to-empty-splits-zeros", "exposed-to-empty-splits-stale"}
    assert exposed(metadata_only("decode-gqa", *SMALL, "kv_lens=5,33,70", "shared_prefix=0", splits=[1, 1, 1])) == {}


def test_split_count_past_the_scratch() -> None:
    trace = metadata_only("decode-gqa", *SMALL, "kv_lens=5,100,300", "shared_prefix=0", splits=[1, 3, 12], max_kv_splits=8)
    assert exposed(trace)["exposed-to-splits-beyond-capture"] == [2]


def test_a_recorded_plan_that_differs_from_the_batch() -> None:
    trace = metadata_only(*DECODE, splits=[1, 1, 1])
    indices = trace.plan.tensors["kv_indices"].clone()
    start = int(trace.plan.tensors["kv_indptr"][1])
    indices[start + 70 : start + 100] = trace.batch.request_slots(2)[70:100].to(indices.dtype)
    trace = replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "kv_indices": indices}))
    assert exposed(trace) == {"exposed-to-recorded-plan-kv": [1]}


def test_a_clean_step_is_exposed_to_nothing_and_the_default_check_skips_it() -> None:
    assert exposed(metadata_only(*DECODE, splits=[1, 1, 1])) == {}
    assert exposed(make_trace("verify", *SMALL, "prefix_lens=20,33", plan=True)) == {}
    assert "exposure" in registry.names() and "exposure" not in registry.default_names()


def test_exposures_are_hazards_a_clean_step_exits_0_and_strict_fails(tmp_path: Path) -> None:
    # A correct step (8 splits is a valid split plan) whose metadata shows empty splits.
    trace = metadata_only("decode-gqa", *SMALL, "kv_lens=5,33,70", "shared_prefix=0", splits=[8, 8, 8])
    assert all(f.severity is Severity.HAZARD for f in detect(CheckContext(trace=trace, path="t")))
    path = io.save(trace, tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "exposure", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    found = data["steps"][0]["findings"]
    assert found and {f["severity"] for f in found} == {"hazard"}
    verdict = data["verdict"]
    assert (verdict["findings"], verdict["defects"], verdict["hazards"]) == (len(found), 0, len(found))
    assert set(verdict["hazards_by_check"]) == {f"exposure/{f['check']}" for f in found}
    line = " ".join(result.output.split())
    assert f"0 defects, {len(found)} hazard" in line and "exposure/exposed-to-empty-splits-zeros" in line
    strict = CliRunner().invoke(main, ["check", str(path), "--only", "exposure", "--strict"])
    assert strict.exit_code == 1, strict.output
