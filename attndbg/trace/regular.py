"""Read an untrusted input file only when it is a regular file: a FIFO, a character or block device
or a socket where a trace, a manifest or an imported file is expected is refused at once, never read.

Why it matters: opening a FIFO for reading blocks until some process opens it for writing (the
command hangs), /dev/zero never ends, /dev/stdin waits on a terminal. The file is opened without
blocking (O_NONBLOCK: a FIFO's open returns at once) and judged by `fstat` of what was opened, so a
file swapped for a FIFO between a look and the open is still refused.
"""

from __future__ import annotations

import os
import stat

from attndbg.trace.errors import TraceError

def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def refusal(mode: int) -> str:
    """The message for a file of this st_mode that is not a regular file."""
    return f"is {_kind(mode)}, not a regular file: refused"


def regular_size(path: str | os.PathLike, *, limit: int | None = None) -> int:
    """The size of `path`, a regular file of at most `limit` bytes; any other is a TraceError naming it."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise TraceError("file", f"cannot read ({e.strerror or e})", str(path)) from None
    if not stat.S_ISREG(info.st_mode):
        raise TraceError("file", refusal(info.st_mode), str(path))
    if limit is not None and info.st_size > limit:
        raise TraceError("file", f"is {info.st_size} bytes, more than the {limit} read here", str(path))
    return info.st_size


def read_regular(path: str | os.PathLike, *, limit: int | None = None) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (see the module docstring)."""
    regular_size(path, limit=limit)  # a socket cannot be opened at all: say what it is first
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise TraceError("file", f"cannot read ({e.strerror or e})", str(path)) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):  # swapped since the look above
            raise TraceError("file", refusal(info.st_mode), str(path))
        if limit is not None and info.st_size > limit:
            raise TraceError("file", f"is {info.st_size} bytes, more than the {limit} read here", str(path))
        try:
            return f.read()
        except OSError as e:
            raise TraceError("file", f"cannot read ({e.strerror or e})", str(path)) from None
