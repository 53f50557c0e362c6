"""A timeline without nsys (`--timeline FILE`, docs/timeline.md): attndbg's ranges and the kernels they
launched, from CUPTI activity records, as a Chrome trace-event file.

    records.py       CUPTI's records copied into named tuples (one per kernel) and frozen dataclasses
                     (and JSON lines between processes)
    convert.py       cupti-python's record objects into those, keeping what a timeline places
    collector.py     the only code that imports cupti: enables the activity kinds, one external
                     correlation id per open phase, NVTX routed to the same libcupti
    worker.py        a check worker's collection, written to a file the parent merges
    matching.py      kernel -> launch call -> range (external correlation), cross-checked against
                     the NVTX ranges CUPTI saw; graph replays and captured launches
    ranges.py        what a range names (step, backend, variant, phase) from its NVTX messages
    summary.py       per kind of range: kernels, GPU time; what could not be placed
    merge.py         the end of a run over several processes: each file matched and written in a helper
    chrome.py        the trace-event JSON (Perfetto, chrome://tracing), per-kernel events from templates
    names.py         demangled kernel names
    availability.py  whether --timeline can run here (package, GPU), before any work
    session.py       the CLI's context manager around one command
"""
