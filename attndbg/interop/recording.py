"""Write imported steps as an attndbg recording (a folder with manifest.jsonl), all or nothing: the
steps go to a scratch folder beside the target and move in once every one was read, so bad input
met halfway leaves no half recording behind."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from attndbg.plural import counted
from attndbg.trace.directory import DirectoryRefused, prepare_directory
from attndbg.trace.errors import TraceError
from attndbg.trace.io import MANIFEST, append_to_recording
from attndbg.trace.schema import Trace


@dataclass
class Imported:
    out_dir: Path
    steps: int = 0
    modes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def summary(self, what: str) -> str:
        modes = ", ".join(f"{mode} {n}" for mode, n in sorted(self.modes.items())) or "no steps"
        left = f"; {counted(len(self.notes), 'note')} above (calls left out, or imported as crashed)" if self.notes else ""
        return f"attndbg import {what}: {counted(self.steps, 'step')} in {self.out_dir} ({modes}){left}"


def write_recording(items: Iterable[Trace | str], out_dir: str, *, overwrite: bool) -> Imported:
    """Each Trace becomes a step of `out_dir`; each str is a note on something left out. Nothing is
    created or removed at `out_dir` until every item was read: an import refused halfway (bad
    input) leaves no folder, and an --overwrite one leaves the earlier recording as it was."""
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise TraceError("-o", f"{out_dir} exists and is not a directory")
    if not overwrite and target.is_dir() and any(target.iterdir()):
        raise TraceError("-o", f"{out_dir} already holds files: --overwrite replaces a recording there, or choose another -o")
    result = Imported(out_dir=target)
    # Beside the target when its parent exists (a move, not a copy, at the end), else in the temp dir.
    near = target.absolute().parent
    with tempfile.TemporaryDirectory(prefix=".attndbg-import-", dir=near if near.is_dir() else None) as scratch:
        for item in items:
            if isinstance(item, str):
                result.notes.append(item)
                continue
            append_to_recording(scratch, item)
            result.steps += 1
            result.modes[item.batch.forward_mode.value] += 1
        if not result.steps:
            return result  # nothing to write: no folder either
        try:
            prepare_directory(out_dir, append=False, overwrite=overwrite)
        except DirectoryRefused as e:
            raise TraceError("-o", str(e).removeprefix(f"-o {out_dir}: ")) from None
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(scratch).iterdir()):
            if path.name != MANIFEST:
                shutil.move(str(path), target / path.name)
        shutil.move(str(Path(scratch) / MANIFEST), target / MANIFEST)  # last: a reader never sees steps that are not there yet
    return result
