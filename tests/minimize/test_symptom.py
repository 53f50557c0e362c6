"""minimize keeps the symptom, not only the label: when the step's repro script reproduces, a
smaller step whose script no longer does is not kept, though it still shows the finding (the graph
step whose padded tokens write live KV: cut to the requests whose slots are not written, the
fill-value finding stays and the script passes). A recorded engine output shrinks with the rows it
has and blocks the cut it cannot follow (cached columns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors import registry
from attndbg.minimize import shrink
from attndbg.minimize.search import MinimizeOptions, Outcome, _Search
from attndbg.minimize.target import Failure, FailureKind, reproduces
from attndbg.report.minimize import render_outcome
from attndbg.repro.symptom import probe_with_symptom, script_outcome
from attndbg.trace import io
from tests.factories import make_trace
from tests.interop import fi_dumps

LABEL = Failure(FailureKind.FINDING, "fill-value", "padded-kv-write")


def _stale_padded_writes(tmp_path: Path) -> Path:
    """Requests 0 and 1 have one column each (no stale slot of theirs): the 2 padded tokens write
    the last step's slots of requests 2 and 3, so only those fail in the graph."""
    trace = make_trace("decode-mha", "heads=2:1", "head_dim=32", "kv_lens=1,1,20,9", "capture_bs=6", plan=True)
    return io.save(registry.inject(trace, "fill-value:padded-kv-write"), tmp_path / "bad.pt")


def _first_kept(tmp_path: Path, bad: Path, symptom: str | None) -> tuple[int, ...]:
    options = MinimizeOptions("triton", ("fill-value", "padded-kv-write"), CheckOptions(backends=("triton",)), jobs=2, probe=probe_with_symptom, symptom=symptom)
    search = _Search(options, tmp_path, lambda _: None)
    search.only, search.target, search.original_failures = [FindingClass("fill-value")], LABEL, []
    trace = io.load(bad)
    hit = search.first_reproducing([lambda: shrink.keep_requests(trace, [0, 1]), lambda: shrink.keep_requests(trace, [2, 3])])
    assert hit is not None
    return hit.rows[: hit.trace.batch.batch_size]


def test_a_smaller_step_whose_script_passes_is_not_kept(tmp_path: Path) -> None:
    bad = _stale_padded_writes(tmp_path)
    original = script_outcome(bad, "triton")
    assert original.symptom == "mismatch", original  # rows 2 and 3 fail in the graph
    assert _first_kept(tmp_path, bad, symptom=None) == (0, 1)  # the label alone: requests 0 and 1 still show it
    assert _first_kept(tmp_path, bad, symptom="mismatch") == (2, 3)  # their script passes: not kept


def test_the_symptom_is_required_beside_the_target() -> None:
    found = [LABEL, Failure(FailureKind.SYMPTOM, "repro", "nan-inf")]
    assert reproduces(LABEL, found, [], symptom="nan-inf")
    assert not reproduces(LABEL, found, [], symptom="crash")
    assert not reproduces(LABEL, [LABEL], [], symptom="nan-inf")
    assert reproduces(LABEL, [LABEL], [])


def test_the_result_line_names_the_symptom_kept() -> None:
    trace = make_trace("decode-mha", "kv_lens=3,9")
    outcome = Outcome(trace, trace, LABEL, "crash", ("requests 1 (of 2)",), 3, 0, 1.0)
    assert "kept:    fill-value/padded-kv-write (finding) with --backend triton; its repro's symptom: crash" in render_outcome(outcome, "triton", "small.pt")
    assert "symptom: none kept" in render_outcome(Outcome(trace, trace, LABEL, None, (), 0, 0, 1.0), "triton", "small.pt")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory):
    """An imported decode with the engine's output kept: 3 requests with cached prefixes."""
    root = tmp_path_factory.mktemp("fi")
    w = fi_dumps.DumpWriter(root / "dump")
    fi_dumps.write_decode(w, kv_lens=(9, 13, 6), layers=1)
    assert CliRunner().invoke(main, ["import", "flashinfer", str(root / "dump"), "-o", str(root / "rec")]).exit_code == 0
    return io.load(root / "rec" / "step_000000.pt")


def test_the_recorded_output_shrinks_with_requests_and_heads(imported) -> None:
    layer = imported.tensors[0]
    kept = shrink.keep_requests(imported, [2]).trace.tensors[0]
    assert torch.equal(kept.output, layer.output[2:3]) and torch.equal(kept.lse, layer.lse[2:3])
    fewer = shrink.fewer_heads(imported, 2, 1).trace.tensors[0]
    assert torch.equal(fewer.output, layer.output[:, :2]) and torch.equal(fewer.lse, layer.lse[:, :2])


def test_cached_columns_are_not_cut_under_a_recorded_output(imported) -> None:
    """Every query of the request attends to them: an output of other keys would fail for another reason."""
    with pytest.raises(shrink.NotApplicable, match="recorded engine output"):
        shrink.drop_columns(imported, 0, 4)
