"""vLLM FULL-CUDA-graph padding bugs: what padded rows of the captured batch held when the builder's
metadata reached a kernel that cannot take vLLM's padding convention (seq_len 0, NULL_BLOCK_ID).

- vllm-project/vllm#35969 (2026-03, issue #33664): FlashMLA's FP8 decode kernel on padded rows
  with seq_lens 0 (n_block = -1, block_table[-1]) and block_table -1 (a negative KV offset):
  illegal memory access under graph replay; the fix clamps both in the FlashMLA builder.
- vllm-project/vllm#28739 (2025-11): ChunkedLocalAttention's builder inherited FlashInfer's
  get_cudagraph_support, so Llama-4's local attention layers were captured in CUDA graphs although
  the builder makes its metadata tensors afresh every step: replays read the capture-time tensors
  (wrong outputs). Fixed by keeping it out of graphs (cudagraph support NEVER).
- vllm-project/vllm#35175 (2026-02, issue #33638): after FlashMLA's scheduler metadata moved into
  FlashMLASchedMeta, the FP8 decode path set freshly made tile_scheduler_metadata / num_splits on it
  instead of copying them into the persistent CUDA-graph buffers: replays read the capture's.
- vllm-project/vllm#19321 (2025-06): the FULL-graph runner padded query_start_loc past the real
  requests with -1; FlashAttention reads it as cu_seqlens_q, which must not decrease: wrong results
  under the compiled graph. The fix repeats the last real offset.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from tests.corpus import vllm_engine as vl
from tests.corpus.bug import Capability, RealBug
from tests.record.engines import import_engine

flashmla = import_engine("vllm.v1.attention.backends.mla.flashmla")
flash_attn = import_engine("vllm.v1.attention.backends.flash_attn")

MLA_STEP = dict(seq_lens=[70, 33, 100], query_lens=[1, 1, 1], blocks=[[3, 7], [5], [9, 2]], block_size=64, pad_reqs=1)


def _flashmla_decode(out: Path, *, clamped: bool) -> None:
    """The runner pads the bs-3 decode to the bs-4 graph with seq_len 0 and block_table -1 (the
    padding #35969 describes); FlashMLAMetadataBuilder.build_decode passes both to the kernel,
    clamped to >= 1 and >= 0 by the fix."""
    cm = vl.Step(**MLA_STEP, padded_block=-1).common()
    seq_lens, table = cm.seq_lens.clone(), cm.block_table_tensor.clone()
    if clamped:
        seq_lens.clamp_(min=1)
        table.clamp_(min=0)
    # split_decodes_and_prefills (a uniform decode): num_decodes = num_reqs, num_decode_tokens = num_actual_tokens.
    decode = flashmla.FlashMLADecodeMetadata(block_table=table, seq_lens=seq_lens, dcp_tot_seq_lens=None, scheduler_metadata=None)
    metadata = flashmla.FlashMLAMetadata(
        num_reqs=cm.num_reqs, max_query_len=1, max_seq_len=cm.max_seq_len, num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
        slot_mapping=cm.slot_mapping, num_decodes=cm.num_reqs, num_decode_tokens=cm.num_actual_tokens, num_prefills=0, causal=True, head_dim=None, prefill=None, decode=decode,
    )  # fmt: skip
    capture = vl.CaptureSizes(max_bs=64, max_num_tokens=8, block_table_width=int(cm.block_table_tensor.shape[1]))
    model = vl.mla_model(block_size=64, kv_dtype="float8_e4m3fn")  # --kv-cache-dtype fp8: the FP8 decode path
    vl.record(out, cm, metadata, backend="FLASHMLA", model=model, capture=capture, builder="FlashMLAMetadataBuilder")


def write_35969(bug: Path, twin: Path) -> None:
    _flashmla_decode(bug, clamped=False)
    _flashmla_decode(twin, clamped=True)




LOCAL_STEPS = [dict(seq_lens=[20, 33, 7], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]], pad_reqs=1),
               dict(seq_lens=[21, 34, 8], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]], pad_reqs=1)]  # fmt: skip


def _local_attention(out: Path, *, persistent: bool) -> None:
    """Two FULL-graph replays (bs-4 graph) of ChunkedLocalAttention's builder, whose virtual batches
    equal the real ones here (attention_chunk_size 8192 > every sequence). It builds its metadata
    tensors afresh each step; under FULL graphs the captured kernels read the capture-time tensors,
    so their addresses must not move: the fix (never capture it in a graph) keeps the backend
    eager, which is what persistent buffers model here."""
    buffers: dict[str, torch.Tensor] = {}
    for step, layout in enumerate(LOCAL_STEPS):
        cm = vl.Step(**layout).common()
        names = ("seq_lens", "block_table_tensor", "query_start_loc", "slot_mapping")
        fresh = {name: getattr(cm, name).clone() for name in names}
        if persistent:
            for name, value in fresh.items():
                buffers.setdefault(name, torch.zeros_like(value)).copy_(value)
            fresh = dict(buffers)
        metadata = SimpleNamespace(
            num_actual_tokens=cm.num_actual_tokens, max_q_len=1, max_seq_len=cm.max_seq_len,
            num_decodes=cm.num_reqs, num_decode_tokens=cm.num_actual_tokens, num_prefills=0, num_prefill_tokens=0, use_cascade=False, **fresh,
        )  # fmt: skip
        vl.record(out, cm, metadata, backend="FLASHINFER", model=vl.mha_model(), step=step, builder="ChunkedLocalAttentionBuilder", pointers=True)


def write_28739(bug: Path, twin: Path) -> None:
    _local_attention(bug, persistent=False)
    _local_attention(twin, persistent=True)


FP8_STEPS = [dict(MLA_STEP, seq_lens=[70, 33, 100]), dict(MLA_STEP, seq_lens=[71, 34, 101])]
SM_PARTS, TILE_METADATA_SIZE = 4, 8  # FlashMLA's tile_scheduler_metadata: [num_sm_parts, TileSchedulerMetaDataSize] int32


def _flashmla_fp8_replays(out: Path, *, persistent: bool) -> None:
    """Two FULL-graph replays (bs-4 graph) of FlashMLA's FP8 decode: the builder's
    FlashMLASchedMeta holds the split schedule get_mla_metadata_dense_fp8 made for the step (its
    contents are FlashMLA's, made on the GPU: zeros and one split per request here, read by
    nothing). The fix copies them into the builder's persistent cg_buf_* tensors; before it, each
    step's fresh tensors were set on the holder, so their addresses move between replays."""
    buffers: dict[str, torch.Tensor] = {}
    kept: list[torch.Tensor] = []  # the fresh tensors stay alive: a moved address is not a reused one
    for step, layout in enumerate(FP8_STEPS):
        cm = vl.Step(**layout).common()
        # The runner's persistent inputs, refilled in place at every replay (in the bug too).
        steady = {
            "seq_lens": cm.seq_lens.clamp(min=1),  # the builder's clamp (vLLM #35969)
            "block_table": cm.block_table_tensor.clamp(min=0),
            "query_start_loc": cm.query_start_loc,
            "slot_mapping": cm.slot_mapping,
        }
        for name, value in steady.items():
            buffers.setdefault(name, torch.zeros_like(value)).copy_(value)
        rows = steady["seq_lens"].numel()
        fresh = {
            "tile_scheduler_metadata": torch.zeros(SM_PARTS, TILE_METADATA_SIZE, dtype=torch.int32),
            "num_splits": torch.arange(rows + 1, dtype=torch.int32),
        }
        kept += fresh.values()
        if persistent:
            for name, value in fresh.items():
                buffers.setdefault(name, torch.zeros_like(value)).copy_(value)
            fresh = {name: buffers[name] for name in fresh}
        schedule = flashmla.FlashMLASchedMeta()  # FlashMLA's holder (vLLM's stand-in of that name where FlashMLA is absent)
        schedule.tile_scheduler_metadata, schedule.num_splits = fresh["tile_scheduler_metadata"], fresh["num_splits"]
        decode = flashmla.FlashMLADecodeMetadata(
            block_table=buffers["block_table"], seq_lens=buffers["seq_lens"], dcp_tot_seq_lens=None, scheduler_metadata=schedule
        )
        metadata = flashmla.FlashMLAMetadata(
            num_reqs=cm.num_reqs, max_query_len=1, max_seq_len=cm.max_seq_len, num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=buffers["query_start_loc"], slot_mapping=buffers["slot_mapping"], num_decodes=cm.num_reqs,
            num_decode_tokens=cm.num_actual_tokens, num_prefills=0, causal=True, head_dim=None, prefill=None, decode=decode,
        )  # fmt: skip
        capture = vl.CaptureSizes(max_bs=64, max_num_tokens=8, block_table_width=int(cm.block_table_tensor.shape[1]))
        model = vl.mla_model(block_size=64, kv_dtype="float8_e4m3fn")
        vl.record(out, cm, metadata, backend="FLASHMLA", model=model, step=step, capture=capture, builder="FlashMLAMetadataBuilder", pointers=True)


def write_35175(bug: Path, twin: Path) -> None:
    _flashmla_fp8_replays(bug, persistent=False)
    _flashmla_fp8_replays(twin, persistent=True)


FA_DECODE = dict(seq_lens=[20, 33, 7], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]], pad_reqs=1)
PADDED_QSL_END = -1  # what the runner of #19321 put past the real requests' offsets


def _flash_attn_graph_decode(out: Path, **overrides: torch.Tensor) -> None:
    """FlashAttentionMetadataBuilder.build of 3 decodes padded to the bs-4 FULL graph: the
    runner's persistent buffers (`overrides` where the runner filled them otherwise than the fixed
    code) handed to FlashAttention as they are."""
    cm = vl.Step(**FA_DECODE, overrides=overrides).common()
    metadata = flash_attn.FlashAttentionMetadata(
        num_actual_tokens=cm.num_actual_tokens, max_query_len=1, query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens,
        block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping, scheduler_metadata=None, max_num_splits=0, causal=True,
    )  # fmt: skip
    capture = vl.CaptureSizes(max_bs=64, max_num_tokens=8, block_table_width=int(cm.block_table_tensor.shape[1]))
    vl.record(out, cm, metadata, backend="FLASH_ATTN", model=vl.mha_model(), capture=capture, builder="FlashAttentionMetadataBuilder")


def write_19321(bug: Path, twin: Path) -> None:
    real = [0, 1, 2, 3]
    padded = torch.tensor(real + [PADDED_QSL_END], dtype=torch.int32)
    _flash_attn_graph_decode(bug, query_start_loc=padded, query_start_loc_cpu=padded.clone())
    _flash_attn_graph_decode(twin)  # vl.Step repeats the last real offset, as the fix does


BUGS = (
    RealBug(
        id="vllm-35969",
        title="FlashMLA FP8 decode on padded rows with seq_len 0 and block_table -1 (IMA under graph replay)",
        links=("https://github.com/vllm-project/vllm/pull/35969", "https://github.com/vllm-project/vllm/issues/33664"),
        date="2026-03",
        engine="vLLM FLASHMLA",
        mode="DECODE graph",
        mechanism="the model runner padded unused graph rows with seq_lens=0 and block_table=-1; FlashMLA's FP8 kernel "
        "computes n_block = -1 from seq_len 0 (block_table[-1]) and a negative KV offset from -1: illegal memory access. "
        "Fixed by clamping seq_lens >= 1 and block_table >= 0 in FlashMLAMetadataBuilder.build_decode",
        encoding="3 MLA decodes (block 64, FP8 KV cache) in a bs-4 FULL graph: padded row seq_len 0, block-table row -1, in "
        "the CommonAttentionMetadata and the FlashMLA decode metadata; twin: the builder's clamped copies",
        expected=("fill-value/padded-seq-len-unsupported", "invariants/index-outside-cache"),
        keywords=("FlashMLA", "seq_len 0", "-1"),
        capabilities=(Capability.BACKEND_NAMES, Capability.PADDED_ROWS),
        twin_note="the runner still pads with 0 and -1; the builder hands the kernel clamped copies (the fix)",
        write=write_35969,
    ),
    RealBug(
        id="vllm-28739",
        title="Chunked local attention captured in FULL CUDA graphs with per-step metadata tensors",
        links=("https://github.com/vllm-project/vllm/pull/28739", "https://github.com/vllm-project/vllm/issues/28604"),
        date="2025-11",
        engine="vLLM FLASHINFER (ChunkedLocalAttention builder)",
        mode="DECODE graph, two replays",
        mechanism="ChunkedLocalAttentionBuilder inherited FlashInfer's get_cudagraph_support, so its _cudagraph_support = "
        "NEVER was ignored and Llama-4's local layers ran inside FULL graphs, though the builder allocates its virtual-batch "
        "metadata each step: graph replays read the tensors captured at capture time (incorrect outputs)",
        encoding="two decode steps replayed in the bs-4 graph; the builder's seq_lens, block table and query_start_loc are new "
        "tensors each step (their data pointers recorded, as the hook records them); twin: persistent buffers refilled in place",
        expected=("invariants/plan-pointer-moved",),
        keywords=("pointer", "capture-time", "replay"),
        capabilities=(Capability.ALREADY, Capability.STALE_PLAN),
        twin_note="the fix keeps the backend out of graphs; the twin is the graph-safe form: the same steps over persistent buffers",
        write=write_28739,
    ),
    RealBug(
        id="vllm-35175",
        title="FP8 FlashMLA decode metadata not copied into the persistent CUDA-graph buffers",
        links=("https://github.com/vllm-project/vllm/pull/35175", "https://github.com/vllm-project/vllm/issues/33638"),
        date="2026-02",
        engine="vLLM FLASHMLA (fp8 KV)",
        mode="DECODE graph, two replays",
        mechanism="after the FlashMLASchedMeta refactor the FP8 path set freshly allocated tile_scheduler_metadata / num_splits on "
        "it instead of copying into cg_buf_*: graph replays read the capture-time metadata (garbled output after ~50 tokens)",
        encoding="two FP8 MLA decode steps replayed in the bs-4 FULL graph; the decode part's FlashMLASchedMeta holds "
        "tile_scheduler_metadata and num_splits made afresh each step (their data pointers recorded, as the hook records them); "
        "twin: the persistent buffers refilled in place",
        expected=("invariants/plan-pointer-moved",),
        keywords=("pointer", "captured", "replay"),
        capabilities=(Capability.STALE_PLAN, Capability.SPLITS_VS_CAPTURE),
        write=write_35175,
    ),
    RealBug(
        id="vllm-19321",
        title="FULL-graph query_start_loc padded with -1: FlashAttention's cu_seqlens_q decreases",
        links=("https://github.com/vllm-project/vllm/pull/19321",),
        date="2025-06",
        engine="vLLM FLASH_ATTN",
        mode="DECODE graph",
        mechanism="the FULL-graph runner captured with a max-shaped persistent query_start_loc and padded its tail past the "
        "real requests with -1; FlashAttention reads it as cu_seqlens_q, which it requires non-decreasing: incorrect results "
        "under the compiled graph (eager was fine). The fix pads with the last real offset",
        encoding="3 decodes (seq_lens 20, 33, 7; block 16) padded to a bs-4 FULL graph; CommonAttentionMetadata and "
        "FlashAttentionMetadata with query_start_loc [0, 1, 2, 3, -1]; twin: [0, 1, 2, 3, 3]",
        expected=("invariants/indptr-decreases",),
        keywords=("query_start_loc", "padded tail", "negative query length"),
        capabilities=(Capability.PADDED_ROWS, Capability.CROSS_FIELDS),
        write=write_19321,
    ),
)
