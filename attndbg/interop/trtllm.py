"""`attndbg import trtllm cases_rank0.jsonl`: TensorRT-LLM attention capture lines as structure-only steps.

TensorRT-LLM's `TRTLLM_ATTN_CAPTURE_DIR` writes one line per attention layer call
(`tensorrt_llm/_torch/attention_backend/_capture.py`; interop.md §3): per request `seq_lens` (new
query tokens) and `num_cached_tokens`, `num_contexts` context requests first, heads, dtypes,
`sliding_window` (W keys: window_left = W - 1), `q_scaling` (scale = 1 / (q_scaling * sqrt(head_dim))),
`page_size`. No block table, no tensor: slots are laid out page after page from page 1, and the
step replays seeded data. Consecutive lines with the same batch are one step's layers: one step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from attndbg.interop.files import json_lines
from attndbg.interop.steps import StepParts, imported_source, make_trace, mha_model
from attndbg.trace.build import mode_from_lengths
from attndbg.trace.errors import TraceError, printable
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, Model, Trace

ENGINE = "tensorrt-llm"
# DeepSeek's latent widths, for an MLA line (the capture keeps no MLA dims, interop.md §3.1).
DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM = 512, 64
BATCH_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "seq_lens", "num_cached_tokens", "num_contexts", "dtype", "kv_dtype", "causal", "sliding_window", "q_scaling", "page_size", "is_mla")


def import_cases(path: Path) -> Iterator[Trace | str]:
    previous: tuple | None = None
    step = 0
    for number, line in json_lines(path):
        if not isinstance(line, dict):
            raise TraceError(f"line {number}", f"is a {type(line).__name__}, expected a capture object", str(path))
        key = tuple(repr(line.get(f)) for f in BATCH_FIELDS)
        if key == previous:
            continue  # the next layer of the same step
        previous = key
        reason = _unsupported(line)
        if reason:
            yield f"line {number}: not imported: {reason}"
            continue
        yield make_trace(_step(line, number, path, step), seed=step, path=path)
        step += 1


def _unsupported(line: dict[str, Any]) -> str | None:
    if line.get("causal") is False:
        return "non-causal attention (causal: false) has no attndbg step form"
    if line.get("seq_lens_kv") is not None:
        return "cross attention (seq_lens_kv) has no attndbg step form"
    if line.get("kv_dtype") == "nvfp4":
        return "an nvfp4 KV cache: attndbg replays float16/bfloat16/float32/float8 caches"
    return None


def _int(line: dict[str, Any], key: str, number: int, path: Path, *, low: int = 1, default: int | None = None) -> int:
    value = line.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 24:
        raise TraceError(f"line {number}.{key}", f"= {printable(repr(value), 60)}, expected an int >= {low}", str(path))
    return value


def _ints(line: dict[str, Any], key: str, number: int, path: Path, length: int | None = None) -> list[int]:
    value = line.get(key)
    if not isinstance(value, list) or len(value) > 1 << 16 or (length is not None and len(value) != length):
        want = f"a list of {length} ints" if length is not None else "a list of ints"
        raise TraceError(f"line {number}.{key}", f"= {printable(repr(value), 60)}, expected {want}", str(path))
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 24:
            raise TraceError(f"line {number}.{key}[{i}]", f"= {printable(repr(v), 60)}, expected a token count >= 0", str(path))
    return value


def _dtype(line: dict[str, Any], key: str, allowed: tuple[str, ...], number: int, path: Path) -> str:
    value = line.get(key)
    if value not in allowed:
        raise TraceError(f"line {number}.{key}", f"= {printable(repr(value), 60)}, attndbg replays {', '.join(allowed)}", str(path))
    return value


def _step(line: dict[str, Any], number: int, path: Path, step: int) -> StepParts:
    heads = _int(line, "num_heads", number, path)
    kv_heads = _int(line, "num_kv_heads", number, path)
    dim = _int(line, "head_dim", number, path)
    q_lens = _ints(line, "seq_lens", number, path)
    cached = _ints(line, "num_cached_tokens", number, path, len(q_lens))
    contexts = _int(line, "num_contexts", number, path, low=0)
    if contexts > len(q_lens):
        raise TraceError(f"line {number}.num_contexts", f"= {contexts}, the batch has {len(q_lens)} requests", str(path))
    ps = _int(line, "page_size", number, path) if line.get("cache", "paged") == "paged" else 1
    q_dtype = _dtype(line, "dtype", Q_DTYPES, number, path)
    kv_dtype = _dtype(line, "kv_dtype", tuple(DTYPES), number, path) if line.get("kv_dtype") is not None else q_dtype
    window = line.get("sliding_window")
    if window is not None:
        window = _int(line, "sliding_window", number, path) - 1  # W keys visible: k > pos - W
    scaling = line.get("q_scaling", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not (math.isfinite(scaling) and scaling > 0):
        raise TraceError(f"line {number}.q_scaling", f"= {printable(repr(scaling), 60)}, expected a positive number", str(path))
    inferred = {
        "batch.slot_ids": "the capture keeps no block table: each request's pages laid out one after another from page 1",
        "values": "the capture keeps no tensors: q and the KV are drawn from the trace's seed",
    }
    if line.get("is_mla"):
        rank = line.get("kv_lora_rank") or DEEPSEEK_KV_LORA_RANK
        rope = line.get("qk_rope_head_dim") or DEEPSEEK_ROPE_DIM
        if not line.get("kv_lora_rank"):
            inferred["model.kv_lora_rank"] = f"the capture keeps no MLA widths: DeepSeek's {DEEPSEEK_KV_LORA_RANK} latent + {DEEPSEEK_ROPE_DIM} rope"
        model = Model(num_qo_heads=heads, num_kv_heads=1, head_dim=rank + rope, v_head_dim=rank, attention=AttentionKind.MLA, kv_lora_rank=rank, qk_rope_head_dim=rope,
                      sm_scale=1 / (scaling * math.sqrt(dim)), logit_cap=0.0, sliding_window=-1 if window is None else window, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=ps)  # fmt: skip
    else:
        if heads % kv_heads:
            raise TraceError(f"line {number}.num_heads", f"= {heads} is not a multiple of num_kv_heads = {kv_heads}", str(path))
        model = mha_model(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=dim, v_head_dim=dim, sm_scale=1 / (scaling * math.sqrt(dim)), logit_cap=0.0,
                          window=-1 if window is None else window, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=ps)  # fmt: skip
    rows, page = [], 1  # page 0 is the dummy page
    for n, c in zip(q_lens, cached):
        pages = -(-(n + c) // ps)
        rows.append(torch.arange(page * ps, page * ps + n + c))
        page += pages
    # TensorRT-LLM orders context requests first; the mode follows from the lengths either way.
    mode = mode_from_lengths(q_lens, cached, path=str(path))
    return StepParts(
        source=imported_source(engine=ENGINE, version="capture", backend="trtllm", step=step), model=model, mode=mode,
        prefix_lens=list(cached), extend_lens=list(q_lens), rows=rows, kv_cache_size=page * ps, inferred=inferred,
    )  # fmt: skip
