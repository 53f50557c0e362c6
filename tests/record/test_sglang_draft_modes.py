"""The draft model's steps, each recorded by its own SGLang mode's conventions through the
installed hooks (real ForwardBatch, EagleDraftExtendInput / EagleDraftInput, ReqToTokenPool, Triton
ForwardMetadata):

- DRAFT_EXTEND_V2 (spec v2): every request runs its whole verify window (the spec input's
  num_tokens_per_req) whatever it accepted; seq_lens = prefix + window. A correct step checks
  clean, small and server-shaped; one whose seq_lens and extend_seq_lens follow the classic
  convention (the accepted tokens) is recorded as the window it ran and judged by it.
- DRAFT_EXTEND (SGL-classic, spec v1): the accepted tokens are the query.
- draft decode (a multi-step draft backend's sub-backend per step): bs x topk branch rows, each
  its request's prefix and its own draft tokens so far. A correct topk > 1 step checks clean; one
  whose kv_indices are cut without the topk factor is caught. Replayed in an EAGLE draft CUDA graph
  (the multi-step FlashInfer or Triton backend, through build_inner_fb_view), each step is
  recorded the same way (Triton's replay calls no sub-backend: its multi-step backend's hook), with
  its graph section in branch rows and the captured buffer's capacity: correct steps (topk 1 and
  > 1) check clean, a buffer sized without the topk factor is caught.
- DRAFT_EXTEND_V2 replayed by the draft-extend graph runner (SGLang's own execute, padding the
  batch to the captured bs): recorded as the eager step is, with the runner's padded buffers as
  its graph section; a correct replay checks clean on Triton and FlashInfer, Triton's qo_indptr
  strided by num_steps + 1 instead of the window is caught.
- DRAFT_EXTEND_V2 replayed by the multi-layer draft-extend runner (SGLang's own prepare, padding the
  shared buffers once, and each draft layer's replay over its own backend): one step recorded per
  layer, as the single-layer runner's is; correct replays check clean on Triton and FlashInfer, a
  prepare that leaves the padded rows as an earlier replay wrote them is caught.

Checks run on metadata only (the reference backend): they are what judges a mode's lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io
from tests.corpus import sglang_draft_modes as draft_modes
from tests.corpus import sglang_engine as sg

I64, I32 = torch.int64, torch.int32
WINDOW = 4
ROWS = {1: list(range(10, 23)), 3: list(range(30, 41)), 6: list(range(50, 67))}
PREFIX, ACCEPTED = [9, 5, 12], [3, 1, 2]


def triton_eager_extend(made: Any, fb: Any) -> None:
    """Triton's eager metadata of an extend-like step (DRAFT_EXTEND_V2 and the classic draft extend
    take init_forward_metadata's extend branch in SGLang 0.5.23): prefix lists over
    extend_prefix_lens (the new K/V come from the kernel's inputs), qo_indptr = cumsum(extend_seq_lens)."""
    indptr, indices = sg.kv_lists(made, fb, fb.extend_prefix_lens.to(I64))
    qo = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32)
    made.forward_metadata = sg.env.TritonForwardMetadata(None, None, int(fb.extend_seq_lens.max()), None, indptr, indices, qo, None, None, None, None, None, None)


def record(out: Path, fb: Any, rows: dict[int, list[int]] = ROWS, *, pool_slots: int | None = None) -> Any:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusTriton, rows, triton_eager_extend)
        if pool_slots is not None:
            made.token_to_kv_pool.size = pool_slots
        sg.record_eager(session, made, fb)
    [entry] = io.read_manifest(out)
    return io.load(out / entry.file)


def findings(path: Path) -> list:
    reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("reference",))))
    assert all(r.checked for r in reports), [r.error for r in reports]
    return [f for r in reports for f in r.findings]


def with_v1_lengths(fb: Any, accepted: list[int]) -> Any:
    """The classic convention's lengths on a V2 step: seq_lens = prefix + accepted,
    extend_seq_lens = accepted (the window's tokens, slots and positions unchanged)."""
    prefix = fb.extend_prefix_lens.to(I64)
    fb.seq_lens = prefix + torch.tensor(accepted, dtype=I64)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.seq_lens_sum = int(fb.seq_lens.sum())
    fb.extend_seq_lens = torch.tensor(accepted, dtype=I32)
    fb.extend_seq_lens_cpu = list(accepted)
    return fb


def test_v2_step_is_its_window(tmp_path: Path) -> None:
    trace = record(tmp_path / "rec", sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED))
    batch = trace.batch
    assert batch.prefix_lens.tolist() == PREFIX
    assert batch.extend_lens.tolist() == [WINDOW] * 3  # accepted 3, 1, 2: the window runs whole
    assert batch.kv_lens.tolist() == [13, 9, 16]
    assert batch.seq_lens_raw.tolist() == [13, 9, 16]
    assert batch.positions.tolist() == [*range(9, 13), *range(5, 9), *range(12, 16)]
    assert batch.out_cache_loc.tolist() == [*range(19, 23), *range(35, 39), *range(62, 66)]
    assert batch.slot_ids.tolist() == [*range(10, 23), *range(30, 39), *range(50, 66)]
    assert trace.plan.tensors["qo_indptr"].tolist() == [0, 4, 8, 12]
    assert findings(tmp_path / "rec") == []


def test_v2_widened_window_counts_its_front_rows_once(tmp_path: Path) -> None:
    """A widened window (SGLang's multi-layer worker v2): num_tokens_per_req already counts the
    num_front_tokens rows it prepends, and the backends stride qo_indptr by it alone."""
    fb = sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED)
    fb.spec_info.num_front_tokens = 2  # of the WINDOW rows, as num_steps + 1 + 2 = WINDOW
    trace = record(tmp_path / "rec", fb)
    assert trace.batch.extend_lens.tolist() == [WINDOW] * 3
    assert trace.plan.tensors["qo_indptr"].tolist() == [0, 4, 8, 12]
    assert findings(tmp_path / "rec") == []


def test_v2_server_shaped_step_checks_clean(tmp_path: Path) -> None:
    """64 requests, prefixes up to 3000 columns, window 8, ragged acceptance."""
    g = torch.Generator().manual_seed(7)
    window, bs = 8, 64
    prefix = torch.randint(1, 3000, (bs,), generator=g).tolist()
    accepted = torch.randint(1, window + 1, (bs,), generator=g).tolist()
    rows, slot = {}, 1
    for r, p in enumerate(prefix, start=1):
        rows[r] = list(range(slot, slot + p + window))
        slot += p + window
    trace = record(tmp_path / "rec", sg.draft_extend_v2_batch(rows, prefix, window, accepted), rows, pool_slots=slot)
    assert trace.batch.extend_lens.tolist() == [window] * bs and trace.batch.prefix_lens.tolist() == prefix
    assert findings(tmp_path / "rec") == []


def test_v2_step_with_v1_lengths_is_judged_by_the_window(tmp_path: Path) -> None:
    fb = with_v1_lengths(sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED), ACCEPTED)
    trace = record(tmp_path / "rec", fb)  # recorded, not refused: the wrong lengths are evidence
    assert trace.batch.extend_lens.tolist() == [WINDOW] * 3
    assert trace.batch.seq_lens_raw.tolist() == [12, 6, 14]
    found = {(f"{f.kind.value}/{f.check}", f.location.field): f for f in findings(tmp_path / "rec")}
    seq_lens = found[("invariants/seq-lens", "batch.seq_lens_raw[0]")]
    assert (seq_lens.data["expected"], seq_lens.data["found"]) == (13, 12)
    qo = found[("invariants/qo-lens", "plan.qo_indptr[1]")]
    assert (qo.data["expected"], qo.data["found"]) == (WINDOW, 3)
    for finding in (seq_lens, qo):
        assert "DRAFT_EXTEND_V2 its whole verify window" in finding.cause


def test_classic_draft_extend_runs_the_accepted_tokens(tmp_path: Path) -> None:
    fb = sg.extend_batch(ROWS, PREFIX, ACCEPTED)
    fb.forward_mode = sg.env.ClassicForwardMode.DRAFT_EXTEND
    trace = record(tmp_path / "rec", fb)
    assert trace.batch.extend_lens.tolist() == ACCEPTED
    assert trace.batch.seq_lens_raw.tolist() == [12, 6, 14]
    assert trace.batch.positions.tolist() == [9, 10, 11, 5, 12, 13]
    assert findings(tmp_path / "rec") == []


def test_v2_step_without_its_window_is_not_guessed(tmp_path: Path) -> None:
    fb = sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED)
    fb.spec_info.num_tokens_per_req = -1  # the dataclass default: never set by the worker
    with pytest.raises(RuntimeError, match="num_tokens_per_req"):
        record(tmp_path / "rec", fb)


TOPK, STEPS = 2, 3
DRAFT_PREFIX = [9, 5, 12]


def draft_rows(prefix: list[int]) -> tuple[dict[int, list[int]], int]:
    """req_to_token rows: each request's prefix, then its topk x steps draft slots (branch-major,
    as assign_draft_cache_locs lays them out); and the pool's slot count."""
    rows, slot = {}, 1
    for r, p in enumerate(prefix, start=1):
        rows[r] = list(range(slot, slot + p + TOPK * STEPS))
        slot += p + TOPK * STEPS
    return rows, slot


def draft_decode_step(rows: dict[int, list[int]], prefix: list[int], step: int, *, topk_factor: bool = True) -> Any:
    """Draft step `step` of an EAGLE draft decode as SGLang 0.5.23 plans it before the first step
    runs: seq_lens the committed prefixes, positions one per branch (step 0's), out_cache_loc
    [bs, topk, steps], and the spec input's lists as generate_draft_decode_kv_indices fills them
    (branch t of request b: its prefix, then columns prefix + t * steps + 0..step), kv_indices cut to
    draft_kv_indices_used_len(seq_lens_sum, topk, bs * topk, step + 1) = seq_lens_sum * topk +
    bs * topk * (step + 1), or without the topk factor (seq_lens_sum + bs * (step + 1))."""
    pools, bs = list(rows), len(prefix)
    branches = [rows[r][:p] + rows[r][p + t * STEPS : p + t * STEPS + step + 1] for r, p in zip(pools, prefix) for t in range(TOPK)]
    indptr = torch.nn.functional.pad(torch.cumsum(torch.tensor([len(x) for x in branches]), 0), (1, 0)).to(I32)
    buffer = torch.full((bs * TOPK * (max(prefix) + STEPS),), -1, dtype=I64)  # the step's row of the multi-step buffer: bs x topk x context
    buffer[: int(indptr[-1])] = torch.tensor([s for x in branches for s in x])
    used = sum(prefix) * TOPK + bs * TOPK * (step + 1) if topk_factor else sum(prefix) + bs * (step + 1)
    spec_info = sg.env.sgl.eagle_info.EagleDraftInput(num_tokens_per_req=TOPK, kv_indptr=indptr, kv_indices=buffer[:used])
    return sg.env.ForwardBatch(
        forward_mode=sg.env.ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs * TOPK, dtype=I64),
        req_pool_indices=torch.tensor(pools, dtype=I64),
        seq_lens=torch.tensor(prefix, dtype=I64),
        out_cache_loc=torch.tensor([rows[r][p + j] for r, p in zip(pools, prefix) for j in range(TOPK * STEPS)], dtype=I64),
        seq_lens_sum=sum(prefix),
        positions=torch.tensor(prefix, dtype=I64).repeat_interleave(TOPK),
        seq_lens_cpu=torch.tensor(prefix, dtype=I64),
        spec_info=spec_info,
    )


def triton_draft_decode(made: Any, fb: Any) -> None:
    """Triton's decode metadata of a draft step: the spec input's lists, one row per branch
    (`bs = kv_indptr.shape[0] - 1`), a split count per row."""
    indptr, indices = fb.spec_info.kv_indptr, fb.spec_info.kv_indices
    rows = indptr.numel() - 1
    made.forward_metadata = sg.env.TritonForwardMetadata(
        torch.empty(rows, sg.HEADS, 8, sg.HEAD_DIM), torch.empty(rows, sg.HEADS, 8), None, sg.split_counts(indptr.diff()), indptr, indices, None, None, None, None, None, None, None
    )


def record_draft_steps(out: Path, prefix: list[int], *, topk_factor: bool = True) -> list[Any]:
    """Every draft step but the last (the worker runs speculative_num_steps - 1 forwards), planned
    by its own sub-backend, which holds row `step` of the multi-step backend's kv_indptr buffer."""
    rows, slots = draft_rows(prefix)
    multi_kv_indptr = torch.zeros(STEPS, len(prefix) * TOPK + 1, dtype=I32)
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        for step in range(STEPS - 1):
            made = sg.backend(sg.CorpusTriton, rows, triton_draft_decode)
            made.kv_indptr = multi_kv_indptr[step]
            made.token_to_kv_pool.size = slots
            sg.record_eager(session, made, draft_decode_step(rows, prefix, step, topk_factor=topk_factor))
    return [io.load(out / entry.file) for entry in io.read_manifest(out)]


def test_draft_decode_topk_steps_are_branch_rows(tmp_path: Path) -> None:
    first, second = record_draft_steps(tmp_path / "rec", DRAFT_PREFIX)
    for step, trace in enumerate((first, second)):
        batch = trace.batch
        assert batch.forward_mode.value == "DECODE" and batch.batch_size == 3 * TOPK
        assert batch.kv_lens.tolist() == [p + step + 1 for p in DRAFT_PREFIX for _ in range(TOPK)]
        assert batch.seq_lens_raw.tolist() == [p for p in DRAFT_PREFIX for _ in range(TOPK)]
        assert batch.positions.tolist() == [p + step for p in DRAFT_PREFIX for _ in range(TOPK)]
        assert (trace.plan.scalars["draft_topk"], trace.plan.scalars["draft_step"]) == (TOPK, step)
    # request 1 (prefix 5, slots 16..20), branch 1 at step 1: its prefix, then columns 5 + 3 + 0..1
    assert second.batch.request_slots(3).tolist() == [*range(16, 21), 24, 25]
    assert second.batch.out_cache_loc.tolist() == [11, 14, 22, 25, 40, 43]  # out_cache_loc[b, t, 1]
    assert findings(tmp_path / "rec") == []


def test_draft_decode_server_shaped_steps_check_clean(tmp_path: Path) -> None:
    prefix = torch.randint(1, 2000, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    record_draft_steps(tmp_path / "rec", prefix)
    assert findings(tmp_path / "rec") == []


def test_draft_decode_kv_indices_without_the_topk_factor_are_caught(tmp_path: Path) -> None:
    record_draft_steps(tmp_path / "rec", DRAFT_PREFIX, topk_factor=False)
    found = findings(tmp_path / "rec")
    assert [(f.location.step, f"{f.kind.value}/{f.check}", f.location.field) for f in found] == [
        (0, "invariants/indptr-end", "plan.kv_indptr[-1]"),
        (1, "invariants/indptr-end", "plan.kv_indptr[-1]"),
    ], [(f.check, f.location.field, f.evidence) for f in found]
    first, second = found
    assert (first.data["expected"], first.data["found"]) == (29, 58)  # kv_indices length, kv_indptr[-1]: 26 x 2 + 3 x 2 x 1
    assert second.severity.value == "defect" and "without the topk factor" in second.cause


# -- draft decode under CUDA graphs (EAGLEDraftCudaGraphRunner) ---------------------------------------


BACKENDS = ["flashinfer", "triton"]


def graph_steps(tmp_path: Path, prefix: list[int], *, topk: int, backend: str, topk_factor: bool = True, max_context_len: int = 24) -> tuple[Path, list[Any]]:
    """One EAGLE draft graph replay (bs 4, 3 steps) through the multi-step FlashInfer or Triton
    draft backend: its two draft steps, each recorded by the hooks (FlashInfer's sub-backend's,
    Triton's multi-step backend's)."""
    out = tmp_path / f"graph-{backend}-topk{topk}-{'fixed' if topk_factor else 'short'}"
    triton = backend == "triton"
    draft_modes.record_draft_graph(out, prefix, topk=topk, steps=STEPS, capture_bs=4, max_context_len=max_context_len, topk_factor=topk_factor, triton=triton)
    return out, [io.load(out / entry.file) for entry in io.read_manifest(out)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [1, 2])
def test_graph_replayed_draft_steps_are_branch_rows_and_check_clean(tmp_path: Path, topk: int, backend: str) -> None:
    prefix = draft_modes.GRAPH_PREFIX
    out, traces = graph_steps(tmp_path, prefix, topk=topk, backend=backend)
    assert len(traces) == STEPS - 1
    rows, _ = draft_modes.draft_graph_rows(prefix, topk, STEPS)
    for step, trace in enumerate(traces):
        batch, graph = trace.batch, trace.graph
        assert trace.source.backend == backend and batch.forward_mode.value == "DECODE" and batch.batch_size == 3 * topk
        assert batch.kv_lens.tolist() == [p + step + 1 for p in prefix for _ in range(topk)]
        assert batch.positions.tolist() == [p + step for p in prefix for _ in range(topk)]
        assert (trace.plan.scalars["draft_topk"], trace.plan.scalars["draft_step"]) == (topk, step)
        # the graph section in the branch rows its kernels ran: the padded request's topk rows last
        assert (graph.is_graph_replay, graph.capture_bs, graph.fill_value) == (True, 4 * topk, 1)
        assert graph.padded_seq_lens.tolist() == [p for p in [*prefix, 1] for _ in range(topk)]
        assert graph.padded_out_cache_loc.tolist() == [rows[r][p + t * STEPS + step] for r, p in zip(rows, prefix) for t in range(topk)] + [0] * topk
        # the captured row: max_bs x topk x max_context_len ids (the plan is read from the bs-4 graph's wrapper)
        assert trace.capture.kv_indices_capacity == 4 * topk * 24
        assert trace.plan.tensors["kv_indptr"].numel() == 4 * topk + 1
        assert trace.buffers["plan.kv_indices"].capacity
    # request 1 (pool row 2, prefix 15), its last branch at step 1: its prefix, then its own draft columns
    last = traces[1].batch.request_slots(2 * topk - 1).tolist()
    assert last == rows[2][:15] + rows[2][15 + (topk - 1) * STEPS : 15 + (topk - 1) * STEPS + 2]
    assert findings(out) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replayed_draft_steps_server_shaped_check_clean(tmp_path: Path, backend: str) -> None:
    prefix = torch.randint(1, 500, (3,), generator=torch.Generator().manual_seed(5)).tolist()
    out, traces = graph_steps(tmp_path, prefix, topk=4, backend=backend, max_context_len=512)
    # only what the step's kernels read of the 4 x 4 x 512 row was copied (cut on the device)
    assert [t.plan.tensors["kv_indices"].numel() for t in traces] == [4 * (sum(prefix) + 1) + 16 * (step + 1) for step in range(STEPS - 1)]
    assert findings(out) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_graph_kv_indices_buffer_without_the_topk_factor_is_caught(tmp_path: Path, backend: str) -> None:
    """The multi-step backend's graph buffer rows sized max_bs x max_context_len (4 x 24 = 96): the
    padded batch's seq_lens_sum 50 x topk 2 + 4 x 2 x (step + 1) ids run past the row."""
    out, traces = graph_steps(tmp_path, draft_modes.GRAPH_PREFIX, topk=2, backend=backend, topk_factor=False)
    assert [t.capture.kv_indices_capacity for t in traces] == [96, 96]
    found = findings(out)
    assert [(f.location.step, f"{f.kind.value}/{f.check}") for f in found] == [(0, "invariants/capture-kv-indices"), (1, "invariants/capture-kv-indices")], [
        (f.check, f.location.field, f.evidence) for f in found
    ]
    assert [(f.data["expected"], f.data["found"]) for f in found] == [(96, 108), (96, 116)]
    assert all(f.severity.value == "defect" and "without the topk factor" in f.cause for f in found)


# -- DRAFT_EXTEND_V2 under CUDA graphs (EAGLEDraftExtendCudaGraphRunner) ---------------------------------


def extend_graph(tmp_path: Path, backend: str, *, stride: int | None = None) -> tuple[Path, Any]:
    """One DRAFT_EXTEND_V2 step (3 requests, window 4) run by SGLang's draft-extend graph runner
    padded to the captured bs 4, over the Triton or FlashInfer backend's graph buffers."""
    out = tmp_path / f"extend-graph-{backend}-{stride or 'window'}"
    draft_modes.record_draft_extend_graph(out, ROWS, PREFIX, WINDOW, ACCEPTED, capture_bs=[1, 2, 4, 8], triton=backend == "triton", stride=stride)
    [entry] = io.read_manifest(out)
    return out, io.load(out / entry.file)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_graph_replayed_draft_extend_is_its_window_and_checks_clean(tmp_path: Path, backend: str) -> None:
    out, trace = extend_graph(tmp_path, backend)
    batch, graph = trace.batch, trace.graph
    # the real requests as the eager step records them: the whole window, whatever was accepted
    assert (batch.batch_size, batch.prefix_lens.tolist(), batch.extend_lens.tolist()) == (3, PREFIX, [WINDOW] * 3)
    assert batch.out_cache_loc.tolist() == [*range(19, 23), *range(35, 39), *range(62, 66)]
    # the padded request: seq_len at the fill, its window's slots and positions 0
    assert (graph.is_graph_replay, graph.capture_bs, graph.fill_value) == (True, 4, 1)
    assert graph.padded_seq_lens.tolist() == [13, 9, 16, 1]
    assert graph.padded_out_cache_loc.tolist() == [*range(19, 23), *range(35, 39), *range(62, 66), 0, 0, 0, 0]
    assert graph.padded_positions.tolist()[-WINDOW:] == [0] * WINDOW
    assert trace.plan.tensors["qo_indptr"].tolist() == [0, 4, 8, 12, 16]
    assert findings(out) == []


def test_graph_replayed_draft_extend_qo_indptr_strided_by_steps_is_caught(tmp_path: Path) -> None:
    """Triton's graph qo_indptr strided by speculative_num_steps + 1 (3) while the runner's batch runs
    the window (4) per request: the offsets count other queries than the step runs."""
    out, trace = extend_graph(tmp_path, "triton", stride=3)
    assert trace.plan.tensors["qo_indptr"].tolist() == [0, 3, 6, 9, 12]
    assert {f.check for f in findings(out)} == {"qo-lens"}


# -- DRAFT_EXTEND_V2 under CUDA graphs, multi-layer EAGLE -------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_multi_layer_draft_extend_replay_records_each_layer_and_checks_clean(tmp_path: Path, backend: str) -> None:
    """3 requests (window 4) prepared once by the multi-layer runner, padded to the captured bs 4,
    then replayed by each of 2 draft layers' runners: each layer's backend refill is one step."""
    out = tmp_path / f"multi-layer-{backend}"
    draft_modes.record_multi_layer_draft_extend_graph(out, [(ROWS, PREFIX, ACCEPTED)], WINDOW, layers=2, capture_bs=[1, 2, 4, 8], triton=backend == "triton")
    traces = [io.load(out / entry.file) for entry in io.read_manifest(out)]
    assert len(traces) == 2
    for trace in traces:
        batch, graph = trace.batch, trace.graph
        assert (trace.source.backend, batch.batch_size, batch.prefix_lens.tolist(), batch.extend_lens.tolist()) == (backend, 3, PREFIX, [WINDOW] * 3)
        # the view's out_cache_loc is the padded buffer: the batch keeps the real tokens'
        assert batch.out_cache_loc.tolist() == [*range(19, 23), *range(35, 39), *range(62, 66)]
        assert (graph.is_graph_replay, graph.capture_bs, graph.fill_value) == (True, 4, 1)
        assert graph.padded_seq_lens.tolist() == [13, 9, 16, 1]
        assert graph.padded_req_pool_indices.tolist() == [1, 3, 6, 0]
        assert graph.padded_out_cache_loc.tolist()[-WINDOW:] == [0] * WINDOW
        assert graph.padded_positions.tolist() == [*range(9, 13), *range(5, 9), *range(12, 16), 0, 0, 0, 0]
        assert trace.plan.tensors["qo_indptr"].tolist() == [0, 4, 8, 12, 16]
    assert findings(out) == []


def test_multi_layer_draft_extend_replay_without_padding_is_caught(tmp_path: Path) -> None:
    """The second batch (a request finished) padded over buffers an earlier replay filled, its
    padded row left as that replay wrote it: the padded tokens write a live request's KV."""
    out = tmp_path / "multi-layer-unpadded"
    draft_modes.record_multi_layer_draft_extend_graph(out, draft_modes.MULTI_REPLAYS, WINDOW, layers=2, capture_bs=[1, 2, 4, 8], triton=True, pad=False)
    found = findings(out)
    assert {f.location.step for f in found} == {2, 3}  # the first batch fills bs 4 exactly: nothing padded
    kv_writes = [f for f in found if f.check == "padded-kv-write"]
    assert [f.data["slots"] for f in kv_writes] == [[87, 88, 89, 90]] * 2
    assert all(f.severity.value == "defect" for f in kv_writes)
