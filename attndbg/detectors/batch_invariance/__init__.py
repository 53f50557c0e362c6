"""batch-invariance: a request's output must not depend on what it is batched with (detect.py).

Opt-in: it replays every request alone and the batch's two halves, bs + 3 launches per backend,
so `check` runs it only when named (`--only batch-invariance`).
"""

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector

DETECTOR = Detector(
    kind=FindingClass.BATCH_INVARIANCE,
    summary="opt-in, runs only when named in --only (bs + 3 launches per backend): each request's output run alone, and in each half of a batch of 4 or more, against the same request in the whole batch (eager, and graph replays under --cuda-graph), beyond the reference tolerance",
    detect="attndbg.detectors.batch_invariance.detect:detect",
    opt_in=True,
)
