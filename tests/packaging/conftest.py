"""One wheel, built once per test session, and one clean venv with it installed: the wheel tests read
the archive, the examples test runs commands in the venv as a user of `pip install attndbg` would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> where it lands in the wheel (setup.py's package_dir).
INSTALLED_AS = {"attndbg": "attndbg", "backends": "attndbg/backends"}
DATA_FOLDERS = {"traces": "attndbg/examples/traces"}
# torch first and pinned, as .ci/run installs it: 2.13.0 is the CPU build on local disk; an unpinned
# torch would bring the CUDA build.
TORCH = "torch==2.13.0"


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources, so the checkout gets no build/ or egg-info."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in (*INSTALLED_AS, *DATA_FOLDERS):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore, symlinks=True)
    # A worktree may link attndbg/backends to ../backends to be importable; setup.py maps it instead.
    link = source / "attndbg" / "backends"
    if link.is_symlink():
        link.unlink()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "out"), str(source)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp / "out").glob("attndbg-*.whl")
    return wheel


def _transformers_pin() -> list[str]:
    """The engine the recording examples run, at CI's pin (.ci/install-transformers.sh), so that the
    docs' `pip install transformers psutil` finds it installed and the run does not depend on what
    the index holds today."""
    text = (ROOT / ".ci" / "install-transformers.sh").read_text(encoding="utf-8")
    return re.findall(r'"((?:transformers|psutil)==[^"]+)"', text)


@pytest.fixture(scope="session")
def wheel_venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv (no system site-packages) with the wheel and its `interop` extra installed."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # Without the developer's PYTHONPATH: pip counts a checkout on it (with its editable install's
    # metadata) as attndbg already installed, and leaves the wheel out of the venv.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for packages in ([TORCH], [f"{built_wheel}[interop]", *_transformers_pin()]):
        installed = subprocess.run([python, "-m", "pip", "install", "-q", *packages], capture_output=True, text=True, timeout=600, env=env)
        assert installed.returncode == 0, installed.stderr[-3000:]
    return venv
