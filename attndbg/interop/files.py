"""Read the untrusted files an import opens: JSON and JSON lines, torch.save archives of tensors,
safetensors files. Every problem is one `TraceError` naming the file, the field (or line) and what
is wrong; nothing runs code (torch archives are vetted by `attndbg.trace.archive` before
torch.load sees them; safetensors holds no code by design) and sizes are bounded before reading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.archive import read_archive
from attndbg.trace.errors import TraceError, printable
from attndbg.trace.io import UNREADABLE, unbacked_tensor
from attndbg.trace.regular import read_regular, regular_size

# A dump's metadata line is a few kB; a workload line a few hundred bytes. Far past either is not one.
MAX_LINE_BYTES = 4 << 20
MAX_JSON_BYTES = 64 << 20
# Tensor files of a dump hold whole KV pools (interop.md §0.10): large, but not unbounded here.
MAX_TENSOR_FILE_BYTES = 8 << 30


def _finite(value: Any) -> Any:
    """Python's json accepts NaN and Infinity: no field we read may be either."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite number {value}")
    return value


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=lambda name: _finite(float(name)))


def read_json(path: Path) -> Any:
    raw = read_regular(path, limit=MAX_JSON_BYTES)
    try:
        return _loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TraceError("file", f"not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})", str(path)) from None
    except (ValueError, RecursionError) as e:
        raise TraceError("file", f"not JSON ({printable(str(e), 200)})", str(path)) from None


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-empty line. A last line cut short (a writer killed while
    appending it) ends the file; any other bad line is an error naming it."""
    regular_size(path)  # a FIFO would block the open below
    try:
        with open(path, "rb") as f:
            lines = iter(f)
            number = 0
            for raw in lines:
                number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(f"line {number}", f"is {len(raw)} bytes long, more than {MAX_LINE_BYTES}", str(path))
                if not raw.strip():
                    continue
                try:
                    value = _loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError) as e:
                    if not raw.endswith(b"\n") and next(lines, None) is None:
                        return  # the writer was stopped inside its last line: that record never finished
                    raise TraceError(f"line {number}", f"not a JSON object ({printable(str(e), 200)})", str(path)) from None
                yield number, value
    except OSError as e:
        raise TraceError("file", f"cannot read ({e.strerror or e})", str(path)) from None


def text_lines(path: Path, limit: int) -> Iterator[str]:
    """The lines of a text file of at most `limit` bytes, undecodable bytes replaced (a log)."""
    regular_size(path, limit=limit)  # a FIFO would block the open below
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                yield line[:MAX_LINE_BYTES].rstrip("\n")
    except OSError as e:
        raise TraceError("file", f"cannot read ({e.strerror or e})", str(path)) from None


def load_tensors(path: Path) -> dict[str, Tensor]:
    """A dict of named tensors saved with torch.save (vetted, weights_only) or as safetensors."""
    raw = read_regular(path, limit=MAX_TENSOR_FILE_BYTES)
    if path.suffix == ".safetensors":
        return _load_safetensors(path, raw)
    try:
        data = read_archive(raw)
    except TraceError as e:
        raise e.in_file(str(path)) from None
    except UNREADABLE as e:
        raise TraceError("file", f"not a readable torch.save file ({type(e).__name__}: {printable(str(e).splitlines()[0] if str(e) else '', 200)})", str(path)) from None
    if data is None:
        raise TraceError("file", f"not a torch.save file (it starts with {raw[:16]!r})", str(path))
    return _tensor_dict(data, path)


def _load_safetensors(path: Path, raw: bytes) -> dict[str, Tensor]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load
    except ImportError:
        raise TraceError("file", "is a safetensors file: pip install safetensors (or pip install 'attndbg[interop]') to read it", str(path)) from None
    try:
        data = load(raw)
    except (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise TraceError("file", f"not a readable safetensors file ({printable(str(e), 200)})", str(path)) from None
    return _tensor_dict(data, path)


def _tensor_dict(data: Any, path: Path) -> dict[str, Tensor]:
    if not isinstance(data, dict):
        raise TraceError("file", f"holds a {type(data).__name__}, expected a dict of named tensors", str(path))
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise TraceError(f"[{printable(repr(key), 80)}]", f"is a {type(value).__name__}, expected a tensor under a name", str(path))
    problem = unbacked_tensor(data)
    if problem:
        raise TraceError(problem[0], problem[1], str(path))
    return dict(data)


def save_safetensors(tensors: dict[str, Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise TraceError("file", "writing safetensors blobs needs the safetensors package: pip install safetensors", str(path)) from None
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def index_tensor(value: Any, name: str, path: Path) -> Tensor:
    """A 1-D int32/int64 tensor, as int64 (`name` is the field the error names)."""
    if not isinstance(value, Tensor):
        raise TraceError(name, f"expected an integer tensor, found {type(value).__name__}", str(path))
    if value.dtype not in (torch.int32, torch.int64) or value.dim() != 1:
        raise TraceError(name, f"is a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}, expected a 1-D int32/int64 tensor", str(path))
    return value.to(torch.int64)
