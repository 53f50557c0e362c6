"""Sliding-window layers' own KV lists in SGLang's FlashInfer backend (wrapper 0 of two, the
sliding-window one; wrapper 1 serves the full-attention layers).

- sgl-project/sglang#26513 (2026-05): FlashInfer's SWA EXTEND with a cached prefix (ragged over the
  new tokens, paged over the prefix, merged): update_sliding_window gave the paged pass
  min(seq_len, window + extend_len) columns ending at seq_len, so it read the new tokens' columns,
  whose K/V are written only after the paged pass ran (stale cache rows); and neither pass got
  window_left. The fix lists the prefix's window tail and passes window_left.

- sgl-project/sglang#39287 (2026-09, open): EAGLE verify of a sliding-window layer on FlashInfer:
  the SWA wrapper clipped each prefix to the window but gathered its KV from column 0 instead of
  the prefix's tail, and was planned with the full-prefix tree mask (rows of prefix + n columns),
  which FlashInfer packs in segments of n x (window + n): rows read with another stride. The fix
  gathers the tail and builds a compact mask of the retained columns, the window bound per node.

- sgl-project/sglang#9279 (2025-08): Triton's EAGLE verify of a sliding-window layer read each
  request's FULL mask from column 0 while its keys came from the window list (the prefix's tail):
  the window's mask columns are offset by prefix - window_len (window_kv_offsets, added by the fix).

- sgl-project/sglang#31501 (2026-07): FlashInfer's sliding-window paged prefill wrapper was planned
  without window_left: plan() compiled the module without the per-element window, and the
  window_left given at forward() only skipped whole KV tiles, so later queries of an extend attended
  keys before their window. The recorder reads the window a wrapper was planned with (its
  `_window_left`, right after the step's plan).

- sgl-project/sglang#9658 (2025-08): FA3's EAGLE tree verify (topk > 1) ran sliding-window layers
  through the full layers' two-call cascade with window (W, 0): the prefix call windows every draft
  token as if it sat at the prefix's end minus n + its index, not at prefix + its depth. The fix
  gives those layers their own per-draft-token tables (swa_spec_metadata), one causal call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import torch

from attndbg.trace import tree
from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
WINDOW = 4
PREFIX, NEW = [10, 6], [3, 2]
ROWS = {1: list(range(10, 23)), 5: list(range(40, 48))}


def _swa_cascade(reads_new_columns: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """The paged (prefix) wrapper of each dispatch: wrapper 0 lists the window, wrapper 1 every
        prefix column; kv_start_idx = end - listed."""
        prefix, extend = fb.extend_prefix_lens.to(I64), fb.extend_seq_lens.to(I64)
        seq = prefix + extend
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices]
        qo_indptr = torch.nn.functional.pad(torch.cumsum(extend, 0), (1, 0)).to(I32)
        wrappers = []
        for window in (True, False):
            if window and reads_new_columns:
                end, count = seq, torch.minimum(seq, WINDOW + extend)  # the bug: up to seq_len
            elif window:
                end, count = prefix, torch.clamp(prefix, max=WINDOW)  # the fix: the prefix's window tail
            else:
                end, count = prefix, prefix
            indptr = torch.nn.functional.pad(torch.cumsum(count, 0), (1, 0)).to(I32)
            indices = torch.cat([rows[b, int(end[b] - count[b]) : int(end[b])] for b in range(count.numel())]).to(I32)
            made_wrapper = sg.wrapper(
                qo_indptr_buf=qo_indptr,
                paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=torch.cat([indices, torch.zeros(256, dtype=I32)]),
                paged_kv_last_page_len_buf=torch.ones(count.numel(), dtype=I32),
            )
            # plan(window_left=...) keeps it: the bug planned neither pass with the window, the fix the SWA one.
            made_wrapper._window_left = WINDOW if window and not reads_new_columns else -1
            wrappers.append(made_wrapper)
        made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=wrappers, use_ragged=True, extend_no_prefix=False)

    return plan


def _record(out: Path, plan: sg.Plan) -> None:
    """The SWA layer's extend of ROWS (prefixes PREFIX, NEW new tokens), planned by `plan`."""
    with sg.recording(out) as session:
        layer = sg.layer(window=WINDOW)  # noqa: F841 - a sliding-window layer: the recorder reads wrapper 0
        made = sg.backend(sg.CorpusFlashInfer, ROWS, plan)
        made.sliding_window_size = WINDOW
        made.dispatch_reason = SimpleNamespace(name="SLIDING_WINDOW")
        sg.record_eager(session, made, sg.extend_batch(ROWS, PREFIX, NEW))


def write_26513(bug: Path, twin: Path) -> None:
    _record(bug, _swa_cascade(reads_new_columns=True))
    _record(twin, _swa_cascade(reads_new_columns=False))


def _swa_paged(planned_window: int) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """Paged-only extend (the new tokens' K/V written before attention): wrapper 0 lists each
        request's window tail through its new tokens, min(seq_len, W + extend_len) columns ending
        at seq_len, and keeps the window it was planned with; wrapper 1 every column."""
        prefix, extend = fb.extend_prefix_lens.to(I64), fb.extend_seq_lens.to(I64)
        seq = prefix + extend
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices]
        qo_indptr = torch.nn.functional.pad(torch.cumsum(extend, 0), (1, 0)).to(I32)
        wrappers = []
        for window in (True, False):
            count = torch.minimum(seq, WINDOW + extend) if window else seq
            indptr = torch.nn.functional.pad(torch.cumsum(count, 0), (1, 0)).to(I32)
            indices = torch.cat([rows[b, int(seq[b] - count[b]) : int(seq[b])] for b in range(count.numel())]).to(I32)
            made_wrapper = sg.wrapper(
                qo_indptr_buf=qo_indptr,
                paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=torch.cat([indices, torch.zeros(256, dtype=I32)]),
                paged_kv_last_page_len_buf=torch.ones(count.numel(), dtype=I32),
            )
            made_wrapper._window_left = planned_window if window else -1  # plan(window_left=...) keeps it
            wrappers.append(made_wrapper)
        made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=wrappers, use_ragged=False, extend_no_prefix=False)

    return plan


def write_31501(bug: Path, twin: Path) -> None:
    _record(bug, _swa_paged(planned_window=-1))
    _record(twin, _swa_paged(planned_window=WINDOW))


VERIFY_ROWS = {2: list(range(10, 24)), 4: list(range(40, 51))}
VERIFY_PREFIX = [10, 7]
PARENTS = [[-1, 0, 0, 1], [-1, 0, 1, 1]]  # EAGLE trees, topk 2
N = len(PARENTS[0])


def _pack_segments(bits: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer plan(): the flat bool mask cut into consecutive segments of `sizes` bits (its
    mask_indptr from qo_len x kv_len), each packed little-endian to whole bytes."""
    packed, offsets, start = [], [0], 0
    for size in sizes:
        packed.append(torch.from_numpy(numpy.packbits(bits[start : start + size].numpy(), bitorder="little")))
        start += size
        offsets.append(offsets[-1] + packed[-1].numel())
    return torch.cat(packed), torch.tensor(offsets, dtype=I32)


def _compact_mask(parents: list[int], prefix: int, kept: int) -> torch.Tensor:
    """The fix's mask of one request: n rows over the `kept` retained prefix columns and the n
    drafts; a node at depth d sees prefix column c iff prefix + d - c <= WINDOW, and its ancestors."""
    p = torch.tensor(parents)
    depth = tree.depths(p)
    cols = torch.arange(prefix - kept, prefix)
    prefix_part = (prefix + depth)[:, None] - cols[None, :] <= WINDOW
    return torch.cat([prefix_part, tree.ancestor_matrix(p)], dim=1).flatten()


def _swa_verify(fixed: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        prefix = fb.seq_lens.to(I64)
        bs = prefix.numel()
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices]
        full_mask = fb.spec_info.custom_mask
        qo = torch.arange(0, (bs + 1) * N, N, dtype=I32)
        wrappers = []
        for window in (True, False):
            kept = torch.clamp(prefix, max=WINDOW) if window else prefix
            start = prefix - kept if (fixed or not window) else torch.zeros_like(prefix)
            ids = [torch.cat([rows[b, int(start[b]) : int(start[b] + kept[b])], rows[b, int(prefix[b]) : int(prefix[b]) + N]]) for b in range(bs)]
            kv = kept + N
            if window and fixed:
                bits = torch.cat([_compact_mask(PARENTS[b], int(prefix[b]), int(kept[b])) for b in range(bs)])
            else:
                bits = full_mask  # SGLang's FULL layout: n x (prefix + n) per request
            mask, offsets = _pack_segments(bits, [N * int(k) for k in kv])
            wrappers.append(
                sg.wrapper(
                    qo_indptr_buf=qo,
                    paged_kv_indptr_buf=torch.nn.functional.pad(torch.cumsum(kv, 0), (1, 0)).to(I32),
                    paged_kv_indices_buf=torch.cat([*ids, torch.zeros(256, dtype=I64)]).to(I32),
                    paged_kv_last_page_len_buf=torch.ones(bs, dtype=I32),
                    custom_mask_buf=mask,
                    mask_indptr_buf=offsets,
                )
            )
        made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=wrappers, use_ragged=False, extend_no_prefix=False)

    return plan


def _verify(out: Path, *, fixed: bool) -> None:
    """The verify step recorded with its layer (`record --layers 0`): the engine's output is what
    FlashInfer computes from the SWA wrapper it was planned with (sg.flashinfer_paged_prefill)."""
    fb = sg.verify_batch(VERIFY_ROWS, VERIFY_PREFIX, PARENTS)
    data = sg.layer_data(39287, tokens=len(VERIFY_PREFIX) * N)
    k_cache, v_cache = sg.with_new_kv(data, fb)
    with sg.recording(out, layers=(0,)) as session:
        layer = sg.layer(window=WINDOW)
        made = sg.backend(sg.CorpusFlashInfer, VERIFY_ROWS, _swa_verify(fixed))
        made.sliding_window_size = WINDOW
        made.dispatch_reason = SimpleNamespace(name="SLIDING_WINDOW")
        made.token_to_kv_pool = sg.kv_pool(data["k_pool"], data["v_pool"])
        made.run_layer = lambda q, k, v, layer, fb: sg.flashinfer_paged_prefill(made.forward_metadata.prefill_wrappers[0], q, k_cache, v_cache, layer.scaling).to(q.dtype)
        sg.record_eager(session, made, fb)
        made.forward(data["q"], data["k"], data["v"], layer, fb)


def write_39287(bug: Path, twin: Path) -> None:
    _verify(bug, fixed=False)
    _verify(twin, fixed=True)


def _triton_swa_verify(with_offsets: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """Triton's verify metadata (kv lists over the prefixes, the FULL mask, mask_indptr =
        cumsum(n (prefix + n))) and its sliding-window list (update_sliding_window_buffer: the
        prefix's last WINDOW columns); the fix adds window_kv_offsets = prefix - window_len."""
        prefix = fb.seq_lens.to(I64)
        bs = prefix.numel()
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices]
        indptr, indices = sg.kv_lists(made, fb, prefix)
        kept = torch.clamp(prefix, max=WINDOW)
        start = prefix - kept
        made.forward_metadata = sg.env.TritonForwardMetadata(
            None, None, N, None, indptr, indices,
            torch.arange(0, (bs + 1) * N, N, dtype=I32), fb.spec_info.custom_mask,
            torch.nn.functional.pad(torch.cumsum(N * (prefix + N), 0), (1, 0)).to(I64),
            torch.nn.functional.pad(torch.cumsum(kept, 0), (1, 0)).to(I32),
            torch.cat([rows[b, int(start[b]) : int(prefix[b])] for b in range(bs)]).to(I64),
            None, start.to(I32) if with_offsets else None,
        )  # fmt: skip

    return plan


CHAIN = [[-1, 0, 1, 2]] * 2


def _triton_verify(out: Path, *, with_offsets: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer(window=WINDOW)  # noqa: F841
        made = sg.backend(sg.CorpusTriton, VERIFY_ROWS, _triton_swa_verify(with_offsets))
        made.sliding_window_size = WINDOW
        sg.record_eager(session, made, sg.verify_batch(VERIFY_ROWS, VERIFY_PREFIX, CHAIN))


def write_9279(bug: Path, twin: Path) -> None:
    _triton_verify(bug, with_offsets=False)
    _triton_verify(twin, with_offsets=True)


# sglang#9658: FA3's tree verify (topk > 1) of a sliding-window layer. The full layers run two
# calls (every draft token over the prefix, then each over the draft tokens it sees) and merge
# them; FA3 takes one window per call, so the prefix call cannot window each draft token at its
# own position. Before the fix the sliding-window layers ran that cascade with window (W, 0); the
# fix gives them swa_spec_metadata: per draft token one causal query over its prefix and the drafts
# it sees. FlashAttentionMetadata had no swa_spec_metadata field before it.
PRE_9658_METADATA = dataclasses.make_dataclass(
    "FlashAttentionMetadata", [(f.name, f.type, f) for f in dataclasses.fields(sg.FlashAttentionMetadata) if f.name != "swa_spec_metadata"]
)


def _fa3_tree_verify(swa_spec: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """flashattention_backend.py init_forward_metadata, TARGET_VERIFY with topk > 1 (page size
        1): the prefix call's metadata, the expand metadata (the draft block gathered from the FULL
        mask, visible slots sorted first, cache_seqlens = the row's sum), and with the fix
        `_init_sliding_window_attn_spec_metadata`'s tables (prepare_swa_spec_page_table_triton:
        each draft token's row = its prefix, then its expand row)."""
        prefix = fb.seq_lens.to(I64)
        bs, n = prefix.numel(), N
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices.to(I64)]
        metadata_class = sg.FlashAttentionMetadata if swa_spec else PRE_9658_METADATA
        md = metadata_class(
            cache_seqlens_int32=prefix.to(I32),
            max_seq_len_q=n,
            max_seq_len_k=int(prefix.max()),
            cu_seqlens_q=torch.arange(0, bs * n + 1, n, dtype=I32),
            cu_seqlens_k=torch.nn.functional.pad(torch.cumsum(prefix, 0), (1, 0)).to(I32),
            page_table=rows[:, : int(prefix.max())].to(I32),
        )
        offsets = torch.arange(n)[None, :]
        cols = offsets.expand(bs, -1) + prefix[:, None]
        cum_len = torch.nn.functional.pad(torch.cumsum((prefix + n).repeat_interleave(n), 0), (1, 0))[:-1]
        mask = fb.spec_info.custom_mask[(cols.repeat_interleave(n, dim=0) + cum_len[:, None]).view(1, -1)].view(-1, n)
        _, order = torch.sort(torch.where(mask, offsets, offsets + n), dim=1)
        expand = metadata_class(max_seq_len_q=1, cu_seqlens_q=torch.arange(bs * n + 1, dtype=I32))
        expand.page_table = rows.gather(1, cols).repeat_interleave(n, dim=0).gather(1, order).to(I32)
        expand.cache_seqlens_int32 = mask.sum(1).to(I32)
        expand.cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(expand.cache_seqlens_int32, 0), (1, 0)).to(I32)
        made.forward_metadata_spec_decode_expand = expand
        if swa_spec:
            lens = md.cache_seqlens_int32.repeat_interleave(n) + expand.cache_seqlens_int32
            table = torch.zeros(bs * n, md.max_seq_len_k + expand.page_table.shape[1], dtype=I32)
            for r in range(bs * n):
                p, own = int(prefix[r // n]), int(expand.cache_seqlens_int32[r])
                table[r, :p] = md.page_table[r // n, :p]
                table[r, p : p + own] = expand.page_table[r, :own]
            swa = sg.FlashAttentionMetadata(max_seq_len_q=1, cu_seqlens_q=expand.cu_seqlens_q, cache_seqlens_int32=lens.to(I32), page_table=table)
            swa.cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(I32)
            md.swa_spec_metadata = swa
        made.forward_metadata = md

    return plan


def _fa3_verify(out: Path, *, swa_spec: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer(window=WINDOW)  # noqa: F841
        made = sg.backend(sg.CorpusFA3, VERIFY_ROWS, _fa3_tree_verify(swa_spec))
        made.sliding_window_size = WINDOW
        made.topk = 2
        made.speculative_num_draft_tokens = N
        sg.record_eager(session, made, sg.verify_batch(VERIFY_ROWS, VERIFY_PREFIX, PARENTS))


def write_9658(bug: Path, twin: Path) -> None:
    _fa3_verify(bug, swa_spec=False)
    _fa3_verify(twin, swa_spec=True)


BUGS = (
    RealBug(
        id="sglang-26513",
        title="FlashInfer SWA extend with a prefix: the paged pass lists the new tokens' unwritten columns",
        links=("https://github.com/sgl-project/sglang/pull/26513",),
        date="2026-05",
        engine="SGLang flashinfer",
        mode="EXTEND",
        mechanism="update_sliding_window set paged_kernel_lens = min(seq_lens, window + extend_lens) ending at seq_len, so the "
        "paged prefix pass of the ragged+paged cascade read columns [prefix_len, seq_len), whose K/V are written after it "
        "(stale rows), and the cascade passes ran without window_left: silently wrong tokens on SWA models with prefix caching",
        encoding="2 requests (prefixes 10, 6; 3 and 2 new) of a window-4 layer; FlashInfer cascade plan, wrapper 0 (SWA) "
        "listing min(seq_len, 4 + new) columns up to seq_len and planned without window_left (the recorder reads the "
        "wrapper's plan-time window); twin: the prefix's window tail, planned with the window",
        expected=("invariants/kv-index", "invariants/kv-length", "invariants/window-kv", "invariants/window-off"),
        keywords=("written after", "unwritten", "not yet written", "planned without"),
        capabilities=(Capability.EVERY_PLAN, Capability.WINDOW_VERIFY),
        write=write_26513,
    ),
    RealBug(
        id="sglang-31501",
        title="FlashInfer SWA paged prefill planned without window_left: the per-element window compiled out",
        links=("https://github.com/sgl-project/sglang/pull/31501",),
        date="2026-07",
        engine="SGLang flashinfer",
        mode="EXTEND (paged-only)",
        mechanism="the sliding-window paged prefill wrapper was planned without window_left, so FlashInfer compiled its module "
        "without the window; the window_left given at forward() only skipped whole KV tiles: tokens past the window attended "
        "to keys before it",
        encoding="2 requests (prefixes 10, 6; 3 and 2 new) of a window-4 layer, paged-only; wrapper 0 (SWA) lists min(seq_len, "
        "4 + new) columns up to seq_len and keeps _window_left = -1 from its plan(); twin: planned with 4",
        expected=("invariants/window-off",),
        keywords=("planned without", "window"),
        capabilities=(Capability.HOST_HINTS, Capability.EVERY_PLAN),
        write=write_31501,
    ),
    RealBug(
        id="sglang-39287",
        title="EAGLE verify of a sliding-window layer on FlashInfer: window KV from column 0, full-prefix mask stride",
        links=("https://github.com/sgl-project/sglang/pull/39287", "https://github.com/sgl-project/sglang/pull/27469"),
        date="2026-09",
        engine="SGLang flashinfer",
        mode="TARGET_VERIFY",
        mechanism="the SWA verify wrapper clipped each prefix to the window but gathered from offset zero and kept SGLang's "
        "full-prefix mask layout (rows of prefix + n bits), which FlashInfer packs per request in q_len x kv_len segments "
        "of the clipped length: the wrong keys, and mask rows read with another stride (incorrect verify outputs)",
        encoding="2 EAGLE verifies (topk 2, n=4; prefixes 10, 7) of a window-4 layer; FlashInfer wrapper 0 (SWA) lists the "
        "first min(prefix, 4) prefix columns + the drafts, with the FULL bool mask packed in segments of 4 x (kept + 4) bits; "
        "layer 0 recorded (q, new K/V, prefix rows) with the output FlashInfer computes from that wrapper; "
        "fix PR open at the time of writing",
        expected=("invariants/kv-index", "tree-mask/plan-mask", "tree-mask/window-offset", "split-merge/recorded-output-mismatch"),
        keywords=("stride", "offset zero", "column 0"),
        capabilities=(Capability.WINDOW_VERIFY, Capability.VERIFY_GEOMETRY, Capability.STRIDE_MODEL),
        twin_note="the fix's layout: the prefix's window tail gathered, a compact mask over the kept columns with the window bound per node",
        write=write_39287,
    ),
    RealBug(
        id="sglang-9279",
        title="Triton EAGLE verify of a sliding-window layer reads the tree mask without the window's column offset",
        links=("https://github.com/sgl-project/sglang/pull/9279",),
        date="2025-08",
        engine="SGLang triton",
        mode="TARGET_VERIFY",
        mechanism="the Triton extend kernel of a sliding-window layer read its keys from window_kv_indices (the prefix's last "
        "window columns) but each mask row from the FULL mask's column 0: the window's columns are prefix - window_len further "
        "on; the fix adds window_kv_offsets and reads the mask there (MMLU 0.777 -> 0.816 on gpt-oss-20b with EAGLE3)",
        encoding="2 EAGLE chain verifies (n=4; prefixes 10, 7) of a window-4 layer; Triton ForwardMetadata with window_kv_indptr/"
        "indices and no window_kv_offsets",
        expected=("tree-mask/window-offset",),
        keywords=("offset",),
        capabilities=(Capability.WINDOW_VERIFY,),
        write=write_9279,
    ),
    RealBug(
        id="sglang-9658",
        title="FA3 tree verify of sliding-window layers (topk > 1) through the full layers' two-call cascade",
        links=("https://github.com/sgl-project/sglang/pull/9658",),
        date="2025-08",
        engine="SGLang fa3",
        mode="TARGET_VERIFY (topk > 1)",
        mechanism="sliding-window layers of a topk > 1 verify ran the full layers' cascade (the prefix call over every draft "
        "token, then the draft-block call, merged) with window_size (W, 0): FA3 takes one window per call and aligns the prefix "
        "call's rows to the prefix's last keys, so each draft token's window was cut at the wrong position; the fix gives these "
        "layers their own page tables (swa_spec_metadata); without them gpt-oss with EAGLE3 lost accuracy",
        encoding="2 EAGLE verifies (topk 2, n=4; prefixes 10, 7) of a window-4 layer; FA3 metadata as SGLang built it before "
        "the fix (no swa_spec_metadata field) with forward_metadata_spec_decode_expand, recorded as the two calls with the "
        "layer's window; twin: the fix's swa_spec_metadata (per draft token its prefix, then the drafts it sees)",
        expected=("tree-mask/window-cascade",),
        keywords=("cascade", "one window"),
        capabilities=(Capability.EVERY_PLAN, Capability.WINDOW_VERIFY),
        write=write_9658,
    ),
)
