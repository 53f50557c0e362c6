"""Render findings: a table per step for people (stacked one field a line where the terminal is
narrow), a plain dict for `--json`, and a one-line verdict that says what was actually compared.
The progress of a long check is report/progress.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attndbg.checks.step import StepReport
from attndbg.detector_api.findings import Finding, FindingClass, Severity
from attndbg.plural import counted
from attndbg.report.terminal import unbounded
from attndbg.trace.errors import printable

if TYPE_CHECKING:
    from attndbg.backends.options import BackendOptions

SCHEMA = "attndbg.check/1"


def render_step(report: StepReport) -> RenderableType:
    if report.error:
        return Text(f"{printable(report.path)}: {report.error}", style="yellow")
    if not report.findings:
        return Text(f"{printable(report.path)}: step {report.step} {report.mode}: no findings", style="green")
    return _StepFindings(f"{printable(report.path)}: step {report.step} {report.mode}: {counted(len(report.findings), 'finding')}", report.findings)


# Narrower than this, five columns fold identifiers mid-word ("spec.custom_ma/sk[51]") and one
# finding takes 30 lines: findings are shown stacked, one field a line.
STACK_BELOW = 120
_LABEL = 9  # "evidence " and the other labels of the stacked form
_TABLE_FRAME = 16  # five columns: a space either side of each, and six rules
_HEADERS = ("class", "check", "where", "evidence", "likely cause")


@dataclass(frozen=True)
class _StepFindings:
    """A step's findings laid out for the width they get (rich asks at print time): a table of
    class, check, where, evidence and likely cause, every column at least as wide as its longest
    word; where that does not fit (or under STACK_BELOW columns, or piped), stacked. Identifiers are
    never split, except one longer than the whole line."""

    title: str
    findings: list[Finding]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Piped: stacked, each field whole on its line (a table as wide as its longest evidence
        # would be hundreds of columns).
        widths = None if unbounded(options) else self._column_widths(options.max_width)
        yield self._stacked() if widths is None else self._table(widths)

    def _cells(self, f: Finding) -> tuple[Text, Text, Text, Text, Text]:
        """As Text: evidence quotes the file ('custom_mask[request 0]'), never read as markup."""
        hazard = f.severity is Severity.HAZARD
        kind = Text(f.kind.value, style="bold yellow" if hazard else "bold red") + Text(" (hazard)" if hazard else "")
        return kind, Text(f.check), Text(str(f.location)), Text(f.evidence), Text(f.cause)

    def _column_widths(self, width: int) -> list[int] | None:
        """class, check and where as wide as they need (where wraps at its ' / ' from 36 columns);
        evidence and cause share the rest, each at least its longest word. None: stack."""
        if width < STACK_BELOW:
            return None
        rows = [self._cells(f) for f in self.findings]
        longest = lambda i: max(len(str(r[i])) for r in rows)  # noqa: E731
        word = lambda i: max((len(w) for r in rows for w in str(r[i]).split()), default=1)  # noqa: E731
        fixed = [longest(0), longest(1), min(longest(2), max(word(2), 36))]
        rest = width - _TABLE_FRAME - sum(fixed)
        need = [max(word(3), 20), max(word(4), 20)]
        if rest < sum(need):
            return None
        evidence = max(need[0], min(longest(3), rest - need[1], rest // 2))
        cause = min(rest - evidence, max(need[1], longest(4)))  # no wider than its longest text
        return [max(width, len(header)) for width, header in zip([*fixed, evidence, cause], _HEADERS)]

    def _table(self, widths: list[int]) -> Table:
        table = Table(title=Text(self.title), title_justify="left", show_lines=True)  # a file name is not markup
        for column, width in zip(_HEADERS, widths):
            table.add_column(column, width=width, overflow="fold")
        for f in self.findings:
            table.add_row(*self._cells(f))
        return table

    def _stacked(self) -> Group:
        parts: list[RenderableType] = [Text(self.title, style="bold")]
        for f in self.findings:
            kind, check, where, evidence, cause = self._cells(f)
            parts.append(Padding(kind + Text(" / ", style="bold") + check, (0, 0, 0, 2)))
            fields = Table.grid(padding=(0, 1))
            fields.add_column(width=_LABEL - 1, style="dim", no_wrap=True)
            fields.add_column(overflow="fold")
            for label, value in (("where", where), ("evidence", evidence), ("cause", cause)):
                fields.add_row(label, value)
            parts.append(Padding(fields, (0, 0, 0, 4)))
        return Group(*parts)


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
    # engine backend -> graph steps padded for it, whose padding rules nothing here knows
    unknown_engine_backends: dict[str, int] = field(default_factory=dict)
    # "<engine backend>: why" -> steps whose engine kernels no adapter here runs (their plans are read)
    engine_kernels_elsewhere: dict[str, int] = field(default_factory=dict)
    # why -> steps whose crashed call (source.crash) could not be run again here
    crashes_not_run: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    defects: int = 0  # findings of Severity.DEFECT: they fail the check
    # "<class>/<check>" -> hazard findings (Severity.HAZARD): they fail only `check --strict`
    hazards: dict[str, int] = field(default_factory=dict)
    selection: Selection | None = None  # `--steps`/`--sample`: which steps of how many
    # mode -> checked steps on which no backend's kernel was compared with the reference, while
    # other steps' were: those steps were judged on metadata and recorded tensors only
    unreplayed: dict[str, int] = field(default_factory=dict)
    # why steps were not checked (an error's first clause) -> those steps: numbers, or file names
    not_checked: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Selection:
    """`--steps`/`--sample`: how many steps the recording has and the options that chose some."""

    recording_steps: int
    steps: tuple[int, ...]  # the steps chosen, numbered as the selection counts them (manifest, else file order)
    options: str  # "--steps 100:200 --sample 5"


def check_verdict(
    reports: list[StepReport],
    detectors: list[FindingClass],
    named: tuple[str, ...] | None,
    backend_options: BackendOptions | None = None,
    *,
    selection: Selection | None = None,
    every: bool = False,
) -> CheckVerdict:
    """The verdict of a check. `named`: the backends of `--backend`; one that ran on no step is said,
    and makes the check incomplete unless `every` (`--backend all`: those that cannot run here are
    skipped and said, as `replay --backend all` does)."""
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
    kernels = ", ".join(f"{name} ({counted(count, 'step')})" for name, count in sorted(ran.items()))
    parts = [f"checked {len(checked)} of {counted(len(steps), 'step')}"]
    if selection is not None:  # which steps of how many: "selected from 5 (steps 1, 3; --sample 2)"
        parts[0] += f" selected from {selection.recording_steps} ({_step_numbers(selection.steps)}; {selection.options})"
    not_checked = _not_checked(steps)
    if not_checked:  # why each step was not checked: its line scrolled away in a long check
        named = [f"{_step_labels(labels)} ({why})" for why, labels in list(not_checked.items())[:MOST_REASONS]]
        more = len(not_checked) - MOST_REASONS
        parts.append("not checked: " + "; ".join(named) + (f"; and {counted(more, 'more reason')} (above)" if more > 0 else ""))
    parts.append(f"detectors: {', '.join(d.value for d in detectors)}")
    parts.append(f"kernels compared with the float64 reference: {kernels}" if kernels else "no kernel ran (metadata and recorded tensors only)")
    # A count of steps per backend hides which steps no backend replayed (the kernels detector runs
    # every backend that can take a step; a step none here can take, or whose every run raised, is
    # left): said by mode, so "checked" is never read as "compared" for those steps.
    unreplayed = Counter(r.mode for r in checked if not r.backends) if kernels else Counter()
    if unreplayed:
        total = sum(unreplayed.values())
        by_mode = ", ".join(f"{mode} {n}" for mode, n in sorted(unreplayed.items()))
        parts.append(f"no kernel compared on {counted(total, 'step')} ({by_mode}: metadata and recorded tensors only)")
    parts += [f"{name} {why}" for name, why in skipped.items()]
    # Not a finding (nothing is wrong in the step) and not incomplete (nothing asked for failed to
    # run), but the plan detectors checked less than the plan: said, never silent.
    unread = Counter(r.plan_unread for r in checked if r.plan_unread)
    parts += [f"recorded plan not read by the plan detectors on {counted(n, 'step')} ({what})" for what, n in sorted(unread.items())]
    # An engine backend no adapter answers to and no table gives padding rules for: its padded rows
    # were judged by no kernel's requirement (never by another backend's), which is said.
    unknown = Counter(r.unknown_engine_backend for r in checked if r.unknown_engine_backend)
    parts += [
        f"padded rows of {counted(n, 'graph step')} not judged by a kernel's fill rules (engine backend {printable(name, 60)}: no adapter or padding rules here)"
        for name, n in sorted(unknown.items())
    ]
    # An engine backend whose kernels its adapter never runs here (it reads their plans): those
    # steps were judged on metadata and the reference, never by another library's kernel.
    elsewhere = Counter(r.engine_kernels_elsewhere for r in checked if r.engine_kernels_elsewhere)
    parts += [f"engine kernels not run on {counted(n, 'step')} ({printable(what, 200)})" for what, n in sorted(elsewhere.items())]
    # A step whose call crashed where it ran, not run again here: its crash is neither confirmed nor
    # cleared, so the check is incomplete.
    unrun = Counter(r.crash_unrun for r in checked if r.crash_unrun)
    parts += [f"crashed call not run again on {counted(n, 'step')} ({why})" for why, n in sorted(unrun.items())]
    hazards = Counter(f"{f.kind.value}/{f.check}" for r in reports for f in r.findings if f.severity is Severity.HAZARD)
    defects = findings - sum(hazards.values())
    count = counted(findings, "finding")
    if hazards:
        listed = ", ".join(f"{check} x{n}" if n > 1 else check for check, n in sorted(hazards.items()))
        total = sum(hazards.values())
        count += f": {counted(defects, 'defect')}, {counted(total, 'hazard')} ({listed}; they fail only --strict)"
    parts.append(count)
    unchecked = len(steps) - len(checked)
    return CheckVerdict(
        line="; ".join(parts),
        incomplete=(bool(skipped) and not every) or unchecked > 0 or bool(unrun),
        checked_steps=len(checked),
        unchecked_steps=unchecked,
        detectors=[d.value for d in detectors],
        backends_ran=dict(sorted(ran.items())),
        backends_skipped=skipped,
        findings=findings,
        plans_unread=dict(sorted(unread.items())),
        unknown_engine_backends=dict(sorted(unknown.items())),
        engine_kernels_elsewhere=dict(sorted(elsewhere.items())),
        crashes_not_run=dict(sorted(unrun.items())),
        defects=defects,
        hazards=dict(sorted(hazards.items())),
        selection=selection,
        unreplayed=dict(sorted(unreplayed.items())),
        not_checked=not_checked,
    )


# Reasons a verdict names for its unchecked steps; the rest are counted (each step's line is above).
MOST_REASONS = 4


def _not_checked(steps: list[StepReport]) -> dict[str, list[str]]:
    """Why steps were not checked -> the steps (by number; an unreadable file, whose number is not
    known, by its name), in recording order. The reason is the error's first clause: the numbers
    and paths in parentheses after it are on the step's own line."""
    reasons: dict[str, list[str]] = {}
    for r in steps:
        if r.error is None:
            continue
        why = r.error.removeprefix("not checked: ").split(" (", 1)[0].rstrip(";: ")
        reasons.setdefault(printable(why, 120), []).append(str(r.step) if r.step >= 0 else Path(r.path).name)
    return reasons


def _step_labels(labels: list[str]) -> str:
    """'step 3', 'steps 1-4', 'c.pt', 'steps 1, 3 and c.pt'."""
    numbers = tuple(int(label) for label in labels if label.isdigit())
    names = [printable(label) for label in labels if not label.isdigit()]
    named = ", ".join(names[:3]) + (f" and {len(names) - 3} more files" if len(names) > 3 else "")
    if not numbers:
        return named
    return _step_numbers(numbers) + (f" and {named}" if named else "")


def _step_numbers(steps: tuple[int, ...], most: int = 12) -> str:
    """'steps 1, 3', 'steps 100-199', 'steps 0, 25, ... and 12 more': runs of consecutive steps
    joined, at most `most` items named, never cut with an ellipsis (a verdict line is whole)."""
    runs: list[list[int]] = []
    for n in sorted(set(steps)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    items = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    listed = ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")
    return f"step{'s' if len(steps) != 1 else ''} {listed}" if steps else "no step"


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
            "unknown_engine_backends": verdict.unknown_engine_backends,
            "engine_kernels_elsewhere": verdict.engine_kernels_elsewhere,
            "crashes_not_run": verdict.crashes_not_run,
            "not_compared_by_mode": verdict.unreplayed,
            "not_checked": verdict.not_checked,
            "findings": verdict.findings,
            "defects": verdict.defects,
            "hazards": sum(verdict.hazards.values()),
            "hazards_by_check": verdict.hazards,
            "selection": None if verdict.selection is None else {
                "recording_steps": verdict.selection.recording_steps,
                "steps": list(verdict.selection.steps),
                "options": verdict.selection.options,
            },
        }
    return data
