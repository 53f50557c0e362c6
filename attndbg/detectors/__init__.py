"""The detectors of `attndbg check`, one package each, and their registry (registry.py).

A package exports one `Detector` (base.py) as `DETECTOR`: its kind, a one-line summary, `detect`,
its recording-level hooks and the mistakes `attndbg synth --inject` plants for it (its
`injections` module). The package's `__init__` imports no torch: listing detectors stays instant.
The check engine that runs them is attndbg/checks.
"""
