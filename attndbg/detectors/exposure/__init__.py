"""exposure: which known mistakes this step's metadata exposes it to, and what each would cost (detect.py).

Opt-in: it runs the mistake models' float64 candidates on every step, so `check` runs it only when
named (`--only exposure`). Its findings are not bugs the engine made: each says a precondition is
there and how far the output would move if the engine made the mistake.
"""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.EXPOSURE,
    summary="opt-in, runs only when named in --only: mistakes whose precondition the step's metadata shows (empty or too many splits in the recorded split plan, a recorded plan whose KV slots or mask differ from the batch), with how far each would move the output",
    detect="attndbg.detectors.exposure.detect:detect",
    opt_in=True,
)
