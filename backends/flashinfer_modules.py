"""FlashInfer's JIT modules named without running anything: which `JitSpec` a wrapper call loads.

FlashInfer compiles a module the first time a call needs it, and which module that is follows from
the call's parameters alone: the dtypes, head dims, position encoding, whether a window or a logits
soft cap is on, fp16 QK reduction, and for prefill the kernel family (FA2, or FA3 on SM90), which its
backend "auto" picks with `flashinfer.utils.determine_attention_backend`. The adapters
(backends/flashinfer.py, fa3.py, mla.py) declare their calls through the functions here, each of
which asks FlashInfer's own spec function (`flashinfer.jit...gen_*_module`) for the spec, so a name
is never restated. Read from FlashInfer 0.7.2.post1 (prefill.py `get_batch_prefill_module`,
decode.py `BatchDecodeWithPagedKVCacheWrapper.plan`, mla/_batch_mla/_backends/_fa_common.py):

    batch decode, CUDA cores        gen_batch_decode_module
    batch decode, tensor cores      the FA2 prefill module (backend "auto" is FA2 unless q or KV is fp8)
    paged / ragged prefill, FA2     the primary module (URI suffix _kv_stride_equal); a paged run
                                    whose K and V strides differ (head_dim != v_head_dim) loads the
                                    independent-stride module (_paged_kv_stride_independent) too
    prefill, FA3 (SM90)             gen_batch_prefill_module("fa3", ...) (suffix _sm90)
    MLA                             gen_batch_mla_module(backend "fa2" or "fa3")
    merge_state                     the cascade module
    segment_packbits                the quantization module (a paged plan() given a bool custom mask)

What this cannot see: a spec FlashInfer picks on a GPU family not read here (Blackwell's ragged
"auto" may upgrade FA2 to cuDNN or CUTLASS), or one a later release adds to a call. A module missed
is compiled on first use, as before: a miss costs time, never a wrong answer.

Getting a spec may write its generated sources under FlashInfer's JIT directory (they are what the
build compiles). flashinfer is imported only inside these functions: this module imports without it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from attndbg import machine
from attndbg.backends.flashinfer_jit import available  # noqa: F401 - the adapters ask fm.available()

# FlashInfer's index dtype in every plan our adapters make (kv_indptr, qo_indptr: int32).
INDEX_DTYPE = "int32"
# Position encoding: none (FlashInfer's PosEncodingMode.NONE); no adapter applies RoPE in the kernel.
POS_ENCODING_NONE = 0
# The arch FlashInfer compiles for when told (its compilation context reads it too): "9.0a 10.0a".
ARCH_VARIABLE = "FLASHINFER_CUDA_ARCH_LIST"
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SM90 = (9, 0)


@dataclass(frozen=True)
class Target:
    """The machine the modules are declared for: its GPU's compute capability (None: no GPU known)."""

    capability: tuple[int, int] | None

    @property
    def sm90(self) -> bool:
        return self.capability == SM90


def target() -> Target:
    """This machine's GPU (device 0), else the first arch of FLASHINFER_CUDA_ARCH_LIST ("9.0a": an
    H100/H200, for declaring on a machine without a GPU), else none."""
    info = machine.gpu_info()
    if info is not None:
        return Target(info.capability)
    listed = os.environ.get(ARCH_VARIABLE, "").split()
    if listed:
        major, _, minor = listed[0].partition(".")
        digits = "".join(c for c in minor if c.isdigit())
        if major.isdigit() and digits:
            return Target((int(major), int(digits)))
    return Target(None)


def _dtype(name: str) -> Any:
    import torch

    from attndbg.trace.schema import DTYPES

    return torch.int32 if name == INDEX_DTYPE else DTYPES[name]


def prefill_family(at: Target, *, q_dtype: str, kv_dtype: str, head_dim_qk: int, head_dim_vo: int, custom_mask: bool = False) -> str:
    """"fa3" or "fa2": what FlashInfer's backend "auto" picks for a prefill call on `at`
    (determine_attention_backend: SM90 with FA3's features and head dims, else FA2). Its own
    feature and head-dim tests are asked; only the arch is ours, since it asks the device."""
    from flashinfer.utils import is_fa3_backend_supported, is_fa3_prefill_head_dim_supported

    if not at.sm90:
        return "fa2"
    if not is_fa3_backend_supported(POS_ENCODING_NONE, False, custom_mask, _dtype(q_dtype), _dtype(kv_dtype)):
        return "fa2"
    return "fa3" if is_fa3_prefill_head_dim_supported(head_dim_qk, head_dim_vo) else "fa2"


def tensor_core_decode_family(at: Target, *, q_dtype: str, kv_dtype: str) -> str:
    """The prefill family tensor-core decode plans with: FA2, unless q or KV is fp8 (then
    determine_attention_backend, without head dims)."""
    from flashinfer.utils import is_fa3_backend_supported

    if q_dtype not in FP8_DTYPES and kv_dtype not in FP8_DTYPES:
        return "fa2"
    return "fa3" if at.sm90 and is_fa3_backend_supported(POS_ENCODING_NONE, False, False, _dtype(q_dtype), _dtype(kv_dtype)) else "fa2"


@functools.cache
def _spec(kind: str, args: tuple) -> Any:
    """FlashInfer's spec for `kind` with `args` (made once per process: making one renders sources)."""
    from flashinfer.jit import attention as fa
    from flashinfer.jit.attention import modules

    makers = {
        "decode": fa.gen_batch_decode_module,
        "prefill": fa.gen_batch_prefill_module,
        "prefill_primary": modules._gen_batch_prefill_primary_module,
        "prefill_independent_paged": modules._gen_batch_prefill_independent_paged_module,
        "mla": fa.gen_batch_mla_module,
    }
    if kind == "cascade":
        from flashinfer.jit.cascade import gen_cascade_module

        return gen_cascade_module()
    if kind == "quantization":
        from flashinfer.jit.quantization import gen_quantization_module

        return gen_quantization_module()
    return makers[kind](*args)


def decode(*, q_dtype: str, kv_dtype: str, head_dim: int, window_left: int, logits_soft_cap: float) -> list[Any]:
    """BatchDecodeWithPagedKVCacheWrapper on CUDA cores: get_batch_decode_module's spec."""
    q = _dtype(q_dtype)
    args = (q, _dtype(kv_dtype), q, _dtype(INDEX_DTYPE), head_dim, head_dim, POS_ENCODING_NONE, window_left != -1, logits_soft_cap > 0)
    return [_spec("decode", args)]


def prefill(
    family: str, *, q_dtype: str, kv_dtype: str, head_dim_qk: int, head_dim_vo: int, window_left: int, logits_soft_cap: float, paged_strides_differ: bool = False
) -> list[Any]:
    """get_batch_prefill_module(family, ...): FA2's primary module (and, for a paged run whose K and
    V strides differ, the independent-stride module it loads lazily), or FA3's module."""
    q = _dtype(q_dtype)
    args = (family, q, _dtype(kv_dtype), q, _dtype(INDEX_DTYPE), head_dim_qk, head_dim_vo, POS_ENCODING_NONE, window_left >= 0, logits_soft_cap > 0, False)
    if family == "fa3":
        return [_spec("prefill", args)]
    return [_spec("prefill_primary", args)] + ([_spec("prefill_independent_paged", args)] if paged_strides_differ else [])


def mla(family: str, *, q_dtype: str, kv_dtype: str, head_dim_ckv: int, head_dim_kpe: int) -> list[Any]:
    """BatchMLAPagedAttentionWrapper(backend=family): get_batch_mla_module's spec (no profiler)."""
    q = _dtype(q_dtype)
    return [_spec("mla", (family, q, _dtype(kv_dtype), q, _dtype(INDEX_DTYPE), head_dim_ckv, head_dim_kpe, False))]


def cascade() -> list[Any]:
    """flashinfer.cascade.merge_state and its kin."""
    return [_spec("cascade", ())]


def quantization() -> list[Any]:
    """flashinfer.quantization.segment_packbits: what a paged plan() packs a bool custom mask with."""
    return [_spec("quantization", ())]
