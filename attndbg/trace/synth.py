"""`attndbg synth`: build a trace from a spec (see `synth_spec` for the keys), seeded and reproducible.

The same spec and seed give the same trace, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

import attndbg
from attndbg.trace import tree
from attndbg.trace.synth_layout import allocate_rows, extend_mask
from attndbg.trace.synth_merge import build_merge
from attndbg.trace.synth_spec import PRESETS, SpecError, SynthSpec, is_causal, parse_spec  # noqa: F401  (the spec API, re-exported)
from attndbg.trace.schema import (
    AttentionKind,
    Batch,
    CaptureSizes,
    ForwardMode,
    Graph,
    GraphCapture,
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
    """(prefix_lens, extend_lens) per request for the spec's mode (cross=1: the encoder KV as prefix)."""
    if spec.mode == "decode":
        if spec.cross:
            return list(spec.kv_lens), [1] * len(spec.kv_lens)
        if any(n < 1 for n in spec.kv_lens):
            raise SpecError("kv_lens: a decode request has at least its current token (>= 1); 0 only with cross=1")
        return [n - 1 for n in spec.kv_lens], [1] * len(spec.kv_lens)
    if spec.mode == "verify":
        return list(spec.prefix_lens), [_draft_tokens(spec)] * len(spec.prefix_lens)
    if spec.mode == "selective":
        if any(n < spec.select for n in spec.kv_lens):
            raise SpecError(f"kv_lens: selective recompute needs rows of at least select={spec.select} columns")
        return [n - spec.select for n in spec.kv_lens], [spec.select] * len(spec.kv_lens)
    if len(spec.prefix_lens) != len(spec.extend_lens):
        raise SpecError(f"prefix_lens has {len(spec.prefix_lens)} entries but extend_lens has {len(spec.extend_lens)}")
    return list(spec.prefix_lens), list(spec.extend_lens)


def _draft_tokens(spec: SynthSpec) -> int:
    return len(spec.parents) if spec.parents else spec.draft_tokens


def _layer(spec: SynthSpec) -> dict:
    """The Model fields of the layer keys (sinks are drawn last, in `build`)."""
    return {"causal": is_causal(spec), "window_right": spec.window_right, "k_scale": spec.k_scale, "v_scale": spec.v_scale}


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
            **_layer(spec),
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
        **_layer(spec),
    )


def build(spec: SynthSpec) -> Trace:
    """The trace a correct engine would describe for this spec (no plan: see replay.plans)."""
    # parse_spec checked mode, attention, dtypes and mask_layout against their closed sets.
    if spec.mode == "merge":
        return build_merge(spec)
    if spec.page_size < 1:
        raise SpecError("page_size must be >= 1")
    g = torch.Generator().manual_seed(spec.seed)
    model = _model(spec)
    prefix, extend = _lengths(spec)
    if not prefix:
        raise SpecError("the batch is empty: give at least one request")
    if any(x < 0 for x in prefix + extend):
        raise SpecError("lengths must be >= 0")
    cross = bool(spec.cross)
    kv = list(prefix) if cross else [p + e for p, e in zip(prefix, extend)]
    mode = _MODES[spec.mode]
    selective = spec.mode == "selective"
    shareable = [0] * len(kv) if selective else prefix
    rows, cache_size = allocate_rows(
        kv, shareable, page_size=spec.page_size, shared_prefix=spec.shared_prefix, slots=spec.slots or ("scatter" if spec.scatter else "contiguous"), g=g
    )
    query_cols, positions = [], []
    spec_section = None
    parents = None
    topk, steps = spec.topk, spec.steps
    if mode is ForwardMode.TARGET_VERIFY:
        if spec.parents:
            given = torch.tensor(spec.parents, dtype=torch.int64)
            parents = given.expand(len(prefix), -1).clone()
            topk, steps = tree.shape(given)
        else:
            try:
                parents = torch.stack(
                    [tree.eagle_tree(topk=spec.topk, steps=spec.steps, draft_token_num=spec.draft_tokens, generator=g) for _ in prefix]
                )
            except ValueError as e:
                raise SpecError(str(e)) from None
        depth = [tree.depths(p) for p in parents]
    for b, (p, e, n) in enumerate(zip(prefix, extend, kv)):
        if cross:
            # Bottom-right aligned (schema.Batch.cross); positions are the decoder's own.
            query_cols.append(torch.arange(n - e, n))
            positions.append(torch.arange(e))
        elif selective:
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
    if cross:  # the encoder's K/V are cached: nothing is written
        out_cache_loc = torch.full((query_cols_t.numel(),), -1, dtype=torch.int64)
    else:
        out_cache_loc = torch.cat([rows[b][c] for b, c in enumerate(query_cols)]) if rows else torch.zeros(0, dtype=torch.int64)

    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    if mode is ForwardMode.TARGET_VERIFY:
        seq_lens_raw = prefix_t.clone()  # SGLang verify seq_lens exclude the draft tokens
        layout = MaskLayout(spec.mask_layout)
        spec_section = Spec(
            algorithm="EAGLE",
            draft_token_num=_draft_tokens(spec),
            topk=topk,
            steps=steps,
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
        cross=cross,
    )
    if spec.extend_mask:
        if mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or selective:
            raise SpecError(f"extend_mask={spec.extend_mask}: a custom mask on an extend or mixed step, not mode={spec.mode}")
        batch = replace(batch, custom_mask=extend_mask(batch, spec.extend_mask, causal=model.causal, g=g))
    if spec.sinks:
        # Drawn last, so every other draw of the spec is the same with and without sinks. gpt-oss's
        # learned sinks sit around the logsumexp of a short row: some heads let the sink dominate.
        model = replace(model, sinks=(torch.rand(model.num_qo_heads, generator=g) * 6.0 - 1.0).to(torch.float32))
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
    capture = CaptureSizes(max_kv_splits=spec.max_kv_splits) if spec.max_kv_splits else None
    return Trace(source=source, model=model, batch=batch, seed=spec.seed, spec=spec_section, graph=graph, capture=capture)


_CAPTURES = {
    GraphCapture.DECODE: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY),
    GraphCapture.MIXED: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.MIXED),
    GraphCapture.FULL: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.MIXED, ForwardMode.EXTEND),
}


def _graph_section(batch: Batch, spec: SynthSpec) -> Graph:
    """The static buffers a correct graph runner holds for this step (SGLang's newer runner: seq_lens
    padded with the fill value; req_pool_indices, out_cache_loc, positions zeroed). A mixed or extend
    step (graph_mode=mixed/full) pads like vLLM's full graphs: one token per padded request, the
    query offsets recorded with their padded tail."""
    captured = GraphCapture(spec.graph_mode) if spec.graph_mode else GraphCapture.DECODE
    if batch.forward_mode not in _CAPTURES[captured]:
        if not spec.graph_mode:
            raise SpecError(f"capture_bs: engines capture only decode and verify steps, not {batch.forward_mode.value} (give graph_mode=mixed or full)")
        raise SpecError(f"graph_mode={spec.graph_mode}: such a runner does not capture {batch.forward_mode.value} steps")
    if batch.cross:
        raise SpecError("capture_bs: a cross-attention step is recorded eager here")
    if spec.capture_bs < batch.batch_size:
        raise SpecError(f"capture_bs={spec.capture_bs} is smaller than the batch ({batch.batch_size} requests)")
    pad = spec.capture_bs - batch.batch_size
    uniform = batch.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    per_req = int(batch.extend_lens[0]) if batch.batch_size and uniform else 1
    zeros = torch.zeros(pad * per_req, dtype=torch.int64)
    qo = None if uniform else torch.cat([batch.qo_indptr, batch.num_tokens + torch.arange(1, pad + 1)])
    return Graph(
        is_graph_replay=True,
        capture_bs=spec.capture_bs,
        fill_value=spec.fill_value,
        padded_seq_lens=torch.cat([batch.seq_lens_raw, torch.full((pad,), spec.fill_value, dtype=torch.int64)]),
        # Request pool rows: synth gives request b row b + 1 (row 0 stays free, as a pool's first).
        padded_req_pool_indices=torch.cat([torch.arange(1, batch.batch_size + 1), torch.zeros(pad, dtype=torch.int64)]),
        padded_out_cache_loc=torch.cat([batch.out_cache_loc, zeros]),
        padded_positions=torch.cat([batch.positions, zeros]),
        padded_qo_indptr=qo,
        captured=GraphCapture(spec.graph_mode) if spec.graph_mode else None,
    )


def recording_specs(spec: SynthSpec, steps: int) -> list[SynthSpec]:
    """The specs of `attndbg synth --recording N`: N steps of one server whose batch shrinks to one
    request and grows back (first requests of the spec kept, a triangle wave between the spec's
    batch and 1), so that detectors of state left by an earlier step (a graph replayed with a
    smaller batch, stale padded rows) see more than one step. Decode and verify requests grow by
    one token a step, as they would decoding; each step draws its own data (seed + step). A spec
    with capture_bs replays every step into that one captured graph."""
    if spec.mode == "merge":
        raise SpecError("--recording: a merge step has no batch to shrink and grow; write the step alone")
    counts = {"decode": len(spec.kv_lens), "selective": len(spec.kv_lens)}.get(spec.mode, len(spec.prefix_lens))
    if counts < 1:
        raise SpecError("the batch is empty: give at least one request")
    period = 2 * (counts - 1)
    out = []
    for step in range(steps):
        phase = step % period if period else 0
        bs = counts - phase if phase < counts else 2 + phase - counts
        grown = {"decode": "kv_lens", "verify": "prefix_lens"}.get(spec.mode)
        fields = {name: tuple(getattr(spec, name)[:bs]) for name in ("kv_lens", "prefix_lens", "extend_lens")}
        if grown:
            fields[grown] = tuple(n + step for n in fields[grown])
        out.append(replace(spec, seed=spec.seed + step, **fields))
    return out
