"""`attndbg export fib REC -o DIR`: a recording's steps as a flashinfer-bench trace set
(`definitions/<op_type>/<name>.json`, `workloads/<op_type>/<name>.jsonl`, blobs under
`blob/workloads/`), so a failing step can go to their benchmark.

Each step's batch (not its recorded plan) becomes FlashInfer's paged CSR arrays; the pages a step
reads are renumbered 0, 1, ... in order of first use, so a blob holds the pages read and not the
engine's whole pool. A step with recorded tensors exports the first recorded layer's q and KV
values (the new tokens' K/V written into their slots, as the kernel sees them); without, q and the
caches are `random`, as flashinfer-bench's own workloads keep them. What the definitions cannot
express (a tree mask, a sliding window, a soft-cap, MLA prefill) is left out with its reason.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.interop.fib_definitions import Op, definition
from attndbg.interop.files import save_safetensors
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import AttentionKind, ForwardMode, Trace


@dataclass
class Exported:
    out_dir: Path
    workloads: int = 0
    definitions: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


def op_of(trace: Trace) -> Op:
    """The definition a step fits; ValueError naming what does not fit."""
    m, b = trace.model, trace.batch
    if trace.is_tree_verify or b.forward_mode is ForwardMode.TARGET_VERIFY:
        raise ValueError("a verify step's tree mask has no flashinfer-bench definition (their definitions carry no mask)")
    if b.selective:
        raise ValueError("a selective-recompute step has no flashinfer-bench definition")
    if m.sliding_window >= 0 or m.logit_cap > 0:
        raise ValueError("a sliding window or logit soft-cap has no flashinfer-bench definition")
    if m.attention is AttentionKind.MLA:
        if b.forward_mode is not ForwardMode.DECODE:
            raise ValueError("MLA prefill: attndbg exports MLA decode only")
        return Op.MLA_DECODE
    if m.v_head_dim != m.head_dim:
        raise ValueError(f"v_head_dim {m.v_head_dim} differs from head_dim {m.head_dim}")
    return Op.DECODE if b.forward_mode is ForwardMode.DECODE else Op.PREFILL


def export_recording(target: str, out_dir: str) -> Exported:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TraceError("-o", f"{out_dir} exists and is not an empty directory: choose a new one")
    result = Exported(out_dir=out)
    for path in io.trace_paths(target):
        trace = io.load(path)
        try:
            op = op_of(trace)
        except ValueError as e:
            result.notes.append(f"{path.name}: step {trace.source.step} not exported: {e}")
            continue
        d = definition(op, trace.model)
        def_path = out / "definitions" / op.op_type / f"{d['name']}.json"
        if d["name"] not in result.definitions:
            def_path.parent.mkdir(parents=True, exist_ok=True)
            def_path.write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
            result.definitions.add(d["name"])
        line = _workload(trace, op, out, d["name"], seed=f"{path.resolve()}:{trace.source.step}")
        jsonl = out / "workloads" / op.op_type / f"{d['name']}.jsonl"
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        result.workloads += 1
    return result


def _pages(trace: Trace) -> tuple[list[Tensor], Tensor]:
    """Per request its pages renumbered in order of first use, and the original page of each new id."""
    ps = trace.model.page_size
    first_use: dict[int, int] = {}
    renumbered = []
    for b in range(trace.batch.batch_size):
        pages = trace.batch.request_slots(b)[::ps] // ps
        renumbered.append(torch.tensor([first_use.setdefault(int(p), len(first_use)) for p in pages], dtype=torch.int64))
    return renumbered, torch.tensor(list(first_use), dtype=torch.int64)


def _workload(trace: Trace, op: Op, root: Path, name: str, *, seed: str) -> dict[str, Any]:
    b, m = trace.batch, trace.model
    pages, originals = _pages(trace)
    ps = m.page_size
    counts = torch.tensor([p.numel() for p in pages], dtype=torch.int64)
    blobs: dict[str, Tensor] = {
        "kv_indptr": torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32),
        "kv_indices": (torch.cat(pages) if pages else torch.zeros(0, dtype=torch.int64)).to(torch.int32),
    }
    if op is Op.MLA_DECODE:
        blobs["kv_len_arr"] = b.kv_lens.to(torch.int32)
    else:
        blobs["kv_last_page_len"] = ((b.kv_lens - 1) % ps + 1).to(torch.int32)
    if op is Op.PREFILL:
        blobs["qo_indptr"] = b.qo_indptr.to(torch.int32)
    num_pages = max(int(originals.numel()), 1)
    axes = {"tokens": b.num_tokens, "batch_size": b.batch_size, "len_indptr": b.batch_size + 1, "num_kv_indices": int(blobs["kv_indices"].numel()), "num_pages": num_pages}
    blobs.update(_values(trace, op, originals, num_pages))
    ident = str(uuid.uuid5(uuid.NAMESPACE_URL, f"attndbg:{seed}"))
    blob = Path("blob") / "workloads" / op.op_type / name / f"{name}_{ident}.safetensors"
    (root / blob).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(blobs, root / blob)
    float_inputs = ("q_nope", "q_pe", "ckv_cache", "kpe_cache") if op is Op.MLA_DECODE else ("q", "k_cache", "v_cache")
    inputs: dict[str, Any] = {k: {"type": "safetensors", "path": blob.as_posix(), "tensor_key": k} if k in blobs else {"type": "random"} for k in float_inputs}
    inputs.update({k: {"type": "safetensors", "path": blob.as_posix(), "tensor_key": k} for k in blobs if k not in float_inputs})
    inputs["sm_scale"] = {"type": "scalar", "value": m.sm_scale}
    return {"definition": name, "workload": {"uuid": ident, "axes": axes, "inputs": inputs}, "solution": None, "evaluation": None}


def _values(trace: Trace, op: Op, originals: Tensor, num_pages: int) -> dict[str, Tensor]:
    """The first recorded layer's q and the read pages' K/V (this step's new K/V written in), by new page id."""
    if not trace.tensors:
        return {}
    m, b = trace.model, trace.batch
    layer = trace.tensors[min(trace.tensors)]
    ps, kv_dtype = m.page_size, layer.k_rows.dtype
    slot_of_page = (originals[:, None] * ps + torch.arange(ps)).flatten()  # new page p, offset o -> old slot
    k = torch.zeros(num_pages * ps, *layer.k_rows.shape[1:], dtype=kv_dtype)
    v = torch.zeros(num_pages * ps, *layer.v_rows.shape[1:], dtype=layer.v_rows.dtype)
    where = {int(s): i for i, s in enumerate(slot_of_page)}
    for slots, k_src, v_src in ((layer.kv_slots, layer.k_rows, layer.v_rows), (b.out_cache_loc, layer.k_new.to(kv_dtype), layer.v_new.to(layer.v_rows.dtype))):
        keep = [i for i, s in enumerate(slots.tolist()) if s in where]
        rows = torch.tensor([where[int(slots[i])] for i in keep], dtype=torch.int64)
        k[rows], v[rows] = k_src[keep], v_src[keep]
    q = layer.q.to(getattr(torch, m.q_dtype))
    if op is Op.MLA_DECODE:
        keys = k.view(num_pages, ps, -1)
        return {"q_nope": q[..., : m.kv_lora_rank], "q_pe": q[..., m.kv_lora_rank :], "ckv_cache": keys[..., : m.kv_lora_rank], "kpe_cache": keys[..., m.kv_lora_rank :]}
    return {"q": q, "k_cache": k.view(num_pages, ps, *k.shape[1:]), "v_cache": v.view(num_pages, ps, *v.shape[1:])}
