"""`vllm_paged`: vLLM's PagedAttention v2 decode kernel (`vllm._custom_ops.paged_attention_v2`).

Not an engine backend vLLM V1 selects (those are FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...): it is
the one kernel whose split scheme differs from SGLang's, fixed 512-token partitions merged through
`exp_sums` / `max_logits`, which the split-merge detector replays beside our split counts.

Its plan, in the kernel's words (csrc/attention/paged_attention_v2.cu's arguments):

    block_tables  [bs, max_blocks] int32: each request's 16-token blocks, block 0 left as vLLM's null block
    seq_lens      [bs] int32: the tokens each request reads
    scalars: block_size (16), max_seq_len

The blocks are those of a KV cache the adapter builds for the launch in vLLM's v1/v2 layout (key
[blocks, Hkv, D/x, block, x], value [blocks, Hkv, D, block]) from each request's slots of the step:
the trace's own cache is in SGLang's token layout, which this kernel does not read.

vLLM pins its own torch, so it is rarely importable beside attndbg's: `unavailable_reason` says
exactly which of GPU, package or op is missing, and nothing here imports vLLM until a run.
"""

from __future__ import annotations

import functools

import torch

from attndbg import machine
from attndbg.environment import package_version
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, KernelError, LibraryRelease, Padding
from attndbg.backends.capabilities import Capabilities, HeadDims
from attndbg.trace.schema import DTYPES, AttentionKind, ForwardMode, Plan, Trace

PARTITION_TOKENS = 512  # vLLM's _PARTITION_SIZE for paged_attention_v2
BLOCK_SIZE = 16  # a KV block size vLLM's v1/v2 kernels are instantiated for
INSTALL_HINT = "vllm is not installed: `pip install vllm`, in an environment of its own (vLLM pins its own torch version)"


@functools.cache
def _ops_problem() -> str | None:
    """Why `vllm._custom_ops.paged_attention_v2` cannot be called here (None: it can), found once:
    importing vLLM takes seconds and registers its ops."""
    try:
        from vllm import _custom_ops as ops
    except (ImportError, OSError, RuntimeError) as e:  # a torch vLLM was not built for: undefined symbols, ABI
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        return f"vllm is installed but vllm._custom_ops does not import ({first}): vLLM needs the torch it was built for"
    if not hasattr(ops, "paged_attention_v2"):
        return "this vllm's _custom_ops has no paged_attention_v2 (removed or renamed in this version)"
    return None


class VllmPagedBackend(Backend):
    name = "vllm_paged"

    def unavailable_reason(self) -> str | None:
        if not machine.cuda_available():
            return "no CUDA GPU: vLLM's paged_attention_v2 runs only on NVIDIA GPUs"
        if not machine.module_available("vllm"):
            return INSTALL_HINT
        return _ops_problem()

    def library(self) -> LibraryRelease:
        return LibraryRelease("vLLM paged_attention_v2", package_version("vllm") or "version unknown")

    def describe(self) -> str:
        from vllm import _custom_ops as ops

        return f"vLLM {getattr(ops, '__name__', '')} paged_attention_v2"

    def device(self) -> str:
        return "cuda"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            kernels="vLLM's PagedAttention v2 kernels",
            modes={AttentionKind.MHA: frozenset({ForwardMode.DECODE})},
            q_dtypes=frozenset({"float16", "bfloat16", "float32"}),
            kv_dtypes=frozenset({"float16", "bfloat16", "float32"}),
            kv_dtype_is_q_dtype=True,  # launched with kv_cache_dtype "auto": the cache is in q's dtype
            head_dims=HeadDims(one_in_decode=True, why="one head_size argument for q, k and v"),
            why={
                "modes": "a decode kernel: one query token per request",
                "merge_state": "PagedAttention v2 merges its own 512-token partitions inside the kernel; vLLM's merge of given states (merge_attn_states) is another op, not wired into this adapter",
            },
        )

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        assert padding is None, "no CUDA-graph support (capabilities.graph_modes is empty)"
        lens = trace.batch.kv_lens.tolist()
        blocks_per = [-(-n // BLOCK_SIZE) for n in lens]
        table = torch.zeros(len(lens), max(blocks_per, default=0), dtype=torch.int32)
        first = 1  # block 0 stays vLLM's null block
        for b, count in enumerate(blocks_per):
            table[b, :count] = torch.arange(first, first + count, dtype=torch.int32)
            first += count
        return Plan(
            backend=self.name,
            tensors={"block_tables": table, "seq_lens": trace.batch.kv_lens.to(torch.int32)},
            scalars={"block_size": BLOCK_SIZE, "max_seq_len": max(lens, default=0)},
        )

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        """The kernel on the step; its LSE rebuilt in float64 from the per-partition max_logits
        and exp_sums (the kernel returns none)."""
        from vllm import _custom_ops as ops

        m, batch = trace.model, trace.batch
        dtype, device = DTYPES[m.q_dtype], inputs.q.device
        table, seq_lens = plan.tensors["block_tables"], plan.tensors["seq_lens"]
        block_size, max_len = int(plan.scalars["block_size"]), int(plan.scalars["max_seq_len"])
        key, value = _paged_cache(trace, inputs, table, block_size)
        parts = -(-max_len // PARTITION_TOKENS)
        bs, hq = batch.batch_size, m.num_qo_heads
        out = torch.empty(bs, hq, m.head_dim, dtype=dtype, device=device)
        # NaN where the kernel writes nothing, so a partition it skips cannot pass for a state.
        exp_sums = torch.full((bs, hq, parts), float("nan"), dtype=torch.float32, device=device)
        max_logits = torch.full_like(exp_sums, float("nan"))
        tmp_out = torch.empty(bs, hq, parts, m.head_dim, dtype=dtype, device=device)
        args = (out, exp_sums, max_logits, tmp_out, inputs.q, key, value, m.num_kv_heads, m.sm_scale,
                table.to(device), seq_lens.to(device), block_size, max_len, None, "auto")  # fmt: skip
        # k_scale/v_scale are tensors in newer vLLM, floats in older: try both before giving up.
        error = None
        for scale in (torch.ones((), dtype=torch.float32, device=device), 1.0):
            try:
                ops.paged_attention_v2(*args, scale, scale)
                break
            except (RuntimeError, TypeError) as e:
                error = f"vLLM paged_attention_v2 raised: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
        else:
            raise KernelError(error)
        # Partitions past a request's end hold no state; the LSE merges the rest in float64.
        lens = seq_lens.to(torch.int64)
        used = torch.arange(parts)[None, :] < (-(-lens // PARTITION_TOKENS))[:, None]
        logits, sums = max_logits.double().cpu(), exp_sums.double().cpu()
        part_lse = torch.where(used[:, None, :], logits + torch.log(sums), torch.full_like(logits, float("-inf")))
        return AttentionResult(output=out, lse=torch.logsumexp(part_lse, dim=-1).float())


def _paged_cache(trace: Trace, inputs: AttentionInputs, table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's K/V rows (its slots of the step's cache) copied into the blocks `table` gives
    it, in vLLM's v1/v2 layout: key [blocks, Hkv, D/x, block, x], value [blocks, Hkv, D, block],
    x = 16 bytes of the dtype."""
    m, batch = trace.model, trace.batch
    k_src, v_src = inputs.k_cache, inputs.v_cache  # [slots, Hkv, D]
    total = int(table.max()) + 1 if table.numel() else 1
    k_cache = torch.zeros(total * block_size, m.num_kv_heads, m.head_dim, dtype=k_src.dtype, device=k_src.device)
    v_cache = torch.zeros_like(k_cache)
    for b in range(batch.batch_size):
        slots = batch.request_slots(b).to(k_src.device)
        n = slots.numel()
        rows = (table[b, : -(-n // block_size)].to(torch.int64)[:, None] * block_size + torch.arange(block_size)).flatten()[:n].to(k_src.device)
        k_cache[rows] = k_src[slots]
        v_cache[rows] = v_src[slots]
    x = 16 // k_cache.element_size()
    key = k_cache.view(total, block_size, m.num_kv_heads, m.head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value = v_cache.view(total, block_size, m.num_kv_heads, m.head_dim).permute(0, 2, 3, 1).contiguous()
    return key, value
