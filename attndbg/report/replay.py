"""Render replay results: a rich table for people, a plain dict for `--json`. Pure functions.

The table holds only numbers of runs that ran, so it fits 80 columns without folding a number;
everything that is prose (why a backend was skipped, what failed, where) goes in lines below it.
The JSON schema (`attndbg.replay/1`) is documented in docs/json.md.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attndbg.compare.tolerance import Location
from attndbg.plural import counted
from attndbg.replay.crashed import CrashRerun
from attndbg.replay.runner import BackendRun, ReplayResult, RunStatus
from attndbg.replay.variants import Eager, parse_variant, run_name
from attndbg.trace.errors import printable

SCHEMA = "attndbg.replay/1"

_STYLE = {
    RunStatus.PASSED: "green",
    RunStatus.FAILED: "bold red",
    RunStatus.ERROR: "bold red",
    RunStatus.UNSUPPORTED: "yellow",
    RunStatus.UNAVAILABLE: "dim",
}
_RAN = (RunStatus.PASSED, RunStatus.FAILED, RunStatus.ERROR)
_RAN_VALUES = {s.value for s in _RAN}


class Verdict(enum.Enum):
    PASSED = "passed"  # something was compared, all of it passed, every backend named ran
    FAILED = "failed"  # a run missed the reference, was not deterministic, or raised
    INCOMPLETE = "incomplete"  # nothing failed, but a backend named explicitly compared nothing


@dataclass(frozen=True)
class StepReport:
    """One replayed step and the facts of how it was run that the result does not carry."""

    result: ReplayResult
    layer: int | None  # recorded layer whose tensors were used; None = data drawn from the seed
    repeat: int = 1  # eager runs per backend (--repeat)
    named: tuple[str, ...] = ()  # backends the user named explicitly (empty for `--backend all`)
    notes: tuple[str, ...] = ()  # options that had no effect on this step, and why
    # The step's call crashed where it ran (source.crash): what its run again in a worker of its own did.
    crash: CrashRerun | None = None

    @property
    def ran(self) -> list[BackendRun]:
        return [r for r in self.result.runs if r.status in _RAN]

    @property
    def skipped(self) -> list[BackendRun]:
        return [r for r in self.result.runs if r.status not in _RAN]

    @property
    def missing(self) -> list[str]:
        """Backends named explicitly that ran nothing here."""
        ran = {r.name for r in self.ran}
        return [n for n in self.named if n not in ran]

    @property
    def verdict(self) -> Verdict:
        if self.result.failed or (self.crash is not None and self.crash.reproduced):
            return Verdict.FAILED
        if self.missing or not self.ran or (self.crash is not None and not self.crash.ran):
            return Verdict.INCOMPLETE
        return Verdict.PASSED

    @property
    def data(self) -> str:
        if self.result.trace.merge is not None:
            return "the merge's given states (trace.merge)"
        if self.layer is None:
            return f"seeded data (seed {self.result.trace.seed})"
        return f"recorded tensors of layer {self.layer}"


def overall(steps: Sequence[dict[str, Any]]) -> Verdict:
    """The verdict of a whole replay from its steps' JSON (`step_to_json`)."""
    verdicts = {Verdict(s["verdict"]) for s in steps}
    for v in (Verdict.FAILED, Verdict.INCOMPLETE):
        if v in verdicts:
            return v
    return Verdict.PASSED if steps else Verdict.INCOMPLETE


def _run_name(run: BackendRun) -> str:
    return run_name(run.name, run.variant)


def _json_run_name(run: dict[str, Any]) -> str:
    return run_name(run["backend"], parse_variant(run["variant"]))


def _repeat_identical(run: BackendRun) -> bool:
    return run.repeat_identical is not False


def _trace_line(result: ReplayResult) -> str:
    t = result.trace
    m, b = t.model, t.batch
    if t.merge is not None:
        return f"{printable(result.trace_path)}: {t.merge.words()}"
    return (
        f"{printable(result.trace_path)}: {b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} "
        f"heads={m.num_qo_heads}:{m.num_kv_heads} d={m.head_dim}/{m.v_head_dim} {m.attention.value} "
        f"{m.q_dtype} kv={m.kv_dtype} page={m.page_size} kv_lens={_short(b.kv_lens.tolist())}"
    )


def _short(values: list[int], limit: int = 8) -> str:
    head = ",".join(str(v) for v in values[:limit])
    return f"[{head}{',…' if len(values) > limit else ''}]"


def _row_in_request(result: ReplayResult, location: Location) -> int:
    """Location.row counts the step's query tokens; people count rows within a request."""
    if result.trace.merge is not None:  # a merge step's rows are requests of their own
        return 0
    return location.row - int(result.trace.batch.qo_indptr[location.request])


def where(result: ReplayResult, location: Location) -> str:
    """'request 1 row 4 (step row 39) head 2'."""
    return f"request {location.request} row {_row_in_request(result, location)} (step row {location.row}) head {location.head}"


def render_replay(step: StepReport) -> RenderableType:
    result = step.result
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, header_style="bold")
    # Short headers: 8 columns of numbers fit 80 terminal columns; only `backend` may wrap.
    table.add_column("backend", overflow="fold", min_width=len("reference"))
    table.add_column("status", no_wrap=True)
    for column in ("max abs", "max rel", "LSE err", "failing", "NaN", "time"):
        table.add_column(column, justify="right", no_wrap=True)
    for run in step.ran:
        status = Text(run.status.value, style=_STYLE[run.status])
        c = run.comparison
        if c is None:
            table.add_row(Text(_run_name(run)), status, "", "", "", "", "", "")
            continue
        table.add_row(
            Text(_run_name(run)),
            status,
            f"{c.max_abs:.3e}",
            f"{c.max_rel:.3e}",
            f"{c.max_lse_abs:.3e}",
            f"{c.failing_rows}/{c.total_rows}",
            str(c.nonfinite),
            f"{run.seconds * 1e3:.1f} ms",
        )
    parts: list[RenderableType] = [Text(_trace_line(result), style="bold"), Text(f"data: {step.data}")]
    if step.ran:
        parts.append(table)
    parts.extend(_notes(step))
    return Group(*parts)


def _notes(step: StepReport) -> list[Text]:
    """The prose below the table: failures and where, skipped runs and why, option notes."""
    lines: list[Text] = []
    crash = step.crash
    if crash is not None:
        logged = step.result.trace.source.crash or "no error was logged"
        style = "bold red" if crash.reproduced else "yellow"
        lines.append(Text(f"backend-crash: the recorded call crashed where it ran ({logged}); run again in a fresh worker: {crash.line()}", style=style))
    for run in step.ran:
        c = run.comparison
        if run.status is RunStatus.ERROR:
            lines.append(Text(f"{_run_name(run)}: error: {run.reason}", style="bold red"))
            continue
        if c is not None and not c.passed:
            worst = f"; worst at {where(step.result, c.worst)}" if c.worst else ""
            lines.append(Text(f"{_run_name(run)}: {c.failing_rows} of {counted(c.total_rows, 'row')} miss the reference{worst}", style="bold red"))
        for problem in run.problems:
            lines.append(Text(f"{_run_name(run)}: {problem}", style="bold red"))
    if step.repeat > 1:
        same = [r.name for r in step.ran if isinstance(r.variant, Eager) and r.result is not None and _repeat_identical(r)]
        if same:
            lines.append(Text(f"--repeat {step.repeat}: {', '.join(same)} bitwise identical over {step.repeat} runs", style="green"))
    for run in step.skipped:
        lines.append(Text(f"{_run_name(run)}: {run.status.value}: {run.reason}", style=_STYLE[run.status]))
    for note in step.notes:
        lines.append(Text(f"note: {note}", style="yellow"))
    described: dict[str, str] = {}
    for run in step.ran:
        described.setdefault(run.name, run.description)
    for name, description in described.items():
        lines.append(Text(f"{name}: {description}", style="dim"))
    return lines


def first_clause(reason: str) -> str:
    """'no CUDA GPU: FlashInfer's kernels run only on NVIDIA GPUs' -> 'no CUDA GPU' (the whole
    reason is in the lines above the verdict). Never cut with '…': a verdict line is whole."""
    return reason.split(": ", 1)[0]


def verdict_line(steps: Sequence[dict[str, Any]]) -> Text:
    """One line naming what actually ran: '2 backends compared (triton, reference), all passed;
    flashinfer unavailable: no CUDA GPU'. Built from the steps' JSON (`step_to_json`), so a
    folder's steps need not keep their tensors until the end."""
    compared: dict[str, None] = {}
    failed: dict[str, None] = {}
    skipped: dict[str, str] = {}
    for step in steps:
        for run in step["backends"]:
            name = _json_run_name(run)
            if run["status"] in _RAN_VALUES:
                compared[run["backend"]] = None
                if run["status"] != RunStatus.PASSED.value:
                    failed[name] = None
            else:
                skipped.setdefault(name, f"{run['status']}: {first_clause(run['reason'] or '')}")
    verdict = overall(steps)
    where_ = f"{len(steps)} steps: " if len(steps) > 1 else ""
    text = f"{where_}{len(compared)} backend{'s' * (len(compared) != 1)} compared ({', '.join(compared) or 'none'})"
    text += f", failed: {', '.join(failed)}" if failed else (", all passed" if compared else "")
    if skipped:  # a named backend that compared nothing is always among these
        text += "; " + "; ".join(f"{name} {why}" for name, why in skipped.items())
    crashes = [s["crash"] for s in steps if "crash" in s]
    if crashes:
        said = [("reproduced", sum(c["reproduced"] for c in crashes)), ("not reproduced", sum(c["ran"] and not c["reproduced"] for c in crashes)), ("not run here", sum(not c["ran"] for c in crashes))]
        text += "; recorded crash " + ", ".join(f"{what} on {counted(n, 'step')}" for what, n in said if n)
    style = {Verdict.PASSED: "bold green", Verdict.FAILED: "bold red", Verdict.INCOMPLETE: "bold yellow"}[verdict]
    return Text(f"{verdict.value.upper()}: {text}", style=style)


def run_to_json(run: BackendRun, step: StepReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "backend": run.name,
        "variant": run.variant.label,
        "status": run.status.value,
        "description": run.description,
        "reason": run.reason,
        "problems": list(run.problems),
    }
    c = run.comparison
    if c is not None:
        worst = None
        if c.worst is not None:
            w = c.worst
            worst = {"request": w.request, "row_in_request": _row_in_request(step.result, w), "step_row": w.row, "head": w.head}
        out.update(
            max_abs=c.max_abs,
            max_rel=c.max_rel,
            max_lse_abs=c.max_lse_abs,
            worst=worst,
            failing_rows=c.failing_rows,
            total_rows=c.total_rows,
            failing_heads=c.failing_heads,
            nonfinite=c.nonfinite,
            seconds=run.seconds,
        )
    if step.repeat > 1 and isinstance(run.variant, Eager) and run.result is not None:
        out["repeat"] = {"runs": step.repeat, "bitwise_identical": _repeat_identical(run)}
    return out


def step_to_json(step: StepReport) -> dict[str, Any]:
    t = step.result.trace
    return {
        "trace": step.result.trace_path,
        "step": t.source.step,
        "mode": t.batch.forward_mode.value,
        "batch_size": t.batch.batch_size,
        "num_tokens": t.batch.num_tokens,
        "data": {"source": "merge" if t.merge is not None else "seeded" if step.layer is None else "recorded", "layer": step.layer, "seed": t.seed},
        "verdict": step.verdict.value,
        "passed": step.verdict is Verdict.PASSED,
        "compared": [_run_name(r) for r in step.ran],
        "skipped": [{"backend": r.name, "variant": r.variant.label, "status": r.status.value, "reason": r.reason} for r in step.skipped],
        "notes": list(step.notes),
        "backends": [run_to_json(r, step) for r in step.result.runs],
        **({"crash": {"recorded": t.source.crash, **vars(step.crash)}} if step.crash is not None else {}),
    }


def replay_to_json(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole replay from its steps' JSON (`step_to_json`): one step or many, one shape."""
    verdict = overall(steps)
    return {
        "schema": SCHEMA,
        "verdict": verdict.value,
        "passed": verdict is Verdict.PASSED,
        "summary": verdict_line(steps).plain,
        "steps": list(steps),
    }
