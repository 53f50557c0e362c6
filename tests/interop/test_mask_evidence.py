"""A FlashInfer dump whose prefill plan() was handed a custom mask that does not fit the requests'
q_len x kv_len blocks (FlashInfer #3176: plan() packed it unchecked and the kernel read past it) is
kept as a step, never refused: the mask as the caller passed it, the draft tree not known; check
names the request and the first element read past the mask. The twins, the right (10, 20) mask
flat or packed, import with their tree and check clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from tests.interop import fi_dumps


def _imported(tmp_path: Path, *writes) -> Path:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    for write in writes:
        write(w)
    result = CliRunner().invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 0, result.output
    assert "not imported" not in result.output, result.output
    return tmp_path / "rec"


def _checked(rec: Path) -> tuple[int, list[dict]]:
    report = rec.parent / "check.json"
    result = CliRunner().invoke(main, ["check", str(rec), "--backend", "reference", "--json", str(report)])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, [s["findings"] for s in json.loads(report.read_text())["steps"]]


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_a_mask_short_of_its_blocks_is_kept_and_judged(tmp_path: Path, packed: bool) -> None:
    rec = _imported(tmp_path, lambda w: fi_dumps.write_mask_shape(w, columns=15, packed=packed))
    (step,) = [io.load(p) for p in io.trace_paths(rec)]
    name = "packed_custom_mask" if packed else "custom_mask"
    assert step.plan.tensors[name].numel() == (19 if packed else 150)  # as the caller passed it
    assert step.spec.custom_mask is None and step.spec.algorithm == "unknown"
    assert "not known" in step.source.inferred["spec"] and step.tensors[0].output is None
    code, steps = _checked(rec)
    assert code == 1
    (found,) = steps[0]
    assert (found["class"], found["check"], found["severity"]) == ("tree-mask", "mask-length", "defect")
    first = 19 if packed else 150
    assert found["location"]["request"] == 0 and found["location"]["field"] == f"plan.{name}[{first}]"
    read_past = "6 byte(s)" if packed else "50 element(s)"
    assert f"request 0's 10 x 20" in found["evidence"] and f"reads {read_past} past the end" in found["evidence"]
    assert "compared:" in found["evidence"] and "#3176" in found["cause"]


def test_a_mask_longer_than_its_blocks_is_judged_on_its_size_alone(tmp_path: Path) -> None:
    """A (10, 25) mask: plan() reads the first 200 elements as request 0's block, rows misplaced;
    with the tree unknown nothing is compared with it, so one finding and no mismatch."""
    rec = _imported(tmp_path, lambda w: fi_dumps.write_mask_shape(w, columns=25))
    code, steps = _checked(rec)
    assert code == 1
    assert [(f["check"], f["location"]["field"]) for f in steps[0]] == [("mask-length", "plan.custom_mask[200]")]
    assert "laid out for other lengths" in steps[0][0]["cause"]


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_the_right_mask_checks_clean(tmp_path: Path, packed: bool) -> None:
    rec = _imported(tmp_path, lambda w: fi_dumps.write_mask_shape(w, columns=20, packed=packed))
    (step,) = [io.load(p) for p in io.trace_paths(rec)]
    assert step.spec.parents[0].tolist() == list(fi_dumps.MASK_TREE) and step.tensors[0].output is not None
    code, steps = _checked(rec)
    assert code == 0 and steps == [[]]


def test_one_bad_plan_among_good_ones_imports_them_all(tmp_path: Path) -> None:
    """A decode, the wrong mask, a causal prefill: three steps; only the wrong mask's is judged."""
    rec = _imported(tmp_path, lambda w: fi_dumps.write_decode(w, layers=1), lambda w: fi_dumps.write_mask_shape(w, columns=15), fi_dumps.write_paged_extend)
    assert [io.load(p).batch.forward_mode.value for p in io.trace_paths(rec)] == ["DECODE", "TARGET_VERIFY", "EXTEND"]
    code, steps = _checked(rec)
    assert code == 1
    assert steps[0] == [] and steps[2] == []
    assert [f["check"] for f in steps[1]] == ["mask-length"]
