"""Render `attndbg backends`: which backends run here (and exactly why not), and with
`--capabilities` what each declares it can run, read from the same `Capabilities` data that the
replay and the detectors act on. Pure functions of `BackendStatus`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from attndbg.backends.base import Backend, FillRequirement
from attndbg.backends.capabilities import Capabilities, dtype_words
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


def render_backends(statuses: list[BackendStatus], *, capabilities: bool) -> RenderableType:
    table = Table(title="attndbg backends")
    for column in ("backend", "available", "what runs / why not"):
        table.add_column(column)
    for status in statuses:
        table.add_row(status.name, "no" if status.unavailable else "yes", status.unavailable or status.description)
    if not capabilities:
        return table
    return Group(table, render_capabilities(statuses))


def _names(values) -> str:
    return ", ".join(sorted(str(getattr(v, "value", v)) for v in values)) or "-"


def render_capabilities(statuses: list[BackendStatus]) -> Table:
    table = Table(title="what each declares (backends/capabilities.py); unavailable backends as configured")
    for column in ("backend", "attention: modes", "CUDA graph", "q / KV dtypes", "head dims", "masks", "window", "soft-cap", "LSE", "padded seq_len"):
        table.add_column(column)
    for status in statuses:
        c = status.capabilities
        modes = "; ".join(
            f"{kind.value}: {_names(m.name.lower() for m in c.modes.get(kind, ()))}" for kind in AttentionKind if kind in c.attention
        )
        dims = c.head_dims
        head = ", ".join(f"{a}/{b}" for a, b in sorted(dims.pairs)) if dims.pairs else "any"
        if dims.min_outside_decode:
            head += f"; >= {dims.min_outside_decode} outside decode"
        masks = ", ".join(word for word, ok in (("tree", c.tree_mask), ("column", c.column_mask)) if ok) or "none"
        window = f"W+{c.window_extra_keys} keys" + ("" if c.window_in_tree_verify else ", not in tree verify") if c.sliding_window else "no"
        fill = f">= {status.fill_requirement.min_seq_len}" if status.fill_requirement else "-"
        table.add_row(
            status.name,
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
    return table
