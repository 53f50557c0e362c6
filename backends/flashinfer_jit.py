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

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attndbg import machine

# How often `build` looks at the steps its ninjas run, to start the next module.
POLL_S = 0.2


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

    @property
    def lock_path(self) -> Path:
        """FlashInfer's lock for this module (JitSpec.lock_path: JIT_DIR/tmp/NAME.lock), which its
        build_and_load holds while it builds."""
        return Path(self.jit_dir) / "tmp" / f"{self.name}.lock"


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
    its ninja's `-j`, and what `build` counts on it running at once."""
    try:
        lines = Path(ninja_file).read_text().splitlines()
    except OSError:
        return 1
    return max(1, sum(1 for line in lines if line.startswith("build ")) - 1)


# FlashInfer's prebuilt modules: one wheel per CUDA version, whose version is FlashInfer's own plus
# the CUDA suffix (flashinfer/jit/env.py checks that they match, and ignores a mismatched one).
PREBUILT_PACKAGE = "flashinfer-jit-cache"
PREBUILT_INDEX = "https://flashinfer.ai/whl/{cuda}"


def prebuilt_hint(flashinfer_version: str | None = None, cuda_version: str | None = None) -> str | None:
    """How to have FlashInfer load prebuilt modules instead of compiling them, for this FlashInfer
    and torch's CUDA (versions read here unless given); None when its prebuilt package is installed
    already (a module it does not hold still compiles), or when the versions are unknown."""
    if machine.module_available(PREBUILT_PACKAGE.replace("-", "_")):
        return None
    if flashinfer_version is None:
        try:
            from flashinfer import __version__ as flashinfer_version
        except ImportError:
            return None
    if cuda_version is None:
        import torch

        cuda_version = torch.version.cuda
    if not cuda_version or not flashinfer_version or flashinfer_version.startswith("0.0.0"):
        return None
    cuda = "cu" + "".join(cuda_version.split(".")[:2])
    return (
        f'FlashInfer loads the modules its prebuilt package holds instead of compiling them: '
        f'pip install "{PREBUILT_PACKAGE}=={flashinfer_version}+{cuda}" --index-url {PREBUILT_INDEX.format(cuda=cuda)}'
    )


def default_jobs() -> int:
    """How many compile steps `build` runs at once unless told: MAX_JOBS (as FlashInfer reads it),
    else every core."""
    return int(os.environ.get("MAX_JOBS", "0") or 0) or os.cpu_count() or 1


def _module_lock(module: Unbuilt) -> Any:
    """FlashInfer's lock for the module: a check worker loading it waits for this build instead of
    starting its own, and this build leaves alone a module a worker is building. Without `filelock`
    (a FlashInfer dependency), None."""
    try:
        from filelock import FileLock
    except ImportError:
        return None
    module.lock_path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(module.lock_path, thread_local=False)


def _steps_running(ninjas: set[int]) -> int | None:
    """How many build steps the ninja processes `ninjas` are running now: their child processes (ninja
    runs each step as one). None where /proc cannot tell (not Linux)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    count = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rfind(")") + 2 :].split()  # after "PID (COMM) ": COMM may hold spaces and parentheses
        if len(fields) > 1 and int(fields[1]) in ninjas:
            count += 1
    return count


@dataclass
class _Building:
    module: Unbuilt
    ninja: subprocess.Popen
    log: Any  # the ninja's output, a temporary file
    lock: Any

    def end(self) -> None:
        """Release the module's lock and drop the output (read it first if it is wanted)."""
        if self.lock is not None:
            self.lock.release()
        self.log.close()


def build(modules: list[Unbuilt], on_built: Callable[[str, float], None] = lambda name, seconds: None, jobs: int | None = None) -> None:
    """Compile `modules` at once, on `jobs` cores (default: MAX_JOBS, else every core): each with its
    own ninja, run in the module's own build directory exactly as FlashInfer's build_and_load runs it
    (`-j` its number of compile steps), the biggest first, and the next module starts whenever the
    steps running leave room for half of its own. `on_built(name, seconds)` is called as each
    module's ninja finishes. Runs ninja itself, without importing flashinfer (the caller may be a
    process that must not start CUDA); holds FlashInfer's lock for each module while it builds, and
    skips for now one that another process holds. RuntimeError with ninja's last lines when a module
    fails (the others are still built).

    Why not one ninja over every module's build file (`subninja`, as flashinfer.jit.build_jit_specs
    does): ninja keeps its log and its record of header dependencies in the directory it runs in,
    and those are how the module's own ninja, which FlashInfer runs at the first load, knows an object
    is up to date. An output with no entry there is rebuilt ("command line not found in log"), so
    every module built by one combined ninja was compiled a second time, silently (FlashInfer prints
    "Building JIT module" only when the library is missing), by the first check that loaded it: on an
    H100, 41 modules took 818 s up front and the check's first 100 steps then spent
    825 s unfinished. FlashInfer's own build_jit_specs, in the 0.7.2 we run, has the same shape;
    upstream it now runs one ninja per module too (flashinfer-ai/flashinfer#2339), one at a time.

    Why start modules by the steps running rather than by reserving each module's `-j`: a module's
    compile steps end at different times (an FA3 module's ten take 9 to 94 s), so reserved cores sit idle. On
    the H100, reserving built one ten-step prefill module at a time on 8-10 of 16 cores (34 of 41 modules built
    after two calls of 553 and 550 s); bench/compile_schedule.py replays that build's step times to compare the two."""
    if not modules:
        return
    jobs = jobs or default_jobs()
    start = time.monotonic()
    need = {m.name: min(jobs, _objects(m.ninja_file)) for m in modules}
    pending = sorted(modules, key=lambda m: (-need[m.name], m.name))
    building: list[_Building] = []
    failed: list[tuple[Unbuilt, int, str]] = []
    try:
        while pending or building:
            for b in [b for b in building if b.ninja.poll() is not None]:
                building.remove(b)
                if b.ninja.returncode != 0:
                    b.log.seek(0)
                    failed.append((b.module, b.ninja.returncode, b.log.read().decode(errors="replace")))
                b.end()
                if b.ninja.returncode == 0:
                    on_built(b.module.name, time.monotonic() - start)
            steps = _steps_running({b.ninja.pid for b in building})
            busy = sum(need[b.module.name] for b in building) if steps is None else steps
            for module in [m for m in pending if not building or busy + (need[m.name] + 1) // 2 <= jobs]:
                lock = _module_lock(module)
                if lock is not None:
                    from filelock import Timeout

                    try:
                        lock.acquire(timeout=0)
                    except Timeout:  # another process is building it: try again later
                        continue
                pending.remove(module)
                log = tempfile.TemporaryFile()
                build_dir = str(Path(module.ninja_file).parent)
                ninja = subprocess.Popen(["ninja", "-C", build_dir, "-f", module.ninja_file, "-j", str(need[module.name])], stdout=log, stderr=subprocess.STDOUT)
                building.append(_Building(module, ninja, log, lock))
                break  # look at the steps again once this ninja has started its own
            time.sleep(POLL_S)
    except BaseException:  # interrupted: no ninja is left compiling into a directory another build may take next
        for b in building:
            b.ninja.terminate()  # ninja passes SIGTERM on to its steps (each runs in its own process group)
        for b in building:
            try:
                b.ninja.wait(timeout=30)
            except subprocess.TimeoutExpired:
                b.ninja.kill()
            b.end()
        raise
    if failed:
        module, code, output = failed[0]
        tail = "\n".join(output.strip().splitlines()[-15:])
        names = ", ".join(m.name for m, _, _ in failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        raise RuntimeError(f"ninja failed (exit {code}) building {len(failed)} FlashInfer modules: {names}\n{tail}")
