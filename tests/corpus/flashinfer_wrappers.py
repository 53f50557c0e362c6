"""FlashInfer wrapper state that outlives the plan it belonged to.

- flashinfer-ai/flashinfer#1028 (2025-04): a prefill wrapper planned with a custom mask (a
  speculative verify) and then planned again without one (a causal extend, when no draft token was
  proposed) kept `_custom_mask_buf`, so the causal step ran with the old tree mask.

- flashinfer-ai/flashinfer#4299 (2026-07, open): FA2 prefill never validates head_dim: a head_dim
  that is a multiple of 16 but not of 64 (80, 96: Phi-2, Phi-3-mini) faults with an illegal memory
  access, one not a multiple of 16 returns wrong results. A library defect: only running the
  kernel on the step's shape finds it (a GPU check).

Recorded through the SGLang hooks on SGLang's FlashInfer backend, one wrapper object planned for a
verify step and then for an extend step: the recorder reads what the wrapper holds at each step
(FlashInfer's `_qo_indptr_buf`, `_paged_kv_*_buf`, `_custom_mask_buf`, `_mask_indptr_buf`), which
is what its kernel reads.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import torch

from attndbg.trace import tree
from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
ROWS = {1: list(range(10, 24)), 4: list(range(40, 52))}
PARENTS = [[-1, 0, 0, 1], [-1, 0, 1, 1]]  # EAGLE trees, topk 2
N = len(PARENTS[0])
VERIFY_PREFIX = [6, 4]
EXTEND_PREFIX, EXTEND_NEW = [10, 8], [3, 4]  # the next step: a causal extend of the same requests


def _pack(bits: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's plan(): each request's q_len x kv_len segment packed little-endian to whole bytes
    (segment_packbits), with the byte offsets (mask_indptr)."""
    packed, offsets, start = [], [0], 0
    for q, kv in zip(q_lens.tolist(), kv_lens.tolist()):
        segment = bits[start : start + q * kv]
        start += q * kv
        packed.append(torch.from_numpy(numpy.packbits(segment.numpy(), bitorder="little")))
        offsets.append(offsets[-1] + packed[-1].numel())
    return torch.cat(packed), torch.tensor(offsets, dtype=I32)


def _plan(made: Any, fb: Any, *, keeps_mask: bool) -> None:
    """BatchPrefillWithPagedKVCacheWrapper.plan on the backend's one prefill wrapper: a verify step
    plans it with the tree mask; an extend step plans it causal, without a mask."""
    paged = made.shared_wrapper
    verify = fb.forward_mode == sg.env.ForwardMode.TARGET_VERIFY
    if verify:
        q_lens = torch.full((fb.batch_size,), N, dtype=I64)
        kv = fb.seq_lens.to(I64) + N
    else:
        q_lens = fb.extend_seq_lens.to(I64)
        kv = fb.seq_lens.to(I64)
    indptr, indices = sg.kv_lists(made, fb, kv, size=int(kv.sum()) + 256, garbage=0)
    paged._qo_indptr_buf = torch.nn.functional.pad(torch.cumsum(q_lens, 0), (1, 0)).to(I32)
    paged._paged_kv_indptr_buf = indptr
    paged._paged_kv_indices_buf = indices.to(I32)
    paged._paged_kv_last_page_len_buf = torch.ones(kv.numel(), dtype=I32)
    if verify:
        paged._custom_mask_buf, paged._mask_indptr_buf = _pack(fb.spec_info.custom_mask, q_lens, kv)
    elif not keeps_mask:  # the fix: a plan without a mask drops the old one
        paged._custom_mask_buf = paged._mask_indptr_buf = None
    made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=[paged], use_ragged=False, extend_no_prefix=False)


STALE_EXTEND_NEW = [3, 2]  # the extend of #1028's steps: each request's q_len x kv_len block lies inside the stale mask


def _two_steps(out: Path, *, keeps_mask: bool) -> None:
    """Both steps recorded with their layer (`record --layers 0`): the engine's output is what
    FlashInfer computes from the wrapper as each step left it (sg.flashinfer_paged_prefill)."""
    with sg.recording(out, layers=(0,)) as session:
        layer = sg.layer()
        made = sg.backend(sg.CorpusFlashInfer, ROWS, lambda m, fb: _plan(m, fb, keeps_mask=keeps_mask))
        made.shared_wrapper = SimpleNamespace()
        for seed, fb in enumerate((sg.verify_batch(ROWS, VERIFY_PREFIX, PARENTS), sg.extend_batch(ROWS, EXTEND_PREFIX, STALE_EXTEND_NEW))):
            data = sg.layer_data(1028 + seed, tokens=int(fb.out_cache_loc.numel()))
            k_cache, v_cache = sg.with_new_kv(data, fb)
            made.token_to_kv_pool = sg.kv_pool(data["k_pool"], data["v_pool"])
            made.run_layer = lambda q, k, v, layer, fb, k_cache=k_cache, v_cache=v_cache: sg.flashinfer_paged_prefill(made.shared_wrapper, q, k_cache, v_cache, layer.scaling).to(q.dtype)
            sg.record_eager(session, made, fb)
            made.forward(data["q"], data["k"], data["v"], layer, fb)


def write_1028(bug: Path, twin: Path) -> None:
    _two_steps(bug, keeps_mask=True)
    _two_steps(twin, keeps_mask=False)


def _paged_extend(made: Any, fb: Any) -> None:
    """SGLang FlashInfer's paged-only extend (use_ragged False: deterministic inference, multimodal
    models): one paged prefill wrapper over prefix + new tokens, causal."""
    kv = fb.seq_lens.to(I64)
    indptr, indices = sg.kv_lists(made, fb, kv, size=int(kv.sum()) + 256, garbage=0)
    paged = sg.wrapper(
        qo_indptr_buf=torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32),
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices.to(I32),
        paged_kv_last_page_len_buf=torch.ones(kv.numel(), dtype=I32),
    )
    made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=[paged], use_ragged=False, extend_no_prefix=False)


def _head_dim(out: Path, head_dim: int) -> None:
    with sg.recording(out) as session:
        layer = sg.layer(heads=4, kv_heads=4, head_dim=head_dim)  # noqa: F841 - Phi-3-mini's heads are MHA, 96 wide
        made = sg.backend(sg.CorpusFlashInfer, ROWS, _paged_extend)
        sg.record_eager(session, made, sg.extend_batch(ROWS, EXTEND_PREFIX, EXTEND_NEW))


def write_4299(bug: Path, twin: Path) -> None:
    _head_dim(bug, 96)
    _head_dim(twin, 128)


BUGS = (
    RealBug(
        id="flashinfer-1028",
        title="Prefill wrapper re-planned causal keeps the custom mask of its verify plan",
        links=("https://github.com/flashinfer-ai/flashinfer/pull/1028",),
        date="2025-04",
        engine="FlashInfer (SGLang flashinfer backend)",
        mode="TARGET_VERIFY, then EXTEND",
        mechanism="BatchPrefillWithPagedKVCacheWrapper.plan without a custom mask did not reset _custom_mask_buf, so a "
        "wrapper planned for a speculative verify and then for a causal prefill (no draft tokens) ran the causal step with "
        "the old tree mask",
        encoding="one FlashInfer prefill wrapper recorded at two steps: an EAGLE verify (topk 2, n=4) with its packed mask, "
        "then a causal extend (prefixes 10, 8; 3 and 2 new) whose wrapper still holds the verify's _custom_mask_buf and "
        "_mask_indptr_buf; layer 0 recorded at both, with the output FlashInfer computes from the wrapper (the extend's from "
        "the stale mask, each request's block inside it)",
        expected=("tree-mask/stale-mask", "tree-mask/stale-after-causal", "tree-mask/mask-on-causal-step", "split-merge/recorded-output-mismatch"),
        keywords=("stale", "earlier verify", "#1028"),
        capabilities=(Capability.STALE_PLAN, Capability.PACKED_MASK),
        write=write_1028,
    ),
    RealBug(
        id="flashinfer-4299",
        title="FA2 prefill at head_dim 96 (not a multiple of 64): illegal memory access, no validation",
        links=("https://github.com/flashinfer-ai/flashinfer/issues/4299", "https://github.com/flashinfer-ai/flashinfer/issues/455"),
        date="2026-07",
        engine="FlashInfer FA2 prefill (SGLang flashinfer backend)",
        mode="EXTEND",
        mechanism="FlashInfer's FA2 prefill JIT-compiles a module for any head_dim and never validates it: 80, 96, 112 ... fault "
        "with an illegal memory access, 72, 136 ... return wrong results silently (Phi-3-mini's head_dim is 96)",
        encoding="2 requests (prefixes 10, 8; 3 and 4 new) of a 4-head MHA layer at head_dim 96; SGLang FlashInfer paged-only "
        "extend plan. A library defect: the step is right, the kernel is not",
        expected=("backend-crash/backend-crashed", "replay/kernel-fails-reference"),
        keywords=("head_dim", "FlashInfer"),
        capabilities=(Capability.KERNEL_RUN,),
        twin_note="the same step at head_dim 128, a width FA2 prefill handles (the defect is in the library, not the step)",
        write=write_4299,
    ),
)
