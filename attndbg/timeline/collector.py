"""Collect CUPTI activity records in this process: the one module that touches `cupti`
(cupti-python, NVIDIA's Python bindings of CUPTI's C API: `pip install 'attndbg[timeline]'`).

What it enables: CONCURRENT_KERNEL (each kernel's GPU start/end, stream, graph and node id),
RUNTIME and DRIVER (the API calls, whose correlation id the kernel carries; only the calls that
launch a kernel or a graph are recorded, `_only_launches`), EXTERNAL_CORRELATION
(which attndbg range each call was made in) and MARKER / MARKER_DATA (the NVTX ranges, as nsys would
see them). Each attndbg phase (`profiling.phase`) pushes its own external correlation id while it
is open, so every API call made in it is tied to it by CUPTI itself (`matching.py`).

NVTX reaches CUPTI only through `NVTX_INJECTION64_PATH`, read by NVTX at the process's first NVTX
call, and it must name the very libcupti.so that cupti-python loaded: torch's environment ships its
own copy, and naming the system one gave zero range records (measured on the H100). So
the path is taken from this process's mappings (/proc/self/maps) once CUPTI is loaded, and set
before the first phase pushes its range.

Records arrive in buffers and are copied into ours inside the callback (`convert.py`: only what a
timeline places, read from memory at the offsets of cupti-python's dtypes for the record kinds
`_record_types` names). The buffers' callbacks are registered through CUPTI's C API (buffers.py),
so that no Python object is built per record; where this cupti-python lacks a layout, or the C
registration fails, through cupti-python's `activity_register_callbacks`, whose record objects are
read instead (slower; the timeline's notes say so).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from attndbg.timeline.buffers import BUFFER_BYTES, Buffers
from attndbg.timeline.convert import Converter, Kinds, LaunchExternalIds, RecordTypes
from attndbg.timeline.records import ProcessRecords, Range, launches_graph, launches_kernel

INJECTION_VARIABLE = "NVTX_INJECTION64_PATH"
# Callback ids are dense from 1 in each API domain (cupti_runtime_cbid.h, cupti_driver_cbid.h):
# this many unnamed ids in a row end the domain; the cap bounds the walk whatever CUPTI answers.
CBID_GAP = 16
CBID_CAP = 8192



def loaded_cupti() -> str | None:
    """The path of the libcupti.so mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libcupti.so"):
                    return parts[5].strip()
    except OSError:
        return None
    return None


def _record_types(cupti: Any) -> RecordTypes:
    """The record classes this cupti-python delivers for the kinds enabled, with their C layouts,
    for `convert.py` to read from memory. A class or dtype of another name (another cupti-python's
    struct version) is left out: its records are read by attribute, slower but all there."""

    def known(cls_name: str, dtype_name: str) -> tuple[type, Any] | None:
        cls, dtype = getattr(cupti, cls_name, None), getattr(cupti, dtype_name, None)
        return None if cls is None or dtype is None else (cls, dtype)

    return RecordTypes(
        kernel=known("ActivityKernel10", "activity_kernel10_dtype"),
        api=known("ActivityAPI", "activity_api_dtype"),
        external_correlation=known("ActivityExternalCorrelation", "activity_external_correlation_dtype"),
        marker=known("ActivityMarker2", "activity_marker2_dtype"),
    )


class Collector:
    """One process's collection: `start()` before the first phase, then `profiling.observe(it)`;
    `take()` whenever the records so far are wanted (flushes CUPTI first), `stop()` at the end."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Lock()
        self._batch = ProcessRecords(pid=os.getpid(), label=label)
        self._open: list[Range] = []  # this process's open ranges (attndbg launches from one thread)
        self._next_id = 1
        self._cupti: Any = None
        self._kinds: list[Any] = []
        self._external_ids = LaunchExternalIds()
        self._converter: Converter | None = None
        self._buffers: Buffers | None = None  # CUPTI's buffers, registered by us (else cupti-python's objects)
        self._external_kind = 0  # ExternalCorrelationKind.CUSTOM0, read in start()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        from cupti import cupti  # the optional dependency: imported here only

        self._cupti = cupti
        kinds = cupti.ActivityKind
        self._external_kind = int(cupti.ExternalCorrelationKind.CUSTOM0)
        domains = cupti.CallbackDomain
        self._converter = Converter(
            Kinds(
                kernel=int(kinds.CONCURRENT_KERNEL), runtime=int(kinds.RUNTIME), driver=int(kinds.DRIVER),
                external_correlation=int(kinds.EXTERNAL_CORRELATION), marker=int(kinds.MARKER),
                external_kind=self._external_kind, thread_object=int(cupti.ActivityObjectKind.THREAD),
            ),
            callback_name=lambda runtime, cbid: cupti.get_callback_name(domains.RUNTIME_API if runtime else domains.DRIVER_API, cbid),
            record_types=_record_types(cupti),
        )
        # Callbacks before enabling: CUPTI asks for a buffer as soon as a kind is on.
        self._register_buffers(cupti)
        self._kinds = [kinds.CONCURRENT_KERNEL, kinds.RUNTIME, kinds.DRIVER, kinds.EXTERNAL_CORRELATION, kinds.MARKER, kinds.MARKER_DATA]
        for kind in self._kinds:
            cupti.activity_enable(kind)
        self._only_launches(cupti)  # after activity_enable, which resets the per-call switches
        self._inject_nvtx()

    def _register_buffers(self, cupti: Any) -> None:
        """CUPTI's buffers read as memory (buffers.py), where this cupti-python gives a layout for
        every kind placed; else through cupti-python's record objects, and the timeline says so."""
        assert self._converter is not None
        why = "this cupti-python has no layout for one of the record kinds placed" if not self._converter.reads_buffers else ""
        if not why:
            cupti.get_timestamp()  # a first call into libcupti, which loads it: its path is what we register on
            library = loaded_cupti()
            if library is None:
                why = "CUPTI's library is not mapped in this process"
            else:
                try:
                    self._buffers = Buffers(library, self._completed_buffer)
                    return
                except (OSError, AttributeError) as e:  # AttributeError: a libcupti without the function
                    why = f"{type(e).__name__}: {e}"
        self._note(f"CUPTI's records are read through cupti-python's objects, a slower --timeline ({why})")
        cupti.activity_register_callbacks(self._requested, self._completed)

    def _only_launches(self, cupti: Any) -> None:
        """Switch off the RUNTIME and DRIVER records of every call that launches neither a kernel
        nor a graph. torch makes many calls per launch (device, stream and capture queries, error
        checks), and each recorded one costs CUPTI a record and us a Python object in the buffer
        callback, where it places nothing (convert.py drops it). Kept: the launches, whose
        correlation id a kernel carries, and cudaGraphLaunch, which a replay's kernels carry."""
        domains = cupti.CallbackDomain
        switches = [(domains.RUNTIME_API, getattr(cupti, "activity_enable_runtime_api", None)), (domains.DRIVER_API, getattr(cupti, "activity_enable_driver_api", None))]
        if any(switch is None for _, switch in switches):
            self._note("this cupti-python cannot record single API calls: every runtime and driver call is recorded (a slower --timeline)")
            return
        for domain, switch in switches:
            misses, cbid = 0, 1
            while misses < CBID_GAP and cbid < CBID_CAP:
                try:
                    name = cupti.get_callback_name(domain, cbid)
                except cupti.cuptiError:  # an id past the domain's last
                    name = None
                if not name:
                    misses += 1
                else:
                    misses = 0
                    if not (launches_kernel(name) or launches_graph(name)):
                        switch(cbid, 0)
                cbid += 1

    def _inject_nvtx(self) -> None:
        path = loaded_cupti()
        current = os.environ.get(INJECTION_VARIABLE)
        if path is None:
            self._note("CUPTI's library is not mapped in this process: NVTX ranges will not reach it")
        elif current is None:
            os.environ[INJECTION_VARIABLE] = path
        elif os.path.realpath(current) != os.path.realpath(path):
            self._note(f"{INJECTION_VARIABLE}={current} is not the libcupti cupti-python loaded ({path}): NVTX ranges go there, not here")

    def take(self) -> ProcessRecords:
        """The records collected since the last take (CUPTI flushed first; ranges still open stay)."""
        if self._cupti is not None:
            self._cupti.activity_flush_all(int(self._cupti.ActivityFlag.FLUSH_FORCED))  # buffers not yet full too
        if self._buffers is not None:
            while self._buffers.problems:
                self._note(self._buffers.problems.pop(0))
        with self._lock:
            batch, self._batch = self._batch, ProcessRecords(pid=os.getpid(), label=self.label)
            # A kernel's own correlation id counts too: a launch call of a name we do not know still places its kernel.
            launched = [c.correlation_id for c in batch.api_calls] + [k.correlation_id for k in batch.kernels]
            batch.external_ids = self._external_ids.keep(batch.external_ids, launched)
        return batch

    @property
    def depth(self) -> int:
        """How many phases are open now."""
        return len(self._open)

    def stop(self) -> ProcessRecords:
        batch = self.take()
        if self._cupti is not None:
            for kind in self._kinds:
                self._cupti.activity_disable(kind)
            if self._buffers is not None:
                # Every buffer back from CUPTI now, while Python runs: our callback must not be
                # called after the interpreter has gone (CUPTI's own teardown would flush the rest).
                # What came back after the take above is dropped: nothing is recorded any more.
                self._cupti.activity_flush_all(int(self._cupti.ActivityFlag.FLUSH_FORCED))
        return batch

    def _note(self, text: str) -> None:
        with self._lock:
            if text not in self._batch.notes:
                self._batch.notes.append(text)

    # -- profiling observer: one external correlation id per open phase --------------------------

    def push(self, message: str) -> None:
        cupti = self._cupti
        range_id = self._next_id
        self._next_id += 1
        parent = self._open[-1].id if self._open else None
        cupti.activity_push_external_correlation_id(self._external_kind, range_id)
        self._open.append(Range(id=range_id, parent=parent, message=message, thread_id=threading.get_native_id(), start=cupti.get_timestamp(), end=0))

    def pop(self) -> None:
        cupti = self._cupti
        end = cupti.get_timestamp()
        cupti.activity_pop_external_correlation_id(self._external_kind)
        opened = self._open.pop()
        closed = Range(id=opened.id, parent=opened.parent, message=opened.message, thread_id=opened.thread_id, start=opened.start, end=end)
        with self._lock:
            self._batch.ranges.append(closed)

    # -- CUPTI buffers ------------------------------------------------------------------------------

    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0  # the same size as our own buffers; 0: as many records as fit

    def _completed_buffer(self, data: bytes, offsets: list[int]) -> None:
        kept = ProcessRecords(pid=os.getpid(), label=self.label)
        assert self._converter is not None  # set in start(), before CUPTI can deliver a buffer
        self._converter.convert_buffer(data, offsets, kept)
        with self._lock:
            self._batch.extend(kept)

    def _completed(self, activities: list) -> None:
        kept = ProcessRecords(pid=os.getpid(), label=self.label)
        assert self._converter is not None  # set in start(), before CUPTI can deliver a buffer
        self._converter.convert(activities, kept)
        with self._lock:
            self._batch.extend(kept)
