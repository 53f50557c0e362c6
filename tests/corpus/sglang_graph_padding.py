"""SGLang CUDA-graph padding bugs: what padded rows (seq_len fill, req_to_token rows, positions) and
the host sums handed to the backend held at a graph replay, recorded through the SGLang hooks.

- sgl-project/sglang#1469 (2024-09) padded FlashInfer decode graphs with seq_len 0; #1779 (issue
  #1571) found NaN rows with it and made the fill 1.
- sgl-project/sglang#1782 (2024-10): the Triton backend's req_to_token was `torch.empty`, so a
  padded row (seq_len 1, req_pool_indices 0) read a garbage slot id.
- sgl-project/sglang#1789 (2024-10): the graph runner's seq_lens_sum left out the padded requests.
- sgl-project/sglang#24361 (2026-05): NGRAM verify + FlashInfer + graph replay: padded positions
  left stale from an earlier, larger batch; fixed by SGL-new's buffer registry zeroing positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import torch

from attndbg.trace import tree
from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
DECODE_ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38], 3: [60, 61, 62]}
DECODE_LENS = [5, 9, 3]
CAPTURE_BS = 4  # three requests replayed in the bs-4 graph: one padded row


def _flashinfer_decode_graph(made: Any, view: Any) -> None:
    """SGLang FlashInfer's decode replay (FlashInferIndicesUpdaterDecode over the padded batch):
    kv_indptr = cumsum(padded seq_lens), kv_indices gathered from each row's req_to_token head,
    kv_last_page_len ones (page size 1), into the wrapper captured for this bs."""
    lens = view.seq_lens.to(I64)
    indptr, indices = sg.kv_lists(made, view, lens, size=int(lens.sum()) + 16, garbage=0)
    decode = sg.wrapper(paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=torch.ones(lens.numel(), dtype=I32))
    decode._use_tensor_cores = False
    made.forward_metadata = sg.flashinfer_backend.DecodeMetadata(decode_wrappers=[decode])


def _fill_value_flashinfer(fill: int, out: Path) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841 - the model's layer, alive while the step records
        made = sg.backend(sg.CorpusFlashInfer, DECODE_ROWS, _flashinfer_decode_graph)
        made.fill = fill
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=fill))


def write_1469(bug: Path, twin: Path) -> None:
    _fill_value_flashinfer(0, bug)
    _fill_value_flashinfer(1, twin)


def _triton_decode_graph(made: Any, view: Any) -> None:
    """SGLang Triton's decode replay: the graph buffers refilled over the padded seq_lens."""
    lens = view.seq_lens.to(I64)
    bs = lens.numel()
    indptr, indices = sg.kv_lists(made, view, lens)
    made.kv_indptr[: bs + 1] = indptr
    made.cuda_graph_kv_indices[: indices.numel()] = indices
    made.cuda_graph_num_kv_splits[:bs] = sg.split_counts(lens)


def _triton_graph_backend(req_to_token: torch.Tensor | None = None) -> Any:
    made = sg.backend(sg.CorpusTriton, DECODE_ROWS, _triton_decode_graph, req_to_token=req_to_token)
    made.kv_indptr = torch.zeros(9, dtype=I32)
    made.cuda_graph_kv_indices = torch.zeros(128, dtype=I64)
    made.cuda_graph_num_kv_splits = torch.full((8,), 8, dtype=I32)
    made.cuda_graph_attn_logits = torch.empty(8, sg.HEADS, 8, sg.HEAD_DIM)  # [max_num_tokens, H, max_kv_splits, Dv]
    return made


def _req_to_token_table(allocated_empty: bool) -> torch.Tensor:
    """req_to_token as ReqToTokenPool allocated it: `torch.empty` (garbage where no request wrote,
    here a large int as an uninitialised int32 holds) or `torch.zeros` (the fix)."""
    pool = sg.env.req_pool(DECODE_ROWS, size=8, width=64)
    table = pool.req_to_token
    if allocated_empty:
        untouched = torch.ones_like(table, dtype=torch.bool)
        for row, slots in DECODE_ROWS.items():
            untouched[row, : len(slots)] = False
        garbage = torch.randint(1 << 20, 1 << 30, table.shape, generator=torch.Generator().manual_seed(1782), dtype=table.dtype)
        table = torch.where(untouched, garbage, table)
    return table


def _padded_row_reads(out: Path, *, allocated_empty: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = _triton_graph_backend(_req_to_token_table(allocated_empty))
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=1))


def write_1782(bug: Path, twin: Path) -> None:
    _padded_row_reads(bug, allocated_empty=True)
    _padded_row_reads(twin, allocated_empty=False)


def _seq_lens_sum(out: Path, *, padded: bool) -> None:
    """The runner hands the backend seq_lens_sum; the FlashInfer backend of the time sized its
    kv_indices from it (`torch.empty(seq_lens_sum)`), so a raw sum is short by the padded rows."""
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = _triton_graph_backend()
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        raw = sum(DECODE_LENS)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=1, seq_lens_sum=raw + (CAPTURE_BS - 3) if padded else raw))


def write_1789(bug: Path, twin: Path) -> None:
    _seq_lens_sum(bug, padded=False)
    _seq_lens_sum(twin, padded=True)


VERIFY_ROWS = {1: [11, 12, 13, 44, 45, 46, 47], 6: [21, 22, 30, 31, 32, 33]}
VERIFY_PREFIX = [3, 2]
CHAIN = [[-1, 0, 1, 2]] * 2  # NGRAM drafts a chain here (its BFS tree of breadth 1)


def _flashinfer_verify_graph(made: Any, view: Any) -> None:
    """SGLang FlashInfer's verify replay: the prefill-verify wrapper planned over the padded batch
    (generate_attn_arg_prefill: kv over seq_len + n, qo_indptr = arange(0, (bs+1)n, n)), the
    FULL mask packed as FlashInfer keeps it (per request q_len x kv_len bits, little-endian)."""
    n = len(CHAIN[0])
    lens = view.seq_lens.to(I64)
    bs = lens.numel()
    kv = lens + n
    indptr, indices = sg.kv_lists(made, view, kv, size=int(kv.sum()) + 16, garbage=0)
    parents = torch.tensor(CHAIN + [[-1, 0, 1, 2]] * (bs - len(CHAIN)))
    bits = tree.full_mask(parents, lens)
    packed, offsets = [], [0]
    start = 0
    for b in range(bs):
        size = n * int(kv[b])
        segment = bits[start : start + size]
        start += size
        packed.append(torch.from_numpy(numpy.packbits(segment.numpy(), bitorder="little")))
        offsets.append(offsets[-1] + packed[-1].numel())
    verify = sg.wrapper(
        qo_indptr_buf=torch.arange(0, (bs + 1) * n, n, dtype=I32),
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices,
        paged_kv_last_page_len_buf=torch.ones(bs, dtype=I32),
        custom_mask_buf=torch.cat(packed),
        mask_indptr_buf=torch.tensor(offsets, dtype=I32),
    )
    verify._use_cuda_graph = True
    made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=[verify], use_ragged=False, extend_no_prefix=False)


def _ngram_verify(out: Path, *, stale: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusFlashInfer, VERIFY_ROWS, _flashinfer_verify_graph)
        fb = sg.verify_batch(VERIFY_ROWS, VERIFY_PREFIX, CHAIN)
        n = len(CHAIN[0])
        # An earlier replay of a bs-4 batch left its positions (prefix ~ 2000) in the padded rows.
        left = torch.arange(2000, 2000 + 2 * n, dtype=I64) if stale else None
        view = sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=1, per_req=n, padded_positions=left)
        sg.record_replay(session, made, view)


def write_24361(bug: Path, twin: Path) -> None:
    _ngram_verify(bug, stale=True)
    _ngram_verify(twin, stale=False)


# A request-pool row a finished request of an earlier, larger replay held: its req_to_token head
# still names that request's KV slots (valid ids, now free or reused).
STALE_POOL_ROW = 7
STALE_ROW_SLOTS = [40, 41, 42, 43, 44, 45]


def _stale_pool_row(out: Path, *, zeroed: bool) -> None:
    """A Triton decode graph replay of 3 requests in the bs-4 graph (fill 1) whose padded
    req_pool_indices entry is what the runner left there: the stale row of an earlier replay (the
    runners #26292 fixed), or 0 (the fix's req_pool_indices.zero_() beside seq_lens.fill_)."""
    table = sg.env.req_pool({**DECODE_ROWS, STALE_POOL_ROW: STALE_ROW_SLOTS}, size=8, width=64).req_to_token
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = _triton_graph_backend(table)
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        left = None if zeroed else torch.tensor([STALE_POOL_ROW], dtype=I64)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=CAPTURE_BS, fill=1, padded_req_pool_indices=left))


def write_26292(bug: Path, twin: Path) -> None:
    _stale_pool_row(bug, zeroed=False)
    _stale_pool_row(twin, zeroed=True)


BUGS = (
    RealBug(
        id="sglang-1469",
        title="FlashInfer decode graphs padded with seq_len 0 (IMA, then NaN rows)",
        links=("https://github.com/sgl-project/sglang/pull/1779", "https://github.com/sgl-project/sglang/pull/1469", "https://github.com/sgl-project/sglang/issues/1571"),
        date="2024-10",
        engine="SGLang flashinfer",
        mode="DECODE graph",
        mechanism="get_cuda_graph_seq_len_fill_value() returned 0 for FlashInfer: padded requests got seq_len 0 (an empty KV list); "
        "FlashInfer sometimes faulted and produced NaN padded rows, which dynamic fp8 quantisation spread into real rows",
        encoding="3 decodes replayed in a bs-4 graph; padded row seq_len 0, the backend's declared fill 0; FlashInfer decode wrapper buffers",
        expected=("fill-value/padded-seq-len-unsupported",),
        keywords=("fill value",),
        capabilities=(Capability.PADDED_ROWS, Capability.KERNEL_RUN),
        write=write_1469,
    ),
    RealBug(
        id="sglang-1782",
        title="Triton req_to_token allocated with torch.empty: padded rows read a garbage slot",
        links=("https://github.com/sgl-project/sglang/pull/1782",),
        date="2024-10",
        engine="SGLang triton",
        mode="DECODE graph",
        mechanism="ReqToTokenPool.req_to_token = torch.empty(...): a padded request (seq_len 1, req_pool_indices 0) gathered "
        "req_to_token[0, 0], an uninitialised int32, as its KV slot (out-of-bounds read during capture and replay)",
        encoding="3 decodes replayed in a bs-4 graph, fill 1; req_to_token rows nobody wrote hold garbage ints; Triton graph buffers",
        expected=("fill-value/padded-req-pool-index-out-of-pool", "invariants/index-outside-cache"),
        keywords=("torch.empty", "never written"),
        capabilities=(Capability.PADDED_ROWS,),
        write=write_1782,
    ),
    RealBug(
        id="sglang-1789",
        title="Graph runner's seq_lens_sum ignores the padded requests",
        links=("https://github.com/sgl-project/sglang/pull/1789",),
        date="2024-10",
        engine="SGLang triton",
        mode="DECODE graph",
        mechanism="replay passed the raw batch's seq_lens_sum to init_forward_metadata_replay_cuda_graph; padded requests' "
        "seq_len fill was not added, so buffers sized from it were one entry per padded row short",
        encoding="3 decodes in a bs-4 graph (fill 1); the view's seq_lens_sum = sum of the real rows (17, not 18)",
        expected=("fill-value/seq-lens-sum-ignores-padding",),
        keywords=("raw batch's seq_lens_sum",),
        capabilities=(Capability.PADDED_ROWS,),
        write=write_1789,
    ),
    RealBug(
        id="sglang-24361",
        title="NGRAM verify graph replay with stale padded positions: IMA in FlashInfer's verify plan",
        links=("https://github.com/sgl-project/sglang/issues/24361",),
        date="2026-05",
        engine="SGLang flashinfer",
        mode="TARGET_VERIFY graph",
        mechanism="the classic graph runner left padded positions from an earlier, larger replay; the FlashInfer verify "
        "replay read them and faulted (cudaErrorIllegalAddress in prefill.plan); SGL-new's buffer registry zeroes positions",
        encoding="2 NGRAM chain-verify requests (n=4) in a bs-4 graph; padded positions 2000+ left from an earlier batch; "
        "FlashInfer verify wrapper with the packed FULL mask",
        expected=("fill-value/stale-padded-positions",),
        keywords=("stale positions",),
        capabilities=(Capability.PADDED_ROWS,),
        write=write_24361,
    ),
    RealBug(
        id="sglang-26292",
        title="Graph runners fill padded seq_lens but leave padded req_pool_indices stale",
        links=("https://github.com/sgl-project/sglang/pull/26292",),
        date="2026-05",
        engine="SGLang triton",
        mode="DECODE graph",
        mechanism="cuda_graph_runner, cpu_graph_runner, eagle_draft_extend_cuda_graph_runner and frozen_kv_mtp_cuda_graph_runner "
        "filled the padded seq_lens with seq_len_fill_value but did not zero the padded req_pool_indices: padded rows kept the "
        "request-pool row an earlier replay wrote, and the captured attention's dummy reads went to that stale req_to_token row "
        "instead of the reserved all-zero row 0; the fix pairs req_pool_indices.zero_() with the fill, as the EAGLE draft runner did",
        encoding="3 decodes (kv 5, 9, 3) replayed in a bs-4 graph (fill 1) on SGLang's Triton backend; the padded row's "
        "req_pool_indices is 7, a row no live request holds, whose req_to_token head still names a finished request's slots "
        "(40..45); twin: the padded row zeroed",
        expected=("fill-value/stale-padded-req-pool-index",),
        keywords=("req_pool_indices", "stale"),
        capabilities=(Capability.PADDED_ROWS,),
        write=write_26292,
    ),
)
