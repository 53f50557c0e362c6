"""FlashInfer's JIT modules: building many of them at once, up front, and watching which a run loads.

FlashInfer compiles each kernel module the first time a call needs it (7-60 s each on an H100,
minutes for SM90 prefill at head_dim 256), one after another as a step reaches them, each with its
own ninja. A recording of a server's mix needs dozens (dtype x head dims x window x soft-cap x decode
/ FA2 prefill and its per-stride paged module / SM90 prefill / MLA / cascade / quantization).

The adapters name the modules a step needs without running it (`Backend.jit_specs`, through
backends/flashinfer_modules.py); `unbuilt` writes the build file of each one not on disk, and `build`
compiles them together, as `flashinfer.jit.build_jit_specs` does (one ninja over every source of
every module, on every core), in whatever process gathered them (attndbg/checks/precompile.py).

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

# How often `build` looks for finished modules to report.
POLL_S = 1.0


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


def build(modules: list[Unbuilt], on_built: Callable[[str, float], None] = lambda name, seconds: None, jobs: int | None = None) -> None:
    """Compile `modules` at once: one ninja over all their sources (`subninja` of each module's own
    build file, as flashinfer.jit.build_jit_specs does), `jobs` at a time (default: MAX_JOBS, else
    every core). `on_built(name, seconds)` is called, from a watcher thread, as each module's library
    appears. Runs ninja itself, without importing flashinfer (the caller may be a process that must
    not start CUDA); takes FlashInfer's build lock when `filelock` (a FlashInfer dependency) is there.
    RuntimeError with ninja's last lines when the build fails."""
    if not modules:
        return
    jit_dir = Path(modules[0].jit_dir)
    tmp = jit_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    ninja_file = tmp / f"attndbg_compile_{os.getpid()}.ninja"
    ninja_file.write_text("\n".join(["ninja_required_version = 1.3", *(f"subninja {m.ninja_file}" for m in modules), ""]))
    jobs = jobs or int(os.environ.get("MAX_JOBS", "0") or 0) or os.cpu_count() or 1
    start = time.monotonic()
    pending = {m.name: m for m in modules if not m.library.exists()}
    stop = threading.Event()

    def watch() -> None:
        while pending and not stop.wait(POLL_S):
            for name in [n for n, m in pending.items() if m.library.exists()]:
                del pending[name]
                on_built(name, time.monotonic() - start)

    try:
        from filelock import FileLock

        lock: Any = FileLock(tmp / "flashinfer_jit.lock", thread_local=False)  # the lock build_jit_specs takes
    except ImportError:
        lock = contextlib.nullcontext()
    watcher = threading.Thread(target=watch, name="flashinfer-build-watch", daemon=True)
    watcher.start()
    try:
        with lock:
            done = subprocess.run(["ninja", "-C", str(jit_dir), "-f", str(ninja_file), "-j", str(jobs)], capture_output=True, text=True)
    finally:
        stop.set()
        watcher.join()
        ninja_file.unlink(missing_ok=True)
    for name, m in list(pending.items()):  # finished between the watcher's last look and the end
        if m.library.exists():
            on_built(name, time.monotonic() - start)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"ninja failed (exit {done.returncode}) building {len(modules)} FlashInfer modules:\n{tail}")
