"""Render findings: a table per step for people, a plain dict for `--json`. Pure functions."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attndbg.checks.run import StepReport


def render_step(report: StepReport) -> RenderableType:
    if not report.findings:
        return Text(f"{report.path}: step {report.step} {report.mode}: no findings", style="green")
    table = Table(title=f"{report.path}: step {report.step} {report.mode}: {len(report.findings)} finding(s)", title_justify="left", show_lines=True)
    for column in ("class", "check", "where", "evidence", "likely cause"):
        table.add_column(column, overflow="fold")
    for f in report.findings:
        table.add_row(Text(f.kind.value, style="bold red"), f.check, str(f.location), Text(f.evidence), Text(f.cause))
    return table


def render_summary(reports: list[StepReport]) -> RenderableType:
    table = Table(title="summary", title_justify="left")
    for column in ("steps", "with findings", "findings by class"):
        table.add_column(column)
    counts = Counter(f.kind.value for r in reports for f in r.findings)
    steps = [r for r in reports if r.step >= 0]
    table.add_row(str(len(steps)), str(sum(1 for r in steps if r.findings)), ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
    return Group(table)


def checks_to_json(reports: list[StepReport]) -> dict[str, Any]:
    return {
        "steps": [{"trace": r.path, "step": r.step, "mode": r.mode, "findings": [f.to_json() for f in r.findings]} for r in reports],
        "total_findings": sum(len(r.findings) for r in reports),
    }
