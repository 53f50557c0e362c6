"""Read a FlashInfer level-10 dump directory (`FLASHINFER_LOGLEVEL=10`, FlashInfer's api_logging.py)
into calls in the order they happened, with their arguments by parameter name.

Layout (interop.md §1.2-1.4): `session.jsonl` holds every metadata record in append (= real time)
order; each call has a directory `<time>_pid<P>_<function>_call<N>/` with `inputs.pt` (or
`.safetensors`; positional tensor i under `arg_i`, keyword x under `kwarg_x`, a tuple's items
under `arg_i__<j>`) and `outputs.pt` (`result` or `result_<i>`). `arg_0` of a wrapper method is
the wrapper itself (`self_id` = its id()). A call captured in a CUDA graph writes no tensors; every
replay flushes them to `graph_flushes/flush_<k>/` and appends records with
`graph_capture_flush_index` k: each flush is an event of its own.

Paths inside records are the dumping machine's: a call's files are looked up by the directory's
own name under the dump root, never by the recorded path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from attndbg.interop.files import json_lines, load_tensors
from attndbg.trace.errors import TraceError, printable

SESSION = "session.jsonl"
# FlashInfer's decode plan() takes its old positional arguments through *deprecated_positional_args,
# in this order (flashinfer/decode.py, _BATCH_DECODE_PLAN_LEGACY_POS_ARGS, 0.7.2).
DECODE_PLAN_LEGACY = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type", "data_type", "sm_scale",
    "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req",
)  # fmt: skip
# Parameter names when a record carries no readable signature (interop.md §1.5; `self` first).
KNOWN_PARAMS: dict[str, tuple[str, ...]] = {
    "BatchDecodeWithPagedKVCacheWrapper.__init__": ("self", "float_workspace_buffer", "kv_layout", "use_cuda_graph", "use_tensor_cores"),
    "BatchDecodeWithPagedKVCacheWrapper.plan": ("self", "indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "*"),
    "BatchDecodeWithPagedKVCacheWrapper.run": ("self", "q", "paged_kv_cache"),
    "BatchPrefillWithPagedKVCacheWrapper.__init__": ("self", "float_workspace_buffer", "kv_layout", "use_cuda_graph"),
    "BatchPrefillWithPagedKVCacheWrapper.plan": (
        "self", "qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads", "head_dim_qk",
        "page_size", "head_dim_vo", "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale",
        "window_left", "logits_soft_cap",
    ),
    "BatchPrefillWithPagedKVCacheWrapper.run": ("self", "q", "paged_kv_cache"),
    "BatchPrefillWithRaggedKVCacheWrapper.__init__": ("self", "float_workspace_buffer", "kv_layout", "use_cuda_graph"),
    "BatchPrefillWithRaggedKVCacheWrapper.plan": (
        "self", "qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo", "custom_mask", "packed_custom_mask",
        "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale",
    ),
    "BatchPrefillWithRaggedKVCacheWrapper.run": ("self", "q", "k", "v"),
    "BatchMLAPagedAttentionWrapper.__init__": ("self", "float_workspace_buffer", "use_cuda_graph"),
    "BatchMLAPagedAttentionWrapper.plan": (
        "self", "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale",
    ),
    "BatchMLAPagedAttentionWrapper.run": ("self", "q_nope", "q_pe", "ckv_cache", "kpe_cache"),
    "merge_state": ("v_a", "s_a", "v_b", "s_b"),
}  # fmt: skip
# A dump directory's name and a flush folder's: nothing else is ever opened.
_CALL_DIR = re.compile(r"[\w.\-]+")
_FLUSH_DIR = re.compile(r"flush_\d{1,9}")


@dataclass
class Call:
    """One call as it happened: a wrapper method or free function, eager or one graph replay's flush."""

    function: str  # "BatchDecodeWithPagedKVCacheWrapper.plan", "merge_state", ...
    process_id: int
    self_id: int | None
    directory: Path  # where its tensor files are (a flush's snapshot folder)
    record: dict[str, Any]  # its last metadata record
    position: int  # line of its first record in session.jsonl
    flush_index: int | None = None  # a graph replay's flush number; None: an eager call
    # The call did not return: its inputs were dumped, its outputs never were (the kernel raised,
    # faulted or killed the process). The error FlashInfer's log holds for it, "" when none.
    crash: str | None = None
    _args: dict[str, Any] | None = field(default=None, repr=False)
    _outputs: dict[str, Tensor] | None = field(default=None, repr=False)

    @property
    def wrapper(self) -> str:
        return self.function.rsplit(".", 1)[0]

    @property
    def method(self) -> str:
        return self.function.rsplit(".", 1)[-1]

    @property
    def where(self) -> str:
        return str(self.directory)

    def args(self) -> dict[str, Any]:
        """Arguments by parameter name (tensors from the inputs file, the rest as recorded)."""
        if self._args is None:
            self._args = _arguments(self)
        return self._args

    def outputs(self) -> dict[str, Tensor]:
        if self._outputs is None:
            self._outputs = _tensor_file(self.directory, "outputs")
        return self._outputs


def read_calls(root: Path, log: Path | None = None) -> tuple[list[Call], list[str]]:
    """The dump's calls in session order, and notes on what happened to them. A call that did not
    return is kept, marked crashed, with the error `log` (FlashInfer's FLASHINFER_LOGDEST file)
    holds for it; captures never flushed are left out."""
    if not root.is_dir():
        raise TraceError("dump", "is not a directory (expected FLASHINFER_DUMP_DIR, holding session.jsonl)", str(root))
    session = root / SESSION
    if not session.exists():
        raise TraceError("dump", f"has no {SESSION}: not a FlashInfer level-10 dump directory (FLASHINFER_LOGLEVEL=10)", str(root))
    calls: dict[tuple[str, int | None], Call] = {}
    for number, record in json_lines(session):
        call = _call_of(record, number, root, session)
        if call is None:
            continue
        key = (call.directory.name if call.flush_index is None else str(call.directory), call.flush_index)
        if key in calls:
            calls[key].record = record  # later records of a call complete it (outputs, flush status)
        else:
            calls[key] = call
    ordered = sorted(calls.values(), key=lambda c: c.position)
    notes = []
    kept = []
    errors = logged_errors(log) if log is not None else {}
    for call in ordered:
        status = call.record.get("execution_status")
        if call.flush_index is None and status == "graph_capture_pending_flush":
            continue  # captured in a graph: its replays' flushes are the calls
        if status == "inputs_saved" and call.method != "plan" and call.method != "__init__":
            call.crash = errors.get(call.directory.name if call.flush_index is None else call.directory.parent.parent.name, "")
            said = f": {call.crash}" if call.crash else " (no error in the log)" if log is not None else " (give FlashInfer's log with --log for its error)"
            notes.append(f"{call.directory.name}: inputs only, the call did not return{said}: imported as a crashed step")
        kept.append(call)
    return kept, notes


# What FlashInfer's api_logging.py logs when a call's outputs cannot be written after it returned:
# an asynchronous kernel fault surfaces at that synchronize ("Failed to dump outputs to <dir>: <error>").
_OUTPUT_FAILURE = re.compile(r"Failed to dump outputs to (?P<dir>\S+): (?P<error>.+)")
MAX_LOG_BYTES = 256 << 20


def logged_errors(log: Path) -> dict[str, str]:
    """Call directory name -> the first error FlashInfer's log (FLASHINFER_LOGDEST) holds for it."""
    from attndbg.interop.files import text_lines

    found: dict[str, str] = {}
    for line in text_lines(log, MAX_LOG_BYTES):
        match = _OUTPUT_FAILURE.search(line)
        if match:
            found.setdefault(Path(match["dir"]).name, printable(match["error"].strip(), 300))
    return found


def _call_of(record: Any, number: int, root: Path, session: Path) -> Call | None:
    if not isinstance(record, dict):
        raise TraceError(f"line {number}", f"is a {type(record).__name__}, expected a metadata record (a JSON object)", str(session))
    function = _field(record, "function_name", str, number, session)
    pid = _field(record, "process_id", int, number, session)
    self_id = record.get("self_id")
    if self_id is not None and (not isinstance(self_id, int) or isinstance(self_id, bool)):
        raise TraceError(f"line {number}.self_id", f"= {printable(repr(self_id), 60)}, expected an int", str(session))
    base = _field(record, "graph_capture_base_dump_dir", str, number, session, optional=True)
    flushed = record.get("graph_capture_flushed") is True
    if flushed and base is None:
        return None  # the base directory's copy of a flush record: its snapshot record stands for it
    directory = _inside(root, base if base is not None else _field(record, "dump_dir", str, number, session), number, session)
    flush = None
    if base is not None:
        flush_name = Path(_field(record, "dump_dir", str, number, session)).name
        if not _FLUSH_DIR.fullmatch(flush_name):
            raise TraceError(f"line {number}.dump_dir", f"a flush record's folder is {printable(flush_name, 80)!r}, expected flush_<k>", str(session))
        flush = _field(record, "graph_capture_flush_index", int, number, session)
        directory = directory / "graph_flushes" / flush_name
    return Call(function=function, process_id=pid, self_id=self_id, directory=directory, record=record, position=number, flush_index=flush)


def _field(record: dict, key: str, kind: type, number: int, path: Path, optional: bool = False) -> Any:
    value = record.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TraceError(f"line {number}.{key}", f"= {printable(repr(value), 60)}, expected {kind.__name__}", str(path))
    if isinstance(value, str) and (len(value) > 4096 or not value.isprintable()):
        raise TraceError(f"line {number}.{key}", f"is not a short printable string: {printable(value, 60)!r}", str(path))
    return value


def _inside(root: Path, recorded: str, number: int, session: Path) -> Path:
    """The call's directory under `root`, by its own name (the recorded path is the dumping machine's)."""
    name = Path(recorded).name
    if not _CALL_DIR.fullmatch(name) or name in (".", ".."):
        raise TraceError(f"line {number}.dump_dir", f"names {printable(name, 80)!r}, not a call directory", str(session))
    return root / name


def _tensor_file(directory: Path, kind: str) -> dict[str, Tensor]:
    for suffix in (".pt", ".safetensors"):
        path = directory / f"{kind}{suffix}"
        if path.exists():
            return load_tensors(path)
    return {}


def parameter_names(call: Call) -> tuple[str, ...]:
    """The function's parameters in order (`self` first for wrapper methods; "*" marks *args), from
    the record's `function_signature`, else the table above."""
    signature = call.record.get("function_signature")
    if isinstance(signature, str) and signature.startswith("(") and len(signature) < 20000:
        names = _signature_names(signature)
        if names:
            return names
    return KNOWN_PARAMS.get(call.function, ())


def _signature_items(signature: str) -> list[str]:
    """The top-level comma-separated items of `str(inspect.signature(f))`, its return type left out."""
    depth, item, items = 0, "", []
    for ch in signature[1:]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            items.append(item.strip())
            item = ""
        else:
            item += ch
    items.append(item.strip())
    return [entry for entry in items if entry]


def _signature_names(signature: str) -> tuple[str, ...]:
    """Parameter names of `str(inspect.signature(f))`, each item up to its ':' or '='; `*args`
    becomes "*", keyword-only ones after a bare '*' are left out (they are always passed by keyword)."""
    names = []
    for entry in _signature_items(signature):
        name = re.split(r"[:=\s]", entry, maxsplit=1)[0]
        if name.startswith("**"):
            continue
        if name.startswith("*"):
            names.append("*")
            break  # positional arguments never reach past *args or a bare *
        if name.isidentifier():
            names.append(name)
    return tuple(names)


def parameter_items(call: Call) -> list[tuple[str, str | None]]:
    """Every named parameter of the call's recorded signature (keyword-only ones too) with the text
    of its default, None when it has none; empty without a readable signature."""
    signature = call.record.get("function_signature")
    if not (isinstance(signature, str) and signature.startswith("(") and len(signature) < 20000):
        return []
    out = []
    for entry in _signature_items(signature):
        name = re.split(r"[:=\s]", entry, maxsplit=1)[0]
        if not name.isidentifier():
            continue
        # "name: type = default" or "name=default": the default follows the first top-level " = " or "=".
        _, eq, text = entry.partition(" = ") if " = " in entry else entry.partition("=")
        out.append((name, text if eq else None))
    return out


def _arguments(call: Call) -> dict[str, Any]:
    params = parameter_names(call)
    tensors = _tensor_file(call.directory, "inputs")
    meta = call.record.get("input_metadata")
    meta = meta if isinstance(meta, dict) else {}
    out: dict[str, Any] = {}
    legacy = DECODE_PLAN_LEGACY if call.function.endswith("DecodeWithPagedKVCacheWrapper.plan") else ()
    star = params.index("*") if "*" in params else len(params)
    for key in list(tensors) + list(meta):
        if key.startswith("kwarg_"):
            name = key[len("kwarg_") :]
        elif key.startswith("arg_") and key[4:].isdigit():
            i = int(key[4:])
            if i < star:
                name = params[i] if i < len(params) else key
            else:
                name = legacy[i - star] if i - star < len(legacy) else key
        else:
            continue  # a nested item (arg_2__0): reached through its container
        out[name] = tensors[key] if key in tensors else _value(meta[key], tensors)
    out.pop("self", None)
    return out


def _value(recorded: Any, tensors: dict[str, Tensor], depth: int = 0) -> Any:
    """A recorded non-tensor argument back as a value: a dtype as its name, a tuple/list of tensors
    as a tuple, a tensor nested in one from its `tensor_key`; anything else as recorded."""
    if not isinstance(recorded, dict) or depth > 4:
        return recorded
    kind = recorded.get("type")
    if kind == "torch.dtype":
        return str(recorded.get("value", "")).replace("torch.", "")
    if kind == "torch.Tensor":
        return tensors.get(str(recorded.get("tensor_key")))
    if kind in ("tuple", "list") and isinstance(recorded.get("items"), list):
        return tuple(_value(item, tensors, depth + 1) for item in recorded["items"])
    if kind == "enum":
        return recorded.get("value")
    return recorded
