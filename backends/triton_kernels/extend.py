"""Extend attention (prefill on top of a cached prefix), SGLang Triton-backend semantics.

Request b has p_b cached tokens (slots kv_indices[kv_indptr[b]:kv_indptr[b+1]] of the KV cache)
and e_b new tokens (rows qo_indptr[b]:qo_indptr[b+1] of q/k/v_extend). Query i of the request sits
at key column c = p_b + i. Each program owns (request, query head, block of BLOCK_M query rows)
and runs one online softmax in two phases over the same accumulator:

  phase 1: the prefix, read from k_buffer/v_buffer through the slot ids;
  phase 2: the extend part, read from k_extend/v_extend directly.

Visibility of key column j for query i (all conditions AND-ed):
  prefix j < p_b:     custom_mask[i, j] when a mask is given and not skip_prefix_custom_mask
  extend j = p_b + k: custom_mask[i, p_b + k] when a mask is given, else k <= i when causal
  sliding_window >= 0: c - j <= sliding_window
  window_right >= 0:   j - c <= window_right (a non-causal layer's right window)
where request b's custom mask is a row-major [e_b, p_b + e_b] block at element mask_indptr[b] of
the flat mask. A query row that sees no key writes 0 and lse = -inf. With sinks, each query head's
sink logit is one more softmax term with no value (a row that sees no key: output 0, lse = the
sink). K and V are read in any dtype (an fp8 cache included) and computed in q's; a scaled fp8
cache passes k_scale folded into sm_scale and v_scale, which multiplies the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import HeadDims, attend_tile, dot_flags, interpreted, load_kv_tile


@triton.jit
def _extend_kernel(
    Q_Extend,  # [T, Hq, Dk]
    K_Extend,  # [T, Hkv, Dk]
    V_Extend,  # [T, Hkv, Dv]
    O_Extend,  # [T, Hq, Dv]
    Lse_Extend,  # [T, Hq] float32
    K_Buffer,  # [N, Hkv, Dk]
    V_Buffer,  # [N, Hkv, Dv]
    Qo_Indptr,  # [bs + 1] int32
    Kv_Indptr,  # [bs + 1] int32
    Kv_Indices,  # prefix slot ids, int32/int64
    Custom_Mask,  # flat uint8 (or a dummy pointer when USE_CUSTOM_MASK is False)
    Mask_Indptr,  # [bs + 1] int64
    Sinks,  # [Hq] float32 sink logits (a dummy pointer when HAS_SINKS is False)
    sm_scale,
    logit_cap,
    sliding_window,
    window_right,
    v_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_kbn, stride_kbh, stride_kbd,
    stride_vbn, stride_vbh, stride_vbd,
    GROUP: tl.constexpr,  # query heads per kv head
    D_MODEL: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr,
    SKIP_PREFIX_CUSTOM_MASK: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    USE_WINDOW_RIGHT: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    block_m = tl.program_id(2)
    cur_kv_head = cur_head // GROUP

    qo_start = tl.load(Qo_Indptr + cur_batch)
    extend_len = tl.load(Qo_Indptr + cur_batch + 1) - qo_start
    if block_m * BLOCK_M >= extend_len:
        return  # grid covers the longest request; this one is shorter (or has e_b = 0)
    kv_start = tl.load(Kv_Indptr + cur_batch)
    prefix_len = tl.load(Kv_Indptr + cur_batch + 1) - kv_start

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index i inside the request
    mask_m = offs_m < extend_len
    rows_q = (qo_start + offs_m).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    q_ptrs = Q_Extend + rows_q[:, None] * stride_qt + cur_head * stride_qh
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & (offs_d[None, :] < D_MODEL),
        other=0.0,
    )
    if BLOCK_DPE > 0:
        offs_dpe = D_MODEL + tl.arange(0, BLOCK_DPE)
        q_pe = tl.load(q_ptrs + offs_dpe[None, :] * stride_qd, mask=mask_m[:, None], other=0.0)
    else:
        q_pe = q  # placeholder, never used

    if USE_CUSTOM_MASK:
        # row i of this request's [e_b, p_b + e_b] mask block
        mask_row_len = (prefix_len + extend_len).to(tl.int64)
        mask_rows = Custom_Mask + tl.load(Mask_Indptr + cur_batch) + offs_m[:, None] * mask_row_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Sliding window: key column j is visible only if c - j <= window with c = p_b + i, so keys
    # before the first row's window start can be skipped (start rounded down to a tile).
    if USE_SLIDING_WINDOW:
        first_col = tl.maximum(prefix_len + block_m * BLOCK_M - sliding_window, 0)
        prefix_lo = tl.minimum(first_col, prefix_len) // BLOCK_N * BLOCK_N
        extend_lo = tl.maximum(first_col - prefix_len, 0) // BLOCK_N * BLOCK_N
    else:
        prefix_lo = 0
        extend_lo = 0

    # ---- phase 1: the cached prefix, through the slot ids ----
    K = K_Buffer + cur_kv_head * stride_kbh
    V = V_Buffer + cur_kv_head * stride_vbh
    for start_n in range(prefix_lo, prefix_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # key column j
        mask_n = offs_n < prefix_len
        kv_loc = tl.load(Kv_Indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k, k_pe, v = load_kv_tile(
            K, V, kv_loc, mask_n, stride_kbn, stride_kbd, stride_vbn, stride_vbd,
            D_MODEL, DV, BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV,
        )
        k, k_pe, v = k.to(q.dtype), k_pe.to(q.dtype), v.to(q.dtype)  # an fp8 cache is computed in q's dtype
        visible = mask_m[:, None] & mask_n[None, :]
        if USE_CUSTOM_MASK and not SKIP_PREFIX_CUSTOM_MASK:
            visible &= tl.load(mask_rows + offs_n[None, :], mask=visible, other=0) != 0
        if USE_SLIDING_WINDOW:
            visible &= (prefix_len + offs_m[:, None]) - offs_n[None, :] <= sliding_window
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pe, k, k_pe, v, visible, sm_scale, logit_cap,
            BLOCK_DPE, USE_LOGIT_CAP, DOT_FP32, DOT_PRECISION,
        )

    # ---- phase 2: the new tokens, straight from k_extend / v_extend ----
    if IS_CAUSAL and not USE_CUSTOM_MASK:
        extend_hi = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)  # keys after the last row
    else:
        extend_hi = extend_len
    K = K_Extend + cur_kv_head * stride_kh
    V = V_Extend + cur_kv_head * stride_vh
    for start_n in range(extend_lo, extend_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # extend key k, column p_b + k
        mask_n = offs_n < extend_len
        rows_kv = (qo_start + offs_n).to(tl.int64)
        k, k_pe, v = load_kv_tile(
            K, V, rows_kv, mask_n, stride_kt, stride_kd, stride_vt, stride_vd,
            D_MODEL, DV, BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV,
        )
        k, k_pe, v = k.to(q.dtype), k_pe.to(q.dtype), v.to(q.dtype)
        visible = mask_m[:, None] & mask_n[None, :]
        if USE_CUSTOM_MASK:
            visible &= tl.load(mask_rows + prefix_len + offs_n[None, :], mask=visible, other=0) != 0
        elif IS_CAUSAL:
            visible &= offs_n[None, :] <= offs_m[:, None]
        if USE_SLIDING_WINDOW:
            visible &= offs_m[:, None] - offs_n[None, :] <= sliding_window
        if USE_WINDOW_RIGHT:
            visible &= offs_n[None, :] - offs_m[:, None] <= window_right
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pe, k, k_pe, v, visible, sm_scale, logit_cap,
            BLOCK_DPE, USE_LOGIT_CAP, DOT_FP32, DOT_PRECISION,
        )

    if HAS_SINKS:
        # the sink: one more term exp(sink - m) in the denominator, with no value
        sink = tl.load(Sinks + cur_head)
        m_new = tl.maximum(m_i, sink)  # finite: the sink is
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m_new)
        m_i = m_new

    # normalise; a row that saw no key has l_i = 0: write 0 and lse = -inf, never 0/0
    has_kv = l_i > 0.0
    l_safe = tl.where(has_kv, l_i, 1.0)
    out = tl.where(has_kv[:, None], acc / l_safe[:, None], 0.0) * v_scale
    lse = tl.where(has_kv, m_i + tl.log(l_safe), float("-inf"))
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(
        O_Extend + rows_q[:, None] * stride_ot + cur_head * stride_oh + offs_dv[None, :] * stride_od,
        out.to(O_Extend.dtype.element_ty),
        mask=mask_m[:, None] & (offs_dv[None, :] < DV),
    )
    tl.store(Lse_Extend + rows_q * stride_lt + cur_head * stride_lh, lse, mask=mask_m)


@dataclass(frozen=True)
class _ExtendLaunch:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def choose(cls, dims: HeadDims) -> _ExtendLaunch:
        if interpreted():
            # ~3-4 ms per loop iteration of a program under the interpreter: few, large tiles.
            return cls(block_m=32, block_n=64, num_warps=4, num_stages=1)
        # Hopper: a 128-row q tile for head dims up to 128, smaller as heads widen so q, K, V
        # and the fp32 accumulator fit in registers. Measured on an H200, triton 3.6 (bs 4,
        # prefix 2048 + 512 new, 32/8 heads, d 128, bf16, causal): 128x64, 4 warps, 2 stages
        # 377 us; 8 warps 454; 3 stages 628; 64x64 442-469; 128x128 528 (FlashInfer paged
        # prefill: 167 us).
        width = dims.block_dmodel + dims.block_dpe
        if width <= 128:
            return cls(block_m=128, block_n=64, num_warps=4, num_stages=2)
        if width <= 256:
            return cls(block_m=64, block_n=64, num_warps=8, num_stages=2)
        return cls(block_m=32, block_n=32, num_warps=4, num_stages=2)


def extend_attention_fwd(
    *,
    q_extend: torch.Tensor,  # [T, Hq, Dk]
    k_extend: torch.Tensor,  # [T, Hkv, Dk]
    v_extend: torch.Tensor,  # [T, Hkv, Dv]
    o_extend: torch.Tensor,  # [T, Hq, Dv] (written)
    lse_extend: torch.Tensor,  # [T, Hq] float32 natural log (written)
    k_buffer: torch.Tensor,  # [N, Hkv, Dk] KV cache holding the prefixes
    v_buffer: torch.Tensor,  # [N, Hkv, Dv]
    qo_indptr: torch.Tensor,  # [bs + 1] int32: rows of each request's new tokens
    kv_indptr: torch.Tensor,  # [bs + 1] int32: each request's prefix in kv_indices
    kv_indices: torch.Tensor,  # int32/int64 prefix slot ids
    custom_mask: torch.Tensor | None,  # flat bool/uint8, [e_b, p_b + e_b] per request
    mask_indptr: torch.Tensor | None,  # [bs + 1] int64 element offsets into custom_mask
    is_causal: bool,
    max_len_extend: int,  # max over requests of e_b: sizes the grid
    sm_scale: float,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window: int = -1,
    window_right: int = -1,  # keys after the query's column it sees (non-causal layers); -1 = no bound
    sinks: torch.Tensor | None = None,  # [Hq] float32 sink logits
    v_scale: float = 1.0,  # the output's scale (an fp8 cache's v_scale; fold k_scale into sm_scale)
) -> None:
    """Extend attention over the cached prefix and the new tokens (see the module docstring)."""
    num_tokens, num_q_heads, dk = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    dv = v_extend.shape[-1]
    bs = qo_indptr.shape[0] - 1
    if k_buffer.shape[-1] != dk or k_extend.shape[-1] != dk:
        raise ValueError(
            f"head dims differ: q_extend {dk}, k_extend {k_extend.shape[-1]}, "
            f"k_buffer {k_buffer.shape[-1]}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q_extend has {num_q_heads} heads, not a multiple of k_extend's {num_kv_heads}"
        )
    use_custom_mask = custom_mask is not None
    if use_custom_mask:
        if mask_indptr is None:
            raise ValueError("custom_mask is given but mask_indptr is None: pass both")
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)  # same bytes; Triton loads it as u8
    else:
        # never read (USE_CUSTOM_MASK is False); any tensors keep the signature uniform
        custom_mask, mask_indptr = qo_indptr, qo_indptr

    dims = HeadDims.of(dk, dv)
    launch = _ExtendLaunch.choose(dims)
    grid = (bs, num_q_heads, triton.cdiv(max_len_extend, launch.block_m))
    if num_tokens == 0 or grid[2] == 0:
        return
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: expected one logit per query head ({num_q_heads},)")
    _extend_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, lse_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
        sinks if sinks is not None else lse_extend,
        sm_scale, logit_cap, sliding_window, window_right, v_scale,
        *q_extend.stride(), *k_extend.stride(), *v_extend.stride(),
        *o_extend.stride(), *lse_extend.stride(),
        *k_buffer.stride(), *v_buffer.stride(),
        GROUP=num_q_heads // num_kv_heads,
        **dims.constexprs(),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        IS_CAUSAL=is_causal,
        USE_CUSTOM_MASK=use_custom_mask,
        SKIP_PREFIX_CUSTOM_MASK=skip_prefix_custom_mask,
        USE_SLIDING_WINDOW=sliding_window >= 0,
        USE_WINDOW_RIGHT=window_right >= 0,
        USE_LOGIT_CAP=logit_cap > 0,
        HAS_SINKS=sinks is not None,
        **dot_flags(q_extend.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
