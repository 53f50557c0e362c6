"""What a recorded plan says: facts, read once per step, for every part that judges a plan.

`reading.read(trace) -> PlanReading` holds them: the layout its backend declares, the per-request
KV (kv.py: `RequestKV`, the one per-request KV type, and the columns each request's ids cover),
on a verify step what each draft row may see (visibility.py), the padded rows of a graph plan and
the guard's answer on its real part (guard.py), each scalar with its source (scalars.py), how each
tensor divides per request (pieces.py), and the structural problems met, as data (problems.py; the
offsets rule: offsets.py).

Facts, not findings: the detectors judge (attndbg/detectors, through `CheckContext.plan()`, which
memoises the reading per step) and the mistake models reproduce (attndbg/diagnose). This package
imports only attndbg/backends and attndbg/trace; replay (the runner's guard), detector_api and the
minimiser build on it. A new plan fact goes here: docs/architecture.md says how.
"""
