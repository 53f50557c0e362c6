"""Diagnosis by reproduction: a library of mistake models, each our own float64 math of
one known engine mistake, and `diagnose`, which names the ones that reproduce an engine's output.

    split_models  LSEs in the wrong base (split-KV merge; prefix + new-token merge, one part or
                  both), empty splits merged from zeroed or stale scratch, splits beyond the
                  captured max_kv_splits, a merge that used another split count than stage 1
    kv_models     another request's KV row; the recorded plan's wrong slots; the capture batch's
                  metadata left in a graph; a KV length / query position one off; stale positions;
                  new tokens' keys read twice (a prefix list over them)
    page_models   a paged KV length a page short (last_page_len 0)
    mask_models   a verify tree mask ignored (causal by index), transposed, in the other bit order,
                  ignored past the causal tile, read with another row stride; the recorded plan's
                  wrong mask; a window without the draft offset
    stale_models  a custom mask the plan kept from an earlier plan, applied on a causal step
    stale_output  across steps: an engine output that does not depend on its step's inputs (the
                  same bits as an earlier step's: a kernel left out of a captured graph)
    exposure      the models as "would this step break under M?" where the metadata shows M's precondition
"""

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, merge
from attndbg.diagnose.diagnose import MASK_MODELS, MODELS, Reproduction, applicable, diagnose

__all__ = ["MASK_MODELS", "MODELS", "Candidate", "MistakeModel", "PartialStates", "Reproduction", "applicable", "diagnose", "merge"]
