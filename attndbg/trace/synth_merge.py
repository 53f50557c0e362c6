"""`attndbg synth` of a merge step (mode=merge): a standalone merge of given partial states
(schema.MergeStates), seeded and reproducible, with the merged output a correct engine records.

The states are what attention over disjoint chunks of keys gives: normalised outputs of unit
scale and LSEs of different sizes per state (a short chunk beside a long one), so that a merge
with the wrong LSE base weighs them visibly wrong. An empty chunk (`empty=`) is a state of LSE -inf
with output 0, what FlashAttention writes for a row that sees no key, on every other row. A row
mask (`row_mask=1`, two states) is merge_state_in_place's: the rows it leaves out keep state 0.
"""

from __future__ import annotations

import math

import torch

import attndbg
from attndbg import numerics
from attndbg.trace.schema import DTYPES, AttentionKind, Batch, ForwardMode, LseBase, MergeStates, Model, Source, Trace
from attndbg.trace.synth_spec import SynthSpec


def merged_as_recorded(v: torch.Tensor, s: torch.Tensor, base: LseBase, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a correct merge kernel returns for states `v` [K, T, H, D] and LSEs `s` [K, T, H] in
    `base`: float32 math, the output in v's dtype, the LSE float32 in the same base; with a row
    `mask` [T] bool, the rows left out keep state 0 (merge_state_in_place)."""
    scale = numerics.LN2 if base is LseBase.TWO else 1.0
    output, lse = numerics.merge_states(v.float(), s.float() * scale)
    output, lse = output.to(v.dtype), (lse / scale).to(torch.float32)
    if mask is not None:
        output, lse = torch.where(mask[:, None, None], output, v[0]), torch.where(mask[:, None], lse, s[0])
    return output, lse


def build_merge(spec: SynthSpec) -> Trace:
    g = torch.Generator().manual_seed(spec.seed)
    heads = int(spec.heads.split(":")[0])  # parse_spec checked the head counts
    width = spec.v_head_dim or spec.head_dim
    dtype = DTYPES[spec.dtype]
    base = LseBase(spec.lse_base)
    states, tokens = spec.states, spec.tokens
    v = torch.randn(states, tokens, heads, width, generator=g).to(dtype)
    # Natural-log LSEs: each state its own size (log of its chunk's key count) plus per-row noise.
    sizes = torch.rand(states, 1, 1, generator=g) * 6.0
    lse = sizes + torch.randn(states, tokens, heads, generator=g)
    for i in spec.empty:
        lse[i, ::2] = float("-inf")
        v[i, ::2] = 0
    s = (lse * (numerics.LOG2E if base is LseBase.TWO else 1.0)).to(torch.float32)
    # Drawn last, so every other draw is the same with and without it; at least one row merged.
    mask = (torch.rand(tokens, generator=g) < 0.5) | (torch.arange(tokens) == 0) if spec.row_mask else None
    output, merged = merged_as_recorded(v, s, base, mask)
    model = Model(
        num_qo_heads=heads,
        num_kv_heads=heads,
        head_dim=width,
        v_head_dim=width,
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=1.0 / math.sqrt(width),
        logit_cap=0.0,
        sliding_window=-1,
        q_dtype=spec.dtype,
        kv_dtype=spec.dtype,
        page_size=1,
    )
    none = torch.zeros(0, dtype=torch.int64)
    batch = Batch(
        forward_mode=ForwardMode.IDLE,
        prefix_lens=none,
        extend_lens=none,
        kv_lens=none,
        slot_indptr=torch.zeros(1, dtype=torch.int64),
        slot_ids=none,
        query_cols=none,
        out_cache_loc=none,
        positions=none,
        seq_lens_raw=none,
        kv_cache_size=1,
    )
    source = Source(
        engine="synth",
        engine_version=attndbg.__version__,
        backend="flashinfer" if base is LseBase.TWO else "triton",  # names a backend: the engine backend whose merge takes LSEs in this base
        device="any",
        tp_rank=0,
        step=0,
        attndbg_version=attndbg.__version__,
    )
    return Trace(source=source, model=model, batch=batch, seed=spec.seed, merge=MergeStates(v=v, s=s, lse_base=base, output=output, lse=merged, mask=mask))
