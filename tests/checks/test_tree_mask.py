"""tree-mask: clean verify steps give nothing; each wrong bit, size, order or window is named where it is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends import registry
from attndbg.backends.base import Padding
from attndbg.backends.triton import TritonBackend
from attndbg.cli import main
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.tree_mask import detect as tree_mask
from attndbg.detectors.tree_mask import injections as inject
from attndbg.replay.runner import PlanSource
from attndbg.trace import synth, tree
from attndbg.trace.schema import MaskLayout, Plan, Trace, to_dict
from attndbg.trace.validate import from_dict
from attndbg.trace.visibility import visibility

PLAN_BACKENDS = ("triton", "flashinfer", "fa3", "mla")
LAYOUTS = ("full", "qlen_only", "qlen_only_bitpacked")
# Replays cost time in the Triton interpreter in proportion to heads; masks do not depend on them.
SMALL = ("heads=4:2",)


def build(*spec: str) -> Trace:
    return synth.build(synth.parse_spec(list(spec)))


def with_plan(trace: Trace, backend: str, padding: Padding | None = None) -> Trace | None:
    adapter = registry.create(backend)
    if adapter.unsupported_reason(trace):
        return None
    return dataclasses.replace(trace, plan=adapter.derive_plan(trace, padding) if padding else adapter.derive_plan(trace))


def masks(trace: Trace, check: str | None = None, field: str | None = None):
    out = tree_mask.mask_findings(trace)
    assert all(f.kind is FindingClass.TREE_MASK and f.cause for f in out)
    return [f for f in out if (check is None or f.check == check) and (field is None or (f.location.field or "").startswith(field))]


def one(trace: Trace, check: str, field: str):
    found = masks(trace, check, field)
    assert len(found) == 1, [(f.check, f.location.field, f.evidence) for f in masks(trace)]
    return found[0]


def says(finding, *texts) -> None:
    for text in texts:
        assert str(text) in finding.evidence, (text, finding.evidence)


def set_plan(trace: Trace, drop: tuple[str, ...] = (), scalars: dict | None = None, **tensors) -> Trace:
    plan = trace.plan
    kept = {k: v for k, v in plan.tensors.items() if k not in drop}
    return dataclasses.replace(trace, plan=Plan(plan.backend, {**kept, **tensors}, {**plan.scalars, **(scalars or {})}))


def roundtrip(trace: Trace) -> Trace:
    return from_dict(to_dict(trace))


def row_of(trace: Trace, b: int, r: int) -> int:
    return int(trace.batch.qo_indptr[b]) + r


# -- clean inputs ---------------------------------------------------------------------------------------


# Merge steps (mode=merge) plan no attention: their detectors' runs are tests/trace/test_merge_step.py's.
@pytest.mark.parametrize("preset", [p for p in synth.PRESETS if synth.PRESETS[p]["mode"] != "merge"])
def test_every_preset_every_plan_is_clean(preset: str) -> None:
    """Masks and plans at the preset's own size; replays (verify steps only) with fewer heads."""
    for page_size in (1, 16):
        for dtype in ("bfloat16", "float16"):
            trace = build(preset, f"page_size={page_size}", f"dtype={dtype}")
            small = build(preset, f"page_size={page_size}", f"dtype={dtype}", *(SMALL if trace.is_tree_verify else ()))
            for backend in PLAN_BACKENDS:
                planned = with_plan(trace, backend)
                if planned is None:
                    continue
                assert masks(planned) == [], (preset, page_size, dtype, backend)
                ctx = CheckContext(trace=with_plan(small, backend), path="t.pt", options=CheckOptions(backends=("triton",)))
                assert tree_mask.detect(ctx) == [], (preset, page_size, dtype, backend)


@pytest.mark.parametrize(
    "spec",
    [
        ("verify", "mask_layout=qlen_only"),
        ("verify", "mask_layout=qlen_only_bitpacked"),
        ("verify", "draft_tokens=12", "mask_layout=qlen_only_bitpacked"),
        ("verify", "draft_tokens=20", "steps=6", "mask_layout=qlen_only_bitpacked"),
        ("verify", "window=40"),
        ("verify", "window=40", "page_size=16"),
        ("verify", "window=8", "prefix_lens=3,30,70"),
        ("verify", "prefix_lens=0,5"),
    ],
)
def test_layouts_windows_and_graph_plans_are_clean(spec: tuple[str, ...]) -> None:
    trace = build(*spec)
    checked = 0
    for backend in PLAN_BACKENDS:
        planned = with_plan(trace, backend)
        if planned is None:
            continue
        assert masks(planned) == [], backend
        padded = with_plan(build(*spec, "capture_bs=5"), backend, Padding(capture_bs=5, fill_value=1))
        assert masks(padded) == [], (backend, "graph")
        checked += 1
    assert checked


def test_clean_recording_has_no_stale_mask() -> None:
    steps = [with_plan(build("verify", f"seed={s}"), "triton") for s in range(3)]
    steps.append(steps[-1])  # the same tree twice: the same mask is right
    contexts = [CheckContext(trace=dataclasses.replace(t, source=dataclasses.replace(t.source, step=i)), path=f"s{i}.pt") for i, t in enumerate(steps)]
    assert tree_mask.detect_recording(contexts) == []


# -- the recorded spec mask ----------------------------------------------------------------------------------


def spec_field(trace: Trace, b: int, r: int, j: int) -> str:
    """Where draft token j of row r of request b lives in the recorded mask."""
    n = trace.spec.draft_token_num
    prefix = trace.batch.prefix_lens
    if trace.spec.mask_layout is MaskLayout.FULL:
        start = int((n * (prefix[:b] + n)).sum())  # the blocks before b, each [n, prefix + n]
        return f"spec.custom_mask[{start + r * (int(prefix[b]) + n) + int(prefix[b]) + j}]"
    if trace.spec.mask_layout is MaskLayout.QLEN_ONLY:
        return f"spec.custom_mask[{(b * n + r) * n + j}]"
    return f"spec.custom_mask[{b * n + r}]"


def siblings(trace: Trace) -> list[tuple[int, int, int]]:
    parents = trace.spec.parents
    n = trace.spec.draft_token_num
    return [(b, i, j) for b in range(parents.shape[0]) for i in range(1, n) for j in range(1, n) if i != j and int(parents[b, i]) == int(parents[b, j])]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sibling_visible_names_request_row_column(layout: str, backend: str, page_size: int, seed: int) -> None:
    trace = with_plan(build("verify", f"mask_layout={layout}", f"page_size={page_size}", f"seed={seed}", "topk=3", "draft_tokens=9"), backend)
    pairs = siblings(trace)
    b, i, j = pairs[int(torch.randint(len(pairs), (1,), generator=torch.Generator().manual_seed(seed + page_size)))]
    bad = roundtrip(inject.sibling_visible(trace, request=b, row=i, column=j))
    prefix = int(trace.batch.prefix_lens[b])
    for field in ("spec.custom_mask", "plan."):
        finding = one(bad, "mask-mismatch", field)
        assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, i), prefix + j)
        assert finding.data["expected"] is False and finding.data["found"] is True
        assert f"sees its sibling {j}" in finding.cause
        says(finding, f"KV column {prefix + j} = draft token {j}", f"request {b}")
    assert one(bad, "mask-mismatch", "spec").location.field == spec_field(trace, b, i, j)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_any_wrong_draft_bit_is_named(layout: str, seed: int) -> None:
    trace = build("verify", f"mask_layout={layout}", f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    n = trace.spec.draft_token_num
    b, i, j = (int(torch.randint(k, (1,), generator=g)) for k in (trace.batch.batch_size, n, n))
    was = bool(tree.ancestor_matrix(trace.spec.parents[b])[i, j])
    bad = dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=inject._set_spec_bit(trace, trace.spec.custom_mask, b, i, j, not was)))
    finding = one(roundtrip(bad), "mask-mismatch", "spec")
    assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, i), int(trace.batch.prefix_lens[b]) + j)
    assert finding.location.field == spec_field(trace, b, i, j)
    assert finding.data == {"expected": was, "found": not was, "wrong": 1}
    says(finding, f"= {not was}, expected {was}", f"draft row {i}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hidden_prefix_bit_in_full_mask(seed: int) -> None:
    trace = with_plan(build("verify", f"seed={seed}"), "flashinfer")
    g = torch.Generator().manual_seed(seed)
    n = trace.spec.draft_token_num
    b = int(torch.randint(trace.batch.batch_size, (1,), generator=g))
    prefix = int(trace.batch.prefix_lens[b])
    i, c = int(torch.randint(n, (1,), generator=g)), int(torch.randint(prefix, (1,), generator=g))
    start = int((n * (trace.batch.prefix_lens[:b] + n)).sum())  # the blocks before b, each [n, prefix + n]
    element = start + i * (prefix + n) + c
    mask = trace.spec.custom_mask.clone()
    mask[element] = False
    bad = set_plan(dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=mask)), custom_mask=mask)
    for field in ("spec.custom_mask", "plan.custom_mask"):
        finding = one(bad, "mask-prefix-hidden", field)
        assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, i), c)
        assert finding.location.field == f"{field}[{element}]"


@pytest.mark.parametrize(("draft_tokens", "topk", "steps", "width"), [(5, 2, 2, 8), (8, 4, 3, 8), (12, 4, 3, 16), (20, 4, 6, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_order_reversal_is_recognised(draft_tokens: int, topk: int, steps: int, width: int, seed: int) -> None:
    trace = build("verify", "mask_layout=qlen_only_bitpacked", f"draft_tokens={draft_tokens}", f"topk={topk}", f"steps={steps}", f"seed={seed}")
    bad = roundtrip(inject.bit_order(trace))
    finding = one(bad, "mask-bit-order", "spec")
    words = trace.spec.custom_mask.to(torch.int64)
    t = int(torch.nonzero(bad.spec.custom_mask.to(torch.int64) != words)[0])
    b, r = divmod(t, draft_tokens)
    assert (finding.location.request, finding.location.row) == (b, row_of(trace, b, r))
    assert finding.data == {"expected": int(words[t]), "found": int(bad.spec.custom_mask[t]), "width": width}
    says(finding, f"= {int(bad.spec.custom_mask[t]):#0{width + 2}b}", f"expected {int(words[t]):#0{width + 2}b}", f"{width} bits reversed")
    assert masks(bad, "mask-mismatch") == []  # named once, as an order, not as wrong bits


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_buffer(layout: str, backend: str, seed: int) -> None:
    trace = with_plan(build("verify", f"mask_layout={layout}", f"seed={seed}"), backend)
    g = torch.Generator().manual_seed(seed)
    n = trace.spec.draft_token_num
    b = int(torch.randint(trace.batch.batch_size, (1,), generator=g))
    columns = int(torch.randint(1, int(trace.batch.prefix_lens[b]) + 1, (1,), generator=g))
    bad = roundtrip(inject.short_buffer(trace, request=b, columns=columns))
    full = int((n * (trace.batch.prefix_lens + n)).sum())
    spec_size = {"full": full, "qlen_only": trace.batch.batch_size * n * n, "qlen_only_bitpacked": trace.batch.batch_size * n}[layout]
    spec_short = {"full": n * columns, "qlen_only": n, "qlen_only_bitpacked": 1}[layout]
    spec_finding = one(bad, "mask-length", "spec")
    assert spec_finding.data == {"expected": spec_size, "found": spec_size - spec_short}
    says(spec_finding, f"has {spec_size - spec_short} elements", f"= {spec_size} (short by {spec_short})")
    plan_finding = one(bad, "mask-length", "plan")
    assert plan_finding.data == {"expected": full, "found": full - n * columns}
    says(plan_finding, f"has {full - n * columns} elements", f"mask_indptr[-1] = {full}")
    assert "#3176" in plan_finding.cause


def test_mask_tagged_with_the_wrong_layout() -> None:
    trace = build("verify", "mask_layout=full")
    qlen = tree.qlen_only_mask(trace.spec.parents)
    finding = one(dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=qlen)), "mask-length", "spec")
    assert "size of layout qlen_only" in finding.cause
    packed = tree.qlen_only_bitpacked_mask(trace.spec.parents)
    bad = dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=packed, mask_layout=MaskLayout.QLEN_ONLY))
    assert one(bad, "mask-layout", "spec").location.field == "spec.custom_mask"


# -- the recorded plan ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mask_indptr_names_the_request(backend: str, seed: int) -> None:
    trace = with_plan(build("verify", f"seed={seed}"), backend)
    n = trace.spec.draft_token_num
    b = int(torch.randint(trace.batch.batch_size, (1,), generator=torch.Generator().manual_seed(seed)))
    indptr = trace.plan.tensors["mask_indptr"].clone()
    indptr[b + 1 :] += n  # request b's block counted the draft tokens twice
    finding = one(set_plan(trace, mask_indptr=indptr), "mask-indptr", "plan")
    prefix = int(trace.batch.prefix_lens[b])
    assert finding.location.request == b and finding.location.field == f"plan.mask_indptr[{b + 1}]"
    assert finding.data == {"expected": n * (prefix + n), "found": n * (prefix + n) + n}
    says(finding, f"request {b} a block of {n * (prefix + n) + n} elements", f"= {n * (prefix + n)}")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_qlen_indptr(backend: str) -> None:
    trace = with_plan(build("verify"), backend)
    finding = one(roundtrip(inject.qlen_indptr(trace)), "mask-indptr", "plan")
    assert finding.location.request == 0 and "QLEN_ONLY sizes" in finding.cause


@pytest.mark.parametrize("window", [8, 25, 40])
@pytest.mark.parametrize("page_size", [1, 16])
def test_window_ignored(window: int, page_size: int) -> None:
    trace = with_plan(build("verify", f"window={window}", f"page_size={page_size}"), "flashinfer")
    bad = roundtrip(inject.window_ignored(trace))
    finding = one(bad, "window-ignored", "plan")
    b, r, c = first_difference(trace, lambda b: window_free(trace, b))
    assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, r), c)
    assert finding.data["expected"] is False and finding.data["found"] is True
    assert masks(bad, field="spec") == []  # SGLang's spec mask never folds the window


@pytest.mark.parametrize("window", [10, 30])
@pytest.mark.parametrize("seed", [0, 1])
def test_window_by_index_is_a_window_offset(window: int, seed: int) -> None:
    trace = with_plan(build("verify", f"window={window}", f"seed={seed}"), "flashinfer")
    unfolded = tree.full_mask(trace.spec.parents, trace.batch.prefix_lens)
    bad = set_plan(trace, custom_mask=unfolded, scalars={"window_left": window})
    finding = one(bad, "window-offset", "plan.scalars.window_left")
    n = trace.spec.draft_token_num

    def by_index(b: int) -> torch.Tensor:
        prefix = int(trace.batch.prefix_lens[b])
        index_window = (prefix + torch.arange(n))[:, None] - torch.arange(prefix + n)[None, :] <= window
        return window_free(trace, b) & index_window

    b, r, c = first_difference(trace, by_index)
    assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, r), c)
    assert finding.data["expected"] is True and finding.data["found"] is False


@pytest.mark.parametrize("shape", [("topk=1", "steps=7"), ("topk=4", "steps=3")])
def test_triton_window_offsets(shape: tuple[str, ...]) -> None:
    """SGLang's Triton SWA verify: kv_indices hold the window's slots, the mask is indexed with window_kv_offsets."""
    trace = build("verify", "window=30", "prefix_lens=20,75,130", *shape)
    unwindowed = dataclasses.replace(trace, model=dataclasses.replace(trace.model, sliding_window=-1))
    triton_plan = TritonBackend().derive_plan(unwindowed)
    keep = [min(int(p), 30) for p in trace.batch.prefix_lens]
    rows = [trace.batch.request_slots(b)[int(p) - k : int(p)] for b, (p, k) in enumerate(zip(trace.batch.prefix_lens, keep))]
    tensors = dict(triton_plan.tensors)
    tensors["kv_indices"] = torch.cat(rows)
    tensors["kv_indptr"] = torch.nn.functional.pad(torch.cumsum(torch.tensor(keep), 0), (1, 0)).to(torch.int32)
    planned = dataclasses.replace(trace, plan=Plan("triton", tensors, {**triton_plan.scalars, "sliding_window": 30}))
    missing = masks(planned, "window-offset", "plan.window_kv_offsets")
    assert [(f.location.request, f.data["expected"], f.data["found"]) for f in missing] == [(1, 45, 0), (2, 100, 0)]
    offsets = torch.tensor([int(p) - k for p, k in zip(trace.batch.prefix_lens, keep)])
    fixed = set_plan(planned, window_kv_offsets=offsets)
    by_index = masks(fixed, "window-offset")
    if shape[0] == "topk=1":
        assert by_index == []  # a chain: index and depth agree, the kernel's window is right
    else:
        assert [f.location.field for f in by_index] == ["plan.scalars.sliding_window"]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_without_tree_mask(backend: str, seed: int) -> None:
    trace = with_plan(build("verify", f"seed={seed}"), backend)
    bad = set_plan(trace, drop=("custom_mask", "mask_indptr"), scalars={"causal": True})
    finding = one(bad, "plan-mask-missing", "plan")
    n = trace.spec.draft_token_num

    def causal(b: int) -> torch.Tensor:
        prefix = int(trace.batch.prefix_lens[b])
        return torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]

    b, r, c = first_difference(trace, causal)
    assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, r), c)


@pytest.mark.parametrize("preset", ["extend-prefix", "extend-noprefix", "extend-cached", "mixed", "window", "fp16"])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_stale_mask_after_causal(preset: str, backend: str) -> None:
    trace = with_plan(build(preset), backend)
    finding = one(roundtrip(inject.stale_after_causal(trace)), "stale-mask", "plan.custom_mask")
    assert "#1028" in finding.cause


def test_stale_mask_across_a_recording() -> None:
    first, second, third = (with_plan(build("verify", f"seed={s}"), "triton") for s in (0, 1, 2))
    assert not torch.equal(first.spec.parents, second.spec.parents)
    stale = dataclasses.replace(second, spec=dataclasses.replace(second.spec, custom_mask=first.spec.custom_mask))
    stale = set_plan(stale, custom_mask=first.plan.tensors["custom_mask"])
    steps = [(3, first), (5, stale), (8, third)]
    contexts = [CheckContext(trace=dataclasses.replace(t, source=dataclasses.replace(t.source, step=s)), path=f"s{s}.pt") for s, t in steps]
    found = tree_mask.detect_recording(contexts)
    assert sorted(f.location.field for f in found) == ["plan.custom_mask", "spec.custom_mask"]
    assert all(f.check == "stale-mask" and f.location.step == 5 and f.data == {"previous_step": 3} and f.trace == "s5.pt" for f in found)


# -- outputs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_recorded_plan_rows_fail_where_the_mask_is_wrong(seed: int) -> None:
    trace = with_plan(build("verify", *SMALL, f"seed={seed}"), "triton")
    pairs = siblings(trace)
    b, i, j = pairs[int(torch.randint(len(pairs), (1,), generator=torch.Generator().manual_seed(seed)))]
    bad = inject.sibling_visible(trace, request=b, row=i, column=j)
    found = tree_mask.detect(CheckContext(trace=bad, path="t.pt", options=CheckOptions(backends=("triton",))))
    outputs = [f for f in found if f.check == "recorded-verify-output"]
    assert len(outputs) == 1 and not [f for f in found if f.check == "verify-output"]
    prefix = int(trace.batch.prefix_lens[b])
    finding = outputs[0]
    assert (finding.location.request, finding.location.row, finding.location.column) == (b, row_of(trace, b, i), prefix + j)
    assert finding.data["failing_rows"] == [row_of(trace, b, i)] and finding.data["columns"] == [prefix + j]
    assert f"columns {prefix + j} (should be hidden)" in finding.evidence


def test_plan_whose_mask_is_too_short_is_not_launched() -> None:
    bad = inject.short_buffer(with_plan(build("verify", *SMALL), "triton"))
    ctx = CheckContext(trace=bad, path="t.pt", options=CheckOptions(backends=("triton",)))
    found = tree_mask.detect(ctx)
    assert {f.check for f in found} == {"mask-length"}
    assert all(options.plan is PlanSource.DERIVED for options, _ in ctx._replays)


def test_kernel_that_misapplies_a_correct_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = build("verify", *SMALL)
    b, i, j = siblings(trace)[0]
    derive = TritonBackend.derive_plan

    def wrong_kernel_mask(self, t, padding=None):  # a backend that packs the tree wrongly
        plan = derive(self, t, padding)
        broken = inject.sibling_visible(dataclasses.replace(t, plan=plan), request=b, row=i, column=j).plan
        return broken

    monkeypatch.setattr(TritonBackend, "derive_plan", wrong_kernel_mask)
    found = tree_mask.detect(CheckContext(trace=trace, path="t.pt", options=CheckOptions(backends=("triton",))))
    outputs = [f for f in found if f.check == "verify-output"]
    assert len(outputs) == 1
    assert outputs[0].location.row == row_of(trace, b, i) and "kernel" in outputs[0].cause


# -- every injection ----------------------------------------------------------------------------------------------

INJECTED = {
    "tree-mask:sibling-visible": ("mask-mismatch", ("verify",), "triton"),
    "tree-mask:bit-order": ("mask-bit-order", ("verify", "mask_layout=qlen_only_bitpacked"), "triton"),
    "tree-mask:short-buffer": ("mask-length", ("verify",), "flashinfer"),
    "tree-mask:missing-prefix": ("mask-prefix-hidden", ("verify",), "flashinfer"),
    "tree-mask:window-ignored": ("window-ignored", ("verify", "window=40"), "flashinfer"),
    "tree-mask:qlen-indptr": ("mask-indptr", ("verify",), "triton"),
    "tree-mask:stale-after-causal": ("stale-mask", ("extend-prefix",), "triton"),
}


def test_every_injection_is_covered() -> None:
    assert set(INJECTED) == set(inject.INJECTIONS)


@pytest.mark.parametrize("kind", sorted(inject.INJECTIONS))
def test_injection_roundtrips_and_fires(kind: str) -> None:
    check, spec, backend = INJECTED[kind]
    trace = with_plan(build(*spec), backend)
    assert masks(trace) == [] and inject.INJECTIONS[kind].__doc__.strip()
    loaded = roundtrip(inject.INJECTIONS[kind](trace))
    assert {f.check for f in masks(loaded)} == {check}


@pytest.mark.parametrize("kind", sorted(set(inject.INJECTIONS) - {"tree-mask:stale-after-causal"}))
def test_tree_mistakes_need_a_verify_trace(kind: str) -> None:
    with pytest.raises(ValueError, match="TARGET_VERIFY"):
        inject.INJECTIONS[kind](with_plan(build("decode-gqa"), "triton"))


def test_stale_after_causal_needs_an_extend_trace() -> None:
    with pytest.raises(ValueError, match="EXTEND"):
        inject.stale_after_causal(with_plan(build("verify"), "triton"))


def test_cli_synth_inject_then_check(tmp_path: Path) -> None:
    out = tmp_path / "bad.pt"
    runner = CliRunner()
    made = runner.invoke(main, ["synth", "verify", "--inject", "tree-mask:bit-order", "mask_layout=qlen_only_bitpacked", "-o", str(out)])
    assert made.exit_code == 0, made.output
    report = tmp_path / "findings.json"
    checked = runner.invoke(main, ["check", str(out), "--only", "tree-mask", "--json", str(report)])
    assert checked.exit_code == 1, checked.output
    assert "mask-bit-order" in checked.output.replace("\n", "").replace("│", "").replace(" ", "")
    found = json.loads(report.read_text())["steps"][0]["findings"]
    assert [f["check"] for f in found] == ["mask-bit-order"] and found[0]["class"] == "tree-mask"


# -- helpers ---------------------------------------------------------------------------------------------------------


def window_free(trace: Trace, b: int) -> torch.Tensor:
    """The tree's visibility without any window (prefix all visible)."""
    n = trace.spec.draft_token_num
    prefix = int(trace.batch.prefix_lens[b])
    block = torch.ones(n, prefix + n, dtype=torch.bool)
    block[:, prefix:] = tree.ancestor_matrix(trace.spec.parents[b])
    return block


def first_difference(trace: Trace, seen) -> tuple[int, int, int]:
    """First (request, draft row, column) where `seen(b)` differs from the true visibility."""
    for b in range(trace.batch.batch_size):
        diff = seen(b) != visibility(trace, b)
        if bool(diff.any()):
            r, c = (int(x) for x in torch.nonzero(diff)[0])
            return b, r, c
    raise AssertionError("no difference")


# -- a FlashInfer mask that does not fit the blocks plan() lays out (FlashInfer #3176) ---------------


def _packed(trace: Trace) -> Trace:
    """The flashinfer plan with its mask as plan() keeps it: packed on whole bytes per request."""
    from attndbg.backends.plan_layout import PackedMask
    from attndbg.interop.flashinfer_steps import PACKED_INDPTR, PACKED_MASK
    from tests.interop.fi_dumps import _pack

    tensors = dict(trace.plan.tensors)
    mask, indptr = tensors.pop("custom_mask"), tensors.pop("mask_indptr").to(torch.int64)
    blocks = [_pack(mask[int(indptr[b]) : int(indptr[b + 1])]) for b in range(trace.batch.batch_size)]
    tensors[PACKED_MASK] = torch.cat(blocks)
    tensors[PACKED_INDPTR] = torch.nn.functional.pad(PackedMask.byte_sizes(indptr.diff()).cumsum(0), (1, 0)).to(torch.int32)
    return dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, tensors=tensors))


def _plan_tensor(trace: Trace, **tensors: torch.Tensor) -> Trace:
    return dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, tensors={**trace.plan.tensors, **tensors}))


def test_a_short_flashinfer_mask_names_the_request_and_first_element_read_past_it() -> None:
    trace = with_plan(build("verify", *SMALL, "seed=3"), "flashinfer")
    mask, indptr = trace.plan.tensors["custom_mask"], trace.plan.tensors["mask_indptr"].to(torch.int64)
    cut = int(indptr[-2]) + 5  # the last request's block loses all but 5 elements
    found = one(_plan_tensor(trace, custom_mask=mask[:cut]), "mask-length", "plan")
    last = trace.batch.batch_size - 1
    assert found.location.request == last and found.location.field == f"plan.custom_mask[{cut}]"
    says(found, f"request {last}'s", f"plan.custom_mask[{int(indptr[-2])}:{int(indptr[-1])}]", f"reads {int(indptr[-1]) - cut} element(s) past the end", "element 5:", "compared:")
    assert "#3176" in found.cause


def test_a_short_packed_flashinfer_mask_is_tree_masks_to_name() -> None:
    """The bytes plan() packed end before the last request's block: tree-mask names the request and
    the first byte read past the end; invariants leaves the refusal to it (no plan-unsafe)."""
    from attndbg.detectors.invariants import detect as invariants

    trace = _packed(with_plan(build("verify", *SMALL, "seed=4"), "flashinfer"))
    assert masks(trace) == []
    data, offsets = trace.plan.tensors["packed_custom_mask"], trace.plan.tensors["packed_mask_indptr"]
    bad = _plan_tensor(trace, packed_custom_mask=data[: int(offsets[-1]) - 2])
    found = one(bad, "mask-length", "plan")
    assert found.location.field == f"plan.packed_custom_mask[{int(offsets[-1]) - 2}]" and found.location.request == trace.batch.batch_size - 1
    says(found, f"holds {int(offsets[-1]) - 2} bytes", "reads 2 byte(s) past the end")
    assert not [f for f in invariants.detect(CheckContext(trace=bad, path="t", options=CheckOptions(backends=("reference",)))) if f.check == "plan-unsafe"]


def test_a_long_flashinfer_mask_is_judged_by_its_size_alone() -> None:
    """plan() reads each block at cumsum(q_len x kv_len): a longer mask was laid out for other
    lengths, so its blocks are not compared with the tree (one mask-length, no mismatch)."""
    trace = with_plan(build("verify", *SMALL, "seed=5"), "flashinfer")
    mask = trace.plan.tensors["custom_mask"]
    bad = _plan_tensor(trace, custom_mask=torch.cat([torch.zeros(7, dtype=mask.dtype), mask]))
    assert [f.check for f in masks(bad)] == ["mask-length"]
    found = one(bad, "mask-length", "plan")
    says(found, "(long by 7)", "compared:")
    assert "laid out for other lengths" in found.cause


# -- fa3: a sliding-window layer of a tree verify (sglang#9658) ------------------------------------------------


def fa3_window_expand(trace: Trace) -> Trace:
    """The fa3 plan of a sliding-window layer's tree verify as SGLang runs it since #9658
    (swa_spec_metadata): the prefix call's tables, and one causal call with a row per draft token
    listing its prefix then its ancestors and itself in column order (page size 1: slot ids),
    cache_seqlens = prefix + that count. Built from the batch and the tree, not from an adapter."""
    plan = registry.create("fa3").derive_plan(trace)
    n, rows = trace.spec.draft_token_num, []
    for b in range(trace.batch.batch_size):
        prefix = int(trace.batch.prefix_lens[b])
        slots = trace.batch.request_slots(b)
        for seen in tree.ancestor_matrix(trace.spec.parents[b]):
            rows.append(torch.cat([slots[:prefix], slots[prefix:][seen]]))
    lens = torch.tensor([r.numel() for r in rows], dtype=torch.int32)
    table = torch.zeros(len(rows), int(lens.max()), dtype=torch.int32)
    for r, listed in enumerate(rows):
        table[r, : listed.numel()] = listed
    tensors = {name: plan.tensors[name] for name in ("page_table", "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k")}
    tensors.update(
        swa_page_table=table,
        swa_cache_seqlens=lens,
        swa_cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32),
        swa_cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32),
    )
    keep = ("max_seqlen_q", "max_seqlen_k", "page_size", "window_left")
    scalars = {name: plan.scalars[name] for name in keep} | {"verify_path": "window-expand", "causal": True}
    scalars |= {"swa_max_seqlen_q": 1, "swa_max_seqlen_k": table.shape[1], "swa_causal": True, "swa_page_size": 1}
    return dataclasses.replace(trace, plan=Plan("fa3", tensors, scalars))


@pytest.mark.parametrize("window", [2, 8, 25])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_sliding_window_layer_of_a_tree_verify_is_clean(window: int, page_size: int) -> None:
    trace = roundtrip(fa3_window_expand(build("verify", f"window={window}", f"page_size={page_size}", "prefix_lens=3,30,70")))
    assert masks(trace) == []


@pytest.mark.parametrize("window", [2, 8, 25])
def test_fa3_sliding_window_layer_through_the_full_layers_cascade(window: int) -> None:
    """SGLang before #9658: the two calls with window_size (W, 0). The prefix call aligns draft row i
    to the prefix's key prefix - n + i, whatever its depth: named as the cascade, at the request's
    prefix-call row. The same two calls without a window (a full layer) are clean."""
    trace = build("verify", f"window={window}", "prefix_lens=3,30,70")
    two_call = registry.create("fa3").derive_plan(trace)
    assert two_call.scalars["verify_path"] == "two-call"
    bad = roundtrip(dataclasses.replace(trace, plan=dataclasses.replace(two_call, scalars={**two_call.scalars, "window_right": 0})))
    finding = one(bad, "window-cascade", "plan.page_table")
    assert finding.location.field == f"plan.page_table[{finding.location.request}]" and "swa_spec_metadata" in finding.cause
    full = build("verify", "prefix_lens=3,30,70")
    assert masks(with_plan(full, "fa3")) == []


def test_fa3_sliding_window_row_missing_its_prefix_is_named() -> None:
    """A sliding-window row listing only the draft tokens (the expand row without the prefix): its
    draft row cannot see the prefix keys inside its window."""
    trace = fa3_window_expand(build("verify", "window=8", "prefix_lens=3,30,70"))
    n = trace.spec.draft_token_num
    table, lens = trace.plan.tensors["swa_page_table"].clone(), trace.plan.tensors["swa_cache_seqlens"].clone()
    prefix = int(trace.batch.prefix_lens[1])
    r = 1 * n + 1
    table[r, : lens[r] - prefix] = table[r, prefix : lens[r]].clone()
    lens[r] -= prefix
    bad = dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, tensors={**trace.plan.tensors, "swa_page_table": table, "swa_cache_seqlens": lens}))
    finding = one(roundtrip(bad), "mask-mismatch", "plan.swa_page_table")
    assert finding.location.field == f"plan.swa_page_table[{r}]" and finding.location.request == 1
