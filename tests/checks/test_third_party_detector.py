"""A detector is one package: a toy one, written here, registered through ATTNDBG_DETECTORS or an
entry point, is run by `check --only`, planted by `synth --inject`, and listed by `check --help` and
`synth --list`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from attndbg.detectors import registry
from tests.cli.helpers import invoke, one_line_error

# The whole toy detector: its Detector, its check and its one injection, as a third party writes them.
TOY_PACKAGE = {
    "__init__.py": '''
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass("toy"),
    summary="a toy: recorded positions are never negative",
    detect="toy_detector.detect:detect",
    injections="toy_detector.injections",
)
''',
    "detect.py": '''
from attndbg.detector_api.findings import FindingClass, finding


def detect(ctx):
    positions = ctx.trace.batch.positions
    return [
        finding(FindingClass("toy"), "negative-position", step=ctx.step, row=t, field=f"batch.positions[{t}]",
                evidence=f"positions[{t}] = {int(positions[t])}", cause="a toy mistake", position=int(positions[t]))
        for t in range(positions.numel()) if int(positions[t]) < 0
    ]
''',
    "injections.py": '''
from dataclasses import replace


def negative_position(trace):
    """The first token's position recorded as -1 (a toy mistake)."""
    positions = trace.batch.positions.clone()
    positions[0] = -1
    return replace(trace, batch=replace(trace.batch, positions=positions))


INJECTIONS = {"toy:negative-position": negative_position}
''',
}


@pytest.fixture
def toy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "toy_detector"
    package.mkdir()
    for name, source in TOY_PACKAGE.items():
        (package / name).write_text(source.lstrip(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in [m for m in sys.modules if m == "toy_detector" or m.startswith("toy_detector.")]:
        monkeypatch.delitem(sys.modules, module)
    return tmp_path


@pytest.fixture(params=["environment", "entry-point"])
def toy(request: pytest.FixtureRequest, toy_package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy registered one way or the other."""
    if request.param == "environment":
        monkeypatch.setenv("ATTNDBG_DETECTORS", "toy=toy_detector:DETECTOR")
    else:
        # An installed distribution's metadata on sys.path, as pip leaves it: importlib.metadata finds
        # it in this process and in check's spawned workers alike (they inherit sys.path).
        info = toy_package / "toy_detector-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-detector\nVersion: 0.0\n", encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\ntoy = toy_detector:DETECTOR\n", encoding="utf-8")


def test_the_toy_is_listed(toy: None) -> None:
    assert registry.names()[-1] == "toy"
    help_text = invoke("check", "--help", columns=200).output
    assert "toy  " in help_text and "a toy: recorded positions are never negative" in help_text
    listing = invoke("synth", "--list", columns=200).output
    assert "toy:negative-position" in listing and "The first token's position recorded as -1 (a toy mistake)." in listing


def test_the_toy_is_injected_and_found(toy: None, tmp_path: Path) -> None:
    clean, bad = tmp_path / "clean.pt", tmp_path / "bad.pt"
    assert invoke("synth", "decode-gqa", "kv_lens=3,20", "-o", str(clean)).exit_code == 0
    result = invoke("synth", "decode-gqa", "kv_lens=3,20", "--inject", "toy:negative-position", "-o", str(bad))
    assert result.exit_code == 0, result.output

    result = invoke("check", str(bad), "--only", "toy", "--json", str(tmp_path / "bad.json"), columns=200)
    assert result.exit_code == 1, result.output
    [step] = json.loads((tmp_path / "bad.json").read_text())["steps"]
    [found] = step["findings"]
    assert (found["class"], found["check"], found["location"], found["data"]) == (
        "toy", "negative-position", {"step": 0, "row": 0, "field": "batch.positions[0]"}, {"position": -1},
    )  # fmt: skip
    assert "detectors: toy;" in result.output

    result = invoke("check", str(clean), "--only", "toy")
    assert result.exit_code == 0, result.output
    assert "0 findings" in result.output


def test_the_toy_runs_beside_the_built_in_detectors(toy: None, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    assert invoke("synth", "decode-gqa", "kv_lens=3,20", "--inject", "toy:negative-position", "-o", str(bad)).exit_code == 0
    result = invoke("check", str(bad), "--only", "invariants,toy", "--json", "-")
    assert result.exit_code == 1, result.output
    classes = {f["class"] for step in json.loads(result.stdout[result.stdout.index("{"):])["steps"] for f in step["findings"]}
    assert "toy" in classes


def test_the_toy_is_found_by_checks_worker_processes(toy: None, tmp_path: Path) -> None:
    """On a GPU machine check runs each step in a spawned worker (a crash boundary): the toy,
    registered either way, must be found there too, not only in the parent process."""
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import parse_only
    from attndbg.detector_api.context import CheckOptions

    bad = tmp_path / "bad.pt"
    assert invoke("synth", "decode-gqa", "kv_lens=3,20", "--inject", "toy:negative-position", "-o", str(bad)).exit_code == 0
    [report] = list(check_steps(str(bad), parse_only("toy"), CheckOptions(backends=("triton",)), isolate=True))
    assert report.checked, report.error
    assert [(f.kind.value, f.check, f.location.field) for f in report.findings] == [("toy", "negative-position", "batch.positions[0]")]


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("bad", "ATTNDBG_DETECTORS: expected KIND=pkg.module:attr, got 'bad'"),
        ("toy=toy_detector", "ATTNDBG_DETECTORS: expected KIND=pkg.module:attr, got 'toy=toy_detector'"),
        ("toy=no_such_module_here.detector:DETECTOR", "detector 'toy' names module 'no_such_module_here.detector', which cannot be found"),
    ],
)
def test_a_malformed_detector_registration_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str, needle: str) -> None:
    monkeypatch.setenv("ATTNDBG_DETECTORS", value)
    one_line_error(invoke("synth", "--list"), needle)


def test_a_registration_that_is_not_a_detector_is_one_line(toy_package: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATTNDBG_DETECTORS", "toy=toy_detector.injections:INJECTIONS")
    one_line_error(invoke("check", str(tmp_path / "any.pt"), "--only", "toy"), "toy_detector.injections:INJECTIONS is a dict, not an attndbg.detectors.base.Detector")
    one_line_error(invoke("synth", "--list"), "is a dict, not an attndbg.detectors.base.Detector")
