"""Run the detectors over a step or a recording: `attndbg check`.

Each detector module exposes `detect(ctx: CheckContext) -> list[Finding]`. Detectors that need
more than one step (stale masks, pointer stability) also expose `detect_recording(contexts)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from attndbg.checks.context import CheckContext, CheckOptions
from attndbg.checks.findings import Finding, FindingClass
from attndbg.trace import io

DETECTORS: dict[FindingClass, str] = {
    FindingClass.INVARIANT: "attndbg.checks.invariants",
    FindingClass.FILL_VALUE: "attndbg.checks.fill_value",
    FindingClass.TREE_MASK: "attndbg.checks.tree_mask",
    FindingClass.SPLIT_MERGE: "attndbg.checks.split_merge",
}


def parse_only(spec: str | None) -> list[FindingClass]:
    """'fill-value,tree-mask' -> classes; ValueError naming the first unknown one."""
    if not spec:
        return list(DETECTORS)
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            out.append(FindingClass(name))
        except ValueError:
            raise ValueError(f"unknown detector {name!r}; detectors: {', '.join(c.value for c in DETECTORS)}") from None
    return out


@dataclass(frozen=True)
class StepReport:
    path: str
    step: int
    mode: str
    findings: list[Finding]


def check_steps(target: str, only: list[FindingClass], options: CheckOptions = CheckOptions(), progress: Callable[[str], None] | None = None) -> Iterator[StepReport]:
    """Check every step of `target` (a .pt file or a recording directory), one step at a time."""
    modules = {kind: importlib.import_module(DETECTORS[kind]) for kind in only}
    contexts = []
    for path in io.trace_paths(target):
        trace = io.load(path)
        ctx = CheckContext(trace=trace, path=str(path), options=options)
        findings: list[Finding] = []
        for module in modules.values():
            findings.extend(module.detect(ctx))
        contexts.append(ctx)
        if progress:
            progress(str(path))
        yield StepReport(str(path), trace.source.step, trace.batch.forward_mode.value, [_with_trace(f, str(path)) for f in findings])
    across = [f for m in modules.values() if hasattr(m, "detect_recording") for f in m.detect_recording(contexts)]
    if across:
        yield StepReport(str(target), -1, "recording", across)


def _with_trace(finding: Finding, path: str) -> Finding:
    if finding.trace:
        return finding
    from dataclasses import replace

    return replace(finding, trace=path)
