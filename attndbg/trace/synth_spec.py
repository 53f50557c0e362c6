"""`attndbg synth` specs: a preset name, then `key=value` overrides, seeded and reproducible.

A spec is a preset name followed by `key=value` overrides, e.g.

    decode-gqa kv_lens=1,33,20000 page_size=16 dtype=float16 seed=3

Keys (lists are comma-separated):

    mode          decode | extend | mixed | verify | selective | merge (a standalone merge of given
                  partial states: the keys states, tokens, lse_base, empty; heads Q, head_dim, dtype)
    attention     mha | mla
    heads         Q:KV query and KV head counts, e.g. 32:8 (MLA: Q only, one latent KV head)
    head_dim      key width (MHA); v_head_dim defaults to it
    v_head_dim    value width (MHA)
    kv_lora_rank  MLA latent width (default 512)
    rope_dim      MLA rope width (default 64)
    kv_lens       decode: total KV length per request, current token included (cross=1: the encoder's)
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
    graph_mode    decode | mixed | full: which steps the runner captured (default: decode and verify
                  only, as SGLang's); mixed also captures mixed steps, full extend steps too (vLLM FULL)
    causal        1 | 0: queries see only the keys up to their own column (default 1; 0 with cross=1
                  or window_right)
    window_right  keys after a query's column it sees (non-causal layers; -1 = unbounded)
    sinks         1: a learned sink logit per query head (gpt-oss), drawn from the seed
    k_scale       dequantisation scale of an fp8 KV cache's keys (needs kv_dtype=float8_e4m3fn or e5m2)
    v_scale       the same for values
    cross         1: cross-attention: prefix_lens (decode: kv_lens) are encoder KV, cached, 0 allowed;
                  extend_lens are the queries, aligned bottom-right when causal
    extend_mask   causal | random | blocks: a custom mask on an extend/mixed step (random: each key
                  drawn from the seed, a query's own column kept; blocks: causal plus bidirectional spans)
    parents       verify: the draft tree as parent indices (-1 first), for every request, e.g. -1,0,0,1,2
    slots         contiguous | scatter | shuffled_pages | interleaved_pages | non_monotonic: how each
                  request's pages lie in the pool (default: scatter's); non_monotonic: descending pages
    max_kv_splits the engine's cap on split-KV partials per request (capture.max_kv_splits; 0 = none)
    states        merge: partial states per row (2: FlashInfer merge_state, vLLM merge_attn_states;
                  more: merge_states, one per chunk of SGLang's chunked prefix)
    tokens        merge: rows (query tokens) merged
    lse_base      merge: 2 | e, the base of the given LSEs (2: FlashInfer's; e: vLLM's, FA3's, Triton's)
    empty         merge: states that are an empty chunk (LSE -inf, output 0) on every other row, e.g. 1
    row_mask      merge: 1: merge_state_in_place's row mask, drawn from the seed: the rows it leaves
                  out keep state 0 (states=2)
    seed          RNG seed of the layout and of replay's data

The same spec and seed give the same trace, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from attndbg.suggest import did_you_mean

# This module imports nothing heavy: `attndbg synth --list` and spec errors stay instant.
# The dtype names a spec accepts (trace.schema.Q_DTYPES and the KV dtypes, spelled without torch).
Q_DTYPE_NAMES = ("float16", "bfloat16", "float32")
KV_DTYPE_NAMES = Q_DTYPE_NAMES + ("float8_e4m3fn", "float8_e5m2")
# The attention kinds (trace.schema.AttentionKind's values, spelled without torch).
MHA = "mha"
MLA = "mla"  # not a backend name: the attention kind


@dataclass(frozen=True)
class SynthSpec:
    mode: str = "decode"
    attention: str = MHA
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
    graph_mode: str = ""  # "" = decode and verify only, stored as before (no graph.captured)
    causal: int = -1  # -1 = 1, or 0 with cross=1 / window_right
    window_right: int = -1
    sinks: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0
    cross: int = 0
    extend_mask: str = ""
    parents: tuple[int, ...] = ()
    slots: str = ""  # "" = as `scatter` says
    max_kv_splits: int = 0
    states: int = 2
    tokens: int = 32
    lse_base: str = "2"
    empty: tuple[int, ...] = ()
    row_mask: int = 0


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
    "mla-decode": {"mode": "decode", "attention": MLA, "heads": "16", "kv_lens": "1,40,300"},
    "window": {"mode": "extend", "heads": "16:4", "prefix_lens": "100,10", "extend_lens": "30,50", "window": "31"},
    "window-decode": {"mode": "decode", "heads": "16:4", "kv_lens": "10,100,300", "window": "63"},
    "softcap": {"mode": "decode", "heads": "16:8", "kv_lens": "7,150,400", "logit_cap": "30.0"},
    "fp16": {"mode": "extend", "heads": "16:4", "dtype": "float16", "prefix_lens": "30,0", "extend_lens": "20,45"},
    "selective": {"mode": "selective", "heads": "16:4", "kv_lens": "64,150", "select": "6"},
    "sinks-decode": {"mode": "decode", "heads": "8:1", "head_dim": "64", "kv_lens": "1,40,300", "sinks": "1"},
    "bidirectional": {"mode": "extend", "heads": "8:2", "head_dim": "64", "prefix_lens": "0,30", "extend_lens": "40,17", "causal": "0"},
    "fp8-scaled": {"mode": "decode", "heads": "16:4", "kv_lens": "9,130", "kv_dtype": "float8_e4m3fn", "k_scale": "0.5", "v_scale": "2.0"},
    "cross": {"mode": "extend", "heads": "8:8", "head_dim": "64", "prefix_lens": "6,12,90", "extend_lens": "5,30,7", "cross": "1"},
    "extend-mask": {"mode": "extend", "heads": "8:2", "head_dim": "64", "prefix_lens": "0,24", "extend_lens": "33,12", "extend_mask": "blocks"},
    "mixed-graph": {"mode": "mixed", "heads": "16:4", "prefix_lens": "48,0,90,33", "extend_lens": "40,25,1,1", "capture_bs": "8", "graph_mode": "mixed"},
    "merge-state": {"mode": "merge", "heads": "8", "head_dim": "128", "states": "2", "tokens": "32", "lse_base": "2"},
    "merge-chunks": {"mode": "merge", "heads": "8", "head_dim": "128", "states": "5", "tokens": "24", "lse_base": "e", "empty": "2"},
}


# What a value of each type must look like, in the words a user typed it.
_EXPECTED = {tuple: "comma-separated integers, e.g. 1,33,20000", int: "an integer", float: "a number", bool: "0 or 1"}
# Keys with a closed set of values (checked here, so the error names the key the user typed).
_CHOICES = {
    "mode": ("decode", "extend", "mixed", "verify", "selective", "merge"),
    "attention": (MHA, MLA),
    "dtype": Q_DTYPE_NAMES,
    "kv_dtype": KV_DTYPE_NAMES,
    "mask_layout": ("full", "qlen_only", "qlen_only_bitpacked"),
    "graph_mode": ("decode", "mixed", "full"),
    "extend_mask": ("causal", "random", "blocks"),
    "slots": ("contiguous", "scatter", "shuffled_pages", "interleaved_pages", "non_monotonic"),
    "lse_base": ("2", "e"),
}
# Keys whose 0/1 value is a switch.
_SWITCHES = ("sinks", "cross", "row_mask")


# Lower bounds of numeric keys (lists: every element), and what the bound means.
_AT_LEAST = {
    "head_dim": (1, ""),
    "v_head_dim": (0, " (0 = head_dim)"),
    "kv_lora_rank": (1, ""),
    "rope_dim": (0, ""),
    "page_size": (1, ""),
    "window": (-1, " (-1 = off)"),
    "logit_cap": (0, " (0 = off)"),
    "sm_scale": (0, " (0 = the default)"),
    "shared_prefix": (0, ""),
    "topk": (1, ""),
    "steps": (1, ""),
    "draft_tokens": (1, ""),
    "select": (1, ""),
    "capture_bs": (0, " (0 = eager)"),
    "fill_value": (0, ""),
    "prefix_lens": (0, ""),
    "extend_lens": (0, ""),
    "kv_lens": (0, ""),
    "causal": (0, ""),
    "window_right": (-1, " (-1 = unbounded)"),
    "k_scale": (0, ""),
    "v_scale": (0, ""),
    "max_kv_splits": (0, " (0 = none)"),
    "states": (1, ""),
    "tokens": (0, ""),
    "empty": (0, ""),
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
            raise SpecError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; presets: {', '.join(PRESETS)}")
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
            raise SpecError(f"unknown key {key!r}{did_you_mean(key, known)}; keys: {', '.join(known)}")
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
            raise SpecError(f"{key}={value!r}: expected {_EXPECTED[type(default)]}") from None
        choices = _CHOICES.get(key)
        if choices and value not in choices and not (key == "kv_dtype" and value == ""):
            raise SpecError(f"{key}={value!r}: expected one of {', '.join(choices)}")
        if (key in _SWITCHES or key == "causal") and kwargs[key] not in (0, 1):
            raise SpecError(f"{key}={value!r}: expected 0 or 1")
        low = _AT_LEAST.get(key)
        given = kwargs[key]
        if isinstance(given, tuple):  # a list: its least element (an empty list has none to bound)
            given = min(given, default=low[0] if low is not None else 0)
        if low is not None and given < low[0]:
            raise SpecError(f"{key}={value!r}: must be >= {low[0]}{low[1]}")
    spec = replace(SynthSpec(), **kwargs)
    _check_heads(spec)
    _check_layer(spec)
    return spec


def _check_layer(spec: SynthSpec) -> None:
    """What the layer keys need of each other (the trace validator would refuse the result)."""
    if spec.window_right >= 0 and spec.causal == 1:
        raise SpecError(f"window_right={spec.window_right}: a causal layer sees no key after the query; give causal=0 (or leave causal out)")
    for key in ("k_scale", "v_scale"):
        value = getattr(spec, key)
        if value <= 0:
            raise SpecError(f"{key}={value}: must be > 0")
        if value != 1.0 and not (spec.kv_dtype or spec.dtype).startswith("float8"):
            raise SpecError(f"{key}={value}: engines scale only an fp8 KV cache; add kv_dtype=float8_e4m3fn")
    if spec.cross and spec.mode not in ("decode", "extend", "mixed"):
        raise SpecError(f"cross=1: cross-attention steps are decode, extend or mixed, not mode={spec.mode}")
    if spec.mode == "verify" and spec.causal == 0:
        raise SpecError("causal=0: a verify step attends by its draft tree")
    bad = next((i for i in spec.empty if i >= spec.states), None)
    if bad is not None:
        raise SpecError(f"empty={','.join(map(str, spec.empty))}: state {bad} is not one of the {spec.states} states (0 to {spec.states - 1})")
    if spec.row_mask and spec.states != 2:
        raise SpecError(f"row_mask=1: merge_state_in_place merges two states; this merge has states={spec.states}")
    if spec.parents and spec.parents[0] != -1:
        raise SpecError(f"parents={','.join(map(str, spec.parents))}: the root (first) has parent -1")
    if any(not 0 <= p < i for i, p in enumerate(spec.parents) if i > 0):
        first = next(i for i, p in enumerate(spec.parents) if i > 0 and not 0 <= p < i)
        raise SpecError(f"parents: entry {first} is {spec.parents[first]}: a draft token's parent comes before it (in [0, {first}))")


def is_causal(spec: SynthSpec) -> bool:
    """The spec's causal flag: as given, else causal unless cross=1 or window_right makes it not."""
    if spec.causal >= 0:
        return bool(spec.causal)
    return not (spec.cross or spec.window_right >= 0)


def _check_heads(spec: SynthSpec) -> None:
    parts = spec.heads.split(":")
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        expected = "the query head count, e.g. 16" if spec.attention == MLA else "Q:KV, e.g. 32:8"
        raise SpecError(f"heads={spec.heads!r}: expected {expected}") from None
    if min(counts) < 1 or len(counts) > 2:
        raise SpecError(f"heads={spec.heads!r}: expected Q:KV head counts >= 1, e.g. 32:8")
    if spec.mode == "merge" and len(counts) == 1:
        return  # a merge's heads: the states' own, no KV heads
    if spec.attention == MHA and (len(counts) != 2 or counts[0] % counts[1]):
        raise SpecError(f"heads={spec.heads!r}: expected Q:KV with Q a multiple of KV (grouped-query attention), e.g. 32:8")


# What each key applies to: a key the user typed that the spec's mode or attention does not use
# is reported (`unused_keys`), not silently dropped.
_USED_BY = {
    "kv_lens": ("mode", ("decode", "selective")),
    "prefix_lens": ("mode", ("extend", "mixed", "verify")),
    "extend_lens": ("mode", ("extend", "mixed")),
    "topk": ("mode", ("verify",)),
    "steps": ("mode", ("verify",)),
    "draft_tokens": ("mode", ("verify",)),
    "mask_layout": ("mode", ("verify",)),
    "select": ("mode", ("selective",)),
    "parents": ("mode", ("verify",)),
    "extend_mask": ("mode", ("extend", "mixed")),
    "states": ("mode", ("merge",)),
    "tokens": ("mode", ("merge",)),
    "lse_base": ("mode", ("merge",)),
    "empty": ("mode", ("merge",)),
    "row_mask": ("mode", ("merge",)),
    "kv_lora_rank": ("attention", (MLA,)),
    "rope_dim": ("attention", (MLA,)),
    "head_dim": ("attention", (MHA,)),
    "v_head_dim": ("attention", (MHA,)),
}


def unused_keys(words: list[str] | tuple[str, ...]) -> list[str]:
    """Notes for `key=value` words that the resulting spec does not use, e.g.
    "prefix_lens: not used by mode=decode (used by mode=extend, mixed, verify)"."""
    spec = parse_spec(words)
    typed = [w.partition("=")[0] for w in words if "=" in w]
    notes = []
    for key in typed:
        if key in _USED_BY:
            field, users = _USED_BY[key]
            if getattr(spec, field) not in users:
                notes.append(f"{key}: not used by {field}={getattr(spec, field)} (used by {field}={', '.join(users)})")
        elif key in ("fill_value", "graph_mode") and not spec.capture_bs:
            notes.append(f"{key}: not used without capture_bs (the step is not a CUDA-graph replay)")
        elif key in ("topk", "steps", "draft_tokens") and spec.parents:
            notes.append(f"{key}: not used with parents= (the tree is given)")
    return notes


