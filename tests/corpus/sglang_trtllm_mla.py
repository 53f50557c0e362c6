"""SGLang's trtllm_mla backend (FlashInfer's trtllm-gen MLA kernels, SM100 only) at a spec-v2
draft extend replayed by EAGLEDraftExtendCudaGraphRunner.

- sgl-project/sglang#21987 (2026-04; the same fix as #19807): the draft-extend graph capture laid
  cu_seqlens_q out with a uniform stride (arange by num_draft_tokens, the runner's layout and the
  padded query the captured kernel reads), while the replay refilled it with a variable stride
  (cumsum(accept_length + 1)), max_seq_len_q = max(accept_length) + 1 and seq_lens_q =
  accept_length + 1. The fix keeps the capture's layout at replay.

The backend's module imports flashinfer and GPU-only kernels, so its stand-in subclasses SGLang's
real AttentionBackend and carries the names SGL-new stamps (trtllm_mla), as FA3's does; its
metadata is SGLang's own TRTLLMMLADecodeMetadata (read from SGLang's source). The DRAFT_EXTEND_V2
branches of _init_cuda_graph_metadata (at capture) and _apply_cuda_graph_metadata (at replay) are
done with tensors only: create_flashmla_kv_indices_triton's block table is req_to_token's page ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug
from tests.corpus.sglang_draft_modes import DraftExtendGraph, _recorded
from tests.record.test_sglang_plans import sglang_class

I64, I32 = torch.int64, torch.int32
TRTLLMMLADecodeMetadata = sglang_class("sglang.srt.layers.attention.trtllm_mla_backend", "TRTLLMMLADecodeMetadata")
PAGE = 32  # trtllm-gen's MLA kernels take pages of 32 or 64 tokens (SGLang asserts it)
WINDOW = 4  # speculative_num_draft_tokens: every request's draft-extend window in spec v2
ROWS = {1: list(range(32, 45)), 3: list(range(64, 75)), 6: list(range(96, 113))}  # one page each: prefix + window, then spare columns
PREFIX, ACCEPTED = [9, 5, 12], [3, 1, 2]  # ragged accepted lengths (num_accept_tokens = accept_length + 1)
CAPTURE_BS = [1, 2, 4, 8]
MAX_CONTEXT = 64
HEADS = sg.HEADS


class CorpusTRTLLMMLA(sg.PlannedBackend):
    """SGLang's TRTLLMMLABackend (absorbed MLA: use_mla), named as SGL-new stamps it."""

    decode_attention_backend_str = "trtllm_mla"
    prefill_attention_backend_str = "trtllm_mla"
    use_mla = True


def _block_table(made: Any, req_pool_indices: Tensor, seq_lens: Tensor, table: Tensor) -> None:
    """create_flashmla_kv_indices_triton: each row's page ids (req_to_token[req, PAGE p] // PAGE)
    for its cdiv(seq_len, PAGE) pages; the rest of the row as it was."""
    rows = made.req_to_token_pool.req_to_token[req_pool_indices.to(torch.long)]
    for b in range(seq_lens.numel()):
        pages = -(-int(seq_lens[b]) // PAGE)
        table[b, :pages] = (rows[b, : pages * PAGE : PAGE] // PAGE).to(I32)


def _captured(made: Any, bs: int) -> Any:
    """_init_cuda_graph_metadata's DRAFT_EXTEND_V2 branch at capture: the uniform layout of
    num_draft_tokens query rows per request, the block table a view of the graph's buffer."""
    n = made.num_draft_tokens
    return TRTLLMMLADecodeMetadata(
        block_kv_indices=made.decode_cuda_graph_kv_indices[:bs],
        max_seq_len_k=MAX_CONTEXT,
        max_seq_len_q=n,
        sum_seq_lens_q=n * bs,
        cu_seqlens_q=torch.arange(0, bs * n + 1, n, dtype=I32),
        seq_lens_q=torch.full((bs,), n, dtype=I32),
        seq_lens_k=torch.zeros(bs, dtype=I32),
    )


def _replay(variable_stride: bool) -> sg.Plan:
    def plan(made: Any, view: Any) -> None:
        """_apply_cuda_graph_metadata's DRAFT_EXTEND_V2 branch at replay, into the captured bs's
        metadata: seq_lens_k and the block table over the view's seq_lens. The fix (0.5.23) keeps
        the capture's query layout (max_seq_len_q = num_draft_tokens); before it the replay
        refilled cu_seqlens_q and seq_lens_q from accept_length + 1 (the spec input's
        num_accept_tokens) and set max_seq_len_q = max(accept_length) + 1."""
        bs = int(view.batch_size)
        md = made.decode_cuda_graph_metadata[bs]
        if variable_stride:
            accepted = view.spec_info.num_accept_tokens[:bs].to(I32)
            md.max_seq_len_q = int(accepted.max())
            md.sum_seq_lens_q = int(accepted.sum())
            md.seq_lens_q.copy_(accepted)
            md.cu_seqlens_q.copy_(torch.nn.functional.pad(torch.cumsum(accepted, 0), (1, 0)).to(I32))
        else:
            md.max_seq_len_q = made.num_draft_tokens
            md.sum_seq_lens_q = made.num_draft_tokens * bs
        seq_lens = view.seq_lens[:bs]
        md.seq_lens_k.copy_(seq_lens.to(I32))
        _block_table(made, view.req_pool_indices[:bs], seq_lens, md.block_kv_indices)

    return plan


def trtllm_mla_backend(plan: sg.Plan) -> Any:
    """The backend after capture: a metadata object per captured bs, the graph's block table
    buffer ([max_bs, cdiv(max_context_len, page)], -1 at init) shared by them."""
    made = sg.backend(CorpusTRTLLMMLA, ROWS, plan, page_size=PAGE)
    made.token_to_kv_pool.size = 4 * PAGE * 2  # pages 1-7 and spares; page 0 is the dummy page
    made.num_draft_tokens = WINDOW
    made.decode_cuda_graph_kv_indices = torch.full((max(CAPTURE_BS), -(-MAX_CONTEXT // PAGE)), -1, dtype=I32)
    made.decode_cuda_graph_metadata = {bs: _captured(made, bs) for bs in CAPTURE_BS}
    made.forward_decode_metadata = made.decode_cuda_graph_metadata[max(CAPTURE_BS)]  # the last capture's
    return made


def record_draft_extend_graph(out: Path, *, variable_stride: bool) -> None:
    """One DRAFT_EXTEND_V2 step of 3 requests run by SGLang's EAGLEDraftExtendCudaGraphRunner.execute,
    padded to the captured bs 4, over the trtllm_mla backend's captured metadata."""
    with sg.recording(out) as session:
        layer = sg.layer(heads=HEADS, kv_heads=1, head_dim=576, v_head_dim=512)  # noqa: F841 (absorbed MLA: latent 512 + rope 64)
        made = trtllm_mla_backend(_replay(variable_stride))
        runner = DraftExtendGraph(made, capture_bs=CAPTURE_BS, width=WINDOW, fill=made.get_cuda_graph_seq_len_fill_value())
        fb = sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED)
        before = len(sg.written(session))
        runner.execute(fb, torch.arange(len(PREFIX), dtype=I64))
        _recorded(session, before, 1)


def write_21987(bug: Path, twin: Path) -> None:
    record_draft_extend_graph(bug, variable_stride=True)
    record_draft_extend_graph(twin, variable_stride=False)


BUGS = (
    RealBug(
        id="sglang-21987",
        title="trtllm_mla draft-extend graph replay builds cu_seqlens_q with another stride than its capture",
        links=("https://github.com/sgl-project/sglang/pull/21987", "https://github.com/sgl-project/sglang/pull/19807"),
        date="2026-04",
        engine="SGLang trtllm_mla",
        mode="DRAFT_EXTEND_V2 graph",
        mechanism="init_forward_metadata_capture_cuda_graph built cu_seqlens_q with a uniform stride (arange by num_draft_tokens), "
        "while the replay path built it with a variable stride (cumsum(accept_length + 1)) and max_seq_len_q = max(accept_length) + 1: "
        "the captured kernel read the replay's offsets with the capture's layout; the fix replays the uniform stride, "
        "max_seq_len_q = num_draft_tokens and seq_lens_q filled with num_draft_tokens",
        encoding="3 spec-v2 draft extends (prefixes 9, 5, 12; window 4; accepted 3, 1, 2; 32-token pages) run by SGLang's "
        "EAGLEDraftExtendCudaGraphRunner.execute padded to the captured bs 4, over a trtllm_mla stand-in (SGLang's "
        "AttentionBackend subclass named trtllm_mla: its module needs flashinfer and a GPU) whose TRTLLMMLADecodeMetadata per "
        "captured bs holds the capture's uniform layout; the bug's replay refills cu_seqlens_q and seq_lens_q in place from "
        "num_accept_tokens (accept_length + 1, the padded row the window); the twin's keeps the capture's layout",
        expected=("invariants/qo-lens",),
        keywords=("uniform stride", "accepted lengths"),
        capabilities=(Capability.FORWARD_MODES, Capability.BACKEND_NAMES, Capability.SPLITS_VS_CAPTURE),
        write=write_21987,
    ),
)
