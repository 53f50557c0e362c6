"""Fuzz the bad-input contract: mutated traces and recordings through `check`, `replay`, `show`, `diff`.

    python bench/fuzz.py --cases 10000 --seed 0 --json fuzz.json

Contract: bad input gets exit 2 and one line naming the field; a valid-but-odd trace
gets 0, 1 or 3; never a traceback, a hang, an out-of-memory kill or code execution. Every case is
run by worker processes (`CliRunner`, in-process, so thousands of cases take minutes) that have an
address-space limit and an alarm: an allocation past the limit is an `oom`, a command past the
alarm a `hang`, a worker that dies a `crash`. Hostile pickles would create a marker file if they
ran; its existence is a `code-execution`.

Mutations, each from a shipped trace (`traces/*.pt`) and a case seed:
  bytes       bit flips, truncation, random bytes, a zip with a damaged header
  value       one field of the stored dict set to None, a string, a huge or negative int, 10**400,
              NaN, a nested list, a tensor of the wrong dtype, shape or size, a stride-0 tensor
              claiming a huge size, an empty tensor
  pickle      a pickle that would call os.system / builtins.exec / a torch rebuild with a bad size
  manifest    a recording whose manifest.jsonl has a null/number/list/NUL/path file, invalid UTF-8,
              deep JSON, a missing step
  special     a FIFO, a symlink to /dev/zero
  deep        containers nested 33 to 200,000 deep anywhere: as a dict key (a tuple: hashing one
              3,000,000 deep overflows the C stack), as a field's value, a list that contains itself
  bignum      oversized numbers in any key or field: a 5,000-digit int (past Python's int/str
              limit) or its digits as a string, as a layer key, a dict key or a value; a text LONG opcode
  compressed  the archive's members deflated: intact, with a damaged stream, or a bomb (a
              member inflating to 256 MB from a small file), through every command
  alloc       pickles that allocate from a small file through globals torch's weights_only
              unpickler allows: bytearray(2**34), a storage claiming 2**33 elements, a quantized tensor
  name        a valid or broken trace whose file name holds a newline and a forged
              `error:` line (it must be printed escaped, never raw)
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MARKER = "ATTNDBG_FUZZ_MARKER"
COMMANDS = ("check", "replay", "show", "diff")


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # bytes | value | pickle | manifest | special | deep | bignum | compressed | alloc | name
    path: str  # the file or recording directory under test


# A file name that forges a second `error:` line when printed raw (the `name` family).
FORGED = "FORGED"


# -- mutations ---------------------------------------------------------------------------------


def _fields(d: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, container, key) of every leaf-ish entry of a stored trace dict."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.append((f"{prefix}{k}", d, k))
            out += _fields(v, f"{prefix}{k}.")
    return out


def _bad_values(rng: random.Random, old: Any) -> list[Any]:
    values: list[Any] = [None, "x" * rng.choice([1, 10, 10_000]), 2**33, 2**64, -1, -(2**40), 10**400, float("nan"), float("inf"), [[[[[[1]]]]]], True]
    if isinstance(old, torch.Tensor):
        values += [
            old.to(torch.float32) if old.dtype != torch.float32 else old.to(torch.int64),
            old.reshape(1, -1) if old.numel() else torch.zeros(2, 2),
            torch.zeros(0, dtype=old.dtype),
            torch.zeros(1, dtype=torch.int64).expand(2**31),  # stride 0: a 4-byte file claiming 2**31 elements
            old.flip(0) if old.dim() else old + 1,
            old * 1000 + 7 if old.dtype not in (torch.bool,) else ~old,
        ]
    return values


def mutate_value(rng: random.Random, base: dict) -> tuple[str, dict]:
    data = pickle.loads(pickle.dumps(base))
    fields = _fields(data)
    name, container, key = rng.choice(fields)
    container[key] = rng.choice(_bad_values(rng, container[key]))
    return name, data


def mutate_bytes(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    choice = rng.randrange(4)
    if choice == 0:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return "bit flips", bytes(data)
    if choice == 1:
        return "truncated", raw[: rng.randrange(len(raw))]
    if choice == 2:
        return "random bytes", rng.randbytes(rng.choice([0, 1, 100, 5000]))
    data = bytearray(raw)
    data[6:8] = b"\x01\x00"  # zip local header flags: encrypted
    return "zip flags", bytes(data)


class _Hostile:
    def __init__(self, call: Callable, args: tuple):
        self.call, self.args = call, args

    def __reduce__(self) -> tuple:
        return self.call, self.args


def hostile_pickle(rng: random.Random, marker: Path) -> tuple[str, bytes]:
    choice = rng.randrange(3)
    if choice == 0:
        payload = _Hostile(os.system, (f"touch {marker}",))
        name = "os.system"
    elif choice == 1:
        payload = _Hostile(exec, (f"open({str(marker)!r}, 'w').close()",))
        name = "exec"
    else:
        payload = {"version": 1, "batch": _Hostile(eval, (f"open({str(marker)!r}, 'w')",))}
        name = "eval inside a dict"
    buffer = io.BytesIO()
    torch.save({"x": 1}, buffer)  # a real torch zip, then its pickle replaced
    raw = pickle.dumps(payload, protocol=2)
    return name, raw if rng.random() < 0.5 else _replace_zip_pickle(buffer.getvalue(), raw)


def _replace_zip_pickle(archive: bytes, pickle_bytes: bytes) -> bytes:
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickle_bytes if info.filename.endswith("data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, data)
    return out.getvalue()


# -- hostile archives ----------------------------------------------------------------------------

PLACEHOLDER = "@@attndbg-fuzz@@"


def _pickle_op(text: str) -> bytes:
    """The protocol-2 opcode torch.save writes for a short string: BINUNICODE, its length, its bytes."""
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _saved(data: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def _zip_pickle(archive: bytes) -> bytes:
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(archive))
    return src.read(next(n for n in src.namelist() if n.endswith("data.pkl")))


def _with_placeholder(rng: random.Random, base: dict, as_key: bool) -> tuple[str, dict]:
    """A copy of `base` with PLACEHOLDER as the value of a random field, or as a new key of a random dict."""
    data = pickle.loads(pickle.dumps(base))
    name, container, key = rng.choice(_fields(data))
    if as_key:
        target = container[key] if isinstance(container[key], dict) else container
        target[PLACEHOLDER] = 1
        return f"a key of {name if target is not container else name.rpartition('.')[0] or 'the top level'}", data
    container[key] = PLACEHOLDER
    return name, data


def _nested(rng: random.Random, depth: int, hashable: bool) -> tuple[str, bytes]:
    """Pickle opcodes that build one object nested `depth` deep, without recursion."""
    kind = "tuple" if hashable else rng.choice(["tuple", "list", "dict", "self-containing list"])
    if kind == "tuple":
        return kind, b")" + b"\x85" * depth  # EMPTY_TUPLE, then TUPLE1 around it depth times
    if kind == "list":
        return kind, b"(" * depth + b"l" * depth  # MARK ... LIST: [[[...]]]
    if kind == "dict":
        return kind, (b"(" + _pickle_op("k")) * depth + b"}" + b"d" * depth  # {"k": {"k": ...}}
    memo = (999_999).to_bytes(4, "little")
    return kind, b"]r" + memo + b"j" + memo + b"a"  # EMPTY_LIST, LONG_BINPUT, LONG_BINGET, APPEND: l = [l]


def deep_nesting(rng: random.Random, base: dict) -> tuple[str, bytes]:
    as_key = rng.random() < 0.4
    where, data = _with_placeholder(rng, base, as_key)
    depth = rng.choice([33, 1000, 50_000, 200_000])
    kind, ops = _nested(rng, depth, hashable=as_key)
    archive = _saved(data)
    pickled = _zip_pickle(archive)
    return f"{kind} nested {depth} deep as {where}", _replace_zip_pickle(archive, pickled.replace(_pickle_op(PLACEHOLDER), ops, 1))


def big_number(rng: random.Random, base: dict) -> tuple[str, bytes]:
    digits = rng.choice([400, 4301, 5000, 20_000])
    value: Any = rng.choice([10**digits, -(10**digits), "9" * digits])
    choice = rng.randrange(4)
    if choice == 0:  # a layer key of the tensors section
        data = pickle.loads(pickle.dumps(base))
        data["tensors"] = {value: {}}
        return f"tensors key: {type(value).__name__} of {digits} digits", _saved(data)
    if choice == 1:  # a key of any dict
        data = pickle.loads(pickle.dumps(base))
        name, container, key = rng.choice([f for f in _fields(data) if isinstance(f[1][f[2]], dict)] or _fields(data))
        target = container[key] if isinstance(container[key], dict) else container
        target[value] = 1
        return f"a key of {name}: {type(value).__name__} of {digits} digits", _saved(data)
    where, data = _with_placeholder(rng, base, as_key=False)
    if choice == 2:
        data_field = pickle.loads(pickle.dumps(base))
        name, container, key = rng.choice(_fields(data_field))
        container[key] = value
        return f"{name} = {type(value).__name__} of {digits} digits", _saved(data_field)
    archive = _saved(data)  # a text LONG opcode: int() of its digits fails past 4300 of them
    ops = b"L" + b"9" * digits + b"L\n"
    return f"{where} = text LONG of {digits} digits", _replace_zip_pickle(archive, _zip_pickle(archive).replace(_pickle_op(PLACEHOLDER), ops, 1))


_BOMBS: dict[bytes, bytes] = {}  # base archive -> its bomb (deflating 256 MB takes a second: once per base)


def compressed(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """The archive with its members deflated: intact, one stream damaged, or a bomb."""
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(raw))
    choice = rng.randrange(3)
    if choice == 2 and raw in _BOMBS:
        return "a deflate bomb of 256 MB beside data.pkl", _BOMBS[raw]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if choice == 2 and info.filename.endswith("data.pkl"):
                dst.writestr(info.filename + ".bomb", b"\0" * (256 << 20), compress_type=zipfile.ZIP_DEFLATED)
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED if choice or rng.random() < 0.5 else zipfile.ZIP_STORED)
    archive = bytearray(out.getvalue())
    if choice == 1:  # flip bytes inside one member's deflate stream (its CRC and sizes still claim the original)
        z = zipfile.ZipFile(io.BytesIO(bytes(archive)))
        info = rng.choice([i for i in z.infolist() if i.compress_size > 8])
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        for _ in range(rng.randint(1, 8)):
            archive[start + rng.randrange(info.compress_size)] ^= 1 << rng.randrange(8)
        return f"member {info.filename} deflated, stream damaged", bytes(archive)
    if choice == 2:
        _BOMBS[raw] = bytes(archive)
    return "deflated members" if choice == 0 else "a deflate bomb of 256 MB beside data.pkl", bytes(archive)


def allocating_pickle(rng: random.Random) -> tuple[str, bytes]:
    """Small torch archives whose pickle allocates what it says through allowed globals."""
    choice = rng.randrange(4)
    if choice == 0:
        return "bytearray(2**34)", _replace_zip_pickle(_saved({"x": 1}), b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x00\x04\x85R.")
    if choice == 1:  # a storage of 4 floats whose persistent id claims 2**33 of them
        archive = _saved({"version": 1, "x": torch.zeros(4)})
        pickled = _zip_pickle(archive)
        claim = b"K\x04t"  # BININT1 4, TUPLE: the numel closing the persistent id
        if claim in pickled:
            return "storage claiming 2**33 elements", _replace_zip_pickle(archive, pickled.replace(claim, b"\x8a\x05\x00\x00\x00\x00\x02t", 1))
    if choice == 2:  # _rebuild_qtensor allocates its size before setting the storage
        return "quantized tensor of 2**34 elements", _replace_zip_pickle(
            _saved({"x": 1}),
            b"\x80\x02ctorch._utils\n_rebuild_qtensor\n(ctorch\nUntypedStorage\nK\x00(\x8a\x05\x00\x00\x00\x00\x04\x85(K\x01\x85(ctorch\nper_tensor_affine\nG?\xf0\x00\x00\x00\x00\x00\x00K\x00t\x89ccollections\nOrderedDict\n)Rtq\x00R.",
        )
    return "set() of a list of 10,000 references", _replace_zip_pickle(_saved({"x": 1}), b"\x80\x02cbuiltins\nset\n(N]q\x00" + b"h\x00" * 10_000 + b"l\x85R.")


def bad_manifest(rng: random.Random, directory: Path, step_file: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(step_file, directory / "s0.pt")
    good = {"file": "s0.pt", "step": 0, "mode": "DECODE", "batch_size": 1, "graph": False, "layers": []}
    variants: list[tuple[str, bytes]] = [
        ("file null", json.dumps({**good, "file": None}).encode()),
        ("file number", json.dumps({**good, "file": 7}).encode()),
        ("file list", json.dumps({**good, "file": ["s0.pt"]}).encode()),
        ("file with NUL", json.dumps({**good, "file": "s0\x00.pt"}).encode()),
        ("file outside", json.dumps({**good, "file": "../s0.pt"}).encode()),
        ("file with newline", json.dumps({**good, "file": "s0.pt\nerror: forged"}).encode()),
        ("invalid utf-8", b"\xff\xfe" + json.dumps(good).encode()),
        ("deep json", b"[" * 100_000 + b"]" * 100_000),
        ("missing step", json.dumps({**good, "file": "gone.pt"}).encode()),
        ("step not int", json.dumps({**good, "step": "x"}).encode()),
    ]
    name, line = rng.choice(variants)
    (directory / "manifest.jsonl").write_bytes(json.dumps(good).encode() + b"\n" + line + b"\n")
    return name


def special_file(rng: random.Random, path: Path) -> str:
    """Not a regular file: a FIFO nobody writes (a read blocks forever) or a link to /dev/zero."""
    if rng.random() < 0.5:
        os.mkfifo(path)
        return "fifo"
    path.symlink_to("/dev/zero")
    return "symlink to /dev/zero"


def build_cases(count: int, seed: int, work: Path) -> list[Case]:
    bases = sorted((ROOT / "traces").glob("*.pt"))
    raws = {p: p.read_bytes() for p in bases}
    dicts = {p: torch.load(io.BytesIO(raws[p]), weights_only=True) for p in bases}
    cases = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        base = rng.choice(bases)
        kind = rng.choices(
            ["value", "bytes", "pickle", "manifest", "special", "deep", "bignum", "compressed", "alloc", "name"],
            weights=[48, 20, 4, 7, 1, 6, 6, 4, 2, 2],
        )[0]
        path = work / f"case{i:05d}.pt"
        if kind == "name":  # a file name printed raw would forge a second line
            path = work / f"case{i:05d}\nerror: {FORGED}.pt"
            broken = rng.random() < 0.5
            path.write_bytes(raws[base][: len(raws[base]) // 2] if broken else raws[base])
            name = "newline in the name" + (", truncated" if broken else "")
        elif kind == "deep":
            name, data = deep_nesting(rng, dicts[base])
            path.write_bytes(data)
        elif kind == "bignum":
            name, data = big_number(rng, dicts[base])
            path.write_bytes(data)
        elif kind == "compressed":
            name, data = compressed(rng, raws[base])
            path.write_bytes(data)
        elif kind == "alloc":
            name, data = allocating_pickle(rng)
            path.write_bytes(data)
        elif kind == "value":
            name, data = mutate_value(rng, dicts[base])
            buffer = io.BytesIO()
            torch.save(data, buffer)
            path.write_bytes(buffer.getvalue())
        elif kind == "bytes":
            name, data = mutate_bytes(rng, raws[base])
            path.write_bytes(data)
        elif kind == "pickle":
            name, data = hostile_pickle(rng, work / MARKER)
            path.write_bytes(data)
        elif kind == "manifest":
            path = work / f"case{i:05d}"
            name = bad_manifest(rng, path, base)
        else:
            name = special_file(rng, path)
        cases.append(Case(f"{base.stem}: {kind}: {name}", kind, str(path)))
    return cases


# -- running -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    case: str
    command: str
    verdict: str  # ok | bad-input | traceback | multi-line | wrong-exit | hang | oom | crash
    exit_code: int | None
    seconds: float
    detail: str


def _classify(command: str, exit_code: int, output: str, exception: BaseException | None, recording: bool) -> tuple[str, str]:
    lines = [line for line in output.splitlines() if line.strip()]
    forged = f"error: {FORGED}"
    if any(forged in line and f"\\n{forged}" not in line for line in lines):  # a name with a newline printed raw
        return "raw-name", next(line for line in lines if forged in line)[:200]
    if exception is not None and not isinstance(exception, SystemExit):
        if isinstance(exception, MemoryError):
            return "oom", type(exception).__name__
        return "traceback", f"{type(exception).__name__}: {str(exception)[:160]}"
    if "Traceback (most recent call last)" in output:
        return "traceback", output[-200:]
    if exit_code == 2:
        errors = [line for line in lines if line.startswith("error:")]
        # A recording's valid steps may print their results before a bad one stops the command.
        if len(errors) != 1 or (len(lines) > 3 and not recording):
            return "multi-line", f"{len(lines)} lines"
        return "bad-input", errors[0][:200]
    if "detector failed on this step" in output:
        return "detector-error", next(line for line in lines if "detector failed" in line)[:200]
    if exit_code in (0, 1, 3):
        return "ok", f"exit {exit_code}"
    return "wrong-exit", f"exit {exit_code}: {output[-160:]}"


def _args(command: str, path: str, reference: str) -> list[str]:
    return {
        "check": ["check", path, "--backend", "reference"],
        "replay": ["replay", path, "--backend", "reference"],
        "show": ["show", path],
        "diff": ["diff", path, reference],
    }[command]


class _Alarm(BaseException):
    """A command ran past the fuzzer's alarm."""


def _worker(conn: Any, memory_bytes: int, timeout: int, reference: str) -> None:
    from click.testing import CliRunner

    from attndbg.cli import main

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    torch.set_num_threads(1)

    def on_alarm(*_: Any) -> None:
        raise _Alarm()  # not an OSError (TimeoutError is one): nothing in the code under test may catch it

    signal.signal(signal.SIGALRM, on_alarm)
    runner = CliRunner()
    while True:
        task = conn.recv()
        if task is None:
            return
        case, command = task
        start = time.perf_counter()
        signal.alarm(timeout)
        try:
            result = runner.invoke(main, _args(command, case.path, reference), catch_exceptions=True)
            signal.alarm(0)
            exc = result.exception
            if isinstance(exc, _Alarm):
                verdict, detail = "hang", f"> {timeout} s"
            else:
                verdict, detail = _classify(command, result.exit_code, result.output, exc, Path(case.path).is_dir())
            code = result.exit_code
        except _Alarm:
            verdict, detail, code = "hang", f"> {timeout} s", None
        except MemoryError:
            signal.alarm(0)
            verdict, detail, code = "oom", "MemoryError", None
        conn.send(Outcome(case.name, command, verdict, code, round(time.perf_counter() - start, 3), detail))


def run_cases(cases: list[Case], *, jobs: int, memory_gb: float, timeout: int, reference: str, budget: float | None = None) -> list[Outcome]:
    """Every case through every command; with `budget` (seconds), no new case starts after it, and
    only the cases whose commands all ran are returned."""
    ctx = mp.get_context("spawn")

    def start() -> tuple[Any, Any]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, int(memory_gb * 2**30), timeout, reference), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    tasks = [(case, command) for case in cases for command in COMMANDS]
    workers = [start() for _ in range(jobs)]
    busy: dict[int, tuple[Case, str]] = {}
    outcomes: list[Outcome] = []
    next_task = 0
    from multiprocessing.connection import wait

    began = time.perf_counter()
    while len(outcomes) < len(tasks):
        if budget is not None and next_task < len(tasks) and time.perf_counter() - began > budget:
            tasks = tasks[: -(-next_task // len(COMMANDS)) * len(COMMANDS)]  # out of time: finish the cases begun, start no new one
            continue
        for i, (proc, conn) in enumerate(workers):
            if i not in busy and next_task < len(tasks):
                conn.send(tasks[next_task])
                busy[i] = tasks[next_task]
                next_task += 1
        wait([conn for i, (proc, conn) in enumerate(workers) if i in busy] + [proc.sentinel for i, (proc, conn) in enumerate(workers) if i in busy], timeout=timeout * 3)
        for i, (proc, conn) in enumerate(list(workers)):
            if i not in busy:
                continue
            if conn.poll():
                try:
                    outcomes.append(conn.recv())
                    del busy[i]
                    continue
                except (EOFError, OSError):
                    pass
            if not proc.is_alive():
                case, command = busy.pop(i)
                outcomes.append(Outcome(case.name, command, "crash", proc.exitcode, 0.0, f"worker exit {proc.exitcode}"))
                workers[i] = start()
        print(f"\r{len(outcomes)}/{len(tasks)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for proc, conn in workers:
        conn.send(None)
        proc.join(timeout=5)
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--memory-gb", type=float, default=4.0, help="address-space limit of each worker")
    parser.add_argument("--timeout", type=int, default=60, help="seconds one command may take")
    parser.add_argument("--json", help="write every outcome and the table here")
    parser.add_argument("--minutes", type=float, default=None, help="start no new case after this long; the summary counts the cases that ran")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = build_cases(args.cases, args.seed, work)
        start = time.perf_counter()
        budget = None if args.minutes is None else args.minutes * 60
        outcomes = run_cases(cases, jobs=args.jobs, memory_gb=args.memory_gb, timeout=args.timeout, reference=str(ROOT / "traces" / "decode_gqa.pt"), budget=budget)
        executed = (work / MARKER).exists()
    seconds = time.perf_counter() - start
    table = Counter(o.verdict for o in outcomes)
    bad = [o for o in outcomes if o.verdict == "bad-input"]
    times = sorted(o.seconds for o in bad)
    ran = len(outcomes) // len(COMMANDS)
    kinds = Counter(c.kind for c in cases[:ran])
    print(f"{ran} cases (of {args.cases} built, seed {args.seed}) x {len(COMMANDS)} commands in {seconds:.0f} s; code executed: {executed}")
    print("  by family: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for verdict, count in sorted(table.items(), key=lambda kv: -kv[1]):
        print(f"  {verdict:12s} {count}")
    if times:
        print(f"rejection time: median {times[len(times) // 2]:.3f} s, max {times[-1]:.3f} s")
    broken = [o for o in outcomes if o.verdict not in ("ok", "bad-input")]
    for o in broken[:40]:
        print(f"  {o.verdict:10s} {o.command:6s} {o.case}: {o.detail}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cases": ran, "built": args.cases, "seed": args.seed, "seconds": round(seconds, 1), "code_executed": executed, "table": dict(table),
                        "broken": [o.__dict__ for o in broken]}, indent=1) + "\n"  # fmt: skip
        )
    return 1 if broken or executed else 0


if __name__ == "__main__":
    sys.exit(main())
