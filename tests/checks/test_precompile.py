"""check's compile phase (checks/precompile.py): which steps it reads, what it does
where nothing can be compiled, and one build with progress. What each adapter declares:
tests/backends/test_flashinfer_modules.py; declared modules built, then loaded by a check without a
build: tests/gpu/test_precompile.py."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from attndbg.backends import flashinfer_jit
from attndbg.checks import precompile as phase
from attndbg.checks.precompile import precompile, scanned
from attndbg.checks.selection import parse_only
from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io
from tests.cli.helpers import one_line_not_run
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")


def _save(directory: Path, traces) -> list[Path]:
    paths = []
    for i, trace in enumerate(traces):
        path = directory / f"step_{i:03d}.pt"
        io.save(trace, path)
        paths.append(path)
    return paths


def test_every_step_is_read_up_to_the_scan_then_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [Path(f"step_{i:03d}.pt") for i in range(10)]
    assert scanned(paths) == paths
    monkeypatch.setattr(phase, "SHAPE_SCAN", 4)
    assert [p.name for p in scanned(paths)] == ["step_000.pt", "step_003.pt", "step_006.pt", "step_009.pt"]


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
    one_line_not_run(CliRunner().invoke(main, ["compile", str(tmp_path)]), "compile: nothing compiled: no CUDA GPU here")


def _module(jit: Path, name: str, command: str) -> flashinfer_jit.Unbuilt:
    """A module's build file as FlashInfer writes one (rules and the library as NAME/NAME.so), with
    a shell command standing in for nvcc: what `build` drives is ninja, not the compiler."""
    build = jit / name
    build.mkdir(parents=True)
    rule = f"rule make_{name}\n  command = {command}\n"
    (build / "build.ninja").write_text(f"{rule}build {build}/{name}.so: make_{name}\n")
    return flashinfer_jit.Unbuilt(name, str(build / "build.ninja"), str(jit))


def _module_ninja_has_work(module: flashinfer_jit.Unbuilt) -> str:
    """What the module's own ninja would do, run as FlashInfer's build_and_load runs it at the first
    load (in the module's build directory): ninja's dry run."""
    build_dir = str(Path(module.ninja_file).parent)
    return subprocess.run(["ninja", "-C", build_dir, "-f", module.ninja_file, "-n"], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_modules_are_built_so_that_flashinfers_own_ninja_finds_them_up_to_date(tmp_path: Path) -> None:
    """Seen on an H100: modules once built by one combined ninja (run in the JIT directory) were all
    rebuilt by the check's first load, since ninja's log lived in the wrong directory. Each module's
    own ninja must now find nothing to do, and a module with several objects gets that many jobs."""
    jit = tmp_path / "cached_ops"
    modules = [_module(jit, f"m{i}", f"sleep 0.{i} && touch $out") for i in range(3)]
    big = jit / "big"
    big.mkdir(parents=True)
    objects = "".join(f"build {big}/o{k}.o: cc\n" for k in range(4))
    (big / "build.ninja").write_text(f"rule cc\n  command = touch $out\nrule link\n  command = touch $out\n{objects}build {big}/big.so: link {' '.join(f'{big}/o{k}.o' for k in range(4))}\n")
    modules.append(flashinfer_jit.Unbuilt("big", str(big / "build.ninja"), str(jit)))
    assert flashinfer_jit._objects(str(big / "build.ninja")) == 4
    seen: list[str] = []
    flashinfer_jit.build(modules, lambda name, seconds: seen.append(name), jobs=3)
    assert sorted(seen) == ["big", "m0", "m1", "m2"] and all(m.library.exists() for m in modules)
    for module in modules:
        assert "no work to do" in _module_ninja_has_work(module), module.name
    broken = [_module(jit, "bad", "echo nvcc said no >&2 && false"), _module(jit, "good", "touch $out")]
    with pytest.raises(RuntimeError, match=r"ninja failed \(exit 1\) building 1 FlashInfer modules: bad\n(.|\n)*nvcc said no"):
        flashinfer_jit.build(broken, jobs=1)
    assert broken[1].library.exists()  # one module's failure does not stop the others


def _logged_module(jit: Path, name: str, steps: int, log: Path) -> flashinfer_jit.Unbuilt:
    """A module of `steps` compile steps and a link, each step logging "NAME start|end TIME"."""
    build = jit / name
    build.mkdir(parents=True)
    step = f'echo "{name} start $$(date +%s.%N)" >> {log} && sleep 1 && echo "{name} end $$(date +%s.%N)" >> {log} && touch $out'
    objects = [f"{build}/o{i}.o" for i in range(steps)]
    text = f"rule step\n  command = {step}\nrule link\n  command = touch $out\n" + "".join(f"build {o}: step\n" for o in objects)
    (build / "build.ninja").write_text(text + f"build {build}/{name}.so: link {' '.join(objects)}\n")
    return flashinfer_jit.Unbuilt(name, str(build / "build.ninja"), str(jit))


def _times(log: Path, name: str, what: str) -> list[float]:
    return [float(t) for n, w, t in (line.split() for line in log.read_text().splitlines()) if (n, w) == (name, what)]


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_a_module_starts_while_another_builds_and_one_locked_elsewhere_waits_for_its_lock(tmp_path: Path) -> None:
    """Modules build side by side when the steps running leave room (a two-step module and a
    one-step one on 4 jobs overlap), and a module whose FlashInfer lock another process holds (a
    check worker building it) is built only once the lock is released."""
    import threading

    from filelock import FileLock

    jit, log = tmp_path / "cached_ops", tmp_path / "steps.log"
    big, small = _logged_module(jit, "big", 2, log), _logged_module(jit, "small", 1, log)
    flashinfer_jit.build([big, small], jobs=4)
    assert min(_times(log, "small", "start")) < max(_times(log, "big", "end"))
    locked = _logged_module(jit, "locked", 1, log)
    held = FileLock(jit / "tmp" / "locked.lock", thread_local=False)
    held.acquire()
    released: list[float] = []
    timer = threading.Timer(0.6, lambda: (released.append(time.time()), held.release()))
    timer.start()
    flashinfer_jit.build([locked], jobs=2)
    timer.join()
    assert locked.library.exists() and _times(log, "locked", "start")[0] >= released[0]


# Interrupted in a process of its own: Ctrl-C reaches a process's main thread, which under a test
# runner's workers (pytest-xdist) is not the thread running the test.
_INTERRUPTED_BUILD = """
import _thread, signal, sys, threading
from attndbg.backends import flashinfer_jit
# interrupt_main() raises KeyboardInterrupt only where SIGINT has Python's handler: a process started
# in the background by a non-interactive shell inherits SIGINT ignored, and Python then installs none.
signal.signal(signal.SIGINT, signal.default_int_handler)
threading.Timer(0.8, _thread.interrupt_main).start()
try:
    flashinfer_jit.build([flashinfer_jit.Unbuilt("slow", sys.argv[1], sys.argv[2])], jobs=2)
except KeyboardInterrupt:
    sys.exit(7)
"""


@pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("pgrep") is None, reason="ninja or pgrep is not installed")
def test_an_interrupted_build_leaves_no_step_compiling(tmp_path: Path) -> None:
    """A ninja left running would go on writing into a module's directory, where the next build (or
    FlashInfer's own, at the first load) then runs a second ninja beside it."""
    import sys

    build = tmp_path / "cached_ops" / "slow"
    build.mkdir(parents=True)
    (build / "build.ninja").write_text(f"rule s\n  command = sleep 31.25 && touch $out\nbuild {build}/a.o: s\nbuild {build}/slow.so: s {build}/a.o\n")
    # The timeout only bounds the child: an uninterrupted build ends on its own after 62.5 s with
    # exit 0, which the returncode assertion rejects (a 60 s timeout hid that as a timeout).
    interrupted = subprocess.run([sys.executable, "-c", _INTERRUPTED_BUILD, str(build / "build.ninja"), str(tmp_path / "cached_ops")], capture_output=True, text=True, timeout=180)
    assert interrupted.returncode == 7, interrupted.stderr[-2000:]  # the build raised KeyboardInterrupt, after 0.8 s, not 31
    time.sleep(0.3)
    assert subprocess.run(["pgrep", "-f", "sleep 31.25"], capture_output=True).returncode == 1  # none left


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_the_phase_builds_what_is_not_on_disk_once_with_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared modules (here stand-ins for FlashInfer's build files) are built at once; a
    second run finds them on disk and has nothing to do."""
    jit = tmp_path / "cached_ops"
    modules = [_module(jit, f"m{i}", "touch $out") for i in range(2)]
    monkeypatch.setattr(flashinfer_jit, "available", lambda: True)
    monkeypatch.setattr(phase, "declared", lambda paths, only, options, at: {m.name: m for m in modules})
    monkeypatch.setattr(flashinfer_jit, "unbuilt", lambda specs: [m for m in specs if not m.library.exists()])
    monkeypatch.setattr(flashinfer_jit, "prebuilt_hint", lambda: "FlashInfer loads the modules its prebuilt package holds ...")
    said: list[str] = []
    done = precompile([tmp_path / "step_000.pt"], parse_only(None), CheckOptions(), say=said.append)
    assert done is not None and (done.modules, done.needed, done.problem) == (2, 2, None)
    assert said[0].startswith("attndbg: compile phase: 2 FlashInfer modules named by the steps' kernels, 2 not on disk")
    assert said[1] == "attndbg: FlashInfer loads the modules its prebuilt package holds ..."  # before the wait, not after it
    assert sorted(line.split(": ")[-1] for line in said if "compiled " in line and "/2" in line) == ["m0", "m1"]
    assert precompile([tmp_path / "step_000.pt"], parse_only(None), CheckOptions(), say=said.append) is None


def test_compile_refuses_an_unknown_detector_in_one_line(tmp_path: Path) -> None:
    _save(tmp_path, [make_trace("decode-mha", "kv_lens=3,2", *SMALL, plan=True)])
    result = CliRunner().invoke(main, ["compile", str(tmp_path), "--only", "invariants,nosuch"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --only: unknown detector 'nosuch'; detectors: invariants, fill-value, tree-mask, split-merge, kernels, batch-invariance, exposure"
    ]


def test_the_prebuilt_package_named_is_the_one_flashinfer_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer takes flashinfer-jit-cache only at its own version plus the CUDA suffix
    (flashinfer/jit/env.py), from the index of that CUDA version; nothing is said where the package
    is installed already, or where the versions are unknown (a CPU torch, a FlashInfer without its
    build metadata)."""
    installed: set[str] = set()
    monkeypatch.setattr(flashinfer_jit.machine, "module_available", lambda name: name in installed)
    assert flashinfer_jit.prebuilt_hint("0.7.2.post1", "13.0") == (
        "FlashInfer loads the modules its prebuilt package holds instead of compiling them: "
        'pip install "flashinfer-jit-cache==0.7.2.post1+cu130" --index-url https://flashinfer.ai/whl/cu130'
    )
    assert "flashinfer-jit-cache==0.6.1+cu129" in (flashinfer_jit.prebuilt_hint("0.6.1", "12.9.1") or "")
    assert flashinfer_jit.prebuilt_hint("0.7.2.post1", None) is None
    assert flashinfer_jit.prebuilt_hint("0.0.0+unknown", "13.0") is None
    installed.add("flashinfer_jit_cache")
    assert flashinfer_jit.prebuilt_hint("0.7.2.post1", "13.0") is None


def _cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: int) -> list[str]:
    """A GPU machine whose FlashInfer cache lacks `missing` of the 3 modules the shapes declare; the
    build is a stand-in that writes the libraries it is asked for and records their names."""
    built: list[str] = []
    modules = [SimpleNamespace(name=f"m{i}", library=tmp_path / f"m{i}.so") for i in range(3)]
    for m in modules[missing:]:
        m.library.touch()  # on disk already

    def build(wanted, on_built):  # noqa: ANN001, ANN202 - flashinfer_jit.build's signature
        for m in wanted:
            m.library.touch()
            built.append(m.name)

    monkeypatch.setattr(phase.machine, "cuda_available", lambda: True)
    monkeypatch.setattr(flashinfer_jit, "available", lambda: True)
    monkeypatch.setattr(flashinfer_jit, "prebuilt_hint", lambda: None)
    monkeypatch.setattr(phase, "declared", lambda paths, only, options, at: {m.name: m for m in modules})
    monkeypatch.setattr(flashinfer_jit, "unbuilt", lambda specs: [m for m in specs if not m.library.exists()])
    monkeypatch.setattr(flashinfer_jit, "build", build)
    return built


@pytest.mark.parametrize(("asked", "missing", "compiles"), [(None, 2, True), (None, 1, False), (None, 0, False), (True, 1, True), (False, 3, False)])
def test_check_compiles_first_when_the_cache_lacks_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: bool | None, missing: int, compiles: bool) -> None:
    """Decided from what the cache holds: 2 or more modules missing (several then build at once),
    unless --compile-first or --no-compile-first says."""
    built = _cold(tmp_path, monkeypatch, missing)
    said: list[str] = []
    phase.before_checking([tmp_path / "s.pt"], parse_only(None), CheckOptions(), asked=asked, shapes=[0], say=said.append)
    assert sorted(built) == ([f"m{i}" for i in range(missing)] if compiles else []), (built, said)
    if compiles and asked is None:
        assert said[0] == f"attndbg: FlashInfer's cache lacks {missing} modules that one step of each kernel shape needs: compiling what the recording needs first (--no-compile-first: each on first use instead)"


def test_no_compile_phase_without_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _cold(tmp_path, monkeypatch, 3)
    monkeypatch.setattr(phase.machine, "cuda_available", lambda: False)
    for asked in (None, True):
        assert phase.before_checking([tmp_path / "s.pt"], parse_only(None), CheckOptions(), asked=asked, shapes=[0], say=lambda line: None) is None
    assert built == []
