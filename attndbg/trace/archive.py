"""Read a `torch.save` file without running code, and with memory bounded before anything is built.

`torch.load(weights_only=True)` runs no code, but it believes what the file says: a pickle may call
an allowed global that allocates what it is told (`bytearray(2**34)` from an 800-byte file, a
quantized tensor's `_empty_affine_quantized(size)`), a storage record may claim more bytes than the
archive holds (allocated before it is read), a dict key may be a tuple nested three million deep
(hashing it overflows the C stack: a segfault, not an exception), a zip member may be deflated
(torch.save never compresses; a damaged stream is a zlib error, a small one can inflate to
gigabytes). So before torch.load sees the bytes:

1. the archive: a zip whose members are stored, unencrypted, unique and no larger than the file;
   plain pickles and the legacy (torch < 1.6) format are refused, their storages are sized by the
   pickle itself;
2. every pickle in it is walked opcode by opcode (`pickletools.genops`, no object is built): the
   globals it names and the callables it calls are checked against what a trace or a saved replay
   holds, the nesting of what it would build is bounded, and each storage it loads must be backed
   by a record of at least the size it claims;

and after it, the loaded object is walked once, iteratively (`check_structure`): nesting, cycles,
keys that are names or layer numbers, integers small enough to print.
Every refusal is a `TraceError` on the field "file" (or the dotted path of the bad entry).
"""

from __future__ import annotations

import io
import pickletools
import warnings
import zipfile
from typing import Any

import torch

from attndbg.trace.errors import TraceError, printable

# Deeper than any trace (about 4 levels of dict, a tensor's size tuple, its rebuild call's
# arguments: 8 at most): what a file nests beyond this is refused before it is built.
MAX_DEPTH = 32
# Integers are checked by field later (seeds: 64 bits); beyond this many bits one cannot even be
# printed (Python refuses int -> str past 4300 digits), so it is refused here, by its size.
MAX_INT_BITS = 4096

# What a trace or a saved replay calls while it is unpickled: the tensor rebuilders and OrderedDict
# (torch.save writes tensors' hooks as one). The meta rebuilder allocates nothing and lets the
# validator name the field of a meta tensor.
CALLABLES = frozenset({
    "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3", "torch._utils _rebuild_meta_tensor_no_storage",
    "collections OrderedDict",
})  # fmt: skip
# Globals a pickle may name without calling them: storage classes and dtypes (a storage's type in a
# persistent id, a tensor's dtype), devices.
DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
with warnings.catch_warnings():  # the typed storage classes warn that they are deprecated when touched
    warnings.simplefilter("ignore")
    STORAGE_TYPES = frozenset(name for name in dir(torch) if name.endswith("Storage") and isinstance(getattr(torch, name, None), type))
    # Bytes per element of what a persistent id names: a typed storage class or a dtype (UntypedStorage: 1).
    ITEM_SIZES = {name: getattr(torch, name).dtype.itemsize for name in STORAGE_TYPES if isinstance(getattr(getattr(torch, name), "dtype", None), torch.dtype)}
    ITEM_SIZES.update({name: getattr(torch, name).itemsize for name in DTYPES})

# What torch's weights_only unpickler allows outside torch (it runs no code, but may allocate).
_HARMLESS_ELSEWHERE = {("builtins", "bytearray"), ("builtins", "set"), ("builtins", "complex"), ("_codecs", "encode"), ("collections", "Counter")}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
_INTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_MUTATORS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}  # change the container below them
_CALLS = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}


class _Item:
    """What the walk knows of one object the pickle would build: its nesting depth, and for small
    scalars, tuples and globals the value (to read persistent ids and global names)."""

    __slots__ = ("depth", "value", "children", "global_name")

    def __init__(self, depth: int = 0, value: Any = None, children: list[_Item] | None = None, global_name: str | None = None):
        self.depth, self.value, self.children, self.global_name = depth, value, children, global_name


_MARK = _Item(depth=-1)


def read_archive(raw: bytes) -> Any:
    """Check `raw` as above, then `torch.load` it on the CPU. TraceError on the first problem
    (the caller adds the path); what torch.load itself raises is left to the caller."""
    if not raw.startswith(b"PK"):
        if raw.startswith(b"\x80"):  # a plain pickle or the legacy format: their storages are sized by the pickle
            scan_pickle(_first_pickle(raw), records=None)  # a pickle that would run code says so
            raise TraceError("file", "a plain pickle or a legacy torch file (torch < 1.6), not a torch.save archive: refused")
        return None  # not a torch file at all: the caller says what it starts with
    records = _zip_records(raw)
    for name in records.pickles:
        scan_pickle(records.read(name), records=records)
    with warnings.catch_warnings():  # torch warns about pickle protocols; the error says enough
        warnings.simplefilter("ignore")
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    check_structure(data)
    return data


class _Records:
    """The members of a torch zip archive, from its central directory."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str):
        self.archive = archive
        self.prefix = prefix
        self.sizes = {info.filename: info.file_size for info in archive.infolist()}
        self.pickles = [name for name in self.sizes if name.endswith(".pkl")]

    def read(self, name: str) -> bytes:
        try:
            return self.archive.read(name)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise TraceError("file", f"a damaged torch archive: member {printable(name)}: {_first_line(e)}") from None

    def storage_size(self, key: str) -> int | None:
        return self.sizes.get(f"{self.prefix}/data/{key}")


def _zip_records(raw: bytes) -> _Records:
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, UnicodeDecodeError) as e:
        raise TraceError("file", f"a damaged torch archive ({_first_line(e)})") from None
    if not infos:
        raise TraceError("file", "an empty zip archive, not a torch.save file")
    seen: set[str] = set()
    for info in infos:
        name = printable(info.filename)
        if info.filename in seen:
            raise TraceError("file", f"a damaged torch archive: member {name} appears twice")
        seen.add(info.filename)
        if info.flag_bits & 0x1:
            raise TraceError("file", f"a damaged torch archive: member {name} is marked encrypted")
        if info.compress_type != zipfile.ZIP_STORED:
            method = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(info.compress_type, f"method {info.compress_type}")
            raise TraceError("file", f"member {name} is compressed ({method}); torch.save stores every member as is: refused")
        if info.file_size > len(raw) or info.compress_size > len(raw):
            raise TraceError("file", f"a damaged torch archive: member {name} claims {info.file_size} bytes in a file of {len(raw)}")
    # torch reads `<first member's folder>/data.pkl` (PyTorchStreamReader's archive name).
    prefix = infos[0].filename.split("/", 1)[0]
    records = _Records(archive, prefix)
    if f"{prefix}/data.pkl" not in records.sizes:
        raise TraceError("file", f"a zip archive without {printable(prefix)}/data.pkl: not a torch.save file")
    return records


def _first_pickle(raw: bytes) -> bytes:
    """The bytes of the first pickle in `raw` (up to its STOP), or all of it when it has none."""
    try:
        for op, _, pos in pickletools.genops(raw):
            if op.name == "STOP":
                return raw[: pos + 1]
    except (ValueError, EOFError, UnicodeDecodeError, OverflowError, MemoryError):
        pass
    return raw


def scan_pickle(data: bytes, records: _Records | None) -> None:
    """Walk the opcodes of one pickle as its unpickler would, building nothing: TraceError on a
    global or call outside what traces hold, nesting beyond MAX_DEPTH, a storage larger than its
    record, or a pickle that is not well formed."""
    stack: list[_Item] = []
    memo: dict[Any, _Item] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            _step(op, arg, stack, memo, records)
    except TraceError:
        raise
    except (ValueError, EOFError, UnicodeDecodeError, OverflowError, IndexError, KeyError) as e:
        raise TraceError("file", f"a damaged pickle in the torch archive ({type(e).__name__}: {_first_line(e)})") from None


def _step(op: pickletools.OpcodeInfo, arg: Any, stack: list[_Item], memo: dict[Any, _Item], records: _Records | None) -> None:
    name = op.name
    if name in _MEMO_PUT or name == "MEMOIZE":
        if not stack or stack[-1] is _MARK:
            raise ValueError(f"{name} with nothing to remember")
        memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        return
    if name in _MEMO_GET:
        stack.append(memo[arg])
        return
    if name == "DUP":
        stack.append(stack[-1])
        return
    popped: list[_Item] = []
    for before in reversed(op.stack_before):
        if before is pickletools.stackslice:
            while stack[-1] is not _MARK:
                popped.append(stack.pop())
            stack.pop()
        elif before is pickletools.markobject:
            continue  # taken with its stackslice
        else:
            item = stack.pop()
            if item is _MARK:
                raise ValueError(f"{name} found a mark where it expected an object")
            popped.append(item)
    popped.reverse()  # in stack order: callable before arguments, container before contents
    if name == "GLOBAL":
        stack.append(_global(arg))
        return
    if name == "STACK_GLOBAL":
        module, qualname = popped
        if not (isinstance(module.value, str) and isinstance(qualname.value, str)):
            raise TraceError("file", "a pickle naming a global it computes (STACK_GLOBAL of non-strings): refused")
        stack.append(_global(f"{module.value} {qualname.value}"))
        return
    if name.startswith("EXT"):  # a global by copyreg's extension code: nothing torch.save writes
        raise TraceError("file", f"contains a Python object (extension code {arg}) that would run code when loaded; refused")
    if name in _CALLS:
        called = popped[0] if popped else None
        what = called.global_name if called is not None else None
        if name != "REDUCE" or what not in CALLABLES:
            raise _refused(what or name)
    if name in ("BINPERSID", "PERSID"):
        _check_storage(popped[0], records)
    depth = 1 + max((p.depth for p in popped), default=-1) if popped else 0
    if name in _MUTATORS:
        container, contents = popped[0], popped[1:]
        container.depth = max(container.depth, 1 + max((c.depth for c in contents), default=0))
        depth, pushed = container.depth, [container]
    else:
        pushed = []
        for after in op.stack_after:
            if after is pickletools.markobject:
                pushed.append(_MARK)
            else:
                value = arg if (name in _STRINGS or name in _INTS) else None
                if name in _INTS and isinstance(arg, int) and arg.bit_length() > MAX_INT_BITS:
                    raise TraceError("file", f"an integer of {arg.bit_length()} bits in the pickle, far beyond any field's 64: refused")
                children = popped if name.startswith("TUPLE") else None
                pushed.append(_Item(depth=depth, value=value, children=children))
    if depth > MAX_DEPTH:
        raise TraceError("file", f"nests deeper than {MAX_DEPTH} levels (no trace does): refused before it is built")
    stack.extend(pushed)


def _global(name: str) -> _Item:
    """A GLOBAL: allowed when it is something a trace calls or names, refused otherwise."""
    module, _, attr = name.partition(" ")
    allowed = name in CALLABLES or (module == "torch" and (attr in STORAGE_TYPES or attr in DTYPES or attr == "device"))
    allowed = allowed or name == "torch.storage UntypedStorage"
    if not allowed:
        raise _refused(name)
    return _Item(global_name=name)


def _refused(name: str) -> TraceError:
    module, _, attr = name.partition(" ")
    if module.split(".")[0] == "torch" or (module.replace("__builtin__", "builtins"), attr) in _HARMLESS_ELSEWHERE:
        # torch's weights_only unpickler allows these, but a trace never calls them, and some
        # allocate what the file asks (bytearray(2**34), a quantized tensor's full size).
        return TraceError("file", f"calls {_dotted(name)} while it is loaded, which no attndbg file does (it could allocate without bound); refused")
    return TraceError("file", f"contains a Python object ({_dotted(name)}) that would run code when loaded; refused")


def _check_storage(pid: _Item, records: _Records | None) -> None:
    """A persistent id ('storage', type, key, location, numel): its record must hold numel elements
    (torch allocates the claimed size, then reads the record into it)."""
    parts = pid.children or []
    if len(parts) != 5 or parts[0].value != "storage" or not isinstance(parts[2].value, str) or not isinstance(parts[4].value, int):
        raise TraceError("file", "a damaged torch archive: a storage reference that is not ('storage', type, key, location, size)")
    kind, key, numel = parts[1].global_name or "", parts[2].value, parts[4].value
    attr = kind.partition(" ")[2]
    item_size = ITEM_SIZES.get(attr, 1)
    stored = records.storage_size(key) if records is not None else None
    if stored is None:
        raise TraceError("file", f"a damaged torch archive: storage {printable(key)} has no record")
    if numel < 0 or numel * item_size > stored:
        raise TraceError("file", f"storage {printable(key)} claims {numel} elements ({numel * item_size} bytes) but its record holds {stored} bytes: refused before allocating")


def check_structure(data: Any) -> None:
    """Walk what was loaded, iteratively: containers nested at most MAX_DEPTH deep, no cycles,
    dict keys that are names (str) or numbers small enough to print, no integer past MAX_INT_BITS.
    TraceError names the entry by its dotted path."""
    todo: list[tuple[Any, str, int]] = [(data, "", 0)]
    on_path: set[int] = set()  # the containers enclosing the one walked now: meeting one again is a cycle
    done: set[int] = set()  # containers already walked (one object may sit in two places)
    while todo:
        value, where, depth = todo.pop()
        if depth < 0:  # the marker pushed below: every child of this container is walked
            on_path.discard(id(value))
            continue
        if isinstance(value, bool) or value is None or isinstance(value, (float, str, bytes, torch.Tensor, torch.dtype, torch.device)):
            continue
        if isinstance(value, int):
            if value.bit_length() > MAX_INT_BITS:
                raise TraceError(where or "file", f"an integer of {value.bit_length()} bits, far beyond any field's 64")
            continue
        if depth > MAX_DEPTH:
            raise TraceError(where or "file", f"nests deeper than {MAX_DEPTH} levels (no trace does)")
        if id(value) in on_path:
            raise TraceError(where or "file", "contains itself (a cycle)")
        if id(value) in done:
            continue
        done.add(id(value))
        on_path.add(id(value))
        todo.append((value, where, -1))  # popped after every child: the container is left
        if isinstance(value, dict):
            for key, child in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise TraceError(where or "file", f"has a key of type {type(key).__name__}: keys are names or layer numbers")
                if isinstance(key, int) and key.bit_length() > 64:
                    raise TraceError(where or "file", f"has an integer key of {key.bit_length()} bits: layer numbers fit in 64")
                todo.append((child, f"{where}.{printable(str(key), 120)}" if where else printable(str(key), 120), depth + 1))
        elif isinstance(value, (list, tuple, set, frozenset)):
            todo.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(value))


def _dotted(global_name: str) -> str:
    return printable(global_name.replace(" ", ".", 1))


def _first_line(e: BaseException) -> str:
    return printable((str(e).strip().splitlines() or [type(e).__name__])[0], 200)
