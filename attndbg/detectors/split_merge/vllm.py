"""split-merge on a GPU with vLLM: PagedAttention v2's own kernel (fixed 512-token partitions
merged through exp_sums/max_logits) run on the step.
"""

from __future__ import annotations

import torch

from attndbg import machine
from attndbg.backends.base import AttentionResult
from attndbg.checks.context import CheckContext
from attndbg.replay import runner
from attndbg.replay.runner import RunStatus
from attndbg.trace.schema import DTYPES, AttentionKind, Trace


V2_PARTITION_TOKENS = 512  # vLLM's _PARTITION_SIZE for paged_attention_v2
V2_BLOCK_SIZE = 16  # a KV block size vLLM's v1/v2 kernels are instantiated for


def _vllm_v2_available(trace: Trace) -> bool:
    m = trace.model
    return (
        machine.cuda_available()
        and machine.module_available("vllm")
        and m.attention is AttentionKind.MHA
        and m.head_dim == m.v_head_dim
        and m.sliding_window < 0
        and m.logit_cap == 0
        and m.q_dtype == m.kv_dtype
    )


def _vllm_v2_run(ctx: CheckContext) -> runner.BackendRun | str:
    """vLLM's paged_attention_v2 on the step: each request's K/V gathered into 16-token blocks in
    vLLM's v1/v2 cache layout; the LSE is rebuilt from the kernel's per-partition exp_sums/max_logits."""
    from vllm import _custom_ops as ops

    trace = ctx.trace
    m, batch = trace.model, trace.batch
    data = ctx.data(ctx.options.layer)
    inputs = data.on("cpu")
    dtype = DTYPES[m.q_dtype]
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    lens = batch.kv_lens.tolist()
    blocks_per = [-(-n // V2_BLOCK_SIZE) for n in lens]
    total = sum(blocks_per) + 1
    k_cache = torch.zeros(total, V2_BLOCK_SIZE, m.num_kv_heads, m.head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    nxt = 1  # block 0 stays vLLM's null block
    for b, n in enumerate(lens):
        slots = batch.request_slots(b)
        ids = torch.arange(nxt, nxt + blocks_per[b])
        table[b, : blocks_per[b]] = ids.to(torch.int32)
        k_cache.view(-1, m.num_kv_heads, m.head_dim)[nxt * V2_BLOCK_SIZE : nxt * V2_BLOCK_SIZE + n] = inputs.k_cache[slots]
        v_cache.view(-1, m.num_kv_heads, m.head_dim)[nxt * V2_BLOCK_SIZE : nxt * V2_BLOCK_SIZE + n] = inputs.v_cache[slots]
        nxt += blocks_per[b]
    # vLLM's v1/v2 layout: key [blocks, Hkv, D/x, block, x], value [blocks, Hkv, D, block].
    key = k_cache.view(total, V2_BLOCK_SIZE, m.num_kv_heads, m.head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous().cuda()
    value = v_cache.permute(0, 2, 3, 1).contiguous().cuda()
    max_len = max(lens)
    parts = -(-max_len // V2_PARTITION_TOKENS)
    bs, hq = len(lens), m.num_qo_heads
    out = torch.empty(bs, hq, m.head_dim, dtype=dtype, device="cuda")
    exp_sums = torch.full((bs, hq, parts), float("nan"), dtype=torch.float32, device="cuda")
    max_logits = torch.full_like(exp_sums, float("nan"))
    tmp_out = torch.empty(bs, hq, parts, m.head_dim, dtype=dtype, device="cuda")
    args = (out, exp_sums, max_logits, tmp_out, inputs.q.cuda(), key, value, m.num_kv_heads, m.sm_scale,
            table.cuda(), batch.kv_lens.to(torch.int32).cuda(), V2_BLOCK_SIZE, max_len, None, "auto")  # fmt: skip
    # k_scale/v_scale are tensors in newer vLLM, floats in older: try both before giving up.
    one = torch.ones((), dtype=torch.float32, device="cuda")
    error = None
    for scale in (one, 1.0):
        try:
            ops.paged_attention_v2(*args, scale, scale)
            error = None
            break
        except (RuntimeError, TypeError) as e:
            error = f"vLLM paged_attention_v2 raised: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
    if error:
        return error
    # Partitions past a request's end hold no state; the LSE merges the rest in float64.
    used = torch.arange(parts)[None, :] < torch.tensor([-(-n // V2_PARTITION_TOKENS) for n in lens])[:, None]
    logits, sums = max_logits.double().cpu(), exp_sums.double().cpu()
    part_lse = torch.where(used[:, None, :], logits + torch.log(sums), torch.full_like(logits, float("-inf")))
    lse = torch.logsumexp(part_lse, dim=-1)
    result = AttentionResult(output=out.cpu(), lse=lse.float())
    cmp = data.compare(result)
    status = RunStatus.PASSED if cmp.passed else RunStatus.FAILED
    return runner.BackendRun("vllm", status, f"vLLM {getattr(ops, '__name__', '')} paged_attention_v2", comparison=cmp, result=result)
