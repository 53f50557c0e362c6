"""`attndbg synth`: build a trace from a short spec, seeded and reproducible.

A spec is a preset name followed by `key=value` overrides, e.g.

    decode-gqa kv_lens=1,33,20000 page_size=16 dtype=float16 seed=3

Keys (lists are comma-separated):

    mode          decode | extend | mixed | verify | selective
    attention     mha | mla
    heads         Q:KV query and KV head counts, e.g. 32:8 (MLA: Q only, one latent KV head)
    head_dim      key width (MHA); v_head_dim defaults to it
    v_head_dim    value width (MHA)
    kv_lora_rank  MLA latent width (default 512)
    rope_dim      MLA rope width (default 64)
    kv_lens       decode: total KV length per request, current token included
    prefix_lens   extend/mixed/verify: cached KV per request
    extend_lens   extend/mixed: new tokens per request (mixed: 1 = a decode row)
    page_size     tokens per KV page (default 1)
    dtype         float16 | bfloat16 | float32 (queries and outputs)
    kv_dtype      KV cache dtype (default: dtype)
    window        sliding window_left (-1 = off)
    logit_cap     tanh soft-cap (0 = off)
    sm_scale      default 1/sqrt(head_dim) (MLA: 1/sqrt(128 + rope_dim), DeepSeek's q/k width)
    shared_prefix leading KV columns shared by all requests, as a radix cache shares them
    scatter       1: slot ids drawn at random from the pool; 0: contiguous
    topk, steps, draft_tokens   verify: EAGLE tree shape
    mask_layout   full | qlen_only | qlen_only_bitpacked (how the engine's mask is recorded)
    select        selective: query positions recomputed per request
    capture_bs    record the step as a CUDA-graph replay padded to this many requests (0 = eager)
    fill_value    seq_len of padded requests in that graph (SGLang: 1)
    seed          RNG seed of the layout and of replay's data

The same spec and seed give the same trace, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

import attndbg
from attndbg.trace import tree
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


@dataclass(frozen=True)
class SynthSpec:
    mode: str = "decode"
    attention: str = "mha"
    heads: str = "32:8"
    head_dim: int = 128
    v_head_dim: int = 0  # 0 = same as head_dim
    kv_lora_rank: int = 512
    rope_dim: int = 64
    kv_lens: tuple[int, ...] = (1, 17, 300, 1025)
    prefix_lens: tuple[int, ...] = (0, 40, 129)
    extend_lens: tuple[int, ...] = (37, 5, 64)
    page_size: int = 1
    dtype: str = "bfloat16"
    kv_dtype: str = ""  # "" = same as dtype
    window: int = -1
    logit_cap: float = 0.0
    sm_scale: float = 0.0  # 0 = default
    shared_prefix: int = 0
    scatter: int = 1
    topk: int = 4
    steps: int = 3
    draft_tokens: int = 8
    mask_layout: str = "full"
    select: int = 4
    capture_bs: int = 0
    fill_value: int = 1
    seed: int = 0


PRESETS: dict[str, dict[str, str]] = {
    "decode-gqa": {"mode": "decode", "heads": "32:8", "kv_lens": "1,17,300,1025", "shared_prefix": "16"},
    "decode-mha": {"mode": "decode", "heads": "8:8", "head_dim": "64", "kv_lens": "3,64,129"},
    "decode-paged": {"mode": "decode", "heads": "16:4", "page_size": "16", "kv_lens": "5,16,33,260", "shared_prefix": "32"},
    "decode-long": {"mode": "decode", "heads": "8:2", "head_dim": "64", "kv_lens": "1,20000"},
    "extend-noprefix": {"mode": "extend", "heads": "16:4", "prefix_lens": "0,0", "extend_lens": "37,70"},
    "extend-prefix": {"mode": "extend", "heads": "16:4", "prefix_lens": "0,40,129", "extend_lens": "37,5,64", "shared_prefix": "24"},
    "extend-cached": {"mode": "extend", "heads": "16:4", "prefix_lens": "63,200", "extend_lens": "1,1"},
    "mixed": {"mode": "mixed", "heads": "16:4", "prefix_lens": "48,0,90,33", "extend_lens": "40,25,1,1"},
    "verify": {"mode": "verify", "heads": "16:4", "prefix_lens": "20,75,130", "topk": "4", "steps": "3", "draft_tokens": "8"},
    "verify-chain": {"mode": "verify", "heads": "16:4", "prefix_lens": "31,64", "topk": "1", "steps": "4", "draft_tokens": "5"},
    "mla-decode": {"mode": "decode", "attention": "mla", "heads": "16", "kv_lens": "1,40,300"},
    "window": {"mode": "extend", "heads": "16:4", "prefix_lens": "100,10", "extend_lens": "30,50", "window": "31"},
    "window-decode": {"mode": "decode", "heads": "16:4", "kv_lens": "10,100,300", "window": "63"},
    "softcap": {"mode": "decode", "heads": "16:8", "kv_lens": "7,150,400", "logit_cap": "30.0"},
    "fp16": {"mode": "extend", "heads": "16:4", "dtype": "float16", "prefix_lens": "30,0", "extend_lens": "20,45"},
    "selective": {"mode": "selective", "heads": "16:4", "kv_lens": "64,150", "select": "6"},
}

_MODES = {
    "decode": ForwardMode.DECODE,
    "extend": ForwardMode.EXTEND,
    "mixed": ForwardMode.MIXED,
    "verify": ForwardMode.TARGET_VERIFY,
    "selective": ForwardMode.EXTEND,
}


class SpecError(ValueError):
    """A synth spec that cannot be built; the message names the key."""


def parse_spec(words: list[str] | tuple[str, ...]) -> SynthSpec:
    """`[preset] key=value ...` -> SynthSpec (the preset's values, then the overrides)."""
    words = list(words)
    values: dict[str, str] = {}
    if words and "=" not in words[0]:
        name = words.pop(0)
        if name not in PRESETS:
            raise SpecError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        values.update(PRESETS[name])
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise SpecError(f"{word!r}: expected key=value")
        values[key] = value
    known = {f.name: f for f in fields(SynthSpec)}
    kwargs: dict[str, object] = {}
    for key, value in values.items():
        if key not in known:
            raise SpecError(f"unknown key {key!r}; keys: {', '.join(known)}")
        default = getattr(SynthSpec(), key)
        try:
            if isinstance(default, tuple):
                kwargs[key] = tuple(int(v) for v in value.split(",") if v != "")
            elif isinstance(default, bool):
                kwargs[key] = value not in ("0", "false", "no")
            elif isinstance(default, int):
                kwargs[key] = int(value)
            elif isinstance(default, float):
                kwargs[key] = float(value)
            else:
                kwargs[key] = value
        except ValueError:
            raise SpecError(f"{key}={value!r}: expected {type(default).__name__}") from None
    return replace(SynthSpec(), **kwargs)


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
    if spec.attention == "mla":
        heads = int(spec.heads.split(":")[0])
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
    if spec.attention != "mha":
        raise SpecError(f"attention={spec.attention!r}: expected mha or mla")
    try:
        q_heads, kv_heads = (int(x) for x in spec.heads.split(":"))
    except ValueError:
        raise SpecError(f"heads={spec.heads!r}: expected Q:KV, e.g. 32:8") from None
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
    if spec.mode not in _MODES:
        raise SpecError(f"mode={spec.mode!r}: expected one of {', '.join(_MODES)}")
    if spec.mask_layout not in {m.value for m in MaskLayout}:
        raise SpecError(f"mask_layout={spec.mask_layout!r}: expected full, qlen_only or qlen_only_bitpacked")
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
        backend="triton",
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
