"""Diagnosis by reproduction: each mistake made by its real mechanism, attributed to its model only.

Every test builds a step whose recorded engine output was produced by one mistake, without the
model's code: our real Triton kernels given the wrong metadata or a stale scratch, a torch stage 2
with the mistake (tests/checks/test_split_merge.py's doubles), the split-merge injection of
trace/mutate, or, where no kernel of ours runs the case (a tree verify with a window), a small
float64 masked attention written here. `check` must name that mechanism with its parameters and
no other model may claim the output.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from attndbg import machine
from attndbg.backends import registry
from attndbg.backends.base import AttentionInputs
from attndbg.detector_api.context import CheckContext
from attndbg.detectors.split_merge import injections as mutate
from attndbg.detectors.split_merge.recorded import recorded_tensors
from attndbg.diagnose import MODELS, diagnose
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility
from tests.checks.shapes import SMALL
from tests.checks.test_split_merge import torch_stage2
from tests.factories import make_trace

from attndbg.backends.triton_kernels import decode as decode_kernels  # noqa: E402  (test_split_merge selected the Triton mode)

LN2 = math.log(2.0)
# kv 5, 100, 130 with 1, 3 and 4 splits: request 0 has one split; request 1 splits of 64 (two used,
# split 2 empty); request 2 splits of 64 (three used, split 3 empty). With 8 splits both requests'
# empty splits hold keys (splits of 32), so a stale 8-split launch leaves real partials in them.
DECODE = ("decode-gqa", *SMALL, "kv_lens=5,100,130", "shared_prefix=0")
SPLITS = [1, 3, 4]
EXTEND = ("extend-prefix", *SMALL, "prefix_lens=10,40", "extend_lens=5,6", "shared_prefix=0")
VERIFY = ("verify", *SMALL, "prefix_lens=20,33")
WINDOW_VERIFY = ("verify", *SMALL, "prefix_lens=30,45", "window=12")


def recorded(*spec: str, splits: list[int] | None = None) -> Trace:
    """The step with layer-0 tensors (drawn by the split-merge injections' helper): a correct engine
    output, no LSE; `splits`: the recorded plan's num_kv_splits."""
    trace = mutate.lse_base_2(make_trace(*spec, plan=True))
    if splits is not None:
        tensors = {**trace.plan.tensors, "num_kv_splits": torch.tensor(splits, dtype=torch.int32)}
        trace = replace(trace, plan=replace(trace.plan, tensors=tensors))
    return replace(trace, tensors={0: replace(trace.tensors[0], lse=None)})


# Where our Triton kernels run: compiled on a GPU machine (they need its tensors), else interpreted.
KERNEL_DEVICE = "cuda" if machine.cuda_available() else "cpu"


def inputs_of(trace: Trace, device: str = KERNEL_DEVICE) -> AttentionInputs:
    return StepData(trace, layer=0, device=device).inputs


def engine_said(trace: Trace, output: Tensor) -> Trace:
    return replace(trace, tensors={0: replace(trace.tensors[0], output=output.to(trace.tensors[0].output.dtype))})


def mismatch(trace: Trace):
    findings = recorded_tensors(CheckContext(trace=trace, path="t"))
    assert [f.check for f in findings] == ["recorded-output-mismatch"], [(f.check, f.evidence) for f in findings]
    return findings[0]


def attributed(trace: Trace, mechanism: str) -> list[dict]:
    """The finding's reproductions: all of `mechanism` (no other model claims the output); their per-request params."""
    f = mismatch(trace)
    reps = f.data["reproductions"]
    assert reps and {r["mechanism"] for r in reps} == {mechanism}, f.evidence
    assert "reproduced: the engine's output equals" in f.evidence and "not reproduced" not in f.evidence
    cause = next(m.cause for m in MODELS if m.name == mechanism)
    assert f.cause == cause
    return [p for r in reps for p in r["params"]]


# -- split-KV decode: real stage 1 into a scratch, the merge with the mistake -------------------------


def split_engine(trace: Trace, *, stage2, scratch_lse_scale: float = 1.0, earlier_splits: int | None = None) -> Tensor:
    """Our Triton stage 1 with the plan's split counts into a zeroed scratch of 8 splits (after a
    stage 1 with `earlier_splits` for every request, when given), then `stage2`."""
    plan, model = trace.plan, trace.model
    inputs = inputs_of(trace)
    device = inputs.q.device
    bs, top = trace.batch.batch_size, 8
    logits = torch.zeros(bs, model.num_qo_heads, top, model.v_head_dim, device=device)
    lse = torch.zeros(bs, model.num_qo_heads, top, device=device)
    kv_indptr, kv_indices = plan.tensors["kv_indptr"].to(device, torch.int32), plan.tensors["kv_indices"].to(device)
    counts = plan.tensors["num_kv_splits"].to(device, torch.int32)
    common = dict(q=inputs.q, k_buffer=inputs.k_cache, v_buffer=inputs.v_cache, kv_indptr=kv_indptr, kv_indices=kv_indices, attn_logits=logits, attn_lse=lse, max_kv_splits=top, sm_scale=model.sm_scale)
    if earlier_splits is not None:
        decode_kernels.decode_stage1(**common, num_kv_splits=torch.full_like(counts, earlier_splits))
    decode_kernels.decode_stage1(**common, num_kv_splits=counts)
    out = torch.empty(bs, model.num_qo_heads, model.v_head_dim, dtype=inputs.q.dtype, device=device)
    stage2(attn_logits=logits, attn_lse=lse * scratch_lse_scale, o=out, lse=torch.empty(bs, model.num_qo_heads, device=device), kv_indptr=kv_indptr, num_kv_splits=counts, max_kv_splits=top)
    return out.cpu()


def test_split_lse_in_base_2_read_as_natural() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    # Stage 1 as FlashInfer writes LSEs (base 2), our real stage 2 merging them as natural log.
    params = attributed(engine_said(trace, split_engine(trace, stage2=decode_kernels.decode_stage2, scratch_lse_scale=1 / LN2)), "split-lse-base")
    assert [(p["request"], round(p["factor"], 6)) for p in params] == [(1, round(1 / LN2, 6)), (2, round(1 / LN2, 6))]


def test_split_natural_lse_weighted_as_base_2() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    params = attributed(engine_said(trace, split_engine(trace, stage2=torch_stage2(exp=torch.exp2))), "split-lse-base")
    assert {p["request"] for p in params} == {1, 2} and all(abs(p["factor"] - LN2) < 1e-12 for p in params)


def test_empty_splits_merged_from_zeroed_scratch() -> None:
    # A zero state weighs exp(-LSE) against the real splits: visible when a short request has many.
    trace = recorded("decode-gqa", *SMALL, "kv_lens=5,33,70", "shared_prefix=0", splits=[8, 8, 8])
    engine = engine_said(trace, split_engine(trace, stage2=torch_stage2(skip_empty=False)))
    params = attributed(engine, "empty-splits-zeros")
    assert [(p["request"], p["empty_splits"]) for p in params] == [(0, [1, 2, 3, 4, 5, 6, 7]), (1, [2, 3, 4, 5, 6, 7]), (2, [3, 4, 5, 6, 7])]
    assert "(request 0, splits 1-7 of 8, kv 5; request 1, splits 2-7 of 8" in mismatch(engine).evidence


def test_empty_splits_holding_a_larger_earlier_split_count() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    params = attributed(engine_said(trace, split_engine(trace, stage2=torch_stage2(skip_empty=False), earlier_splits=8)), "empty-splits-stale")
    assert [(p["request"], p["stale_splits"]) for p in params] == [(1, [2]), (2, [3])]
    # Split counts 5-16 all leave splits of 32 in those slots: one candidate names them together.
    assert all(8 in p["earlier_num_kv_splits"] for p in params)


def test_prefix_partial_lse_in_base_2() -> None:
    trace = mutate.cascade_lse_base_2(make_trace(*EXTEND, plan=True))
    findings = recorded_tensors(CheckContext(trace=trace, path="t"))
    assert [f.check for f in findings] == ["merge-lse-base-confusion"]
    reps = findings[0].data["reproductions"]
    assert {r["mechanism"] for r in reps} == {"prefix-merge-lse-base"}
    assert [(p["request"], p["part"]) for r in reps for p in r["params"]] == [(0, "prefix"), (1, "prefix")]


# -- which keys: real kernels given the wrong metadata -----------------------------------------------


def triton_on(trace: Trace, told: Trace) -> Tensor:
    """Our Triton kernels run on the step's data with the batch `told` (the engine's wrong metadata)."""
    backend = registry.create("triton")
    return backend.run(told, inputs_of(trace), backend.derive_plan(told)).output.cpu()


def with_rows(trace: Trace, rows: dict[int, Tensor], query_shift: dict[int, int] | None = None) -> Trace:
    """The batch with request b's slot row replaced by rows[b] and its queries moved by query_shift[b] columns."""
    batch = trace.batch
    slots = [rows.get(b, batch.request_slots(b)) for b in range(batch.batch_size)]
    lens = torch.tensor([s.numel() for s in slots])
    shift = torch.zeros(batch.num_tokens, dtype=torch.int64)
    for b, d in (query_shift or {}).items():
        shift[int(batch.qo_indptr[b]) : int(batch.qo_indptr[b + 1])] = d
    changed = replace(batch, slot_ids=torch.cat(slots), slot_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]), kv_lens=lens, prefix_lens=lens - batch.extend_lens, query_cols=batch.query_cols + shift)
    return replace(trace, batch=changed, plan=None)


def test_decode_request_reading_the_next_requests_row() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    told = with_rows(trace, {1: trace.batch.request_slots(2)[:100]})
    params = attributed(engine_said(trace, triton_on(trace, told)), "other-request-row")
    assert params == [{"request": 1, "read_request": 2, "variant": "row"}]


def test_decode_request_reading_another_requests_row_and_length() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    told = with_rows(trace, {2: trace.batch.request_slots(1)}, {2: -30})
    params = attributed(engine_said(trace, triton_on(trace, told)), "other-request-row")
    assert params == [{"request": 2, "read_request": 1, "variant": "row and length"}]


def test_extend_prefix_read_from_another_requests_row() -> None:
    trace = recorded(*EXTEND)
    own = trace.batch.request_slots(0)
    # Triton extend reads the prefix through kv_indices and this step's K/V from k_new.
    told = with_rows(trace, {0: torch.cat([trace.batch.request_slots(1)[:10], own[10:]])})
    params = attributed(engine_said(trace, triton_on(trace, told)), "other-request-row")
    assert params == [{"request": 0, "read_request": 1, "variant": "prefix"}]


def test_decode_seq_len_one_short() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    # One key of five is visible; one of 130 would be within the tolerance, and rightly not a finding.
    told = with_rows(trace, {0: trace.batch.request_slots(0)[:-1]}, {0: -1})
    params = attributed(engine_said(trace, triton_on(trace, told)), "key-off-by-one")
    assert params == [{"request": 0, "offset": -1}]


def request_kv(trace: Trace, inputs: AttentionInputs, b: int) -> tuple[Tensor, Tensor]:
    """Request b's keys and values [kv, Hq, D] in float64, its KV heads repeated for its query heads."""
    slots, group = trace.batch.request_slots(b), trace.model.gqa_group
    return inputs.k_cache[slots].double().repeat_interleave(group, 1), inputs.v_cache[slots].double().repeat_interleave(group, 1)


def masked_engine(trace: Trace, sees) -> Tensor:
    """A float64 engine of this test: request b's query row r attends to the columns c of its KV row
    where sees(b, r, c) holds (written here, independently of the reference and of the models)."""
    model, batch = trace.model, trace.batch
    inputs = inputs_of(trace, "cpu")
    out = torch.zeros(batch.num_tokens, model.num_qo_heads, model.v_head_dim, dtype=torch.float64)
    for b in range(batch.batch_size):
        start, n, kv = int(batch.qo_indptr[b]), int(batch.extend_lens[b]), int(batch.kv_lens[b])
        k, v = request_kv(trace, inputs, b)  # [kv, Hq, D]
        visible = torch.tensor([[sees(b, r, c) for c in range(kv)] for r in range(n)])  # [n, kv]
        for r in range(n):
            scores = torch.einsum("hd,khd->hk", inputs.q[start + r].double(), k) * model.sm_scale
            weights = torch.softmax(scores.masked_fill(~visible[r], float("-inf")), -1)
            out[start + r] = torch.einsum("hk,khd->hd", weights, v)
    return out


def test_extend_positions_one_ahead() -> None:
    trace = recorded(*EXTEND)
    cols = trace.batch.query_cols
    qo = trace.batch.qo_indptr

    def sees(b: int, r: int, c: int) -> bool:  # request 1's queries also see the next token's key
        return c <= int(cols[int(qo[b]) + r]) + (1 if b == 1 else 0)

    params = attributed(engine_said(trace, masked_engine(trace, sees)), "key-off-by-one")
    assert params == [{"request": 1, "offset": 1}]


def test_verify_tree_mask_ignored() -> None:
    trace = recorded(*VERIFY)
    n = trace.spec.draft_token_num
    chain = torch.arange(-1, n - 1).expand(trace.batch.batch_size, n).clone()
    # The real kernel, planned from a chain tree: its mask is causal by token index.
    told = replace(trace, spec=replace(trace.spec, parents=chain), plan=None)
    params = attributed(engine_said(trace, triton_on(trace, told)), "mask-ignored")
    assert [p["request"] for p in params] == [0, 1]


def test_verify_window_applied_by_index() -> None:
    trace = recorded(*WINDOW_VERIFY)
    window, prefix = trace.model.sliding_window, trace.batch.prefix_lens
    tree_of = {b: visibility(replace(trace, model=replace(trace.model, sliding_window=-1)), b) for b in range(trace.batch.batch_size)}

    def sees(b: int, r: int, c: int) -> bool:  # the tree, and a window measured from column prefix + r
        return bool(tree_of[b][r, c]) and int(prefix[b]) + r - c <= window

    params = attributed(engine_said(trace, masked_engine(trace, sees)), "window-without-draft-offset")
    assert [p["request"] for p in params] == [0, 1] and params[0]["window"] == window


# -- clean and unexplained ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [DECODE, EXTEND, VERIFY, WINDOW_VERIFY])
def test_correct_engine_output_is_not_attributed(spec) -> None:
    trace = recorded(*spec, splits=SPLITS if spec is DECODE else None)
    assert recorded_tensors(CheckContext(trace=trace, path="t")) == []
    data = StepData(trace, layer=0, device="cpu")
    assert diagnose(data, trace.tensors[0].output) == []


def test_a_wrong_output_no_model_explains() -> None:
    trace = recorded(*DECODE, splits=SPLITS)
    output = trace.tensors[0].output.double()
    output[2] = output[2] * 0.8 + 0.05  # no attention mistake scales and shifts a row
    f = mismatch(engine_said(trace, output))
    assert f.data["reproductions"] == [] and "no known mistake model reproduces it" in f.evidence
    assert {"split-lse-base", "empty-splits-zeros", "empty-splits-stale", "other-request-row", "key-off-by-one"} <= set(f.data["models_tried"])
    assert "split-KV decode" in f.cause and f.location.request == 2
