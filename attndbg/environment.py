"""`attndbg env` and `--version`: what a bug report needs to know about this machine.

Versions come from the installed distributions' metadata (importlib.metadata), so SGLang, vLLM and
transformers are named without importing them; torch's CUDA build is read from torch/version.py's
text, so `--version` stays instant (no torch import). The GPUs come from attndbg.machine (the one
place that decides what this machine can do); the JIT caches are where Triton and FlashInfer put
them, with their sizes, because a stale or shared cache is a common cause of "works on my machine".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA = "attndbg.env/1"
# (what the report calls it, the distributions that provide it, first installed wins)
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attndbg", ("attndbg",)),
    ("torch", ("torch",)),
    ("triton", ("triton", "pytorch-triton")),
    ("flashinfer", ("flashinfer-python", "flashinfer")),
    ("nvtx", ("nvtx",)),
    ("cupti-python", ("cupti-python",)),  # --timeline's CUPTI (its major version must match the driver's CUDA)
    ("sglang", ("sglang",)),
    ("sgl-kernel", ("sgl-kernel",)),
    ("vllm", ("vllm",)),
    ("transformers", ("transformers",)),
    ("flash-attn", ("flash-attn", "flash_attn")),
    ("numpy", ("numpy",)),
)
# The variables that change what runs or where it is cached (read, never set, here).
VARIABLES = (
    "TRITON_INTERPRET",
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "FLASHINFER_WORKSPACE_BASE",
    "CUDA_VISIBLE_DEVICES",
    "ATTNDBG_BACKENDS",
    "ATTNDBG_DETECTORS",
)
# A cache walk stops after this many files or seconds and says its size is at least what it saw.
CACHE_WALK_FILES = 200_000
CACHE_WALK_SECONDS = 5.0


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: str  # "9.0"
    memory_gib: float


@dataclass(frozen=True)
class Cache:
    name: str  # "triton", "flashinfer"
    path: str
    exists: bool
    bytes: int
    files: int
    complete: bool  # False: the walk stopped early, bytes and files are lower bounds
    source: str  # which variable chose the path, or "default"


@dataclass(frozen=True)
class Environment:
    attndbg: str
    attndbg_path: str  # where it is imported from: a checkout (editable) or site-packages
    python: str
    python_executable: str
    platform: str
    packages: dict[str, str | None]  # name -> version, None when not installed
    torch_cuda: str | None  # the CUDA torch was built with (None: a CPU build)
    cuda_available: bool
    gpus: tuple[Gpu, ...]
    driver: str | None  # the NVIDIA kernel driver, when one is loaded
    caches: tuple[Cache, ...]
    variables: dict[str, str]  # VARIABLES that are set


# Where a package's own files state its version, for a copy importable without metadata.
_VERSION_FILES = ("_build_meta.py", "version.py", "_version.py", "__init__.py")
_VERSION_TEXT = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def package_version(name: str) -> str | None:
    """The installed version of a report name of PACKAGES (or of a distribution), or None when it
    cannot be imported. A package importable without distribution metadata (unpacked onto
    PYTHONPATH, as FlashInfer is on our GPU image) is not "not installed": its version is read from
    its own files without importing it, else it is reported as present with no version."""
    distributions = dict(PACKAGES).get(name, (name,))
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return _version_without_metadata(name.replace("-", "_"))


def _version_without_metadata(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        for file in _VERSION_FILES:
            try:
                found = _VERSION_TEXT.search((Path(folder) / file).read_text(errors="replace"))
            except OSError:
                continue
            if found:
                return f"{found.group(1)} (no package metadata)"
    return "present (no package metadata, version unknown)"


def torch_cuda_build() -> str | None:
    """torch.version.cuda without importing torch: read from torch/version.py's text."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        return match.group(1) if match else None
    return None


def version_line() -> str:
    """`attndbg --version`: attndbg and the versions a report needs first, without torch."""
    torch = package_version("torch")
    cuda = torch_cuda_build()
    torch_text = f"torch {torch} (CUDA {cuda})" if torch and cuda else f"torch {torch} (no CUDA)" if torch else "torch not installed"
    parts = [f"Python {platform.python_version()}", torch_text]
    parts += [f"{name} {package_version(name) or 'not installed'}" for name in ("triton", "flashinfer")]
    return f"attndbg {package_version('attndbg') or 'unknown'} ({', '.join(parts)})"


def _driver() -> str | None:
    """The NVIDIA kernel driver's version: /proc on Linux, else nvidia-smi when on PATH."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8", errors="replace").splitlines()[0]
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", first)
        if match:
            return match.group(1)
    except (OSError, IndexError):
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def _cache_paths(environ: Mapping[str, str]) -> list[tuple[str, Path, str]]:
    """(name, path, which variable chose it) of each JIT cache, as the library computes it:
    Triton: TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache (TRITON_HOME defaults to ~);
    FlashInfer: $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (the base defaults to ~)."""
    home = Path.home()
    if environ.get("TRITON_CACHE_DIR"):
        triton = (Path(environ["TRITON_CACHE_DIR"]), "TRITON_CACHE_DIR")
    elif environ.get("TRITON_HOME"):
        triton = (Path(environ["TRITON_HOME"]) / ".triton" / "cache", "TRITON_HOME")
    else:
        triton = (home / ".triton" / "cache", "default")
    base = environ.get("FLASHINFER_WORKSPACE_BASE")
    flashinfer = (Path(base) if base else home) / ".cache" / "flashinfer"
    return [("triton", *triton), ("flashinfer", flashinfer, "FLASHINFER_WORKSPACE_BASE" if base else "default")]


def _cache(name: str, path: Path, source: str) -> Cache:
    """The cache's size, walked without following links, bounded in files and time."""
    total = files = 0
    complete = True
    deadline = time.monotonic() + CACHE_WALK_SECONDS
    for folder, _, names in os.walk(path):
        for file_name in names:
            try:
                total += os.lstat(os.path.join(folder, file_name)).st_size
            except OSError:
                continue
            files += 1
        if files >= CACHE_WALK_FILES or time.monotonic() > deadline:
            complete = False
            break
    return Cache(name=name, path=str(path), exists=path.is_dir(), bytes=total, files=files, complete=complete, source=source)


def collect() -> Environment:
    """Everything `attndbg env` reports (imports torch for the GPUs; never an engine)."""
    from attndbg import machine

    gpus = tuple(
        Gpu(index=i, name=g.name, capability=f"{g.capability[0]}.{g.capability[1]}", memory_gib=round(g.total_memory / 2**30, 1)) for i, g in enumerate(machine.gpus())
    )
    return Environment(
        attndbg=package_version("attndbg") or "unknown",
        attndbg_path=str(Path(__file__).resolve().parent),
        python=platform.python_version(),
        python_executable=sys.executable,
        platform=platform.platform(),
        packages={name: package_version(name) for name, _ in PACKAGES if name != "attndbg"},
        torch_cuda=torch_cuda_build(),
        cuda_available=machine.cuda_available(),
        gpus=gpus,
        driver=_driver(),
        caches=tuple(_cache(name, path, source) for name, path, source in _cache_paths(os.environ)),
        variables={name: os.environ[name] for name in VARIABLES if name in os.environ},
    )


def to_json(env: Environment) -> dict[str, Any]:
    return {"schema": SCHEMA, **asdict(env)}


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def render(env: Environment) -> str:
    """Plain `key: value` lines, to paste into a bug report as they are."""
    lines = [f"attndbg: {env.attndbg} ({env.attndbg_path})", f"python: {env.python} ({env.python_executable})", f"platform: {env.platform}"]
    for name, version in env.packages.items():
        text = version or "not installed"
        if name == "torch" and version:
            text += f" (CUDA {env.torch_cuda})" if env.torch_cuda else " (CPU build)"
        lines.append(f"{name}: {text}")
    lines.append(f"CUDA available: {'yes' if env.cuda_available else 'no'}")
    lines += [f"GPU {g.index}: {g.name}, compute capability {g.capability}, {g.memory_gib} GiB" for g in env.gpus]
    lines.append(f"NVIDIA driver: {env.driver or 'none found'}")
    for cache in env.caches:
        where = f"{cache.path} ({'set by ' + cache.source if cache.source != 'default' else 'default'})"
        if not cache.exists:
            lines.append(f"{cache.name} cache: {where}, absent")
            continue
        bound = "" if cache.complete else "at least "
        lines.append(f"{cache.name} cache: {where}, {bound}{_size(cache.bytes)} in {bound}{cache.files} files")
    interpret = env.variables.get("TRITON_INTERPRET")
    lines.append(f"TRITON_INTERPRET: {interpret if interpret is not None else 'unset'}" + ("" if interpret is not None or env.cuda_available else " (attndbg sets 1: no CUDA GPU)"))
    lines += [f"{name}: {value}" for name, value in env.variables.items() if name != "TRITON_INTERPRET"]
    return "\n".join(lines)
