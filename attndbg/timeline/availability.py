"""Whether `--timeline` can run here, decided before any work: the optional package, and a GPU.
Nothing here imports cupti unless it is installed (`--help` must import nothing heavy)."""

from __future__ import annotations

import importlib
import importlib.util

PACKAGE = "cupti-python"
INSTALL = "pip install 'attndbg[timeline]'"


class Unavailable(Exception):
    """CUPTI would not start in this process (found only by trying): the command is refused as not
    runnable here (exit 3), like a missing package."""


def refusal() -> str | None:
    """One line saying why `--timeline` cannot run here, or None. No GPU is said first: on a CPU
    the package would not help, and a user sent to install it would learn that only afterwards."""
    from attndbg import machine

    if not machine.cuda_available():
        return "--timeline records the kernels a GPU runs, and there is no CUDA GPU here: no GPU timeline on this machine"
    if importlib.util.find_spec("cupti") is None:
        return (
            f"--timeline needs the {PACKAGE} package (NVIDIA's CUPTI for Python), which is not installed: "
            f"{INSTALL}, or the one of your CUDA driver's major version, e.g. pip install '{PACKAGE}==13.*'"
        )
    try:
        importlib.import_module("cupti.cupti")
    except (ImportError, OSError) as e:  # installed, but its CUDA libraries do not load (cuda-bindings, libcupti)
        return f"--timeline: {PACKAGE} is installed but does not load here: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None
