"""`attndbg synth` specs: a preset name, then `key=value` overrides, seeded and reproducible.

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
}


# What a value of each type must look like, in the words a user typed it.
_EXPECTED = {tuple: "comma-separated integers, e.g. 1,33,20000", int: "an integer", float: "a number", bool: "0 or 1"}
# Keys with a closed set of values (checked here, so the error names the key the user typed).
_CHOICES = {
    "mode": ("decode", "extend", "mixed", "verify", "selective"),
    "attention": (MHA, MLA),
    "dtype": Q_DTYPE_NAMES,
    "kv_dtype": KV_DTYPE_NAMES,
    "mask_layout": ("full", "qlen_only", "qlen_only_bitpacked"),
}


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
        low = _AT_LEAST.get(key)
        if low is not None and (min(kwargs[key]) if isinstance(kwargs[key], tuple) and kwargs[key] else kwargs[key]) < low[0]:
            raise SpecError(f"{key}={value!r}: must be >= {low[0]}{low[1]}")
    spec = replace(SynthSpec(), **kwargs)
    _check_heads(spec)
    return spec


def _check_heads(spec: SynthSpec) -> None:
    parts = spec.heads.split(":")
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        expected = "the query head count, e.g. 16" if spec.attention == MLA else "Q:KV, e.g. 32:8"
        raise SpecError(f"heads={spec.heads!r}: expected {expected}") from None
    if min(counts) < 1 or len(counts) > 2:
        raise SpecError(f"heads={spec.heads!r}: expected Q:KV head counts >= 1, e.g. 32:8")
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
        elif key == "fill_value" and not spec.capture_bs:
            notes.append("fill_value: not used without capture_bs (the step is not a CUDA-graph replay)")
    return notes


