"""Speculative draft modes: the draft model's own steps, with their own seq_lens conventions.

- sgl-project/sglang#27738 (2026-06): Triton's eager DRAFT_EXTEND built kv_indices over
  forward_batch.seq_lens (prefix + accepted tokens); the extend kernel gets the accepted tokens'
  K/V from its inputs, so their columns were attended twice (ragged accepted lengths mismatched the
  dense reference). The fix builds them over extend_prefix_lens. Spec v1's draft extend: recorded
  as SGL-classic's DRAFT_EXTEND (the accepted tokens are the query).
- sgl-project/sglang#26628 (2026-05): the revert of #26512, which took DRAFT_EXTEND_V2's seq_lens
  for the prefixes and added extend_seq_lens to FA's cache extent; spec v2 bumps seq_lens to
  prefix + window before the backend plans (#26651), so FA3 read each request's window twice over.
- sgl-project/sglang#25015 (2026-05): EAGLE's draft decode advanced forward_batch.positions before
  each draft forward instead of after: every draft decode step ran at its position + 1.
- sgl-project/sglang#26880 (2026-06): EAGLEDraftCudaGraphRunner padded seq_lens but left
  seq_lens_sum at the raw batch's, which the multi-step draft backends (FlashInfer, FlashInfer MLA,
  Aiter) size their draft kv_indices with.
- sgl-project/sglang#27338 (2026-06): the multi-step FlashInfer draft backend's CUDA-graph
  kv_indices buffer was sized max_bs x max_context_len per step, without the topk factor the
  eager path has; a draft graph replay's lists of bs x topk branch rows ran past their row.
- sgl-project/sglang#22958 (2026-04, closed unmerged): the multi-layer EAGLE draft-extend graph
  runner copied the real requests into its static buffers but never reset the padded rows, which
  kept an earlier replay's request rows, seq_lens and KV slots.

#25015's and #26880's draft decode steps are recorded for topk 1, where each request's draft step
is one query over its own KV row (prefix and the draft tokens written so far). #27338 needs topk > 1:
its draft steps are recorded as their bs x topk branch rows (record/sglang/draft.py), replayed
through the multi-step backend's sub-backends as SGLang runs a draft graph.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug
from tests.record.engines import import_engine

I64, I32 = torch.int64, torch.int32
PREFIX, ACCEPTED = [9, 5, 12], [3, 1, 2]  # ragged accepted lengths, as in the fix's test
ROWS = {1: list(range(10, 22)), 3: list(range(30, 36)), 6: list(range(50, 64))}
triton_backend = import_engine("sglang.srt.layers.attention.triton_backend")


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
    fb.forward_mode = sg.env.ClassicForwardMode.DRAFT_EXTEND  # spec v1: the accepted tokens are the query
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


WINDOW = 4  # speculative_num_draft_tokens: every request's draft-extend window in spec v2
V2_ROWS = {1: list(range(10, 23)), 3: list(range(30, 41)), 6: list(range(50, 67))}  # prefix + window, then spare columns
V2_PREFIX, V2_ACCEPTED = [9, 5, 12], [3, 1, 2]


def _fa3_draft_extend_v2(double_extent: bool) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """FA3's eager DRAFT_EXTEND_V2 metadata (flashattention_backend.py, the extend branch):
        cache_seqlens = seq_lens (already prefix + window), or, as #26512 had it, seq_lens +
        extend_seq_lens; cu_seqlens_q over extend_seq_lens; page_table = req_to_token rows cut to
        max_seq_len_k (page size 1)."""
        cache = fb.seq_lens.to(I64) + (fb.extend_seq_lens.to(I64) if double_extent else 0)
        made.forward_metadata = sg.FlashAttentionMetadata(
            cache_seqlens_int32=cache.to(I32),
            max_seq_len_q=max(fb.extend_seq_lens_cpu),
            max_seq_len_k=int(cache.max()),
            cu_seqlens_q=torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32),
            cu_seqlens_k=torch.nn.functional.pad(torch.cumsum(cache, 0), (1, 0)).to(I32),
            page_table=made.req_to_token_pool.req_to_token[fb.req_pool_indices.to(torch.long), : int(cache.max())].to(I32),
        )

    return plan


def _fa3_v2(out: Path, *, double_extent: bool) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusFA3, V2_ROWS, _fa3_draft_extend_v2(double_extent))
        sg.record_eager(session, made, sg.draft_extend_v2_batch(V2_ROWS, V2_PREFIX, WINDOW, V2_ACCEPTED))


def write_26628(bug: Path, twin: Path) -> None:
    _fa3_v2(bug, double_extent=True)
    _fa3_v2(twin, double_extent=False)


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


class MultiStepDraftGraph:
    """SGLang's FlashInferMultiStepDraftBackend at an EAGLE draft graph replay
    (`init_forward_metadata_out_graph(view)`, flashinfer_backend.py): `common_template` fills every
    step's lists at once into the [num_steps, width] graph buffer (generate_draft_decode_kv_indices,
    row i at offset i x width: a list longer than the row runs into the next), then per step i hands
    the spec input kv_indptr[i, :bs x topk + 1] and the row cut at draft_kv_indices_used_len
    (seq_lens_sum x topk + bs x topk x (i + 1)) to sub-backend i through `build_inner_fb_view`,
    whose decode wrappers for the captured bs plan them (the wrapper's buffers are those very
    tensors). The real kernel and wrappers need a GPU: tensors only here.

    `width`: the row width init_cuda_graph_state gave the buffer (the fix: max_bs x topk x
    max_context_len; before it max_bs x max_context_len)."""

    def __init__(self, rows: dict[int, list[int]], *, topk: int, steps: int, capture_bs: int, width: int, slots: int) -> None:
        self.topk, self.steps = topk, steps
        self.kv_indptr = torch.zeros(steps, capture_bs * topk + 1, dtype=I32)
        self.cuda_graph_kv_indices = torch.zeros(steps, width, dtype=I32)
        tokens = capture_bs * topk
        self.attn_backends = []
        for i in range(steps - 1):
            sub = sg.backend(sg.CorpusFlashInfer, rows, _wrapper_plans)
            sub.token_to_kv_pool.size = slots
            del sub.max_kv_splits  # a Triton setting (sg.prepare's): SGLang's FlashInfer backend has none
            sub.kv_indptr = [self.kv_indptr[i]]  # kv_indptr_buf: row i of the multi-step buffer
            sub.cuda_graph_kv_indices = [self.cuda_graph_kv_indices[i]]  # init_cuda_graph_state(kv_indices_buf=row i)
            decode = sg.wrapper(
                paged_kv_indptr_buf=self.kv_indptr[i][: tokens + 1],
                paged_kv_indices_buf=self.cuda_graph_kv_indices[i],
                paged_kv_last_page_len_buf=torch.ones(tokens, dtype=I32),
                use_tensor_cores=False,
            )
            sub.decode_cuda_graph_metadata = {capture_bs: [decode]}
            self.attn_backends.append(sub)

    def init_forward_metadata_out_graph(self, view: Any, in_capture: bool = False) -> None:
        from sglang.srt.model_executor import forward_batch_info  # looked up at each call, as SGLang's code does

        bs, k = int(view.batch_size), self.topk
        draft_lists(view, self.attn_backends[0].req_to_token_pool.req_to_token, self.kv_indptr, self.cuda_graph_kv_indices, topk=k)
        for i in range(self.steps - 1):
            view.spec_info.kv_indptr = self.kv_indptr[i, : bs * k + 1]
            view.spec_info.kv_indices = self.cuda_graph_kv_indices[i][: int(view.seq_lens_sum) * k + bs * k * (i + 1)]
            inner = forward_batch_info.build_inner_fb_view(view, bs=bs, forward_mode=sg.env.ForwardMode.DECODE)
            self.attn_backends[i].init_forward_metadata_out_graph(inner, in_capture=in_capture)


def draft_lists(view: Any, req_to_token: Tensor, kv_indptr: Tensor, buffer: Tensor, *, topk: int) -> None:
    """generate_draft_decode_kv_indices over the view's padded batch: every step's lists at once,
    step i's at offset i x width of the [num_steps, width] buffer (a list longer than its row runs
    into the next; past the last row into graph memory outside this buffer, not kept here)."""
    bs, steps, width = int(view.batch_size), buffer.shape[0], buffer.shape[1]
    flat = buffer.view(-1)
    for i in range(steps):
        lists = []
        for b in range(bs):
            row, prefix = req_to_token[int(view.req_pool_indices[b])], int(view.seq_lens[b])
            for t in range(topk):
                lists.append(torch.cat([row[:prefix], row[prefix + t * steps : prefix + t * steps + i + 1]]))
        kv_indptr[i, : bs * topk + 1] = torch.nn.functional.pad(torch.cumsum(torch.tensor([x.numel() for x in lists]), 0), (1, 0)).to(kv_indptr.dtype)
        ids = torch.cat(lists)[: flat.numel() - i * width]
        flat[i * width : i * width + ids.numel()] = ids.to(buffer.dtype)


class TritonMultiStepDraftGraph(triton_backend.TritonMultiStepDraftBackend):
    """SGLang's TritonMultiStepDraftBackend (its own init_forward_metadata_out_graph, whose replay
    calls no sub-backend: each step's kernels read their rows of the multi-step buffers), with
    `common_template`'s kernel (generate_draft_decode_kv_indices) done with tensors. Sub-backend i
    holds row i of kv_indptr and cuda_graph_kv_indices, all of them the shared split counts
    (static: max_kv_splits) and stage-1 scratch of max_bs x topk rows."""

    def __init__(self, rows: dict[int, list[int]], *, topk: int, steps: int, capture_bs: int, width: int, slots: int) -> None:
        self.topk, self.speculative_num_steps = topk, steps
        tokens = capture_bs * topk
        self.kv_indptr = torch.zeros(steps, tokens + 1, dtype=I32)
        self.cuda_graph_kv_indices = torch.zeros(steps, width, dtype=I64)
        self.cuda_graph_window_kv_indices, self.window_rail = None, False
        splits = torch.full((tokens,), 8, dtype=I32)
        self.attn_backends = []
        for i in range(steps - 1):
            sub = sg.backend(sg.CorpusTriton, rows, lambda made, fb: None)
            sub.token_to_kv_pool.size = slots
            sub.kv_indptr, sub.cuda_graph_kv_indices, sub.cuda_graph_num_kv_splits = self.kv_indptr[i], self.cuda_graph_kv_indices[i], splits
            sub.cuda_graph_attn_logits = torch.zeros(tokens, sg.HEADS, 8, sg.HEAD_DIM)
            sub.static_kv_splits, sub.enable_deterministic, sub.device_core_count, sub.use_sliding_window_kv_pool = True, False, 0, False
            self.attn_backends.append(sub)

    def common_template(self, forward_batch: Any, kv_indices_buffer: Any, call_fn: Any, window_kv_indices_buffer: Any = None) -> None:
        assert kv_indices_buffer is None and call_fn is None, "only the graph replay's call is stood in for"
        draft_lists(forward_batch, self.attn_backends[0].req_to_token_pool.req_to_token, self.kv_indptr, self.cuda_graph_kv_indices, topk=self.topk)


def _wrapper_plans(made: Any, view: Any) -> None:
    """FlashInferIndicesUpdaterDecode.update with the spec input's lists, into the captured bs's
    decode wrapper: plan() copies them into its graph buffers (here the same tensors)."""
    [decode] = made.decode_cuda_graph_metadata[int(view.batch_size)]
    indptr, indices = view.spec_info.kv_indptr, view.spec_info.kv_indices
    decode._paged_kv_indptr_buf[: indptr.numel()] = indptr
    decode._paged_kv_indices_buf[: indices.numel()] = indices


def draft_graph_rows(prefix: list[int], topk: int, steps: int) -> tuple[dict[int, list[int]], int]:
    """req_to_token rows from pool row 1: each request's prefix, then its topk x steps draft slots
    (branch-major, as assign_draft_cache_locs lays them out); and the pool's slot count."""
    rows, slot = {}, 1
    for r, p in enumerate(prefix, start=1):
        rows[r] = list(range(slot, slot + p + topk * steps))
        slot += p + topk * steps
    return rows, slot


def draft_replay_view(rows: dict[int, list[int]], prefix: list[int], *, topk: int, steps: int, capture_bs: int, fill: int) -> Any:
    """EAGLEDraftCudaGraphRunner.execute's view of a draft decode padded to `capture_bs`: seq_lens
    (the committed prefixes), seq_lens_cpu and req_pool_indices padded (fill, 0), out_cache_loc the
    runner's [bs, topk, steps] buffer (padded slots 0), positions one per branch row (step 0's),
    seq_lens_sum with the padded requests' fill, `num_padding` = capture_bs - raw bs."""
    raw, pad = len(prefix), capture_bs - len(prefix)
    pools = list(rows)
    padded = torch.tensor(prefix + [fill] * pad, dtype=I64)
    fb = sg.env.ForwardBatch(
        forward_mode=sg.env.ForwardMode.DECODE,
        batch_size=capture_bs,
        input_ids=torch.zeros(capture_bs * topk, dtype=I64),
        req_pool_indices=torch.tensor(pools + [0] * pad, dtype=I64),
        seq_lens=padded,
        out_cache_loc=torch.tensor([rows[r][p + j] for r, p in zip(pools, prefix) for j in range(topk * steps)] + [0] * (pad * topk * steps), dtype=I64),
        seq_lens_sum=int(padded.sum()),
        positions=torch.cat([torch.tensor(prefix, dtype=I64).repeat_interleave(topk), torch.zeros(pad * topk, dtype=I64)]),
        seq_lens_cpu=padded.clone(),
        spec_info=sg.env.sgl.eagle_info.EagleDraftInput(num_tokens_per_req=topk),
    )
    return SimpleNamespace(**vars(fb), num_padding=pad)


def record_draft_graph(
    out: Path, prefix: list[int], *, topk: int, steps: int, capture_bs: int, max_context_len: int, topk_factor: bool = True, triton: bool = False
) -> None:
    """One EAGLE draft graph replay of the multi-step FlashInfer (or Triton) draft backend: each of
    its steps - 1 draft steps recorded by the hooks."""
    rows, slots = draft_graph_rows(prefix, topk, steps)
    width = capture_bs * (topk if topk_factor else 1) * max_context_len
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        kind = TritonMultiStepDraftGraph if triton else MultiStepDraftGraph
        multi = kind(rows, topk=topk, steps=steps, capture_bs=capture_bs, width=width, slots=slots)
        before = len(sg.written(session))
        multi.init_forward_metadata_out_graph(draft_replay_view(rows, prefix, topk=topk, steps=steps, capture_bs=capture_bs, fill=1))
        if len(sg.written(session)) != before + steps - 1:
            raise RuntimeError(f"the SGLang hooks recorded {len(sg.written(session)) - before} of {steps - 1} draft steps ({session.stats.stopped_reason or 'no reason given'})")


GRAPH_PREFIX = [18, 15, 16]  # with the padded request's fill 1: seq_lens_sum 50, x topk 2 = 100 ids past a row of 4 x 24


# -- DRAFT_EXTEND_V2 under CUDA graphs (EAGLEDraftExtendCudaGraphRunner) ---------------------------------

extend_runner_module = import_engine("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner")


class DraftExtendGraph(extend_runner_module.EAGLEDraftExtendCudaGraphRunner):
    """SGLang's draft-extend graph runner without its GPU __init__ and capture: `execute` is
    SGLang's own (it pads the static buffers, builds the backend's view and calls its
    init_forward_metadata_out_graph); only the graph's replay is left out."""

    def __init__(self, backend: Any, *, capture_bs: list[int], width: int, fill: int) -> None:
        self.draft_extend_attn_backend, self.capture_bs, self.captured_req_width, self.seq_len_fill_value = backend, capture_bs, width, fill
        self.max_bs = max_bs = max(capture_bs)
        self.forward_mode = sg.env.ForwardMode.DRAFT_EXTEND_V2
        self.deepep_adapter = SimpleNamespace(replay=lambda: None)
        self.require_mlp_tp_gather = self.require_gathered_buffer = False
        self.model_runner = SimpleNamespace(model_config=SimpleNamespace(model_is_mrope=False), device_timer=None, shared_read_done_event=None)
        self.extend_seq_lens_cpu = [width] * max_bs
        tokens = max_bs * width
        self.buffers = SimpleNamespace(
            input_ids=torch.zeros(tokens, dtype=I64),
            req_pool_indices=torch.zeros(max_bs, dtype=I64),
            seq_lens=torch.full((max_bs,), fill, dtype=I64),
            seq_lens_cpu=torch.full((max_bs,), fill, dtype=I64),
            out_cache_loc=torch.zeros(tokens, dtype=I64),
            positions=torch.zeros(tokens, dtype=I64),
            extend_seq_lens=torch.full((max_bs,), width, dtype=I32),
            num_correct_drafts=torch.zeros(max_bs, dtype=I32),
            num_accept_tokens=torch.zeros(max_bs, dtype=I32),
            select_index=torch.zeros(max_bs, dtype=I64),
            mamba_track_indices=None,
            hidden_states=None,
        )

    def _replay_graph(self, shape_key: Any, forward_batch: Any) -> Any:
        return SimpleNamespace(next_token_logits=torch.zeros(self.max_bs, 1), hidden_states=torch.zeros(self.max_bs, 1))


def triton_draft_extend_graph(stride: int | None = None) -> sg.Plan:
    def plan(made: Any, view: Any) -> None:
        """TritonAttnBackend._update_draft_extend_buffers: qo_indptr strided by `stride` (0.5.23:
        num_draft_tokens, the window), kv lists over the prefixes (seq_lens less the spec input's
        extend lengths, clamped at 0 for the padded rows) into the graph buffers."""
        bs, n = int(view.batch_size), stride or made.num_draft_tokens
        made.qo_indptr[: bs + 1] = torch.arange(0, bs * n + 1, n, dtype=I32)
        lens = torch.clamp(view.seq_lens[:bs] - view.spec_info.extend_seq_lens_tensor[:bs].to(I64), min=0)
        indptr, indices = sg.kv_lists(made, SimpleNamespace(req_pool_indices=view.req_pool_indices[:bs]), lens)
        made.kv_indptr[: bs + 1] = indptr
        made.cuda_graph_kv_indices[: indices.numel()] = indices

    return plan


def flashinfer_draft_extend_graph(made: Any, view: Any) -> None:
    """FlashInfer's DRAFT_EXTEND_V2 replay: the bs graph's paged prefill wrapper planned causal over
    the whole sequences (seq_lens), the queries the spec input's extend lengths."""
    bs = int(view.batch_size)
    [paged] = made.draft_extend_cuda_graph_metadata[bs]
    lens = view.seq_lens[:bs].to(I64)
    indptr, indices = sg.kv_lists(made, SimpleNamespace(req_pool_indices=view.req_pool_indices[:bs]), lens)
    paged._qo_indptr_buf[: bs + 1] = torch.nn.functional.pad(torch.cumsum(view.spec_info.extend_seq_lens_tensor[:bs].to(I64), 0), (1, 0)).to(I32)
    paged._paged_kv_indptr_buf[: bs + 1] = indptr
    paged._paged_kv_indices_buf[: indices.numel()] = indices.to(I32)


def draft_extend_graph_backend(rows: dict[int, list[int]], window: int, *, capture_bs: list[int], triton: bool, stride: int | None = None, slots: int | None = None) -> Any:
    """The Triton or FlashInfer backend a draft-extend graph runner replays over, its graph buffers
    sized for the largest captured bs."""
    max_bs = max(capture_bs)
    width = max_bs * (max(len(r) for r in rows.values()) + window)
    if triton:
        made = sg.backend(sg.CorpusTriton, rows, triton_draft_extend_graph(stride))
        made.num_draft_tokens, made.max_kv_splits = window, 8
        made.qo_indptr, made.kv_indptr = torch.zeros(max_bs + 1, dtype=I32), torch.zeros(max_bs + 1, dtype=I32)
        made.cuda_graph_kv_indices = torch.zeros(width, dtype=I64)
        made.forward_metadata = SimpleNamespace(max_extend_len=window)
    else:
        made = sg.backend(sg.CorpusFlashInfer, rows, flashinfer_draft_extend_graph)
        made.draft_extend_cuda_graph_metadata = {
            bs: [
                sg.wrapper(
                    qo_indptr_buf=torch.zeros(bs + 1, dtype=I32),
                    paged_kv_indptr_buf=torch.zeros(bs + 1, dtype=I32),
                    paged_kv_indices_buf=torch.zeros(width, dtype=I32),
                    paged_kv_last_page_len_buf=torch.ones(bs, dtype=I32),
                )
            ]
            for bs in capture_bs
        }
    if slots is not None:
        made.token_to_kv_pool.size = slots
    return made


def _recorded(session: Any, before: int, expected: int) -> None:
    if len(sg.written(session)) != before + expected:
        raise RuntimeError(f"the SGLang hooks recorded {len(sg.written(session)) - before} of {expected} draft-extend graph replays ({session.stats.stopped_reason or 'no reason given'})")


def record_draft_extend_graph(
    out: Path, rows: dict[int, list[int]], prefix: list[int], window: int, accepted: list[int], *, capture_bs: list[int], triton: bool, stride: int | None = None, slots: int | None = None
) -> None:
    """One DRAFT_EXTEND_V2 step replayed by the draft-extend graph runner over the Triton or
    FlashInfer backend's graph buffers (sized for the largest captured bs)."""
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = draft_extend_graph_backend(rows, window, capture_bs=capture_bs, triton=triton, stride=stride, slots=slots)
        runner = DraftExtendGraph(made, capture_bs=capture_bs, width=window, fill=made.get_cuda_graph_seq_len_fill_value())
        fb = sg.draft_extend_v2_batch(rows, prefix, window, accepted)
        before = len(sg.written(session))
        runner.execute(fb, torch.arange(len(prefix), dtype=I64))
        _recorded(session, before, 1)


# -- DRAFT_EXTEND_V2 under CUDA graphs, multi-layer EAGLE (MTP) ------------------------------------------

multi_layer_module = import_engine("sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner")


class MultiLayerDraftExtendStep(multi_layer_module.MultiLayerEagleDraftExtendCudaGraphRunner):
    """One draft layer's runner without its GPU __init__ and capture: `replay` is SGLang's own (it
    builds its view over the shared buffers and calls its layer's backend's
    init_forward_metadata_out_graph); only the graph's replay is left out."""

    def __init__(self, worker: Any, step: int, *, capture_bs: list[int], width: int, fill: int) -> None:
        self.step, self.eagle_worker = step, worker
        self.forward_mode = sg.env.ForwardMode.DRAFT_EXTEND_V2
        self.attn_backend = worker.draft_extend_attn_backend_list[step]
        self.metadata_captured_in_graph = self.attn_backend.draft_extend_metadata_captured_in_graph()
        self.deepep_adapter = SimpleNamespace(replay=lambda: None)
        self.model_runner = SimpleNamespace(device_timer=None)
        self.capture_bs, self.max_bs, self.captured_req_width, self.num_front_tokens, self.seq_len_fill_value = capture_bs, max(capture_bs), width, 0, fill
        self.require_gathered_buffer = self.require_mlp_tp_gather = self.require_mlp_sync = self.disable_padding = False
        self.prune_draft_extend_logits = True

    def _replay_graph(self, shape_key: Any, forward_batch: Any) -> Any:
        rows = self.max_bs
        return SimpleNamespace(next_token_logits=torch.zeros(rows, 1), hidden_states=None, topk_p=torch.zeros(rows, 1), topk_index=torch.zeros(rows, 1, dtype=I64))


def prepare_fill(*, pad: bool) -> Any:
    """What prepare's fill_draft_extend_prepare_buffers writes into the shared buffers (the Triton
    kernel's real rows, on the host): the real rows copied; with `pad` the padded rows as the
    single-layer runner pads them (seq_lens at the fill, slots, positions, input ids and request
    rows 0), without it they keep what an earlier replay left."""

    def fill(input_ids, positions, out_cache_loc, src_input_ids, src_positions, src_out_cache_loc, seq_lens, req_pool_indices, num_correct_drafts, num_accept_tokens,
             select_index, temperatures, src_seq_lens, src_req_pool_indices, src_num_correct_drafts, src_num_accept_tokens, src_temperatures, hidden_states,
             src_hidden_states, global_num_tokens, global_num_tokens_for_logprob, raw_bs, bs, num_tokens_per_bs, num_front_tokens, seq_len_fill_value) -> None:  # fmt: skip
        tokens = src_input_ids.shape[0]
        if pad:
            for buffer in (input_ids, positions, out_cache_loc):
                buffer[tokens : bs * num_tokens_per_bs].zero_()
            seq_lens[raw_bs:bs].fill_(seq_len_fill_value)
            req_pool_indices[raw_bs:bs].zero_()
            num_accept_tokens[raw_bs:bs].fill_(-1)
        for buffer, src in ((input_ids, src_input_ids), (positions, src_positions), (out_cache_loc, src_out_cache_loc)):
            buffer[:tokens].copy_(src)
        for buffer, src in ((seq_lens, src_seq_lens), (req_pool_indices, src_req_pool_indices), (num_correct_drafts, src_num_correct_drafts), (num_accept_tokens, src_num_accept_tokens)):
            buffer[:raw_bs].copy_(src)
        select_index[:bs] = torch.arange(bs, dtype=I64) * num_tokens_per_bs + num_front_tokens + num_correct_drafts[:bs].to(I64)

    return fill


class MultiLayerDraftExtendGraph(multi_layer_module.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """SGLang's multi-layer draft-extend runner (one shared buffer set, one step runner per draft
    layer, each over its own backend) without its GPU __init__ and capture: `prepare` and `replay`
    are SGLang's own; prepare's Triton fill kernel is `fill` on the host."""

    def __init__(self, backends: list[Any], *, capture_bs: list[int], width: int, fill: int, pad: bool = True) -> None:
        worker = SimpleNamespace(draft_extend_attn_backend_list=backends)
        self.eagle_worker, self.draft_extend_attn_backend_list, self.speculative_num_steps = worker, backends, len(backends)
        self.runners = [MultiLayerDraftExtendStep(worker, step, capture_bs=capture_bs, width=width, fill=fill) for step in range(len(backends))]
        self.capture_bs, self.max_bs, self.captured_req_width, self.num_front_tokens, self.seq_len_fill_value = capture_bs, max(capture_bs), width, 0, fill
        self.require_gathered_buffer = self.require_mlp_tp_gather = self.require_mlp_sync = self.disable_padding = False
        self.prune_draft_extend_logits = True
        self._out_cache_loc_virtual = self._kv_loc_plan = self._kv_loc_cols = None
        self.fill = prepare_fill(pad=pad)
        max_bs, tokens = self.max_bs, self.max_bs * width
        # as _allocate_buffers lays them out (out_cache_loc starts at ones, seq_lens at the fill)
        self.buffers = SimpleNamespace(
            input_ids=torch.zeros(tokens, dtype=I64),
            out_cache_loc=torch.ones(tokens, dtype=I64),
            positions=torch.zeros(tokens, dtype=I64),
            seq_lens=torch.full((max_bs,), fill, dtype=I32),
            seq_lens_cpu=torch.full((max_bs,), fill, dtype=I32),
            req_pool_indices=torch.zeros(max_bs, dtype=I64),
            mamba_track_indices=None,
            num_correct_drafts=torch.ones(max_bs, dtype=I32),
            num_accept_tokens=torch.ones(max_bs, dtype=I32),
            extend_seq_lens=torch.full((max_bs,), width, dtype=I32),
            extend_start_loc=torch.arange(0, tokens, width, dtype=I32),
            select_index=torch.zeros(max_bs, dtype=I64),
            hidden_states=torch.zeros(tokens, 1),
            global_num_tokens_gpu=None,
            global_num_tokens_for_logprob_gpu=None,
            temperatures=None,
            draft_probs=None,
            sampling_seed=None,
        )
        for runner in self.runners:
            runner.buffers = self.buffers

    def prepare(self, forward_batch: Any, *, staged: bool = False) -> None:
        kernel = multi_layer_module.fill_draft_extend_prepare_buffers
        multi_layer_module.fill_draft_extend_prepare_buffers = self.fill
        try:
            super().prepare(forward_batch, staged=staged)
        finally:
            multi_layer_module.fill_draft_extend_prepare_buffers = kernel


def multi_layer_draft_extend_batch(rows: dict[int, list[int]], prefix: list[int], window: int, accepted: list[int]) -> Any:
    """A DRAFT_EXTEND_V2 batch as the multi-layer worker hands its runner's prepare: the spec
    input carries the target's hidden states, a row per token."""
    fb = sg.draft_extend_v2_batch(rows, prefix, window, accepted)
    fb.spec_info.hidden_states = torch.zeros(len(prefix) * window, 1)
    return fb


def record_multi_layer_draft_extend_graph(
    out: Path, replays: list[tuple[dict[int, list[int]], list[int], list[int]]], window: int, *, layers: int, capture_bs: list[int], triton: bool, pad: bool = True
) -> None:
    """DRAFT_EXTEND_V2 batches (rows, prefixes, accepted), each replayed by the multi-layer
    draft-extend runner (prepare once, then each layer's step) over `layers` Triton or FlashInfer
    backends: one recorded step per layer and batch."""
    every_row = {r: cols for rows, _, _ in replays for r, cols in rows.items()}
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        backends = [draft_extend_graph_backend(every_row, window, capture_bs=capture_bs, triton=triton) for _ in range(layers)]
        runner = MultiLayerDraftExtendGraph(backends, capture_bs=capture_bs, width=window, fill=backends[0].get_cuda_graph_seq_len_fill_value(), pad=pad)
        before = len(sg.written(session))
        for rows, prefix, accepted in replays:
            runner.prepare(multi_layer_draft_extend_batch(rows, prefix, window, accepted))
            for step in range(layers):
                runner.replay(step)
        _recorded(session, before, layers * len(replays))


def write_27338(bug: Path, twin: Path) -> None:
    options = dict(topk=2, steps=3, capture_bs=4, max_context_len=24)
    record_draft_graph(bug, GRAPH_PREFIX, topk_factor=False, **options)
    record_draft_graph(twin, GRAPH_PREFIX, **options)


def write_27545(bug: Path, twin: Path) -> None:
    # topk 2, 2 steps: a window of 4 draft tokens (WINDOW), while num_steps + 1 is 3
    for out, stride in ((bug, 3), (twin, None)):
        record_draft_extend_graph(out, V2_ROWS, V2_PREFIX, WINDOW, V2_ACCEPTED, capture_bs=[1, 2, 4, 8], triton=True, stride=stride)


# Two batches through the multi-layer runner: the request of row 1 finished between them, so the
# second (3 requests) is padded to the captured bs 4 over the buffers the first (4 requests) filled;
# each request's prefix grew by what it accepted.
MULTI_ROWS = {1: list(range(10, 23)), 3: list(range(30, 45)), 6: list(range(50, 70)), 8: list(range(80, 95))}
MULTI_REPLAYS = [
    ({r: MULTI_ROWS[r] for r in (1, 3, 6, 8)}, [9, 5, 12, 7], [3, 1, 2, 2]),
    ({r: MULTI_ROWS[r] for r in (3, 6, 8)}, [6, 14, 9], [2, 1, 3]),
]


def write_22958(bug: Path, twin: Path) -> None:
    for out, pad in ((bug, False), (twin, True)):
        record_multi_layer_draft_extend_graph(out, MULTI_REPLAYS, WINDOW, layers=2, capture_bs=[1, 2, 4, 8], triton=True, pad=pad)


BUGS = (
    RealBug(
        id="sglang-22958",
        title="Multi-layer EAGLE draft-extend graph runner never pads its replay buffers",
        links=("https://github.com/sgl-project/sglang/pull/22958",),
        date="2026-04",
        engine="SGLang (any)",
        mode="DRAFT_EXTEND_V2 graph (multi-layer EAGLE)",
        mechanism="the multi-layer runner's replay copied the real requests into its shared static buffers but, unlike the "
        "single-layer runner, never reset the padded rows [raw_bs:bs]: their req_pool_indices, seq_lens, out_cache_loc and "
        "positions kept an earlier replay's values (stale pool rows indexed req_to_token out of bounds; fix PR closed)",
        encoding="2 draft layers (Triton), window 4, captured bs 4: a replay of 4 requests (rows 1, 3, 6, 8), then one of the "
        "3 still running (row 1 finished) padded to 4, each run by SGLang's MultiLayerEagleMultiStepDraftExtendCudaGraphRunner "
        "prepare and per-layer replay; the bug's prepare fill copies the real rows only, so the padded row keeps row 8's "
        "earlier window (seq_len 11, slots 87-90, now its prefix and window); the twin's pads as the single-layer runner does",
        expected=("fill-value/padded-kv-write",),
        keywords=("did not reset", "stale"),
        capabilities=(Capability.FORWARD_MODES, Capability.PADDED_ROWS),
        write=write_22958,
    ),
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
        encoding="3 draft-extend requests (prefixes 9, 5, 12; accepted 3, 1, 2) with the v1 worker's seq_lens = prefix + accepted, "
        "as SGL-classic's DRAFT_EXTEND (the installed SGLang 0.5.23 names only DRAFT_EXTEND_V2, whose query is the whole window: "
        "the step carries the classic name); Triton ForwardMetadata with kv lists over seq_lens; layer 0 recorded (q, new K/V, "
        "prefix rows) with the output Triton's extend kernel computes from that metadata",
        expected=("invariants/kv-length", "invariants/kv-index", "split-merge/recorded-output-mismatch"),
        keywords=("accepted", "extend_prefix_lens"),
        capabilities=(Capability.FORWARD_MODES,),
        write=write_27738,
    ),
    RealBug(
        id="sglang-27545",
        title="Triton spec-v2 draft-extend graph strides qo_indptr by num_steps + 1, not the window",
        links=("https://github.com/sgl-project/sglang/pull/27545",),
        date="2026-06",
        engine="SGLang triton",
        mode="DRAFT_EXTEND_V2 graph (topk > 1)",
        mechanism="_update_draft_extend_buffers laid qo_indptr out with speculative_num_steps + 1 tokens per request (the classic "
        "draft extend's width) while the spec-v2 runner lays out num_draft_tokens per request; with topk > 1 the two differ and at "
        "bs > 1 every request after the first read another's queries (NaN); eager steps were right",
        encoding="3 spec-v2 draft extends (prefixes 9, 5, 12; window 4 = num_draft_tokens of topk 2, 2 steps; accepted 3, 1, 2) run "
        "by SGLang's EAGLEDraftExtendCudaGraphRunner.execute padded to the captured bs 4; the Triton backend's graph buffers refilled "
        "with qo_indptr strided by 3 (the twin: by the window), kv lists over the prefixes",
        expected=("invariants/qo-lens",),
        keywords=("window", "num_tokens_per_req"),
        capabilities=(Capability.FORWARD_MODES, Capability.PADDED_ROWS),
        write=write_27545,
    ),
    RealBug(
        id="sglang-26628",
        title="FA3 DRAFT_EXTEND_V2 cache extent counts the window twice (#26512, reverted)",
        links=("https://github.com/sgl-project/sglang/pull/26628", "https://github.com/sgl-project/sglang/pull/26512", "https://github.com/sgl-project/sglang/pull/26651"),
        date="2026-05",
        engine="SGLang fa3",
        mode="DRAFT_EXTEND_V2",
        mechanism="#26512 read DRAFT_EXTEND_V2's seq_lens as the prefixes and set FA's cache_seqlens, cu_seqlens_k and max_seq_len_k "
        "to seq_lens + extend_seq_lens; spec v2 bumps seq_lens to prefix + window before init_forward_metadata (#26651), so the "
        "kernel's cache extent ran a whole window past each request's KV (columns req_to_token never filled); #26628 reverted it",
        encoding="3 spec-v2 draft extends (prefixes 9, 5, 12; window 4; accepted 3, 1, 2) as prepare_for_draft_extend builds them "
        "(extend_seq_lens = 4 each, seq_lens = prefix + 4); FA3 metadata with cache_seqlens = seq_lens + extend_seq_lens and the "
        "page table cut to that max",
        expected=("invariants/kv-length", "invariants/page-table"),
        keywords=("window", "twice", "extend_seq_lens"),
        capabilities=(Capability.FORWARD_MODES,),
        write=write_26628,
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
    RealBug(
        id="sglang-27338",
        title="EAGLE draft CUDA-graph kv_indices buffer lacks the topk factor",
        links=("https://github.com/sgl-project/sglang/pull/27338", "https://github.com/sgl-project/sglang/issues/26340"),
        date="2026-06",
        engine="SGLang flashinfer",
        mode="DECODE graph (draft decode, topk > 1)",
        mechanism="generate_draft_decode_kv_indices packs topk branch rows per request (topk x seq_len entries); the multi-step draft "
        "graph buffer was max_bs x max_context_len, so past it the kernel wrote into adjacent graph memory (out-of-vocab draft ids)",
        encoding="3 draft-decode requests (topk 2, 3 steps; prefixes 18, 15, 16) replayed in a bs-4 EAGLE draft graph (fill 1) through "
        "the multi-step FlashInfer draft backend's init_forward_metadata_out_graph: each step's lists written into its row of the "
        "[3, width] graph buffer, handed to its sub-backend through build_inner_fb_view, planned into the captured bs's decode "
        "wrapper; width 4 x 24 (max_bs x max_context_len; the fix: 4 x 2 x 24); both recorded draft steps",
        expected=("invariants/capture-kv-indices",),
        keywords=("without the topk factor",),
        capabilities=(Capability.ALREADY, Capability.FORWARD_MODES),
        write=write_27338,
    ),
)
