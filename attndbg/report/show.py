"""`attndbg show`: one trace as a readable summary, including a picture of each verify tree mask.

`render_trace` is a pure function of the trace: it returns a rich renderable and prints nothing.
Long things are cut to what a terminal can show, and the cut says how much was left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import Tensor

from attndbg.plural import counted
from attndbg.report.terminal import FittedPanel
from attndbg.trace import tree
from attndbg.trace.errors import printable
from attndbg.trace.mask_geometry import MaskGeometry, word_dtype
from attndbg.trace.schema import AttentionKind, Batch, CaptureSizes, Graph, MaskLayout, MergeStates, Model, Plan, Spec, Trace

MAX_REQUEST_ROWS = 24  # per-request table rows before "... N more requests"
MAX_TREES = 4  # verify requests whose mask is drawn
MAX_TREE_SIDE = 64  # draft tokens drawn per tree side; wider trees are cut
MAX_VALUES = 8  # leading values shown per plan/graph tensor
MAX_LAYERS = 16  # layers listed in the tensors section
SPACED_TREE_SIDE = 32  # trees up to this many tokens get a space between cells

ATTEND, MASKED = "█", "·"
EXTRA, MISSING = "x", "o"  # recorded attends where the tree says masked / the reverse


def render_trace(trace: Trace, path: str) -> RenderableType:
    parts: list[RenderableType] = [_title(trace, path), _source(trace), _model(trace.model), _batch(trace)]
    if trace.spec is not None:
        parts.append(_spec(trace))
    if trace.plan is not None:
        parts.append(_plan(trace.plan))
    if trace.graph is not None:
        parts.append(_graph(trace.graph, trace.batch))
    if trace.capture is not None:
        parts.append(_capture(trace.capture))
    if trace.tensors:
        parts.append(_tensors(trace))
    if trace.merge is not None:
        parts.append(_merge(trace.merge))
    return Group(*parts)


def _add_row(table: Table, *cells: str | Text) -> None:
    """Add a row of literal text: names and values from a trace are data, never rich markup."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


# --- small formatting helpers -------------------------------------------------------------------


def _meta(t: Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _values(t: Tensor, limit: int = MAX_VALUES) -> str:
    flat = t.flatten()
    head = flat[:limit]
    if head.dtype == torch.bool:
        items = [str(int(v)) for v in head.tolist()]
    elif head.is_floating_point():
        items = [f"{v:.4g}" for v in head.float().tolist()]
    else:
        items = [str(v) for v in head.to(torch.int64).tolist()]
    more = f", … (+{flat.numel() - limit})" if flat.numel() > limit else ""
    return "[" + ", ".join(items) + more + "]"


def _span(t: Tensor) -> str:
    """'a..b' of a 1-D int tensor, noting when it is not a run of consecutive values."""
    if t.numel() == 0:
        return "—"
    first, last = int(t[0]), int(t[-1])
    if t.numel() == 1:
        return str(first)
    consecutive = bool((t[1:] - t[:-1] == 1).all())
    return f"{first}..{last}" if consecutive else f"{first}..{last} ({t.numel()}, gaps)"


def _range(t: Tensor) -> str:
    if t.numel() == 0:
        return "—"
    low, high = int(t.min()), int(t.max())
    return str(low) if low == high else f"{low}..{high}"


def _kv_grid(rows: list[tuple[str, str | Text]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows:
        _add_row(grid, key, value)
    return grid


def _more(shown: int, total: int, what: str) -> Text | None:
    return Text(f"… {total - shown} more {what} not shown", style="dim") if total > shown else None


# --- sections -----------------------------------------------------------------------------------


def _title(trace: Trace, path: str) -> Text:
    b = trace.batch
    text = Text(printable(path), style="bold")  # a newline in a file name is shown as \n
    text.append(
        f"  step {trace.source.step} · {b.forward_mode.value} · batch size {b.batch_size} · {b.num_tokens} tokens"
    )
    return text


def _source(trace: Trace) -> Panel:
    s = trace.source
    return FittedPanel(
        _kv_grid(
            [
                ("engine", f"{s.engine} {s.engine_version}"),
                ("backend", s.backend),
                ("device", f"{s.device}, TP rank {s.tp_rank}"),
                ("step", str(s.step)),
                ("recorded by", f"attndbg {s.attndbg_version}, replay seed {trace.seed}"),
                # An imported step: what its format did not carry, each field with how it was filled.
                *((f"inferred {name}", printable(why)) for name, why in s.inferred.items()),
                # A call that did not return where it ran: what its source logged.
                *((("crashed", printable(s.crash or "the call did not return (no error was logged)")),) if s.crash is not None else ()),
            ]
        ),
        title="source",
        title_align="left",
    )


def _sm_scale(scale: float) -> str:
    # Name the common 1/sqrt(d) so a wrong scale (e.g. MLA's 576 instead of 192) is visible at once.
    d = 1.0 / (scale * scale)
    return f"{scale:.6g} (= 1/√{round(d)})" if abs(d - round(d)) < 1e-3 * d else f"{scale:.6g}"


def _model(m: Model) -> Panel:
    if m.gqa_group == 1:
        grouping = "MHA"
    elif m.num_kv_heads == 1:
        grouping = f"MQA, group {m.gqa_group}"
    else:
        grouping = f"GQA group {m.gqa_group}"
    kind = m.attention.value
    if m.attention is AttentionKind.MLA:
        kind += f" (kv_lora_rank {m.kv_lora_rank}, qk_rope_head_dim {m.qk_rope_head_dim})"
    return FittedPanel(
        _kv_grid(
            [
                ("heads", f"Q {m.num_qo_heads} : KV {m.num_kv_heads} ({grouping})"),
                ("head dims", f"qk {m.head_dim}, v {m.v_head_dim}"),
                ("attention", kind),
                ("sm_scale", _sm_scale(m.sm_scale)),
                ("soft-cap", "off" if m.logit_cap == 0 else f"{m.logit_cap:g}"),
                ("window", "off" if m.sliding_window < 0 and m.window_right < 0 else ", ".join(w for w in (f"window_left {m.sliding_window}" if m.sliding_window >= 0 else "", f"window_right {m.window_right}" if m.window_right >= 0 else "") if w)),
                ("dtypes", f"q {m.q_dtype}, kv {m.kv_dtype}" + (f" (k_scale {m.k_scale:g}, v_scale {m.v_scale:g})" if (m.k_scale, m.v_scale) != (1.0, 1.0) else "")),
                ("page size", str(m.page_size)),
                # The layer kinds added within trace version 1, shown only when a trace has them.
                *([("causal", "no (queries see later keys)")] if not m.causal else []),
                *([("sinks", f"{m.sinks.numel()} logits, {float(m.sinks.min()):.3g}..{float(m.sinks.max()):.3g}")] if m.sinks is not None else []),
            ]
        ),
        title="model",
        title_align="left",
    )


def _slot_layout(batch: Batch, page_size: int, b: int) -> str:
    slots = batch.request_slots(b)
    n = slots.numel()
    if n == 0:
        return "no slots"
    if n == 1:
        parts = [f"slot {int(slots[0])}"]
    elif bool((slots[1:] - slots[:-1] == 1).all()):
        count = math.ceil(n / page_size)
        pages = f" ({count} page{'s' if count > 1 else ''})" if page_size > 1 else ""
        parts = [f"slots {int(slots[0])}..{int(slots[-1])} contiguous{pages}"]
    else:
        # Validation guarantees a page's columns stay in one page, so the first column of each
        # page names it; runs count stretches of consecutive pages (or slots).
        units = slots[::page_size] // page_size if page_size > 1 else slots
        runs = 1 + int((units[1:] != units[:-1] + 1).sum())
        noun = "pages" if page_size > 1 else "slots"
        parts = [f"{units.numel()} {noun}, scattered ({runs} runs)"]
    shared, with_request = 0, -1
    for other in range(b):
        o = batch.request_slots(other)
        m = min(n, o.numel())
        same = slots[:m] == o[:m]
        lead = m if bool(same.all()) else int(torch.nonzero(~same)[0, 0])
        if lead > shared:
            shared, with_request = lead, other
    if shared:
        parts.append(f"shares {shared} columns with request {with_request}")
    if bool((slots == 0).any()):
        parts.append("uses dummy slot 0")
    return ", ".join(parts)


def _batch(trace: Trace) -> Panel:
    b, m = trace.batch, trace.model
    pages = f" ({b.kv_cache_size // m.page_size} pages of {m.page_size})" if m.page_size > 1 else ""
    summary = _kv_grid(
        [
            ("mode", b.forward_mode.value + (" (selective recompute)" if b.selective else "") + (" (cross-attention)" if b.cross else "") + (" (custom mask)" if b.custom_mask is not None else "")),
            ("batch size", str(b.batch_size)),
            ("num tokens", str(b.num_tokens)),
            ("KV lengths", f"sum {int(b.kv_lens.sum())}, max {int(b.kv_lens.max()) if b.batch_size else 0}"),
            ("KV cache", f"{b.kv_cache_size} slots{pages}"),
        ]
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("req", "prefix", "extend", "kv", "seq_len raw", "query cols", "positions", "slots"):
        table.add_column(name, justify="right" if name not in ("query cols", "positions", "slots") else "left")
    qo = b.qo_indptr
    shown = min(b.batch_size, MAX_REQUEST_ROWS)
    for r in range(shown):
        tokens = slice(int(qo[r]), int(qo[r + 1]))
        positions = b.positions[tokens]
        _add_row(
            table,
            str(r),
            str(int(b.prefix_lens[r])),
            str(int(b.extend_lens[r])),
            str(int(b.kv_lens[r])),
            str(int(b.seq_lens_raw[r])),
            _span(b.query_cols[tokens]),
            _range(positions),
            _slot_layout(b, m.page_size, r),
        )
    body = [summary, table]
    more = _more(shown, b.batch_size, "requests")
    if more is not None:
        body.append(more)
    return FittedPanel(Group(*body), title="batch", title_align="left")


# --- tree masks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TreeMask:
    """One request's verify mask: the recorded draft block against the one its parents define."""

    expected: Tensor  # [n, n] bool: token i attends draft token j (from the parents)
    recorded: Tensor | None  # [n, n] bool, or None when nothing usable was recorded
    note: str  # how the recorded mask compares, one line
    same: bool


def _recorded_block(spec: Spec, prefix_lens: Tensor, b: int) -> tuple[Tensor | None, Tensor | None, str]:
    """(full rows [n, width] as recorded, the [n, n] draft block, problem) of request b."""
    n, mask = spec.draft_token_num, spec.custom_mask
    geometry = MaskGeometry.of_spec(spec, prefix_lens)
    start, end = geometry.span(b)
    if mask.numel() < end:
        return None, None, f"recorded mask has {mask.numel()} elements, request {b} needs [{start}, {end})"
    rows = geometry.visible(mask, b)
    problem = ""
    if spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED:
        high = torch.nonzero(geometry.block(mask, b).to(torch.int64) >> n)
        problem = f"row {int(high[0, 0])} has bits set above bit {n - 1}" if high.numel() else ""
    return rows, rows[:, geometry.prefix_columns(b) :], problem


def _tree_mask(spec: Spec, prefix_lens: Tensor, b: int) -> _TreeMask:
    parents = spec.parents[b]
    expected = tree.ancestor_matrix(parents)
    if spec.custom_mask is None:
        return _TreeMask(expected, None, "no custom_mask recorded; drawn from the parents", True)
    rows, block, problem = _recorded_block(spec, prefix_lens, b)
    if rows is None:
        return _TreeMask(expected, None, problem, False)
    full_expected = torch.ones_like(rows)
    full_expected[:, rows.shape[1] - expected.shape[1] :] = expected
    wrong = rows != full_expected
    if not wrong.any():
        note = "recorded mask same as rebuilt from parents" + (f"; but {problem}" if problem else "")
        return _TreeMask(expected, block, note, not problem)
    row, col = (int(i) for i in torch.nonzero(wrong)[0])
    prefix = rows.shape[1] - expected.shape[1]
    where = f"draft col {col - prefix}" if col >= prefix else f"prefix col {col}"
    if spec.mask_layout is MaskLayout.FULL:
        where = f"col {col} ({where})"
    note = (
        f"recorded mask differs from parents: first at row {row}, {where}: recorded {int(rows[row, col])}, "
        f"tree says {int(full_expected[row, col])}; {int(wrong.sum())} cells differ"
    )
    return _TreeMask(expected, block, note, False)


def _tree_picture(spec: Spec, b: int, mask: _TreeMask) -> Text:
    n = spec.draft_token_num
    side = min(n, MAX_TREE_SIDE)
    sep = " " if side <= SPACED_TREE_SIDE else ""
    parents, depth = spec.parents[b], tree.depths(spec.parents[b])
    w = len(str(n - 1))
    label_width = w + 16
    text = Text(no_wrap=True, overflow="crop")
    header = sep.join(str(j % 10) for j in range(side))
    text.append(f"{'tok':>{w + 1}} {'parent':>6} {'depth':>5}".ljust(label_width) + header + "\n", style="dim")
    shown = mask.recorded if mask.recorded is not None else mask.expected
    for i in range(side):
        parent = int(parents[i])
        label = f"{i:>{w + 1}} {'root' if parent < 0 else parent:>6} {int(depth[i]):>5}".ljust(label_width)
        text.append(label, style="dim")
        for j in range(side):
            got, want = bool(shown[i, j]), bool(mask.expected[i, j])
            if got == want:
                text.append(ATTEND if got else MASKED)
            else:
                text.append(EXTRA if got else MISSING, style="bold red")
            if j < side - 1:
                text.append(sep)
        if i < side - 1:
            text.append("\n")
    if side < n:
        text.append(f"\n(first {side} of {n} draft tokens shown)", style="dim")
    return text


def _spec(trace: Trace) -> Panel:
    spec, batch = trace.spec, trace.batch
    n = spec.draft_token_num
    expected_len = MaskGeometry.of_spec(spec, batch.prefix_lens).length
    if spec.custom_mask is None:
        recorded = Text("none recorded")
    else:
        recorded = Text(f"{_meta(spec.custom_mask)}, layout {spec.mask_layout.value}, expected {expected_len} elements")
        if spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED:
            word = str(word_dtype(n)).replace("torch.", "")
            recorded.append(f" of {word} (SGLang's word for n = {n})")
        if spec.custom_mask.numel() != expected_len:
            # A mask of the wrong length is read past its end or misaligned (FlashInfer #3176).
            side = "shorter" if spec.custom_mask.numel() < expected_len else "longer"
            recorded.append(f"; {side} than expected", style="bold red")
    body: list[RenderableType] = [
        _kv_grid(
            [
                ("algorithm", spec.algorithm),
                ("draft tokens", f"{n} (topk {spec.topk}, steps {spec.steps})"),
                ("custom_mask", recorded),
            ]
        )
    ]
    if trace.is_tree_verify:
        legend = (
            f"{ATTEND} attend  {MASKED} masked  {EXTRA} recorded attends, tree says masked  "
            f"{MISSING} recorded masked, tree says attend"
        )
        body.append(Text(legend, style="dim"))
        shown = min(batch.batch_size, MAX_TREES)
        masks = [_tree_mask(spec, batch.prefix_lens, b) for b in range(batch.batch_size)]
        for b in range(shown):
            style = "green" if masks[b].same else "bold red"
            title = Text(f"request {b} · prefix {int(batch.prefix_lens[b])} · ", style="bold")
            body.append(title.append(masks[b].note, style=style))
            body.append(_tree_picture(spec, b, masks[b]))
        if shown < batch.batch_size:
            differing = [b for b in range(shown, batch.batch_size) if not masks[b].same]
            tail = f"; requests {differing[:8]} differ from their parents" if differing else "; all match their parents"
            body.append(Text(f"… {batch.batch_size - shown} more requests' masks not drawn{tail}", style="dim"))
    return FittedPanel(Group(*body), title="spec", title_align="left")


# --- plan, graph, tensors -----------------------------------------------------------------------


def _plan(plan: Plan) -> Panel:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("tensor", "dtype", "shape", "values"):
        table.add_column(name)
    for name, t in plan.tensors.items():
        _add_row(table, name, str(t.dtype).replace("torch.", ""), str(list(t.shape)), _values(t))
    if plan.plan_info is not None:  # the library's own schedule, as stored (read by `check`: attndbg/plans/schedule.py)
        vector, workspace = plan.plan_info.vector, plan.plan_info.workspace
        _add_row(table, "plan_info.vector", "int64", str(list(vector.shape)), _values(vector))
        _add_row(table, "plan_info.workspace", "uint8", str(list(workspace.shape)), f"{workspace.numel()} bytes of the host int workspace")
    body: list[RenderableType] = [Text(f"built by {plan.backend}"), table]
    if plan.scalars:
        body.append(_kv_grid([(k, repr(v) if isinstance(v, str) else str(v)) for k, v in plan.scalars.items()]))
    return FittedPanel(Group(*body), title="plan (recorded)", title_align="left")


def _graph(graph: Graph, batch: Batch) -> Panel:
    real_rows, real_tokens = batch.batch_size, batch.num_tokens

    def split(t: Tensor, real: int) -> str:
        return f"real {_values(t[:real])}  padded {_values(t[real:])}"

    body = _kv_grid(
        [
            ("ran as", "CUDA-graph replay" if graph.is_graph_replay else "eager"),
            ("capture batch size", f"{graph.capture_bs} ({graph.capture_bs - real_rows} padded rows)"),
            ("fill value", str(graph.fill_value)),
            ("seq_lens", split(graph.padded_seq_lens, real_rows)),
            ("req_pool_indices", split(graph.padded_req_pool_indices, real_rows) if graph.padded_req_pool_indices is not None else "not recorded (the engine has no request pool)"),
            ("out_cache_loc", split(graph.padded_out_cache_loc, real_tokens)),
            ("positions", split(graph.padded_positions, real_tokens)),
        ]
        # The engine-neutral extras an engine records (vLLM); a row of block ids per request.
        + ([("qo_indptr", split(graph.padded_qo_indptr, real_rows + 1))] if graph.padded_qo_indptr is not None else [])
        + ([("block_table", f"{_meta(graph.padded_block_table)}, padded rows {_values(graph.padded_block_table[real_rows:])}")] if graph.padded_block_table is not None else [])
    )
    return FittedPanel(body, title="graph", title_align="left")


def _capture(capture: CaptureSizes) -> Panel:
    """The sizes the engine captured its graphs with; the ones it did not give are said so."""
    rows = [(name, str(value) if value is not None else "not recorded") for name, value in ((n, getattr(capture, n)) for n in capture.__dataclass_fields__)]
    return FittedPanel(_kv_grid(rows), title="capture sizes", title_align="left")


def _merge(merge: MergeStates) -> Panel:
    """A merge step's given states: their shape and base, and which rows each leaves empty."""
    empty = torch.isneginf(merge.s).flatten(1).sum(1).tolist()
    rows: list[tuple[str, str | Text]] = [
        ("states", f"{merge.num_states} x {merge.num_tokens} tokens: v {_meta(merge.v)}, s {_meta(merge.s)}"),
        ("LSE base", merge.lse_base.value),
        ("empty (s = -inf)", ", ".join(f"state {i}: {n}" for i, n in enumerate(empty) if n) or "none"),
        ("row mask", "none: every row merged" if merge.mask is None else f"{int(merge.mask.sum())} of {merge.num_tokens} rows merged, the others keep state 0 (merge_state_in_place)"),
        ("recorded", ", ".join(name for name in ("output", "lse") if getattr(merge, name) is not None) or "nothing (replay merges the states; check judges no engine output)"),
    ]
    return FittedPanel(_kv_grid(rows), title="merge of given states", title_align="left")


def _tensors(trace: Trace) -> Panel:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("layer", "q", "k_new", "v_new", "KV rows (k / v)", "output", "lse"):
        table.add_column(name)
    layers = sorted(trace.tensors)
    for layer in layers[:MAX_LAYERS]:
        t = trace.tensors[layer]
        _add_row(
            table,
            str(layer),
            _meta(t.q),
            _meta(t.k_new),
            _meta(t.v_new),
            f"{counted(t.kv_slots.numel(), 'row')}: {_meta(t.k_rows)} / {_meta(t.v_rows)}",
            _meta(t.output) if t.output is not None else "—",
            f"{_meta(t.lse)} base {t.lse_base.value}" if t.lse is not None else "—",
        )
    body: list[RenderableType] = [table]
    more = _more(min(len(layers), MAX_LAYERS), len(layers), "layers")
    if more is not None:
        body.append(more)
    return FittedPanel(Group(*body), title=f"tensors ({counted(len(layers), 'layer')})", title_align="left")


# --- JSON ---------------------------------------------------------------------------------------

SHOW_SCHEMA = "attndbg.show/1"


def _plain(value: object) -> object:
    """JSON-ready: enums to values, tensors to a {dtype, shape} description."""
    if isinstance(value, Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    return getattr(value, "value", value)


def trace_to_json(trace: Trace, path: str) -> dict[str, object]:
    """What `show` prints, as data: every scalar field, per-request lengths, and tensors by dtype
    and shape (their values are in the trace itself)."""
    b, m = trace.batch, trace.model
    out: dict[str, object] = {
        "schema": SHOW_SCHEMA,
        "trace": path,
        "source": {k: _plain(v) for k, v in vars(trace.source).items()},
        "model": {k: _plain(v) for k, v in vars(m).items()},
        "seed": trace.seed,
        "batch": {
            "mode": b.forward_mode.value,
            "batch_size": b.batch_size,
            "num_tokens": b.num_tokens,
            "prefix_lens": b.prefix_lens.tolist(),
            "extend_lens": b.extend_lens.tolist(),
            "kv_lens": b.kv_lens.tolist(),
            "seq_lens_raw": b.seq_lens_raw.tolist(),
            "kv_cache_size": b.kv_cache_size,
            "selective": b.selective,
        },
        "spec": None if trace.spec is None else {k: _plain(v) for k, v in vars(trace.spec).items()},
        "graph": None if trace.graph is None else {k: _plain(v) for k, v in vars(trace.graph).items()},
        "capture": None if trace.capture is None else dict(vars(trace.capture)),
        "plan": None,
        "layers": sorted(trace.tensors),
    }
    if trace.merge is not None:  # only where present: other steps' JSON keeps its keys
        out["merge"] = {k: _plain(v) for k, v in vars(trace.merge).items()}
    if trace.plan is not None:
        out["plan"] = {
            "backend": trace.plan.backend,
            "tensors": {k: _plain(v) for k, v in trace.plan.tensors.items()},
            "scalars": dict(trace.plan.scalars),
        }
        if trace.plan.plan_info is not None:
            out["plan"]["plan_info"] = {"vector": trace.plan.plan_info.vector.tolist(), "workspace_bytes": trace.plan.plan_info.workspace.numel()}
    return out
