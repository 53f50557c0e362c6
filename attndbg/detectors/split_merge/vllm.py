"""split-merge with vLLM: PagedAttention v2's own kernel (fixed 512-token partitions merged
through exp_sums/max_logits) run on the step through the runner, as the `vllm_paged` backend
(backends/vllm_paged.py), which says why it cannot run where it cannot.
"""

from __future__ import annotations

from attndbg.backends.options import BackendOptions
from attndbg.backends.vllm_paged import VllmPagedBackend
from attndbg.detector_api.context import CheckContext
from attndbg.replay import runner
from attndbg.replay.runner import ReplayOptions, RunStatus


def _vllm_v2_available(ctx: CheckContext) -> bool:
    """Whether vLLM's kernel can run the step here (asked of the adapter with its default options,
    whichever backends the check was asked for: v2 is one of this detector's split configurations)."""
    backend = ctx.adapter(VllmPagedBackend.name, BackendOptions())
    return backend.unavailable_reason() is None and backend.unsupported_reason(ctx.trace) is None


def _vllm_v2_run(ctx: CheckContext) -> runner.BackendRun | str:
    """The eager run of vLLM's paged_attention_v2 on the step; a string when the kernel raised
    (its op did not take our call: its signature moves between vLLM versions)."""
    run = ctx.replay(ReplayOptions(layer=ctx.options.layer), (VllmPagedBackend.name,)).runs[0]
    if run.status is RunStatus.ERROR:
        return run.reason or "vLLM paged_attention_v2 raised"
    return run
