"""The flashinfer-bench definitions attndbg writes and reads: paged GQA decode, paged GQA causal
prefill and paged MLA decode, named by their convention (`gqa_paged_decode_h32_kv8_d128_ps16`)
where the signature is theirs, else namespaced (`attndbg_gqa_paged_decode_...`: OFFICIAL),
with inputs as FlashInfer's trace templates declare them (flashinfer/trace/templates/attention.py)
plus `kv_last_page_len`, without which a partly filled last page cannot be told from a full one.
The reference of each is our own plain-PyTorch code, its LSE base 2 like FlashInfer's.
"""

from __future__ import annotations

import enum
from typing import Any

from attndbg.trace.schema import Model


class Op(enum.Enum):
    DECODE = "gqa_paged_decode"
    PREFILL = "gqa_paged_prefill_causal"
    MLA_DECODE = "mla_paged_decode"

    @property
    def op_type(self) -> str:
        return "mla_paged" if self is Op.MLA_DECODE else "gqa_paged"


_PAGED_REFERENCE = '''import math
import torch


def run(q, k_cache, v_cache, {indptr_args}kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    """Paged attention{causal_doc}. q [tokens, H, D]; k_cache, v_cache [num_pages, page_size, H_kv, D];
    request b reads pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the last holding
    kv_last_page_len[b] tokens. Returns the output and the base-2 log-sum-exp of the logits."""
    heads, dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    output = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(kv_indptr.shape[0] - 1):
        {rows}
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        if pages.numel() == 0 or last <= first:
            continue
        n = (pages.numel() - 1) * page_size + int(kv_last_page_len[b])
        k = k_cache[pages].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(group, 1)
        v = v_cache[pages].reshape(-1, kv_heads, v_cache.shape[-1])[:n].float().repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * sm_scale
        # causal, bottom-right: query i of m sees keys 0 .. n - m + i
        visible = torch.arange(n, device=q.device)[None, :] <= (n - (last - first) + torch.arange(last - first, device=q.device))[:, None]
        logits = logits.masked_fill(~visible[None], -math.inf)
        lse[first:last] = (torch.logsumexp(logits, -1) / math.log(2)).T
        output[first:last] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v).to(q.dtype)
    return output, lse
'''

_MLA_REFERENCE = '''import math
import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len_arr, sm_scale):
    """DeepSeek MLA decode over paged latent caches: keys are [ckv | kpe] per token, values the ckv
    part; request b reads pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], kv_len_arr[b] tokens of
    them. Returns the output and the base-2 log-sum-exp of the logits."""
    page_size, ckv = ckv_cache.shape[1], ckv_cache.shape[2]
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    output = torch.zeros_like(q_nope)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
    for b in range(kv_indptr.shape[0] - 1):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        n = int(kv_len_arr[b])
        if n == 0:
            continue
        keys = torch.cat([ckv_cache[pages].reshape(-1, ckv), kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])], dim=-1)[:n].float()
        logits = q[b] @ keys.T * sm_scale
        lse[b] = torch.logsumexp(logits, -1) / math.log(2)
        output[b] = (torch.softmax(logits, -1) @ keys[:, :ckv]).to(q_nope.dtype)
    return output, lse
'''


# flashinfer-bench's own definitions of these ops, by the name they start with, with their input
# and output names (FlashInfer's trace templates: tests/trace/fi_trace_out/*.json at fb28d72). A
# definition of ours takes that name only where its inputs and outputs are exactly these; else its
# name is namespaced `attndbg_...`, so no reader mistakes it for theirs (ours add kv_last_page_len
# or kv_len_arr, which their decode and prefill assume away, and take no return_lse).
OFFICIAL: dict[Op, tuple[str, frozenset[str], frozenset[str]]] = {
    Op.DECODE: ("gqa_paged_decode", frozenset({"q", "k_cache", "v_cache", "kv_indptr", "kv_indices", "sm_scale", "return_lse"}), frozenset({"output", "lse"})),
    Op.PREFILL: ("gqa_paged_prefill", frozenset({"q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "sm_scale", "return_lse"}), frozenset({"output", "lse"})),
    Op.MLA_DECODE: (
        "mla_paged_decode",
        frozenset({"q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices", "sm_scale", "ckv_scale", "ckv_scale_arr", "kpe_scale", "return_lse"}),
        frozenset({"output", "lse"}),
    ),
}
NAMESPACE = "attndbg_"


def _tensor(shape: list[str] | None, dtype: str, description: str) -> dict[str, Any]:
    return {"shape": shape, "dtype": dtype, "description": description}


def definition_name(op: Op, model: Model, inputs: set[str] | frozenset[str], outputs: set[str] | frozenset[str]) -> str:
    """Their convention's name (`gqa_paged_decode_h32_kv8_d128_ps16`) where the signature is theirs,
    else ours under the `attndbg_` namespace."""
    official, their_inputs, their_outputs = OFFICIAL[op]
    base = official if (set(inputs), set(outputs)) == (their_inputs, their_outputs) else f"{NAMESPACE}{op.value}"
    if op is Op.MLA_DECODE:
        return f"{base}_h{model.num_qo_heads}_ckv{model.kv_lora_rank}_kpe{model.qk_rope_head_dim}_ps{model.page_size}"
    return f"{base}_h{model.num_qo_heads}_kv{model.num_kv_heads}_d{model.head_dim}_ps{model.page_size}"


def definition(op: Op, model: Model) -> dict[str, Any]:
    """The Definition JSON of `op` at `model`'s shape and dtypes."""
    index = {
        "kv_indptr": _tensor(["len_indptr"], "int32", "KV page offsets of each request (FlashInfer's paged_kv_indptr)."),
        "kv_indices": _tensor(["num_kv_indices"], "int32", "Page ids of the requests' KV, request after request."),
    }
    scale = {"sm_scale": _tensor(None, "float32", "Softmax scale applied to q.k.")}
    lse = _tensor(["tokens", "num_qo_heads"], "float32", "Base-2 log-sum-exp of each row's logits (FlashInfer's convention).")
    common_axes = {
        "num_pages": {"type": "var", "description": "Pages of the KV pool."},
        "len_indptr": {"type": "var", "description": "Length of kv_indptr: requests + 1."},
        "num_kv_indices": {"type": "var", "description": "Page ids listed in kv_indices."},
        "page_size": {"type": "const", "value": model.page_size, "description": "Tokens per KV page."},
        "batch_size": {"type": "var", "description": "Requests in the batch."},
    }
    if op is Op.MLA_DECODE:
        axes = {
            "tokens": {"type": "var", "description": "Query tokens: one per request."},
            "num_qo_heads": {"type": "const", "value": model.num_qo_heads, "description": "Query heads."},
            "head_dim_ckv": {"type": "const", "value": model.kv_lora_rank, "description": "Latent (compressed KV) width."},
            "head_dim_kpe": {"type": "const", "value": model.qk_rope_head_dim, "description": "Rope key width."},
            **common_axes,
        }
        inputs = {
            "q_nope": _tensor(["tokens", "num_qo_heads", "head_dim_ckv"], model.q_dtype, "Absorbed query, latent part."),
            "q_pe": _tensor(["tokens", "num_qo_heads", "head_dim_kpe"], model.q_dtype, "Query, rope part."),
            "ckv_cache": _tensor(["num_pages", "page_size", "head_dim_ckv"], model.kv_dtype, "Paged latent cache."),
            "kpe_cache": _tensor(["num_pages", "page_size", "head_dim_kpe"], model.kv_dtype, "Paged rope-key cache."),
            **index,
            "kv_len_arr": _tensor(["batch_size"], "int32", "Tokens each request reads."),
            **scale,
        }
        outputs = {"output": _tensor(["tokens", "num_qo_heads", "head_dim_ckv"], model.q_dtype, "Attention output."), "lse": lse}
        constraints = ["len_indptr == batch_size + 1", "tokens == batch_size", "num_kv_indices == kv_indptr[-1].item()"]
        reference = _MLA_REFERENCE
        stage = "decode"
    else:
        prefill = op is Op.PREFILL
        axes = {
            "tokens": {"type": "var", "description": "Query tokens of the batch."},
            "num_qo_heads": {"type": "const", "value": model.num_qo_heads, "description": "Query heads."},
            "num_kv_heads": {"type": "const", "value": model.num_kv_heads, "description": "KV heads."},
            "head_dim": {"type": "const", "value": model.head_dim, "description": "Head width of q, k and v."},
            **common_axes,
        }
        inputs = {
            "q": _tensor(["tokens", "num_qo_heads", "head_dim"], model.q_dtype, "Queries."),
            "k_cache": _tensor(["num_pages", "page_size", "num_kv_heads", "head_dim"], model.kv_dtype, "Paged key cache (NHD)."),
            "v_cache": _tensor(["num_pages", "page_size", "num_kv_heads", "head_dim"], model.kv_dtype, "Paged value cache (NHD)."),
            **({"qo_indptr": _tensor(["len_indptr"], "int32", "Query offsets of each request.")} if prefill else {}),
            **index,
            "kv_last_page_len": _tensor(["batch_size"], "int32", "Tokens in each request's last page."),
            **scale,
        }
        outputs = {"output": _tensor(["tokens", "num_qo_heads", "head_dim"], model.q_dtype, "Attention output."), "lse": lse}
        constraints = ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"]
        constraints.append("tokens == qo_indptr[-1].item()" if prefill else "tokens == batch_size")
        rows = "first, last = int(qo_indptr[b]), int(qo_indptr[b + 1])" if prefill else "first, last = b, b + 1"
        reference = _PAGED_REFERENCE.format(indptr_args="qo_indptr, " if prefill else "", rows=rows, causal_doc=", causal (bottom-right)" if prefill else ", one query per request")
        stage = "prefill" if prefill else "decode"
    return {
        "name": definition_name(op, model, set(inputs), set(outputs)),
        "op_type": op.op_type,
        "description": f"Paged {'MLA' if op is Op.MLA_DECODE else 'GQA'} {stage} as attndbg exports a recorded step (written by attndbg export fib).",
        "tags": [f"stage:{stage}", "status:draft", "source:attndbg"],
        "axes": axes,
        "constraints": constraints,
        "inputs": inputs,
        "outputs": outputs,
        "reference": reference,
    }
