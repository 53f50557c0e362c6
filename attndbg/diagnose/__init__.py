"""Diagnosis by reproduction: a library of mistake models, each our own float64 math of
one known engine mistake, and `diagnose`, which names the ones that reproduce an engine's output.

    split_models  LSEs in the wrong base (split-KV merge; prefix + new-token merge), empty splits
                  merged from zeroed or stale scratch, splits beyond the captured max_kv_splits
    kv_models     another request's KV row; the recorded plan's wrong slots; the capture batch's
                  metadata left in a graph; a KV length / query position one off; stale positions
    mask_models   a verify tree mask ignored (causal by index), transposed, in the other bit order,
                  ignored past the causal tile; the recorded plan's wrong mask; a window without
                  the draft offset
    exposure      the models as "would this step break under M?" where the metadata shows M's precondition
"""

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, merge
from attndbg.diagnose.diagnose import MASK_MODELS, MODELS, Reproduction, applicable, diagnose

__all__ = ["MASK_MODELS", "MODELS", "Candidate", "MistakeModel", "PartialStates", "Reproduction", "applicable", "diagnose", "merge"]
