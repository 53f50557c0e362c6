"""Every vLLM field attndbg's detectors read: where it comes from, how it is recorded, who reads it.

`ENGINE_FIELDS` is the table (a detector that reads a field must be fed by the adapter);
the recorder takes its trimming rules from it, so the table cannot drift from what is recorded.
`CommonAttentionMetadata` (vLLM 0.33 `vllm/v1/attention/backend.py`, engines.md B1) is recorded
*verbatim* under `plan.tensors["common.<field>"]` / `plan.scalars["common.<field>"]`, beside the
engine-neutral batch built from it, cut only of bytes no kernel launched over this metadata can
read (the `Trim` of each field says which and why). The builder's own output is recorded beside
it under its own names (`plan`).

| engine field | source | recorded as | read by |
|---|---|---|---|
| query_start_loc | cm, [num_reqs+1] int32 | common.query_start_loc; batch.extend_lens (real rows); graph.padded_qo_indptr (padded steps) | invariants (vLLM offsets), batch, fill-value |
| query_start_loc_cpu | cm, host mirror | common.query_start_loc_cpu | invariants (host mirror) |
| seq_lens | cm, [num_reqs] int32 | common.seq_lens; batch.kv_lens, seq_lens_raw; graph.padded_seq_lens | invariants (seq-lens), fill-value |
| seq_lens_cpu_upper_bound | cm (0.33), host | common.seq_lens_cpu_upper_bound | invariants (host mirror) |
| seq_lens_cpu, num_computed_tokens_cpu | cm (0.11), host | common.* | invariants (host mirror) |
| num_reqs, num_actual_tokens, max_query_len, max_seq_len | cm ints | common.* and vllm.* scalars | invariants (seq-lens-max) |
| block_table_tensor | cm, [num_reqs, W] int32 | common.block_table_tensor; batch.slot_ids; graph.padded_block_table (padded steps); capture.block_table_width (W, before trimming) | invariants (block table, capture sizes) |
| slot_mapping | cm, [num_actual_tokens] int64 | common.slot_mapping; graph.padded_out_cache_loc | invariants (slot-mapping), fill-value |
| positions | cm (0.33), [num_actual_tokens] | common.positions; batch.positions; graph.padded_positions | invariants (positions) |
| is_prefilling | cm (0.33), [num_reqs] bool | common.is_prefilling | the converter (verify vs extend) |
| causal, encoder_seq_lens, dcp_local_seq_lens*, rswa_prefix_lens, logits_indices_padded, ... | cm | common.* (generic) | none yet |
| req_idx, encoder_seq_lens_cpu (numpy), mm_req_doc_ranges (dict) | cm | not recorded (not tensors) | none |
| kv_cache_spec.block_size | builder | model.page_size | every detector |
| cache_config.num_gpu_blocks | vllm_config (engine process) | vllm.num_gpu_blocks; batch.kv_cache_size | invariants (pool bound) |
| speculative_config.num_speculative_tokens, .method | vllm_config | spec | tree-mask |
| speculative_config.enable_adaptive_verification (V2, opt-in) | vllm_config | vllm.adaptive_verification (when on) | invariants (host mirror: totals only) |
| scheduler_config.max_num_seqs; compilation_config.cudagraph_capture_sizes / max_cudagraph_capture_size | vllm_config | capture.max_bs; capture.max_num_tokens | invariants (capture sizes) |
| FlashInfer builder `_workspace_buffer` | builder (once allocated) | capture.workspace_bytes | none (recorded) |
| tree_attn_bias | TreeAttentionMetadata (0.11) | plan.tree_attn_bias; spec.parents | tree-mask |
| every int/bool tensor and scalar of the built metadata | builder.build() | plan.<name> | invariants (plan), replay --plan recorded |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attndbg.record.vllm.plan import Scalar, plan_parts

COMMON_PREFIX = "common."  # plan names of the CommonAttentionMetadata evidence


class Trim(enum.Enum):
    """How a field is cut before it is copied, and why no kernel can read what is cut."""

    NONE = "recorded whole"
    # Kernels launch one program per request over query_start_loc[:num_reqs+1] (vLLM 0.33 hands in
    # exactly that view already; older runners passed the persistent buffer).
    OFFSETS = "first num_reqs + 1 entries"
    # Per-request tensors are indexed by request < num_reqs only.
    PER_REQUEST = "first num_reqs rows"
    # Per-token tensors are indexed by token < num_actual_tokens only.
    PER_TOKEN = "first num_actual_tokens entries"
    # The table's rows are read up to ceil(seq_len / block_size) columns, and vLLM sizes every
    # launch by max_seq_len >= each seq_len; the persistent table is max_model_len / block_size wide
    # (megabytes a step). A seq_len past max_seq_len is itself reported (invariants: seq-lens-max).
    TABLE = "first num_reqs rows, first ceil(max_seq_len / block_size) columns"


@dataclass(frozen=True)
class EngineField:
    name: str  # CommonAttentionMetadata's own name
    trim: Trim
    read_by: str  # detectors (and converter steps) that read it; "" = recorded for the record only


ENGINE_FIELDS: tuple[EngineField, ...] = (
    EngineField("query_start_loc", Trim.OFFSETS, "batch; invariants: indptr-*, vllm-empty-request"),
    EngineField("query_start_loc_cpu", Trim.OFFSETS, "invariants: host-mirror"),
    EngineField("seq_lens", Trim.PER_REQUEST, "batch; graph; invariants: seq-lens, seq-lens-max; fill-value"),
    EngineField("seq_lens_cpu", Trim.PER_REQUEST, "invariants: host-mirror"),
    EngineField("seq_lens_cpu_upper_bound", Trim.PER_REQUEST, "invariants: host-mirror"),
    EngineField("num_computed_tokens_cpu", Trim.PER_REQUEST, "invariants: host-mirror"),
    EngineField("block_table_tensor", Trim.TABLE, "batch; invariants: index-outside-cache, null-block-read, block-table-short"),
    EngineField("slot_mapping", Trim.PER_TOKEN, "graph; invariants: slot-mapping; fill-value: padded-kv-write"),
    EngineField("positions", Trim.PER_TOKEN, "batch; graph; invariants: positions"),
    EngineField("is_prefilling", Trim.PER_REQUEST, "converter: verify or extend"),
    EngineField("dcp_local_seq_lens", Trim.PER_REQUEST, ""),
    EngineField("dcp_local_seq_lens_cpu_upper_bound", Trim.PER_REQUEST, ""),
    EngineField("rswa_prefix_lens", Trim.PER_REQUEST, ""),
    EngineField("replayssm_decode_base_cpu", Trim.PER_REQUEST, ""),
    EngineField("encoder_seq_lens", Trim.PER_REQUEST, ""),
    EngineField("logits_indices_padded", Trim.NONE, ""),
)
FIELDS_BY_NAME = {f.name: f for f in ENGINE_FIELDS}


def common_parts(cm: Any, block_size: int) -> tuple[dict[str, Tensor], dict[str, Scalar]]:
    """(tensors, scalars) of a CommonAttentionMetadata, verbatim but for each field's `Trim`.

    Fields are discovered (vLLM adds and drops them between versions); a tensor field missing from
    `ENGINE_FIELDS` is recorded whole. Views only: nothing is copied or synchronised here. No data
    pointers: kernels read the builder's tensors, whose pointers the plan keeps.
    """
    num_reqs, tokens = int(cm.num_reqs), int(cm.num_actual_tokens)
    stops = {Trim.OFFSETS: num_reqs + 1, Trim.PER_REQUEST: num_reqs, Trim.TABLE: num_reqs, Trim.PER_TOKEN: tokens}
    tensors, scalars = plan_parts(cm, block_size=block_size, max_seq_len=int(cm.max_seq_len), pointers=False)
    for name, value in tensors.items():
        field = FIELDS_BY_NAME.get(name)
        if field is not None and field.trim in stops and value.dim() >= 1:
            tensors[name] = value[: stops[field.trim]]
    return tensors, scalars
