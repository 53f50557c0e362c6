"""The buffer callback's conversion per CUPTI record, on the CPU with real cupti-python objects:
by attribute (each read a numpy record-array field access: what --timeline did before) against
from the record's memory (one struct unpack at cupti-python's dtype offsets, convert._Layout);
and what making each object costs against reading the record from a buffer of records as CUPTI
hands it over (timeline/buffers.py, Converter.convert_buffer).

The objects are cupti-python's own classes (ActivityKernel10, ActivityAPI, ActivityExternalCorrelation,
ActivityMarker2) made with `from_data` over numpy records of its dtypes, names through C strings:
what the callback receives, without a GPU. Each kind is converted alone, best of --repeats, in
us per record; "name" is a kernel name's resolution alone, per record, against a dict by pointer
(not used: see convert._text).

    pip install cupti-python   # no GPU needed
    python bench/cupti_convert_cost.py > cupti_convert_cost_cpu.txt
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import sys
import time
import timeit
from importlib.metadata import version
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cupti import cupti

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.profiling import DOMAIN  # noqa: E402
from attndbg.timeline.collector import _record_types  # noqa: E402
from attndbg.timeline.convert import MARKER_START, Converter, Kinds, _text  # noqa: E402
from attndbg.timeline.records import ProcessRecords  # noqa: E402

K = cupti.ActivityKind
KINDS = Kinds(
    kernel=int(K.CONCURRENT_KERNEL), runtime=int(K.RUNTIME), driver=int(K.DRIVER), external_correlation=int(K.EXTERNAL_CORRELATION),
    marker=int(K.MARKER), external_kind=int(cupti.ExternalCorrelationKind.CUSTOM0), thread_object=int(cupti.ActivityObjectKind.THREAD),
)
MANGLED = b"_ZN7flashinfer24BatchPrefillWithPagedKVCacheKernelILb0ELNS_9MaskModeE0EEEvNS_6ParamsEPKNS_10PagedKVCacheIN3c108BFloat16EiEE"
STRINGS = [ctypes.create_string_buffer(s) for s in (MANGLED, b"attndbg/run step=0 mode=DECODE bs=3 backend=triton variant=eager", DOMAIN.encode())]
NAME, MESSAGE, OURS = (ctypes.addressof(s) for s in STRINGS)


def _records(cls: type, dtype: Any, count: int, **fields: Any) -> list[Any]:
    data = np.zeros(count, dtype=dtype)
    for name, value in fields.items():
        data[name] = value
    data["correlation_id" if "correlation_id" in dtype.fields else "id"] = np.arange(count)
    made = [cls.from_data(data[i : i + 1]) for i in range(count)]
    for record in made:  # never freed: cupti-python's __dealloc__ of an object not from a CUPTI buffer prints a KeyError
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(record))
    return made


KEPT: list[list[Any]] = []  # objects from_data made in a timing: never freed, as _records' (their __dealloc__ prints a KeyError)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(KEPT))  # one reference no one drops, even at exit


def _best(run: Callable[[], Any], count: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=5000, help="records of each kind")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n = args.records
    thread = int(cupti.ActivityObjectKind.THREAD)
    kinds = {
        "kernel": _records(cupti.ActivityKernel10, cupti.activity_kernel10_dtype, n, kind=KINDS.kernel, name=NAME, device_id=0, stream_id=7,
                           start=10**12, end=10**12 + 5000, graph_id=4, graph_node_id=9),
        "launch call": _records(cupti.ActivityAPI, cupti.activity_api_dtype, n, kind=KINDS.runtime, cbid=211, start=10**12, end=10**12 + 300, thread_id=140001),
        "external id": _records(cupti.ActivityExternalCorrelation, cupti.activity_external_correlation_dtype, n, kind=KINDS.external_correlation,
                                external_kind=KINDS.external_kind, external_id=12),
        "marker": _records(cupti.ActivityMarker2, cupti.activity_marker2_dtype, n, kind=KINDS.marker, flags_=MARKER_START, timestamp=10**12,
                           object_kind=thread, name=MESSAGE, domain=OURS),
    }
    names = {(True, 211): "cudaLaunchKernel_v7000"}
    by_attribute = Converter(KINDS, callback_name=lambda runtime, cbid: names[(runtime, cbid)])
    by_memory = Converter(KINDS, callback_name=lambda runtime, cbid: names[(runtime, cbid)], record_types=_record_types(cupti))
    print(f"cupti-python {version('cupti-python')}, numpy {np.__version__}, Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(f"{n} records of each kind, best of {args.repeats}, us per record (convert into a ProcessRecords, the named tuples included)")
    print(f"{'':12s} {'attributes':>11s} {'memory':>8s} {'x':>6s}")
    for label, records in kinds.items():
        old_out, new_out = ProcessRecords(pid=1, label="b"), ProcessRecords(pid=1, label="b")
        by_attribute.convert(records, old_out)
        by_memory.convert(records, new_out)
        assert old_out == new_out and not new_out.empty(), label
        old = _best(lambda: by_attribute.convert(records, ProcessRecords(pid=1, label="b")), n, args.repeats)
        new = _best(lambda: by_memory.convert(records, ProcessRecords(pid=1, label="b")), n, args.repeats)
        print(f"{label:12s} {old:11.2f} {new:8.2f} {old / new:6.1f}")
    # CUPTI's buffer read as memory (buffers.py + Converter.convert_buffer) against the objects: the
    # records' bytes one after another, as in CUPTI's buffer, and what making the objects costs
    # (cupti-python's from_data over each record's numpy row: a stand-in for the construction its
    # buffer callback does per record, itself not timed here: it needs CUPTI to hand it a buffer).
    print(f"{'':12s} {'from_data':>11s} {'buffer':>8s}   (us per record: making the object alone; reading it from a buffer of records)")
    for label, records in kinds.items():
        rows = [r._data for r in records]
        data = b"".join(row.tobytes() for row in rows)
        offsets = [i * rows[0].dtype.itemsize for i in range(n)]
        from_buffer = ProcessRecords(pid=1, label="b")
        by_memory.convert_buffer(data, offsets, from_buffer)
        by_objects = ProcessRecords(pid=1, label="b")
        by_memory.convert(records, by_objects)
        assert from_buffer == by_objects, label
        cls = type(records[0])
        made = _best(lambda: KEPT.append([cls.from_data(row) for row in rows[:1000]]), 1000, args.repeats)
        read = _best(lambda: by_memory.convert_buffer(data, offsets, ProcessRecords(pid=1, label="b")), n, args.repeats)
        print(f"{label:12s} {made:11.2f} {read:8.2f}")
    pointers, cache = [NAME] * n, {NAME: MANGLED.decode()}
    resolve = _best(lambda: [_text(p) for p in pointers], n, args.repeats)
    cached = _best(lambda: [cache[p] for p in pointers], n, args.repeats)
    print(f"name: string_at + decode {resolve:.2f} us, a dict by pointer {cached:.2f} us ({len(MANGLED)} characters)")
    one = kinds["kernel"][0]
    reads = {expression: min(timeit.repeat(expression, globals={"a": one}, number=n, repeat=args.repeats)) / n * 1e6 for expression in ("a.kind", "a.start", "a.name", "a.ptr", "a._data", "type(a)")}
    print("one read of a kernel record: " + ", ".join(f"{expression} {cost:.2f} us" for expression, cost in reads.items()))


if __name__ == "__main__":
    main()
