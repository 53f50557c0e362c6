"""CUPTI's buffers as memory (buffers.py), without CUPTI: the callbacks called as CUPTI calls them,
`cuptiActivityGetNextRecord` stood in for by a walk over records of known sizes."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from attndbg.timeline import buffers
from attndbg.timeline.buffers import Buffers

# (kind, payload) records: 8-byte aligned, each a different size, as CUPTI's kinds are
RECORDS = [(10, b"kernel-record-bytes!"), (5, b"api"), (20, b"external-id-record"), (99, b"")]


def _laid_out() -> tuple[bytes, list[int]]:
    data, offsets = b"", []
    for kind, payload in RECORDS:
        offsets.append(len(data))
        record = struct.pack("=I", kind) + payload
        data += record + b"\0" * (-len(record) % 8)
    return data, offsets


class _Walk:
    """cuptiActivityGetNextRecord over `offsets`: the record after *record (NULL: the first)."""

    def __init__(self, offsets: list[int], fail_after: int | None = None):
        self.offsets, self.fail_after = offsets, fail_after

    def __call__(self, buffer: int, valid: int, where: Any) -> int:
        record: ctypes.c_void_p = where._obj
        index = 0 if record.value is None else self.offsets.index(record.value - buffer) + 1
        if self.fail_after is not None and index >= self.fail_after:
            return 3  # CUPTI_ERROR_INVALID_CONTEXT, say
        if index >= len(self.offsets):
            return buffers.CUPTI_ERROR_MAX_LIMIT_REACHED
        record.value = buffer + self.offsets[index]
        return buffers.CUPTI_SUCCESS


def _cupti_fills(b: Buffers, data: bytes) -> int:
    """CUPTI asks for a buffer, writes `data` at its start; returns the address it was given."""
    address, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(7)
    b._request(ctypes.pointer(address), ctypes.pointer(size), ctypes.pointer(most))
    assert address.value % buffers.ALIGN == 0 and size.value == buffers.BUFFER_BYTES and most.value == 0
    ctypes.memmove(address.value, data, len(data))
    return address.value


def test_a_completed_buffer_is_handed_on_as_bytes_and_offsets_and_given_back() -> None:
    data, offsets = _laid_out()
    got: list[tuple[bytes, list[int]]] = []
    b = Buffers(None, lambda d, o: got.append((d, o)), next_record=_Walk(offsets), register=False)
    address = _cupti_fills(b, data)
    assert b.held == 1
    b._complete(None, 0, address, buffers.BUFFER_BYTES, len(data))
    assert got == [(data, offsets)] and b.held == 0 and b.problems == []
    assert [struct.unpack_from("=I", got[0][0], o)[0] for o in got[0][1]] == [kind for kind, _ in RECORDS]


def test_an_empty_buffer_is_given_back_unread() -> None:
    got: list[Any] = []
    b = Buffers(None, lambda d, o: got.append(o), next_record=_Walk([]), register=False)
    b._complete(None, 0, _cupti_fills(b, b""), buffers.BUFFER_BYTES, 0)
    assert got == [] and b.held == 0


def test_what_goes_wrong_in_a_callback_is_kept_never_raised_into_cupti() -> None:
    data, offsets = _laid_out()
    got: list[list[int]] = []
    b = Buffers(None, lambda d, o: got.append(o), next_record=_Walk(offsets, fail_after=2), register=False)
    b._complete(None, 0, _cupti_fills(b, data), buffers.BUFFER_BYTES, len(data))
    assert got == [offsets[:2]]  # the records before the error are read
    assert b.problems == ["cuptiActivityGetNextRecord returned CUPTI error 3 after 2 records of a buffer"]

    def broken(d: bytes, o: list[int]) -> None:
        raise ValueError("unpack requires a buffer of 40 bytes")

    b = Buffers(None, broken, next_record=_Walk(offsets), register=False)
    b._complete(None, 0, _cupti_fills(b, data), buffers.BUFFER_BYTES, len(data))
    assert b.problems == ["a CUPTI buffer's records were lost: ValueError: unpack requires a buffer of 40 bytes"] and b.held == 0
