"""`attndbg diff`: trace and replay diffs as rich renderables and as JSON-ready data.

Pure functions of the result objects of `attndbg.compare`: nothing here compares or prints.
`--json` and the terminal render the same object, so they cannot disagree.
"""

from __future__ import annotations

import enum
import math
from dataclasses import fields, is_dataclass
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attndbg.compare.recording_diff import RecordingDiff, StepDiff
from attndbg.compare.replay_diff import PairDiff, PairStatus, ReplayDiff, Worst
from attndbg.compare.trace_diff import SECTIONS, FieldDiff, FieldStatus, TraceDiff
from attndbg.plural import counted
from attndbg.trace.errors import printable

SCHEMA = "attndbg.diff/1"  # documented in docs/json.md

MAX_FIELDS = 40  # differing fields listed before "... N more"
MAX_REQUESTS = 16  # differing requests listed per backend pair
MAX_HEADS = 4  # worst heads named per backend pair


def _compact_table(title: str | None = None) -> Table:
    """Rules under the header only, one space between columns: numbers fit 80 columns unfolded."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, show_edge=False, collapse_padding=True)


def _add_row(table: Table, *cells: str | Text) -> None:
    """Add a row of literal text: names and values from a trace are data, never rich markup."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


# --- trace diff ---------------------------------------------------------------------------------


def render_trace_diff(d: TraceDiff, *, labels: tuple[str, str] = ("a", "b")) -> RenderableType:
    differences = d.differences
    if not differences:
        return Text(f"traces are structurally identical ({len(d.fields)} fields compared)", style="green")
    parts: list[RenderableType] = [
        Text(f"{len(differences)} of {len(d.fields)} fields differ", style="bold red"),
        _section_summary(d),
    ]
    table = Table(header_style="bold", pad_edge=False)
    table.add_column("field")
    table.add_column(labels[0])
    table.add_column(labels[1])
    table.add_column("detail")
    for f in differences[:MAX_FIELDS]:
        a, b, detail = _field_cells(f)
        _add_row(table, f.field, a, b, detail)
    parts.append(table)
    if len(differences) > MAX_FIELDS:
        parts.append(Text(f"… {len(differences) - MAX_FIELDS} more differing fields (see --json)", style="dim"))
    parts.append(Text(f"traces differ: {len(differences)} of {len(d.fields)} fields, first {differences[0].field}", style="bold red"))
    return Group(*parts)


def _section_summary(d: TraceDiff) -> Text:
    text = Text()
    for name in SECTIONS:
        section = d.section(name)
        if not section:
            continue
        differing = sum(not f.equal for f in section)
        if text:
            text.append("  ")
        if differing:
            text.append(f"{name}: {differing} of {len(section)} differ", style="red")
        else:
            text.append(f"{name}: equal", style="green")
    return text


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


def _at(f: FieldDiff) -> str:
    where = f" ({f.where})" if f.where else ""
    return f"{list(f.index)}{where}"


def _field_cells(f: FieldDiff) -> tuple[str, str, str]:
    """(a, b, detail) cells of one differing field."""
    if f.status is FieldStatus.VALUE:
        return _show(f.a), _show(f.b), ""
    if f.status is FieldStatus.ONLY_A:
        return "present", "absent", ""
    if f.status is FieldStatus.ONLY_B:
        return "absent", "present", ""
    if f.status is FieldStatus.SHAPE:
        if f.index is None:
            return f.a_meta, f.b_meta, "shapes differ"
        if f.a is None:
            return f.a_meta, f.b_meta, f"the first {f.numel} elements are equal"
        detail = f"first difference at {_at(f)}: {_show(f.a)} vs {_show(f.b)}; {f.count} of the first {f.numel} differ"
        return f.a_meta, f.b_meta, detail
    if f.status is FieldStatus.DTYPE and f.count == 0:
        return f.a_meta, f.b_meta, "dtypes differ; values equal"
    first = f"first at {_at(f)}: {_show(f.a)} vs {_show(f.b)}"
    if isinstance(f.a, int) and isinstance(f.b, int) and not isinstance(f.a, bool) and f.field in ("spec.custom_mask", "buffers.spec.custom_mask.contents"):
        flipped = [j for j in range(max(f.a, f.b).bit_length()) if (f.a ^ f.b) >> j & 1]
        first += f" (bits {flipped} differ)"
    counted = f"{f.count} of {f.numel} elements differ"
    if f.status is FieldStatus.DTYPE:
        return f.a_meta, f.b_meta, f"dtypes differ; {counted}, {first}"
    return _show(f.a), _show(f.b), f"{counted}, {first} ({f.a_meta})"


def trace_diff_to_json(d: TraceDiff) -> dict[str, Any]:
    return {"schema": SCHEMA, "kind": "traces"} | _trace_diff_data(d)


def _trace_diff_data(d: TraceDiff) -> dict[str, Any]:
    return {
        "identical": d.identical,
        "compared": len(d.fields),
        "differences": [_jsonable(f) for f in d.differences],
        "equal": [f.field for f in d.fields if f.equal],
    }


# --- replay diff --------------------------------------------------------------------------------


def render_replay_diff(d: ReplayDiff) -> RenderableType:
    a_label, b_label = printable(d.a_path or "a"), printable(d.b_path or "b")
    title = f"{a_label} (trace {d.a_trace_file})  vs  {b_label} (trace {d.b_trace_file})"
    if d.a_path and d.a_path == d.b_path:
        title = f"{a_label} (trace {d.a_trace_file}): backends against each other"
    parts: list[RenderableType] = [Text(title, style="bold")]
    if not d.qo_indptr_equal:
        note = "the two files replayed different batches (qo_indptr differs); requests follow the first file"
        parts.append(Text(note, style="yellow"))
    table = _compact_table()
    table.add_column("pair", overflow="fold", min_width=len("reference"))
    table.add_column("result", overflow="fold", min_width=len("identical"))
    for name in ("out max abs", "LSE max abs", "rows differ"):
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("NaN/Inf a", "NaN/Inf b"):
        table.add_column(name, overflow="fold")
    for p in d.pairs:
        _add_row(table, *_pair_cells(p))
    parts.append(table)
    for p in d.pairs:
        if p.status is not PairStatus.COMPARED:
            parts.append(Text(f"{_name(p)}: {p.reason}", style="yellow"))
    if d.only_a or d.only_b:
        only = f"only in {a_label}: {', '.join(d.only_a) or '—'}; only in {b_label}: {', '.join(d.only_b) or '—'}"
        parts.append(Text(only, style="yellow"))
    for p in d.pairs:
        if p.status is PairStatus.COMPARED and p.differing_rows:
            parts.append(_pair_detail(p))
            scale = _scale(p, a_label, b_label)
            if scale is not None:
                parts.append(scale)
    if not d.identical:
        parts.append(Text("judged bitwise: any difference counts (a deterministic kernel run twice matches exactly)", style="dim"))
    if d.identical:
        parts.append(Text("all pairs bitwise identical", style="green"))
    elif all(p.bitwise_equal for p in d.pairs):
        parts.append(Text("compared pairs bitwise identical; some backends are in one file only", style="yellow"))
    else:
        parts.append(Text("differences found", style="bold red"))
    return Group(*parts)


def _name(p: PairDiff) -> str:
    return p.a_name if p.a_name == p.b_name else f"{p.a_name} vs {p.b_name}"


def _num(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def _nonfinite(p: PairDiff, side: str) -> str:
    counts = []
    for what, t in (("out", p.output), ("lse", p.lse)):
        nan, inf = getattr(t, f"nan_{side}"), getattr(t, f"inf_{side}")
        counts += [f"{nan} NaN {what}"] * bool(nan) + [f"{inf} Inf {what}"] * bool(inf)
    return ", ".join(counts) or "0"


def _worst(w: Worst | None, what: str) -> str:
    if w is None:
        return ""
    col = f" col {w.col}" if w.col >= 0 else ""
    where = f"request {w.request} row {w.row_in_request} (step row {w.row}) head {w.head}{col}"
    # 9 significant digits print any two distinct float32 values differently.
    return f"{what}: {where}: {w.a:.9g} vs {w.b:.9g} (difference {abs(w.a - w.b):.3g})"


def _scale(p: PairDiff, a_label: str, b_label: str) -> Text | None:
    """How far each side is from its own float64 reference: the size a difference is judged by."""
    sides = [(label, name, v) for label, name, v in ((a_label, p.a_name, p.a_vs_reference), (b_label, p.b_name, p.b_vs_reference)) if v]
    if not sides:
        return None
    text = "; ".join(f"{name} in {label}: output {_num(v[0])}, LSE {_num(v[1])}" for label, name, v in sides)
    return Text(f"against the float64 reference, for scale: {text}", style="dim")


def _pair_cells(p: PairDiff) -> tuple[str | Text, ...]:
    if p.status is not PairStatus.COMPARED:
        return (_name(p), Text(p.status.value, style="yellow"), "", "", "", "", "")
    out, lse = p.output, p.lse
    if p.bitwise_equal:
        result = Text("identical", style="green")
    elif p.differing_rows == 0:
        result = Text("equal values, bits differ (NaN payload or ±0)", style="yellow")
    else:
        result = Text("differ", style="red")
    mismatches = out.nonfinite_mismatches + lse.nonfinite_mismatches
    return (
        _name(p),
        result,
        _num(out.max_abs),
        _num(lse.max_abs),
        f"{p.differing_rows}/{p.num_rows}" + (f" ({mismatches} non-finite)" if mismatches else ""),
        _nonfinite(p, "a"),
        _nonfinite(p, "b"),
    )


def _pair_detail(p: PairDiff) -> RenderableType:
    differing = [r for r in p.requests if r.differing_rows]
    table = _compact_table(title=f"{_name(p)}: requests that differ")
    for name in ("request", "rows", "rows differ", "output max abs", "LSE max abs", "non-finite"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in differing[:MAX_REQUESTS]:
        _add_row(
            table,
            str(r.request),
            str(r.rows),
            str(r.differing_rows),
            _num(r.output_max_abs),
            _num(r.lse_max_abs),
            str(r.nonfinite_mismatches),
        )
    parts: list[RenderableType] = [table]
    if len(differing) > MAX_REQUESTS:
        parts.append(Text(f"… {len(differing) - MAX_REQUESTS} more differing requests (see --json)", style="dim"))
    heads = sorted(range(len(p.output.head_max_abs)), key=lambda h: -p.output.head_max_abs[h])[:MAX_HEADS]
    named = ", ".join(f"{h} ({_num(p.output.head_max_abs[h])})" for h in heads if p.output.head_max_abs[h] > 0)
    if named:
        parts.append(Text(f"heads with the largest output difference: {named}"))
    for delta, what in ((p.output, "worst output"), (p.lse, "worst LSE")):
        if delta.worst is not None:
            parts.append(Text(_worst(delta.worst, what)))
    return Group(*parts)


def replay_diff_to_json(d: ReplayDiff) -> dict[str, Any]:
    data = {"schema": SCHEMA, "kind": "replays"} | _jsonable(d)
    data["identical"] = d.identical
    for pair, p in zip(data["pairs"], d.pairs):
        pair["bitwise_equal"] = p.bitwise_equal
    return data


# --- recording diff -----------------------------------------------------------------------------


def _step_summary(s: StepDiff) -> str:
    if s.error:
        return f"could not compare: {s.error}"
    if s.a_file is None or s.b_file is None:
        return f"only in {'b' if s.a_file is None else 'a'}"
    assert s.diff is not None
    if s.diff.identical:
        return "identical"
    first = s.diff.differences[0]
    a, b, detail = _field_cells(first)
    return f"{len(s.diff.differences)} fields differ; first {first.field}: {detail or f'{a} vs {b}'}"


def render_recording_diff(d: RecordingDiff) -> RenderableType:
    parts: list[RenderableType] = [Text(f"{printable(d.a_path)} (a) vs {printable(d.b_path)} (b): {counted(len(d.steps), 'step')} paired in order", style="bold")]
    table = Table(header_style="bold", pad_edge=False)
    for name in ("#", "a", "b", "result"):
        table.add_column(name, overflow="fold")
    for s in d.differing[:MAX_FIELDS]:
        _add_row(table, str(s.index), s.a_file or "—", s.b_file or "—", _step_summary(s))
    if d.differing:
        parts.append(table)
    if len(d.differing) > MAX_FIELDS:
        parts.append(Text(f"… {len(d.differing) - MAX_FIELDS} more differing steps (see --json)", style="dim"))
    first = d.first_difference
    if first is None:
        parts.append(Text(f"all {counted(len(d.steps), 'step')} structurally identical", style="green"))
    else:
        parts.append(Text(f"{len(d.differing)} of {counted(len(d.steps), 'step')} differ; first at #{first.index}: {_step_summary(first)}", style="bold red"))
    return Group(*parts)


def recording_diff_to_json(d: RecordingDiff) -> dict[str, Any]:
    first = d.first_difference
    return {
        "schema": SCHEMA,
        "kind": "recordings",
        "identical": not d.differs,
        "a": d.a_path,
        "b": d.b_path,
        "first_difference": None if first is None else first.index,
        "steps": [
            {
                "index": s.index,
                "a_file": s.a_file,
                "b_file": s.b_file,
                "identical": not s.differs,
                "error": s.error or None,
                "diff": None if s.diff is None else _trace_diff_data(s.diff),
            }
            for s in d.steps
        ],
    }


# --- JSON ---------------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """Plain JSON data: dataclasses to dicts, enums to values, non-finite floats to strings
    ("nan", "inf", "-inf"), because strict JSON has no NaN."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj
