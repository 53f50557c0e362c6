"""Render replay results: a rich table for people, a plain dict for `--json`. Pure functions."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attndbg.replay.runner import BackendRun, ReplayResult, RunStatus

_STYLE = {
    RunStatus.PASSED: "green",
    RunStatus.FAILED: "bold red",
    RunStatus.ERROR: "bold red",
    RunStatus.UNSUPPORTED: "yellow",
    RunStatus.UNAVAILABLE: "dim",
}


def _trace_line(result: ReplayResult) -> str:
    t = result.trace
    m, b = t.model, t.batch
    return (
        f"{result.trace_path}: {b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} "
        f"heads={m.num_qo_heads}:{m.num_kv_heads} d={m.head_dim}/{m.v_head_dim} {m.attention.value} "
        f"{m.q_dtype} page={m.page_size} kv_lens={_short(b.kv_lens.tolist())}"
    )


def _short(values: list[int], limit: int = 8) -> str:
    head = ",".join(str(v) for v in values[:limit])
    return f"[{head}{',…' if len(values) > limit else ''}]"


def render_replay(result: ReplayResult) -> RenderableType:
    table = Table(title=_trace_line(result), title_justify="left", show_lines=False)
    for column in ("backend", "variant", "status", "max abs", "max rel", "max LSE err", "worst", "failing rows", "NaN/Inf", "time", "note"):
        table.add_column(column, overflow="fold")
    for run in result.runs:
        c = run.comparison
        status = Text(run.status.value, style=_STYLE[run.status])
        if c is None:
            table.add_row(run.name, run.variant, status, "", "", "", "", "", "", "", run.reason or run.description)
            continue
        note = "; ".join(run.problems) if run.problems else run.description
        table.add_row(
            run.name,
            run.variant,
            status,
            f"{c.max_abs:.3e}",
            f"{c.max_rel:.3e}",
            f"{c.max_lse_abs:.3e}",
            str(c.worst) if c.worst and not c.passed else "",
            f"{c.failing_rows}/{c.total_rows}",
            str(c.nonfinite),
            f"{run.seconds * 1e3:.1f} ms",
            Text(note, style="bold red" if run.problems else ""),
        )
    return Group(table)


def run_to_json(run: BackendRun) -> dict[str, Any]:
    out: dict[str, Any] = {
        "backend": run.name,
        "variant": run.variant,
        "status": run.status.value,
        "description": run.description,
        "reason": run.reason,
        "problems": list(run.problems),
    }
    c = run.comparison
    if c is not None:
        out.update(
            max_abs=c.max_abs,
            max_rel=c.max_rel,
            max_lse_abs=c.max_lse_abs,
            worst=None if c.worst is None else {"request": c.worst.request, "row": c.worst.row, "head": c.worst.head},
            failing_rows=c.failing_rows,
            total_rows=c.total_rows,
            failing_heads=c.failing_heads,
            nonfinite=c.nonfinite,
            seconds=run.seconds,
        )
    return out


def replay_to_json(result: ReplayResult) -> dict[str, Any]:
    t = result.trace
    return {
        "trace": result.trace_path,
        "mode": t.batch.forward_mode.value,
        "batch_size": t.batch.batch_size,
        "num_tokens": t.batch.num_tokens,
        "passed": not result.failed,
        "backends": [run_to_json(r) for r in result.runs],
    }
