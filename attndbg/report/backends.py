"""Render `attndbg backends`: which backends run here (and exactly why not), and with
`--capabilities` what each declares it can run, read from the same `Capabilities` data that the
replay and the detectors act on. Pure functions of `BackendStatus`."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attndbg.backends.base import Backend, FillRequirement
from attndbg.backends.capabilities import Capabilities, dtype_words
from attndbg.report.terminal import PIPED_WIDTH, unbounded
from attndbg.trace.schema import AttentionKind


@dataclass(frozen=True)
class BackendStatus:
    name: str
    unavailable: str | None  # why it cannot run here; None: it can
    description: str  # what runs (only when it can)
    capabilities: Capabilities
    fill_requirement: FillRequirement | None


def backend_status(name: str, backend: Backend) -> BackendStatus:
    unavailable = backend.unavailable_reason()
    return BackendStatus(
        name=name,
        unavailable=unavailable,
        description="" if unavailable else backend.describe(),
        capabilities=backend.capabilities(),
        fill_requirement=backend.fill_requirement,
    )


SCHEMA = "attndbg.backends/1"


def backends_to_json(statuses: list[BackendStatus]) -> dict[str, Any]:
    """`backends --json`: the same statuses, capabilities as declared (sets sorted, enums by value)."""
    return {
        "schema": SCHEMA,
        "backends": [
            {
                "name": s.name,
                "available": s.unavailable is None,
                "unavailable": s.unavailable,
                "description": s.description,
                "capabilities": _plain(s.capabilities),
                "fill_requirement": _plain(s.fill_requirement),
            }
            for s in statuses
        ],
    }


def _plain(value: Any) -> Any:
    """A declaration as JSON values: dataclasses as objects, enums by value, sets as sorted lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# An install command inside a reason, quoted as `pip install ...` (backends write them so).
_COMMAND = re.compile(r"`([^`]+)`")


def render_backends(statuses: list[BackendStatus], *, capabilities: bool) -> RenderableType:
    """The status table (install commands named in the reasons are listed after it, by
    `install_commands`); with `capabilities`, what each declares."""
    table = Table(title="attndbg backends", title_justify="left")
    for column in ("backend", "available", "what runs / why not"):
        table.add_column(column)
    for status in statuses:
        reason = status.unavailable
        table.add_row(status.name, "no" if reason else "yes", Text(_COMMAND.sub(r"\1", reason) if reason else status.description))  # Text: '[flashinfer]' is not markup
    return Group(table, _Capabilities(statuses), render_layer_kinds(statuses)) if capabilities else table


# The layer kinds and batch forms of trace/schema.py beyond causal self-attention, as capability fields.
LAYER_KINDS = (
    ("non-causal", "non_causal"),
    ("right window", "window_right"),
    ("sinks", "sinks"),
    ("KV scales", "kv_scales"),
    ("cross-attention", "cross"),
    ("extend mask", "extend_mask"),
    ("empty KV", "empty_kv"),
    ("merge of given states", "merge_state"),
)


def render_layer_kinds(statuses: list[BackendStatus]) -> Group:
    """Which layer kinds (docs/trace-format.md) each backend takes, and why not where it declares
    why: a line a backend, which folds at any width."""
    lines: list[RenderableType] = [Text("layer kinds each takes (docs/trace-format.md)", style="bold")]
    for status in statuses:
        c = status.capabilities
        takes = [word for word, name in LAYER_KINDS if getattr(c, name)]
        refuses = [f"{word} ({c.why[name]})" if name in c.why else word for word, name in LAYER_KINDS if not getattr(c, name)]
        text = f"{status.name}: takes {', '.join(takes) or 'none'}" + (f"; not {'; '.join(refuses)}" if refuses else "")
        lines.append(Text(text))
    return Group(*lines)


def install_commands(statuses: list[BackendStatus]) -> list[Text]:
    """'  fa3: pip install sgl-kernel', one line per command a reason names: printed whole whatever
    the width (soft-wrapped: the terminal may fold it on screen, a copy is one line), never
    wrapped inside a table cell, where a command cut in two is no command."""
    return [Text.assemble((f"  {s.name}: ", "dim"), command) for s in statuses for command in _COMMAND.findall(s.unavailable or "")]


def _names(values) -> str:
    return ", ".join(sorted(str(getattr(v, "value", v)) for v in values)) or "-"


_CAPABILITIES_TITLE = "what each declares (backends/capabilities.py); unavailable backends as configured"
_CAPABILITY_COLUMNS = ("attention: modes", "CUDA graph", "q / KV dtypes", "head dims", "masks", "window", "soft-cap", "LSE", "padded seq_len")


def _capability_cells(status: BackendStatus) -> tuple[str, ...]:
    c = status.capabilities
    modes = "; ".join(f"{kind.value}: {_names(m.name.lower() for m in c.modes.get(kind, ()))}" for kind in AttentionKind if kind in c.attention)
    dims = c.head_dims
    head = ", ".join(f"{a}/{b}" for a, b in sorted(dims.pairs)) if dims.pairs else "any"
    if dims.min_outside_decode:
        head += f"; >= {dims.min_outside_decode} outside decode"
    masks = ", ".join(word for word, ok in (("tree", c.tree_mask), ("column", c.column_mask)) if ok) or "none"
    window = f"W+{c.window_extra_keys} keys" + ("" if c.window_in_tree_verify else ", not in tree verify") if c.sliding_window else "no"
    fill = f">= {status.fill_requirement.min_seq_len}" if status.fill_requirement else "-"
    return (
        modes,
        _names(m.name.lower() for m in c.graph_modes),
        f"{dtype_words(c.q_dtypes)} / {dtype_words(c.kv_dtypes)}" + (" (one dtype)" if c.kv_dtype_is_q_dtype else ""),
        head,
        masks,
        window,
        "yes" if c.soft_cap else "no",
        "base 2" if c.lse_base.value == "2" else "natural",
        fill,
    )


def render_capabilities(statuses: list[BackendStatus]) -> Table:
    """What each backend declares, one row a backend (as wide as the longest declaration)."""
    table = Table(title=_CAPABILITIES_TITLE, title_justify="left")
    for column in ("backend", *_CAPABILITY_COLUMNS):
        table.add_column(column, no_wrap=True)
    for status in statuses:
        table.add_row(status.name, *_capability_cells(status))
    return table


def render_capabilities_stacked(statuses: list[BackendStatus]) -> Group:
    """The same, one backend after another, a declaration a line: what reads at 80 columns and in a pipe."""
    parts: list[RenderableType] = [Text(_CAPABILITIES_TITLE, style="bold")]
    for status in statuses:
        parts.append(Padding(Text(status.name, style="bold"), (0, 0, 0, 2)))
        fields = Table.grid(padding=(0, 1))
        fields.add_column(style="dim", no_wrap=True)
        fields.add_column(overflow="fold")
        for label, value in zip(_CAPABILITY_COLUMNS, _capability_cells(status)):
            fields.add_row(label, value)
        parts.append(Padding(fields, (0, 0, 0, 4)))
    return Group(*parts)


@dataclass(frozen=True)
class _Capabilities:
    """The capabilities table where the terminal is wide enough for it whole; stacked where it is
    not (cells cut at 80 columns) and in a pipe (a table there is some 200 columns wide)."""

    statuses: list[BackendStatus]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = render_capabilities(self.statuses)
        whole = Measurement.get(console, options.update(width=PIPED_WIDTH), table).maximum  # measured unclamped
        fits = whole <= options.max_width
        yield table if fits and not unbounded(options) else render_capabilities_stacked(self.statuses)
