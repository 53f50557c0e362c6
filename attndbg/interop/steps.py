"""Lay an imported step out as a trace: request rows from page tables, the engine-side fields the
formats do not carry (positions, raw seq_lens: filled as a correct engine would and named in
`source.inferred`), recorded tensors gathered from a KV pool, and one validation pass that turns
any inconsistency into an error naming the file it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from attndbg.trace.build import batch_from_rows, package_version
from attndbg.trace import tree
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, ForwardMode, Graph, LayerTensors, LseBase, Model, Plan, Source, Spec, Trace, to_dict
from attndbg.trace.validate import check_indptr, from_dict

# What every import fills in the same way (the formats are kernel-level: no engine bookkeeping).
ENGINE_FIELDS = {
    "batch.positions": "not in the source: each token's column (prefix + depth for a verify draft), as a correct engine computes it",
    "batch.seq_lens_raw": "not in the source: the KV length (the prefix for a verify step), as SGLang records it",
}


def dtype_name(dtype: torch.dtype, what: str, path: Path, *, q: bool = False) -> str:
    """A tensor dtype as the trace names it; an error naming `what` when attndbg has no such dtype."""
    name = str(dtype).replace("torch.", "")
    allowed = Q_DTYPES if q else tuple(DTYPES)
    if name not in allowed:
        raise TraceError(what, f"has dtype {name}, attndbg replays {', '.join(allowed)}", str(path))
    return name


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def paged_rows(*, indptr: Tensor, indices: Tensor, kv_lens: Tensor, page_size: int, num_pages: int, names: tuple[str, str, str], path: Path) -> list[Tensor]:
    """Each request's KV slot ids (page id * page_size + offset, cut to its length) from a CSR page
    table. `names` are the fields (indptr, indices, lengths) errors name; everything is checked:
    offsets, page ids inside the pool, lengths inside the pages listed."""
    indptr_name, indices_name, lens_name = names
    try:
        check_indptr(indptr_name, indptr)
    except TraceError as e:
        raise e.in_file(str(path)) from None
    requests = indptr.numel() - 1
    if int(indptr[-1]) > indices.numel():
        raise TraceError(f"{indptr_name}[-1]", f"= {int(indptr[-1])}, past the {indices.numel()} entries of {indices_name}", str(path))
    if kv_lens.numel() != requests:
        raise TraceError(lens_name, f"has {kv_lens.numel()} entries, expected one per request of {indptr_name} ({requests})", str(path))
    used = indices[: int(indptr[-1])]
    bad = torch.nonzero((used < 0) | (used >= num_pages)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise TraceError(f"{indices_name}[{i}]", f"= {int(used[i])} is outside the KV pool's {num_pages} pages", str(path))
    pages = indptr.diff()
    bad = torch.nonzero((kv_lens < 0) | (kv_lens > pages * page_size) | ((pages > 0) & (kv_lens <= (pages - 1) * page_size))).flatten()
    if bad.numel():
        b = int(bad[0])
        raise TraceError(f"{lens_name}[{b}]", f"= {int(kv_lens[b])} tokens, but request {b} lists {int(pages[b])} pages of {page_size}", str(path))
    offsets = torch.arange(page_size, dtype=torch.int64)
    rows = []
    for b in range(requests):
        ids = used[int(indptr[b]) : int(indptr[b + 1])]
        rows.append((ids[:, None] * page_size + offsets[None, :]).flatten()[: int(kv_lens[b])])
    return rows


def last_page_lengths(indptr: Tensor, last_page_len: Tensor, page_size: int, *, name: str, path: Path, inferred: dict[str, str]) -> Tensor:
    """Each request's KV length from FlashInfer's paged arrays: (pages - 1) * page_size +
    last_page_len (0 without pages). A last page length outside 1..page_size is the engine's
    mistake, not bad input: the request is taken to fill the pages it lists (what
    `seq_len % page_size` meant for a full last page), the plan keeps the value, `check` judges it,
    and `inferred` says so."""
    pages = indptr.diff()
    if last_page_len.numel() < pages.numel():
        raise TraceError(name, f"has {last_page_len.numel()} entries, expected one per request ({pages.numel()})", str(path))
    last = last_page_len[: pages.numel()]
    bad = torch.nonzero((pages > 0) & ((last < 1) | (last > page_size))).flatten()
    if bad.numel():
        b = int(bad[0])
        more = f" and {bad.numel() - 1} more" if bad.numel() > 1 else ""
        inferred["batch.kv_lens"] = (
            f"{name}[{b}] = {int(last[b])}{more}: a last page holds 1 to {page_size} tokens, so each such request is taken to fill "
            f"the pages it lists (as if its last page were full); the plan keeps the engine's value, which check judges"
        )
        last = torch.where((last < 1) | (last > page_size), torch.full_like(last, page_size), last)
    return torch.where(pages > 0, (pages - 1) * page_size + last, 0)


@dataclass
class StepParts:
    """Everything an importer knows of one step, in the trace's words."""

    source: Source
    model: Model
    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: list[Tensor]  # per request: the slot of each column (prefix + extend)
    kv_cache_size: int
    spec: Spec | None = None
    graph: Graph | None = None
    plan: Plan | None = None
    tensors: dict[int, LayerTensors] = field(default_factory=dict)
    inferred: dict[str, str] = field(default_factory=dict)


def make_trace(parts: StepParts, *, seed: int, path: Path) -> Trace:
    """The validated trace of `parts`; any inconsistency is a TraceError naming `path`."""
    prefix, extend = torch.tensor(parts.prefix_lens, dtype=torch.int64), torch.tensor(parts.extend_lens, dtype=torch.int64)
    kv = prefix + extend
    cols = torch.cat([torch.arange(p, p + e) for p, e in zip(parts.prefix_lens, parts.extend_lens)]) if parts.rows else torch.zeros(0, dtype=torch.int64)
    verify = parts.spec is not None and parts.mode is ForwardMode.TARGET_VERIFY
    positions = cols.clone()
    if verify:
        depth = torch.stack([tree.depths(p) for p in parts.spec.parents]).flatten() if parts.rows else cols
        positions = torch.repeat_interleave(prefix, extend) + depth
    out_cache_loc = torch.cat([row[c] for row, c in zip(parts.rows, torch.split(cols, parts.extend_lens))]) if parts.rows else cols
    try:
        batch = batch_from_rows(
            forward_mode=parts.mode,
            prefix_lens=prefix,
            extend_lens=extend,
            rows=parts.rows,
            out_cache_loc=out_cache_loc,
            positions=positions,
            seq_lens_raw=prefix if verify else kv,
            kv_cache_size=parts.kv_cache_size,
        )
    except ValueError as e:
        raise TraceError("batch", str(e), str(path)) from None
    source = Source(**{**vars(parts.source), "inferred": {**ENGINE_FIELDS, **parts.inferred}})
    trace = Trace(source=source, model=parts.model, batch=batch, seed=seed, spec=parts.spec, graph=parts.graph, plan=parts.plan, tensors=parts.tensors)
    try:
        return from_dict(to_dict(trace))  # the loader's own checks: what import writes, check can read
    except TraceError as e:
        raise e.in_file(str(path)) from None


def layer_from_pool(*, rows: list[Tensor], extend_lens: list[int], q: Tensor, k_pool: Tensor, v_pool: Tensor | None, output: Tensor | None, lse: Tensor | None, lse_base: LseBase) -> LayerTensors:
    """Recorded tensors of one layer from a KV pool indexed by slot ([slots, Hkv, D]) that already
    holds this step's K/V (FlashInfer runs after the append): the rows the batch reads, and the new
    tokens' K/V read back from their slots. `v_pool` None: MLA (values are the latent keys)."""
    slots = torch.unique(torch.cat(rows)) if rows else torch.zeros(0, dtype=torch.int64)
    loc = torch.cat([row[row.numel() - e :] for row, e in zip(rows, extend_lens)]) if rows else slots
    k_rows, k_new = k_pool[slots], k_pool[loc]
    if v_pool is None:
        v_rows, v_new = k_rows.new_zeros(*k_rows.shape[:2], 0), k_new.new_zeros(*k_new.shape[:2], 0)
    else:
        v_rows, v_new = v_pool[slots], v_pool[loc]
    return LayerTensors(q=q, k_new=k_new, v_new=v_new, kv_slots=slots, k_rows=k_rows, v_rows=v_rows, output=output, lse=lse, lse_base=lse_base)


def mha_model(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, sm_scale: float, logit_cap: float, window: int, q_dtype: str, kv_dtype: str, page_size: int) -> Model:
    return Model(
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, attention=AttentionKind.MHA,
        kv_lora_rank=0, qk_rope_head_dim=0, sm_scale=sm_scale, logit_cap=logit_cap, sliding_window=window, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size,
    )  # fmt: skip


def imported_source(*, engine: str, version: str, backend: str, step: int) -> Source:
    # The formats name no GPU: "cuda" says where the step ran, not on which card.
    return Source(engine=engine, engine_version=version, backend=backend, device="cuda", tp_rank=0, step=step, attndbg_version=package_version("attndbg"))


DUMMY_PAGE_NOTE = "page ids shifted up by one: the source's requests use page 0, which attndbg (as SGLang) keeps as the dummy page padded graph rows write"


def off_dummy_page(rows: list[Tensor], pools: tuple[Tensor, ...], page_size: int) -> tuple[list[Tensor], tuple[Tensor, ...], bool]:
    """Requests that read page 0 (a FlashInfer caller owns its whole pool; SGLang never hands page 0
    to a request): every page moves up one, the pools get an empty page 0, so a padded graph replay
    writing the dummy slot does not overwrite a real request's keys."""
    if not any(bool((row < page_size).any()) for row in rows):
        return rows, pools, False
    pad = [p.new_zeros(page_size, *p.shape[1:]) for p in pools]
    return [row + page_size for row in rows], tuple(torch.cat([z, p]) for z, p in zip(pad, pools)), True
