"""Serialising and writing steps in a child process, so the engine's Python does not pay for it.

Validating a step and `torch.save`-ing it costs about 1-2 ms of Python per step. On the writer
thread that time is taken under the engine process's GIL, i.e. from the engine's own loop (measured
on the H200: an 8.7 ms CUDA-graph decode step became 10.1 ms). Here the writer thread only packs
the step (tensors as raw bytes) and pipes it to `python -m attndbg.record.writer_process DIR`,
which validates, saves atomically and appends the manifest, then answers one line per step.

The child is started with `subprocess` (not `multiprocessing`: its spawn start re-imports the
engine's `__main__`) and without ATTNDBG_RECORD, so it never records itself.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.record.options import ENV_VAR

_HEADER = struct.Struct("<Q")
_TENSOR = "__attndbg_tensor__"
_OS_ERROR = "oserror"  # answer status: writing failed in the OS ("oserror <errno> <strerror>")


def pack(obj: Any) -> Any:
    """A `to_dict` storage form with every tensor replaced by (marker, dtype, shape, bytes)."""
    if isinstance(obj, Tensor):
        t = obj.detach().cpu().contiguous()
        return (_TENSOR, str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [pack(v) for v in obj]
    return obj


def unpack(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _TENSOR:
        _, dtype_name, shape, data = obj
        dtype = getattr(torch, dtype_name)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v) for v in obj]
    return obj


class _PlainUnpickler(pickle.Unpickler):
    """Only containers and scalars: the payload is data, never code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a recorded step")


class ProcessWriter:
    """Parent side: pipe one packed step to the child, wait for its one-line answer.

    One step in flight keeps the size cap and the step order exact; the wait on the pipe releases
    the GIL, so the engine runs while the child works."""

    def __init__(self, out_dir: Path):
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "attndbg.record.writer_process", str(out_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )

    def write(self, name: str, data: dict[str, Any], *, in_flight: bool = False) -> int:
        """Write one step; returns its file size. Raises OSError when the child could not write to
        the directory (a full disk), RuntimeError when it refused the step or is gone."""
        assert self._process.stdin is not None and self._process.stdout is not None
        payload = pickle.dumps((name, pack(data), in_flight), protocol=5)
        try:
            self._process.stdin.write(_HEADER.pack(len(payload)) + payload)
            self._process.stdin.flush()
        except OSError:  # a broken pipe: the child is gone; this is not the directory's error
            raise RuntimeError(f"the writer process exited (exit code {self._process.poll()})") from None
        answer = self._process.stdout.readline().decode("utf-8", "replace").rstrip("\n")
        if not answer:
            raise RuntimeError(f"the writer process exited (exit code {self._process.poll()})")
        status, _, rest = answer.partition(" ")
        if status == _OS_ERROR:
            code, _, strerror = rest.partition(" ")
            raise OSError(int(code), strerror)
        if status != "ok":
            raise RuntimeError(rest)
        return int(rest.rpartition(" ")[2])

    def close(self, timeout: float = 30.0) -> None:
        try:
            if self._process.stdin:
                self._process.stdin.close()
            self._process.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()


def _serve(out_dir: Path) -> None:
    """Child side: read steps from stdin until EOF, write each, answer on stdout."""
    from attndbg.trace.io import append_to_recording
    from attndbg.trace.validate import from_dict

    stdin = sys.stdin.buffer
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        payload = stdin.read(_HEADER.unpack(header)[0])
        try:
            name, packed, in_flight = _PlainUnpickler(io.BytesIO(payload)).load()
            path = append_to_recording(out_dir, from_dict(unpack(packed)), name, in_flight=bool(in_flight))
            answer = f"ok {name} {path.stat().st_size}"
        except OSError as e:  # the directory's (ENOSPC, EDQUOT, EROFS, ...): the parent says so, naming it
            answer = f"{_OS_ERROR} {e.errno or 0} {e.strerror or e}"
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops recording
            answer = f"error writing a step: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
