"""Diagnosis by reproduction (issue 13): a library of mistake models, each our own float64 math of
one known engine mistake, and `diagnose`, which names the ones that reproduce an engine's output.

    split_models  LSEs in the wrong base (split-KV merge; prefix + new-token merge), empty splits
                  merged from zeroed or stale scratch
    kv_models     another request's KV row; a KV length / query position one off
    mask_models   a verify tree mask ignored (causal by index); a window without the draft offset
"""

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, merge
from attndbg.diagnose.diagnose import MODELS, Reproduction, applicable, diagnose

__all__ = ["MODELS", "Candidate", "MistakeModel", "PartialStates", "Reproduction", "applicable", "diagnose", "merge"]
