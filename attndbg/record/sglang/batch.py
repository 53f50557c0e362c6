"""SGLang's ForwardBatch -> attndbg's engine-neutral Batch, with SGLang's seq_lens resolved per mode.

Two halves, because a hook must not synchronise the device:
- `capture_batch` runs in the engine's hook: it only slices and gathers device tensors (no
  `.item()`, `.cpu()`, `.tolist()`) and reads host fields the engine already holds;
- `batch_from_host` runs on the writer thread on host copies of those tensors.
`batch_from_forward_batch` composes the two for host-side callers and tests.

SGLang's `seq_lens` (engines.md A2): DECODE and EXTEND/MIXED count the tokens of this step,
TARGET_VERIFY counts only the prefix (the backend adds draft_token_num itself). The draft model's
extend has two versions with their own conventions:
- DRAFT_EXTEND (SGL-classic, spec v1): each request's query is its accepted tokens
  (`extend_seq_lens` = accept lengths, ragged) and `seq_lens` = prefix + accepted: the extend rule;
- DRAFT_EXTEND_V2 (spec v2, `prepare_for_draft_extend` in speculative/eagle_worker_common.py of
  SGLang 0.5.23, `prepare_for_extend_to_fill_draft_kvcache` before it): every request runs its whole
  verify window, `num_tokens_per_req` (= speculative_num_draft_tokens; a widened window's
  `num_front_tokens` rows are counted in it) queries whatever it accepted; `extend_prefix_lens` =
  the prefix before the window, `seq_lens` = prefix + window (bumped before
  init_forward_metadata; SGLang #26651, and #26512, reverted by #26628, which took them for the
  prefix alone). The window's width is the
  step's query count, so a V2 step's batch is the window (like a verify step's), and the engine's
  `seq_lens` / `extend_seq_lens` are evidence judged against it (`batch.seq_lens_raw`, the plan).
Fields are read by name from a real ForwardBatch or from SGL-new's replay view (a SimpleNamespace
with the same names), so both work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record.sglang.draft import DraftDecode, branch_parts
from attndbg.trace.build import batch_from_rows
from attndbg.trace.schema import Batch, ForwardMode

# SGLang ForwardMode names (classic and new) -> the trace's; IDLE and the modes attention does not
# run as a normal step (PREBUILT, SPLIT_PREFILL, DLLM_EXTEND, DUMMY_FIRST) are not recorded.
MODES: dict[str, ForwardMode] = {
    "DECODE": ForwardMode.DECODE,
    "EXTEND": ForwardMode.EXTEND,
    "MIXED": ForwardMode.MIXED,
    "TARGET_VERIFY": ForwardMode.TARGET_VERIFY,
    "DRAFT_EXTEND": ForwardMode.DRAFT_EXTEND,
    "DRAFT_EXTEND_V2": ForwardMode.DRAFT_EXTEND,
}


class UnsupportedStep(ValueError):
    """A step the adapter does not record (IDLE, an exotic mode); the message says which and why."""


def engine_mode_name(fb: Any) -> str:
    """The runtime mode's name. SGL-new's replay view carries the capture mode in `forward_mode`
    and the step's own in `actual_forward_mode` (IDLE may replay a DECODE graph)."""
    mode = getattr(fb, "actual_forward_mode", None) or fb.forward_mode
    return mode.name


def trace_mode(fb: Any) -> ForwardMode:
    name = engine_mode_name(fb)
    if name not in MODES:
        raise UnsupportedStep(f"SGLang ForwardMode.{name} is not recorded (recorded: {', '.join(MODES)})")
    return MODES[name]


def draft_extend_window(spec_info: Any) -> int:
    """Queries per request of a DRAFT_EXTEND_V2 step: its spec input's `num_tokens_per_req`, a host
    int. A widened window's front rows are already in it: every SGLang 0.5.23 caller that sets
    `num_front_tokens` (the multi-layer worker v2 and its draft-extend graph runners) sets
    `num_tokens_per_req` = num_steps + 1 + num_front_tokens, and the backends stride qo_indptr by
    `num_tokens_per_req` alone (EagleDraftExtendInput.generate_attn_arg_prefill)."""
    per_req = getattr(spec_info, "num_tokens_per_req", None)
    if not isinstance(per_req, int) or isinstance(per_req, bool) or per_req < 1:
        raise ValueError(f"a DRAFT_EXTEND_V2 ForwardBatch whose spec input has no num_tokens_per_req ({per_req!r}): the window each request runs is unknown")
    return per_req


def draft_token_num(spec_info: Any) -> int:
    """Tokens per request of a verify step: SGL-new's per-step `num_tokens_per_req` when set (> 0),
    else the configured `draft_token_num`."""
    per_req = getattr(spec_info, "num_tokens_per_req", None)
    if isinstance(per_req, int) and per_req > 0:
        return per_req
    return int(spec_info.draft_token_num)


@dataclass(frozen=True)
class BatchInfo:
    """Host facts of one step, read without touching the device."""

    mode: ForwardMode
    batch_size: int  # real requests (graph padding excluded)
    # 1 for decode (topk for a draft decode), draft_token_num for verify, the window for a
    # DRAFT_EXTEND_V2 step, 0 when it varies (extend, mixed, the classic draft extend's accepted tokens)
    tokens_per_req: int
    draft: DraftDecode | None = None  # a multi-step draft backend's decode step: branch rows (draft.py)


def _cpu_max(values: Any) -> int | None:
    """max() of a host-side list/tensor, None when the engine has no host copy."""
    if values is None:
        return None
    if isinstance(values, Tensor):
        if values.is_cuda or values.numel() == 0:
            return None if values.is_cuda else 0
        return int(values.max())
    return max(values) if len(values) else 0


def capture_batch(fb: Any, req_to_token: Tensor, *, raw_bs: int | None = None, draft: DraftDecode | None = None) -> tuple[BatchInfo, dict[str, Tensor | None]]:
    """Device tensors describing the batch's real requests, plus host facts; never syncs.

    `raw_bs` is the number of real requests when `fb` is padded for a CUDA graph (the first
    `raw_bs` rows are the real ones). Each request's req_to_token row is gathered on the device and
    cut to the longest KV length when the engine has it on the host (seq_lens_cpu), else kept whole.
    `draft`: the step is a draft decode (draft.py), whose rows are its requests' branches.
    """
    mode = trace_mode(fb)
    bs = int(fb.batch_size if raw_bs is None else raw_bs)
    if mode is ForwardMode.TARGET_VERIFY:
        if fb.spec_info is None:
            raise ValueError("a TARGET_VERIFY ForwardBatch without spec_info: the draft token count is unknown")
        per_req = draft_token_num(fb.spec_info)
    elif mode is ForwardMode.DECODE:
        per_req = 1 if draft is None else draft.topk
    elif engine_mode_name(fb) == "DRAFT_EXTEND_V2":
        per_req = draft_extend_window(getattr(fb, "spec_info", None))
    else:
        per_req = 0
    seq_lens = fb.seq_lens[:bs]
    req_pool_indices = fb.req_pool_indices[:bs]
    seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
    longest = _cpu_max(seq_lens_cpu[:bs] if seq_lens_cpu is not None else None)
    # Verify seq_lens exclude the draft tokens, whose slots follow the prefix in the row; a V2
    # draft extend's include its window, unless they are wrong (judged, so the row is kept whole).
    extra = per_req if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND) else 0
    if draft is not None:  # every branch's draft columns follow the prefix
        extra = draft.topk * draft.columns
    width = req_to_token.shape[1] if longest is None else min(longest + extra, req_to_token.shape[1])
    tokens = bs * per_req if per_req else None
    positions = getattr(fb, "positions", None)
    if positions is None and mode is ForwardMode.TARGET_VERIFY:
        positions = getattr(fb.spec_info, "positions", None)
    tensors: dict[str, Tensor | None] = {
        "seq_lens": seq_lens,
        "rows": req_to_token[req_pool_indices.to(torch.long), :width],
        "out_cache_loc": fb.out_cache_loc[: tokens * (draft.columns if draft else 1)] if tokens is not None else fb.out_cache_loc,
        "positions": None if positions is None else (positions[:tokens] if tokens is not None else positions),
        "extend_prefix_lens": None,
        "extend_seq_lens": None,
    }
    if per_req == 0 or mode is ForwardMode.DRAFT_EXTEND:
        prefix = getattr(fb, "extend_prefix_lens", None)
        tensors["extend_prefix_lens"] = prefix if per_req == 0 or prefix is None else prefix[:bs]
    if per_req == 0:
        tensors["extend_seq_lens"] = getattr(fb, "extend_seq_lens", None)
    return BatchInfo(mode=mode, batch_size=bs, tokens_per_req=per_req, draft=draft), tensors


def lengths_from_host(info: BatchInfo, host: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
    """(prefix_lens, extend_lens) per request, SGLang's seq_lens semantics resolved per mode."""
    seq_lens = host["seq_lens"].to(torch.int64)
    if info.mode is ForwardMode.DECODE:
        if bool((seq_lens < 1).any()):
            raise ValueError(f"DECODE seq_lens {seq_lens.tolist()} include the current token, so every one must be >= 1")
        return seq_lens - 1, torch.ones_like(seq_lens)
    if info.mode is ForwardMode.TARGET_VERIFY:
        return seq_lens, torch.full_like(seq_lens, info.tokens_per_req)
    if info.mode is ForwardMode.DRAFT_EXTEND and info.tokens_per_req:
        # V2: the window is the query; the prefix is the engine's extend_prefix_lens (what the
        # kernels' prefix lists are built from), else seq_lens less the window.
        prefix = host["extend_prefix_lens"]
        window = torch.full_like(seq_lens, info.tokens_per_req)
        prefix = seq_lens - window if prefix is None else prefix.to(torch.int64)
        bad = torch.nonzero(prefix < 0).flatten()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(f"request {b}: a DRAFT_EXTEND_V2 prefix of {int(prefix[b])} (seq_lens {int(seq_lens[b])} less the window of {info.tokens_per_req})")
        return prefix, window
    prefix, extend = host["extend_prefix_lens"], host["extend_seq_lens"]
    if extend is None:
        raise ValueError(f"a {info.mode.value} ForwardBatch without extend_seq_lens: the new tokens per request are unknown")
    extend = extend.to(torch.int64)
    prefix = seq_lens - extend if prefix is None else prefix.to(torch.int64)
    bad = torch.nonzero(prefix + extend != seq_lens).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"request {b}: extend_prefix_lens {int(prefix[b])} + extend_seq_lens {int(extend[b])} != seq_lens {int(seq_lens[b])}"
        )
    return prefix, extend


def batch_from_host(info: BatchInfo, host: dict[str, Tensor | None], *, kv_cache_size: int) -> Batch:
    """The trace's Batch from host copies of `capture_batch`'s tensors."""
    if info.draft is not None:
        parts = branch_parts(info.draft, seq_lens=host["seq_lens"].to(torch.int64), rows=host["rows"], out_cache_loc=host["out_cache_loc"], positions=host["positions"])
        return batch_from_rows(forward_mode=info.mode, kv_cache_size=kv_cache_size, **parts)
    prefix, extend = lengths_from_host(info, host)
    kv = prefix + extend
    rows = host["rows"]
    if kv.numel() and int(kv.max()) > rows.shape[1]:
        raise ValueError(f"a request needs {int(kv.max())} KV columns but its req_to_token row has {rows.shape[1]}")
    positions = host["positions"]
    if positions is None:
        # ForwardBatch.init_new computes them like this (compute_position); verify takes spec_info's.
        positions = torch.cat([torch.arange(int(p), int(p) + int(e)) for p, e in zip(prefix, extend)]) if info.batch_size else torch.zeros(0)
    return batch_from_rows(
        forward_mode=info.mode,
        prefix_lens=prefix,
        extend_lens=extend,
        rows=list(rows),
        out_cache_loc=host["out_cache_loc"],
        positions=positions,
        seq_lens_raw=host["seq_lens"],
        kv_cache_size=kv_cache_size,
    )


def host_copy(tensors: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Synchronous host copies (for callers outside a hook: tests, offline conversion)."""
    return {k: None if v is None else v.detach().to("cpu") for k, v in tensors.items()}


def batch_from_forward_batch(fb: Any, req_to_token: Tensor, kv_cache_size: int, *, raw_bs: int | None = None) -> Batch:
    """The trace's Batch of a ForwardBatch (or SGL-new replay view) and its req_to_token table."""
    info, tensors = capture_batch(fb, req_to_token, raw_bs=raw_bs)
    return batch_from_host(info, host_copy(tensors), kv_cache_size=kv_cache_size)
