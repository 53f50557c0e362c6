"""Every SGLang field attndbg's detectors read: where each runner gives it, whether the adapter
records it, where it lands in the trace, and which detector reads it (a detector that reads a
field must be fed by every adapter that can record it).

Three ways a step reaches the adapter (engines.md A5, A6):
- eager (both APIs): `init_forward_metadata(fb)` with a real ForwardBatch;
- SGL-classic graph replay: `CudaGraphRunner.replay_prepare(fb)`; the padded static buffers are the
  runner's (`runner.seq_lens[:bs]`, ...), the backend refilled its graph buffers in
  `init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum, ...)`;
- SGL-new graph replay: `init_forward_metadata_out_graph(view)`, `view` built by
  `build_replay_fb_view` from the padded buffers (`num_padding`, padded `seq_lens_sum`).

`SGLANG_FIELDS` is that table as data; `tests/record/test_sglang_evidence.py` records steps through
the adapter and checks that every field marked recorded for a mode is in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineField:
    engine: str  # SGLang's own name (ForwardBatch / EagleVerifyInput / ForwardMetadata / runner buffer)
    eager: str  # where an eager step has it ("" = not there)
    classic_graph: str  # SGL-classic CudaGraphRunner replay
    new_graph: str  # SGL-new DecodeCudaGraphRunner replay (the view)
    trace: str  # where the trace keeps it ("" = not recorded)
    read_by: str  # detectors that read it
    why_not: str = ""  # for a field not recorded: why
    plan: tuple[str, ...] = ()  # the Triton plan tensors (or "scalars.<name>") it is recorded as


SGLANG_FIELDS: tuple[EngineField, ...] = (
    EngineField("forward_mode", "fb.forward_mode", "fb.forward_mode", "view.actual_forward_mode", "batch.forward_mode", "every detector"),
    EngineField("seq_lens", "fb.seq_lens", "fb.seq_lens[:raw_bs]", "view.seq_lens[:raw_bs]", "batch.seq_lens_raw; prefix/extend/kv lens", "invariants: seq-lens; every detector"),
    EngineField("req_to_token row", "pool.req_to_token[fb.req_pool_indices]", "same", "same (pool from forward context / backend)", "batch.slot_ids", "invariants: kv-index, window-kv; replay"),
    EngineField("out_cache_loc", "fb.out_cache_loc", "fb.out_cache_loc", "fb.out_cache_loc", "batch.out_cache_loc", "replay; fill-value"),
    EngineField("positions", "fb.positions (verify: spec_info.positions)", "fb.positions", "view.positions[:tokens]", "batch.positions", "invariants: positions"),
    EngineField("extend_prefix_lens / extend_seq_lens", "fb.*", "", "", "batch.prefix_lens / extend_lens", "every detector"),
    EngineField(
        "EagleDraftExtendInput.num_tokens_per_req (a widened window's num_front_tokens included)",
        "spec_info.* (DRAFT_EXTEND_V2)",
        "",
        "the draft-extend runner's view.spec_info (single-layer execute, each layer's replay of the multi-layer runner: a view "
        "without num_padding, its padding read from the runner's buffers)",
        "batch.extend_lens of a V2 draft extend (the window; extend_seq_lens and seq_lens are judged against it)",
        "invariants: seq-lens, qo-lens; every detector",
    ),
    EngineField(
        "seq_lens_sum",
        "fb.seq_lens_sum",
        "the seq_lens_sum argument of init_forward_metadata_replay_cuda_graph",
        "view.seq_lens_sum (SGLang adds padded x fill)",
        "plan.scalars.seq_lens_sum",
        "invariants: seq-lens-sum; fill-value: seq-lens-sum-*",
        plan=("scalars.seq_lens_sum",),
    ),
    EngineField("EagleVerifyInput.seq_lens_sum", "spec_info.seq_lens_sum", "same", "same", "plan.scalars.spec_seq_lens_sum", "invariants: seq-lens-sum", plan=("scalars.spec_seq_lens_sum",)),
    EngineField(
        "custom_mask (spec)",
        "spec_info.custom_mask, whole (or VerifyMask.buffer: cut at this step's layout length)",
        "spec_info.custom_mask, whole",
        "VerifyMask.buffer: cut at this step's layout length",
        "spec.custom_mask + buffers['spec.custom_mask']",
        "tree-mask: mask-length, mask-layout, mask-mismatch, ...",
    ),
    EngineField("retrieve_next_token / _next_sibling", "spec_info", "spec_info", "spec_info", "spec.parents", "tree-mask; invariants: positions"),
    EngineField("TreeMaskMode", "backend.verify_mask.mode, else by size", "by size", "backend.verify_mask.mode", "spec.mask_layout", "tree-mask"),
    EngineField("kv_indptr / kv_indices", "forward_metadata.*", "backend.kv_indptr[:bs+1], cuda_graph_kv_indices", "same", "plan.kv_indptr / kv_indices + buffers", "invariants: indptr-*, kv-index, kv-length; replay --plan recorded", plan=("kv_indptr", "kv_indices")),
    EngineField("num_kv_splits", "forward_metadata.num_kv_splits", "cuda_graph_num_kv_splits[:bs]", "same", "plan.num_kv_splits", "invariants: num-kv-splits; split-merge", plan=("num_kv_splits",)),
    EngineField("qo_indptr", "forward_metadata.qo_indptr", "backend.qo_indptr[:bs+1]", "same", "plan.qo_indptr", "invariants: qo-lens", plan=("qo_indptr",)),
    EngineField("custom_mask / mask_indptr (plan)", "forward_metadata.*", "cuda_graph_custom_mask, mask_indptr[:bs+1]", "verify_mask.buffer, mask_indptr[:bs+1]", "plan.custom_mask / mask_indptr + buffers", "tree-mask: mask-indptr, mask-length, ...; invariants", plan=("custom_mask", "mask_indptr")),
    EngineField(
        "window_kv_indptr / window_kv_indices",
        "forward_metadata.*",
        "backend.window_kv_indptr[:bs+1], cuda_graph_window_kv_indices",
        "same",
        "plan.window_kv_indptr / window_kv_indices + buffers",
        "invariants: window-kv; tree-mask: window-offset",
        plan=("window_kv_indptr", "window_kv_indices"),
    ),
    EngineField("window_kv_offsets", "forward_metadata.window_kv_offsets", "cuda_graph_window_kv_offsets[:bs] (verify)", "same", "plan.window_kv_offsets", "tree-mask: window-offset; invariants: window-kv", plan=("window_kv_offsets",)),
    EngineField("window_num_kv_splits", "forward_metadata.*", "cuda_graph_window_num_kv_splits[:bs] (decode)", "same", "plan.window_num_kv_splits", "invariants: num-kv-splits (generic)", plan=("window_num_kv_splits",)),
    EngineField("sliding_window_size", "layer / backend", "same", "same", "model.sliding_window; plan.scalars.sliding_window", "tree-mask; invariants: window-kv; replay", plan=("scalars.sliding_window",)),
    EngineField("seq_len fill value", "", "runner.seq_len_fill_value", "backend.get_cuda_graph_seq_len_fill_value()", "graph.fill_value", "fill-value"),
    EngineField("padded seq_lens / req_pool_indices / out_cache_loc / positions", "", "runner.*[:bs]", "view.* (+ the padded out_cache_loc buffer)", "graph.padded_*", "fill-value"),
    EngineField(
        "capture sizes (max_bs, max_num_token; attn_logits / kv_indices / mask / workspace buffer sizes)",
        "",
        "runner.max_bs, runner.max_num_token; model_runner.attn_backend's cuda_graph_* buffers' shapes",
        "the static buffers' lengths (seen by build_replay_fb_view); the backend's cuda_graph_* shapes",
        "capture.* (graph/capture_sizes)",
        "invariants: capture-*, num-kv-splits",
    ),
    EngineField(
        "fa3 / flashmla / flashinfer plans",
        "forward_metadata, FlashInfer wrapper buffers (the recorded layer's wrapper), FA3 forward_metadata_spec_decode_expand",
        "forward_metadata (capture-time object, refilled)",
        "same",
        "plan.* (the adapters' names); window_left, logits_soft_cap, causal, verify_path, q_len, FlashMLA cache_seqlens: from the recorded layer and the step (plan._call_arguments)",
        "invariants; tree-mask",
    ),
    EngineField(
        "raw_bs of a classic replay",
        "",
        "runner.raw_bs",
        "view.num_padding",
        "batch size vs graph.capture_bs",
        "fill-value",
    ),
    EngineField(
        "seq_lens_sum without a plan",
        "fb.seq_lens_sum",
        "",
        "",
        "",
        "invariants: seq-lens-sum",
        why_not="kept as a plan scalar; a backend whose metadata the adapter cannot read records no plan, so its sum has nowhere to go",
    ),
    EngineField(
        "FlashInfer packed custom mask",
        "wrapper._custom_mask_buf, wrapper._mask_indptr_buf",
        "same",
        "same",
        "plan.packed_custom_mask, plan.packed_mask_indptr (bytes as FlashInfer packed them: little-endian, per request)",
        "tree-mask (unpacked, against the draft tree); invariants (byte offsets inside the buffer)",
    ),
)
