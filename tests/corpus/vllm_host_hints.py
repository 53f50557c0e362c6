"""Host-side values vLLM hands a kernel beside its tensors, which choose a kernel, a split count or a
launch size: right tensors, wrong hint.

- vllm-project/vllm#43991 (2026-05): Model Runner V2's hybrid and draft paths built the attention
  metadata with max_seq_len = max_model_len instead of the batch's longest sequence; FlashInfer's
  TRT-LLM attention, sized by it, walked past the valid block-table entries.
- vllm-project/vllm#40654 (2026-05, named by #43991): the same mistake in Model Runner V2's
  DefaultModelState, the path every plain (non-hybrid) model takes, fixed first.
- vllm-project/vllm#20301 (2025-07): FlashAttention-3's ahead-of-time scheduler under FULL CUDA
  graphs: with no explicit num_splits, the split factor chosen at run time could exceed the one the
  captured graph's buffers were sized for (illegal memory access); fixed by passing max_num_splits
  at both capture and run time.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from tests.corpus import vllm_engine as vl
from tests.corpus.bug import Capability, RealBug
from tests.record.engines import import_engine

flash_attn = import_engine("vllm.v1.attention.backends.flash_attn")

MAX_MODEL_LEN = 4096
DECODE = dict(seq_lens=[20, 33, 7], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]])
# A plain model's decode batch (DefaultModelState), blocks of 32 and a longer context window.
PLAIN_MAX_MODEL_LEN = 8192
PLAIN_DECODE = dict(seq_lens=[70, 12, 95, 33, 128], query_lens=[1] * 5, blocks=[[3, 8, 11], [4], [5, 9, 12], [6, 10], [13, 14, 15, 16]], block_size=32)


def _trtllm_decode(out: Path, layout: dict, *, max_seq_len: int) -> None:
    """FlashInferMetadataBuilder.build (vLLM 0.33) of a decode batch on the trtllm-gen decode
    kernel: its decode part (FlashInferTrtllmAPIDecode) holds the decode rows of the block table
    and seq_lens and the CommonAttentionMetadata's max_seq_len, which the kernel gets as is. The
    runner's block table is as wide as the batch's longest row needs, plus one column (the
    recorder keeps at most ceil(max_seq_len / block_size) of them)."""
    step = vl.Step(**layout, max_seq_len=max_seq_len)
    cm = step.common()
    rows = len(step.seq_lens)
    decode = vl.FlashInferTrtllmAPIDecode(
        kernel=vl.FlashInferDecodeKernel.TRTLLM_GEN, block_tables=cm.block_table_tensor[:rows], seq_lens=cm.seq_lens[:rows], max_seq_len=max_seq_len
    )
    # FlashInferMetadata's fields as the builder fills them (its module imports FlashInfer).
    metadata = SimpleNamespace(
        num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping, num_decodes=rows, num_decode_tokens=rows, num_prefills=0,
        num_prefill_tokens=0, causal=True, prefill=None, decode=decode,
    )  # fmt: skip
    model = vl.mha_model(block_size=step.block_size)
    vl.record(out, cm, metadata, backend="FLASHINFER", model=model, builder="FlashInferMetadataBuilder")


def write_43991(bug: Path, twin: Path) -> None:
    _trtllm_decode(bug, DECODE, max_seq_len=MAX_MODEL_LEN)  # MambaHybridModelState.prepare_attn before the fix
    _trtllm_decode(twin, DECODE, max_seq_len=33)  # the batch's longest sequence


def write_40654(bug: Path, twin: Path) -> None:
    _trtllm_decode(bug, PLAIN_DECODE, max_seq_len=PLAIN_MAX_MODEL_LEN)  # DefaultModelState before the fix
    _trtllm_decode(twin, PLAIN_DECODE, max_seq_len=128)


def _fa3_graph_decode(out: Path, *, max_num_splits: int) -> None:
    """FlashAttentionMetadataBuilder.build of a FULL-graph decode (padded to the bs-4 graph) with
    FA3's ahead-of-time scheduling: its scheduler_metadata buffer and the split bound FA3 is
    launched with. The buffer has FA3's size for the batch (1 + round_up(bs, 4) * 4 int32, vLLM's
    persistent buffer); its contents (FA3's own layout, computed on the GPU by
    get_scheduler_metadata) are not reproduced: zeros, as vLLM allocates it. Nothing reads them."""
    cm = vl.Step(**DECODE, pad_reqs=1).common()
    rows = int(cm.num_reqs)
    scheduler_metadata = torch.zeros(1 + -(-rows // 4) * 4 * 4, dtype=torch.int32)
    metadata = flash_attn.FlashAttentionMetadata(
        num_actual_tokens=cm.num_actual_tokens, max_query_len=1, query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens,
        block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping, scheduler_metadata=scheduler_metadata, max_num_splits=max_num_splits, causal=True,
    )  # fmt: skip
    capture = vl.CaptureSizes(max_bs=64, max_num_tokens=8, block_table_width=int(cm.block_table_tensor.shape[1]))
    vl.record(out, cm, metadata, backend="FLASH_ATTN", model=vl.mha_model(), capture=capture, builder="FlashAttentionMetadataBuilder")


def write_20301(bug: Path, twin: Path) -> None:
    _fa3_graph_decode(bug, max_num_splits=0)  # 0: FA3's heuristic picks the split count at each launch
    _fa3_graph_decode(twin, max_num_splits=16)  # VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH's default


BUGS = (
    RealBug(
        id="vllm-43991",
        title="Attention metadata built with max_seq_len = max_model_len: TRT-LLM attention walks past the block table",
        links=("https://github.com/vllm-project/vllm/pull/43991",),
        date="2026-05",
        engine="vLLM FLASHINFER",
        mode="DECODE",
        mechanism="MambaHybridModelState.prepare_attn and the EAGLE/MTP draft metadata passed max_seq_len=max_model_len; "
        "FlashInfer's TRT-LLM attention sizes its walk over the block table by it and read past the valid entries; the fix "
        "uses the batch's own max (max_model_len only at capture)",
        encoding="3 decodes (seq_lens 20, 33, 7; block 16; a block table of 4 columns); CommonAttentionMetadata and FlashInfer "
        "metadata (vLLM 0.33) whose decode part is the trtllm-gen decode's (FlashInferTrtllmAPIDecode), max_seq_len 4096 in both; "
        "twin: 33",
        expected=("invariants/max-seq-len", "invariants/seq-lens-max", "invariants/host-hint"),
        keywords=("max_seq_len", "max_model_len", "hint"),
        capabilities=(Capability.HOST_HINTS,),
        write=write_43991,
    ),
    RealBug(
        id="vllm-40654",
        title="Model Runner V2's DefaultModelState built attention metadata with max_seq_len = max_model_len",
        links=("https://github.com/vllm-project/vllm/pull/40654", "https://github.com/vllm-project/vllm/pull/43991"),
        date="2026-05",
        engine="vLLM FLASHINFER",
        mode="DECODE",
        mechanism="Model Runner V2's DefaultModelState (every non-hybrid model) passed max_seq_len=max_model_len to the "
        "attention metadata at every step, not only at CUDA-graph capture; FlashInfer's TRT-LLM decode sizes its walk over the "
        "block table by it (#43991 names the walk past the valid entries). The fix uses the batch's longest sequence "
        "(seq_lens_cpu_upper_bound's max) and max_model_len only for capture",
        encoding="5 decodes (seq_lens 70, 12, 95, 33, 128; block 32; a block table of 5 columns); CommonAttentionMetadata and "
        "FlashInfer metadata (vLLM 0.33) whose decode part is the trtllm-gen decode's, max_seq_len 8192; twin: 128",
        expected=("invariants/host-hint",),
        keywords=("max_seq_len", "block table", "hint"),
        capabilities=(Capability.HOST_HINTS,),
        twin_note="the runner's block table is as wide as the batch needs plus one column; with a max_model_len-wide table the "
        "walk stays inside it",
        write=write_40654,
    ),
    RealBug(
        id="vllm-20301",
        title="FA3 AoT scheduling under FULL CUDA graphs without a split bound (IMA)",
        links=("https://github.com/vllm-project/vllm/pull/20301",),
        date="2025-07",
        engine="vLLM FLASH_ATTN",
        mode="DECODE graph",
        mechanism="with full CUDA graphs and FA3's ahead-of-time scheduler, no explicit num_splits was passed: the run-time "
        "split factor could exceed what the captured graph's buffers held (illegal memory access); the fix passes "
        "max_num_splits at capture and at run time",
        encoding="3 decodes padded to a bs-4 FULL graph; FlashAttentionMetadata with FA3's AoT scheduler_metadata buffer "
        "(its size; contents, computed on the GPU by FA3, not reproduced) and max_num_splits 0 (no bound); twin: 16",
        expected=("invariants/split-bound",),
        keywords=("max_num_splits", "num_splits", "capture"),
        capabilities=(Capability.SPLITS_VS_CAPTURE, Capability.HOST_HINTS),
        write=write_20301,
    ),
)
