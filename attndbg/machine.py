"""One place that decides what this machine can do: GPU, arch, Triton mode, libraries.

Everything here is computed on first call and cached; importing this module has no side
effects. `select_triton_mode()` is the one exception that changes process state (it sets
TRITON_INTERPRET), and it must run before any `@triton.jit` kernel module is imported,
because Triton decides at decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os
from dataclasses import dataclass


class TritonMode(enum.Enum):
    GPU = "gpu"  # compiled for the local CUDA GPU
    INTERPRETER = "interpreter"  # TRITON_INTERPRET=1: numpy on the CPU, slow but exact semantics


def _env_flag(name: str) -> bool:
    """The one boolean parser for environment variables."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def host_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), which
    os.cpu_count() ignores, so that workers and threads are sized by what they can use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class GpuInfo:
    name: str
    capability: tuple[int, int]
    num_sms: int
    total_memory: int

    @property
    def arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


@functools.cache
def gpus() -> tuple[GpuInfo, ...]:
    """Every visible CUDA device, in torch's order (empty without CUDA)."""
    if not cuda_available():
        return ()
    import torch

    infos = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        infos.append(GpuInfo(name=props.name, capability=(props.major, props.minor), num_sms=props.multi_processor_count, total_memory=props.total_memory))
    return tuple(infos)


def gpu_info() -> GpuInfo | None:
    """Device 0, the one attndbg runs on unless told otherwise."""
    return next(iter(gpus()), None)


def device_name() -> str:
    info = gpu_info()
    return f"cuda:{info.name}" if info else "cpu"


@functools.cache
def select_triton_mode() -> TritonMode:
    """Pick compiled Triton on a GPU, the interpreter otherwise (or when forced by the user).

    Called before our kernel modules are imported. On a machine without a GPU this sets
    TRITON_INTERPRET=1 for the process; callers report the mode so the switch is never silent.
    """
    if _env_flag("TRITON_INTERPRET") or not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
        return TritonMode.INTERPRETER
    return TritonMode.GPU


def kernel_device() -> str:
    """Where tensors for our Triton kernels live: the interpreter runs on CPU tensors."""
    return "cuda" if select_triton_mode() is TritonMode.GPU else "cpu"


@functools.cache
def module_available(name: str) -> bool:
    """Whether a library can be found, without importing it (imports can be slow or noisy)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
