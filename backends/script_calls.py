"""Where an adapter's kernel-library calls go while `attndbg repro` writes a script of them.

`attndbg repro` writes the calls an adapter makes, read from the adapter's own code run once on the
host: inside `recording_into(library)` every adapter looks its library up here instead of importing
it (`flashinfer_module()`, the Triton adapter's kernels), so its calls land on `library`, a
recorder standing in for the library's top module; and it chooses what it would choose on the
script's machine, not this one (`scripting()`: fa3 runs FlashInfer's backend="fa3" on SM90, mla
FlashInfer's MLA wrapper with its kernel family picked where the script runs, no wait on a GPU
stream). Outside it, nothing changes: every adapter calls its real library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_library: ContextVar[Any] = ContextVar("attndbg_script_library", default=None)
_scripting: ContextVar[bool] = ContextVar("attndbg_scripting", default=False)


class ScriptExpression(str):
    """A value the script computes where it runs (written as this expression, not as a literal)."""

    def __repr__(self) -> str:
        return str(self)


@contextlib.contextmanager
def recording_into(library: Any) -> Iterator[None]:
    """While open, adapters call `library` instead of their kernel library (None: nothing is called,
    only the choices are the script's: for reading a plan or a capability as the script will)."""
    library_token, scripting_token = _library.set(library), _scripting.set(True)
    try:
        yield
    finally:
        _library.reset(library_token)
        _scripting.reset(scripting_token)


def scripting() -> bool:
    """A script's calls are being recorded: choose as the script's machine would, touch no GPU."""
    return _scripting.get()


def stand_in() -> Any:
    """The recorder calls go to, or None when the real library is called."""
    return _library.get()


def flashinfer_module() -> Any:
    """`flashinfer`, or its stand-in while a script's calls are recorded."""
    library = stand_in()
    if library is not None:
        return library.flashinfer
    import flashinfer

    return flashinfer
