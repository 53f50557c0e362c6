"""A merge of given partial attention states by their LSEs (what FlashInfer's merge_state /
merge_states and vLLM's merge_attn_states compute), for a standalone merge step (trace.merge).

Each (row, head) program merges the row's states with online rescaling, natural-log LSEs:
  out = sum_i exp(lse_i - m) * o_i / sum_i exp(lse_i - m),  lse = m + log(sum_i exp(lse_i - m)).
A state of LSE -inf attended to no key (an empty chunk): it is skipped, its output never read, so
an empty state's garbage or NaN cannot reach the row (FlashInfer #4051 is a merge that read one).
A row whose every state is empty gets output 0 and LSE -inf, as the float64 reference gives. With a
row mask (FlashInfer's merge_state_in_place(mask=)), a row left out keeps its first state as given.

Unlike stage 2 of the split-KV decode kernel (decode.py), which tells empty splits by the split
rule, this kernel is told nothing but the states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _check


@triton.jit
def _merge_states_kernel(
    V,  # [rows, H, states, D]
    S,  # [rows, H, states] float32, natural log
    O,  # [rows, H, D]
    Lse,  # [rows, H] float32
    Rows,  # [rows] bool: merge this row (a dummy pointer when HAS_ROWS is False)
    num_states,
    stride_vr, stride_vh, stride_vs, stride_vd,
    stride_sr, stride_sh, stride_ss,
    stride_or, stride_oh, stride_od,
    stride_lr, stride_lh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    v_ptrs = V + row * stride_vr + head * stride_vh + offs_d * stride_vd
    s_ptr = S + row * stride_sr + head * stride_sh

    count = num_states
    if HAS_ROWS:  # a row left out merges nothing here: it keeps its first state (below)
        count = tl.where(tl.load(Rows + row) != 0, num_states, 0)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for state in range(0, count):
        lse_s = tl.load(s_ptr + state * stride_ss)
        if lse_s > float("-inf"):  # an empty state weighs 0: skipped, its output never read
            o_s = tl.load(v_ptrs + state * stride_vs, mask=mask_d, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse_s - m_new)
            acc = acc * alpha + w * o_s
            total = total * alpha + w
            m = m_new

    merged = total > 0.0
    o = tl.where(merged, acc / tl.where(merged, total, 1.0), 0.0)
    lse = tl.where(merged, m + tl.log(tl.where(merged, total, 1.0)), float("-inf"))
    if HAS_ROWS:  # a row left out keeps its first state
        o = tl.where(count > 0, o, tl.load(v_ptrs, mask=mask_d, other=0.0).to(tl.float32))
        lse = tl.where(count > 0, lse, tl.load(s_ptr))
    tl.store(O + row * stride_or + head * stride_oh + offs_d * stride_od, o.to(O.dtype.element_ty), mask=mask_d)
    tl.store(Lse + row * stride_lr + head * stride_lh, lse)


def merge_states(
    *,
    v: torch.Tensor,  # [rows, H, states, D]
    s: torch.Tensor,  # [rows, H, states] float32 natural-log LSEs
    o: torch.Tensor,  # [rows, H, D] (written, in o's dtype)
    lse: torch.Tensor,  # [rows, H] float32 natural log (written)
    rows: torch.Tensor | None = None,  # [rows] bool: merge only these rows, the others keep state 0
) -> None:
    """Merge each row's states by their LSEs into o and its LSE (see the module docstring)."""
    _check(v.dim() == 4, f"v {tuple(v.shape)}: expected [rows, heads, states, dim]")
    count, heads, states, dim = v.shape
    _check(tuple(s.shape) == (count, heads, states) and s.dtype == torch.float32, f"s {tuple(s.shape)} {s.dtype}: expected float32 ({count}, {heads}, {states})")
    _check(tuple(o.shape) == (count, heads, dim), f"o {tuple(o.shape)}: expected ({count}, {heads}, {dim})")
    _check(tuple(lse.shape) == (count, heads) and lse.dtype == torch.float32, f"lse {tuple(lse.shape)} {lse.dtype}: expected float32 ({count}, {heads})")
    _check(rows is None or (rows.dtype == torch.bool and tuple(rows.shape) == (count,)), f"rows: expected a bool mask of {count} rows")
    if count == 0 or heads == 0:
        return
    _merge_states_kernel[(count, heads)](
        v, s, o, lse, rows if rows is not None else lse, states,
        *v.stride(), *s.stride(), *o.stride(), *lse.stride(),
        D=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        HAS_ROWS=rows is not None,
        num_warps=4,
    )
