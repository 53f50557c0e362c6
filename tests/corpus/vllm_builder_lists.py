"""Lists a vLLM metadata builder derives from the CommonAttentionMetadata for its kernel: right
batch, wrong derivation.

- vllm-project/vllm#31282 (2025-12): ROCm AITER MLA decode set paged_kv_last_page_len to the whole
  sequence length, while the kernel's pages hold one token each: the kernel was told the last page
  holds seq_len tokens.
- vllm-project/vllm#27753 (2025-10, with #27547): hybrid models' attention metadata builders
  derived FlashInfer's paged-KV lists at the KV manager's block size, while the kernel's cache
  pages (and the block table handed to it) are of the kernel block size: too few pages listed, the
  last one's length wrong, garbage loads.
- vllm-project/vllm#39773 (2026-04): EAGLE draft decodes in PIECEWISE graphs: FlashInfer's native
  decode planned a row per padded token.
- vllm-project/vllm#56181 (2026-09, after #55458): DFlash speculators under data parallelism built
  the draft attention metadata with the DP-padded token count while query_start_loc covered only the
  requests' tokens; FlashInfer's prefill run refused q of 52 rows for qo_indptr[-1] = 48.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from attndbg.trace.schema import CaptureSizes
from tests.corpus import vllm_engine as vl
from tests.corpus.bug import Capability, RealBug
from tests.record.engines import import_engine

aiter_mla = import_engine("vllm.v1.attention.backends.mla.rocm_aiter_mla")

I32 = torch.int32


def _paged_lists(seq_lens: torch.Tensor, table: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr, indices, last_page_len) of each request's first ceil(seq_len / page) block-table
    entries, as vLLM's builders compute them at page size `page`."""
    pages = (seq_lens + page - 1) // page
    indptr = torch.zeros(len(seq_lens) + 1, dtype=I32)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.cat([table[b, : int(n)] for b, n in enumerate(pages)]).to(I32)
    last = seq_lens % page
    last = torch.where((last == 0) & (seq_lens != 0), torch.full_like(last, page), last)
    return indptr, indices, last.to(I32)


# AITER MLA's kernel pages hold one token (vLLM's ROCm AITER MLA backend takes block size 1).
AITER_DECODE = dict(seq_lens=[5, 7, 3], query_lens=[1, 1, 1], blocks=[[9, 2, 14, 4, 11], [1, 3, 5, 7, 8, 10, 12], [13, 6, 15]], block_size=1)


def _aiter_mla_decode(out: Path, *, last_page_is_seq_len: bool) -> None:
    """AiterMLAMetadataBuilder._build_decode over 3 decodes: its paged-KV lists at block size 1."""
    cm = vl.Step(**AITER_DECODE).common()
    seq_lens = cm.seq_lens.clone()
    indptr, indices, last = _paged_lists(seq_lens, cm.block_table_tensor, 1)
    if last_page_is_seq_len:
        last = torch.where(seq_lens == 0, torch.ones_like(seq_lens), seq_lens)  # the builder before the fix
    decode = aiter_mla.AiterMLADecodeMetadata(
        block_table=cm.block_table_tensor, seq_lens=seq_lens, dcp_tot_seq_lens=None, paged_kv_indptr=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len=last, qo_indptr=cm.query_start_loc, max_qo_len=1,
    )  # fmt: skip
    metadata = aiter_mla.AiterMLAMetadata(
        num_reqs=cm.num_reqs, max_query_len=1, max_seq_len=cm.max_seq_len, num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
        slot_mapping=cm.slot_mapping, num_decodes=cm.num_reqs, num_decode_tokens=cm.num_actual_tokens, num_prefills=0, decode=decode,
    )  # fmt: skip
    vl.record(out, cm, metadata, backend="ROCM_AITER_MLA", model=vl.mla_model(block_size=1), builder="AiterMLAMetadataBuilder")


def write_31282(bug: Path, twin: Path) -> None:
    _aiter_mla_decode(bug, last_page_is_seq_len=True)
    _aiter_mla_decode(twin, last_page_is_seq_len=False)


# Kernel blocks of 16 (the cache's pages and the block table the builder gets); the hybrid model's
# KV manager allocates blocks of 64 (4 kernel blocks each).
KERNEL_BLOCK, MANAGER_BLOCK = 16, 64
HYBRID_MIXED = dict(seq_lens=[40, 21, 70], query_lens=[1, 1, 30], blocks=[[4, 5, 6], [8, 9], [12, 13, 14, 15, 16]], block_size=KERNEL_BLOCK)


def _flashinfer_hybrid(out: Path, *, page: int) -> None:
    """FlashInferMetadataBuilder.build (vLLM 0.11's FlashInferMetadata fields) of 2 decodes and a
    chunked prefill: its paged-KV lists and `page_size` derived at block size `page`, over the
    kernel-block block table. The recorder reads the block size from the builder's
    kv_cache_spec, the same value the builder used: `page` on both sides."""
    cm = vl.Step(**HYBRID_MIXED).common()
    indptr, indices, last = _paged_lists(cm.seq_lens, cm.block_table_tensor, page)
    # FlashInferMetadata's fields as the builder filled them (its module imports FlashInfer).
    metadata = SimpleNamespace(
        num_actual_tokens=cm.num_actual_tokens, qo_indptr_cpu=cm.query_start_loc_cpu, paged_kv_indptr_cpu=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len_cpu=last, page_size=page, slot_mapping=cm.slot_mapping, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens,
        block_table_tensor=cm.block_table_tensor, num_decodes=2, num_decode_tokens=2, num_prefills=1, num_prefill_tokens=30, use_cascade=False,
    )  # fmt: skip
    vl.record(out, cm, metadata, backend="FLASHINFER", model=vl.mha_model(block_size=page), builder="FlashInferMetadataBuilder")


def write_27753(bug: Path, twin: Path) -> None:
    _flashinfer_hybrid(bug, page=MANAGER_BLOCK)
    _flashinfer_hybrid(twin, page=KERNEL_BLOCK)


# scheduler_config.max_num_seqs, which the recorder keeps as capture.max_bs: the draft steps below
# have fewer requests, so a FULL graph would have padded their rows with their tokens.
ENGINE = CaptureSizes(max_bs=256)

# A draft decode of 3 requests (one token each) in a PIECEWISE graph captured for 4 tokens.
DRAFT_DECODE = dict(seq_lens=[21, 34, 9], query_lens=[1, 1, 1], blocks=[[7, 3], [5, 1, 9], [2]])
PIECEWISE_TOKENS = 4
STALE_INDPTR_TAIL = 11  # what the persistent paged_kv_indptr buffer held past the requests (an earlier, larger batch)


def _draft_decode(out: Path, *, padded_tokens: int) -> None:
    """FlashInferMetadataBuilder.build of an EAGLE draft decode whose CommonAttentionMetadata counts
    `padded_tokens` tokens (the PIECEWISE capture size; the real 3 tokens in the fix's eager or FULL
    runs): split_decodes_and_prefills returns num_decode_tokens = num_actual_tokens for a uniform
    single-token batch, and the native decode path plans paged_kv_indptr[:num_decode_tokens + 1]
    and paged_kv_last_page_len[:num_decode_tokens] from the persistent buffers, written only for
    the requests (vLLM 0.11's host-list field names, as the builder kept them)."""
    real = len(DRAFT_DECODE["seq_lens"])
    slots = vl.Step(**DRAFT_DECODE).common().slot_mapping
    padded_slots = torch.cat([slots, torch.full((padded_tokens - real,), -1, dtype=torch.int64)])  # PAD_SLOT_ID
    cm = vl.Step(**DRAFT_DECODE, overrides=dict(num_actual_tokens=padded_tokens, slot_mapping=padded_slots)).common()
    indptr, indices, last = _paged_lists(cm.seq_lens, cm.block_table_tensor, KERNEL_BLOCK)
    rows = padded_tokens  # the plan's rows: one per decode token
    stale_indptr = torch.full((rows - real,), STALE_INDPTR_TAIL, dtype=I32)
    stale_last = torch.full((rows - real,), 5, dtype=I32)
    metadata = SimpleNamespace(
        num_actual_tokens=padded_tokens, qo_indptr_cpu=cm.query_start_loc_cpu, paged_kv_indptr_cpu=torch.cat([indptr, stale_indptr]),
        paged_kv_indices=indices, paged_kv_last_page_len_cpu=torch.cat([last, stale_last]), page_size=KERNEL_BLOCK, slot_mapping=cm.slot_mapping,
        max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens, block_table_tensor=cm.block_table_tensor, num_decodes=real,
        num_decode_tokens=padded_tokens, num_prefills=0, num_prefill_tokens=0, use_cascade=False,
    )  # fmt: skip
    vl.record(out, cm, metadata, backend="FLASHINFER", model=vl.mha_model(block_size=KERNEL_BLOCK), builder="FlashInferMetadataBuilder", capture=ENGINE)


def write_39773(bug: Path, twin: Path) -> None:
    _draft_decode(bug, padded_tokens=PIECEWISE_TOKENS)
    _draft_decode(twin, padded_tokens=len(DRAFT_DECODE["seq_lens"]))


# A DFlash draft pass: each request drafts its block of 4 query tokens in one parallel pass; the DP
# sync pads the rank's 12 tokens to 16 (another rank ran more).
DFLASH_DRAFT = dict(seq_lens=[25, 38, 13], query_lens=[4, 4, 4], blocks=[[7, 3], [5, 1, 9], [2]])
DP_PADDED_TOKENS = 16


def _dflash_draft(out: Path, *, tokens: int) -> None:
    """FlashInferMetadataBuilder.build of a DFlash draft pass (eager, no FULL graph) whose
    CommonAttentionMetadata counts `tokens` tokens: the DP-padded batch size before #56181, the
    requests' own tokens (query_start_loc[-1]) after it. The 4-token blocks exceed the decode
    threshold, so the builder plans them as prefills: qo_indptr over the requests' 12 tokens,
    the DP padding in num_actual_tokens and slot_mapping (PAD_SLOT_ID -1) only."""
    step = vl.Step(**DFLASH_DRAFT)
    real = step.common()
    real_tokens = int(real.num_actual_tokens)
    slots = torch.cat([real.slot_mapping, torch.full((tokens - real_tokens,), -1, dtype=torch.int64)])
    cm = vl.Step(**DFLASH_DRAFT, overrides=dict(num_actual_tokens=tokens, slot_mapping=slots)).common()
    indptr, indices, last = _paged_lists(cm.seq_lens, cm.block_table_tensor, KERNEL_BLOCK)
    metadata = SimpleNamespace(
        num_actual_tokens=tokens, qo_indptr_cpu=cm.query_start_loc_cpu, paged_kv_indptr_cpu=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len_cpu=last, page_size=KERNEL_BLOCK, slot_mapping=cm.slot_mapping, max_seq_len=cm.max_seq_len,
        seq_lens=cm.seq_lens, block_table_tensor=cm.block_table_tensor, num_decodes=0, num_decode_tokens=0, num_prefills=3,
        num_prefill_tokens=real_tokens, use_cascade=False,
    )  # fmt: skip
    vl.record(out, cm, metadata, backend="FLASHINFER", model=vl.mha_model(block_size=KERNEL_BLOCK), builder="FlashInferMetadataBuilder", capture=ENGINE)


def write_56181(bug: Path, twin: Path) -> None:
    _dflash_draft(bug, tokens=DP_PADDED_TOKENS)
    _dflash_draft(twin, tokens=sum(DFLASH_DRAFT["query_lens"]))


BUGS = (
    RealBug(
        id="vllm-31282",
        title="AITER MLA decode: paged_kv_last_page_len set to the sequence length with one-token pages",
        links=("https://github.com/vllm-project/vllm/pull/31282",),
        date="2025-12",
        engine="vLLM ROCM_AITER_MLA",
        mode="DECODE",
        mechanism="AiterMLAMetadataBuilder._build_decode set paged_kv_last_page_len = seq_lens (1 where 0), while the AITER MLA "
        "kernel's pages hold one token: a 127-token sequence's last page was said to hold 127 tokens (wrong attention, reads "
        "past the page); the fix keeps a buffer of ones",
        encoding="3 MLA decodes (seq_lens 5, 7, 3; block size 1) through the vLLM converter: AiterMLAMetadata with its decode "
        "part's paged_kv_indptr, paged_kv_indices and paged_kv_last_page_len = seq_lens; twin: last_page_len 1",
        expected=("invariants/kv-last-page-len",),
        keywords=("last_page_len", "whole sequence length", "last page"),
        capabilities=(Capability.CROSS_FIELDS,),
        write=write_31282,
    ),
    RealBug(
        id="vllm-27753",
        title="Hybrid models: FlashInfer's paged-KV lists derived at the KV manager's block size, not the kernel's",
        links=("https://github.com/vllm-project/vllm/pull/27753", "https://github.com/vllm-project/vllm/pull/27547", "https://github.com/vllm-project/vllm/issues/26936"),
        date="2025-10",
        engine="vLLM FLASHINFER",
        mode="MIXED",
        mechanism="after kernel block sizes were decoupled from the KV manager's, the model runner still gave the metadata "
        "builders the manager's block size: FlashInfer's paged_kv_indptr and paged_kv_last_page_len were computed at 64 over "
        "a block table of 16-token kernel blocks (too few pages, wrong last-page lengths): garbage loads, GSM8K 0.02; the fix "
        "passes the kernel block size to the builders",
        encoding="2 decodes and a 30-token chunked prefill (seq_lens 40, 21, 70) on kernel blocks of 16, through the vLLM "
        "converter: block table and slot_mapping in kernel blocks; FlashInfer metadata (0.11 fields) with paged_kv_indptr_cpu / "
        "paged_kv_last_page_len_cpu and page_size at 64, the block size the recorder reads from the builder's kv_cache_spec too; "
        "twin: 16 throughout",
        expected=("invariants/slot-mapping", "invariants/kv-length", "invariants/kv-last-page-len"),
        keywords=("blocks of 16", "page size"),
        capabilities=(Capability.CROSS_FIELDS,),
        write=write_27753,
    ),
    RealBug(
        id="vllm-39773",
        title="EAGLE draft decodes in PIECEWISE graphs: FlashInfer's native decode plans a row per padded token",
        links=("https://github.com/vllm-project/vllm/pull/39773",),
        date="2026-04",
        engine="vLLM FLASHINFER",
        mode="DECODE (EAGLE draft decode, PIECEWISE graph)",
        mechanism="Model Runner V2 let EAGLE draft decodes run in PIECEWISE mode, which pads num_tokens to the capture size "
        "but not the requests; for a single-token decode batch FlashInfer's builder takes num_decode_tokens (= the padded "
        "num_actual_tokens, split_decodes_and_prefills) as its row count and planned paged_kv_indptr[:num_decode_tokens + 1] "
        "from its persistent buffer, whose entries past the requests are stale: stale paged-KV rows read by the decode "
        "kernel. The fix keeps draft decodes out of PIECEWISE graphs (FULL or eager only)",
        encoding="3 draft-decode requests (seq_lens 21, 34, 9; block 16) with num_actual_tokens padded to 4 (slot -1 for the "
        "padded token); FlashInfer metadata (0.11 host-list fields) with num_decodes 3, num_decode_tokens 4, "
        "paged_kv_indptr_cpu of 5 entries whose last (stale) is 11 past the 6 listed pages, paged_kv_last_page_len_cpu of 4; "
        "twin: the eager step (3 tokens, 3 rows); max_num_seqs 256 recorded (capture.max_bs)",
        expected=("invariants/builder-rows", "invariants/builder-counts", "invariants/kv-length", "invariants/unowned-tokens"),
        keywords=("num_decode_tokens", "stale", "paged_kv_indptr"),
        capabilities=(Capability.CROSS_FIELDS, Capability.PADDED_ROWS),
        write=write_39773,
    ),
    RealBug(
        id="vllm-56181",
        title="DFlash draft attention metadata counts the DP padding tokens: q rows past qo_indptr[-1]",
        links=("https://github.com/vllm-project/vllm/pull/56181", "https://github.com/vllm-project/vllm/pull/55458"),
        date="2026-09",
        engine="vLLM FLASHINFER",
        mode="MIXED (DFlash draft pass, prefill path)",
        mechanism="with DP > 1 the DP sync pads the drafter's tokens; the DFlash speculators built the draft attention "
        "metadata with that padded num_tokens while query_start_loc_cpu counted only the requests' tokens, so FlashInfer's "
        "prefill run got q of 52 rows for qo_indptr[-1] = 48 (ValueError); the fix builds the draft metadata with the "
        "padded count only for FULL graphs and query_start_loc[-1] otherwise (#55458 did it for autoregressive drafts)",
        encoding="a DFlash draft pass of 3 requests (4 query tokens each; seq_lens 25, 38, 13; block 16), eager, through the "
        "vLLM converter: CommonAttentionMetadata with num_actual_tokens 16 (12 real + 4 DP padding, slot -1) and "
        "query_start_loc ending at 12; FlashInfer metadata (0.11 host-list fields) with 3 prefills of 12 tokens; twin: "
        "num_actual_tokens 12; max_num_seqs 256 recorded (capture.max_bs). The mask inside the draft block is recorded causal "
        "(the count is what the bug is about)",
        expected=("invariants/unowned-tokens", "invariants/builder-counts", "invariants/qo-lens"),
        keywords=("num_actual_tokens", "query_start_loc", "padding"),
        capabilities=(Capability.CROSS_FIELDS, Capability.PADDED_ROWS),
        write=write_56181,
    ),
)
