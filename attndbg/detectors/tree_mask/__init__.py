"""tree-mask: speculative-verify masks against the draft tree, and verify outputs (detect.py)."""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.TREE_MASK,
    summary="verify-step tree masks (the spec's and the one the plan's kernel reads: layout, bit order, prefix, window) against the draft tree; stale masks; verify outputs against the reference",
    detect="attndbg.detectors.tree_mask.detect:detect",
    injections="attndbg.detectors.tree_mask.injections",
    recording_digest="attndbg.detectors.tree_mask.detect:recording_digest",
    recording_state="attndbg.detectors.tree_mask.detect:RecordingState",
    reads_plan=True,
)
