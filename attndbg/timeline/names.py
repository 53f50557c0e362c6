"""Kernel names people can read: CUPTI reports C++ kernels mangled (`_ZN10flashinfer...`), as the
driver knows them. Demangled with the C++ runtime's own `__cxa_demangle` (libstdc++, loaded by torch
anyway); a name it cannot read, or a machine without it, keeps the mangled name."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _demangler() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    for name in ("stdc++", "c++"):
        path = ctypes.util.find_library(name)
        if path is None:
            continue
        try:
            func = getattr(ctypes.CDLL(path), "__cxa_demangle")
        except (OSError, AttributeError):
            continue
        func.restype = ctypes.c_void_p  # a malloc'ed string we must free
        func.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        return func
    return None


@functools.cache
def _free() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.free.argtypes = [ctypes.c_void_p]
    return libc.free


@functools.lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """'_Z3addPfS_' -> 'add(float*, float*)'; any other name as it is."""
    if not name.startswith("_Z"):
        return name
    func = _demangler()
    if func is None:
        return name
    status = ctypes.c_int(0)
    pointer = func(name.encode(), None, None, ctypes.byref(status))
    if not pointer or status.value != 0:
        return name
    try:
        return ctypes.string_at(pointer).decode("utf-8", "replace")
    finally:
        _free()(pointer)


def short(name: str, width: int = 60) -> str:
    """A demangled name without its argument list, cut to `width`: what a summary line shows."""
    readable = demangle(name).removeprefix("void ")  # a template kernel's demangled name starts with its return type
    if "(" in readable:
        readable = readable[: readable.index("(")]
    return readable if len(readable) <= width else readable[: width - 1] + "…"
