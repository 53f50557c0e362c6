"""invariants: the batch's bookkeeping and the recorded plan, checked against the batch (detect.py)."""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.INVARIANT,
    summary="the engine's positions and seq_lens, and the recorded plan's indptrs, KV ids and lengths, split counts, window lists and FlashInfer's own work-item schedule (plan info), against the batch; plan pointers that move between graph replays",
    detect="attndbg.detectors.invariants.detect:detect",
    injections="attndbg.detectors.invariants.injections",
    recording_digest="attndbg.detectors.invariants.detect:recording_digest",
    recording_state="attndbg.detectors.invariants.detect:RecordingState",
    reads_plan=True,
)
