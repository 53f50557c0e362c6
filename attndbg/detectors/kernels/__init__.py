"""kernels: every backend's own kernels on the step against the float64 reference (detect.py)."""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.KERNELS,
    summary="every backend that can run the step, on every forward mode, eagerly and (--cuda-graph) as a graph replay, against the float64 reference: a crash, NaN or miss is a library defect named with its release, the shape and an `attndbg repro` command",
    detect="attndbg.detectors.kernels.detect:detect",
)
