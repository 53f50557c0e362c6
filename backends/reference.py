"""Ground truth: attention computed from the batch alone, in float64 (or, for the tolerance model,
in the run's own low precision).

Nothing here reads a plan. Which keys a query sees comes from the batch: its column in the
request's KV row (causal), the draft tree (verify), the sliding window and the soft-cap.
"""

from __future__ import annotations

import torch

from attndbg.backends.base import AttentionInputs, AttentionResult, Backend
from attndbg.trace.visibility import visibility
from attndbg.trace.schema import Plan, Trace


def attention(trace: Trace, inputs: AttentionInputs, compute_dtype: torch.dtype = torch.float64) -> AttentionResult:
    """Masked softmax attention per request.

    float64: the reference. A low dtype: what a plain PyTorch implementation in the run's dtype
    commits (scores and the weighted sum in that dtype, softmax in float32 then cast, as
    FlashAttention's `attention_ref(upcast=False)`), used to size tolerances.
    """
    model = trace.model
    batch = trace.batch
    low = compute_dtype != torch.float64
    qo = batch.qo_indptr
    group = model.gqa_group
    out = torch.zeros(batch.num_tokens, model.num_qo_heads, model.v_head_dim, dtype=compute_dtype, device=inputs.q.device)
    lse = torch.full((batch.num_tokens, model.num_qo_heads), float("-inf"), dtype=torch.float64, device=inputs.q.device)
    for b in range(batch.batch_size):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if rows.start == rows.stop:
            continue
        slots = batch.request_slots(b).to(inputs.q.device)
        q = inputs.q[rows].to(compute_dtype)  # [e, Hq, Dk]
        k = inputs.k_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)  # [kv, Hq, Dk]
        v = inputs.v_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)  # [kv, Hq, Dv]
        scores = torch.einsum("qhd,khd->hqk", q, k) * model.sm_scale  # [Hq, e, kv]
        if model.logit_cap > 0:
            scores = model.logit_cap * torch.tanh(scores / model.logit_cap)
        visible = visibility(trace, b).to(inputs.q.device)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        softmax_dtype = torch.float32 if low else torch.float64
        probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(compute_dtype)
        probs = torch.nan_to_num(probs, nan=0.0)  # a row that sees nothing has no weights
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[rows] = torch.logsumexp(scores.to(torch.float64), dim=-1).T
    return AttentionResult(output=out, lse=lse)


class ReferenceBackend(Backend):
    name = "reference"

    def unavailable_reason(self) -> str | None:
        return None

    def describe(self) -> str:
        return "float64 PyTorch attention from the batch alone (ground truth)"

    def device(self) -> str:
        return "cpu"

    def unsupported_reason(self, trace: Trace) -> str | None:
        return None

    def derive_plan(self, trace: Trace) -> Plan:
        return Plan(backend=self.name, tensors={}, scalars={})

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        return attention(trace, inputs, torch.float64)
