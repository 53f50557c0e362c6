"""Results and how two of them compare: the layer below the runner.

    cli, report, checks, detectors      parse, judge, render
            │
    attndbg.replay                      the runner: data, plans, kernels (eager, recorded, graph)
            │
    attndbg.compare                     formats and result types: no kernel runs here
            │
    attndbg.trace, attndbg.backends     the step and the adapters' shared types

- `tolerance`: a run against the float64 reference (`Comparison`, `ReferenceBasis`, `Location`),
  the result type every replay, check and report shares;
- `saved`: the saved-replay file format (`replay --save` writes it, `diff` reads it);
- `replay_diff`, `trace_diff`, `recording_diff`: differences between two saved replays, traces or
  recordings, as data for `report.diff`.

Nothing here imports `attndbg.replay` (or anything above it): the runner imports these, never the
other way, so a diff of two saved files needs no kernel, and `tests/compare/test_layering.py`
keeps it so.
"""
