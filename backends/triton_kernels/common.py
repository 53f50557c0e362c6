"""Pieces shared by the decode and extend kernels, so both do the score/softmax step one way.

Host side: how a head dim is tiled (`HeadDims`), the dot-product flags for this Triton mode.
Jitted: `dot` (with the interpreter's bf16 workaround), `load_kv_tile` (K/V through slot ids,
any strides), `attend_tile` (scores, soft-cap, mask, one online-softmax step with the -inf guard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attndbg.machine import TritonMode, select_triton_mode


# ---------------------------------------------------------------------------------------------
# Host side: head-dim tiling and launch parameters
# ---------------------------------------------------------------------------------------------

# Head dims whose key is a power-of-2 "main" part plus a rope tail, loaded as two tiles instead
# of one padded tile: 576 = MLA (512 latent + 64 rope), 192 = MLA prefill q/k (128 + 64).
_ROPE_TAIL_SPLITS = {576: (512, 64), 192: (128, 64), 288: (256, 32)}


@dataclass(frozen=True)
class HeadDims:
    """How a key head dim Dk and value head dim Dv are tiled in the kernels."""

    d_model: int  # Dk without the rope tail: columns [0, d_model) of q/k form the main tile
    dv: int  # Dv
    block_dmodel: int  # power of 2 >= d_model; columns past d_model are masked
    block_dpe: int  # rope tail width, columns [d_model, d_model + block_dpe); 0 when none
    block_dv: int  # power of 2 >= dv; columns past dv are masked

    @classmethod
    def of(cls, dk: int, dv: int) -> HeadDims:
        d_model, block_dpe = _ROPE_TAIL_SPLITS.get(dk, (dk, 0))
        return cls(
            d_model=d_model,
            dv=dv,
            block_dmodel=triton.next_power_of_2(d_model),
            block_dpe=block_dpe,
            block_dv=triton.next_power_of_2(dv),
        )

    def constexprs(self) -> dict[str, int]:
        return dict(
            D_MODEL=self.d_model,
            DV=self.dv,
            BLOCK_DMODEL=self.block_dmodel,
            BLOCK_DPE=self.block_dpe,
            BLOCK_DV=self.block_dv,
        )


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs that pick how every tl.dot in our kernels runs.

    DOT_FP32: under TRITON_INTERPRET=1 (triton 3.9) tl.dot on bf16 operands returns garbage
    (measured: max error 2.5e10 on a 16x16 product; the interpreter hands the raw bf16 bits to
    numpy.matmul), while fp32 operands are exact. So when interpreted we upcast both operands to
    fp32 *after* rounding them to the storage dtype, which keeps the GPU's numerics (bf16 inputs,
    fp32 accumulation). On the GPU the dots stay in the native dtype (tensor cores).
    DOT_PRECISION: fp32 inputs use exact "ieee" products instead of Triton's default tf32, so an
    fp32 run is a precise reference rather than a 10-bit-mantissa one.
    """
    return dict(
        DOT_FP32=select_triton_mode() is TritonMode.INTERPRETER,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def interpreted() -> bool:
    return select_triton_mode() is TritonMode.INTERPRETER


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)



# ---------------------------------------------------------------------------------------------
# Jitted helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; see `dot_flags` for why the interpreter upcasts."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x):
    # There is no portable tl.tanh; 2 / (1 + e^-2x) - 1 saturates to +-1 without overflow NaNs.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def load_kv_tile(
    K,  # pointer to K of this kv head (row 0)
    V,  # pointer to V of this kv head (row 0)
    offs_row,  # [BLOCK_N] int64 rows (cache slots or token rows) to read
    mask_n,  # [BLOCK_N] which of them exist
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    D_MODEL: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Load K transposed as [BLOCK_DMODEL, BLOCK_N] (+ rope tail [BLOCK_DPE, BLOCK_N]) and V as
    [BLOCK_N, BLOCK_DV]. Missing rows and padded columns read as 0."""
    offs_d = tl.arange(0, BLOCK_DMODEL)
    k = tl.load(
        K + offs_row[None, :] * stride_kn + offs_d[:, None] * stride_kd,
        mask=mask_n[None, :] & (offs_d[:, None] < D_MODEL),
        other=0.0,
    )
    if BLOCK_DPE > 0:
        offs_dpe = D_MODEL + tl.arange(0, BLOCK_DPE)
        k_pe = tl.load(
            K + offs_row[None, :] * stride_kn + offs_dpe[:, None] * stride_kd,
            mask=mask_n[None, :],
            other=0.0,
        )
    else:
        k_pe = k  # placeholder, never used when BLOCK_DPE == 0
    offs_dv = tl.arange(0, BLOCK_DV)
    v = tl.load(
        V + offs_row[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=mask_n[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    return k, k_pe, v


@triton.jit
def attend_tile(
    acc,  # [ROWS, BLOCK_DV] float32, un-normalised output so far
    l_i,  # [ROWS] float32, sum of exp(score - m_i) so far
    m_i,  # [ROWS] float32, running max score (-inf while nothing was visible)
    q,  # [ROWS, BLOCK_DMODEL]
    q_pe,  # [ROWS, BLOCK_DPE] (placeholder when BLOCK_DPE == 0)
    k,  # [BLOCK_DMODEL, BLOCK_N]
    k_pe,  # [BLOCK_DPE, BLOCK_N]
    v,  # [BLOCK_N, BLOCK_DV]
    visible,  # bool, broadcastable to [ROWS, BLOCK_N]
    sm_scale,
    logit_cap,
    BLOCK_DPE: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the online softmax over a tile of keys; returns the new (acc, l_i, m_i)."""
    # scores: qk = (q . k) * sm_scale, optionally soft-capped with tanh
    qk = dot(q, k, DOT_FP32, DOT_PRECISION)
    if BLOCK_DPE > 0:
        qk += dot(q_pe, k_pe, DOT_FP32, DOT_PRECISION)
    qk = qk * sm_scale
    if USE_LOGIT_CAP:
        qk = logit_cap * _tanh(qk / logit_cap)
    qk = tl.where(visible, qk, float("-inf"))

    # online softmax: new running max, then rescale what was accumulated under the old one.
    # A row that has seen no visible key keeps m = -inf; subtract 0 instead so that
    # exp(-inf - -inf) = NaN never happens (its p and alpha are then exp(-inf) = 0).
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_base)
    p = tl.exp(qk - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to V's dtype for the tensor-core product, as in the fused-attention tutorial.
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
    return acc, l_i, m_new
