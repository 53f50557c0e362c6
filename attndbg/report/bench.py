"""Render `attndbg bench`: a table of timings, the skipped backends, a verdict line; and the same
object as `attndbg.bench/1` JSON (docs/json.md). Pure functions of `BenchResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attndbg.replay.timing import Timing
from attndbg.report.replay import first_clause

SCHEMA = "attndbg.bench/1"


@dataclass(frozen=True)
class Timed:
    timing: Timing
    description: str  # what ran


@dataclass(frozen=True)
class BenchResult:
    trace_path: str
    mode: str
    batch_size: int
    copy_gbps: float  # the device's measured copy bandwidth, the peak the timings are set against
    timed: tuple[Timed, ...]
    skipped: tuple[tuple[str, str], ...]  # (backend, why it could not be timed)
    named: tuple[str, ...]  # backends named explicitly (empty for `--backend all`)

    @property
    def incomplete(self) -> bool:
        """A named backend could not be timed, or nothing was."""
        return not self.timed or any(name in self.named for name, _ in self.skipped)


def verdict_line(r: BenchResult) -> Text:
    names = [t.timing.backend for t in r.timed]
    text = f"{len(names)} backend{'s' * (len(names) != 1)} timed ({', '.join(names) or 'none'})"
    text += "".join(f"; {name} skipped: {first_clause(why)}" for name, why in r.skipped)
    label, style = ("INCOMPLETE", "bold yellow") if r.incomplete else ("TIMED", "bold green")
    return Text(f"{label}: {text}", style=style)


def render_bench(r: BenchResult) -> RenderableType:
    parts: list[RenderableType] = [
        Text(f"{r.trace_path}: {r.mode} bs={r.batch_size}; device copy bandwidth {r.copy_gbps:.0f} GB/s", style="bold")
    ]
    if r.timed:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, header_style="bold")
        table.add_column("backend", overflow="fold", min_width=len("reference"))
        for column in ("median", "min..max us", "bytes", "GB/s", "of peak"):
            table.add_column(column, justify="right", no_wrap=True)
        for t in (x.timing for x in r.timed):
            table.add_row(
                Text(t.backend),
                f"{t.median_us:.1f} us",
                f"{t.min_us:.1f}..{t.max_us:.1f}",
                f"{t.bytes_moved / 1e6:.1f} MB",
                f"{t.achieved_gbps:.0f}",
                f"{t.achieved_gbps / r.copy_gbps:.0%}",
            )
        parts.append(table)
    parts += [Text(f"{name}: skipped: {why}", style="yellow") for name, why in r.skipped]
    parts += [Text(f"{x.timing.backend}: {x.description}", style="dim") for x in r.timed]
    parts.append(verdict_line(r))
    return Group(*parts)


def bench_to_json(r: BenchResult) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "verdict": "incomplete" if r.incomplete else "timed",
        "summary": verdict_line(r).plain,
        "trace": r.trace_path,
        "copy_gbps": r.copy_gbps,
        "timed": [asdict(x.timing) | {"description": x.description} for x in r.timed],
        "skipped": [{"backend": name, "reason": why} for name, why in r.skipped],
    }
