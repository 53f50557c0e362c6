"""FlashInfer's JIT modules: which ones a step loads, and building many of them at once, up front.

FlashInfer compiles each kernel module the first time a call needs it (7-60 s each on an H100,
minutes for SM90 prefill at head_dim 256), one after another as a step reaches them, each with its
own ninja. A recording of a server's mix needs dozens (dtype x head dims x window x soft-cap x decode
/ FA2 prefill and its per-stride paged module / SM90 prefill / MLA / cascade / quantization).

Which modules a call needs is FlashInfer's own decision (backend "auto", the FA2 primary module and
the paged-stride module it loads lazily, tensor-core decode through the prefill module, ...). Rather
than restate it, `watching_modules` runs code with `JitSpecNvcc.build_and_load` answering
`ModuleNotBuilt` for any module that is not on disk: the call fails before any kernel of that module
runs, and the module's spec is noted; `build_files` writes each noted module's build file. `build`
then compiles them together, as `flashinfer.jit.build_jit_specs` does (one ninja over every source of
every module, on every core), in whatever process gathered them (check's parent, which never starts
CUDA). A failed call hides the modules it would have loaded after the missing one, so callers repeat
until nothing new is noted (attndbg/checks/precompile.py).

flashinfer is imported only inside these functions: this module imports on a machine without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# How often `build` looks for finished modules to report.
POLL_S = 1.0
# What attndbg remembers, in FlashInfer's own JIT directory (per version and GPU arch, so it goes
# when that cache is cleared): the modules each kernel shape of a recording loaded.
MEMO_FILE = "attndbg_modules_by_shape.json"


class ModuleNotBuilt(RuntimeError):
    """A FlashInfer module a call needs is not compiled yet; it was noted instead of built."""


def available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


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
    """A module a look found missing, as the build needs it: plain paths, so a check worker can hand
    it to its parent (FlashInfer's JitSpec holds callables and does not pickle)."""

    name: str
    ninja_file: str  # the module's build.ninja, written by the worker that noted it
    jit_dir: str  # FlashInfer's JIT directory, where its library appears as NAME/NAME.so

    @property
    def library(self) -> Path:
        return _library(Path(self.jit_dir), self.name)


def _library(jit_dir: Path, name: str) -> Path:
    """Where FlashInfer's JIT build puts a module's library (JitSpecNvcc.jit_library_path)."""
    return jit_dir / name / f"{name}.so"


def build_files(watch: ModuleWatch) -> list[Unbuilt]:
    """Write the build file of each module `watch` noted (under FlashInfer's lock for that module,
    as flashinfer.jit.build_jit_specs does), for a build elsewhere."""
    from filelock import FileLock
    from flashinfer.jit import env

    out = []
    for name, spec in sorted(watch.unbuilt.items()):
        with FileLock(spec.lock_path, thread_local=False):
            spec.write_ninja()
        out.append(Unbuilt(name, str(spec.ninja_path), str(env.FLASHINFER_JIT_DIR)))
    return out


def compiled(names: set[str] | list[str]) -> bool:
    """Whether every named module is on disk (FlashInfer's JIT directory, or its AOT one)."""
    from flashinfer.jit import env

    return all(_library(env.FLASHINFER_JIT_DIR, name).exists() or env.get_aot_path(name).exists() for name in names)


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


def _memo_path() -> Path:
    from flashinfer.jit import env

    return env.FLASHINFER_JIT_DIR / MEMO_FILE


def read_memo() -> dict[str, list[str]]:
    """Shape key -> the modules a step of that shape loaded, as remembered from earlier checks."""
    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, list) and all(isinstance(n, str) for n in v)}


def remember(learnt: dict[str, list[str]]) -> None:
    """Add `learnt` to the memo (written whole, through a rename, so readers never see half of it)."""
    if not learnt:
        return
    path = _memo_path()
    memo = {**read_memo(), **learnt}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
    os.replace(tmp, path)
