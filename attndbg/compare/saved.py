"""The saved-replay file: what `attndbg replay --save FILE` writes and `attndbg diff` reads.

One file holds, for one trace, every backend's output and LSE (the float64 reference under the
name `reference`), so two runs (two machines, two library versions, eager vs graph) can be diffed
later without re-running anything. Stored as a plain dict of str/int/dict and tensors so that
`torch.load(weights_only=True)` reads it without executing code:

    {"format": "attndbg.replay", "version": 1, "trace_file": str, "qo_indptr": Tensor,
     "results": {name: {"output": Tensor, "lse": Tensor}}, "trace_sha256": str (optional)}

Values are float32 on the CPU: every backend's dtype (bf16, fp16, fp32) converts to it exactly, and
the float64 reference rounds once, which is far below any tolerance the comparisons apply.
"""

from __future__ import annotations

import os
import pickletools
import re
import stat
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from attndbg.atomic import torch_save_atomically
from torch import Tensor

from attndbg.trace.archive import read_archive
from attndbg.trace.io import SAVED_REPLAY_FORMAT, UNREADABLE
from attndbg.trace.regular import read_regular
from attndbg.trace.validate import TraceError, check_indptr

FORMAT_NAME = SAVED_REPLAY_FORMAT  # the trace loader recognises it too, to point at `attndbg diff`
FORMAT_VERSION = 1
REFERENCE = "reference"  # the name the float64 reference result is stored under

@dataclass(frozen=True)
class BackendResult:
    output: Tensor  # [T, Hq, Dv] float32, CPU
    lse: Tensor  # [T, Hq] float32, CPU, natural log


@dataclass(frozen=True)
class SavedReplay:
    """Every backend's result on one trace. Checked when built: an object that exists is valid."""

    trace_file: str  # the trace that was replayed, as given on the command line
    qo_indptr: Tensor  # [bs+1] int64: request b's rows are qo_indptr[b]:qo_indptr[b+1]
    results: Mapping[str, BackendResult]  # by backend name; REFERENCE is the float64 reference
    path: str = ""  # the file it was loaded from ("" when built in memory)
    trace_digest: str = ""  # sha256 of the trace file's bytes when saved ("" in older files)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def names(self) -> list[str]:
        return list(self.results)


def _check(saved: SavedReplay) -> None:
    if not isinstance(saved.trace_file, str):
        raise TraceError("trace_file", f"expected a string, found {type(saved.trace_file).__name__}")
    indptr = saved.qo_indptr
    if not isinstance(indptr, Tensor):
        raise TraceError("qo_indptr", f"expected a tensor, found {type(indptr).__name__}")
    if indptr.dtype != torch.int64 or indptr.dim() != 1:
        raise TraceError("qo_indptr", f"{_describe(indptr)}, expected a 1-D int64 tensor [bs+1]")
    check_indptr("qo_indptr", indptr)
    if not isinstance(saved.results, Mapping):
        raise TraceError("results", f"expected a dict of backend name -> result, found {type(saved.results).__name__}")
    tokens = int(indptr[-1])
    shape: tuple[int, int, int] | None = None  # (T, Hq, Dv) of the first result: all must agree
    for name, result in saved.results.items():
        field = f"results[{name!r}]"
        if not isinstance(name, str) or not name:
            raise TraceError("results", f"backend names must be non-empty strings, found {name!r}")
        if not isinstance(result, BackendResult):
            raise TraceError(field, f"expected output and lse, found {type(result).__name__}")
        for key, value, ndim in (("output", result.output, 3), ("lse", result.lse, 2)):
            if not isinstance(value, Tensor):
                raise TraceError(f"{field}.{key}", f"expected a tensor, found {type(value).__name__}")
            if value.dtype != torch.float32 or value.dim() != ndim or value.device.type != "cpu":
                raise TraceError(f"{field}.{key}", f"{_describe(value)}, expected a {ndim}-D float32 CPU tensor")
        out, lse = result.output, result.lse
        if out.shape[0] != tokens:
            raise TraceError(
                f"{field}.output",
                f"shape {list(out.shape)} has {out.shape[0]} rows, but qo_indptr[-1] = {tokens} query tokens",
            )
        if tuple(lse.shape) != tuple(out.shape[:2]):
            raise TraceError(f"{field}.lse", f"shape {list(lse.shape)}, expected [T, Hq] = {list(out.shape[:2])}")
        if shape is None:
            shape = tuple(out.shape)
        elif tuple(out.shape) != shape:
            raise TraceError(
                f"{field}.output", f"shape {list(out.shape)} differs from the other results' {list(shape)}"
            )


def _describe(t: Tensor) -> str:
    return f"dtype {str(t.dtype).replace('torch.', '')} shape {list(t.shape)} on {t.device.type}"


def _stored(t: Tensor) -> Tensor:
    # clone(): torch.save writes a view's whole storage, and a CUDA-graph output buffer is
    # usually a view of a larger static buffer.
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()


def save_replay(
    path: str | os.PathLike,
    *,
    trace_file: str,
    qo_indptr: Tensor,
    results: Mapping[str, tuple[Tensor, Tensor]],
    trace_digest: str = "",
) -> None:
    """Write `results` (name -> (output [T, Hq, Dv], lse [T, Hq] natural log)) atomically.

    The reference belongs in `results` under `REFERENCE`. Values are stored as float32 CPU copies.
    Raises `TraceError` (naming the file) when the results are inconsistent: never writes what
    `load_replay` would refuse.
    """
    path = Path(path)
    saved = _built(
        str(path),
        lambda: SavedReplay(
            trace_file=trace_file,
            qo_indptr=qo_indptr.detach().to(device="cpu", dtype=torch.int64).clone(),
            results={name: BackendResult(output=_stored(o), lse=_stored(l)) for name, (o, l) in results.items()},
            trace_digest=trace_digest,
        ),
    )
    data = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "trace_file": saved.trace_file,
        "qo_indptr": saved.qo_indptr,
        "results": {name: {"output": r.output, "lse": r.lse} for name, r in saved.results.items()},
    }
    if saved.trace_digest:
        data["trace_sha256"] = saved.trace_digest
    torch_save_atomically(data, path)


def is_saved_replay(path: str | os.PathLike) -> bool:
    """Whether `path` is a saved replay rather than a trace, decided without unpickling anything.

    A `.replay` name counts (so a damaged one gets `load_replay`'s error, not the trace loader's);
    otherwise the torch archive's pickle is read as opcodes only and its top-level "format" string
    is checked. Anything unreadable is "no": the trace loader then reports what is wrong with it.
    """
    path = Path(path)
    if path.suffix == ".replay":
        return True
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return False  # a FIFO or device: the trace loader refuses it without reading
        with zipfile.ZipFile(path) as archive:
            pickled = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
            if pickled is None:
                return False
            ops = pickletools.genops(archive.read(pickled))
            strings = [arg for op, arg, _ in ops if isinstance(arg, str) and "UNICODE" in op.name]
    except (OSError, zipfile.BadZipFile, ValueError, NotImplementedError, RuntimeError, EOFError, zlib.error):
        return False  # damaged zip headers (an unknown compression or version, an encrypted flag), a damaged deflate stream
    return any(key == "format" and value == FORMAT_NAME for key, value in zip(strings, strings[1:]))


def load_replay(path: str | os.PathLike) -> SavedReplay:
    """Load and check a saved replay; any problem is a one-line `TraceError` naming the file."""
    where = str(path)
    raw = read_regular(path)  # a FIFO or a device: refused, never read
    if not raw:
        raise TraceError("file", "is empty (an interrupted write? save_replay writes atomically)", where)
    try:
        data = read_archive(raw)  # bounded and code-free before torch.load sees it (trace/archive.py)
    except TraceError as e:
        raise TraceError(e.field, f"not a readable attndbg saved replay: {e.message}", where) from None
    except UNREADABLE as e:  # what torch.load raises on a file that is not a (safe) torch archive
        raise TraceError("file", f"not a readable attndbg saved replay: {_unreadable_reason(e)}", where) from None
    if data is None:
        raise TraceError("file", f"not a readable attndbg saved replay: not a torch.save file (it starts with {raw[:16]!r})", where)
    if not isinstance(data, dict):
        raise TraceError("file", f"not an attndbg saved replay (top level is {type(data).__name__})", where)
    if data.get("format") != FORMAT_NAME:
        is_trace = data.get("format") == "attndbg.trace"
        hint = " (this is a trace: replay it with `attndbg replay --save FILE`)" if is_trace else ""
        raise TraceError(
            "format", f"= {data.get('format')!r}, not an attndbg saved replay (expected {FORMAT_NAME!r}){hint}", where
        )
    if data.get("version") != FORMAT_VERSION or isinstance(data.get("version"), bool):
        raise TraceError(
            "version", f"= {data.get('version')!r}, this attndbg reads saved-replay version {FORMAT_VERSION}", where
        )
    return _built(where, lambda: _from_dict(data, where))


def _unreadable_reason(e: Exception) -> str:
    """One line from torch.load's multi-paragraph error: a refused global, or what was malformed."""
    text = str(e)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return f"contains a Python object ({refused.group(1)}) that would run code when loaded; refused"
    after = text.split("WeightsUnpickler error:", 1)
    lines = [line.strip() for line in after[-1].splitlines() if line.strip()]
    detail = lines[0] if lines else type(e).__name__
    return f"not a torch archive of plain data ({detail[:200]})" if len(after) == 2 else detail[:200]


def _from_dict(data: dict, where: str) -> SavedReplay:
    for key in ("trace_file", "qo_indptr", "results"):
        if key not in data:
            raise TraceError(key, "missing")
    raw_results = data["results"]
    if not isinstance(raw_results, dict):
        raise TraceError("results", f"expected a dict of backend name -> result, found {type(raw_results).__name__}")
    results = {}
    for name, entry in raw_results.items():
        if not isinstance(entry, dict) or not {"output", "lse"} <= set(entry):
            found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise TraceError(f"results[{name!r}]", f"expected a dict with output and lse, found {found}")
        results[name] = BackendResult(output=entry["output"], lse=entry["lse"])
    qo_indptr = data["qo_indptr"]
    if isinstance(qo_indptr, Tensor) and qo_indptr.dtype == torch.int32:
        qo_indptr = qo_indptr.to(torch.int64)
    digest = data.get("trace_sha256", "")
    if not isinstance(digest, str):
        raise TraceError("trace_sha256", f"expected a hex string, found {type(digest).__name__}")
    return SavedReplay(trace_file=data["trace_file"], qo_indptr=qo_indptr, results=results, path=where, trace_digest=digest)


def _built(where: str, make):
    """Run a constructor; a `TraceError` it raises is re-raised naming the file."""
    try:
        return make()
    except TraceError as e:
        raise e.in_file(where) from None
