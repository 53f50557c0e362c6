"""Where a new recording goes: a directory made ready for this run's steps, never mixed silently
with an earlier one. Shared by everything that writes recordings: `attndbg record` (a live engine)
and the importers of other tools' evidence (attndbg/interop).
"""

from __future__ import annotations

import os
from pathlib import Path

from attndbg.plural import counted
from attndbg.trace.io import MANIFEST, read_manifest


class DirectoryRefused(ValueError):
    """The output directory cannot take this run's steps; the message names the option (-o,
    --append, --overwrite) and what to do instead."""


def prepare_directory(out_dir: str | os.PathLike, *, append: bool, overwrite: bool) -> str:
    """Make `out_dir` ready for a new run and return the step files' name prefix.

    Two runs never mix silently: a directory holding anything is refused unless the user says
    --append (this run's files get a fresh `run<N>_` prefix, so no step of the earlier run is
    overwritten) or --overwrite (the earlier recording's manifest and step files are deleted;
    a directory holding other files is never emptied).
    """
    if append and overwrite:
        raise DirectoryRefused("--append and --overwrite exclude each other")
    directory = Path(out_dir)
    if directory.exists() and not directory.is_dir():
        raise DirectoryRefused(f"-o {out_dir}: exists and is not a directory")
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not present:
        return ""
    ours = [n for n in present if n == MANIFEST or n.endswith(".pt")]
    if overwrite:
        others = [n for n in present if n not in ours]
        if others:
            raise DirectoryRefused(f"-o {out_dir}: holds files that are not a recording ({', '.join(others[:3])}); choose another directory")
        for name in ours:
            (directory / name).unlink()
        return ""
    if append:
        run = 2
        while any(n.startswith(f"run{run}_") for n in present):
            run += 1
        return f"run{run}_"
    steps = len(read_manifest(directory)) if MANIFEST in present else 0
    held = f"a recording ({counted(steps, 'step')})" if MANIFEST in present else counted(len(present), "file")
    raise DirectoryRefused(f"-o {out_dir}: already holds {held}; add --append to add to it, --overwrite to replace it, or choose another -o")
