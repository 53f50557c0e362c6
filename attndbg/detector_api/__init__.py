"""The detector contract: what a detector is given for one step (context.py: `CheckContext`, the
trace with memoised data and replays) and what it reports (findings.py: `Finding`,
`FindingClass`, `Severity`, `finding()`).

Below the detectors, the mistake models of attndbg/diagnose and the check engine (attndbg/checks),
which all import it; it imports none of them. `Detector` itself is attndbg/detectors/base.py.
This `__init__` imports nothing: the findings vocabulary stays free of torch.
"""
