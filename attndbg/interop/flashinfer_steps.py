"""`attndbg import flashinfer DUMP_DIR`: each paired plan/run of a FlashInfer dump as one step.

Per run (one layer of one forward step): lengths and KV slots from its wrapper's plan, the recorded
q and the KV rows it read from the run's cache, and the run's output (and base-2 LSE) as the
engine's output, so `check` judges what FlashInfer computed against the float64 reference. The
recorded plan keeps FlashInfer's own names (backends/flashinfer.py and mla.py read it) and its
values as the caller passed them, wrong ones included (a last_page_len outside 1..page_size is
the caller's mistake: `check` judges it). An argument the caller left out gets the value FlashInfer
gives it (flashinfer_defaults.py: the dumped version's signature), marked inferred; a value SGLang
keeps on the wrapper instead (`forward()` sets causal, sm_scale, window_left and logits_soft_cap
and calls run without them, interop.md §0.5) is not in the dump, which the inferred note says. A
run that did not return is kept as a step marked crashed (`source.crash`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from attndbg.interop import flashinfer_args as fa
from attndbg.interop import flashinfer_defaults as defaults
from attndbg.interop.flashinfer_dump import Call, read_calls
from attndbg.interop.flashinfer_pairs import Cascade, Kind, Run, pair_runs
from attndbg.interop.steps import DUMMY_PAGE_NOTE, StepParts, default_sm_scale, off_dummy_page, dtype_name, imported_source, last_page_lengths, layer_from_pool, make_trace, mha_model, paged_rows
from attndbg.trace.build import mode_from_lengths
from attndbg.trace import tree
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import AttentionKind, ForwardMode, Graph, LseBase, MaskLayout, Model, Plan, Spec, Trace
from attndbg.trace.validate import check_indptr

ENGINE = "flashinfer-dump"
CAUSAL_NOTE = (
    "causal not passed: FlashInfer's plan() default is False, but a non-causal prefill without a mask has no step form; "
    "taken causal, as SGLang's forward(causal=True) sets it on the wrapper (not dumped)"
)
PACKED_MASK, PACKED_INDPTR = "packed_custom_mask", "packed_mask_indptr"  # backends/flashinfer.py PACKED_MASK


def import_dump(root: Path, log: Path | None = None) -> Iterator[Trace | str]:
    """Each importable run as a trace, in session order; a note (str) for each call left out or
    crashed. `log`: FlashInfer's log (FLASHINFER_LOGDEST), where a crashed call's error is."""
    calls, notes = read_calls(root, log)
    yield from notes
    runs, notes = pair_runs(calls)
    yield from notes
    step = 0
    for item in runs:
        first = item.ragged.run if isinstance(item, Cascade) else item.run
        try:
            parts = _cascade(item, step) if isinstance(item, Cascade) else _run(item, step)
        except fa.NotImported as e:
            yield f"{first.directory.name}: not imported: {e}"
            continue
        crashed = [c.crash for c in ((item.ragged.run, item.paged.run, item.merge) if isinstance(item, Cascade) else (item.run,)) if c.crash is not None]
        if crashed:
            parts.source = replace(parts.source, crash=crashed[0])
        yield make_trace(parts, seed=step, path=first.directory)
        step += 1


def _run(item: Run, step: int) -> StepParts:
    if item.plan is None:
        raise fa.NotImported(f"no plan() of this wrapper precedes the run (FLASHINFER_DUMP_INCLUDE must keep '*Wrapper.plan'; under CUDA graphs SGLang and vLLM plan with fast_decode_plan, which is not logged)")
    if item.kind is Kind.MLA:
        return _mla(item, step)
    if item.kind is Kind.RAGGED:
        return _ragged(item, step)
    return _paged(item, step)


def _common(item: Run, *, head_dim: int) -> tuple[float, float, int, dict[str, str]]:
    """sm_scale, logits_soft_cap, window_left as the plan (or the run, which overrides) states them,
    and where neither passes one, as FlashInfer fills it in (the dumped version's defaults)."""
    plan, run = item.plan, item.run
    inferred: dict[str, str] = {}
    scale = fa.known_float(plan, "sm_scale")
    if scale is None:
        scale = default_sm_scale(head_dim)
        inferred["model.sm_scale"] = "not passed to plan(): 1/sqrt(head_dim), as FlashInfer's plan() fills sm_scale=None (a scale kept on the wrapper by forward() is not dumped)"
    cap = fa.known_float(plan, "logits_soft_cap")
    if cap is None:
        filled, inferred["model.logit_cap"] = _filled(plan, "logits_soft_cap", fallback=None, becomes=0.0, what="the plan's logits_soft_cap and the model's cap")
        cap = float(filled)
    window = fa.known_int(run, "window_left")
    window = fa.known_int(plan, "window_left") if window is None else window
    if window is None:
        filled, inferred["model.sliding_window"] = _filled(plan, "window_left", fallback=-1, becomes=None, what="the plan's window_left and the model's window")
        window = int(filled)
    return scale, cap, window, inferred


def _filled(call: Call, name: str, *, fallback: object, becomes: object, what: str) -> tuple[object, str]:
    """The value FlashInfer gives `name` when the call left it out, and the note naming its source.
    `becomes`: what plan() turns a None default into (logits_soft_cap None is 0, off)."""
    found = defaults.default(call, name)
    value, source = (found.value, found.source) if found is not None else (fallback, "FlashInfer's documented default (the dump's signature names none)")
    shown = f"{value!r}" if value is not None or becomes is None else f"None, which plan() makes {becomes!r}"
    if value is None:
        value = becomes
    return value, f"{name} not passed: {shown}, {source} ({what}; a value kept on the wrapper by forward() is not dumped)"


def _scalars(path: str, page_size: int, cap: float, window: int, **known: object) -> dict[str, int | float | bool | str]:
    """The plan scalars: those the dump states, and the defaults FlashInfer filled for the others."""
    scalars: dict[str, int | float | bool | str] = {"path": path, "page_size": page_size, "logits_soft_cap": cap, "window_left": window}
    scalars.update({k: v for k, v in known.items() if v is not None})
    return scalars


def _layout(item: Run, inferred: dict[str, str]) -> str:
    layout = fa.known_str(item.init, "kv_layout")
    if layout is None:
        inferred["kv_layout"] = "the wrapper's __init__ is not in the dump (or gave none): NHD, FlashInfer's default"
        return "NHD"
    if layout not in ("NHD", "HND"):
        raise TraceError("kv_layout", f"= {layout!r}, expected NHD or HND", item.init.where)
    return layout


def _graph(item: Run, bs: int, inferred: dict[str, str]) -> Graph | None:
    if item.run.flush_index is None:
        return None
    inferred["graph"] = f"replay {item.run.flush_index} of a CUDA graph, as FlashInfer flushed it: the engine's padding is not in the dump (capture_bs = the batch size, no padded rows)"
    inferred["plan"] = "the wrapper's last logged plan() before this replay (a replay planned with fast_decode_plan is not logged)"
    empty = torch.zeros(0, dtype=torch.int64)
    return Graph(is_graph_replay=True, capture_bs=bs, fill_value=1, padded_seq_lens=empty, padded_req_pool_indices=None, padded_out_cache_loc=empty, padded_positions=empty)


def _paged(item: Run, step: int) -> StepParts:
    """Decode wrapper, or paged prefill (causal, or verify with a custom mask)."""
    plan, run = item.plan, item.run
    decode = item.kind is Kind.DECODE
    names = ("indptr", "indices", "last_page_len") if decode else ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    kv_indptr, kv_indices, last = (fa.index(plan, n) for n in names)
    hq, hkv = fa.positive_int(plan, "num_qo_heads"), fa.positive_int(plan, "num_kv_heads")
    dim = fa.positive_int(plan, "head_dim" if decode else "head_dim_qk")
    if not decode and fa.positive_int(plan, "head_dim_vo", dim) != dim:
        raise fa.NotImported("head_dim_vo differs from head_dim_qk: attndbg imports one paged cache of one head dim")
    ps = fa.positive_int(plan, "page_size")
    scale, cap, window, inferred = _common(item, head_dim=dim)
    k_pool, v_pool, pages = fa.kv_pool(run, "paged_kv_cache", layout=_layout(item, inferred), page_size=ps, heads=hkv, dim=dim)
    kv_lens = last_page_lengths(kv_indptr, last, ps, name=names[2], path=plan.directory, inferred=inferred)
    rows = paged_rows(indptr=kv_indptr, indices=kv_indices, kv_lens=kv_lens, page_size=ps, num_pages=pages, names=names, path=plan.directory)
    bs = len(rows)
    if decode:
        q_len = fa.known_int(plan, "q_len_per_req") or fa.known_int(run, "q_len_per_req") or 1
        if q_len != 1:
            raise fa.NotImported(f"q_len_per_req = {q_len}: a multi-token decode has no causal rule attndbg knows of")
        q_lens = torch.ones(bs, dtype=torch.int64)
    else:
        qo = fa.index(plan, "qo_indptr")
        if qo.numel() != bs + 1:
            raise TraceError("qo_indptr", f"has {qo.numel()} entries, expected {bs + 1} (one per request of paged_kv_indptr, plus one)", plan.where)
        q_lens = qo.diff()
    if decode and bs and int(kv_lens.min()) < 1:
        raise fa.NotImported(f"a decode request without KV (request {int(torch.argmin(kv_lens))}): a padded row, no step")
    short = torch.nonzero(q_lens > kv_lens).flatten()
    if short.numel():
        b = int(short[0])
        raise fa.NotImported(f"request {b} has {int(q_lens[b])} queries but {int(kv_lens[b])} keys: its queries' own keys are not in the cache")
    tensors: dict[str, Tensor] = {"kv_indptr": plan.args()[names[0]], "kv_indices": plan.args()[names[1]], "kv_last_page_len": plan.args()[names[2]]}
    rows, (k_pool, v_pool), shifted = off_dummy_page(rows, (k_pool, v_pool), ps)
    if shifted:
        pages += 1
        tensors["kv_indices"] = tensors["kv_indices"] + 1
        inferred["batch.slot_ids"] = DUMMY_PAGE_NOTE
    prefix = (kv_lens - q_lens).tolist()
    spec = None
    if decode:
        mode = ForwardMode.DECODE
        cores = fa.known_bool(item.init, "use_tensor_cores")
        if cores is None:  # the wrapper's __init__ passed none, or is not in the dump
            if item.init is None:
                filled, source = False, "the wrapper's __init__ is not in the dump (FLASHINFER_DUMP_INCLUDE must keep '*Wrapper.__init__'): False, FlashInfer's default"
            else:
                filled, source = _filled(item.init, "use_tensor_cores", fallback=False, becomes=False, what="the decode kernel family")
            cores, inferred["plan.use_tensor_cores"] = bool(filled), source
        known = {"use_tensor_cores": cores, "causal": False}
    else:
        tensors["qo_indptr"] = plan.args()["qo_indptr"]
        mask, unread = _mask(plan, q_lens, kv_lens, tensors)
        causal = fa.known_bool(plan, "causal")
        if mask is not None or unread is not None:
            spec = _spec(mask, q_lens, kv_lens, plan, inferred) if mask is not None else _unread_spec(q_lens, unread, inferred)
            mode = ForwardMode.TARGET_VERIFY
            if causal is None:  # the kernel reads the mask; the flag is FlashInfer's default
                filled, inferred["plan.causal"] = _filled(plan, "causal", fallback=False, becomes=False, what="the plan's causal flag; the custom mask decides")
                causal = bool(filled)
        elif causal is False:
            raise fa.NotImported("a non-causal paged prefill without a mask: every query sees every key, which no attndbg step means (only as a cascade's prefix pass)")
        else:
            mode = mode_from_lengths(q_lens, prefix, path=plan.where)
            if causal is None:
                inferred["plan.causal"] = CAUSAL_NOTE
                causal = True
        known = {"causal": causal}
    q = fa.float_tensor(run, "q", dims=3)
    q = fa.check_shape(q, (int(q_lens.sum()), hq, dim), "q", run)
    out, lse = fa.results(run)
    out, lse = _shaped(out, q.shape, run, "result"), _shaped(lse, q.shape[:2], run, "result_1")
    if spec is not None and spec.custom_mask is None and (out is not None or lse is not None):
        # What the kernel computed from a mask that does not fit its blocks has no truth to be
        # compared with (the tree is not known): the plan detectors judge the mask itself.
        out = lse = None
        inferred["layer.output"] = "not kept: the run read a custom mask that does not fit the plan's blocks, and the draft tree it should show is not known"
    model = mha_model(num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim, v_head_dim=dim, sm_scale=scale, logit_cap=cap, window=window,
                      q_dtype=dtype_name(q.dtype, "q", run.directory, q=True), kv_dtype=dtype_name(k_pool.dtype, "paged_kv_cache", run.directory), page_size=ps)  # fmt: skip
    layer = layer_from_pool(rows=rows, extend_lens=q_lens.tolist(), q=q, k_pool=k_pool, v_pool=v_pool, output=out, lse=lse, lse_base=LseBase.TWO)
    return StepParts(
        source=imported_source(engine=ENGINE, version=_version(run), backend="flashinfer", step=step), model=model, mode=mode,
        prefix_lens=prefix, extend_lens=q_lens.tolist(), rows=rows, kv_cache_size=pages * ps, spec=spec, graph=_graph(item, bs, inferred),
        plan=Plan(backend="flashinfer", tensors=tensors, scalars=_scalars("decode" if decode else "paged", ps, cap, window, **known)),
        tensors={item.layer: layer}, inferred=inferred,
    )  # fmt: skip


def _mask(plan: Call, q_lens: Tensor, kv_lens: Tensor, tensors: dict[str, Tensor]) -> tuple[Tensor | None, str | None]:
    """The plan's custom mask as bools (per request a row-major [q_len, kv_len] block), recorded in
    the plan as given: `custom_mask` (bool, flattened as plan() flattens it) or `packed_custom_mask`
    (FlashInfer's segment_packbits, little-endian, each block on its own bytes), with the offsets
    plan() computes from the lengths. A mask whose size does not fit those blocks is kept as given
    (plan() packed it unchecked before FlashInfer #3503, and the kernel read it at these offsets:
    the tree-mask detector judges it); then no bools, and why the draft tree cannot be read."""
    sizes = q_lens * kv_lens
    args = plan.args()
    if isinstance(args.get("custom_mask"), Tensor):
        mask = args["custom_mask"].reshape(-1)
        tensors["custom_mask"] = mask
        # plan() computes the blocks' offsets itself (prefill.py _compute_page_mask_indptr); the
        # adapter's plan form carries them beside the bool mask.
        tensors["mask_indptr"] = torch.nn.functional.pad(sizes.cumsum(0), (1, 0)).to(torch.int32)
        if mask.numel() != int(sizes.sum()):
            return None, f"custom_mask has {mask.numel()} elements, the requests' q_len x kv_len blocks need {int(sizes.sum())}"
        return mask.to(torch.bool), None
    packed = args.get("packed_custom_mask")
    if not isinstance(packed, Tensor):
        return None, None
    if packed.dim() != 1 or packed.dtype != torch.uint8:
        raise fa.NotImported(f"packed_custom_mask is a {str(packed.dtype).replace('torch.', '')} tensor of shape {list(packed.shape)}, not segment_packbits' 1-D uint8 bytes")
    byte_sizes = (sizes + 7) // 8
    offsets = torch.nn.functional.pad(byte_sizes.cumsum(0), (1, 0))
    tensors[PACKED_MASK], tensors[PACKED_INDPTR] = packed, offsets.to(torch.int32)
    if packed.numel() < int(offsets[-1]):
        return None, f"packed_custom_mask holds {packed.numel()} bytes, the requests' blocks need {int(offsets[-1])}"
    bits = torch.arange(8)
    blocks = [((packed[int(offsets[b]) : int(offsets[b + 1])].to(torch.int64)[:, None] >> bits) & 1).flatten()[: int(sizes[b])] for b in range(sizes.numel())]
    return (torch.cat(blocks).to(torch.bool) if blocks else torch.zeros(0, dtype=torch.bool)), None


def _unread_spec(q_lens: Tensor, unread: str, inferred: dict[str, str]) -> Spec:
    """A verify step whose draft tree is not known: its mask does not fit the blocks the kernel
    reads. The step keeps the verify's shape (n queries a request) so the plan detectors judge the
    mask as the kernel reads it; the tree stands as a chain only so the step has a form, with no
    mask of its own (nothing is compared with it: the run's output is not kept)."""
    n = _draft_count(q_lens)
    inferred["spec"] = f"not known: {unread}, so the draft tree cannot be read from it; a chain of {n} stands in for it (no spec mask, the run's output not kept): the plan's mask is judged as the kernel reads it"
    return Spec(algorithm="unknown", draft_token_num=n, topk=1, steps=max(n - 1, 1), parents=tree.chain_parents(n, q_lens.numel()), custom_mask=None, mask_layout=MaskLayout.FULL)


def _draft_count(q_lens: Tensor) -> int:
    n = int(q_lens[0]) if q_lens.numel() else 1
    if bool((q_lens != n).any()):
        raise fa.NotImported(f"custom mask over requests of {sorted(set(q_lens.tolist()))} queries: a verify step has the same draft count in every request")
    return n


def _spec(mask: Tensor, q_lens: Tensor, kv_lens: Tensor, plan: Call, inferred: dict[str, str]) -> Spec:
    """The draft tree each request's mask block draws: token j is an ancestor of i when row i sees
    draft column j; a token's parent is its nearest visible earlier token. A block that is not a
    tree's mask still gives a tree (the nearest visible token, else the root): check then names
    where the recorded mask departs from it."""
    n = _draft_count(q_lens)
    parents, start = [], 0
    for b in range(q_lens.numel()):
        kv = int(kv_lens[b])
        block = mask[start : start + n * kv].view(n, kv)[:, kv - n :]
        start += n * kv
        row = [-1]
        for i in range(1, n):
            seen = torch.nonzero(block[i, :i]).flatten()
            row.append(int(seen[-1]) if seen.numel() else 0)
        parents.append(row)
    p = torch.tensor(parents, dtype=torch.int64).view(len(parents), n)
    depth = int(max((tree.depths(r).max() for r in p), default=torch.tensor(0))) if p.numel() else 0
    children = max((int(torch.bincount(r[1:], minlength=n).max()) for r in p if n > 1), default=1)
    inferred["spec"] = "from the plan's custom mask (FULL layout): parents are each token's nearest visible draft; algorithm, topk and steps are not in the dump"
    return Spec(algorithm="unknown", draft_token_num=n, topk=max(children, 1), steps=max(depth, 1), parents=p, custom_mask=mask, mask_layout=MaskLayout.FULL)


def _shaped(t: Tensor | None, shape: tuple[int, ...], call: Call, name: str) -> Tensor | None:
    """An output of the expected shape (kept as the engine's output); another shape is not this run's output."""
    if t is None:
        return None
    if tuple(t.shape) != tuple(shape) or t.dtype not in fa.FLOAT_TYPES:
        raise TraceError(name, f"is a {str(t.dtype).replace('torch.', '')} tensor of shape {list(t.shape)}, expected float {list(shape)}", str(call.directory / "outputs"))
    return t


def _version(call: Call) -> str:
    versions = call.record.get("versions")
    version = versions.get("flashinfer") if isinstance(versions, dict) else None
    return version if isinstance(version, str) and len(version) < 64 and version.isprintable() else "unknown"


def _ragged(item: Run, step: int) -> StepParts:
    """A ragged prefill alone: causal, its keys laid out in a cache of their own (it has none)."""
    plan, run = item.plan, item.run
    qo, kv_indptr = fa.index(plan, "qo_indptr"), fa.index(plan, "kv_indptr")
    hq, hkv = fa.positive_int(plan, "num_qo_heads"), fa.positive_int(plan, "num_kv_heads")
    dim = fa.positive_int(plan, "head_dim_qk")
    if fa.positive_int(plan, "head_dim_vo", dim) != dim:
        raise fa.NotImported("head_dim_vo differs from head_dim_qk")
    if isinstance(plan.args().get("custom_mask"), Tensor) or isinstance(plan.args().get("packed_custom_mask"), Tensor):
        raise fa.NotImported("a ragged prefill with a custom mask: attndbg reads tree masks of paged prefills only")
    causal = fa.known_bool(plan, "causal")
    if causal is False:
        raise fa.NotImported("a non-causal ragged prefill: every query sees every key, which no attndbg step means")
    scale, cap, window, inferred = _common(item, head_dim=dim)
    if causal is None:
        inferred["plan.causal"] = CAUSAL_NOTE
        causal = True
    for name, offsets in (("qo_indptr", qo), ("kv_indptr", kv_indptr)):
        try:
            check_indptr(name, offsets)
        except TraceError as e:
            raise e.in_file(plan.where) from None
    if qo.numel() != kv_indptr.numel():
        raise TraceError("kv_indptr", f"has {kv_indptr.numel()} entries, qo_indptr {qo.numel()}: one per request plus one", plan.where)
    q_lens, kv_lens = qo.diff(), kv_indptr.diff()
    if bool((q_lens > kv_lens).any()):
        b = int(torch.nonzero(q_lens > kv_lens)[0, 0])
        raise fa.NotImported(f"request {b} has more queries ({int(q_lens[b])}) than keys ({int(kv_lens[b])})")
    q = fa.check_shape(fa.float_tensor(run, "q", dims=3), (int(qo[-1]), hq, dim), "q", run)
    k, v = fa.float_tensor(run, "k", dims=3), fa.float_tensor(run, "v", dims=3)
    total = int(kv_indptr[-1])
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] < total or tuple(t.shape[1:]) != (hkv, dim):
            raise TraceError(name, f"has shape {list(t.shape)}, expected [>= {total}, {hkv}, {dim}]", run.where)
    # Slot 0 is the engine's dummy slot: request b's keys sit at 1 + their ragged rows.
    rows = [torch.arange(1 + int(kv_indptr[b]), 1 + int(kv_indptr[b + 1])) for b in range(q_lens.numel())]
    inferred["batch.slot_ids"] = "a ragged call has no KV cache: each request's keys laid out in slots from 1, in ragged order"
    pad = k.new_zeros(1, hkv, dim)
    k_pool, v_pool = torch.cat([pad, k[:total]]), torch.cat([pad, v[:total]])
    prefix = (kv_lens - q_lens).tolist()
    plan_out = None
    if any(prefix):
        inferred["plan"] = "a ragged call over a cached prefix has no attndbg plan form (SGLang runs that as a cascade): not recorded"
    else:
        plan_out = Plan(backend="flashinfer", tensors={"qo_indptr": plan.args()["qo_indptr"]}, scalars=_scalars("ragged", 1, cap, window, causal=causal))
    out, lse = fa.results(run)
    model = mha_model(num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim, v_head_dim=dim, sm_scale=scale, logit_cap=cap, window=window,
                      q_dtype=dtype_name(q.dtype, "q", run.directory, q=True), kv_dtype=dtype_name(k.dtype, "k", run.directory), page_size=1)  # fmt: skip
    layer = layer_from_pool(rows=rows, extend_lens=q_lens.tolist(), q=q, k_pool=k_pool, v_pool=v_pool, output=_shaped(out, q.shape, run, "result"), lse=_shaped(lse, q.shape[:2], run, "result_1"), lse_base=LseBase.TWO)
    return StepParts(
        source=imported_source(engine=ENGINE, version=_version(run), backend="flashinfer", step=step), model=model, mode=mode_from_lengths(q_lens, prefix, path=plan.where),
        prefix_lens=prefix, extend_lens=q_lens.tolist(), rows=rows, kv_cache_size=total + 1, plan=plan_out, tensors={item.layer: layer}, inferred=inferred,
    )  # fmt: skip


def _cascade(item: Cascade, step: int) -> StepParts:
    """SGLang's cached extend: prefix lengths and slots from the paged plan, new tokens from the
    ragged plan, the merge_state output as the engine's output."""
    if item.ragged.plan is None or item.paged.plan is None:
        raise fa.NotImported("a cascade run without its plan() in the dump")
    ragged = _ragged(item.ragged, step)
    if any(ragged.prefix_lens):
        raise fa.NotImported("the cascade's ragged part reads keys beyond its own queries")
    paged_plan, paged_run = item.paged.plan, item.paged.run
    ps = fa.positive_int(paged_plan, "page_size")
    names = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    kv_indptr, kv_indices, last = (fa.index(paged_plan, n) for n in names)
    m = ragged.model
    inferred = dict(ragged.inferred)
    k_pool, v_pool, pages = fa.kv_pool(paged_run, "paged_kv_cache", layout=_layout(item.paged, inferred), page_size=ps, heads=m.num_kv_heads, dim=m.head_dim)
    prefix_lens = last_page_lengths(kv_indptr, last, ps, name=names[2], path=paged_plan.directory, inferred=inferred)
    prefix_rows = paged_rows(indptr=kv_indptr, indices=kv_indices, kv_lens=prefix_lens, page_size=ps, num_pages=pages, names=names, path=paged_plan.directory)
    prefix_rows, (k_pool, v_pool), shifted = off_dummy_page(prefix_rows, (k_pool, v_pool), ps)
    pages += int(shifted)
    extend = ragged.extend_lens
    if len(prefix_rows) != len(extend):
        raise TraceError(names[0], f"lists {len(prefix_rows)} requests, the ragged run {len(extend)}", paged_plan.where)
    # The new tokens have no slots in the dump (the paged pass reads the prefix only): each continues
    # its request's last page, then takes fresh pages after the pool.
    rows, fresh = [], pages
    for row, e in zip(prefix_rows, extend):
        cols = torch.arange(row.numel(), row.numel() + e)
        in_last = cols < -(-row.numel() // ps) * ps
        new = torch.empty(e, dtype=torch.int64)
        if row.numel():
            new[in_last] = row[-1] // ps * ps + cols[in_last] % ps
        count = int((~in_last).sum())
        first_page = fresh
        fresh += -(-count // ps)
        new[~in_last] = first_page * ps + torch.arange(count)
        rows.append(torch.cat([row, new]))
    inferred["batch.out_cache_loc"] = "the cascade's new tokens come from the ragged run (no cache slots in the dump): each continues its last prefix page, then pages after the pool"
    inferred.pop("batch.slot_ids", None)
    inferred.pop("plan", None)
    size = fresh * ps
    new_slots = torch.cat([r[r.numel() - e :] for r, e in zip(rows, extend)]) if rows else torch.zeros(0, dtype=torch.int64)
    layer = ragged.tensors[item.ragged.layer]
    ragged_k = layer.k_new
    k_full, v_full = k_pool.new_zeros(size, *k_pool.shape[1:]), v_pool.new_zeros(size, *v_pool.shape[1:])
    k_full[: k_pool.shape[0]], v_full[: v_pool.shape[0]] = k_pool, v_pool
    k_full[new_slots], v_full[new_slots] = ragged_k.to(k_full.dtype), layer.v_new.to(v_full.dtype)
    out, lse = fa.results(item.merge)
    q = layer.q
    merged = layer_from_pool(rows=rows, extend_lens=extend, q=q, k_pool=k_full, v_pool=v_full, output=_shaped(out, q.shape, item.merge, "result_0"), lse=_shaped(lse, q.shape[:2], item.merge, "result_1"), lse_base=LseBase.TWO)
    qo = item.ragged.plan.args()["qo_indptr"]
    scale, cap, window, _ = _common(item.paged, head_dim=m.head_dim)
    tensors = {"qo_indptr": qo, "kv_indptr": paged_plan.args()[names[0]], "kv_indices": paged_plan.args()[names[1]] + int(shifted), "kv_last_page_len": paged_plan.args()[names[2]]}
    if shifted:
        inferred["batch.slot_ids"] = DUMMY_PAGE_NOTE
    prefix_causal = fa.known_bool(paged_plan, "causal")
    if prefix_causal is None:  # the prefix pass is non-causal: FlashInfer's default is just that
        filled, inferred["plan.causal"] = _filled(paged_plan, "causal", fallback=False, becomes=False, what="the cascade's prefix pass")
        prefix_causal = bool(filled)
    model = Model(**{**vars(m), "page_size": ps, "kv_dtype": dtype_name(k_pool.dtype, "paged_kv_cache", paged_run.directory)})
    prefix = prefix_lens.tolist()
    return StepParts(
        source=ragged.source, model=model, mode=mode_from_lengths(extend, prefix, path=paged_plan.where), prefix_lens=prefix, extend_lens=extend, rows=rows,
        kv_cache_size=size, plan=Plan(backend="flashinfer", tensors=tensors, scalars=_scalars("cascade", ps, cap, window, causal=prefix_causal)),
        tensors={item.ragged.layer: merged}, inferred=inferred,
    )  # fmt: skip


def _mla(item: Run, step: int) -> StepParts:
    """FlashInfer's MLA wrapper: keys = [ckv | kpe] per slot (576 wide for DeepSeek), values the ckv part."""
    plan, run = item.plan, item.run
    qo, kv_indptr, kv_indices, kv_len_arr = (fa.index(plan, n) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
    heads, ckv, kpe, ps = (fa.positive_int(plan, n) for n in ("num_heads", "head_dim_ckv", "head_dim_kpe", "page_size"))
    inferred: dict[str, str] = {}
    scale = fa.known_float(plan, "sm_scale")
    if scale is None:
        scale = default_sm_scale(ckv + kpe)
        inferred["model.sm_scale"] = "the plan gives none: 1/sqrt(head_dim_ckv + head_dim_kpe) (DeepSeek models pass their own)"
    q_nope, q_pe = fa.float_tensor(run, "q_nope", dims=3), fa.float_tensor(run, "q_pe", dims=3)
    caches = []
    for name, width in (("ckv_cache", ckv), ("kpe_cache", kpe)):
        t = fa.float_tensor(run, name, dims=run.args()[name].dim() if isinstance(run.args().get(name), Tensor) else 3)
        t = t.view(-1, ps, width) if t.dim() == 2 and ps == 1 else t
        if t.dim() != 3 or tuple(t.shape[1:]) != (ps, width):
            raise TraceError(name, f"has shape {list(t.shape)}, expected [pages, {ps}, {width}]", run.where)
        caches.append(t.reshape(-1, 1, width))
    if caches[0].shape[0] != caches[1].shape[0]:
        raise TraceError("kpe_cache", f"has {caches[1].shape[0]} slots, ckv_cache {caches[0].shape[0]}", run.where)
    pages = caches[0].shape[0] // ps
    rows = paged_rows(indptr=kv_indptr, indices=kv_indices, kv_lens=kv_len_arr, page_size=ps, num_pages=pages, names=("kv_indptr", "kv_indices", "kv_len_arr"), path=plan.directory)
    if qo.numel() != len(rows) + 1:
        raise TraceError("qo_indptr", f"has {qo.numel()} entries, expected {len(rows) + 1}", plan.where)
    rows, (key_pool,), shifted = off_dummy_page(rows, (torch.cat(caches, dim=-1),), ps)
    pages += int(shifted)
    if shifted:
        inferred["batch.slot_ids"] = DUMMY_PAGE_NOTE
    q_lens = qo.diff()
    if bool((q_lens > kv_len_arr).any()) or bool((kv_len_arr < 1).any()):
        raise fa.NotImported("a request with more queries than keys, or without keys")
    causal = fa.known_bool(plan, "causal")
    decode = bool((q_lens == 1).all())
    if not decode and causal is False:
        raise fa.NotImported("a non-causal MLA prefill: every query sees every key, which no attndbg step means")
    if not decode and causal is None:
        inferred["plan.causal"] = CAUSAL_NOTE
        causal = True
    q = torch.cat([q_nope, q_pe], dim=-1)
    q = fa.check_shape(q, (int(q_lens.sum()), heads, ckv + kpe), "q_nope/q_pe", run)
    out, lse = fa.results(run)
    base = LseBase.E if fa.known_bool(run, "return_lse_base_on_e") else LseBase.TWO
    layer = layer_from_pool(rows=rows, extend_lens=q_lens.tolist(), q=q, k_pool=key_pool, v_pool=None, output=_shaped(out, (q.shape[0], heads, ckv), run, "result"), lse=_shaped(lse, q.shape[:2], run, "result_1"), lse_base=base)
    model = Model(
        num_qo_heads=heads, num_kv_heads=1, head_dim=ckv + kpe, v_head_dim=ckv, attention=AttentionKind.MLA, kv_lora_rank=ckv, qk_rope_head_dim=kpe,
        sm_scale=scale, logit_cap=0.0, sliding_window=-1, q_dtype=dtype_name(q.dtype, "q_nope", run.directory, q=True), kv_dtype=dtype_name(caches[0].dtype, "ckv_cache", run.directory), page_size=ps,
    )  # fmt: skip
    prefix = (kv_len_arr - q_lens).tolist()
    tensors = {n: plan.args()[n] for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")}
    tensors["kv_indices"] = tensors["kv_indices"] + int(shifted)
    scalars: dict[str, int | float | bool | str] = {"impl": "flashinfer", "page_size": ps}
    if causal is not None or decode:
        scalars["causal"] = bool(causal) and not decode
    return StepParts(
        source=imported_source(engine=ENGINE, version=_version(run), backend="flashinfer_mla", step=step), model=model,
        mode=ForwardMode.DECODE if decode else mode_from_lengths(q_lens, prefix, path=plan.where), prefix_lens=prefix, extend_lens=q_lens.tolist(), rows=rows,
        kv_cache_size=pages * ps, graph=_graph(item, len(rows), inferred), plan=Plan(backend="mla", tensors=tensors, scalars=scalars), tensors={item.layer: layer}, inferred=inferred,
    )  # fmt: skip
