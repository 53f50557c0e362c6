"""kernels detector: every backend that can run a step runs it against the float64 reference, on
every forward mode, and a failure is a library defect named with its release, the shape and a
repro command.

Clean steps run through our real Triton kernels (interpreted on the CPU) and must stay silent. The
faulty backend (tests/checks/short_prefix_backend.py, registered through ATTNDBG_BACKENDS as a
third party's adapter is) launches the same kernels with extend plans that read each cached prefix
one token short: only its outputs show it, and only on extend and mixed steps, which no detector
compared before. No mock stands in for a kernel.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import FindingClass, Severity
from attndbg.detectors.kernels import detect as kernels
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace import io
from tests.checks.short_prefix_backend import ShortPrefixBackend
from tests.cli.helpers import invoke
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32", "shared_prefix=0")
EXTEND = ("extend-prefix", *SMALL, "prefix_lens=0,9,20", "extend_lens=7,3,12")
MIXED = ("mixed", *SMALL, "prefix_lens=30,0,25,14", "extend_lens=9,6,1,1")
# Every forward mode a backend runs, each the smallest step that still has its structure.
CLEAN = {
    "decode": (("decode-gqa", *SMALL, "kv_lens=5,40,70"), "triton"),
    "extend": (EXTEND, "triton"),
    "mixed": (MIXED, "triton"),
    "extend-window": (("window", *SMALL, "prefix_lens=40,10", "extend_lens=12,20", "window=15"), "triton"),
    "verify-tree": (("verify", *SMALL, "prefix_lens=20,45"), "triton"),
    "selective": (("selective", *SMALL, "kv_lens=24,50", "select=3"), "triton"),
    "mla-decode": (("mla-decode", "heads=2", "kv_lens=1,40"), "mla"),
}
SHORT_PREFIX = "short_prefix=tests.checks.short_prefix_backend:ShortPrefixBackend"


@pytest.fixture
def short_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", SHORT_PREFIX)


def _context(trace, *backends: str, path: str = "t.pt") -> CheckContext:
    return CheckContext(trace=trace, path=path, options=CheckOptions(backends=backends))


@pytest.mark.parametrize("mode", list(CLEAN))
def test_every_forward_mode_compares_a_kernel_and_a_clean_step_is_silent(mode: str) -> None:
    spec, backend = CLEAN[mode]
    ctx = _context(make_trace(*spec), backend)
    assert kernels.detect(ctx) == []
    assert ctx.backends_consulted() == (backend,)


@pytest.mark.parametrize("spec", [EXTEND, MIXED], ids=["extend", "mixed"])
def test_a_prefix_read_one_short_is_a_library_defect_named_with_its_release_shape_and_repro(short_prefix: None, spec: tuple[str, ...]) -> None:
    trace = make_trace(*spec)
    ctx = _context(trace, "short_prefix", "triton")
    [found] = kernels.detect(ctx)  # triton's own plans are right: silent
    assert (found.kind, found.check, found.severity) == (FindingClass.KERNELS, "kernel-fails-reference", Severity.DEFECT)
    data = found.data
    library = ShortPrefixBackend().library()
    assert (data["backend"], data["library"], data["version"], data["passing"]) == ("short_prefix", library.name, library.version, ["triton"])
    assert data["shape"].startswith(f"{trace.batch.forward_mode.value} bs {trace.batch.batch_size}, 2:1 heads, head_dim 32, page 1")
    assert data["repro"] == "attndbg repro t.pt --backend short_prefix --plan derived --eager -o repro_short_prefix_step0.py && python repro_short_prefix_step0.py"
    # The rows that miss their last cached key: every row of a request with a prefix, none of one
    # without (the extend step's request 0, the mixed step's request 1).
    assert data["failing_rows"] == int(trace.batch.extend_lens[trace.batch.prefix_lens > 0].sum())
    assert found.location.request is not None and int(trace.batch.prefix_lens[found.location.request]) > 0
    assert "the same step passes on triton" in found.evidence
    assert found.cause.startswith(f"A defect of {library} at this shape: triton pass")
    assert ctx.backends_consulted() == ("short_prefix", "triton")


def test_the_repro_command_reproduces_the_defect_standalone_and_not_the_correct_twin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The command a finding gives writes a script that calls only the kernels, with the plan the
    adapter made, and exits 1: it reproduces. The faulty plan builder stands in for the triton
    adapter here (repro scripts the built-in adapters by name); with the real one back, the same
    command's script exits 0."""
    from attndbg.backends import registry

    path = io.save(make_trace(*EXTEND), tmp_path / "step.pt")
    with monkeypatch.context() as faulty:
        faulty.setitem(registry.ADAPTERS, "triton", "tests.checks.short_prefix_backend:ShortPrefixAsTriton")
        [found] = kernels.detect(_context(io.load(path), "triton", path=str(path)))
        assert found.check == "kernel-fails-reference" and "no other backend ran this step" in found.evidence
        make, run = found.data["repro"].split(" && ")
        assert make == f"attndbg repro {path} --backend triton --plan derived --eager -o repro_triton_step0.py" and run == "python repro_triton_step0.py"
        assert _script_exit(make, tmp_path / "faulty.py") == 1
    assert _script_exit(make, tmp_path / "correct.py") == 0


def _script_exit(command: str, script: Path) -> int:
    """Run `command` (attndbg repro ... -o X) writing `script` instead of X, then the script."""
    words = shlex.split(command)
    result = invoke(*words[1:-2], "-o", str(script))
    assert result.exit_code == 0, result.output
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.returncode


def test_a_known_defect_is_run_by_a_check_and_its_prediction_confirmed_or_contradicted(short_prefix: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's declared library defect at a shape is a prediction: replay refuses the step with
    it, a check runs it and says whether the run confirms it (the defect's finding says it was
    predicted) or contradicts it (a hazard: the declaration is wider than the defect)."""
    from attndbg.backends.triton import TritonBackend

    declared = "known short_prefix defect at this shape (measured)"
    monkeypatch.setattr(ShortPrefixBackend, "known_defect", lambda self, trace: declared)
    monkeypatch.setattr(TritonBackend, "known_defect", lambda self, trace: declared if type(self) is TritonBackend else None)
    trace = make_trace(*EXTEND)
    [refused] = replay(trace, "t.pt", ["short_prefix"]).runs
    assert refused.status is RunStatus.UNSUPPORTED and refused.reason == declared
    confirmed, contradicted = kernels.detect(_context(trace, "short_prefix", "triton"))
    assert (confirmed.check, confirmed.data["predicted"]) == ("kernel-fails-reference", declared)
    assert confirmed.cause.endswith(f"Predicted: {declared}.")
    assert (contradicted.check, contradicted.severity, contradicted.data["backend"]) == ("known-defect-not-reproduced", Severity.HAZARD, "triton")


def test_check_compares_a_kernel_on_extend_and_mixed_steps(tmp_path: Path) -> None:
    """The verdict's "no kernel compared on ... (EXTEND, MIXED)" is gone: both steps are compared,
    and the JSON's not_compared_by_mode is empty."""
    folder = tmp_path / "steps"
    folder.mkdir()
    for i, spec in enumerate((EXTEND, MIXED)):
        io.save(make_trace(*spec), folder / f"step_{i}.pt")
    report = tmp_path / "check.json"
    result = invoke("check", str(folder), "--backend", "triton", "--only", "invariants,kernels", "--json", str(report))
    assert result.exit_code == 0, result.output
    verdict = json.loads(report.read_text())["verdict"]
    assert verdict["compared"] == {"triton": 2} and verdict["not_compared_by_mode"] == {}
    assert "no kernel compared" not in result.output


def test_under_cuda_graph_a_decode_step_is_also_replayed_padded_and_judged_beside_its_eager_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cuda-graph: each backend's graph replay of a decode step (on a CPU the padded sequence runs
    eagerly on the graph's static buffers) is compared too; a plan builder wrong in the batch
    (tests/checks/neighbour_row_backend.py) fails eagerly and padded, and its finding says both."""
    monkeypatch.setenv("ATTNDBG_BACKENDS", "neighbour_row=tests.checks.neighbour_row_backend:NeighbourRowBackend")
    trace = make_trace("decode-gqa", *SMALL, "kv_lens=90,40,20")
    ctx = CheckContext(trace=trace, path="t.pt", options=CheckOptions(backends=("neighbour_row", "triton"), cuda_graph=True))
    runs = kernels.kernel_runs(ctx)
    assert [r.variant.label for r in runs["triton"]] == ["eager", "graph bs=4 fill=1"]
    [found] = kernels.detect(ctx)
    assert (found.check, found.data["backend"], found.data["graph"]) == ("kernel-fails-reference", "neighbour_row", "failed")
    assert "its graph bs=4 fill=1 replay fails too (1 row)" in found.evidence and found.location.request == 2
