"""The detector contract: what one detector package exports, as one `Detector` object.

A detector package (`attndbg/detectors/tree_mask/`, or a third party's) exports `DETECTOR`: its
kind, a one-line summary, how it judges a step, optionally how it judges a recording, and the
mistakes `attndbg synth --inject` can plant for it. Its hooks may be given as "pkg.module:attr"
strings, imported on first use, so that listing detectors (`--help`, `synth --list`) never imports
what they run (torch, the kernels). This module imports neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from attndbg import plugins
from attndbg.detector_api.findings import Finding, FindingClass
from attndbg.profiling import phase, step_label

if TYPE_CHECKING:
    from attndbg.detector_api.context import CheckContext
    from attndbg.trace.schema import Trace

Injection = Callable[["Trace"], "Trace"]


class RecordingState(Protocol):
    """What a recording-level detector keeps across steps: it sees each step's digest (the value its
    `recording_digest` returned, never None) in recording order, and returns the findings that
    step's digest completes."""

    def observe(self, digest: Any) -> list[Finding]: ...


def _hook(value: Any) -> Any:
    return plugins.load(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class Detector:
    kind: FindingClass  # what `--only`, `--inject KIND:...`, the reports and JSON call it
    summary: str  # one line: what it judges, for the help texts and docs/checking.md's table
    # (ctx) -> findings of the step; a function or "pkg.module:attr".
    detect: Callable[[CheckContext], list[Finding]] | str
    # Mistakes `synth --inject KIND:MISTAKE` plants, keyed "KIND:MISTAKE", each function documented
    # (first line: the listing) with the real bug it imitates: a mapping, or the name of a module
    # holding it as INJECTIONS (read from its source for listing, imported only to inject).
    injections: Mapping[str, Injection] | str = field(default_factory=dict)
    # Recording-level checks (across steps), run as a stream: `recording_digest(ctx)` keeps the
    # little it needs of a step (small and picklable: it comes back from a check worker; None:
    # nothing), and one `recording_state()` per check sees the digests in recording order.
    recording_digest: Callable[[CheckContext], Any] | str | None = None
    recording_state: Callable[[], RecordingState] | str | None = None
    # It judges the recorded plan through the step's plan reading (ctx.plan()): where that reading
    # cannot read the plan as its kernel would (PlanReading.unread), the check's verdict names it.
    reads_plan: bool = False
    # (trace) -> the (backend name, its options object) runs this detector makes of a step beyond
    # the check's own replays, where that backend is among the check's (split-merge forces
    # FlashInfer's cascade and paged extend paths): check's compile phase builds their kernels too.
    forced_runs: Callable[[Trace], list[tuple[str, Any]]] | str | None = None
    # Run only when named in `check --only`: for detectors whose cost is out of proportion to a
    # default check (batch-invariance replays every request alone: bs + 3 launches per backend).
    opt_in: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FindingClass):
            raise TypeError(f"Detector.kind must be a FindingClass, got {self.kind!r}")
        if not self.summary.strip() or "\n" in self.summary:
            raise ValueError(f"detector {self.kind.value}: the summary is one non-empty line")
        if (self.recording_digest is None) != (self.recording_state is None):
            raise ValueError(f"detector {self.kind.value}: recording_digest and recording_state go together")

    @property
    def name(self) -> str:
        return self.kind.value

    def run(self, ctx: CheckContext) -> list[Finding]:
        with phase(f"detector/{self.name}", step_label(ctx.trace)):  # an NVTX range, and what the spinner names
            return _hook(self.detect)(ctx)

    def digest(self, ctx: CheckContext) -> Any:
        return _hook(self.recording_digest)(ctx) if self.recording_digest is not None else None

    def new_state(self) -> RecordingState | None:
        return _hook(self.recording_state)() if self.recording_state is not None else None

    def forced_runs_of(self, trace: Trace) -> list[tuple[str, Any]]:
        return _hook(self.forced_runs)(trace) if self.forced_runs is not None else []

    def injection_table(self) -> Mapping[str, Injection]:
        """Its injections, imported."""
        if isinstance(self.injections, str):
            return importlib.import_module(self.injections).INJECTIONS
        return self.injections
