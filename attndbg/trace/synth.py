"""`attndbg synth`: build a trace from a spec (see `synth_spec` for the keys), seeded and reproducible.

The same spec and seed give the same trace, bit for bit.
"""

from __future__ import annotations

import math

import torch

import attndbg
from attndbg.trace import tree
from attndbg.trace.synth_spec import PRESETS, SpecError, SynthSpec, parse_spec  # noqa: F401  (the spec API, re-exported)
from attndbg.trace.schema import (
    AttentionKind,
    Batch,
    ForwardMode,
    Graph,
    MaskLayout,
    Model,
    Source,
    Spec,
    Trace,
)


_MODES = {
    "decode": ForwardMode.DECODE,
    "extend": ForwardMode.EXTEND,
    "mixed": ForwardMode.MIXED,
    "verify": ForwardMode.TARGET_VERIFY,
    "selective": ForwardMode.EXTEND,
}


def _lengths(spec: SynthSpec) -> tuple[list[int], list[int]]:
    """(prefix_lens, extend_lens) per request for the spec's mode."""
    if spec.mode == "decode":
        if any(n < 1 for n in spec.kv_lens):
            raise SpecError("kv_lens: a decode request has at least its current token (>= 1)")
        return [n - 1 for n in spec.kv_lens], [1] * len(spec.kv_lens)
    if spec.mode == "verify":
        return list(spec.prefix_lens), [spec.draft_tokens] * len(spec.prefix_lens)
    if spec.mode == "selective":
        if any(n < spec.select for n in spec.kv_lens):
            raise SpecError(f"kv_lens: selective recompute needs rows of at least select={spec.select} columns")
        return [n - spec.select for n in spec.kv_lens], [spec.select] * len(spec.kv_lens)
    if len(spec.prefix_lens) != len(spec.extend_lens):
        raise SpecError(f"prefix_lens has {len(spec.prefix_lens)} entries but extend_lens has {len(spec.extend_lens)}")
    return list(spec.prefix_lens), list(spec.extend_lens)


def _model(spec: SynthSpec) -> Model:
    if spec.attention == AttentionKind.MLA.value:
        heads = int(spec.heads.split(":")[0])  # parse_spec checked the head counts
        head_dim = spec.kv_lora_rank + spec.rope_dim
        return Model(
            num_qo_heads=heads,
            num_kv_heads=1,
            head_dim=head_dim,
            v_head_dim=spec.kv_lora_rank,
            attention=AttentionKind.MLA,
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.rope_dim,
            sm_scale=spec.sm_scale or 1.0 / math.sqrt(128 + spec.rope_dim),
            logit_cap=spec.logit_cap,
            sliding_window=spec.window,
            q_dtype=spec.dtype,
            kv_dtype=spec.kv_dtype or spec.dtype,
            page_size=spec.page_size,
        )
    q_heads, kv_heads = (int(x) for x in spec.heads.split(":"))  # parse_spec checked them
    return Model(
        num_qo_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim or spec.head_dim,
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=spec.sm_scale or 1.0 / math.sqrt(spec.head_dim),
        logit_cap=spec.logit_cap,
        sliding_window=spec.window,
        q_dtype=spec.dtype,
        kv_dtype=spec.kv_dtype or spec.dtype,
        page_size=spec.page_size,
    )


def _allocate_rows(
    kv_lens: list[int], shareable: list[int], *, page_size: int, shared_prefix: int, scatter: bool, g: torch.Generator
) -> tuple[list[torch.Tensor], int]:
    """Give each request a req_to_token row of slot ids, paged, optionally sharing a prefix.

    Page 0 is reserved (the engine's dummy slot for padded tokens), as SGLang and vLLM reserve it.
    Shared prefixes are whole pages, as a paged radix cache matches them, and only columns already
    cached (`shareable`) are shared: slots written this step belong to one request.
    """
    shared_pages = shared_prefix // page_size
    reused = [min(shared_pages, s // page_size) for s in shareable]
    pages_needed = [math.ceil(n / page_size) for n in kv_lens]
    own_pages = [p - r for p, r in zip(pages_needed, reused)]
    used = shared_pages + sum(own_pages)
    # Spare pages make the pool larger than the batch, so wrong indices can land on unused data.
    pool_pages = 1 + used + max(used // 4, 2)
    order = torch.randperm(pool_pages - 1, generator=g) + 1 if scatter else torch.arange(1, pool_pages)
    shared = order[:shared_pages]
    cursor = shared_pages
    rows = []
    for n, own, reuse in zip(kv_lens, own_pages, reused):
        pages = torch.cat([shared[:reuse], order[cursor : cursor + own]])
        cursor += own
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        rows.append(slots.to(torch.int64))
    return rows, pool_pages * page_size


def build(spec: SynthSpec) -> Trace:
    """The trace a correct engine would describe for this spec (no plan: see replay.plans)."""
    # parse_spec checked mode, attention, dtypes and mask_layout against their closed sets.
    if spec.page_size < 1:
        raise SpecError("page_size must be >= 1")
    g = torch.Generator().manual_seed(spec.seed)
    model = _model(spec)
    prefix, extend = _lengths(spec)
    if not prefix:
        raise SpecError("the batch is empty: give at least one request")
    if any(x < 0 for x in prefix + extend):
        raise SpecError("lengths must be >= 0")
    kv = [p + e for p, e in zip(prefix, extend)]
    mode = _MODES[spec.mode]
    selective = spec.mode == "selective"
    shareable = [0] * len(kv) if selective else prefix
    rows, cache_size = _allocate_rows(
        kv, shareable, page_size=spec.page_size, shared_prefix=spec.shared_prefix, scatter=bool(spec.scatter), g=g
    )
    query_cols, positions = [], []
    spec_section = None
    parents = None
    if mode is ForwardMode.TARGET_VERIFY:
        try:
            parents = torch.stack(
                [tree.eagle_tree(topk=spec.topk, steps=spec.steps, draft_token_num=spec.draft_tokens, generator=g) for _ in prefix]
            )
        except ValueError as e:
            raise SpecError(str(e)) from None
        depth = [tree.depths(p) for p in parents]
    for b, (p, e, n) in enumerate(zip(prefix, extend, kv)):
        if selective:
            # Recompute a sorted subset of the row that always includes the last column.
            picked = torch.randperm(n - 1, generator=g)[: e - 1].sort().values if e > 1 else torch.zeros(0, dtype=torch.int64)
            cols = torch.cat([picked, torch.tensor([n - 1])])
            query_cols.append(cols)
            positions.append(cols)
        else:
            cols = torch.arange(p, n)
            query_cols.append(cols)
            positions.append(p + depth[b] if parents is not None else cols)
    query_cols_t = torch.cat(query_cols).to(torch.int64)
    out_cache_loc = torch.cat([rows[b][c] for b, c in enumerate(query_cols)]) if rows else torch.zeros(0, dtype=torch.int64)

    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    if mode is ForwardMode.TARGET_VERIFY:
        seq_lens_raw = prefix_t.clone()  # SGLang verify seq_lens exclude the draft tokens
        layout = MaskLayout(spec.mask_layout)
        spec_section = Spec(
            algorithm="EAGLE",
            draft_token_num=spec.draft_tokens,
            topk=spec.topk,
            steps=spec.steps,
            parents=parents,
            custom_mask=tree.build_mask(layout, parents, prefix_t),
            mask_layout=layout,
        )
    else:
        seq_lens_raw = torch.tensor(kv, dtype=torch.int64)  # SGLang decode/extend: total incl. new tokens
    batch = Batch(
        forward_mode=mode,
        prefix_lens=prefix_t,
        extend_lens=torch.tensor(extend, dtype=torch.int64),
        kv_lens=torch.tensor(kv, dtype=torch.int64),
        slot_indptr=torch.nn.functional.pad(torch.cumsum(torch.tensor(kv, dtype=torch.int64), 0), (1, 0)),
        slot_ids=torch.cat(rows),
        query_cols=query_cols_t,
        out_cache_loc=out_cache_loc,
        positions=torch.cat(positions).to(torch.int64),
        seq_lens_raw=seq_lens_raw,
        kv_cache_size=cache_size,
        selective=selective,
    )
    source = Source(
        engine="synth",
        engine_version=attndbg.__version__,
        backend="triton",  # names a backend: a synth step is what SGLang's Triton backend records (the trace layer imports no adapter)
        device="any",
        tp_rank=0,
        step=0,
        attndbg_version=attndbg.__version__,
    )
    graph = _graph_section(batch, spec) if spec.capture_bs else None
    return Trace(source=source, model=model, batch=batch, seed=spec.seed, spec=spec_section, graph=graph)


def _graph_section(batch: Batch, spec: SynthSpec) -> Graph:
    """The static buffers a correct SGLang graph runner holds for this step (newer runner:
    seq_lens padded with the fill value; req_pool_indices, out_cache_loc, positions zeroed)."""
    if batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        raise SpecError(f"capture_bs: engines capture only decode and verify steps, not {batch.forward_mode.value}")
    if spec.capture_bs < batch.batch_size:
        raise SpecError(f"capture_bs={spec.capture_bs} is smaller than the batch ({batch.batch_size} requests)")
    pad = spec.capture_bs - batch.batch_size
    per_req = int(batch.extend_lens[0]) if batch.batch_size else 1
    zeros = torch.zeros(pad * per_req, dtype=torch.int64)
    return Graph(
        is_graph_replay=True,
        capture_bs=spec.capture_bs,
        fill_value=spec.fill_value,
        padded_seq_lens=torch.cat([batch.seq_lens_raw, torch.full((pad,), spec.fill_value, dtype=torch.int64)]),
        # Request pool rows: synth gives request b row b + 1 (row 0 stays free, as a pool's first).
        padded_req_pool_indices=torch.cat([torch.arange(1, batch.batch_size + 1), torch.zeros(pad, dtype=torch.int64)]),
        padded_out_cache_loc=torch.cat([batch.out_cache_loc, zeros]),
        padded_positions=torch.cat([batch.positions, zeros]),
    )
