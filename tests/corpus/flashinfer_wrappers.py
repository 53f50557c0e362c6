"""FlashInfer wrapper state that outlives the plan it belonged to.

- flashinfer-ai/flashinfer#1028 (2025-04): a prefill wrapper planned with a custom mask (a
  speculative verify) and then planned again without one (a causal extend, when no draft token was
  proposed) kept `_custom_mask_buf`, so the causal step ran with the old tree mask.

- flashinfer-ai/flashinfer#4299 (2026-07, open): FA2 prefill never validates head_dim: a head_dim
  that is a multiple of 16 but not of 64 (80, 96: Phi-2, Phi-3-mini) faults with an illegal memory
  access, one not a multiple of 16 returns wrong results. A library defect: only running the
  kernel on the step's shape finds it (a GPU check).

- flashinfer-ai/flashinfer#4002 (2026-07): under CUDA graphs with split-KV off (SGLang's
  deterministic inference: tensor-core decode, `disable_split_kv=True`), FA2's scheduler padded
  the grid to its split-KV occupancy bound but wrote a work item only per request and query tile,
  and no block_valid_mask: the padded thread blocks read whatever the pinned int workspace held
  there (an earlier plan's work items: an illegal memory access). The wrapper's own schedule
  (`_plan_info` and the int workspace it indexes) is what the recorder keeps as `plan.plan_info`.

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
from tests.plans.flashinfer_scheduler import prefill_plan_info

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


DECODE_ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38], 3: [60, 61, 62]}
DECODE_LENS = [5, 9, 3]
CAPTURE_BS = 4  # three decodes replayed in the bs-4 graph: one padded row (seq_len 1)
H100_SMS = 132  # plan() asks the device; 2 blocks an SM over 2 KV heads: grid 132 when padded
CTA_TILE_Q = 16  # FA2's query tile for one row x group 2 (FA2DetermineCtaTileQ)
EARLIER_REQUESTS = 16  # the fix's reproduction: 16 requests planned into the workspace before


def _schedule(kv_pages: list[int], *, exact_grid: bool, previous: bytes = b"") -> tuple[list[int], bytes]:
    """FlashInfer's prefill scheduler as tensor-core decode calls it under a CUDA graph with
    split-KV off: one query row a request (group 2 packed), one KV tile a request."""
    return prefill_plan_info(
        [1] * len(kv_pages), kv_pages, 1, group=sg.HEADS // sg.KV_HEADS, num_kv_heads=sg.KV_HEADS, num_sm=H100_SMS, cta_tile_q=CTA_TILE_Q,
        graph=True, disable_split_kv=True, exact_grid=exact_grid, previous=previous,
    )  # fmt: skip


def _deterministic_decode_graph(made: Any, view: Any, *, exact_grid: bool) -> None:
    """SGLang FlashInfer's decode replay with deterministic inference: the graph's tensor-core
    decode wrapper re-planned over the padded batch with disable_split_kv=True (its plan(): the
    indptrs into the graph buffers, then the scheduler's work items into the pinned int workspace,
    which an earlier 16-request plan used before)."""
    lens = view.seq_lens.to(I64)
    bs = lens.numel()
    indptr, indices = sg.kv_lists(made, view, lens, size=int(lens.sum()) + 16, garbage=0)
    decode = sg.wrapper(
        qo_indptr_buf=torch.arange(bs + 1, dtype=I32),  # a tensor-core graph decode wrapper's: one row a request
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices,
        paged_kv_last_page_len_buf=torch.ones(bs, dtype=I32),
    )
    decode._use_tensor_cores = True
    decode._use_cuda_graph = True
    decode._backend = "fa2"
    _, earlier = _schedule([7] * EARLIER_REQUESTS, exact_grid=exact_grid)
    vector, workspace = _schedule(lens.tolist(), exact_grid=exact_grid, previous=earlier)
    decode._plan_info = vector
    decode._pin_memory_int_workspace_buffer = torch.frombuffer(bytearray(workspace.ljust(4096, b"\0")), dtype=torch.uint8)
    made.forward_metadata = sg.flashinfer_backend.DecodeMetadata(decode_wrappers=[decode])


def _deterministic_decode(out: Path, *, exact_grid: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841 - the model's layer, alive while the step records
        made = sg.backend(sg.CorpusFlashInfer, DECODE_ROWS, lambda m, view: _deterministic_decode_graph(m, view, exact_grid=exact_grid))
        made.decode_use_tensor_cores = True
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=1))


def write_4002(bug: Path, twin: Path) -> None:
    _deterministic_decode(bug, exact_grid=False)
    _deterministic_decode(twin, exact_grid=True)


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
    RealBug(
        id="flashinfer-4002",
        title="FA2 CUDA-graph plans without split-KV launch padded CTAs over uninitialised scheduler entries",
        links=(
            "https://github.com/flashinfer-ai/flashinfer/issues/4002",
            "https://github.com/flashinfer-ai/flashinfer/pull/5176",
            "https://github.com/flashinfer-ai/flashinfer/pull/4794",
            "https://github.com/sgl-project/sglang/pull/31387",
        ),
        date="2026-07",
        engine="FlashInfer (SGLang deterministic decode)",
        mode="DECODE graph",
        mechanism="with CUDA graphs and split-KV off the planner padded grid-x to padded_batch_size (the split-KV occupancy "
        "bound, 132 on an H100 with 2 KV heads) without a block_valid_mask; padded CTAs read plan entries never written (an "
        "earlier plan's in a reused workspace: illegal memory access)",
        encoding="3 decodes replayed in a bs-4 graph (fill 1) on SGLang's FlashInfer backend with deterministic inference: the "
        "tensor-core decode wrapper planned with disable_split_kv; its plan info (FlashInfer's prefill scheduler, graph on, "
        "split-KV off) pads the grid to 132 with 4 work items written and no block_valid_mask, the int workspace past them "
        "holding an earlier 16-request plan's work items",
        expected=("invariants/plan-info-request-index", "invariants/plan-info-padded-batch-size", "invariants/plan-info-valid-mask"),
        keywords=("block_valid_mask", "never written", "split-KV off"),
        capabilities=(Capability.PLAN_INFO,),
        twin_note="the same replay planned with the exact grid the proposed fixes give a one-token decode without split-KV "
        "(flashinfer#4794, sglang#31387: padded_batch_size = the 4 work items); flashinfer#5176's layout (the grid still "
        "padded, a block_valid_mask switching the padding off) reads clean too (tests/checks/test_plan_schedule.py)",
        write=write_4002,
    ),
)
