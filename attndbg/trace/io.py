"""Read and write traces: one step per `.pt` file, a recording is a directory with `manifest.jsonl`
(steps in manifest order); a plain folder of `.pt` files is read in name order.

Loading uses `torch.load(weights_only=True)`: a file that would execute code when unpickled is
rejected, never run. Writing goes to a temporary file in the same directory and is renamed into
place, so a reader never sees half a trace.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from attndbg.atomic import torch_save_atomically
from attndbg.trace.archive import read_archive
from attndbg.trace.errors import printable
from attndbg.trace.regular import read_regular
from attndbg.trace.schema import Trace, to_dict
from attndbg.trace.validate import TraceError, from_dict

MANIFEST = "manifest.jsonl"
SAVED_REPLAY_FORMAT = "attndbg.replay"  # compare.saved.FORMAT_NAME: told apart here without importing it

# What torch.load raises on a file that is not a (safe) torch archive: random bytes, truncation,
# a pickle with code in it (UnpicklingError from the weights_only unpickler), a zip without data.
UNREADABLE = (
    pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, KeyError, IndexError, AttributeError, TypeError,
    UnicodeDecodeError, struct.error,  # a legacy pickle cut inside a length field
    NotImplementedError,  # a zip header naming an unknown compression or version
)  # fmt: skip


def save(trace: Trace, path: str | os.PathLike) -> Path:
    """Validate `trace` (a round trip through the loader) and write it atomically."""
    path = Path(path)
    data = to_dict(trace)
    from_dict(data)  # never write what we could not read back
    return torch_save_atomically(data, path)


def load(path: str | os.PathLike) -> Trace:
    """Load and validate one step file; any problem is a `TraceError` naming the file."""
    path = Path(path)
    raw = read_regular(path)  # a FIFO blocks forever, /dev/zero never ends: refused, never read
    try:
        data = read_archive(raw)  # bounded and code-free before torch.load sees it
    except TraceError as e:
        raise TraceError(e.field, e.message if e.field != "file" else f"not a readable attndbg trace: {e.message}", str(path)) from None
    except UNREADABLE as e:
        raise TraceError("file", f"not a readable attndbg trace: {_unreadable_reason(raw, e)}", str(path)) from None
    if data is None:
        raise TraceError("file", f"not a readable attndbg trace: {_unreadable_reason(raw, None)}", str(path))
    if not isinstance(data, dict):
        raise TraceError("file", f"not an attndbg trace (top level is {type(data).__name__})", str(path))
    problem = unbacked_tensor(data)
    if problem:
        raise TraceError(problem[0], problem[1], str(path))
    if data.get("format") == SAVED_REPLAY_FORMAT:
        raise TraceError("file", "this is a saved replay (`attndbg replay --save`), not a trace: compare two with `attndbg diff A B`", str(path))
    try:
        return from_dict(data)
    except TraceError as e:
        raise e.in_file(str(path)) from None


def unbacked_tensor(data: object, name: str = "", depth: int = 0) -> tuple[str, str] | None:
    """(field, why) for the first tensor that is not plain CPU data backed by its own bytes: a
    stride-0 view claiming 2**31 elements in a 4-byte file would make every later step allocate
    gigabytes; meta, sparse and quantized tensors are nothing an engine records."""
    if depth > 8:
        return None  # deeper than any trace: the validator rejects the structure itself
    if isinstance(data, torch.Tensor):
        if data.layout is not torch.strided or data.is_quantized or data.device.type != "cpu":
            return name, f"a {data.layout} {data.device.type} tensor{' (quantized)' if data.is_quantized else ''}, expected plain CPU data"
        claimed = data.numel() * data.element_size()
        stored = data.untyped_storage().nbytes()
        if claimed > stored:
            return name, f"claims {data.numel()} elements ({claimed} bytes) but the file stores {stored} bytes for it (a strided view)"
        return None
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, (list, tuple)):
        items = enumerate(data)
    else:
        return None
    for key, value in items:
        found = unbacked_tensor(value, f"{name}.{key}" if name else str(key), depth + 1)
        if found:
            return found
    return None


def _unreadable_reason(raw: bytes, e: Exception | None) -> str:
    """One line saying what the file is instead, for a user who cannot read torch.load's error."""
    if not raw:
        return "the file is empty"
    if e is None or not raw.startswith((b"PK", b"\x80")):  # a torch.save zip archive, or a legacy pickle
        return f"not a torch.save file (it starts with {raw[:16]!r}; a trace is written by `attndbg synth` or `attndbg record`)"
    text = str(e)
    if "Unsupported global" in text:
        return "contains Python objects that would run code when loaded; refused (weights_only)"
    # torch's weights_only errors are paragraphs; the cause follows "WeightsUnpickler error:".
    detail = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[-1].splitlines() if line.strip()]
    first_line = printable(detail[0] if detail else type(e).__name__)
    return f"a damaged torch file ({type(e).__name__}: {first_line[:200]})"


@dataclass(frozen=True)
class ManifestEntry:
    file: str
    step: int
    mode: str
    batch_size: int
    graph: bool
    layers: list[int]
    # A flight-recorder ring (`record --ring`) wrote this step while its device work had not been
    # seen to finish: the step that faulted is among the steps in flight. Stored only when true.
    in_flight: bool = False

    def line(self) -> str:
        """The manifest line (in_flight left out unless true: older readers take these lines)."""
        fields = dict(self.__dict__)
        if not fields["in_flight"]:
            del fields["in_flight"]
        return json.dumps(fields)


def manifest_entry(trace: Trace, file: str, *, in_flight: bool = False) -> ManifestEntry:
    return ManifestEntry(
        file=file,
        step=trace.source.step,
        mode=trace.batch.forward_mode.value,
        batch_size=trace.batch.batch_size,
        graph=bool(trace.graph and trace.graph.is_graph_replay),
        layers=sorted(trace.tensors),
        in_flight=in_flight,
    )


def append_to_recording(directory: str | os.PathLike, trace: Trace, file: str | None = None, *, in_flight: bool = False) -> Path:
    """Save one step into a recording directory and append its manifest line."""
    directory = Path(directory)
    file = file or f"step_{trace.source.step:06d}.pt"
    path = save(trace, directory / file)
    append_manifest_line(directory, manifest_entry(trace, file, in_flight=in_flight).line())
    return path


def append_manifest_line(directory: str | os.PathLike, line: str) -> None:
    """Append one line to a recording's manifest (one short append: lines of several processes do not mix)."""
    with open(Path(directory) / MANIFEST, "a", encoding="utf-8") as f:
        f.write(line + "\n")


# A flight-recorder trigger line: {"trigger": {"kind": ..., "step": ..., "message": ..., ...}}.
# It names why the ring was written (attndbg/record/triggers.py); read_manifest passes over it.
TRIGGER_KEY = "trigger"


@dataclass(frozen=True)
class TriggerLine:
    kind: str  # exception, cuda-error, exit, signal, nan, accept, pointer (record/triggers.py TriggerKind)
    step: int | None  # the step it names (None: the process recorded none)
    message: str
    code: int | None = None  # exit code (exit), signal number (signal)
    pid: int | None = None  # the engine process whose ring was written


def trigger_line(trigger: TriggerLine) -> str:
    return json.dumps({TRIGGER_KEY: {k: v for k, v in trigger.__dict__.items() if v is not None or k == "step"}})


def _is_trigger(obj: object) -> bool:
    return isinstance(obj, dict) and set(obj) == {TRIGGER_KEY}


def read_manifest(directory: str | os.PathLike) -> list[ManifestEntry]:
    directory = Path(directory)
    path = directory / MANIFEST
    raw = read_regular(path)  # a FIFO in its place would block forever: refused, never read
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = text_line(raw, e.start)
        raise TraceError(f"line {line}", f"not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})", str(path)) from None
    lines = text.splitlines()
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if _is_trigger(data):
                continue  # a flight-recorder trigger (read_triggers), not a step
            entry = ManifestEntry(**data)
        except (json.JSONDecodeError, TypeError, RecursionError) as e:
            if number == len(lines) and not text.endswith("\n"):
                break  # a recorder killed while appending its last line: that step was never committed
            raise TraceError(f"line {number}", f"not a manifest entry ({e})", str(path)) from None
        for key, kind in (("file", str), ("step", int), ("mode", str), ("batch_size", int), ("in_flight", bool)):
            value = getattr(entry, key)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise TraceError(f"line {number}.{key}", f"= {_short_repr(value)}, expected {kind.__name__}", str(path))
        if Path(entry.file).name != entry.file or not entry.file.isprintable() or not entry.file:
            raise TraceError(f"line {number}.file", f"= {_short_repr(entry.file)} must name a file inside the recording", str(path))
        entries.append(entry)
    return entries


def read_triggers(directory: str | os.PathLike) -> list[TriggerLine]:
    """The flight-recorder triggers a recording's manifest names, in order (none for a plain recording).
    A malformed trigger line is one TraceError naming the line and the field."""
    path = Path(directory) / MANIFEST
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        raise TraceError("manifest", f"cannot read ({e.strerror or e})", str(path)) from None
    found = []
    for number, line in enumerate(lines, start=1):
        try:
            data = json.loads(line) if line.strip() else None
        except (json.JSONDecodeError, RecursionError):
            continue  # read_manifest names a torn or foreign line
        if not _is_trigger(data):
            continue
        body = data[TRIGGER_KEY]
        if not isinstance(body, dict):
            raise TraceError(f"line {number}.trigger", f"= {_short_repr(body)}, expected an object", str(path))
        for key, kinds, optional in (("kind", (str,), False), ("message", (str,), False), ("step", (int,), True), ("code", (int,), True), ("pid", (int,), True)):
            value = body.get(key)
            if (value is None and not optional) or (value is not None and (not isinstance(value, kinds) or isinstance(value, bool))):
                raise TraceError(f"line {number}.trigger.{key}", f"= {_short_repr(value)}, expected {kinds[0].__name__}", str(path))
        unknown = sorted(set(body) - {"kind", "message", "step", "code", "pid"})
        if unknown:
            raise TraceError(f"line {number}.trigger.{unknown[0]}", "is not a trigger field (kind, step, message, code, pid)", str(path))
        found.append(TriggerLine(kind=body["kind"], step=body.get("step"), message=body["message"], code=body.get("code"), pid=body.get("pid")))
    return found


def text_line(data: bytes, offset: int) -> int:
    """The 1-based line of `offset` in `data`."""
    return data.count(b"\n", 0, offset) + 1


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def trace_paths(target: str | os.PathLike) -> list[Path]:
    """A `.pt` file; every step of a recording directory in manifest order; or, in a folder
    without a manifest, every `.pt` file in name order."""
    target = Path(target)
    if not target.is_dir():
        return [target]
    if (target / MANIFEST).exists():
        return [target / e.file for e in read_manifest(target)]
    paths = sorted(p for p in target.iterdir() if p.suffix == ".pt" and p.is_file())
    if not paths:
        raise TraceError("folder", f"has no {MANIFEST} and no .pt files: expected a recording or a folder of traces", str(target))
    return paths
