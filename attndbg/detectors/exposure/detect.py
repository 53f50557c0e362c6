"""exposure: the mistake models run as "would this step break under M?" (attndbg/diagnose/exposure.py).

One finding per mistake that would move some request's output beyond the step's tolerance, named
`exposed-to-<mechanism>`, with the requests, the parameters and the size of the move. On a step
with the engine's tensors, the first recorded layer is judged (its real q/K/V); else the step's
seeded inputs. Every exposure is a hazard: nothing says the engine made the mistake, the finding
states the mistake under which this step would break (whether it did is split-merge's and
tree-mask's recorded-output findings, defects).
"""

from __future__ import annotations

from dataclasses import replace

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, FindingClass, Location, Severity
from attndbg.diagnose.exposure import exposures

KIND = FindingClass.EXPOSURE


def detect(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    layer = ctx.options.layer if ctx.options.layer is not None else (min(trace.tensors) if trace.tensors else None)
    where = Location(step=ctx.step, layer=layer)
    out = []
    for e in exposures(ctx.data(layer)):
        b = e.requests[0]
        out.append(
            Finding(
                KIND,
                f"exposed-to-{e.mechanism}",
                replace(where, request=b, row=int(trace.batch.qo_indptr[b])),
                f"the step's metadata shows the precondition of {e.mechanism}: {e.summary} would move requests "
                f"{list(e.requests)} up to {e.worst:.3g}x the output tolerance off the reference ({'; '.join(e.details)})",
                f"If the engine makes this mistake: {e.cause}",
                data={"exposure": e.to_json()},
                severity=Severity.HAZARD,
            )
        )
    return out
