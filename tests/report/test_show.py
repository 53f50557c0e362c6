"""render_trace: key facts appear, and verify tree masks are drawn as the parents define them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rich.console import Console

from attndbg.report.show import render_trace
from attndbg.trace import tree
from attndbg.trace.schema import Graph, MaskLayout, Plan, Trace
from attndbg.trace.synth import build, parse_spec

# Three hand-made 8-token trees: a branching tree, a chain, a star.
PARENTS = [
    [-1, 0, 0, 1, 1, 2, 4, 0],
    [-1, 0, 1, 2, 3, 4, 5, 6],
    [-1, 0, 0, 0, 0, 0, 0, 0],
]
N = 8


def _text(renderable, width: int = 120) -> str:
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


def _lines(text: str) -> list[str]:
    """Lines without the panel borders."""
    return [line.strip().strip("│").strip() for line in text.splitlines()]


def _verify(layout: MaskLayout, parents: list[list[int]] = PARENTS) -> Trace:
    """A verify trace whose tree is `parents`, with the mask an engine would record for it."""
    trace = build(parse_spec(["verify", "draft_tokens=8", f"mask_layout={layout.value}"]))
    p = torch.tensor(parents, dtype=torch.int64)
    spec = dataclasses.replace(trace.spec, parents=p, custom_mask=tree.build_mask(layout, p, trace.batch.prefix_lens))
    return dataclasses.replace(trace, spec=spec)


def _ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def _expected_rows(parents: list[int]) -> list[list[str]]:
    """[tok, parent, depth, cell...] per row, computed here from the parents alone."""
    rows = []
    for i in range(len(parents)):
        visible = _ancestors_or_self(parents, i)
        cells = ["█" if j in visible else "·" for j in range(len(parents))]
        rows.append([str(i), "root" if parents[i] < 0 else str(parents[i]), str(len(visible) - 1), *cells])
    return rows


def _tree_rows(text: str, request: int) -> list[list[str]]:
    """The drawn rows of one request's tree, split into words."""
    lines = _lines(text)
    start = next(k for k, line in enumerate(lines) if line.startswith(f"request {request} · prefix"))
    header = next(k for k in range(start, len(lines)) if lines[k].startswith("tok parent depth"))
    return [lines[k].split() for k in range(header + 1, header + 1 + N)]


@pytest.mark.parametrize("layout", list(MaskLayout))
def test_tree_mask_grid_matches_the_parents(layout: MaskLayout) -> None:
    text = _text(render_trace(_verify(layout), "verify.pt"))
    for request, parents in enumerate(PARENTS):
        assert _tree_rows(text, request) == _expected_rows(parents)
    assert text.count("recorded mask same as rebuilt from parents") == 3
    assert "differs" not in text


def _flip(trace: Trace, request: int, row: int, draft_col: int) -> Trace:
    """Flip one cell of the recorded mask, located with the layouts' own formulas."""
    spec, prefix = trace.spec, trace.batch.prefix_lens.tolist()
    mask = spec.custom_mask.clone()
    if spec.mask_layout is MaskLayout.FULL:
        k = sum(N * (p + N) for p in prefix[:request]) + row * (prefix[request] + N) + prefix[request] + draft_col
        mask[k] = ~mask[k]
    elif spec.mask_layout is MaskLayout.QLEN_ONLY:
        k = request * N * N + row * N + draft_col
        mask[k] = ~mask[k]
    else:
        mask[request * N + row] ^= 1 << draft_col
    return dataclasses.replace(trace, spec=dataclasses.replace(spec, custom_mask=mask))


@pytest.mark.parametrize("layout", list(MaskLayout))
def test_a_flipped_bit_is_located_and_drawn(layout: MaskLayout) -> None:
    # Request 1 is the chain: row 5 attends to draft tokens 0..5, so draft col 2 is a dropped ancestor.
    text = _text(render_trace(_flip(_verify(layout), 1, 5, 2), "verify.pt"), width=200)
    prefix1 = int(_verify(layout).batch.prefix_lens[1])
    col = f"col {prefix1 + 2} (draft col 2)" if layout is MaskLayout.FULL else "draft col 2"
    assert f"recorded mask differs from parents: first at row 5, {col}: recorded 0, tree says 1; 1 cells differ" in text
    rows = _tree_rows(text, 1)
    expected = _expected_rows(PARENTS[1])
    expected[5][3 + 2] = "o"  # drawn as "masked, but the tree says attend"
    assert rows == expected
    assert _tree_rows(text, 0) == _expected_rows(PARENTS[0])  # the other requests are untouched
    assert text.count("recorded mask same as rebuilt from parents") == 2


def test_a_prefix_column_masked_in_a_full_mask_is_reported() -> None:
    trace = _verify(MaskLayout.FULL)
    mask = trace.spec.custom_mask.clone()
    mask[3] = False  # request 0, row 0, prefix column 3
    text = _text(render_trace(dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=mask)), "v.pt"), width=200)
    assert "first at row 0, col 3 (prefix col 3): recorded 0, tree says 1" in text


def test_a_short_mask_and_a_missing_mask() -> None:
    trace = _verify(MaskLayout.QLEN_ONLY)
    short = dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=trace.spec.custom_mask[: 2 * N * N]))
    text = _text(render_trace(short, "v.pt"), width=200)
    assert f"recorded mask has {2 * N * N} elements, request 2 needs [{2 * N * N}, {3 * N * N})" in text
    assert f"bool [{2 * N * N}], layout qlen_only, expected {3 * N * N} elements; shorter than expected" in text
    assert _tree_rows(text, 2) == _expected_rows(PARENTS[2])  # drawn from the parents instead
    none = dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=None))
    text = _text(render_trace(none, "v.pt"))
    assert "no custom_mask recorded" in text and _tree_rows(text, 0) == _expected_rows(PARENTS[0])


def test_batch_facts_and_request_table() -> None:
    trace = _verify(MaskLayout.FULL)
    text = _text(render_trace(trace, "traces/verify.pt"))
    assert "traces/verify.pt" in text and "TARGET_VERIFY" in text
    assert "Q 16 : KV 4 (GQA group 4)" in text and "sm_scale" in text and "1/√128" in text
    b = trace.batch
    rows = {line.split()[0]: line.split() for line in _lines(text) if line[:1].isdigit() and "slots" in line}
    for r in range(b.batch_size):
        prefix, extend, kv = int(b.prefix_lens[r]), int(b.extend_lens[r]), int(b.kv_lens[r])
        words = rows[str(r)]
        assert words[1:6] == [str(prefix), str(extend), str(kv), str(int(b.seq_lens_raw[r])), f"{prefix}..{kv - 1}"]
    expected_len = sum(N * (int(p) + N) for p in b.prefix_lens)
    assert f"bool [{expected_len}], layout full, expected {expected_len} elements" in text


def test_slot_layouts_contiguous_scattered_and_shared() -> None:
    contiguous = build(parse_spec(["decode-mha", "scatter=0", "kv_lens=5,7"]))
    text = _text(render_trace(contiguous, "c.pt"))
    s0, s1 = contiguous.batch.request_slots(0), contiguous.batch.request_slots(1)
    assert f"slots {int(s0[0])}..{int(s0[-1])} contiguous" in text
    assert f"slots {int(s1[0])}..{int(s1[-1])} contiguous" in text

    paged = build(parse_spec(["decode-paged"]))  # page 16, shared_prefix 32, kv_lens 5,16,33,260
    text = _text(render_trace(paged, "p.pt"), width=200)
    slots3, slots2 = paged.batch.request_slots(3), paged.batch.request_slots(2)
    shared = int((slots3[:32] == slots2[:32]).sum())
    assert shared == 32  # what the preset promises, checked independently of show
    pages3 = len(set((slots3 // 16).tolist()))
    assert f"{pages3} pages, scattered" in text and "shares 32 columns with request 2" in text
    assert "416 slots (26 pages of 16)" in text and "page size  16" in text


def test_model_kinds() -> None:
    text = _text(render_trace(build(parse_spec(["mla-decode"])), "m.pt"))
    assert "mla (kv_lora_rank 512, qk_rope_head_dim 64)" in text and "qk 576, v 512" in text
    text = _text(render_trace(build(parse_spec(["softcap"])), "s.pt"))
    assert "soft-cap   30" in text
    text = _text(render_trace(build(parse_spec(["window"])), "w.pt"))
    assert "window_left 31" in text and "EXTEND" in text


def test_plan_graph_and_truncation() -> None:
    trace = build(parse_spec(["decode-mha", "kv_lens=" + ",".join(str(n) for n in range(1, 41))]))
    b = trace.batch
    plan = Plan(
        backend="flashinfer",
        tensors={"kv_indptr": b.slot_indptr.to(torch.int32), "kv_indices": b.slot_ids.to(torch.int32)},
        scalars={"page_size": 1, "causal": False, "tag": "[bold]x[/bold]"},
    )
    pad = 48 - b.batch_size
    graph = Graph(
        is_graph_replay=True,
        capture_bs=48,
        fill_value=1,
        padded_seq_lens=torch.cat([b.seq_lens_raw, torch.ones(pad, dtype=torch.int64)]),
        padded_req_pool_indices=torch.arange(48),
        padded_out_cache_loc=torch.cat([b.out_cache_loc, torch.zeros(pad, dtype=torch.int64)]),
        padded_positions=torch.cat([b.positions, torch.zeros(pad, dtype=torch.int64)]),
    )
    text = _text(render_trace(dataclasses.replace(trace, plan=plan, graph=graph), "big.pt"), width=160)
    assert "16 more requests not shown" in text  # 40 requests, 24 rows shown
    indptr_values = ", ".join(str(v) for v in b.slot_indptr[:8].tolist())
    plan_row = next(line for line in _lines(text) if line.startswith("kv_indptr"))
    assert plan_row.split(None, 3) == ["kv_indptr", "int32", "[41]", f"[{indptr_values}, … (+33)]"]
    assert "causal" in text and "False" in text
    assert "'[bold]x[/bold]'" in text  # recorded strings are shown literally, not as rich markup
    assert "CUDA-graph replay" in text and "48 (8 padded rows)" in text
    assert "padded [1, 1, 1, 1, 1, 1, 1, 1]" in text


def test_many_verify_requests_draw_the_first_few() -> None:
    trace = build(parse_spec(["verify", "prefix_lens=3,4,5,6,7,8"]))
    mask = trace.spec.custom_mask.clone()
    n = trace.spec.draft_token_num
    start5 = sum(n * (p + n) for p in [3, 4, 5, 6, 7])
    mask[start5] = False  # request 5, row 0, prefix col 0: not drawn, still reported
    text = _text(render_trace(dataclasses.replace(trace, spec=dataclasses.replace(trace.spec, custom_mask=mask)), "v.pt"))
    assert "request 3 · prefix" in text and "request 4 · prefix" not in text
    assert "2 more requests' masks not drawn; requests [5] differ from their parents" in text


def test_wide_trees_are_cut() -> None:
    trace = build(parse_spec(["verify", "prefix_lens=2", "topk=1", "steps=70", "draft_tokens=70", "mask_layout=qlen_only"]))
    text = _text(render_trace(trace, "wide.pt"), width=200)
    assert "(first 64 of 70 draft tokens shown)" in text
    assert "recorded mask same as rebuilt from parents" in text


def test_a_recorded_plan_info_is_shown_as_stored() -> None:
    from attndbg.trace.schema import PlanInfo

    trace = build(parse_spec(["decode-mha"]))
    info = PlanInfo(vector=torch.tensor([6, 0, 4096, 0, 32, 64, 96, 100, 0, 1]), workspace=torch.zeros(112, dtype=torch.uint8))
    plan = Plan(backend="flashinfer", tensors={"kv_indptr": trace.batch.slot_indptr.to(torch.int32)}, scalars={"page_size": 1}, plan_info=info)
    lines = _lines(_text(render_trace(dataclasses.replace(trace, plan=plan), "p.pt"), width=160))
    assert next(line for line in lines if line.startswith("plan_info.vector")).split(None, 3)[:3] == ["plan_info.vector", "int64", "[10]"]
    assert any(line.startswith("plan_info.workspace") and "112 bytes" in line for line in lines)
