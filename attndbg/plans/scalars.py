"""The scalars a plan's kernel is launched with, each with where its value comes from: the plan
records it, the plan leaves it out and the kernel library's default applies, or the plan leaves it
out (or holds no number there) and the value is derived from the trace (the model's window or page
size, as the engine would pass them).

Read by the layout the plan's backend declares (backends/plan_layout.py): the scalar holding the
kernel's own window (`PlanLayout.window`), the page size, and whether a FULL mask's prefix columns
are skipped (`PlanLayout.skip_prefix`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from attndbg.backends.plan_layout import PlanLayout
from attndbg.trace.schema import Plan, Trace


class ScalarSource(enum.Enum):
    RECORDED = "recorded"  # the plan holds it
    LIBRARY_DEFAULT = "the library's default"  # absent: what the kernel library assumes (slot ids are pages of 1, a skipped prefix)
    DERIVED = "derived"  # absent or not a number: taken from the trace (the model's window, its page size)


@dataclass(frozen=True)
class PlanScalar:
    name: str  # the plan scalar's name, e.g. "window_left"
    value: int
    source: ScalarSource


def kernel_window(trace: Trace, plan: Plan, name: str) -> PlanScalar:
    """The window the kernel applies by KV index (`name`: the layout's window scalar); the model's
    when the plan holds no number there."""
    value = plan.scalars.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return PlanScalar(name, int(value), ScalarSource.RECORDED)
    return PlanScalar(name, trace.model.sliding_window, ScalarSource.DERIVED)


def window_right(plan: Plan) -> int:
    """A non-causal call's right window (FA3's `window_right`: SGLang's cascade passes (sw, 0));
    -1 (none) when the plan records no number there."""
    value = plan.scalars.get("window_right")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else -1


def page_size(trace: Trace, plan: Plan, layout: PlanLayout) -> PlanScalar:
    """Tokens per KV id: fixed by the layout (slot ids: 1), else the plan's page_size, else the model's."""
    if layout.page_size is not None:
        return PlanScalar("page_size", layout.page_size, ScalarSource.LIBRARY_DEFAULT)
    value = plan.scalars.get("page_size")
    if value is not None:
        try:
            return PlanScalar("page_size", int(value), ScalarSource.RECORDED)
        except (TypeError, ValueError):
            pass  # not a number (the strict view names it where the kernel reads it): the model's
    return PlanScalar("page_size", trace.model.page_size, ScalarSource.DERIVED)


def skip_prefix(plan: Plan, layout: PlanLayout) -> PlanScalar | None:
    """Whether a FULL mask's prefix columns are skipped by the kernel (SGLang's Triton
    `skip_prefix_custom_mask`, true by default); None where the layout has no such scalar."""
    if layout.skip_prefix is None:
        return None
    if layout.skip_prefix in plan.scalars:
        return PlanScalar(layout.skip_prefix, int(bool(plan.scalars[layout.skip_prefix])), ScalarSource.RECORDED)
    return PlanScalar(layout.skip_prefix, 1, ScalarSource.LIBRARY_DEFAULT)
