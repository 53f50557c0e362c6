"""Render findings: a table per step for people, a plain dict for `--json`, a one-line verdict that
says what was actually compared, and the progress bar of a long check."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from attndbg.checks.findings import FindingClass, Severity
from attndbg.checks.run import StepReport
from attndbg.trace.errors import printable

if TYPE_CHECKING:
    from attndbg.backends.options import BackendOptions

SCHEMA = "attndbg.check/1"


def render_step(report: StepReport) -> RenderableType:
    if report.error:
        return Text(f"{printable(report.path)}: {report.error}", style="yellow")
    if not report.findings:
        return Text(f"{printable(report.path)}: step {report.step} {report.mode}: no findings", style="green")
    table = Table(title=f"{printable(report.path)}: step {report.step} {report.mode}: {len(report.findings)} finding(s)", title_justify="left", show_lines=True)
    for column in ("class", "check", "where", "evidence", "likely cause"):
        table.add_column(column, overflow="fold")
    for f in report.findings:
        hazard = f.severity is Severity.HAZARD
        kind = Text(f.kind.value, style="bold yellow" if hazard else "bold red") + Text(" (hazard)" if hazard else "")
        table.add_row(kind, f.check, str(f.location), Text(f.evidence), Text(f.cause))
    return table


def render_summary(reports: list[StepReport]) -> RenderableType:
    table = Table(title="summary", title_justify="left")
    for column in ("steps", "not checked", "with findings", "findings by class"):
        table.add_column(column)
    counts = Counter(f.kind.value for r in reports for f in r.findings)
    steps = [r for r in reports if r.mode != "recording"]
    table.add_row(
        str(len(steps)),
        str(sum(1 for r in steps if r.error)),
        str(sum(1 for r in steps if r.findings)),
        ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none",
    )
    return Group(table)


@dataclass(frozen=True)
class CheckVerdict:
    """What a check actually did, in one line and as data."""

    line: str
    incomplete: bool  # a named backend never ran, or a step was not checked
    checked_steps: int
    unchecked_steps: int
    detectors: list[str]
    backends_ran: dict[str, int]  # backend -> steps it ran on
    backends_skipped: dict[str, str]  # backend -> why it ran on no step
    findings: int = 0
    # "<plan backend>: <why>" -> steps whose recorded plan the plan detectors could not read
    plans_unread: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    defects: int = 0  # findings of Severity.DEFECT: they fail the check
    # "<class>/<check>" -> hazard findings (Severity.HAZARD): they fail only `check --strict`
    hazards: dict[str, int] = field(default_factory=dict)


def check_verdict(reports: list[StepReport], detectors: list[FindingClass], named: tuple[str, ...] | None, backend_options: BackendOptions | None = None) -> CheckVerdict:
    from attndbg.backends import registry

    steps = [r for r in reports if r.mode != "recording"]
    checked = [r for r in steps if r.error is None]
    ran = Counter(name for r in checked for name in r.backends)
    skipped: dict[str, str] = {}
    for name in named or ():
        if name == "reference" or ran.get(name):
            continue
        reason = registry.create(name, options=backend_options).unavailable_reason()
        skipped[name] = f"unavailable: {reason}" if reason else "ran on no step (unsupported by every step, or no detector needed it)"
    findings = sum(len(r.findings) for r in reports)
    kernels = ", ".join(f"{name} ({count} step{'s' if count != 1 else ''})" for name, count in sorted(ran.items()))
    parts = [f"checked {len(checked)} of {len(steps)} step{'s' if len(steps) != 1 else ''}"]
    parts.append(f"detectors: {', '.join(d.value for d in detectors)}")
    parts.append(f"kernels compared with the float64 reference: {kernels}" if kernels else "no kernel ran (metadata and recorded tensors only)")
    parts += [f"{name} {why}" for name, why in skipped.items()]
    # Not a finding (nothing is wrong in the step) and not incomplete (nothing asked for failed to
    # run), but the plan detectors checked less than the plan: said, never silent.
    unread = Counter(r.plan_unread for r in checked if r.plan_unread)
    parts += [f"recorded plan not read by the plan detectors on {n} step{'s' if n != 1 else ''} ({what})" for what, n in sorted(unread.items())]
    hazards = Counter(f"{f.kind.value}/{f.check}" for r in reports for f in r.findings if f.severity is Severity.HAZARD)
    defects = findings - sum(hazards.values())
    count = f"{findings} finding{'s' if findings != 1 else ''}"
    if hazards:
        listed = ", ".join(f"{check} x{n}" if n > 1 else check for check, n in sorted(hazards.items()))
        total = sum(hazards.values())
        count += f": {defects} defect{'s' if defects != 1 else ''}, {total} hazard{'s' if total != 1 else ''} ({listed}; they fail only --strict)"
    parts.append(count)
    unchecked = len(steps) - len(checked)
    return CheckVerdict(
        line="; ".join(parts),
        incomplete=bool(skipped) or unchecked > 0,
        checked_steps=len(checked),
        unchecked_steps=unchecked,
        detectors=[d.value for d in detectors],
        backends_ran=dict(sorted(ran.items())),
        backends_skipped=skipped,
        findings=findings,
        plans_unread=dict(sorted(unread.items())),
        defects=defects,
        hazards=dict(sorted(hazards.items())),
    )


def checks_to_json(reports: list[StepReport], verdict: CheckVerdict | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "steps": [
            {
                "trace": r.path,
                "step": r.step,
                "mode": r.mode,
                "checked": r.error is None,
                "error": r.error,
                "backends": list(r.backends),
                "findings": [f.to_json() for f in r.findings],
            }
            for r in reports
        ],
        "total_findings": sum(len(r.findings) for r in reports),
    }
    if verdict is not None:
        data["verdict"] = {
            "line": verdict.line,
            "checked_steps": verdict.checked_steps,
            "unchecked_steps": verdict.unchecked_steps,
            "detectors": verdict.detectors,
            "compared": verdict.backends_ran,
            "skipped": verdict.backends_skipped,
            "plans_unread": verdict.plans_unread,
            "findings": verdict.findings,
            "defects": verdict.defects,
            "hazards": sum(verdict.hazards.values()),
            "hazards_by_check": verdict.hazards,
        }
    return data


class CheckProgress:
    """A progress bar over steps (rate and ETA) that findings print above; silent when disabled."""

    def __init__(self, console: Console, *, total: int, enabled: bool):
        self.console = console
        self.progress = (
            Progress(
                TextColumn("checking"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            if enabled
            else None
        )
        self.task = self.progress.add_task("checking", total=total, rate="") if self.progress else None

    def __enter__(self) -> CheckProgress:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.progress:
            self.progress.stop()

    def advance(self, report: StepReport) -> None:
        if self.progress is None or self.task is None:
            return
        self.progress.advance(self.task)
        task = self.progress.tasks[0]
        speed = task.speed
        self.progress.update(self.task, rate=f"{speed:.1f} steps/s" if speed else "")

    def print(self, renderable: RenderableType) -> None:
        (self.progress.console if self.progress else self.console).print(renderable)
