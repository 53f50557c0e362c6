"""Attach to a trace the plan a correct engine backend would have recorded.

Synth traces carry a plan so that the recorded-plan path, `show` and `diff` have something real
to work on. The plan comes from the backend the trace names (`source.backend`), derived from the
batch exactly as that backend's engine counterpart would.
"""

from __future__ import annotations

from dataclasses import replace

from attndbg.backends import registry
from attndbg.trace.schema import Trace


def with_engine_plan(trace: Trace) -> Trace:
    if trace.merge is not None:
        return trace  # a merge of given states is planned by nobody
    backend = registry.create(trace.source.backend)
    if backend.unsupported_reason(trace):
        return trace  # that engine backend could not run this step: no plan to record
    return replace(trace, plan=backend.derive_plan(trace))
