"""CUPTI's activity buffers as memory: their callbacks registered through CUPTI's C API (ctypes, on
the libcupti.so cupti-python loaded), each completed buffer handed on as its bytes and its
records' offsets, for `convert.Converter.convert_buffer` to read with cupti-python's own layouts.

Why not cupti-python's `activity_register_callbacks`: it builds a Python object for every record
of a buffer (numpy record views, a few each) before its callback sees the list. On the H200's
server mix that was 390,174 numpy `__array_finalize__` and 2.15 M `__getattribute__` calls in one
worker's 60 steps (bench/check_profile.py inside --timeline), most of what `--timeline` still costs after
attndbg stopped reading the records' attributes. Here a record costs one `cuptiActivityGetNextRecord`
call (which knows each kind's size, whatever struct version CUPTI writes) and one unpack.

    buffers = Buffers(library, on_buffer)   # before the first activity kind is enabled
    ...                                     # CUPTI asks for buffers and returns them, full or flushed

C side (cupti_activity.h):
    void request(uint8_t **buffer, size_t *size, size_t *maxNumRecords)
    void complete(CUcontext ctx, uint32_t streamId, uint8_t *buffer, size_t size, size_t validSize)
    CUptiResult cuptiActivityRegisterCallbacks(request, complete)
    CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t validSize, CUpti_Activity **record)
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

BUFFER_BYTES = 8 << 20  # per buffer; CUPTI asks for another when one fills
ALIGN = 8  # CUPTI's buffers must be 8-byte aligned
CUPTI_SUCCESS = 0
CUPTI_ERROR_MAX_LIMIT_REACHED = 12  # cuptiActivityGetNextRecord: no record after this one

_REQUEST = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
NextRecord = Callable[[int, int, Any], int]  # (buffer, valid bytes, byref(record pointer)) -> CUptiResult


class Buffers:
    """CUPTI's buffer callbacks, ours. `on_buffer(data, offsets)` gets each completed buffer's bytes
    and the offsets of its records, in CUPTI's thread or the one that flushed; `problems` what went
    wrong in a callback (it must never raise into CUPTI)."""

    def __init__(self, library: str | None, on_buffer: Callable[[bytes, list[int]], None], *, next_record: NextRecord | None = None, register: bool = True):
        self._on_buffer = on_buffer
        self._held: dict[int, ctypes.Array] = {}  # aligned address -> the memory behind it, until CUPTI returns it
        self._lock = threading.Lock()
        self.problems: list[str] = []
        # The C callbacks must outlive the registration: kept here.
        self._request_callback = _REQUEST(self._request)
        self._complete_callback = _COMPLETE(self._complete)
        if next_record is None or register:
            cupti = ctypes.CDLL(library or "libcupti.so")
            if next_record is None:
                get_next = cupti.cuptiActivityGetNextRecord
                get_next.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
                get_next.restype = ctypes.c_int
                next_record = get_next
            if register:
                register_callbacks = cupti.cuptiActivityRegisterCallbacks
                register_callbacks.argtypes = [_REQUEST, _COMPLETE]
                register_callbacks.restype = ctypes.c_int
                status = register_callbacks(self._request_callback, self._complete_callback)
                if status != CUPTI_SUCCESS:
                    raise OSError(f"cuptiActivityRegisterCallbacks returned CUPTI error {status}")
        self._next_record = next_record

    def _request(self, buffer: Any, size: Any, max_records: Any) -> None:
        memory = (ctypes.c_uint8 * (BUFFER_BYTES + ALIGN))()
        address = (ctypes.addressof(memory) + ALIGN - 1) & ~(ALIGN - 1)
        with self._lock:
            self._held[address] = memory
        buffer[0] = address
        size[0] = BUFFER_BYTES
        max_records[0] = 0  # as many as fit

    def _complete(self, context: Any, stream_id: int, buffer: int | None, size: int, valid: int) -> None:
        try:
            if buffer and valid:
                data, offsets = self.records(buffer, valid)
                self._on_buffer(data, offsets)
        except Exception as e:  # noqa: BLE001 - an exception must not unwind into CUPTI's C frames
            self.problems.append(f"a CUPTI buffer's records were lost: {type(e).__name__}: {e}")
        finally:
            if buffer:
                with self._lock:
                    self._held.pop(buffer, None)

    def records(self, buffer: int, valid: int) -> tuple[bytes, list[int]]:
        """The buffer's valid bytes (copied: CUPTI reuses the memory) and each record's offset in them."""
        data = ctypes.string_at(buffer, valid)
        offsets: list[int] = []
        append, next_record = offsets.append, self._next_record
        record = ctypes.c_void_p(None)  # NULL: the first record
        where = ctypes.byref(record)
        while True:
            status = next_record(buffer, valid, where)
            if status != CUPTI_SUCCESS:
                break
            append(record.value - buffer)
        if status != CUPTI_ERROR_MAX_LIMIT_REACHED:
            self.problems.append(f"cuptiActivityGetNextRecord returned CUPTI error {status} after {len(offsets)} records of a buffer")
        return data, offsets

    @property
    def held(self) -> int:
        """Buffers handed to CUPTI and not returned yet."""
        return len(self._held)
