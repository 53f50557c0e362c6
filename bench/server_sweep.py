"""Server-shaped clean recordings, correct by construction, and `attndbg check` over them.

    python bench/server_sweep.py make -o DIR --steps 1000 --seed 0 [--jobs N]
    python bench/server_sweep.py run DIR --backend triton,flashinfer,fa3,mla [--cuda-graph] [--jobs auto] --json OUT.json
    python bench/server_sweep.py all --steps 1000 --out-dir OUT [--seed 0]     # make + run eager + run --cuda-graph + OUT/server_sweep.md
    python bench/server_sweep.py all ... --slice-steps 100 --timeout 540        # resumable: each call checks the slices not yet checked

`make` writes a recording (`manifest.jsonl` + one `step_NNNNNN.pt` per step, through
`attndbg.trace.io.append_to_recording` as `attndbg record` writes them) of the steps an SGLang server
(EAGLE + CUDA graphs + chunked prefill) and a vLLM server (FULL CUDA graphs) run. No step holds
tensors: replay draws q/k/v from each step's seed, as `check_scale.py`'s recording does. Every step
is what a correct engine describes: the batch from `attndbg.trace.synth` (a synth spec per step),
the engine's plan as the step's engine backend builds it (the adapter's `derive_plan`, which is what
`replay.plans.with_engine_plan` attaches, given the graph's padding on graph replays), SGLang's
graph padding from synth (`capture_bs`), vLLM's steps through the vLLM recorder's own converter
(`attndbg.record.vllm.adapter.trace_from_host`) from the `CommonAttentionMetadata` vLLM's runner
fills. The same seed gives the same bytes (drawn in one process, built in any number of workers).

Distributions (per step, drawn independently from `random.Random(seed)`):

  mode      52 % DECODE, graph-padded (of which 15 % MLA decode, 35 % of the MHA decodes vLLM's);
            20 % TARGET_VERIFY, graph-padded (SGLang EAGLE);
            18 % EXTEND (chunked prefill, eager); 10 % MIXED (one or two prefill chunks + decode rows, eager)
  batch     decode: 1-64 requests (40 % 1-8, 35 % 9-32, 25 % 33-64); verify: 1-32 (40 % 1-4, 35 % 5-16, 25 % 17-32);
            extend: 1 request (50 %), 2-4 (35 %), 5-8 (15 %); mixed: 1 chunk (80 %) or 2, + 1-32 decode rows
  KV        decode KV and verify prefix per request: 1-8192, half uniform, half log-uniform
            (short requests are common); extend/mixed-chunk prefix: 0 (35 %), else 1-4096 (75 %) or
            4097-8192 (25 %); the tokens of one extend/mixed step's chunks sum to at most 2048
            (SGLang's chunked_prefill_size), split at random among the chunk requests
  radix     30 % of the steps share a KV prefix among their requests (synth `shared_prefix`, whole pages)
  models    32:8 d128 (30 %), 32:4 d128 (12 %), 64:8 d128 (15 %), 16:16 d128 MHA (10 %), 16:16 d64 (5 %),
            32:8 d64 (5 %), 16:8 d256 soft-cap 50 (Gemma-2 global layer, 7 %), 16:8 d256 soft-cap 50
            window 4095 (Gemma-2 local layer, 7 %), 32:8 d128 window 4095 (Mistral, 5 %), 8:4 d256 window
            1023 (Gemma-3 local layer, 4 %): sliding windows on 16 %, soft-cap on 14 % of MHA steps
  MLA       kv_lora_rank 512, rope 64, 16 (60 %) or 128 (40 %) query heads; SGLang's flashmla (page 64,
            40 %), flashinfer_mla (page 1, 30 %) or triton (page 1, 30 %)
  dtype     bf16 (85 %), fp16 (15 %); KV in the same dtype
  backend   SGLang: triton / flashinfer / fa3 in a random order per step, the first whose adapter
            supports the step (an engine never runs a backend that cannot take the step); page 1, or
            page 16 on 30 % of triton and fa3 steps (SGLang's FlashInfer backend is token-level, page 1).
            vLLM decode: FLASHINFER / FLASH_ATTN / TRITON_ATTN (one third each), block size 16
  verify    SGLang EAGLE trees (FULL mask layout, as SGLang's GPU backends build it): topk 4 steps 3
            draft 8 (45 %), chain topk 1 steps 3 draft 4 (30 %), chain topk 1 steps 5 draft 6 (10 %),
            topk 8 steps 4 draft 16 (15 %)
  graphs    SGLang: padded to the next capture size, seq_len fill 1, padded req_pool_indices,
            out_cache_loc and positions 0 (SGL-new's registry), capture sizes [1,2,4,8,12] +
            range(16, 161, 8) (decode, cuda_graph_max_bs 160) and range(1, 9) + range(10, 33, 2) +
            range(40, 65, 4) (EAGLE verify, max bs 64); the plan covers the padded rows; `capture`
            holds max_bs, max_num_tokens (and max_kv_splits 8 for Triton).
            vLLM: FULL-graph decode padded to [1, 2, 4] + range(8, 513, 8) (max_num_seqs 256):
            padded rows seq_len 0, query_len 0 (query_start_loc's tail repeats), block-table rows
            NULL_BLOCK 0, slot_mapping -1, positions stale; the builder's metadata as vLLM's
            TRITON_ATTN / FLASH_ATTN / FLASHINFER builders hold it (index tensors; no data pointers)

With --layer-kinds (off by default: without it the recording is byte-identical to one made
before the flag existed; with it, every other step is too, its draws coming from a second RNG):

  sinks     10 % of SGLang's MHA steps are gpt-oss layers: 64:8 d64, a learned sink per query head,
            a 128-token window on half of them (none on verify steps: SGLang runs windowed verify
            on no backend here)
  fp8 KV    10 % of SGLang's MHA steps keep their model with an fp8 e4m3 cache and per-layer
            k_scale / v_scale in [0.25, 2] (SGLang's --kv-cache-dtype fp8_e4m3 with checkpoint scales)

Not modelled: vLLM verify and vLLM eager/extend steps, draft-model steps (DRAFT_EXTEND, draft
decode), fp8 KV without --layer-kinds, MLA extend/verify, encoder-decoder. `run` prints, from check's JSON, the steps
with findings by class/check (and severity where findings carry one), the steps not checked with
their reasons, backend crashes, wall time, ms/step, and the first 3 steps of each finding with
their shapes.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

# -- distributions -----------------------------------------------------------------------------------

MODES = (("decode", 0.52), ("verify", 0.20), ("extend", 0.18), ("mixed", 0.10))
MLA_SHARE_OF_DECODE = 0.15
VLLM_SHARE_OF_MHA_DECODE = 0.35
FP16_SHARE = 0.15
SHARED_PREFIX_SHARE = 0.30
MAX_KV = 8192
MAX_DECODE_BS = 64
MAX_VERIFY_BS = 32
CHUNKED_PREFILL_SIZE = 2048  # SGLang's chunked_prefill_size: a step's chunk tokens at most


@dataclass(frozen=True)
class ModelProfile:
    name: str
    heads: str
    head_dim: int
    window: int = -1  # window_left
    logit_cap: float = 0.0


MODELS = (
    (ModelProfile("llama-8b", "32:8", 128), 0.30),
    (ModelProfile("gqa-32:4", "32:4", 128), 0.12),
    (ModelProfile("llama-70b", "64:8", 128), 0.15),
    (ModelProfile("mha-d128", "16:16", 128), 0.10),
    (ModelProfile("mha-d64", "16:16", 64), 0.05),
    (ModelProfile("gqa-d64", "32:8", 64), 0.05),
    (ModelProfile("gemma2-global", "16:8", 256, logit_cap=50.0), 0.07),
    (ModelProfile("gemma2-local", "16:8", 256, window=4095, logit_cap=50.0), 0.07),
    (ModelProfile("mistral-swa", "32:8", 128, window=4095), 0.05),
    (ModelProfile("gemma3-local", "8:4", 256, window=1023), 0.04),
)
# (topk, steps, draft_tokens): SGLang's EAGLE defaults and chains.
TREES = (((4, 3, 8), 0.45), ((1, 3, 4), 0.30), ((1, 5, 6), 0.10), ((8, 4, 16), 0.15))
MLA_BACKENDS = (("flashmla", 0.40), ("flashinfer_mla", 0.30), ("triton", 0.30))
MLA_PAGE = {"flashmla": 64, "flashinfer_mla": 1, "triton": 1}  # FlashMLA's 64-token blocks (engines.md A4.4)
SGLANG_BACKENDS = ("triton", "flashinfer", "fa3")
PAGED_SHARE = 0.30  # of triton and fa3 steps: page 16
VLLM_BACKENDS = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN")
VLLM_BLOCK = 16
# Capture sizes (engines.md A5, B5).
SGLANG_DECODE_CAPTURE = [1, 2, 4, 8, 12] + list(range(16, 161, 8))
SGLANG_VERIFY_CAPTURE = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
VLLM_CAPTURE = [1, 2, 4] + list(range(8, 513, 8))
VLLM_MAX_NUM_SEQS = 256
TRITON_MAX_KV_SPLITS = 8  # SGLang's triton_attention_num_kv_splits default
ENGINE_VERSION = "server_sweep"  # no engine ran: the steps are what a correct one describes


def _weighted(rng: random.Random, table):
    x, acc = rng.random(), 0.0
    for value, weight in table:
        acc += weight
        if x < acc:
            return value
    return table[-1][0]


def _batch_size(rng: random.Random, cap: int) -> int:
    """1..cap, skewed to small batches: 40 % in 1..cap/8, 35 % up to cap/2, 25 % above."""
    low, high = _weighted(rng, (((1, cap // 8), 0.40), ((cap // 8 + 1, cap // 2), 0.35), ((cap // 2 + 1, cap), 0.25)))
    return rng.randint(low, high)


def _kv_len(rng: random.Random, low: int = 1) -> int:
    if rng.random() < 0.5:
        return rng.randint(low, MAX_KV)
    return max(low, min(MAX_KV, int(math.exp(rng.uniform(0.0, math.log(MAX_KV))))))


def _chunk_prefix(rng: random.Random) -> int:
    if rng.random() < 0.35:
        return 0
    return rng.randint(1, 4096) if rng.random() < 0.75 else rng.randint(4097, MAX_KV)


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` tokens in `parts` positive pieces, cut at random."""
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def _capture_bs(sizes: list[int], bs: int) -> int:
    return sizes[bisect.bisect_left(sizes, bs)]


# -- one step's draw ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepDraw:
    """Everything a worker needs to build step `step`: drawn in the parent, so the recording does
    not depend on the number of workers."""

    step: int
    engine: str  # "sglang" | "vllm"
    mode: str  # decode | verify | extend | mixed
    words: tuple[str, ...]  # the synth spec (capture_bs included for SGLang graph steps)
    backends: tuple[str, ...]  # engine backends to try, in order: the first that supports the step runs it
    capture_sizes: tuple[int, ...] = ()  # graph steps: the engine's capture sizes
    capture_bs: int = 0
    model: str = ""
    mla: bool = False


def draw_step(rng: random.Random, step: int, seed: int) -> StepDraw:
    mode = _weighted(rng, MODES)
    dtype = "float16" if rng.random() < FP16_SHARE else "bfloat16"
    step_seed = seed * 1_000_003 + step
    shared = rng.random() < SHARED_PREFIX_SHARE
    if mode == "decode" and rng.random() < MLA_SHARE_OF_DECODE:
        backend = _weighted(rng, MLA_BACKENDS)
        bs = _batch_size(rng, MAX_DECODE_BS)
        kv = [_kv_len(rng) for _ in range(bs)]
        capture = _capture_bs(SGLANG_DECODE_CAPTURE, bs)
        heads = "16" if rng.random() < 0.6 else "128"
        words = (
            "mla-decode", f"heads={heads}", f"kv_lens={_csv(kv)}", f"page_size={MLA_PAGE[backend]}", f"dtype={dtype}",
            f"shared_prefix={rng.randint(1, min(kv)) if shared else 0}", f"capture_bs={capture}", "fill_value=1", f"seed={step_seed}",
        )  # fmt: skip
        return StepDraw(step, "sglang", mode, words, (backend,), tuple(SGLANG_DECODE_CAPTURE), capture, f"mla-{heads}", True)
    profile = _weighted(rng, MODELS)
    model_words = (f"heads={profile.heads}", f"head_dim={profile.head_dim}", f"window={profile.window}", f"logit_cap={profile.logit_cap}", f"dtype={dtype}")
    order = list(SGLANG_BACKENDS)
    rng.shuffle(order)
    paged = rng.random() < PAGED_SHARE
    if mode == "decode":
        bs = _batch_size(rng, MAX_DECODE_BS)
        kv = [_kv_len(rng) for _ in range(bs)]
        sp = f"shared_prefix={rng.randint(1, min(kv)) if shared else 0}"
        if rng.random() < VLLM_SHARE_OF_MHA_DECODE:
            capture = _capture_bs(VLLM_CAPTURE, bs)
            words = ("decode-gqa", *model_words, f"kv_lens={_csv(kv)}", f"page_size={VLLM_BLOCK}", sp, f"seed={step_seed}")
            return StepDraw(step, "vllm", mode, words, (rng.choice(VLLM_BACKENDS),), tuple(VLLM_CAPTURE), capture, profile.name)
        capture = _capture_bs(SGLANG_DECODE_CAPTURE, bs)
        words = ("decode-gqa", *model_words, f"kv_lens={_csv(kv)}", sp, f"capture_bs={capture}", "fill_value=1", f"seed={step_seed}")
        return _sglang(step, mode, words, order, paged, SGLANG_DECODE_CAPTURE, capture, profile.name)
    if mode == "verify":
        bs = _batch_size(rng, MAX_VERIFY_BS)
        prefix = [_kv_len(rng) for _ in range(bs)]
        topk, steps, draft = _weighted(rng, TREES)
        capture = _capture_bs(SGLANG_VERIFY_CAPTURE, bs)
        words = (
            "verify", *model_words, f"prefix_lens={_csv(prefix)}", f"topk={topk}", f"steps={steps}", f"draft_tokens={draft}",
            "mask_layout=full", f"shared_prefix={rng.randint(1, min(prefix)) if shared else 0}", f"capture_bs={capture}", "fill_value=1",
            f"seed={step_seed}",
        )  # fmt: skip
        return _sglang(step, mode, words, order, paged, SGLANG_VERIFY_CAPTURE, capture, profile.name)
    if mode == "extend":
        low, high = _weighted(rng, (((1, 1), 0.50), ((2, 4), 0.35), ((5, 8), 0.15)))
        bs = rng.randint(low, high)
        extend = _split(rng, rng.randint(bs, CHUNKED_PREFILL_SIZE), bs)
        prefix = [_chunk_prefix(rng) for _ in range(bs)]
    else:  # mixed: prefill chunks first, then the running decodes (SGLang's mix_with_running)
        chunks = 1 if rng.random() < 0.8 else 2
        decodes = rng.randint(1, 32)
        extend = _split(rng, rng.randint(chunks, CHUNKED_PREFILL_SIZE - decodes), chunks) + [1] * decodes
        prefix = [_chunk_prefix(rng) for _ in range(chunks)] + [_kv_len(rng, low=2) - 1 for _ in range(decodes)]
    cached = [p for p in prefix if p > 0]
    sp = f"shared_prefix={rng.randint(1, min(cached)) if shared and len(cached) == len(prefix) else 0}"
    words = ("extend-prefix" if mode == "extend" else "mixed", *model_words, f"prefix_lens={_csv(prefix)}", f"extend_lens={_csv(extend)}", sp, f"seed={step_seed}")
    return _sglang(step, mode, words, order, paged, [], 0, profile.name)


def _sglang(step: int, mode: str, words: tuple[str, ...], order: list[str], paged: bool, sizes: list[int], capture: int, model: str) -> StepDraw:
    # SGLang's FlashInfer backend is token-level (page 1); Triton and FA3 take pages too.
    backends = tuple(f"{b}@{16 if paged and b != 'flashinfer' else 1}" for b in order)
    return StepDraw(step, "sglang", mode, words, backends, tuple(sizes), capture, model)


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


# --layer-kinds: shares of SGLang's MHA steps (drawn from their own RNG, after the step's own draws).
SINK_SHARE = 0.10
FP8_SCALED_SHARE = 0.10
GPT_OSS_WORDS = ("heads=64:8", "head_dim=64", "logit_cap=0.0", "sinks=1")
GPT_OSS_WINDOW = 127  # gpt-oss's 128-token sliding window (window_left counts the keys before the query)


def draw_all(steps: int, seed: int, *, layer_kinds: bool = False) -> list[StepDraw]:
    rng = random.Random(seed)
    draws = [draw_step(rng, step, seed) for step in range(steps)]
    if not layer_kinds:
        return draws
    kinds = random.Random(f"layer-kinds/{seed}")  # its own stream: the steps' own draws stay as they were
    return [_with_layer_kind(kinds, draw) for draw in draws]


def _with_layer_kind(rng: random.Random, draw: StepDraw) -> StepDraw:
    """Some of SGLang's MHA steps become gpt-oss layers (sinks) or run an fp8 cache with scales."""
    x, window, k_scale, v_scale = rng.random(), rng.random() < 0.5, rng.uniform(0.25, 2.0), rng.uniform(0.25, 2.0)
    if draw.engine != "sglang" or draw.mla:
        return draw
    if x < SINK_SHARE:
        windowed = window and draw.mode != "verify"
        words = (*draw.words, *GPT_OSS_WORDS, f"window={GPT_OSS_WINDOW if windowed else -1}")
        return replace(draw, words=words, model="gpt-oss" + ("-swa" if windowed else ""))
    if x < SINK_SHARE + FP8_SCALED_SHARE:
        words = (*draw.words, "kv_dtype=float8_e4m3fn", f"k_scale={k_scale:.4f}", f"v_scale={v_scale:.4f}")
        return replace(draw, words=words, model=f"{draw.model}-fp8")
    return draw


# -- building a step (in a worker) -------------------------------------------------------------------


def _adapter(engine_backend: str, attention_mla: bool):
    """The adapter that builds `engine_backend`'s plan (SGLang's names)."""
    from attndbg.backends import registry

    if attention_mla and engine_backend in ("flashmla", "flashinfer_mla"):
        from attndbg.backends.mla import MLABackend, MLAImpl, MLAOptions

        return MLABackend(MLAOptions(impl=MLAImpl.FLASHMLA if engine_backend == "flashmla" else MLAImpl.FLASHINFER))
    return registry.create(engine_backend)


def build_step(draw: StepDraw):
    """The Trace of one drawn step (SGLang: synth batch + graph, the backend's plan; vLLM: through
    the vLLM recorder's converter). Returns (trace, note): note names why the step has no plan."""
    from attndbg.trace import synth

    base = synth.build(synth.parse_spec(list(draw.words)))
    if draw.engine == "vllm":
        return _vllm_step(draw, base), ""
    reasons = []
    for choice in draw.backends:
        name, _, page = choice.partition("@")
        trace = base
        if page and int(page) != base.model.page_size:
            trace = synth.build(synth.parse_spec([*draw.words, f"page_size={page}"]))
        trace = _sglang_source(trace, draw, name)
        adapter = _adapter(name, draw.mla)
        reason = adapter.unsupported_reason(trace)
        if reason:
            reasons.append(f"{name}: {reason}")
            continue
        return _with_plan(trace, adapter, draw, name), ""
    return _sglang_source(base, draw, draw.backends[-1].partition("@")[0]), "; ".join(reasons)


def _sglang_source(trace, draw: StepDraw, backend: str):
    return replace(trace, source=replace(trace.source, engine="sglang", engine_version=ENGINE_VERSION, backend=backend, step=draw.step))


def _with_plan(trace, adapter, draw: StepDraw, backend: str):
    from attndbg.backends.base import Padding
    from attndbg.replay.plans import with_engine_plan
    from attndbg.trace.schema import CaptureSizes

    if trace.graph is None:
        if backend in ("triton", "flashinfer", "fa3"):
            return with_engine_plan(trace)  # the registry's adapter, as `attndbg synth` attaches it
        return replace(trace, plan=adapter.derive_plan(trace))
    # A graph replay: the engine's backend planned the padded batch (SGLang re-plans [:bs] of the
    # captured buffers, padded rows at seq_len fill 1 and slot 0).
    plan = adapter.derive_plan(trace, Padding(capture_bs=trace.graph.capture_bs, fill_value=trace.graph.fill_value))
    per_req = int(trace.batch.extend_lens[0])
    capture = CaptureSizes(
        max_bs=max(draw.capture_sizes),
        max_num_tokens=max(draw.capture_sizes) * per_req,
        max_kv_splits=TRITON_MAX_KV_SPLITS if backend == "triton" else None,
    )
    return replace(trace, plan=plan, capture=capture)


def _vllm_step(draw: StepDraw, base):
    """A vLLM FULL-graph decode step as vLLM's runner pads it, recorded through the vLLM adapter's
    own writer path (`trace_from_host`): the CommonAttentionMetadata and the builder's metadata."""
    import torch

    from attndbg.record.vllm.adapter import _Static, trace_from_host
    from attndbg.record.vllm.fields import common_parts
    from attndbg.record.vllm.plan import plan_parts
    from attndbg.trace.schema import CaptureSizes

    batch, block = base.batch, base.model.page_size
    n, rows = batch.batch_size, draw.capture_bs
    pad = rows - n
    kv = batch.kv_lens.tolist()
    width = -(-MAX_KV // block)  # the persistent table: cdiv(max_model_len, block_size) columns
    table = torch.zeros(rows, width, dtype=torch.int32)  # padded rows: NULL_BLOCK_ID 0
    for b in range(n):
        pages = batch.request_slots(b)[::block] // block
        table[b, : pages.numel()] = pages.to(torch.int32)
    qsl = torch.cat([torch.arange(n + 1), torch.full((pad,), n)]).to(torch.int32)  # padded rows: query_len 0
    seq = torch.cat([batch.kv_lens, torch.zeros(pad, dtype=torch.int64)]).to(torch.int32)  # seq_lens[num_reqs:] = 0
    slots = torch.cat([batch.out_cache_loc, torch.full((pad,), -1, dtype=torch.int64)])  # slot_mapping tail -1
    # positions' padded tail is stale (whatever earlier, larger batches left there).
    stale = torch.randint(0, MAX_KV, (pad,), generator=torch.Generator().manual_seed(base.seed))
    positions = torch.cat([batch.positions, stale])
    cm = SimpleNamespace(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=rows, num_actual_tokens=rows,
        max_query_len=1, max_seq_len=max(kv), block_table_tensor=table, slot_mapping=slots, causal=True,
        positions=positions, is_prefilling=torch.zeros(rows, dtype=torch.bool),
    )  # fmt: skip
    shared = dict(num_actual_tokens=rows, slot_mapping=slots, max_seq_len=max(kv), seq_lens=seq, use_cascade=False)
    if draw.backends[0] == "FLASHINFER":
        metadata = SimpleNamespace(
            **shared, max_q_len=1, block_table_tensor=table, num_decodes=rows, num_decode_tokens=rows, num_prefills=0, num_prefill_tokens=0
        )
    else:  # TritonAttentionMetadata / FlashAttentionMetadata pass the common fields through
        metadata = SimpleNamespace(**shared, max_query_len=1, query_start_loc=qsl, block_table=table, common_prefix_len=0)
        if draw.backends[0] == "FLASH_ATTN":
            metadata.causal = True
            # FA3's ahead-of-time schedule under a FULL graph: vLLM's persistent scheduler_metadata
            # buffer (FA3's size, 1 + round_up(rows, 4) * 4; its contents are FA3's, made on the GPU)
            # and the split bound the capture sized for (VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH).
            metadata.scheduler_metadata = torch.zeros(1 + -(-rows // 4) * 4 * 4, dtype=torch.int32)
            metadata.max_num_splits = 16
    # No data pointers: these tensors are not the engine's persistent buffers (a real recording's
    # pointers stay put across replays; made-up ones would either move or mean nothing).
    plan_tensors, plan_scalars = plan_parts(metadata, block_size=block, max_seq_len=max(kv), pointers=False)
    common_tensors, common_scalars = common_parts(cm, block)
    static = _Static(
        model=base.model,
        backend=draw.backends[0],
        device=torch.device("cpu"),
        tp_rank=0,
        kv_cache_size=batch.kv_cache_size,
        speculation=None,
        scalars={
            **plan_scalars,
            **{f"common.{k}": v for k, v in common_scalars.items()},
            "vllm.call": "build",
            "vllm.num_reqs": rows,
            "vllm.num_actual_tokens": rows,
            "vllm.max_query_len": 1,
            "vllm.max_seq_len": max(kv),
            "vllm.num_gpu_blocks": batch.kv_cache_size // block,
        },
        capture=CaptureSizes(max_bs=VLLM_MAX_NUM_SEQS, max_num_tokens=max(draw.capture_sizes), block_table_width=width),
    )
    host = {**{f"cm.{k}": v for k, v in common_tensors.items()}, **{f"plan.{k}": v for k, v in plan_tensors.items()}}
    trace = trace_from_host(host, static=static, step=draw.step)
    return replace(trace, seed=base.seed, source=replace(trace.source, engine_version=ENGINE_VERSION, device="any", attndbg_version=base.source.attndbg_version))


def shape_of(draw: StepDraw, trace, note: str) -> dict:
    """What the summary prints of a step: mode, engine/backend, batch, lengths, layout."""
    b, m = trace.batch, trace.model
    return {
        "step": draw.step,
        "mode": draw.mode + ("-mla" if draw.mla else ""),
        "engine": draw.engine,
        "backend": trace.source.backend,
        "bs": b.batch_size,
        "prefix": b.prefix_lens.tolist(),
        "extend": b.extend_lens.tolist(),
        "page": m.page_size,
        "heads": f"{m.num_qo_heads}:{m.num_kv_heads}",
        "head_dim": m.head_dim,
        "dtype": m.q_dtype,
        "window": m.sliding_window,
        "logit_cap": m.logit_cap,
        # --layer-kinds only (absent otherwise, so the default shapes file is as it was):
        **({"sinks": True} if m.sinks is not None else {}),
        **({"kv_dtype": m.kv_dtype, "k_scale": m.k_scale, "v_scale": m.v_scale} if (m.k_scale, m.v_scale) != (1.0, 1.0) else {}),
        "capture_bs": trace.graph.capture_bs if trace.graph else 0,
        "tree": f"topk{trace.spec.topk}/steps{trace.spec.steps}/n{trace.spec.draft_token_num}" if trace.spec else "",
        "model": draw.model,
        "no_plan": note,
    }


def _build_block(args: tuple[str, list[StepDraw]]) -> list[dict]:
    directory, draws = args
    import torch

    from attndbg.trace import io

    torch.set_num_threads(1)  # one process per core
    shapes = []
    for draw in draws:
        trace, note = build_step(draw)
        file = f"step_{draw.step:06d}.pt"
        _save(trace, Path(directory) / file)
        shapes.append({**shape_of(draw, trace, note), "manifest": io.manifest_entry(trace, file).__dict__})
    return shapes


def _save(trace, path: Path) -> None:
    """`io.save` (validated by a round trip through the loader, written atomically) with every
    string interned: pickle memoizes objects by identity, so without it the bytes would depend on
    whether two equal strings were made in this process or unpickled from the parent."""
    from attndbg.atomic import torch_save_atomically
    from attndbg.trace.schema import to_dict
    from attndbg.trace.validate import from_dict

    data = _interned(to_dict(trace))
    from_dict(data)
    torch_save_atomically(data, path)


def _interned(value):
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, dict):
        return {_interned(k): _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_interned(v) for v in value)
    return value


# -- make --------------------------------------------------------------------------------------------

SHAPES = "server_sweep_steps.jsonl"  # beside the manifest: each step's shape, for the summary
PARAMS = "server_sweep.json"


def _params(steps: int, seed: int, layer_kinds: bool = False) -> dict:
    """What a recording was made from: `all` reuses one only when these match (this file included)."""
    import hashlib

    params = {"steps": steps, "seed": seed, "generator_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}
    return {**params, "layer_kinds": True} if layer_kinds else params


def make(out: Path, steps: int, seed: int, jobs: int, progress: bool = True, *, layer_kinds: bool = False) -> float:
    """Write the recording; returns seconds. Steps are drawn here and built in `jobs` processes;
    the manifest is written in step order, so the bytes do not depend on `jobs`."""
    from attndbg.trace import io

    start = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    draws = draw_all(steps, seed, layer_kinds=layer_kinds)
    blocks = [draws[i : i + 25] for i in range(0, steps, 25)]
    shapes: list[dict] = []
    if jobs <= 1:
        results = map(_build_block, [(str(out), blk) for blk in blocks])
        pool = None
    else:
        pool = ProcessPoolExecutor(jobs)
        results = pool.map(_build_block, [(str(out), blk) for blk in blocks])
    try:
        for part in results:
            shapes.extend(part)
            if progress:
                print(f"  made {len(shapes)}/{steps} steps ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    with open(out / io.MANIFEST, "w", encoding="utf-8") as manifest:
        for shape in shapes:
            manifest.write(json.dumps(shape.pop("manifest")) + "\n")
    with open(out / SHAPES, "w", encoding="utf-8") as f:
        for shape in shapes:
            f.write(json.dumps(shape) + "\n")
    (out / PARAMS).write_text(json.dumps(_params(steps, seed, layer_kinds)) + "\n")
    return time.perf_counter() - start

# -- run ---------------------------------------------------------------------------------------------


def run_check(rec: Path, backends: str, *, cuda_graph: bool, jobs: str | None, json_out: Path, log: Path, extra: list[str] = (), timeout: float = 0) -> dict:
    """`attndbg check REC --backend B [--cuda-graph] [--jobs J] --json OUT` in a fresh process (its
    own crash boundary); stdout and stderr go to `log`, a heartbeat every 30 s to ours."""
    command = [sys.executable, "-m", "attndbg", "check", str(rec), "--backend", backends, "--json", str(json_out), *extra]
    if cuda_graph:
        command.append("--cuda-graph")
    if jobs:
        command += ["--jobs", jobs]
    label = "graph" if cuda_graph else "eager"
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.unlink(missing_ok=True)  # a JSON left by an earlier run must not pass for this one's
    print(f"[{label}] {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        # Its own process group: on a timeout the check and the workers it started go together.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(30):
                print(f"[{label}] still checking: {time.perf_counter() - start:.0f} s (log: {log})", flush=True)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            code = proc.wait(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (the check and its workers)
            proc.wait()
            code = -9
            print(f"[{label}] timed out after {timeout:.0f} s: killed (no JSON)", flush=True)
        finally:
            done.set()
    seconds = time.perf_counter() - start
    print(f"[{label}] exit {code} after {seconds:.1f} s", flush=True)
    return {"label": label, "command": command[1:], "exit": code, "seconds": round(seconds, 2), "log": str(log)}


def run_sliced(rec: Path, backends: str, *, cuda_graph: bool, jobs: str | None, json_out: Path, slice_steps: int, extra: list[str] = (), timeout: float = 0) -> dict:
    """`run_check` over slices of `slice_steps` steps (check `--steps A:B`), each with its own JSON
    beside `json_out` (`<stem>.steps-A-B.json`). A slice whose JSON exists is not run again and the
    slices share one `timeout`, so a call stopped by a device's time limit (the first checks of the
    server mix spend minutes compiling FlashInfer) loses one slice at most, and the next call with
    the same arguments resumes. The parts present are merged into `json_out`."""
    total = sum(1 for _ in open(rec / "manifest.jsonl", encoding="utf-8"))
    label = "graph" if cuda_graph else "eager"
    start = time.perf_counter()
    runs: list[dict] = []
    for a in range(0, total, slice_steps):
        b = min(total, a + slice_steps)
        part = json_out.with_name(f"{json_out.stem}.steps-{a:06d}-{b:06d}.json")
        if part.exists():
            continue
        left = timeout - (time.perf_counter() - start) if timeout else 0
        if timeout and left <= 1:
            break
        runs.append(run_check(rec, backends, cuda_graph=cuda_graph, jobs=jobs, json_out=part, log=part.with_suffix(".log"), extra=[*extra, f"--steps={a}:{b}"], timeout=left))
        if runs[-1]["exit"] == -9:
            break
    parts = sorted(json_out.parent.glob(f"{json_out.stem}.steps-*.json"))
    merged = _merge_parts([json.loads(p.read_text()) for p in parts])
    json_out.write_text(json.dumps(merged) + "\n")
    slices = -(-total // slice_steps)
    return {
        "label": label,
        "command": [*(runs[0]["command"] if runs else ["(every slice already checked)"]), f"(in slices of {slice_steps} steps)"],
        "exit": max((r["exit"] for r in runs), default=0, key=lambda code: (code < 0, abs(code))),
        "seconds": round(sum(r["seconds"] for r in runs), 2),
        "log": runs[-1]["log"] if runs else "",
        "slices": f"{len(parts)} of {slices} slices of {slice_steps} steps checked, {len(runs)} of them by this call (its wall time and ms/step)"
        + ("" if len(parts) == slices else "; the rest were not run (time): run the same command again to resume"),
    }


def _merge_parts(parts: list[dict]) -> dict:
    """Check JSONs of disjoint step slices as one: steps in order, findings summed, each slice's
    verdict line kept, and the verdicts' per-backend tables as counts."""
    verdicts = [p.get("verdict") or {} for p in parts]

    def counts(key: str) -> dict[str, int]:
        total: Counter = Counter()
        for v in verdicts:
            for name, value in (v.get(key) or {}).items():
                total[name] += len(value) if isinstance(value, list) else int(value) if isinstance(value, (int, float)) else 1
        return dict(total)

    return {
        "steps": [step for p in parts for step in p.get("steps", [])],
        "total_findings": sum(int(p.get("total_findings") or 0) for p in parts),
        "verdict": {
            "line": " | ".join(v.get("line", "") for v in verdicts),
            "compared": counts("compared"),
            "skipped": counts("skipped"),
            "plans_unread": counts("plans_unread"),
        },
    }


def _severity(finding: dict) -> str:
    return str(finding.get("severity") or "")


def kernels_by_mode(steps: list[dict]) -> list[str]:
    """Markdown: per forward mode, the steps checked, those on which no kernel was compared with
    the float64 reference (check's not_compared_by_mode), and the steps each backend was compared on."""
    checked = [s for s in steps if s.get("checked", True)]
    names = sorted({b for s in checked for b in s.get("backends") or []})
    lines = ["Kernels compared with the float64 reference, per mode (steps):", "", f"| mode | checked | no kernel compared | {' | '.join(names)} |", "|---" * (3 + len(names)) + "|"]
    for mode in sorted({s["mode"] for s in checked}):
        here = [s for s in checked if s["mode"] == mode]
        counts = [str(sum(1 for s in here if name in (s.get("backends") or []))) for name in names]
        lines.append(f"| {mode} | {len(here)} | {sum(1 for s in here if not s.get('backends'))} | {' | '.join(counts)} |")
    return lines


def summarise(rec: Path, result: dict, json_path: Path) -> str:
    """The summary table (markdown-friendly text) of one check run over the recording."""
    shapes = {s["step"]: s for s in map(json.loads, (rec / SHAPES).read_text().splitlines())} if (rec / SHAPES).exists() else {}
    lines = [f"### {result['label']}: `{' '.join(result['command'])}`", ""]
    if not json_path.exists():
        log = Path(result.get("log", ""))
        tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.is_file() else []
        lines += [f"no JSON written (exit {result['exit']}); the log ends:", "", *(f"    {line}" for line in tail), ""]
        return "\n".join(lines)
    data = json.loads(json_path.read_text())
    steps = [s for s in data["steps"] if s.get("step", -1) >= 0 or s.get("mode") != "recording"]
    recording = [s for s in data["steps"] if s.get("step") == -1 and s.get("mode") == "recording"]
    n = len(steps)
    with_findings = [s for s in steps if s.get("findings")]
    unchecked = [s for s in steps if not s.get("checked", True)]
    by_check: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    by_class: Counter = Counter()
    severity_seen = any("severity" in f for s in data["steps"] for f in s.get("findings") or [])
    crashes = []
    examples: dict[tuple[str, str, str], list[tuple[int, dict]]] = defaultdict(list)
    for s in data["steps"]:
        classes_here = set()
        for f in s.get("findings") or []:
            key = (f.get("class", "?"), f.get("check", "?"), _severity(f))
            if s["step"] not in by_check[key]:
                by_check[key].append(s["step"])
                if len(examples[key]) < 3:
                    examples[key].append((s["step"], f))
            classes_here.add(f.get("class", "?"))
            if f.get("class") == "backend-crash":
                crashes.append((s["step"], f))
        by_class.update(classes_here)
    verdict = data.get("verdict", {})
    seconds = result["seconds"]
    lines += [
        f"- exit {result['exit']}, wall {seconds:.1f} s, {1000 * seconds / max(n, 1):.0f} ms/step over {n} steps",
        f"- steps with findings: {len(with_findings)} of {n}; total findings {data.get('total_findings')}"
        + (f"; recording-level findings: {sum(len(s.get('findings') or []) for s in recording)}" if recording else ""),
        *([f"- steps with findings by class: {', '.join(f'{k} {c}' for k, c in by_class.most_common())}"] if by_class else []),
        *(
            [
                f"- by severity: steps with a defect {sum(1 for s in steps if any(_severity(f) != 'hazard' for f in s.get('findings') or []))}, "
                f"steps with hazards only {sum(1 for s in steps if s.get('findings') and all(_severity(f) == 'hazard' for f in s['findings']))}"
            ]
            if severity_seen
            else (["- findings carry no severity (this attndbg predates it): every finding counts"] if by_check else [])
        ),
        *([f"- {result['slices']}"] if result.get("slices") else []),
        f"- steps not checked: {len(unchecked)}",
        f"- backend crashes: {len(crashes)}",
        f"- verdict: {verdict.get('line', '')}",
    ]
    if verdict.get("skipped"):
        lines.append(f"- backends skipped: {verdict['skipped']}")
    if verdict.get("plans_unread"):
        lines.append(f"- plans not read: { {k: len(v) if isinstance(v, list) else v for k, v in verdict['plans_unread'].items()} }")
    if verdict.get("compared"):
        lines.append(f"- backends ran on: { {k: len(v) if isinstance(v, list) else v for k, v in verdict['compared'].items()} }")
    lines += ["", *kernels_by_mode(steps)]
    lines.append("")
    if by_check:
        lines += [
            "| class | check | severity | steps | by mode |" if severity_seen else "| class | check | steps | by mode |",
            "|---|---|---|---|---|" if severity_seen else "|---|---|---|---|",
        ]
        for (kind, check, sev), hit in sorted(by_check.items(), key=lambda kv: -len(kv[1])):
            modes = Counter(shapes.get(st, {}).get("mode", "?") for st in hit)
            mode_text = ", ".join(f"{m} {c}" for m, c in modes.most_common())
            lines.append(f"| {kind} | {check} | {sev or '-'} | {len(hit)} | {mode_text} |" if severity_seen else f"| {kind} | {check} | {len(hit)} | {mode_text} |")
        lines.append("")
        lines.append("First steps of each (shape; evidence):")
        for key, found in examples.items():
            lines.append(f"- {key[0]}/{key[1]}{' (' + key[2] + ')' if key[2] else ''}:")
            for step, f in found:
                lines.append(f"  - step {step}: {_shape_text(shapes.get(step))}")
                lines.append(f"    {str(f.get('evidence', ''))[:300]}")
        lines.append("")
    if unchecked:
        reasons = Counter(str(s.get("error"))[:160] for s in unchecked)
        lines.append("Steps not checked, by reason:")
        for reason, count in reasons.most_common():
            first = [s["step"] for s in unchecked if str(s.get("error"))[:160] == reason][:3]
            lines.append(f"- {count} x {reason} (steps {first}: {'; '.join(_shape_text(shapes.get(st)) for st in first)})")
        lines.append("")
    if crashes:
        lines.append("Backend crashes:")
        for step, f in crashes[:10]:
            data_ = f.get("data") or {}
            lines.append(f"- step {step} {data_.get('backend')} {data_.get('variant')}: {str(data_.get('error', f.get('evidence')))[:200]} ({_shape_text(shapes.get(step))})")
        lines.append("")
    return "\n".join(lines)


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 6 else f"[{', '.join(map(str, values[:6]))}, ... {len(values)} total, max {max(values)}]"


def _shape_text(shape: dict | None) -> str:
    if not shape:
        return "(shape unknown)"
    text = (
        f"{shape['mode']} {shape['engine']}/{shape['backend']} bs={shape['bs']} prefix={_short(shape['prefix'])} "
        f"extend={_short(shape['extend'])} page={shape['page']} heads={shape['heads']} d={shape['head_dim']} {shape['dtype']}"
    )
    if shape["capture_bs"]:
        text += f" graph bs={shape['capture_bs']}"
    if shape["tree"]:
        text += f" tree={shape['tree']}"
    if shape["window"] >= 0:
        text += f" window={shape['window']}"
    if shape["logit_cap"]:
        text += f" softcap={shape['logit_cap']}"
    if shape.get("sinks"):
        text += " sinks"
    if "k_scale" in shape:
        text += f" {shape['kv_dtype']} k_scale={shape['k_scale']} v_scale={shape['v_scale']}"
    return text


def recording_summary(rec: Path) -> str:
    """The recording's own mix (what was generated), from the shapes file."""
    shapes = [json.loads(line) for line in (rec / SHAPES).read_text().splitlines()]
    modes = Counter(s["mode"] for s in shapes)
    engines = Counter(f"{s['engine']}/{s['backend']}" for s in shapes)
    graph = sum(1 for s in shapes if s["capture_bs"])
    pages = Counter(s["page"] for s in shapes)
    no_plan = [s for s in shapes if s["no_plan"]]
    lines = [
        f"- {len(shapes)} steps: " + ", ".join(f"{m} {c}" for m, c in sorted(modes.items())),
        f"- engine/backend: " + ", ".join(f"{k} {c}" for k, c in sorted(engines.items())),
        f"- graph replays {graph}, pages " + ", ".join(f"{p}: {c}" for p, c in sorted(pages.items())),
        f"- windowed {sum(1 for s in shapes if s['window'] >= 0)}, soft-cap {sum(1 for s in shapes if s['logit_cap'])}, fp16 {sum(1 for s in shapes if s['dtype'] == 'float16')}"
        + (f", sinks {sum(1 for s in shapes if s.get('sinks'))}, scaled fp8 KV {sum(1 for s in shapes if 'k_scale' in s)}" if any(s.get("sinks") or "k_scale" in s for s in shapes) else ""),
        f"- steps no candidate backend could plan (recorded without a plan): {len(no_plan)}",
    ]
    return "\n".join(lines)


# -- CLI ---------------------------------------------------------------------------------------------


def _device() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return "no GPU (nvidia-smi absent)"
    names = [n.strip() for n in names if n.strip()]
    return ", ".join(f"{c} x {n}" for n, c in Counter(names).items()) or "no GPU"


def _version() -> str:
    from importlib import metadata

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=20, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return metadata.version("attndbg") + (f" at commit {commit} (plus the working tree's changes)" if commit else "")


def _default_jobs() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_make = sub.add_parser("make", help="write the recording")
    p_make.add_argument("-o", "--out", required=True, type=Path)
    p_make.add_argument("--steps", type=int, default=1000)
    p_make.add_argument("--seed", type=int, default=0)
    p_make.add_argument("--jobs", type=int, default=_default_jobs(), help="build processes (the bytes do not depend on it)")
    p_make.add_argument("--layer-kinds", action="store_true", help="also draw gpt-oss sink layers and scaled fp8 caches (see the module docstring)")
    p_run = sub.add_parser("run", help="attndbg check the recording and summarise")
    p_run.add_argument("rec", type=Path)
    p_run.add_argument("--backend", default="triton,flashinfer,fa3,mla")
    p_run.add_argument("--cuda-graph", action="store_true")
    p_run.add_argument("--jobs", default=None, help="check --jobs (default: check's own, auto)")
    p_run.add_argument("--json", required=True, type=Path)
    p_run.add_argument("--timeout", type=float, default=0, help="kill the check after this many seconds (0: never)")
    p_run.add_argument("--check-arg", action="append", default=[], help="extra argument for attndbg check (repeatable), e.g. --check-arg=--steps=0:60")
    p_run.add_argument("--slice-steps", type=int, default=0, help="check in slices of this many steps, each its own JSON, resumable (0: one check)")
    p_all = sub.add_parser("all", help="make + run eager + run --cuda-graph + a markdown summary")
    p_all.add_argument("--steps", type=int, default=1000)
    p_all.add_argument("--seed", type=int, default=0)
    p_all.add_argument("--layer-kinds", action="store_true", help="also draw gpt-oss sink layers and scaled fp8 caches")
    p_all.add_argument("--out-dir", required=True, type=Path)
    p_all.add_argument("--work", type=Path, default=Path("/tmp/attndbg_server_sweep"), help="where the recording is written (reused when steps and seed match)")
    p_all.add_argument("--backend", default="triton,flashinfer,fa3,mla")
    p_all.add_argument("--jobs", default=None, help="check --jobs (default: check's own, auto)")
    p_all.add_argument("--make-jobs", type=int, default=_default_jobs())
    p_all.add_argument("--timeout", type=float, default=0, help="kill each check after this many seconds (0: never)")
    p_all.add_argument("--runs", default="eager,graph", help="which check runs: eager, graph or both")
    p_all.add_argument("--tag", default="", help="suffix of the summary file name, e.g. _h100")
    p_all.add_argument("--slice-steps", type=int, default=0, help="check in slices of this many steps, each its own JSON, resumable (0: one check)")
    args = parser.parse_args()

    if args.command == "make":
        seconds = make(args.out, args.steps, args.seed, args.jobs, layer_kinds=args.layer_kinds)
        print(f"made {args.steps} steps (seed {args.seed}) in {seconds:.1f} s: {args.out}")
        print(recording_summary(args.out))
        return 0
    if args.command == "run":
        if args.slice_steps > 0:
            result = run_sliced(args.rec, args.backend, cuda_graph=args.cuda_graph, jobs=args.jobs, json_out=args.json, slice_steps=args.slice_steps, extra=args.check_arg, timeout=args.timeout)
        else:
            result = run_check(args.rec, args.backend, cuda_graph=args.cuda_graph, jobs=args.jobs, json_out=args.json, log=args.json.with_suffix(".log"), extra=args.check_arg, timeout=args.timeout)
        print(summarise(args.rec, result, args.json))
        return result["exit"]
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    # The recording (about 0.7 MB a step) stays outside --out-dir, which holds only the results.
    rec = args.work / f"server_sweep_{args.steps}_seed{args.seed}{'_kinds' if args.layer_kinds else ''}"
    params = rec / PARAMS
    if params.exists() and json.loads(params.read_text()) == _params(args.steps, args.seed, args.layer_kinds):
        print(f"reusing {rec} (same steps, seed and generator)", flush=True)
        made = None
    else:
        made = make(rec, args.steps, args.seed, args.make_jobs, layer_kinds=args.layer_kinds)
        print(f"made {args.steps} steps in {made:.1f} s", flush=True)
    sections = [
        f"# server_sweep: {args.steps} steps, seed {args.seed}, backends {args.backend}",
        "",
        f"device: {_device()}; attndbg {_version()}",
        "",
        f"`python bench/server_sweep.py all --steps {args.steps} --seed {args.seed} --out-dir OUT`"
        + (f"; generation {made:.1f} s with {args.make_jobs} processes" if made is not None else ""),
        "",
        recording_summary(rec),
        "",
    ]
    codes = []
    for label in [r for r in args.runs.split(",") if r]:
        json_out = out / f"server_sweep_{label}.json"
        if args.slice_steps > 0:
            result = run_sliced(rec, args.backend, cuda_graph=label == "graph", jobs=args.jobs, json_out=json_out, slice_steps=args.slice_steps, timeout=args.timeout)
        else:
            result = run_check(rec, args.backend, cuda_graph=label == "graph", jobs=args.jobs, json_out=json_out, log=out / f"server_sweep_{label}.log", timeout=args.timeout)
        text = summarise(rec, result, json_out)
        print(text, flush=True)
        sections += [text, ""]
        codes.append(result["exit"])
        (out / f"server_sweep{args.tag}.md").write_text("\n".join(sections) + "\n")  # after each run: a timeout keeps the first
    print(f"summary: {out / f'server_sweep{args.tag}.md'}")
    return max(codes) if codes else 0


if __name__ == "__main__":
    sys.exit(main())
