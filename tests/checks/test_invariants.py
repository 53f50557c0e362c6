"""invariants: clean plans of every backend give nothing; each mistake is named where it was put."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attndbg.backends import registry
from attndbg.backends.base import Padding
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.invariants import detect as invariants
from attndbg.detectors.invariants import injections as inject
from attndbg.plans.reading import read
from attndbg.trace import synth, tree
from attndbg.trace.schema import Plan, Trace, to_dict
from attndbg.trace.validate import from_dict

PLAN_BACKENDS = ("triton", "flashinfer", "fa3", "mla")


def build(*spec: str) -> Trace:
    return synth.build(synth.parse_spec(list(spec)))


def with_plan(trace: Trace, backend: str, padding: Padding | None = None) -> Trace | None:
    """The plan `backend` derives on the CPU (pure torch), or None when it cannot run this trace."""
    adapter = registry.create(backend)
    if adapter.unsupported_reason(trace):
        return None
    return dataclasses.replace(trace, plan=adapter.derive_plan(trace, padding) if padding else adapter.derive_plan(trace))


def findings(trace: Trace, check: str | None = None):
    out = invariants.detect(CheckContext(trace=trace, path="t.pt"))
    assert all(f.kind is FindingClass.INVARIANT and f.cause for f in out)
    return [f for f in out if check is None or f.check == check]


def one(trace: Trace, check: str):
    found = findings(trace, check)
    assert len(found) == 1, [(f.check, f.evidence) for f in findings(trace)]
    return found[0]


def says(finding, *numbers) -> None:
    """The evidence names the numbers (expected and found), not only the machine-readable data."""
    for number in numbers:
        assert str(number) in finding.evidence, (number, finding.evidence)


def set_tensor(trace: Trace, **tensors) -> Trace:
    plan = trace.plan
    return dataclasses.replace(trace, plan=Plan(plan.backend, {**plan.tensors, **tensors}, dict(plan.scalars)))


def roundtrip(trace: Trace) -> Trace:
    return from_dict(to_dict(trace))


# -- clean inputs ------------------------------------------------------------------------------------


# Merge steps (mode=merge) plan no attention: their detectors' runs are tests/trace/test_merge_step.py's.
@pytest.mark.parametrize("preset", [p for p in synth.PRESETS if synth.PRESETS[p]["mode"] != "merge"])
def test_every_preset_every_plan_is_clean(preset: str) -> None:
    checked = 0
    for page_size in (1, 16):
        for dtype in ("bfloat16", "float16"):
            trace = build(preset, f"page_size={page_size}", f"dtype={dtype}")
            for backend in PLAN_BACKENDS:
                planned = with_plan(trace, backend)
                if planned is None:
                    continue
                checked += 1
                assert findings(planned) == [], (preset, page_size, dtype, backend)
    assert checked >= 4


@pytest.mark.parametrize("preset", ["decode-gqa", "decode-paged", "window-decode", "verify", "verify-chain", "mla-decode"])
def test_graph_padded_plans_are_clean(preset: str) -> None:
    base = build(preset)
    capture = base.batch.batch_size + 3
    trace = build(preset, f"capture_bs={capture}")
    planned = [p for b in PLAN_BACKENDS if (p := with_plan(trace, b, Padding(capture_bs=capture, fill_value=1))) is not None]
    assert planned
    for p in planned:
        assert findings(p) == [], p.plan.backend


def test_clean_recording_keeps_its_pointers() -> None:
    contexts = [CheckContext(trace=pointer_step(step, 0x7000), path=f"s{step}.pt") for step in range(3)]
    assert invariants.detect_recording(contexts) == []


# -- plan structure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("preset", ["decode-mha", "extend-prefix", "mixed", "verify"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decreasing_indptr_names_the_element(backend: str, preset: str, seed: int) -> None:
    trace = with_plan(build(preset, f"seed={seed}", "shared_prefix=0"), backend)
    name = "kv_indptr" if backend != "fa3" else "cu_seqlens_k"
    indptr = trace.plan.tensors[name]
    valid = [b for b in range(1, trace.batch.batch_size) if int(indptr[b]) < int(indptr[b + 1])]
    request = valid[int(torch.randint(len(valid), (1,), generator=torch.Generator().manual_seed(seed)))]
    bad = roundtrip(inject.decreasing_indptr(trace, request=request))
    finding = one(bad, "indptr-decreases")
    assert finding.location.request == request
    assert finding.location.field == f"plan.{name}[{request + 1}]"
    assert finding.data == {"expected_at_least": int(indptr[request + 1]), "found": int(indptr[request])}
    assert f"plan.{name}[{request + 1}] = {int(indptr[request])} < plan.{name}[{request}] = {int(indptr[request + 1])}" in finding.evidence


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_indptr_start_and_end(backend: str) -> None:
    trace = with_plan(build("extend-prefix"), backend)
    indptr, indices = trace.plan.tensors["kv_indptr"], trace.plan.tensors["kv_indices"]
    started = one(set_tensor(trace, kv_indptr=indptr + 1), "indptr-start")
    assert started.location.field == "plan.kv_indptr[0]" and started.data == {"expected": 0, "found": 1}
    longer = torch.cat([indices, indices[:3]])
    ended = one(set_tensor(trace, kv_indices=longer), "indptr-end")
    assert ended.data == {"expected": longer.numel(), "found": int(indptr[-1])}
    shorter = one(set_tensor(trace, kv_indices=indices[:-2]), "indptr-end")
    assert "reads past its end" in shorter.evidence


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("preset", ["decode-gqa", "extend-prefix", "verify", "window-decode"])
@pytest.mark.parametrize("seed", [0, 3])
def test_index_outside_cache_names_request_and_column(backend: str, page_size: int, preset: str, seed: int) -> None:
    trace = with_plan(build(preset, f"page_size={page_size}", f"seed={seed}"), backend)
    g = torch.Generator().manual_seed(seed + 10 * page_size)
    ps = 1 if backend == "triton" else page_size
    counts = _entry_counts(trace)
    request = int(torch.randint(len(counts), (1,), generator=g))
    while counts[request] == 0:
        request = (request + 1) % len(counts)
    column = int(torch.randint(counts[request], (1,), generator=g))
    bad = roundtrip(inject.index_outside_cache(trace, request=request, column=column))
    finding = one(bad, "index-outside-cache")
    limit = trace.batch.kv_cache_size // ps
    start = _covered_start(trace, request)
    assert (finding.location.request, finding.location.column) == (request, start + column * ps)
    assert finding.data["limit"] == limit and finding.data["found"] >= limit
    says(finding, f"= {finding.data['found']}", f"[0, {limit})", f"request {request}")
    assert findings(bad, "kv-index") == []  # one mistake, one finding


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("preset", ["decode-mha", "extend-prefix", "verify", "mixed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_wrong_req_row_names_first_wrong_column(backend: str, page_size: int, preset: str, seed: int) -> None:
    trace = with_plan(build(preset, f"page_size={page_size}", f"seed={seed}"), backend)
    g = torch.Generator().manual_seed(seed)
    bs = trace.batch.batch_size
    order = torch.randperm(bs * bs, generator=g).tolist()
    for code in order:
        request, source = divmod(code, bs)
        if request == source:
            continue
        try:
            bad = roundtrip(inject.wrong_req_row(trace, request=request, source=source))
        except ValueError:
            continue
        break
    else:
        pytest.skip("no two requests with differing rows")
    ps = 1 if backend == "triton" else page_size
    before, after = _entries(trace, request), _entries(bad, request)
    j = int(torch.nonzero(before != after)[0])
    finding = one(bad, "kv-index")
    assert (finding.location.request, finding.location.column) == (request, j * ps)
    assert finding.data["expected"] == int(before[j]) and finding.data["found"] == int(after[j])
    says(finding, f"= {int(after[j])} (request {request}, KV column {j * ps})", f"expected {'slot' if ps == 1 else 'page'} {int(before[j])}")
    assert f"request {source}'s req_to_token row" in finding.cause


@pytest.mark.parametrize("shift", [1, 2])
@pytest.mark.parametrize("request_", [1, 2])
def test_window_start_off_is_named_as_a_shift(shift: int, request_: int) -> None:
    trace = with_plan(build("window-decode"), "triton")
    indptr = trace.plan.tensors["kv_indptr"].to(torch.int64)
    indices = trace.plan.tensors["kv_indices"].clone()
    lo, hi = int(indptr[request_]), int(indptr[request_ + 1])
    row = trace.batch.request_slots(request_)
    start = row.numel() - (hi - lo)
    # The window starts `shift` columns early (a kv_start_idx from the length before the increment).
    indices[lo:hi] = row[start - shift : row.numel() - shift]
    finding = one(set_tensor(trace, kv_indices=indices), "kv-index")
    assert (finding.location.request, finding.location.column) == (request_, start)
    assert f"start {shift} column(s) too early" in finding.cause


@pytest.mark.parametrize("request_", [0, 1])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_verify_without_draft_tokens_in_cache_seqlens(request_: int, page_size: int) -> None:
    trace = with_plan(build("verify-chain", f"page_size={page_size}"), "fa3")
    n = trace.spec.draft_token_num
    lens = trace.plan.tensors["cache_seqlens"].clone()
    lens[request_] -= n
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    finding = one(set_tensor(trace, cache_seqlens=lens, cu_seqlens_k=cu), "kv-length")
    assert finding.location.request == request_
    assert finding.data == {"expected": int(trace.batch.kv_lens[request_]), "found": int(lens[request_])}
    says(finding, f"request {request_} {int(lens[request_])} KV columns", f"kv = {int(trace.batch.kv_lens[request_])}")
    assert "draft tokens were not added" in finding.cause


def test_cu_seqlens_k_must_sum_cache_seqlens() -> None:
    trace = with_plan(build("decode-paged", "page_size=16"), "fa3")
    cu = trace.plan.tensors["cu_seqlens_k"].clone()
    cu[2:] += 1
    finding = one(set_tensor(trace, cu_seqlens_k=cu), "cu-seqlens-k")
    assert finding.location.field == "plan.cu_seqlens_k[2]"


@pytest.mark.parametrize("value", [0, 17])
def test_kv_last_page_len_in_range(value: int) -> None:
    trace = with_plan(build("decode-paged", "page_size=16"), "flashinfer")
    last = trace.plan.tensors["kv_last_page_len"].clone()
    last[1] = value
    finding = one(set_tensor(trace, kv_last_page_len=last), "kv-last-page-len")
    assert finding.location.request == 1 and finding.data["found"] == value
    says(finding, f"plan.kv_last_page_len[1] = {value}", "[1, 16]")


@pytest.mark.parametrize("preset", ["extend-prefix", "mixed", "verify"])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("request_", [0, 1])
def test_qo_indptr_against_extend_lens(preset: str, backend: str, request_: int) -> None:
    trace = with_plan(build(preset), backend)
    qo = trace.plan.tensors["qo_indptr"].clone()
    qo[request_ + 1] -= 1
    finding = one(set_tensor(trace, qo_indptr=qo), "qo-lens")
    assert finding.location.request == request_
    assert finding.data == {"expected": int(trace.batch.extend_lens[request_]), "found": int(trace.batch.extend_lens[request_]) - 1}
    says(finding, f"request {request_} {int(trace.batch.extend_lens[request_]) - 1} query tokens", f"extend_lens[{request_}] = {int(trace.batch.extend_lens[request_])}")


@pytest.mark.parametrize("value", [0, 9])
@pytest.mark.parametrize("request_", [0, 2])
def test_num_kv_splits_in_range(value: int, request_: int) -> None:
    trace = with_plan(build("decode-gqa"), "triton")
    splits = trace.plan.tensors["num_kv_splits"].clone()
    splits[request_] = value
    finding = one(set_tensor(trace, num_kv_splits=splits), "num-kv-splits")
    assert finding.location.request == request_ and finding.data["found"] == value
    assert finding.data["maximum"] == int(trace.plan.scalars["max_kv_splits"])
    says(finding, f"plan.num_kv_splits[{request_}] = {value}", f"[1, {int(trace.plan.scalars['max_kv_splits'])}]")


def test_plan_for_another_batch() -> None:
    trace = with_plan(build("decode-gqa"), "triton")
    smaller = with_plan(build("decode-gqa", "kv_lens=1,17,300"), "triton")
    finding = one(dataclasses.replace(trace, plan=smaller.plan), "plan-batch-size")
    assert finding.data == {"expected": 4, "found": 3}


def test_selective_mask_length() -> None:
    trace = with_plan(build("selective"), "triton")
    mask = trace.plan.tensors["custom_mask"]
    finding = one(set_tensor(trace, custom_mask=mask[:-5]), "mask-length")
    assert finding.data == {"expected": mask.numel() - 5, "found": mask.numel()}
    says(finding, f"= {mask.numel()}", f"has {mask.numel() - 5} elements")


# -- batch bookkeeping -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["decode-gqa", "extend-prefix", "mixed", "verify", "selective", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stale_positions_name_the_first_token(preset: str, seed: int) -> None:
    trace = build(preset, f"seed={seed}")
    qo = trace.batch.qo_indptr
    valid = [b for b in range(trace.batch.batch_size) if int(trace.batch.positions[int(qo[b])]) > 0]
    request = valid[int(torch.randint(len(valid), (1,), generator=torch.Generator().manual_seed(seed)))]
    finding = one(roundtrip(inject.stale_positions(trace, request=request)), "positions")
    row = int(qo[request])
    assert (finding.location.request, finding.location.row) == (request, row)
    assert finding.data["expected"] == int(trace.batch.positions[row]) and finding.data["found"] == int(trace.batch.positions[row]) - 1
    says(finding, f"batch.positions[{row}] = {int(trace.batch.positions[row]) - 1}", f"expected {int(trace.batch.positions[row])}")
    assert "one step stale" in finding.cause


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_verify_positions_by_index(seed: int) -> None:
    trace = build("verify", f"seed={seed}")
    finding = one(inject.verify_positions_by_index(trace), "positions")
    depth = torch.cat([tree.depths(p) for p in trace.spec.parents])
    index = torch.cat([torch.arange(int(n)) for n in trace.batch.extend_lens])
    t = int(torch.nonzero(depth != index)[0])
    assert finding.location.row == t
    assert "tree depth" in finding.cause


@pytest.mark.parametrize(
    ("preset", "delta", "cause"),
    [("verify", "n", "include the draft tokens"), ("decode-gqa", -1, "before the decode step"), ("extend-prefix", 3, "another step's")],
)
@pytest.mark.parametrize("request_", [0, 2])
def test_seq_lens_raw_per_sglang_semantics(preset: str, delta, cause: str, request_: int) -> None:
    trace = build(preset)
    raw = trace.batch.seq_lens_raw.clone()
    raw[request_] += trace.spec.draft_token_num if delta == "n" else delta
    bad = dataclasses.replace(trace, batch=dataclasses.replace(trace.batch, seq_lens_raw=raw))
    finding = one(bad, "seq-lens")
    assert finding.location.request == request_
    assert finding.data == {"expected": int(trace.batch.seq_lens_raw[request_]), "found": int(raw[request_])}
    says(finding, f"batch.seq_lens_raw[{request_}] = {int(raw[request_])}", f"expected {int(trace.batch.seq_lens_raw[request_])}")
    assert cause in finding.cause


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
def test_seq_lens_sum(backend: str) -> None:
    trace = with_plan(build("decode-paged", "page_size=16"), backend)
    finding = one(inject.seq_lens_sum_before_increment(trace), "seq-lens-sum")
    want = int(trace.batch.seq_lens_raw.sum())
    assert finding.data == {"expected": want, "found": want - trace.batch.batch_size}
    says(finding, f"= {want - trace.batch.batch_size}", f"expected sum(seq_lens) = {want}")
    good = dataclasses.replace(trace, plan=Plan(trace.plan.backend, trace.plan.tensors, {**trace.plan.scalars, "seq_lens_sum": want}))
    assert findings(good) == []


# -- across a recording ---------------------------------------------------------------------------------------


def pointer_step(step: int, pointer: int, capture_bs: int = 8) -> Trace:
    trace = build("decode-gqa", f"capture_bs={capture_bs}")
    trace = with_plan(trace, "triton", Padding(capture_bs=capture_bs, fill_value=1))
    source = dataclasses.replace(trace.source, step=step)
    scalars = {**trace.plan.scalars, "kv_indptr_data_ptr": 0x1000, "kv_indices_data_ptr": pointer}
    return dataclasses.replace(trace, source=source, plan=Plan(trace.plan.backend, trace.plan.tensors, scalars))


@pytest.mark.parametrize("moved_at", [1, 3])
def test_plan_pointer_moved_between_graph_replays(moved_at: int) -> None:
    steps = [pointer_step(s, 0x7000 if s < moved_at else 0x9000) for s in range(5)]
    steps.append(pointer_step(9, 0xABC0, capture_bs=16))  # another graph: its own pointers
    found = invariants.detect_recording([CheckContext(trace=t, path=f"s{t.source.step}.pt") for t in steps])
    assert len(found) == 1
    finding = found[0]
    assert finding.check == "plan-pointer-moved" and finding.location.step == moved_at
    assert finding.location.field == "plan.kv_indices"
    assert finding.data["expected"] == 0x7000 and finding.data["found"] == 0x9000 and finding.trace == f"s{moved_at}.pt"
    says(finding, "0x9000", "0x7000", f"step {moved_at}", "bs=8")


# -- every injection -------------------------------------------------------------------------------------------

INJECTED = {
    "invariants:decreasing-indptr": ("indptr-decreases", ("extend-prefix",)),
    "invariants:wrong-req-row": ("kv-index", ("verify",)),
    "invariants:index-outside-cache": ("index-outside-cache", ("decode-paged", "page_size=16")),
    "invariants:stale-positions": ("positions", ("mixed",)),
    "invariants:verify-positions": ("positions", ("verify",)),
    "invariants:seq-lens-sum": ("seq-lens-sum", ("decode-gqa",)),
}


def test_every_injection_is_covered() -> None:
    assert set(INJECTED) == set(inject.INJECTIONS)


@pytest.mark.parametrize("kind", sorted(inject.INJECTIONS))
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_injection_roundtrips_and_fires(kind: str, backend: str) -> None:
    check, spec = INJECTED[kind]
    trace = with_plan(build(*spec), backend)
    bad = inject.INJECTIONS[kind](trace)
    assert inject.INJECTIONS[kind].__doc__.strip()
    loaded = roundtrip(bad)
    assert findings(trace) == []
    assert [f.check for f in findings(loaded)] == [check]


@pytest.mark.parametrize("kind", ["invariants:decreasing-indptr", "invariants:wrong-req-row", "invariants:seq-lens-sum"])
def test_injection_that_does_not_apply_says_why(kind: str) -> None:
    with pytest.raises(ValueError, match="plan"):
        inject.INJECTIONS[kind](build("decode-gqa"))  # no plan recorded


# -- helpers ----------------------------------------------------------------------------------------------------


def _entries(trace: Trace, b: int) -> torch.Tensor:
    t = trace.plan.tensors
    if "page_table" in t:
        ps = trace.model.page_size
        return t["page_table"][b, : -(-int(t["cache_seqlens"][b]) // ps)].to(torch.int64)
    indptr = t["kv_indptr"].to(torch.int64)
    return t["kv_indices"][int(indptr[b]) : int(indptr[b + 1])].to(torch.int64)


def _entry_counts(trace: Trace) -> list[int]:
    return [_entries(trace, b).numel() for b in range(trace.batch.batch_size)]


def _covered_start(trace: Trace, b: int) -> int:
    return read(trace).coverage[b][0]


@pytest.mark.parametrize("request_", [0, 2])
def test_seq_lens_raw_per_vllm_semantics(request_: int) -> None:
    """vLLM's verify seq_lens count the draft tokens (attndbg/trace/engines.py): kv_len is clean,
    SGLang's prefix-only seq_lens are the finding."""
    trace = build("verify")
    trace = dataclasses.replace(trace, source=dataclasses.replace(trace.source, engine="vllm"))
    batch = trace.batch
    assert findings(dataclasses.replace(trace, batch=dataclasses.replace(batch, seq_lens_raw=batch.kv_lens.clone())), "seq-lens") == []
    raw = batch.kv_lens.clone()
    raw[request_] = batch.prefix_lens[request_]
    finding = one(dataclasses.replace(trace, batch=dataclasses.replace(batch, seq_lens_raw=raw)), "seq-lens")
    assert finding.location.request == request_
    says(finding, f"batch.seq_lens_raw[{request_}] = {int(raw[request_])}", f"expected {int(batch.kv_lens[request_])} (vLLM: prefix + draft tokens)")
    assert finding.cause == "vLLM's seq_lens count the speculative tokens; these exclude them"
