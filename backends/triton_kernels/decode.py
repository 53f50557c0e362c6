"""Split-KV decode attention (SGLang Triton-backend semantics), for MHA, GQA/MQA and MLA.

One query token per request attends to the request's KV slots, read through
`kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. The work is split along the KV sequence:

  stage 1: each (request, kv head, block of query heads, split) program computes the
           softmax-normalised partial output of its split and the split's natural-log LSE;
  stage 2: each (request, query head) program merges the splits with online rescaling.

Split boundaries (both stages compute them the same way, `_split_range`):
  kv_len_per_split = cdiv(cdiv(seq_len, num_kv_splits[b]), MIN_BLOCK_KV) * MIN_BLOCK_KV
  split s covers [s * kv_len_per_split, min((s + 1) * kv_len_per_split, seq_len)).
An empty split writes nothing in stage 1 and is skipped in stage 2, so merging never computes
exp(-inf - -inf) (FlashInfer #4051 is that bug). Sinks (one more softmax term per query head, with
no value) and a scaled fp8 cache's v_scale belong to the merge, so stage 2 applies them once; K
and V are read in any dtype and computed in q's (k_scale is folded into sm_scale by the caller).

The score/softmax step is shared with the extend kernel through common.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import HeadDims, _check, attend_tile, dot_flags, interpreted, load_kv_tile
from .split_rule import MIN_BLOCK_KV
# tl.dot needs at least 16 rows: query heads of one kv head are padded up to this.
MIN_BLOCK_H = 16


def _check_scratch(
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    *,
    bs: int,
    num_q_heads: int,
    max_kv_splits: int,
    dv: int,
) -> None:
    """The split scratch may be larger than the batch (engines keep one buffer for the largest
    CUDA-graph batch); it must hold bs rows of num_q_heads x max_kv_splits float32 partials."""
    logits_ok = (
        attn_logits.dim() == 4
        and attn_logits.shape[0] >= bs
        and attn_logits.shape[1] == num_q_heads
        and attn_logits.shape[2] >= max_kv_splits
        and attn_logits.shape[3] == dv
    )
    lse_ok = (
        attn_lse.dim() == 3
        and attn_lse.shape[0] >= bs
        and attn_lse.shape[1] == num_q_heads
        and attn_lse.shape[2] >= max_kv_splits
    )
    _check(
        logits_ok and lse_ok and attn_logits.dtype == attn_lse.dtype == torch.float32,
        f"split scratch attn_logits {tuple(attn_logits.shape)} {attn_logits.dtype}, attn_lse "
        f"{tuple(attn_lse.shape)} {attn_lse.dtype}: expected float32 [>={bs}, {num_q_heads}, "
        f">={max_kv_splits}, {dv}] and [>={bs}, {num_q_heads}, >={max_kv_splits}]",
    )


@triton.jit
def _split_range(Kv_Indptr, Num_Kv_Splits, cur_batch, split, MIN_BLOCK_KV: tl.constexpr):
    """[split_start, split_end) of this split inside the request's KV, and the request's first
    index into kv_indices. Both stages call this, so they agree on the boundaries."""
    kv_start = tl.load(Kv_Indptr + cur_batch)
    seq_len = tl.load(Kv_Indptr + cur_batch + 1) - kv_start
    num_splits = tl.load(Num_Kv_Splits + cur_batch)
    kv_len_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_start = split * kv_len_per_split
    split_end = tl.minimum(split_start + kv_len_per_split, seq_len)
    return kv_start, split_start, split_end


# ---------------------------------------------------------------------------------------------
# Stage 1: partial attention per split
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_stage1_kernel(
    Q,  # [bs, Hq, Dk]
    K_Buffer,  # [N, Hkv, Dk]
    V_Buffer,  # [N, Hkv, Dv]
    Kv_Indptr,  # [bs + 1] int32
    Kv_Indices,  # [kv_indptr[-1]] int32/int64 slot ids
    Num_Kv_Splits,  # [bs] int32
    Att_Out,  # [bs, Hq, max_kv_splits, Dv] float32: normalised partial outputs
    Att_Lse,  # [bs, Hq, max_kv_splits] float32: natural-log LSE of each split
    sm_scale,
    logit_cap,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_ab, stride_ah, stride_as, stride_ad,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_BLOCKS: tl.constexpr,  # cdiv(GROUP, BLOCK_H): programs per kv head
    D_MODEL: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)

    # The BLOCK_H query heads of this program all share one kv head (MHA: GROUP = 1, the block is
    # padded up to MIN_BLOCK_H rows so the scores are still one tl.dot).
    cur_kv_head = pid_h // HEAD_BLOCKS
    offs_g = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = cur_kv_head * GROUP + offs_g

    kv_start, split_start, split_end = _split_range(
        Kv_Indptr, Num_Kv_Splits, cur_batch, split, MIN_BLOCK_KV
    )
    # Empty split (short request, or split >= num_kv_splits[b]): write nothing.
    if split_end > split_start:
        offs_d = tl.arange(0, BLOCK_DMODEL)
        q_ptrs = Q + cur_batch * stride_qb + offs_h[:, None] * stride_qh
        q = tl.load(
            q_ptrs + offs_d[None, :] * stride_qd,
            mask=mask_h[:, None] & (offs_d[None, :] < D_MODEL),
            other=0.0,
        )
        if BLOCK_DPE > 0:
            offs_dpe = D_MODEL + tl.arange(0, BLOCK_DPE)
            q_pe = tl.load(q_ptrs + offs_dpe[None, :] * stride_qd, mask=mask_h[:, None], other=0.0)
        else:
            q_pe = q  # placeholder, never used

        K = K_Buffer + cur_kv_head * stride_kh
        V = V_Buffer + cur_kv_head * stride_vh
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            # 64-bit slot ids: slot * stride overflows int32 on large caches
            kv_loc = tl.load(Kv_Indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k, k_pe, v = load_kv_tile(
                K, V, kv_loc, mask_n, stride_kn, stride_kd, stride_vn, stride_vd,
                D_MODEL, DV, BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV,
            )
            k, k_pe, v = k.to(q.dtype), k_pe.to(q.dtype), v.to(q.dtype)  # an fp8 cache is computed in q's dtype
            # Padded head rows have q = 0 and finite scores, so only key columns are masked;
            # the first tile of a non-empty split always has a visible key.
            acc, l_i, m_i = attend_tile(
                acc, l_i, m_i, q, q_pe, k, k_pe, v, mask_n[None, :], sm_scale, logit_cap,
                BLOCK_DPE, USE_LOGIT_CAP, DOT_FP32, DOT_PRECISION,
            )

        # the split's normalised output and natural-log LSE (l_i >= 1: the max term is exp(0))
        offs_dv = tl.arange(0, BLOCK_DV)
        out_ptrs = Att_Out + cur_batch * stride_ab + offs_h[:, None] * stride_ah + split * stride_as
        tl.store(
            out_ptrs + offs_dv[None, :] * stride_ad,
            acc / l_i[:, None],
            mask=mask_h[:, None] & (offs_dv[None, :] < DV),
        )
        lse_ptrs = Att_Lse + cur_batch * stride_lb + offs_h * stride_lh + split * stride_ls
        tl.store(lse_ptrs, m_i + tl.log(l_i), mask=mask_h)


# ---------------------------------------------------------------------------------------------
# Stage 2: merge the splits
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_stage2_kernel(
    Att_Out,  # [bs, Hq, max_kv_splits, Dv] float32
    Att_Lse,  # [bs, Hq, max_kv_splits] float32
    O,  # [bs, Hq, Dv]
    Lse,  # [bs, Hq] float32
    Kv_Indptr,
    Num_Kv_Splits,
    Sinks,  # [Hq] float32 sink logits (a dummy pointer when HAS_SINKS is False)
    max_kv_splits,
    v_scale,
    stride_ab, stride_ah, stride_as, stride_ad,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    stride_sb, stride_sh,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    out_ptrs = Att_Out + cur_batch * stride_ab + cur_head * stride_ah + offs_dv * stride_ad
    lse_ptr = Att_Lse + cur_batch * stride_lb + cur_head * stride_lh
    # num_kv_splits[b] > max_kv_splits is a caller bug; stage 1 computed only the first
    # max_kv_splits splits, so stop there instead of reading past the scratch.
    num_splits = tl.minimum(tl.load(Num_Kv_Splits + cur_batch), max_kv_splits)

    # online merge: each split is (o_s, lse_s) with o_s already normalised, so its weight is
    # exp(lse_s - m) relative to the running max m of the LSEs.
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in range(0, num_splits):
        _, split_start, split_end = _split_range(
            Kv_Indptr, Num_Kv_Splits, cur_batch, split, MIN_BLOCK_KV
        )
        # stage 1 wrote nothing for an empty split: skip it (its scratch holds garbage)
        if split_end > split_start:
            o_s = tl.load(out_ptrs + split * stride_as, mask=mask_dv, other=0.0)
            lse_s = tl.load(lse_ptr + split * stride_ls)
            m_new = tl.maximum(m, lse_s)  # finite: lse_s of a non-empty split is finite
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse_s - m_new)
            acc = acc * alpha + w * o_s
            total = total * alpha + w
            m = m_new

    if HAS_SINKS:
        # the sink: one more term exp(sink - m) in the denominator, with no value
        sink = tl.load(Sinks + cur_head)
        m_new = tl.maximum(m, sink)  # finite: the sink is
        alpha = tl.exp(m - m_new)
        acc = acc * alpha
        total = total * alpha + tl.exp(sink - m_new)
        m = m_new

    # seq_len 0 (and no sink): no split was merged; write 0 and lse = -inf instead of 0/0
    has_kv = total > 0.0
    o = tl.where(has_kv, acc / tl.where(has_kv, total, 1.0), 0.0) * v_scale
    lse = tl.where(has_kv, m + tl.log(tl.where(has_kv, total, 1.0)), float("-inf"))
    tl.store(O + cur_batch * stride_ob + cur_head * stride_oh + offs_dv * stride_od,
             o.to(O.dtype.element_ty), mask=mask_dv)
    tl.store(Lse + cur_batch * stride_sb + cur_head * stride_sh, lse)


# ---------------------------------------------------------------------------------------------
# Python wrappers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stage1Launch:
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def choose(cls, *, group: int, dims: HeadDims) -> _Stage1Launch:
        # Up to 64 query heads of one kv head share each K/V tile; 16 is tl.dot's minimum.
        # Wide MLA heads (Dv 512) keep 16 rows so the [BLOCK_H, BLOCK_DV] fp32 accumulator
        # stays in registers.
        max_h = MIN_BLOCK_H if dims.block_dv >= 512 else 64
        block_h = min(max(MIN_BLOCK_H, triton.next_power_of_2(group)), max_h)
        if interpreted():
            # ~3-4 ms per loop iteration of a program under the interpreter, whatever the
            # tile size: fewer, larger tiles.
            return cls(block_h=block_h, block_n=64, num_warps=4, num_stages=1)
        # Memory-bound: K/V tiles large enough to keep several loads in flight per SM, small
        # enough that K, V and the accumulator stay out of local memory. Measured on an H200,
        # triton 3.6, bs 64 (d 256: 32), kv 4096, bf16, scattered slots, 2-8 splits:
        #   d 128, 32/8 heads: BLOCK_N 128: 268-277 us; 64: 283-298; 32: 284-293
        #                      (FlashInfer decode, tensor cores: 260 us; CUDA cores: 384 us);
        #   d 256, 32/8 heads: BLOCK_N 32: 267-270 us; 64: 318-394; 128: 399-406;
        #   MLA 576/512, 16 heads: BLOCK_N 32: 133 us (4 splits); 16: 169-207; 8 warps: 198+.
        # 4 warps and 2 stages were best or within 2% everywhere.
        width = dims.block_dmodel + dims.block_dpe + dims.block_dv
        block_n = 128 if width < 512 else 32
        return cls(block_h=block_h, block_n=block_n, num_warps=4, num_stages=2)


def decode_stage1(
    *,
    q: torch.Tensor,  # [bs, Hq, Dk]
    k_buffer: torch.Tensor,  # [N, Hkv, Dk], any strides
    v_buffer: torch.Tensor,  # [N, Hkv, Dv], any strides (MLA: a view of k_buffer)
    kv_indptr: torch.Tensor,  # [bs + 1] int32
    kv_indices: torch.Tensor,  # [kv_indptr[-1]] int32 or int64
    attn_logits: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits, Dv] float32 scratch (written)
    attn_lse: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits] float32 scratch (written)
    num_kv_splits: torch.Tensor,  # [bs] int32 in [1, max_kv_splits]
    max_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> None:
    """Stage 1: per split, the normalised partial output and its natural-log LSE."""
    bs, num_q_heads, dk = q.shape
    _, num_kv_heads, dk_cache = k_buffer.shape
    dv = v_buffer.shape[-1]
    _check(dk == dk_cache, f"q head dim {dk} != k_buffer head dim {dk_cache}")
    _check(
        num_q_heads % num_kv_heads == 0,
        f"q has {num_q_heads} heads, not a multiple of k_buffer's {num_kv_heads} kv heads",
    )
    _check_scratch(
        attn_logits, attn_lse, bs=bs, num_q_heads=num_q_heads, max_kv_splits=max_kv_splits, dv=dv
    )
    if bs == 0:
        return
    group = num_q_heads // num_kv_heads
    dims = HeadDims.of(dk, dv)
    launch = _Stage1Launch.choose(group=group, dims=dims)
    head_blocks = triton.cdiv(group, launch.block_h)

    grid = (bs, num_kv_heads * head_blocks, max_kv_splits)
    _decode_stage1_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits, attn_logits, attn_lse,
        sm_scale, logit_cap,
        *q.stride(), *k_buffer.stride(), *v_buffer.stride(),
        *attn_logits.stride(), *attn_lse.stride(),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        **dims.constexprs(),
        BLOCK_H=launch.block_h,
        BLOCK_N=launch.block_n,
        MIN_BLOCK_KV=MIN_BLOCK_KV,
        USE_LOGIT_CAP=logit_cap > 0,
        **dot_flags(q.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )


def decode_stage2(
    *,
    attn_logits: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits, Dv] float32, from stage 1
    attn_lse: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits] float32, from stage 1
    o: torch.Tensor,  # [bs, Hq, Dv] (written, in o's dtype)
    lse: torch.Tensor,  # [bs, Hq] float32 natural log (written)
    kv_indptr: torch.Tensor,  # [bs + 1] int32
    num_kv_splits: torch.Tensor,  # [bs] int32, the same values stage 1 used
    max_kv_splits: int,
    sinks: torch.Tensor | None = None,  # [Hq] float32 sink logits, merged in once
    v_scale: float = 1.0,  # the output's scale (an fp8 cache's v_scale)
) -> None:
    """Stage 2: merge each request's non-empty splits (and the sinks) into o and its natural-log LSE."""
    bs, num_q_heads, dv = o.shape
    _check_scratch(
        attn_logits, attn_lse, bs=bs, num_q_heads=num_q_heads, max_kv_splits=max_kv_splits, dv=dv
    )
    _check(lse.shape == (bs, num_q_heads), f"lse {tuple(lse.shape)}: expected ({bs}, {num_q_heads})")
    _check(sinks is None or sinks.shape == (num_q_heads,), f"sinks {None if sinks is None else tuple(sinks.shape)}: expected ({num_q_heads},)")
    if bs == 0:
        return
    grid = (bs, num_q_heads)
    _decode_stage2_kernel[grid](
        attn_logits, attn_lse, o, lse, kv_indptr, num_kv_splits,
        sinks if sinks is not None else lse, max_kv_splits, v_scale,
        *attn_logits.stride(), *attn_lse.stride(), *o.stride(), *lse.stride(),
        DV=dv,
        BLOCK_DV=triton.next_power_of_2(dv),
        MIN_BLOCK_KV=MIN_BLOCK_KV,
        HAS_SINKS=sinks is not None,
        num_warps=4,
        num_stages=2,
    )


def decode_attention_fwd(
    *,
    q: torch.Tensor,  # [bs, Hq, Dk]
    k_buffer: torch.Tensor,  # [N, Hkv, Dk]
    v_buffer: torch.Tensor,  # [N, Hkv, Dv]
    o: torch.Tensor,  # [bs, Hq, Dv] (written)
    lse: torch.Tensor,  # [bs, Hq] float32 (written)
    kv_indptr: torch.Tensor,  # [bs + 1] int32
    kv_indices: torch.Tensor,  # int32 or int64 slot ids
    attn_logits: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits, Dv] float32 scratch
    attn_lse: torch.Tensor,  # [>=bs, Hq, >=max_kv_splits] float32 scratch
    num_kv_splits: torch.Tensor,  # [bs] int32
    max_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq] float32 sink logits
    v_scale: float = 1.0,  # an fp8 cache's v_scale (fold k_scale into sm_scale)
) -> None:
    """Split-KV decode attention: stage 1 then stage 2 (see the module docstring)."""
    decode_stage1(
        q=q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        attn_logits=attn_logits,
        attn_lse=attn_lse,
        num_kv_splits=num_kv_splits,
        max_kv_splits=max_kv_splits,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
    )
    decode_stage2(
        attn_logits=attn_logits,
        attn_lse=attn_lse,
        o=o,
        lse=lse,
        kv_indptr=kv_indptr,
        num_kv_splits=num_kv_splits,
        max_kv_splits=max_kv_splits,
        sinks=sinks,
        v_scale=v_scale,
    )
