"""vLLM steps recorded through attndbg's vLLM recorder, for the real-bug corpus.

The recorder's hook wraps a builder's `build()` and hands the writer host copies of vLLM's
`CommonAttentionMetadata` (`common_parts`) and of the built metadata (`plan_parts`), which
`trace_from_host` turns into the trace: the same two functions and the same writer path here, fed
with the metadata the buggy (or fixed) vLLM code built. `CommonAttentionMetadata` is vLLM's own
class; the builders' outputs are vLLM's metadata classes where they import on a CPU (FlashMLA's,
Triton's, FlashAttention's), else a namespace with the builder's field names (FlashInfer's module
imports FlashInfer). `_Static` holds what the hook reads from the builder and its config.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.record.vllm.adapter import _Static, trace_from_host
from attndbg.record.vllm.fields import COMMON_PREFIX, common_parts
from attndbg.record.vllm.plan import plan_parts
from attndbg.trace import io
from attndbg.trace.schema import AttentionKind, CaptureSizes, Model
from tests.record.engines import import_engine

CommonAttentionMetadata = import_engine("vllm.v1.attention.backend").CommonAttentionMetadata
NUM_BLOCKS = 24  # the KV pool (cache_config.num_gpu_blocks); block 0 is vLLM's null block
I32, I64 = torch.int32, torch.int64


class FlashInferDecodeKernel(enum.Enum):
    """vLLM's FlashInferDecodeKernel (0.33, v1/attention/backends/flashinfer.py), whose module
    imports FlashInfer: the decode kernels its FLASHINFER backend picks besides FlashInfer's own."""

    XQA = "xqa"
    TRTLLM_GEN = "trtllm-gen"


@dataclass
class FlashInferTrtllmAPIDecode:
    """vLLM's decode part of FlashInferMetadata for the XQA / trtllm-gen decode kernels (0.33):
    the fields the builder fills, under the class's own name (its module imports FlashInfer)."""

    kernel: FlashInferDecodeKernel
    block_tables: Tensor  # block_table_tensor[:num_decodes]
    seq_lens: Tensor  # seq_lens[:num_decodes]
    max_seq_len: int  # the CommonAttentionMetadata's, handed to the kernel as is
    q_len_per_req: int = 1


@dataclass
class TRTLLMPrefill:
    """vLLM's prefill part of FlashInferMetadata for the trtllm-gen prefill kernel (0.33), under
    the class's own name (its module imports FlashInfer)."""

    block_tables: Tensor  # block_table_tensor[num_decodes:]
    seq_lens: Tensor  # seq_lens[num_decodes:]
    cum_seq_lens_q: Tensor
    cum_seq_lens_kv: Tensor
    max_q_len: int  # the longest query among the prefills
    max_seq_len: int


def mha_model(*, block_size: int = 16, window: int = -1) -> Model:
    """4 query heads over 2 KV heads of width 32: small enough for the Triton interpreter."""
    return Model(
        num_qo_heads=4, num_kv_heads=2, head_dim=32, v_head_dim=32, attention=AttentionKind.MHA, kv_lora_rank=0, qk_rope_head_dim=0,
        sm_scale=32**-0.5, logit_cap=0.0, sliding_window=window, q_dtype="bfloat16", kv_dtype="bfloat16", page_size=block_size,
    )  # fmt: skip


def mla_model(*, block_size: int = 64, kv_dtype: str = "bfloat16") -> Model:
    """DeepSeek's absorbed MLA at a small width (latent 64, rope 16) for the Triton interpreter;
    `kv_dtype`: the KV cache's (vLLM's --kv-cache-dtype)."""
    return Model(
        num_qo_heads=4, num_kv_heads=1, head_dim=80, v_head_dim=64, attention=AttentionKind.MLA, kv_lora_rank=64, qk_rope_head_dim=16,
        sm_scale=(128 + 16) ** -0.5, logit_cap=0.0, sliding_window=-1, q_dtype="bfloat16", kv_dtype=kv_dtype, page_size=block_size,
    )  # fmt: skip


@dataclass(frozen=True)
class Step:
    """A batch as vLLM's runner lays it out: decodes first, blocks handed out from block 1 on,
    padded rows (FULL-graph capture size) with seq_len 0, query_len 0 and NULL_BLOCK_ID rows."""

    seq_lens: Sequence[int]
    query_lens: Sequence[int]
    blocks: Sequence[Sequence[int]]  # block ids of each real request, in column order
    block_size: int = 16
    pad_reqs: int = 0
    width: int | None = None  # block-table columns (the persistent table's); default: the longest row + 1
    padded_block: int = 0  # what padded rows' block-table entries hold
    padded_seq_len: int = 0
    max_seq_len: int | None = None  # the host hint the runner sets; default: the batch's longest seq_len
    overrides: dict[str, Any] = field(default_factory=dict)

    def slot(self, b: int, col: int) -> int:
        return self.blocks[b][col // self.block_size] * self.block_size + col % self.block_size

    def common(self) -> Any:
        """vLLM's CommonAttentionMetadata of the step."""
        rows = len(self.seq_lens) + self.pad_reqs
        width = self.width or max(len(b) for b in self.blocks) + 1
        table = torch.full((rows, width), self.padded_block, dtype=I32)
        table[: len(self.seq_lens)] = 0
        for b, ids in enumerate(self.blocks):
            table[b, : len(ids)] = torch.tensor(ids, dtype=I32)
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        cu += [cu[-1]] * self.pad_reqs
        qsl = torch.tensor(cu, dtype=I32)
        seq = torch.tensor(list(self.seq_lens) + [self.padded_seq_len] * self.pad_reqs, dtype=I32)
        slots = [self.slot(b, c) for b, (s, q) in enumerate(zip(self.seq_lens, self.query_lens)) for c in range(s - q, s)]
        positions = [c for s, q in zip(self.seq_lens, self.query_lens) for c in range(s - q, s)]
        fields = dict(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=rows, num_actual_tokens=cu[-1],
            max_query_len=max(self.query_lens), max_seq_len=self.max_seq_len or max(self.seq_lens), block_table_tensor=table,
            slot_mapping=torch.tensor(slots, dtype=I64), causal=True, positions=torch.tensor(positions, dtype=I64),
            is_prefilling=torch.tensor([s == q for s, q in zip(self.seq_lens, self.query_lens)] + [False] * self.pad_reqs),
            seq_lens_cpu_upper_bound=seq.clone(),
        )  # fmt: skip
        fields.update(self.overrides)
        return CommonAttentionMetadata(**fields)


def record(
    out: Path,
    cm: Any,
    metadata: Any,
    *,
    backend: str,
    model: Model,
    step: int = 0,
    capture: CaptureSizes | None = None,
    builder: str = "",
    pointers: bool = False,
) -> None:
    """Write the step the vLLM recorder writes for `builder.build(common_prefix_len=0, cm)`
    returning `metadata` (adapter._record's scalars and host copies, then trace_from_host).
    `pointers`: keep the built tensors' data pointers (the hook records them: they are the
    persistent buffers a graph replays); off for metadata made here per step, whose pointers mean
    nothing."""
    block = model.page_size
    plan_tensors, plan_scalars = plan_parts(metadata, block_size=block, max_seq_len=int(cm.max_seq_len), pointers=pointers)
    common_tensors, common_scalars = common_parts(cm, block)
    static = _Static(
        model=model,
        backend=backend,
        device=torch.device("cpu"),
        tp_rank=0,
        kv_cache_size=NUM_BLOCKS * block,
        speculation=None,
        capture=capture,
        scalars={
            **plan_scalars,
            **{COMMON_PREFIX + k: v for k, v in common_scalars.items()},
            "vllm.call": "build",
            "vllm.builder": builder or f"{backend} builder",
            "vllm.metadata": type(metadata).__name__,
            "vllm.num_reqs": int(cm.num_reqs),
            "vllm.num_actual_tokens": int(cm.num_actual_tokens),
            "vllm.max_query_len": int(cm.max_query_len),
            "vllm.max_seq_len": int(cm.max_seq_len),
            "vllm.num_gpu_blocks": NUM_BLOCKS,
            "vllm.fast_build": False,
        },
    )
    host: dict[str, Tensor | None] = {f"cm.{k}": v.clone() for k, v in common_tensors.items()}
    host.update({f"plan.{k}": v.clone() for k, v in plan_tensors.items()})
    trace = trace_from_host(host, static=static, step=step)
    io.append_to_recording(out, trace, f"step_{step:06d}.pt")
