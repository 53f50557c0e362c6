"""split-merge: partial attention states (KV splits, cascade parts) and how they are merged.

What it runs (DESIGN.md "The detectors"):

  split counts      decode steps through our Triton split-KV kernels with num_kv_splits forced to
                    1, 2, SGLang's heuristic (the engine's), the recorded plan's, and the maximum
                    (16), plus vLLM PagedAttention v2's scheme (below); any configuration that
                    fails the float64 reference is reported with the request/row/head, its empty
                    splits, and how it differs from the single-split run.
  empty states      our stage 2 driven directly with crafted partials: empty splits whose scratch
                    holds -inf (an empty state) or +inf (FlashAttention-2 marks empty rows +inf)
                    must be skipped, and a row whose every split is empty must give 0 / -inf, not
                    NaN (FlashInfer #4051); reported where the trace reaches that case.
  recorded tensors  the engine's own output/LSE (Trace.tensors) against the reference: LSE base
                    confusion named by its ratio (log2 e: a base-2 LSE read as natural log; ln 2:
                    the reverse; FlashInfer #2113, SGLang #40903), FA2's +inf empty marker
                    recognised, NaN rows of requests with empty splits, and a merged output that
                    matches the reference only with one or both partials' LSEs rescaled by log2 e or ln 2.
  merge steps       a standalone merge of given states (trace.merge): the engine's recorded merge
                    against the float64 merge of the same states, an LSE base confusion named by
                    the rescaling (log2 e, ln 2; every state or one) that reproduces it.
  GPU only          FlashInfer's cascade (ragged + paged merged) against one paged pass, with empty
                    prefixes; `flashinfer.cascade.merge_state` on empty states; graph replay
                    against eager for paths with a merge (a merge launched off the capture stream
                    is missing from the graph, SGLang #5404).

vLLM PagedAttention v2 splits every sequence into fixed 512-token partitions and merges them
through exp_sums/max_logits. With vLLM importable on a GPU its kernel runs; otherwise our kernels
run with num_kv_splits = cdiv(len, 512) per request: the same number of partitions as v2, but our
split length is cdiv(cdiv(len, s), 32) * 32 tokens (SGLang's rule, computed in the kernel from the
length and the split count), which equals 512 only when cdiv(len, s) > 480 (e.g. len 1000, not
1025: 352 + 352 + 321 instead of 512 + 512 + 1). Exact 512-token partitions would need a fixed
partition size inside the kernel, which ours (like SGLang's) does not have.
"""

from __future__ import annotations

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding
from attndbg.detectors.split_merge.counts import split_counts
from attndbg.detectors.split_merge.merge_step import merge_step
from attndbg.detectors.split_merge.gpu import cascade_vs_single_pass, flashinfer_merge_state, merge_in_capture
from attndbg.detectors.split_merge.recorded import recorded_tensors
from attndbg.detectors.split_merge.stage2 import empty_split_merge


def detect(ctx: CheckContext) -> list[Finding]:
    if ctx.trace.merge is not None:  # a merge of given states: its recorded merge is all there is to judge
        return merge_step(ctx)
    return (
        split_counts(ctx)
        + empty_split_merge(ctx)
        + recorded_tensors(ctx)
        + cascade_vs_single_pass(ctx)
        + flashinfer_merge_state(ctx)
        + merge_in_capture(ctx)
    )
