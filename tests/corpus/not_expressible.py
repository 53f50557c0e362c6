"""Real bugs the recorders (and importers) cannot express today, each with what the trace or the
recorder lacks: data for the trace model and the recorders, not steps."""

from __future__ import annotations

from tests.corpus.bug import Capability, RealBug


def _bug(id: str, title: str, links: tuple[str, ...], date: str, engine: str, mode: str, mechanism: str, why: str, *capabilities: Capability) -> RealBug:
    return RealBug(
        id=id, title=title, links=links, date=date, engine=engine, mode=mode, mechanism=mechanism, encoding="not encoded",
        expected=(), keywords=(), capabilities=capabilities, not_expressible=why,
    )  # fmt: skip


BUGS = (
    _bug(
        "sglang-5419", "merge_state_v2 launched off the capture stream: graph replays return stale merged outputs",
        ("https://github.com/sgl-project/sglang/pull/5419", "https://github.com/sgl-project/sglang/issues/5404"), "2025-04",
        "SGLang fa3", "TARGET_VERIFY graph (topk > 1)",
        "the two-call tree verify's merge ran on the default stream, outside the captured graph; every replay returned the merged "
        "output of the capture (GSM8K collapsed on DeepSeek-V3 with FA3)",
        "the SGLang recorder copies no layer tensors of a graph-replayed step (no Python runs at replay) and the step's metadata "
        "is right: the mistake is only in the output; it needs in-graph probes of the output",
        Capability.STALE_OUTPUT,
    ),
    _bug(
        "sglang-9344", "Triton extend/decode kernels overflow kv_indices * stride (int32)",
        ("https://github.com/sgl-project/sglang/pull/9344", "https://github.com/sgl-project/sglang/issues/9412"), "2025-08",
        "SGLang triton", "EXTEND, DECODE",
        "the kernels computed kv_indices * stride in int32: with a large KV pool the offset overflowed (illegal memory access "
        "under EAGLE3 on gpt-oss-20b)",
        "the overflow needs slot x row stride >= 2^31: a trace can name such slots, but a replay allocates the pool it indexes "
        "(billions of elements, refused by --max-memory), and no check models a kernel's index width",
        Capability.KERNEL_RUN,
    ),
    _bug(
        "sglang-22688", "trtllm_mla chunked-prefix prefill: zero-length chunks of short prefixes",
        ("https://github.com/sgl-project/sglang/pull/22688", "https://github.com/sgl-project/sglang/issues/22291"), "2026-04",
        "SGLang trtllm_mla", "EXTEND (MLA chunked prefix)",
        "the number of prefix chunks follows the longest prefix; shorter prefixes get kv_len 0 in later chunks, which the "
        "trtllm_mla path mishandled (MSE up to 3.0 with batch > 1)",
        "DeepSeek's chunked-prefix prefill (prefix latents up-projected chunk by chunk, merged) has no step form: a trace holds one "
        "attention over one KV row per request; and trtllm_mla's kernels (trtllm-gen, SM100 only) run here on no adapter (the mla "
        "adapter reads its decode, verify and draft-extend plans only)",
        Capability.SPLIT_MODEL, Capability.BACKEND_NAMES,
    ),
    _bug(
        "vllm-17283", "Cascade attention's prefix scheduler metadata planned for num_reqs requests instead of one",
        ("https://github.com/vllm-project/vllm/pull/17283", "https://github.com/vllm-project/vllm/issues/17276"), "2025-04",
        "vLLM FLASH_ATTN", "EXTEND (cascade)",
        "the shared-prefix pass runs as a single request, but its FA3 scheduler metadata was computed with batch_size=num_reqs "
        "(RuntimeError: scheduler_metadata must have shape (metadata_size))",
        "FA3's scheduler_metadata is FA3's own opaque layout (get_scheduler_metadata, on the GPU): it is recorded as an int tensor "
        "that nothing reads, and the prefix pass of a cascade has no plan form of its own",
        Capability.CROSS_FIELDS, Capability.EVERY_PLAN,
    ),
    _bug(
        "vllm-25196", "FlashInfer spec decode slices prefill rows by num_decode_tokens instead of num_decodes",
        ("https://github.com/vllm-project/vllm/pull/25196",), "2025-09", "vLLM FLASHINFER", "MIXED (spec decode)",
        "with q_len > 1 decodes (padded-batch speculative decoding) forward() sliced block_table_tensor and seq_lens for the "
        "prefill rows at num_decode_tokens, which is num_decodes x q_len, not num_decodes",
        "the slice is taken in forward(), after build(): the recorder sees the builder's fields (right) and the counts, not the "
        "tensors the prefill kernel got",
        Capability.CROSS_FIELDS,
    ),
    _bug(
        "vllm-21196", "FULL-graph padded tokens' slot_mapping not reset to -1: padded tokens write K/V through stale slots",
        ("https://github.com/vllm-project/vllm/pull/21196", "https://github.com/vllm-project/vllm/pull/20466"), "2025-07", "vLLM (any)",
        "DECODE graph",
        "after #20466 moved slot_mapping into the block table, _prepare_inputs no longer filled the persistent slot_mapping past "
        "the real tokens with -1; CUDA-graph padding happens after it, so the captured reshape_and_cache wrote the padded tokens' "
        "K/V through whatever slots an earlier step left there (a live request's KV, or out of bounds). The fix fills them with -1",
        "CommonAttentionMetadata.slot_mapping is the view blk_table.slot_mapping[:num_actual_tokens] (the stale tail is not in "
        "it) and the recorder keeps a per-token field's first num_actual_tokens entries (record/vllm/fields.py, Trim.PER_TOKEN): "
        "the padded tail the captured graph reads is in no trace",
        Capability.PADDED_ROWS,
    ),
    _bug(
        "vllm-40961", "Micro-batch metadata captured with max_seq_len 1: SWA layers captured with full-attention kernels",
        ("https://github.com/vllm-project/vllm/pull/40961",), "2026-04", "vLLM (any)", "capture",
        "during CUDA-graph capture the ubatch metadata carried max_seq_len 1, so the kernel chosen for sliding-window layers was "
        "the full-attention one, baked into the graph",
        "build_for_cudagraph_capture is not recorded (capture runs dummy batches, not steps): the hint that chose the captured "
        "kernel is never in a trace",
        Capability.HOST_HINTS, Capability.SPLITS_VS_CAPTURE,
    ),
    _bug(
        "flashinfer-362", "vLLM planned a prefill wrapper with paged_kv_indptr = [0] for bs + 1 query offsets",
        ("https://github.com/flashinfer-ai/flashinfer/issues/362", "https://github.com/vllm-project/vllm/pull/7008"), "2024-07",
        "vLLM (V0) FLASHINFER", "capture",
        "at CUDA-graph init vLLM planned the prefill wrappers with paged_kv_indptr = torch.tensor([0]) while qo_indptr had bs + 1 "
        "entries; FlashInfer's scheduler read uninitialised values and asked for a huge workspace (Out of workspace memory)",
        "the plan() raised and no run followed: the importer makes steps of runs (a plan alone is a note), and vLLM V0's metadata "
        "is not hooked (the recorder wraps v1 builders)",
        Capability.CROSS_FIELDS,
    ),
    _bug(
        "flashinfer-3716", "CuteDSL paged decode with is_causal=False counts padding KV lanes",
        ("https://github.com/flashinfer-ai/flashinfer/issues/3716",), "2026-06", "FlashInfer CuteDSL decode", "DECODE",
        "the non-causal path skipped the boundary mask, so lanes past seq_len entered the softmax denominator",
        "no adapter runs FlashInfer's CuteDSL decode wrapper, and no recorder records a non-causal decode",
        Capability.KERNEL_RUN, Capability.BACKEND_NAMES,
    ),
    _bug(
        "flashinfer-1968", "TRT-LLM-gen attention under full CUDA graphs wrong beyond 128k context on Blackwell",
        ("https://github.com/flashinfer-ai/flashinfer/issues/1968",), "2025-10", "FlashInfer trtllm-gen (vLLM)", "DECODE graph",
        "with max_seq_len > 128k and FULL graphs the trtllm-gen kernel produced wrong outputs (GSM8K 0.4 % vs 86 %)",
        "no adapter runs FlashInfer's trtllm-gen kernels: vLLM FLASHINFER steps replay through FlashInfer's FA2/FA3 wrappers",
        Capability.KERNEL_RUN, Capability.HOST_HINTS,
    ),
    _bug(
        "trtllm-11696", "Eagle3 one-model warmups accumulate drift on kv_lens_cuda (out-of-bounds KV access)",
        ("https://github.com/NVIDIA/TensorRT-LLM/pull/11696",), "2026-02", "TensorRT-LLM", "graph capture (spec decode)",
        "kv_lens_cuda was set once before the warmups; each warmup's in-place Eagle3 adjustment added accepted - 1, so after "
        "two warmups and the capture the device lengths ran past the KV cache",
        "TensorRT-LLM's attention capture lines carry the host lengths (seq_lens, num_cached_tokens), not the device kv_lens "
        "that drifted",
        Capability.CROSS_FIELDS,
    ),
    _bug(
        "trtllm-7127", "Attention workspace resized under CUDA graphs: replays read the relocated buffer",
        ("https://github.com/NVIDIA/TensorRT-LLM/pull/7127",), "2025-08", "TensorRT-LLM", "DECODE graph",
        "the attention op's workspace grew with the request count; a resize relocated it and captured graphs kept the old address",
        "TensorRT-LLM's capture lines carry no buffers and no data pointers: the importer makes structure-only steps",
        Capability.STALE_PLAN,
    ),
    _bug(
        "vllm-33360", "Whisper cross-attention captured with max_seq_len 0 under FA2 full CUDA graphs",
        ("https://github.com/vllm-project/vllm/pull/33360", "https://github.com/vllm-project/vllm/issues/33091"), "2026-01",
        "vLLM FLASH_ATTN (CrossAttentionBuilder)", "capture",
        "CrossAttentionBuilder.build() overrode max_seq_len with max(encoder_seq_lens); the capture's dummy batch has no encoder "
        "tokens, so the FULL graph was captured with max_seq_len 0 and replayed that launch for real batches (wrong outputs on FA2)",
        "build_for_cudagraph_capture is not recorded (capture runs dummy batches, not steps; see vllm-40961): the hint the graph "
        "was captured with is never in a trace, and a replayed step's own max_seq_len is right",
        Capability.HOST_HINTS, Capability.SPLITS_VS_CAPTURE,
    ),
    _bug(
        "trtllm-18769", "FlashInfer decode plans of multi-wrapper models never re-planned under CUDA graphs",
        ("https://github.com/NVIDIA/TensorRT-LLM/pull/18769",), "2026-09", "TensorRT-LLM (FlashInfer backend)", "DECODE graph",
        "the page tuple that triggers _refresh_fa2_cuda_graph_plans() was recorded only for a single tensor-core 'fa2' decode "
        "wrapper; a mixed sliding-window/full-attention model holds one decode wrapper per window and prepare() deferred their "
        "plans to forward_impl, which a graph replay never reaches: every replay ran the plan of the warm-up batch (a "
        "max_seq_len dummy in slot 0, one-token dummies elsewhere), so requests past slot 0 attended one token",
        "TensorRT-LLM's capture lines carry no buffers, no plans and no data pointers (the importer makes structure-only "
        "steps): the FlashInfer plan a replay ran is in no trace",
        Capability.STALE_PLAN, Capability.EVERY_PLAN,
    ),
)
