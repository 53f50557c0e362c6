"""FlashInfer's JIT modules: building many of them at once, up front, and watching which a run loads.

FlashInfer compiles each kernel module the first time a call needs it (7-60 s each on an H100,
minutes for SM90 prefill at head_dim 256), one after another as a step reaches them, each with its
own ninja. A recording of a server's mix needs dozens (dtype x head dims x window x soft-cap x decode
/ FA2 prefill and its per-stride paged module / SM90 prefill / MLA / cascade / quantization).

The adapters name the modules a step needs without running it (`Backend.jit_specs`, through
backends/flashinfer_modules.py); `unbuilt` writes the build file of each one not on disk, and `build`
compiles them together, each module's ninja in its own build directory as FlashInfer runs it (so
FlashInfer finds them up to date at the first load), several at a time on every core, in whatever
process gathered them (attndbg/checks/precompile.py).

`watching_modules` checks a declaration against a real run (the GPU test, bench/flashinfer_module_names.py
--watch): within it, a module that is not on disk is noted and its load fails with `ModuleNotBuilt`
before any of its kernels runs; built ones load as usual and are noted as used.

flashinfer is imported only inside these functions: this module imports on a machine without it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attndbg import machine


class ModuleNotBuilt(RuntimeError):
    """A FlashInfer module a call needs is not compiled yet; it was noted instead of built."""


def available() -> bool:
    return machine.module_available("flashinfer")


@dataclass
class ModuleWatch:
    """The modules code loaded (`used`) and those it needed but found unbuilt (`unbuilt`, name -> spec)."""

    used: set[str] = field(default_factory=set)
    unbuilt: dict[str, Any] = field(default_factory=dict)


@contextmanager
def watching_modules() -> Iterator[ModuleWatch]:
    """Within the block, a FlashInfer module that is not compiled is noted and its load fails with
    `ModuleNotBuilt` (raised before any of its kernels could run); compiled ones load as usual and
    are noted as used. Without flashinfer, nothing is watched."""
    watch = ModuleWatch()
    if not available():
        yield watch
        return
    from flashinfer.jit import core

    original = core.JitSpecNvcc.build_and_load

    def build_and_load(spec):  # noqa: ANN001, ANN202 - FlashInfer's JitSpecNvcc
        watch.used.add(spec.name)
        if not spec.is_compiled:
            watch.unbuilt.setdefault(spec.name, spec)
            raise ModuleNotBuilt(f"FlashInfer module {spec.name} is not compiled yet (noted, to be built up front)")
        return original(spec)

    core.JitSpecNvcc.build_and_load = build_and_load
    try:
        yield watch
    finally:
        core.JitSpecNvcc.build_and_load = original


@dataclass(frozen=True)
class Unbuilt:
    """A module not on disk, as the build needs it: plain paths (FlashInfer's JitSpec holds
    callables and does not pickle)."""

    name: str
    ninja_file: str  # the module's build.ninja, written by `unbuilt`
    jit_dir: str  # FlashInfer's JIT directory, where its library appears as NAME/NAME.so

    @property
    def library(self) -> Path:
        return _library(Path(self.jit_dir), self.name)


def _library(jit_dir: Path, name: str) -> Path:
    """Where FlashInfer's JIT build puts a module's library (JitSpecNvcc.jit_library_path)."""
    return jit_dir / name / f"{name}.so"


def unbuilt(specs: list[Any]) -> list[Unbuilt]:
    """The FlashInfer specs (JitSpec) whose library is not on disk (its JIT directory, or its AOT
    one), once each, by name, with each one's build file written (under FlashInfer's lock for that
    module, as flashinfer.jit.build_jit_specs does), for `build`."""
    from filelock import FileLock
    from flashinfer.jit import env

    out: dict[str, Unbuilt] = {}
    for spec in specs:
        if spec.name in out or spec.is_compiled:
            continue
        with FileLock(spec.lock_path, thread_local=False):
            spec.write_ninja()
        out[spec.name] = Unbuilt(spec.name, str(spec.ninja_path), str(env.FLASHINFER_JIT_DIR))
    return [out[name] for name in sorted(out)]


def _objects(ninja_file: str) -> int:
    """How many compile steps a module's build file has (its `build` lines but the library's link):
    the share of the jobs its ninja gets."""
    try:
        lines = Path(ninja_file).read_text().splitlines()
    except OSError:
        return 1
    return max(1, sum(1 for line in lines if line.startswith("build ")) - 1)


def _module_lock(module: Unbuilt) -> Any:
    """FlashInfer's lock for one module (JitSpec.lock_path: JIT_DIR/tmp/NAME.lock), which its
    build_and_load holds while it builds: a check worker loading the module waits for this build
    instead of starting its own. Without `filelock` (a FlashInfer dependency), no lock."""
    try:
        from filelock import FileLock
    except ImportError:
        return contextlib.nullcontext()
    tmp = Path(module.jit_dir) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return FileLock(tmp / f"{module.name}.lock", thread_local=False)


def build(modules: list[Unbuilt], on_built: Callable[[str, float], None] = lambda name, seconds: None, jobs: int | None = None) -> None:
    """Compile `modules` at once: each with its own ninja, run in the module's own build directory
    exactly as FlashInfer's build_and_load runs it, several modules at a time, the biggest first,
    sharing `jobs` compile jobs (default: MAX_JOBS, else every core) by each module's number of
    compile steps. `on_built(name, seconds)` is called as each module's ninja finishes. Runs ninja
    itself, without importing flashinfer (the caller may be a process that must not start CUDA);
    holds FlashInfer's lock for each module while it builds. RuntimeError with ninja's last lines
    when a module fails (the others are still built).

    Why not one ninja over every module's build file (`subninja`, as flashinfer.jit.build_jit_specs
    does): ninja keeps its log in the directory it runs in, and the log is how the module's own ninja,
    which FlashInfer runs at the first load, knows an object is up to date. An output with no entry
    in that log is rebuilt ("command line not found in log"), so every module built by one combined
    ninja was compiled a second time, silently (FlashInfer prints "Building JIT module" only when the
    library is missing), by the first check that loaded it: on an H100 in session 10, 41 modules took
    818 s up front and the check's workers then rebuilt them all. FlashInfer's own build_jit_specs,
    in the 0.7.2 we run, has the same shape; upstream it now runs one ninja per module too
    (flashinfer-ai/flashinfer#2339)."""
    if not modules:
        return
    jobs = jobs or int(os.environ.get("MAX_JOBS", "0") or 0) or os.cpu_count() or 1
    start = time.monotonic()
    need = {m.name: min(jobs, _objects(m.ninja_file)) for m in modules}
    pending = sorted(modules, key=lambda m: (-need[m.name], m.name))
    free = jobs
    turn = threading.Condition()
    failed: list[tuple[Unbuilt, subprocess.CompletedProcess]] = []

    def run(module: Unbuilt) -> None:
        nonlocal free
        done: subprocess.CompletedProcess | None = None
        try:
            with _module_lock(module):
                build_dir = str(Path(module.ninja_file).parent)
                done = subprocess.run(["ninja", "-C", build_dir, "-f", module.ninja_file, "-j", str(need[module.name])], capture_output=True, text=True)
        finally:
            with turn:
                free += need[module.name]
                if done is not None and done.returncode == 0:
                    on_built(module.name, time.monotonic() - start)
                elif done is not None:
                    failed.append((module, done))
                turn.notify_all()

    threads: list[threading.Thread] = []
    with turn:
        while pending:
            module = next((m for m in pending if need[m.name] <= free), None)
            if module is None:
                turn.wait()
                continue
            pending.remove(module)
            free -= need[module.name]
            thread = threading.Thread(target=run, args=(module,), name=f"flashinfer-build-{module.name[:40]}", daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    if failed:
        module, done = failed[0]
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        names = ", ".join(m.name for m, _ in failed)
        raise RuntimeError(f"ninja failed (exit {done.returncode}) building {len(failed)} FlashInfer modules: {names}\n{tail}")
