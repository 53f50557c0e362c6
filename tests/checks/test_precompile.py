"""check's compile phase (checks/precompile.py, issue 24 item 1): which steps it looks at, and what it
does where nothing can be compiled. The discovery itself (FlashInfer's loads watched, modules built
at once) needs FlashInfer on a GPU: tests/gpu/test_precompile.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends import flashinfer_jit
from attndbg.checks.precompile import kernel_shape, precompile, representatives
from attndbg.checks.run import parse_only
from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")


def _save(directory: Path, traces) -> list[Path]:
    paths = []
    for i, trace in enumerate(traces):
        path = directory / f"step_{i:03d}.pt"
        io.save(trace, path)
        paths.append(path)
    return paths


def test_one_step_per_kernel_shape_the_smallest(tmp_path: Path) -> None:
    steps = [
        make_trace("decode-mha", "kv_lens=30,20,50", *SMALL, plan=True),
        make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True),  # same shape, less work: picked
        make_trace("decode-mha", "kv_lens=9", *SMALL, plan=True),
        make_trace("extend-prefix", "prefix_lens=0,9", "extend_lens=5,3", *SMALL, plan=True),  # another mode
        make_trace("decode-mha", "kv_lens=3,2", "heads=2:1", "head_dim=64", plan=True),  # another head dim
    ]
    paths = _save(tmp_path, steps)
    picked = representatives(paths)
    assert len({kernel_shape(t) for t in steps}) == 3
    assert sorted(p.name for p in picked.values()) == ["step_001.pt", "step_003.pt", "step_004.pt"]


def test_an_unreadable_step_is_left_to_the_check(tmp_path: Path) -> None:
    paths = _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True)])
    bad = tmp_path / "step_999.pt"
    bad.write_bytes(b"not a trace")
    assert list(representatives([bad, *paths]).values()) == paths


@pytest.mark.skipif(flashinfer_jit.available(), reason="FlashInfer is installed here")
def test_nothing_to_compile_without_flashinfer(tmp_path: Path) -> None:
    paths = _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True)])
    said: list[str] = []
    assert precompile(paths, parse_only(None), CheckOptions(), say=said.append) is None
    assert said == []


def test_compile_command_says_nothing_was_compiled_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True)])
    result = CliRunner().invoke(main, ["compile", str(tmp_path)])
    assert result.exit_code == 3, result.output
    assert "nothing compiled: no CUDA GPU here" in result.output


def test_memo_is_written_whole_and_read_defensively(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memo = tmp_path / "jit" / flashinfer_jit.MEMO_FILE
    monkeypatch.setattr(flashinfer_jit, "_memo_path", lambda: memo)
    assert flashinfer_jit.read_memo() == {}
    flashinfer_jit.remember({"shape a": ["m1", "m2"]})
    flashinfer_jit.remember({"shape b": ["m3"]})
    assert flashinfer_jit.read_memo() == {"shape a": ["m1", "m2"], "shape b": ["m3"]}
    assert [p.name for p in memo.parent.iterdir()] == [memo.name]  # no temporary left behind
    memo.write_text(json.dumps({"shape a": "not a list", "shape c": ["m4"]}))
    assert flashinfer_jit.read_memo() == {"shape c": ["m4"]}
    memo.write_text("{ torn")
    assert flashinfer_jit.read_memo() == {}


def test_a_look_comes_back_from_a_check_worker(tmp_path: Path) -> None:
    """The looks run in check workers: their results (a StepResult subclass with what FlashInfer
    loaded) cross the process boundary. Without FlashInfer nothing is watched: an empty look."""
    from attndbg.checks.precompile import LookResult, look_one
    from attndbg.checks.workers import check_in_workers

    paths = _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True), make_trace("extend-prefix", "prefix_lens=0,9", "extend_lens=5,3", *SMALL, plan=True)])
    results = list(check_in_workers(paths, parse_only("invariants"), CheckOptions(), jobs=2, devices=None, check=look_one))
    assert [type(r) for r in results] == [LookResult, LookResult]
    assert [r.report.step for r in results] == [0, 0] and all(r.report.checked for r in results)
    if not flashinfer_jit.available():
        assert all(r.look.used == () and r.look.unbuilt == () for r in results)


def _module(jit: Path, name: str, command: str) -> flashinfer_jit.Unbuilt:
    """A module's build file as FlashInfer writes one (rules and the library as NAME/NAME.so), with
    a shell command standing in for nvcc: what `build` drives is ninja, not the compiler."""
    build = jit / name
    build.mkdir(parents=True)
    rule = f"rule make_{name}\n  command = {command}\n"
    (build / "build.ninja").write_text(f"{rule}build {build}/{name}.so: make_{name}\n")
    return flashinfer_jit.Unbuilt(name, str(build / "build.ninja"), str(jit))


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_modules_are_built_in_one_ninja_with_progress(tmp_path: Path) -> None:
    jit = tmp_path / "cached_ops"
    modules = [_module(jit, f"m{i}", f"sleep 0.{i} && touch $out") for i in range(3)]
    seen: list[str] = []
    flashinfer_jit.build(modules, lambda name, seconds: seen.append(name), jobs=3)
    assert sorted(seen) == ["m0", "m1", "m2"] and all(m.library.exists() for m in modules)
    assert not list((jit / "tmp").glob("*.ninja"))  # the combined build file is not left behind
    broken = [_module(jit, "bad", "echo nvcc said no >&2 && false")]
    with pytest.raises(RuntimeError, match=r"ninja failed \(exit 1\) building 1 FlashInfer modules:(.|\n)*nvcc said no"):
        flashinfer_jit.build(broken, jobs=1)


def test_compile_refuses_an_unknown_detector_in_one_line(tmp_path: Path) -> None:
    _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True)])
    result = CliRunner().invoke(main, ["compile", str(tmp_path), "--only", "invariants,nosuch"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --only: unknown detector 'nosuch'; detectors: invariants, fill-value, tree-mask, split-merge, batch-invariance, exposure"
    ]
