"""Merges of partial attention states inside FlashInfer: the library's merge kernel, called on the
states an engine hands it, returns the wrong merged state.

- flashinfer-ai/flashinfer#4051 (2026-07): FlashInfer writes an empty attention state (a partition
  that attended to no key) as output 0 with LSE -inf. Merging two of them evaluated
  exp2(s - max(s_a, s_b)) = exp2(-inf - -inf) = NaN: NaN output and LSE instead of the empty state
  (0, -inf), in merge_state, merge_state_in_place and every reduction through state_t::merge, so an
  empty or fully masked partition on both sides spread NaN into later cascade reductions. The
  fix (#5262) shifts the exponents by a finite value when the maximum is -inf.

No engine recorder writes a standalone merge step, and the FlashInfer dump importer pairs
merge_state only into SGLang's cascade (whose new-token part always holds the query's own key, so
never two empty states). The step is the library call itself, written as the trace format holds a
merge (`trace.merge`: the states, their base-2 LSEs, and the output the kernel returned), with the
merged state computed in float32 the way the kernel computed it (the real kernel needs a GPU).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

import attndbg
from attndbg.trace import io
from attndbg.trace.schema import AttentionKind, Batch, ForwardMode, LseBase, MergeStates, Model, Source, Trace
from tests.corpus.bug import Capability, RealBug

TOKENS, HEADS, WIDTH = 6, 4, 64
EMPTY_ROWS = [1, 4]  # rows whose partitions attended to no key on both sides


def _states(*, both_empty: bool) -> tuple[Tensor, Tensor]:
    """Two states (v [2, T, H, D] bfloat16, base-2 LSEs s [2, T, H]) as attention over two disjoint
    KV partitions leaves them; on EMPTY_ROWS partition a saw no key, and partition b none either
    (`both_empty`) or its chunk."""
    g = torch.Generator().manual_seed(4051)
    v = torch.randn(2, TOKENS, HEADS, WIDTH, generator=g).to(torch.bfloat16)
    lse = torch.tensor([3.0, 1.5]).view(2, 1, 1) + torch.randn(2, TOKENS, HEADS, generator=g)
    s = (lse / math.log(2)).to(torch.float32)  # natural-log sizes written in FlashInfer's base 2
    for state in (0, 1) if both_empty else (0,):
        v[state, EMPTY_ROWS] = 0
        s[state, EMPTY_ROWS] = float("-inf")
    return v, s


def _merge_state(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """flashinfer.cascade.merge_state(v_a, s_a, v_b, s_b) before the fix: float32, base 2, each state
    weighed by exp2(s - max): NaN where both LSEs are -inf."""
    top = torch.maximum(s[0], s[1])
    weights = torch.exp2(s - top)
    total = weights.sum(0)
    output = (v.float() * weights[..., None]).sum(0) / total[..., None]
    return output.to(v.dtype), (top + torch.log2(total)).to(torch.float32)


def _step(v: Tensor, s: Tensor) -> Trace:
    output, lse = _merge_state(v, s)
    model = Model(
        num_qo_heads=HEADS, num_kv_heads=HEADS, head_dim=WIDTH, v_head_dim=WIDTH, attention=AttentionKind.MHA, kv_lora_rank=0, qk_rope_head_dim=0,
        sm_scale=1.0 / math.sqrt(WIDTH), logit_cap=0.0, sliding_window=-1, q_dtype="bfloat16", kv_dtype="bfloat16", page_size=1,
    )  # fmt: skip
    none = torch.zeros(0, dtype=torch.int64)
    batch = Batch(
        forward_mode=ForwardMode.IDLE, prefix_lens=none, extend_lens=none, kv_lens=none, slot_indptr=torch.zeros(1, dtype=torch.int64), slot_ids=none,
        query_cols=none, out_cache_loc=none, positions=none, seq_lens_raw=none, kv_cache_size=1,
    )  # fmt: skip
    source = Source(engine="flashinfer", engine_version="merge_state before the fix", backend="flashinfer", device="cuda", tp_rank=0, step=0, attndbg_version=attndbg.__version__)
    return Trace(source=source, model=model, batch=batch, seed=4051, merge=MergeStates(v=v, s=s, lse_base=LseBase.TWO, output=output, lse=lse))


def _merge(out: Path, *, both_empty: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    io.append_to_recording(out, _step(*_states(both_empty=both_empty)))


def write_4051(bug: Path, twin: Path) -> None:
    _merge(bug, both_empty=True)
    _merge(twin, both_empty=False)


BUGS = (
    RealBug(
        id="flashinfer-4051",
        title="Merging two empty attention states returns NaN",
        links=("https://github.com/flashinfer-ai/flashinfer/issues/4051", "https://github.com/flashinfer-ai/flashinfer/pull/5262", "https://github.com/flashinfer-ai/flashinfer/pull/4054"),
        date="2026-07",
        engine="FlashInfer cascade",
        mode="merge (merge_state)",
        mechanism="merge((0, -inf), (0, -inf)) evaluates exp2(-inf - -inf): NaN output and LSE, contaminating later cascade reductions",
        encoding="a merge step: merge_state of 2 states x 6 tokens x 4 heads, width 64 bfloat16, base-2 LSEs, both states empty "
        "(output 0, LSE -inf) on rows 1 and 4; the output and LSE as the kernel returned them (NaN on those rows, the exact merge "
        "elsewhere), computed in float32 as the kernel did; written as the trace format holds a merge (no recorder writes one)",
        expected=("split-merge/merge-step-nonfinite", "replay/kernel-fails-reference"),
        keywords=("-inf - -inf", "empty state"),
        capabilities=(Capability.KERNEL_RUN, Capability.SPLIT_MODEL),
        twin_note="the same merge with one state empty on rows 1 and 4 (partition b holds its chunk there), which the kernel "
        "merges right (the defect is in the library, not the caller's states)",
        write=write_4051,
    ),
)
