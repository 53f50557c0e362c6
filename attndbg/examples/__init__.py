"""What ships with attndbg so that the documentation's examples run from an installed wheel, in an
empty folder: the example traces (`attndbg examples DIR` writes them) and a live engine to record
(`python -m attndbg.examples.transformers_generate`).

The example traces are the `.pt` files of the repository's traces/ folder. The wheel installs that
folder as attndbg/examples/traces (setup.py); a source checkout, editable or on PYTHONPATH, reads
traces/ where it is. Nothing of attndbg is imported here, and no torch: copying files needs neither.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Where the wheel puts traces/ (setup.py's package_dir), and where a checkout has it.
INSTALLED_TRACES = Path(__file__).resolve().parent / "traces"
CHECKOUT_TRACES = Path(__file__).resolve().parents[2] / "traces"


class ExamplesMissing(Exception):
    """This installation carries no example traces (a wheel built without them)."""


class ExamplesRefused(Exception):
    """DIR cannot take the example traces as asked: one line naming the path and why."""


@dataclass(frozen=True)
class WrittenExamples:
    directory: Path
    written: tuple[str, ...]  # file names written by this call
    unchanged: tuple[str, ...]  # already in DIR with the same bytes (a clone's traces/, a second call)


def example_traces() -> tuple[Path, ...]:
    """The shipped example traces, by file name."""
    for folder in (INSTALLED_TRACES, CHECKOUT_TRACES):
        files = tuple(sorted(folder.glob("*.pt"))) if folder.is_dir() else ()
        if files:
            return files
    raise ExamplesMissing(f"no example traces in this installation (looked in {INSTALLED_TRACES} and {CHECKOUT_TRACES})")


def write_examples(directory: str | os.PathLike, *, overwrite: bool = False) -> WrittenExamples:
    """Copy every example trace into `directory` (created if absent; its parent must exist).

    A file of the same name with the same bytes is left as it is. One with other bytes is refused
    before anything is written, unless `overwrite`. A name taken by anything but a regular file (a
    folder, a FIFO, a socket) is always refused, and never opened: reading a FIFO would hang.
    """
    target = Path(directory)
    sources = example_traces()
    if target.exists() and not target.is_dir():
        raise ExamplesRefused(f"{target}: not a folder")
    if not target.exists() and not target.absolute().parent.is_dir():
        raise ExamplesRefused(f"{target}: the folder {target.parent} does not exist")
    to_write, unchanged = [], []
    for source in sources:
        destination = target / source.name
        if not destination.exists() and not destination.is_symlink():
            to_write.append(source)
        elif not stat.S_ISREG(destination.lstat().st_mode):
            raise ExamplesRefused(f"{destination}: there already, and not a regular file")
        elif destination.read_bytes() == source.read_bytes():
            unchanged.append(source.name)
        elif overwrite:
            to_write.append(source)
        else:
            raise ExamplesRefused(f"{destination}: there already, with other content (--overwrite replaces it)")
    # The folder is made only when something goes into it.
    if to_write:
        target.mkdir(exist_ok=True)
    for source in to_write:
        _copy_atomically(source, target / source.name)
    return WrittenExamples(target, tuple(s.name for s in to_write), tuple(unchanged))


def _copy_atomically(source: Path, destination: Path) -> None:
    """A reader of `destination` sees the old file or the whole new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; these are meant to be shared
        os.replace(tmp, destination)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
