"""Atomic writes: a reader sees the old file or the new one, never half of one; and output
directories that exist only once something was written into them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def torch_save_atomically(data: Any, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file in the same directory, fsync, then rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes files private; these files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def output_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Around a command that writes into the directory `path` (record, import, export): when it
    ends, however it ends, having written nothing there, the directory and the parents made for it
    are removed again if they did not exist before. A failed run leaves no empty folder behind;
    one that existed before is never removed, and nothing that holds a file is."""
    path = Path(path)
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        yield path
    finally:
        for folder in made:
            try:
                folder.rmdir()  # only an empty directory: anything written keeps it
            except OSError:
                break
