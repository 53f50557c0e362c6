"""fill-value: how a batch was padded for a CUDA graph, and what the padding does (detect.py)."""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.FILL_VALUE,
    summary="CUDA-graph padding: padded seq_lens a kernel cannot take, padded KV writes, stale padded rows and positions, and the step replayed padded with each backend's fill value",
    detect="attndbg.detectors.fill_value.detect:detect",
    injections="attndbg.detectors.fill_value.injections",
)
