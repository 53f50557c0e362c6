"""split-merge: partial attention states (KV splits, cascade parts) and their merge (detect.py)."""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.SPLIT_MERGE,
    summary="partial states and their merge: decode through every split count, empty splits, the engine's recorded output and LSE (base confusion, NaN rows), cascade and graph merges, a merge step's recorded merge of given states",
    detect="attndbg.detectors.split_merge.detect:detect",
    injections="attndbg.detectors.split_merge.injections",
    forced_runs="attndbg.detectors.split_merge.gpu:forced_runs",
    recording_digest="attndbg.detectors.split_merge.stale:recording_digest",
    recording_state="attndbg.detectors.split_merge.stale:RecordingState",
)
