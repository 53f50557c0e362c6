"""Speculative draft modes: the draft model's own steps, with their own seq_lens conventions.

- sgl-project/sglang#27738 (2026-06): Triton's eager DRAFT_EXTEND built kv_indices over
  forward_batch.seq_lens (prefix + accepted tokens); the extend kernel gets the accepted tokens'
  K/V from its inputs, so their columns were attended twice (ragged accepted lengths mismatched the
  dense reference). The fix builds them over extend_prefix_lens.
- sgl-project/sglang#25015 (2026-05): EAGLE's draft decode advanced forward_batch.positions before
  each draft forward instead of after: every draft decode step ran at its position + 1.
- sgl-project/sglang#26880 (2026-06): EAGLEDraftCudaGraphRunner padded seq_lens but left
  seq_lens_sum at the raw batch's, which the multi-step draft backends (FlashInfer, FlashInfer MLA,
  Aiter) size their draft kv_indices with.

The draft decode steps are recorded for topk 1, where each request's draft step is one query over
its own KV row (prefix and the draft tokens written so far): the DECODE form the recorder writes.
For topk > 1 a draft step has bs x topk branch rows, which have no Batch form (see the corpus'
not-expressible entries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
PREFIX, ACCEPTED = [9, 5, 12], [3, 1, 2]  # ragged accepted lengths, as in the fix's test
ROWS = {1: list(range(10, 22)), 3: list(range(30, 36)), 6: list(range(50, 64))}


def _draft_extend(over_seq_lens: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """Triton's eager DRAFT_EXTEND metadata: qo_indptr = cumsum(accepted), kv lists over the
        prefix (the fix) or over seq_lens (the bug), max_extend_len = max(accepted)."""
        kv = fb.seq_lens if over_seq_lens else fb.extend_prefix_lens
        indptr, indices = sg.kv_lists(made, fb, kv.to(I64))
        made.forward_metadata = sg.env.TritonForwardMetadata(
            None, None, max(ACCEPTED), None, indptr, indices,
            torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32),
            None, None, None, None, None, None,
        )  # fmt: skip

    return plan


def _record(out: Path, *, over_seq_lens: bool) -> None:
    """The draft extend recorded with its layer (`record --layers 0`): the engine's output is what
    Triton's extend kernel computes from the metadata it was given (sg.triton_extend)."""
    fb = sg.extend_batch(ROWS, PREFIX, ACCEPTED)
    fb.forward_mode = sg.env.ForwardMode.DRAFT_EXTEND_V2  # SGL-new renamed DRAFT_EXTEND
    data = sg.layer_data(27738, tokens=sum(ACCEPTED))
    k_cache, v_cache = sg.with_new_kv(data, fb)
    with sg.recording(out, layers=(0,)) as session:
        layer = sg.layer()
        made = sg.backend(sg.CorpusTriton, ROWS, _draft_extend(over_seq_lens))
        made.token_to_kv_pool = sg.kv_pool(data["k_pool"], data["v_pool"])
        made.run_layer = lambda q, k, v, layer, fb: sg.triton_extend(made.forward_metadata, q, k, v, k_cache, v_cache, layer.scaling).to(q.dtype)
        sg.record_eager(session, made, fb)
        made.forward(data["q"], data["k"], data["v"], layer, fb)


def write_27738(bug: Path, twin: Path) -> None:
    _record(bug, over_seq_lens=True)
    _record(twin, over_seq_lens=False)


DECODE_ROWS = {1: list(range(10, 22)), 3: list(range(30, 37)), 6: list(range(50, 59))}
DECODE_LENS = [12, 7, 9]  # each request's prefix plus the draft tokens written so far, the current one last


def _draft_decode(positions_ahead: int) -> tuple[Any, Any]:
    fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
    fb.positions = fb.positions + positions_ahead  # eagle_worker: positions.add_(1) before the forward (the bug)
    return fb, lambda made, batch: setattr(made, "forward_metadata", sg.triton_decode_metadata(made, batch))


def _positions(out: Path, *, ahead: int) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        fb, plan = _draft_decode(ahead)
        made = sg.backend(sg.CorpusTriton, DECODE_ROWS, plan)
        sg.record_eager(session, made, fb)


def write_25015(bug: Path, twin: Path) -> None:
    _positions(bug, ahead=1)
    _positions(twin, ahead=0)


def _flashinfer_draft_graph(made: Any, view: Any) -> None:
    """The multi-step FlashInfer draft backend's replay: one decode wrapper over the padded draft
    batch, its kv_indices buffer sized from the seq_lens_sum the runner handed over."""
    lens = view.seq_lens.to(I64)
    indptr, indices = sg.kv_lists(made, view, lens, size=max(int(view.seq_lens_sum), int(lens.sum())), garbage=0)
    decode = sg.wrapper(paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=torch.ones(lens.numel(), dtype=I32))
    made.forward_metadata = sg.flashinfer_backend.DecodeMetadata(decode_wrappers=[decode])


def _draft_graph(out: Path, *, padded_sum: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusFlashInfer, DECODE_ROWS, _flashinfer_draft_graph)
        fb = sg.decode_batch(DECODE_ROWS, DECODE_LENS)
        raw = sum(DECODE_LENS)
        view = sg.replay_view(fb, capture_bs=4, fill=1, seq_lens_sum=raw + 1 if padded_sum else raw)
        sg.record_replay(session, made, view)


def write_26880(bug: Path, twin: Path) -> None:
    _draft_graph(bug, padded_sum=False)
    _draft_graph(twin, padded_sum=True)


BUGS = (
    RealBug(
        id="sglang-27738",
        title="Triton DRAFT_EXTEND kv_indices over seq_lens: accepted tokens' K/V attended twice",
        links=("https://github.com/sgl-project/sglang/pull/27738",),
        date="2026-06",
        engine="SGLang triton",
        mode="DRAFT_EXTEND",
        mechanism="the eager DRAFT_EXTEND path built kv_indptr/kv_indices from forward_batch.seq_lens (prefix + accepted); the "
        "Triton extend kernel reads the accepted tokens' K/V from its inputs, so those columns were attended twice "
        "(wrong draft outputs on ragged accepted lengths); the fix uses extend_prefix_lens",
        encoding="3 draft-extend requests (prefixes 9, 5, 12; accepted 3, 1, 2) with the v1 worker's seq_lens = prefix + accepted "
        "(the installed SGLang 0.5.23 names the mode DRAFT_EXTEND_V2 only: the step carries that name); Triton ForwardMetadata "
        "with kv lists over seq_lens; layer 0 recorded (q, new K/V, prefix rows) with the output Triton's extend kernel computes "
        "from that metadata",
        expected=("invariants/kv-length", "invariants/kv-index", "split-merge/recorded-output-mismatch"),
        keywords=("accepted", "extend_prefix_lens"),
        capabilities=(Capability.FORWARD_MODES,),
        write=write_27738,
    ),
    RealBug(
        id="sglang-25015",
        title="EAGLE draft decode steps run one position ahead",
        links=("https://github.com/sgl-project/sglang/pull/25015",),
        date="2026-05",
        engine="SGLang triton",
        mode="DECODE (draft decode, topk 1)",
        mechanism="eagle_worker (v1 and v2) ran forward_batch.positions.add_(1) before each draft decode forward instead of "
        "after, so the draft model's RoPE positions were one too large on every draft decode step (positions 8, 9 for "
        "tokens at 7, 8 in the PR's log)",
        encoding="3 draft-decode requests (topk 1; KV rows 12, 7, 9 including the current draft token); positions = seq_len "
        "instead of seq_len - 1; Triton decode metadata",
        expected=("invariants/positions",),
        keywords=("one ahead", "advanced", "before the forward", "add_(1)"),
        capabilities=(Capability.FORWARD_MODES,),
        write=write_25015,
    ),
    RealBug(
        id="sglang-26880",
        title="EAGLE draft CUDA-graph replay pads seq_lens but not seq_lens_sum",
        links=("https://github.com/sgl-project/sglang/pull/26880",),
        date="2026-06",
        engine="SGLang flashinfer",
        mode="DECODE graph (draft decode, topk 1)",
        mechanism="EAGLEDraftCudaGraphRunner.replay padded batch_size, seq_lens, seq_lens_cpu and req_pool_indices to the "
        "captured bs but left forward_batch.seq_lens_sum at the raw batch's; the multi-step draft backends slice their draft "
        "kv_indices by it, inconsistent with the padded seq_lens",
        encoding="3 draft-decode requests (topk 1) replayed in a bs-4 graph (fill 1); the view's seq_lens_sum = 28, the raw "
        "sum (the padded batch's is 29); FlashInfer decode wrapper",
        expected=("fill-value/seq-lens-sum-ignores-padding",),
        keywords=("raw batch's seq_lens_sum",),
        capabilities=(Capability.ALREADY, Capability.FORWARD_MODES),
        write=write_26880,
    ),
)
