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


def without_arguments(name: str) -> str:
    """A demangled name without its return type and argument list (its template arguments kept)."""
    readable = demangle(name).removeprefix("void ")  # a template kernel's demangled name starts with its return type
    return readable[: _argument_list(readable)]


def _argument_list(readable: str) -> int:
    """Where the argument list starts: the first '(' outside template arguments and not of
    '(anonymous namespace)' (len: none)."""
    depth, i = 0, 0
    while i < len(readable):
        if readable.startswith(_ANONYMOUS, i):
            i += len(_ANONYMOUS)
            continue
        char = readable[i]
        if char == "<":
            depth += 1
        elif char == ">" and depth:
            depth -= 1
        elif char == "(" and depth == 0:
            return i
        i += 1
    return len(readable)


def short(name: str, width: int = 60) -> str:
    """A demangled name without its argument list, cut to `width`: what a summary line shows."""
    readable = without_arguments(name)
    return readable if len(readable) <= width else readable[: width - 1] + "…"


def base(name: str) -> str:
    """The kernel's name as its events carry it: demangled, without its return type, template
    arguments or argument list ('at::native::vectorized_elementwise_kernel'); the template
    arguments tell instances apart, and the timeline's kernel table keeps them (chrome.KernelTable)."""
    readable = demangle(name).removeprefix("void ").replace(_ANONYMOUS, "\0")  # its parentheses are no argument list
    out, depth = [], 0
    for char in readable:
        if char == "<":
            depth += 1
        elif char == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(char)
    bare = "".join(out)
    if "(" in bare:
        bare = bare[: bare.index("(")]
    return bare.strip().replace("\0", _ANONYMOUS) or name


_ANONYMOUS = "(anonymous namespace)"


def unqualified(name: str) -> str:
    """`base` without its namespaces and classes ('vectorized_elementwise_kernel'): a kernel's event
    name in the timeline, 26 characters on average against 45 (the replays of traces/ on an H200);
    the qualified name and the template arguments are in the timeline's kernel table."""
    bare = base(name).replace(_ANONYMOUS + "::", "")
    return bare.rsplit("::", 1)[-1] or bare
