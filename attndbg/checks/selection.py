"""What `attndbg check` is asked to check: the detectors (`--only`) and the steps of a recording
(`--steps`, `--sample`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors import registry
from attndbg.suggest import did_you_mean
from attndbg.trace import io


def parse_only(spec: str | None) -> list[FindingClass]:
    """`--only`: 'fill-value,tree-mask' -> kinds (None: every detector of the registry but the
    opt-in ones, which run only when named); ValueError naming the first unknown one and the choices."""
    known = registry.names()
    if spec is None:
        return [FindingClass(name) for name in registry.default_names()]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:  # `--only ""` (an empty variable, say) is not "every detector"
        raise ValueError(f"{spec!r} names no detector; detectors: {', '.join(known)} (leave --only out for the default ones)")
    out = []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown detector {name!r}{did_you_mean(name, known)}; detectors: {', '.join(known)}")
        out.append(FindingClass(name))
    return out


@dataclass(frozen=True)
class StepSelection:
    """Which steps of a recording to check: `--steps A:B` (by step number) and `--sample N`."""

    start: int | None = None
    stop: int | None = None
    sample: int | None = None  # N steps spread evenly over the selection (first and last included)


def numbered_paths(target: str | Path) -> list[tuple[int, Path]]:
    """(step number, file) of every step of `target` in recording order: numbered as the manifest
    numbers them, else by file order (what --steps A:B counts)."""
    target = Path(target)
    if target.is_dir() and (target / io.MANIFEST).exists():
        return [(e.step, target / e.file) for e in io.read_manifest(target)]
    return list(enumerate(io.trace_paths(target)))


def select_paths(target: str | Path, selection: StepSelection = StepSelection()) -> list[Path]:
    """The step files of `target` in recording order, restricted to `selection`."""
    numbered = numbered_paths(target)
    paths = [
        path
        for step, path in numbered
        if (selection.start is None or step >= selection.start) and (selection.stop is None or step < selection.stop)
    ]
    n = selection.sample
    if n is not None and n < len(paths):
        # Evenly spaced and deterministic: the same command checks the same steps.
        picks = sorted({round(i * (len(paths) - 1) / max(1, n - 1)) for i in range(n)}) if n > 1 else [0]
        paths = [paths[i] for i in picks]
    return paths
