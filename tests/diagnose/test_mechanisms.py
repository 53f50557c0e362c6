"""Diagnosis of the mechanisms behind real output bugs: a merge with both LSEs in base 2 (SGLang
#40903), a tree mask read with another row stride (SGLang #39287), a merge with another split
count than stage 1, a paged KV length a page short (last_page_len 0), a custom mask a plan kept from
an earlier plan (FlashInfer #1028), and new tokens' keys read twice (SGLang #27738).

Each mistake is made by its own mechanism, not by the model's code: our real Triton stage 1 and 2
with the wrong split count, our Triton kernels given the wrong rows or mask, or a float64 engine
written here where no kernel of ours has the path. Each is attributed to its model and no other;
its correct twin (the same step computed right) is attributed to nothing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.detector_api.context import CheckContext
from attndbg.detectors.split_merge.recorded import recorded_tensors
from attndbg.diagnose import MODELS, diagnose
from attndbg.diagnose.base import PartialStates
from attndbg.diagnose.mask_models import _tree_rows
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility
from tests.checks.shapes import SMALL
from tests.diagnose.test_diagnose import DECODE, EXTEND, VERIFY, attributed, decode_kernels, engine_said, inputs_of, masked_engine, recorded, request_kv, split_engine, triton_on, with_rows
from tests.diagnose.test_more_models import triton_masked

LN2 = math.log(2.0)


def PartialStatesOf(trace: Trace) -> PartialStates:  # noqa: N802 - reads as the class it builds
    return PartialStates(StepData(trace, layer=0, device="cpu"))


def no_claim(trace: Trace) -> None:
    """The step's recorded output is right: no finding, and diagnosis attributes nothing."""
    assert recorded_tensors(CheckContext(trace=trace, path="t")) == []
    assert diagnose(StepData(trace, layer=0, device="cpu"), trace.tensors[0].output) == []


# -- a prefix + new-token merge with both LSEs in base 2 (SGLang #40903) ------------------------------


def cascade_engine(trace: Trace, *, prefix_factor: float, new_factor: float) -> Tensor:
    """A float64 engine of this test: each request's prefix and new-token partials (causal among the
    new tokens), merged the natural-log way (merge_state_v2) with each LSE multiplied by its factor."""
    model, batch = trace.model, trace.batch
    inputs = inputs_of(trace, "cpu")
    out = torch.zeros(batch.num_tokens, model.num_qo_heads, model.v_head_dim, dtype=torch.float64)
    for b in range(batch.batch_size):
        start, n, prefix = int(batch.qo_indptr[b]), int(batch.extend_lens[b]), int(batch.prefix_lens[b])
        k, v = request_kv(trace, inputs, b)
        q = inputs.q[start : start + n].double()
        scores = torch.einsum("thd,khd->thk", q, k) * model.sm_scale
        cols = torch.arange(prefix + n)
        parts = []
        for visible, factor in (((cols < prefix)[None, :].expand(n, -1), prefix_factor), ((cols >= prefix)[None, :] & (cols[None, :] <= prefix + torch.arange(n)[:, None]), new_factor)):
            s = scores.masked_fill(~visible[:, None, :], float("-inf"))
            parts.append((torch.einsum("thk,khd->thd", torch.softmax(s, -1), v), torch.logsumexp(s, -1) * factor))
        (o_p, l_p), (o_s, l_s) = parts
        top = torch.maximum(l_p, l_s)
        w_p, w_s = torch.exp(l_p - top), torch.exp(l_s - top)
        out[start : start + n] = (o_p * w_p[..., None] + o_s * w_s[..., None]) / (w_p + w_s)[..., None]
    return out


def test_both_partials_lses_in_base_2() -> None:
    trace = recorded(*EXTEND)
    engine = engine_said(trace, cascade_engine(trace, prefix_factor=1 / LN2, new_factor=1 / LN2))
    findings = recorded_tensors(CheckContext(trace=engine, path="t"))
    assert [f.check for f in findings] == ["merge-lse-base-confusion"], [(f.check, f.evidence) for f in findings]
    f = findings[0]
    assert f.data["part"] == "both" and "both partials' LSEs x log2 e" in f.evidence
    assert {r["mechanism"] for r in f.data["reproductions"]} == {"prefix-merge-lse-base"}
    assert f.cause.startswith("Both partials' LSEs entered the merge as base-2 LSEs read as natural log")


def test_a_right_cascade_merge_is_not_attributed() -> None:
    trace = recorded(*EXTEND)
    no_claim(engine_said(trace, cascade_engine(trace, prefix_factor=1.0, new_factor=1.0)))


# -- a tree mask read with another row stride (SGLang #39287) ------------------------------------------


def test_full_mask_read_as_draft_rows() -> None:
    # A kernel that takes the prefix as visible and reads [n, n] draft rows, given SGLang's FULL
    # [n, prefix + n] mask: draft row r reads elements r * n ... of the FULL layout.
    trace = recorded(*VERIFY)
    n = trace.spec.draft_token_num
    blocks = {}
    for b in range(trace.batch.batch_size):
        prefix = int(trace.batch.prefix_lens[b])
        read = torch.ones(n, prefix + n, dtype=torch.bool)
        read[:, prefix:] = _tree_rows(trace, b).flatten()[: n * n].view(n, n)
        blocks[b] = read
    params = attributed(engine_said(trace, triton_masked(trace, blocks)), "mask-row-stride")
    assert [(p["request"], p["read_stride"], p["columns"]) for p in params] == [(0, n, "drafts"), (1, n, "drafts")]


WINDOW_VERIFY = ("verify", *SMALL, "prefix_lens=20,33", "window=4")


def listed_plan(trace: Trace, kept: int) -> tuple[Trace, dict[int, Tensor]]:
    """The step with SGLang #39287's FlashInfer verify plan for a sliding-window layer: each request
    lists its first `kept` prefix slots (from column 0) and its drafts, and the mask holds the FULL
    layout's first n x (kept + n) elements. Returns the step and each request's listed columns."""
    plan = registry.create("flashinfer").derive_plan(trace)
    batch, n = trace.batch, trace.spec.draft_token_num
    ids, masks, listed = [], [], {}
    for b in range(batch.batch_size):
        prefix = int(batch.prefix_lens[b])
        cols = torch.cat([torch.arange(kept), torch.arange(prefix, prefix + n)])
        listed[b] = cols
        ids.append(batch.request_slots(b)[cols])
        masks.append(_tree_rows(trace, b).flatten()[: n * cols.numel()])
    lens = torch.tensor([c.numel() for c in listed.values()])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), (lens * n).cumsum(0)]).to(torch.int32)
    tensors = {**plan.tensors, "kv_indptr": indptr, "kv_indices": torch.cat(ids).to(torch.int32), "custom_mask": torch.cat(masks), "mask_indptr": mask_indptr}
    return replace(trace, plan=replace(plan, tensors=tensors)), listed


def test_full_mask_read_at_the_width_the_plan_lists() -> None:
    # FlashInfer over the listed columns, the FULL blocks laid back to back read as [n, kept + n]
    # blocks at the offsets plan() computes, cumsum(n x listed): request 1 reads the tail of request
    # 0's block and the head of its own.
    trace = recorded(*WINDOW_VERIFY)
    n, kept = trace.spec.draft_token_num, 4
    trace, listed = listed_plan(trace, kept)
    back_to_back = torch.cat([_tree_rows(trace, b).flatten() for b in range(trace.batch.batch_size)])

    def sees(b: int, r: int, c: int) -> bool:
        where = torch.nonzero(listed[b] == c).flatten()
        return bool(where.numel()) and bool(back_to_back[b * n * (kept + n) + r * (kept + n) + int(where[0])])

    params = attributed(engine_said(trace, masked_engine(trace, sees)), "mask-row-stride")
    # Request 0's block starts at 0 by either offsets: both readings reproduce it.
    assert sorted((p["request"], p["offsets"], p["read_stride"]) for p in params) == [(0, "engine", kept + n), (0, "kernel", kept + n), (1, "kernel", kept + n)]
    assert {p["laid_stride"] for p in params if p["request"] == 1} == {33 + n}


def test_a_right_verify_through_a_listed_plan_is_not_attributed() -> None:
    trace, _ = listed_plan(recorded(*WINDOW_VERIFY), 4)
    no_claim(trace)


# -- a merge with another split count than stage 1 ----------------------------------------------------


def split_count_engine(trace: Trace, stage2_splits: list[int]) -> Tensor:
    """Our real Triton stage 1 with the plan's num_kv_splits, our real stage 2 with `stage2_splits`
    (a split-count buffer left from another batch): stage 2 computes its splits from that count."""
    wrong = torch.tensor(stage2_splits, dtype=torch.int32)

    def stage2(**launch) -> None:
        decode_kernels.decode_stage2(**{**launch, "num_kv_splits": wrong.to(launch["o"].device)})

    return split_engine(trace, stage2=stage2)


def test_merge_with_fewer_splits_than_stage_1_wrote() -> None:
    # kv 100 in 3 splits of 64 (two written) and kv 130 in 4 (three written); stage 2 counts 1
    # split for each: one slot merged, keys from column 64 lost.
    trace = recorded(*DECODE, splits=[1, 3, 4])
    params = attributed(engine_said(trace, split_count_engine(trace, [1, 1, 1])), "split-count-mismatch")
    assert [(p["request"], p["merged_splits"], p["stage2_num_kv_splits"], p["kept_columns"]) for p in params] == [(1, 1, [1], 64), (2, 1, [1], 64)]


def test_stage_2_with_the_same_split_count_is_not_attributed() -> None:
    trace = recorded(*DECODE, splits=[1, 3, 4])
    no_claim(engine_said(trace, split_count_engine(trace, [1, 3, 4])))


# -- a paged KV length a page short (last_page_len 0) --------------------------------------------------

PAGED_DECODE = ("decode-gqa", *SMALL, "kv_lens=40,96,70", "page_size=16", "shared_prefix=0")
PAGED_EXTEND = ("extend-prefix", *SMALL, "prefix_lens=40,70", "extend_lens=8,9", "page_size=16", "shared_prefix=0")


def paged(*spec: str) -> Trace:
    """The step recorded with a FlashInfer plan (page ids and kv_last_page_len)."""
    trace = recorded(*spec)
    return replace(trace, plan=registry.create("flashinfer").derive_plan(trace))


def test_decode_last_page_dropped() -> None:
    # kv 96 is six full pages: `96 % 16` gives last_page_len 0 and the kernel reads 80 keys; kv 40
    # and 70 end in partial pages, which that bug leaves alone.
    trace = paged(*PAGED_DECODE)
    told = with_rows(trace, {1: trace.batch.request_slots(1)[:80]}, {1: -16})
    params = attributed(engine_said(trace, triton_on(trace, told)), "last-page-dropped")
    assert params == [{"request": 1, "page_size": 16, "kv": 96, "read": 80}]


def test_extend_last_partial_page_dropped() -> None:
    # A zeroed last_page_len buffer: both requests lose their last page, whole (kv 48) or partial
    # (kv 79). FlashInfer's paged prefill reads every key from the cache and aligns the queries with
    # the end of the KV it was told: query r at column kept - extend_len + r.
    trace = paged(*PAGED_EXTEND)
    batch = trace.batch
    kept = {b: (int(batch.kv_lens[b]) - 1) // 16 * 16 for b in range(2)}

    def sees(b: int, r: int, c: int) -> bool:
        return c < kept[b] and c <= kept[b] - int(batch.extend_lens[b]) + r

    params = attributed(engine_said(trace, masked_engine(trace, sees)), "last-page-dropped")
    assert [(p["request"], p["kv"], p["read"]) for p in params] == [(0, 48, 32), (1, 79, 64)]


def test_a_right_paged_step_is_not_attributed() -> None:
    no_claim(paged(*PAGED_DECODE))
    no_claim(paged(*PAGED_EXTEND))
    # A Triton plan lists slots and takes no last_page_len: the mistake is not its kernel's to make.
    from attndbg.diagnose.page_models import LastPageDropped

    trace = recorded(*PAGED_DECODE)
    assert list(LastPageDropped().candidates(PartialStatesOf(trace), [0, 1, 2])) == []


# -- a custom mask the plan kept from an earlier plan (FlashInfer #1028) --------------------------------


def kept_mask(trace: Trace, earlier: Trace) -> tuple[Trace, dict[int, Tensor]]:
    """The step's plan still holding `earlier`'s verify mask and offsets (a bool custom_mask at
    mask_indptr's element offsets); returns the step and each request's [q_len, kv_len] block the
    kernel reads from them."""
    mask, indptr = earlier.plan.tensors["custom_mask"], earlier.plan.tensors["mask_indptr"]
    batch = trace.batch
    blocks = {}
    for b in range(batch.batch_size):
        q, kv, start = int(batch.extend_lens[b]), int(batch.kv_lens[b]), int(indptr[b])
        blocks[b] = mask[start : start + q * kv].view(q, kv)
    tensors = {**trace.plan.tensors, "custom_mask": mask, "mask_indptr": indptr}
    return replace(trace, plan=replace(trace.plan, tensors=tensors)), blocks


def test_causal_step_with_the_mask_an_earlier_verify_plan_left() -> None:
    earlier = make_verify()
    trace, blocks = kept_mask(recorded(*EXTEND), earlier)
    params = attributed(engine_said(trace, masked_engine(trace, lambda b, r, c: bool(blocks[b][r, c]))), "stale-plan-mask")
    assert [p["request"] for p in params] == [0, 1] and all(p["entries_differ"] > 0 for p in params)


def test_a_causal_step_whose_plan_holds_no_mask_is_not_attributed() -> None:
    no_claim(recorded(*EXTEND))


def make_verify() -> Trace:
    # A verify with longer rows than EXTEND's blocks, so each stale block lies inside the mask.
    return recorded("verify", *SMALL, "prefix_lens=40,60")


# -- new tokens' keys read twice: a prefix list over them (SGLang #27738) --------------------------------


def listed_past_prefix(trace: Trace, extra: dict[int, int]) -> tuple[Trace, Trace]:
    """The step with a Triton plan whose prefix list runs `extra[b]` columns into request b's new
    tokens (kv_indices built over more than extend_prefix_lens), and the batch its kernel was told:
    that list as the prefix, the new tokens again after it."""
    batch = trace.batch
    rows = {}
    for b, count in extra.items():
        own, prefix = batch.request_slots(b), int(batch.prefix_lens[b])
        rows[b] = torch.cat([own[: prefix + count], own[prefix:]])
    told = with_rows(trace, rows)
    return replace(trace, plan=registry.create("triton").derive_plan(told)), told


def test_new_tokens_listed_in_the_prefix_and_read_again() -> None:
    # Request 0's list covers its whole row (seq_lens), request 1's two of its six new tokens: our
    # real Triton extend reads those keys from the cache as prefix keys and again from its inputs.
    trace = recorded(*EXTEND)
    trace, told = listed_past_prefix(trace, {0: 5, 1: 2})
    params = attributed(engine_said(trace, triton_on(trace, told)), "new-tokens-twice")
    assert [(p["request"], p["prefix"], p["listed"], p["twice"]) for p in params] == [(0, 10, 15, 5), (1, 40, 42, 2)]


def test_a_prefix_list_over_the_prefix_is_not_attributed() -> None:
    trace = recorded(*EXTEND)
    no_claim(replace(trace, plan=registry.create("triton").derive_plan(trace)))


def test_new_tokens_twice_reads_only_the_requests_own_row() -> None:
    from attndbg.diagnose.kv_models import NewTokensTwice

    trace, _ = listed_past_prefix(recorded(*EXTEND), {0: 5, 1: 2})
    clean = candidate_outputs(NewTokensTwice(), trace)
    bad = candidate_outputs(NewTokensTwice(), poisoned(trace, {0: list(range(15))}))
    assert clean.keys() == bad.keys() and {b for _, b in clean} == {0, 1}
    for (summary, b), output in clean.items():
        assert torch.isfinite(bad[(summary, b)]).all() == (b == 1) and (b == 0 or torch.equal(bad[(summary, b)], output))


def test_every_new_model_is_listed() -> None:
    names = {m.name for m in MODELS}
    assert {"split-count-mismatch", "last-page-dropped", "mask-row-stride", "stale-plan-mask", "new-tokens-twice"} <= names


# -- soundness: a key the mistake's kernel does not read never reaches the model's output -------------


def poisoned(trace: Trace, columns: dict[int, list[int]]) -> Trace:
    """The step with NaN in the recorded K/V of request b's columns `columns[b]` (what the mistake's
    kernel never reads; the true attention may)."""
    layer = trace.tensors[0]
    slots = {int(trace.batch.request_slots(b)[c]) for b, cols in columns.items() for c in cols}
    # A cached key lives in the recorded KV rows; a new token's in k_new / v_new (written over its slot).
    cached = torch.tensor([int(s) in slots for s in layer.kv_slots])
    new = torch.tensor([int(s) in slots for s in trace.batch.out_cache_loc])
    assert bool(cached.any() or new.any())
    k, v, k_new, v_new = layer.k_rows.clone(), layer.v_rows.clone(), layer.k_new.clone(), layer.v_new.clone()
    k[cached], v[cached], k_new[new], v_new[new] = (float("nan"),) * 4
    return replace(trace, tensors={0: replace(layer, k_rows=k, v_rows=v, k_new=k_new, v_new=v_new)})


def candidate_outputs(model, trace: Trace) -> dict:
    states = PartialStatesOf(trace)
    return {(c.summary, c.request): c.output for c in model.candidates(states, list(range(trace.batch.batch_size)))}


def assert_sound(model, trace: Trace, hidden: dict[int, list[int]]) -> None:
    clean, bad = candidate_outputs(model, trace), candidate_outputs(model, poisoned(trace, hidden))
    assert clean and clean.keys() == bad.keys()
    for key, output in clean.items():
        assert torch.isfinite(bad[key]).all() and torch.equal(bad[key], output), key


def test_split_count_mismatch_never_reads_the_splits_it_drops() -> None:
    from attndbg.diagnose.split_models import SplitCountMismatch

    trace = recorded(*DECODE, splits=[1, 3, 4])
    # Every candidate merges a prefix of the splits; the last column each can read is the last
    # written split's end, so poison only the last split's keys of each request.
    assert_sound(SplitCountMismatch(), trace, {1: list(range(64, 100)), 2: list(range(128, 130))})


def test_last_page_dropped_never_reads_the_last_page() -> None:
    from attndbg.diagnose.page_models import LastPageDropped

    assert_sound(LastPageDropped(), paged(*PAGED_DECODE), {0: list(range(32, 40)), 1: list(range(80, 96)), 2: list(range(64, 70))})


def test_mask_row_stride_never_reads_a_column_its_mask_hides() -> None:
    from attndbg.diagnose.mask_models import MaskRowStride

    trace, _ = listed_plan(recorded(*WINDOW_VERIFY), 4)
    batch, n = trace.batch, trace.spec.draft_token_num
    # Listed stride: the kernel's KV is the kept prefix columns and the drafts; the rest of the
    # prefix is never gathered.
    unlisted = {b: list(range(4, int(batch.prefix_lens[b]))) for b in range(batch.batch_size)}
    clean = {k: o for k, o in candidate_outputs(MaskRowStride(), trace).items() if "lists" in k[0]}
    bad = {k: o for k, o in candidate_outputs(MaskRowStride(), poisoned(trace, unlisted)).items() if "lists" in k[0]}
    assert len(clean) == 2 * batch.batch_size and all(torch.isfinite(bad[k]).all() and torch.equal(bad[k], o) for k, o in clean.items())
    # Draft stride: per request, the draft column most rows of the misread mask (cut by the window
    # by rope position, as the model applies it) hide; the rows that hide it keep their output bit
    # for bit, the others read the NaN.
    hidden, rows = {}, {}
    for b in range(batch.batch_size):
        prefix = int(batch.prefix_lens[b])
        read = torch.ones(n, prefix + n, dtype=torch.bool)
        read[:, prefix:] = _tree_rows(trace, b).flatten()[: n * n].view(n, n)
        seen = visibility(trace, b, tree_mask=read)[:, prefix:]
        j = int((~seen).sum(0).argmax())
        hidden[b], rows[b] = [prefix + j], ~seen[:, j]
    clean = {k: o for k, o in candidate_outputs(MaskRowStride(), trace).items() if "draft rows" in k[0]}
    bad = {k: o for k, o in candidate_outputs(MaskRowStride(), poisoned(trace, hidden)).items() if "draft rows" in k[0]}
    assert clean
    for (summary, b), output in clean.items():
        assert bool(rows[b].any()) and torch.equal(bad[(summary, b)][rows[b]], output[rows[b]])
        assert not bool(torch.isfinite(bad[(summary, b)][~rows[b]]).all()) or bool(rows[b].all())


def test_stale_plan_mask_never_reads_a_column_the_stale_mask_hides() -> None:
    from attndbg.diagnose.stale_models import StalePlanMask

    trace, blocks = kept_mask(recorded(*EXTEND), make_verify())
    # Per request, the column most rows of the stale block hide: those rows keep their output bit
    # for bit, the rows that see it read the NaN.
    hidden, rows = {}, {}
    for b, block in blocks.items():
        c = int((~block).sum(0).argmax())
        hidden[b], rows[b] = [c], ~block[:, c]
    clean, bad = candidate_outputs(StalePlanMask(), trace), candidate_outputs(StalePlanMask(), poisoned(trace, hidden))
    assert clean.keys() == bad.keys() and {b for _, b in clean} == set(blocks)
    for (summary, b), output in clean.items():
        assert bool(rows[b].any()) and torch.equal(bad[(summary, b)][rows[b]], output[rows[b]])
        assert bool(rows[b].all()) or not bool(torch.isfinite(bad[(summary, b)][~rows[b]]).all())
