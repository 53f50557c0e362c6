"""Write FlashInfer level-10 dump directories as FlashInfer 0.7.2's api_logging.py writes them
(interop.md §1.2-1.7: call folders, session.jsonl, inputs.pt / outputs.pt with arg_i / kwarg_x
keys, `self` as arg_0, graph flushes), with outputs computed by a float64 reference, so an import
of a correct dump checks clean. Small on purpose: these are CPU fixtures."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

DECODE = "BatchDecodeWithPagedKVCacheWrapper"
PAGED = "BatchPrefillWithPagedKVCacheWrapper"
RAGGED = "BatchPrefillWithRaggedKVCacheWrapper"
MLA = "BatchMLAPagedAttentionWrapper"
MODULES = {DECODE: "flashinfer.decode", PAGED: "flashinfer.prefill", RAGGED: "flashinfer.prefill", MLA: "flashinfer.mla._batch_mla._wrapper", "merge_state": "flashinfer.cascade"}
SIGNATURES = {
    f"{DECODE}.__init__": "(self, float_workspace_buffer: torch.Tensor, kv_layout: str = 'NHD', use_cuda_graph: bool = False, use_tensor_cores: bool = False)",
    f"{DECODE}.plan": "(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *deprecated_positional_args: Any, **kwargs: Any) -> None",
    f"{DECODE}.run": "(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, return_lse: bool = False)",
    f"{PAGED}.plan": "(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None, packed_custom_mask=None, causal: bool = False, sm_scale=None, window_left: int = -1, logits_soft_cap=None)",
    f"{PAGED}.run": "(self, q: torch.Tensor, paged_kv_cache, *args, return_lse: bool = False)",
    f"{RAGGED}.plan": "(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: Optional[int] = None, custom_mask=None, packed_custom_mask=None, causal: bool = False)",
    f"{RAGGED}.run": "(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, return_lse: bool = False)",
    "merge_state": "(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]",
}


class Obj:
    """A wrapper object as the dump records `self`: its class name and id."""

    def __init__(self, cls: str, ident: int):
        self.cls, self.ident = cls, ident


def _meta(value: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, Tensor):
        tensors[key] = value
        return {"type": "torch.Tensor", "shape": list(value.shape), "dtype": str(value.dtype), "stride": list(value.stride()), "device": "cuda:0", "tensor_key": key}
    if isinstance(value, torch.dtype):
        return {"type": "torch.dtype", "value": str(value)}
    if isinstance(value, (list, tuple)):
        return {"type": type(value).__name__, "length": len(value), "items": [_meta(v, f"{key}__{i}", tensors) for i, v in enumerate(value)], "truncated": False}
    if isinstance(value, Obj):
        return {"type": value.cls, "repr": f"<flashinfer.{value.cls} object at {value.ident:#x}>"}
    return value


@dataclass
class DumpWriter:
    root: Path
    pid: int = 4242
    line: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    flushes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def log(self) -> Path:
        """FlashInfer's log (FLASHINFER_LOGDEST), beside the dump."""
        return self.root.parent / f"{self.root.name}.log"

    def _append(self, path: Path, record: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def call(self, function: str, args: tuple = (), kwargs: dict | None = None, result: Any = None, *, self_obj: Obj | None = None, capture: bool = False, crash: str | None = None) -> Path:
        """One decorated call: inputs before, outputs after; `capture`: recorded inside a CUDA graph
        (no files). `crash`: the call did not return: its inputs only (api_logging.py dumps them
        before the kernel runs), and, when the fault surfaced at the outputs' synchronize, the line
        FlashInfer logs for it (in `log`)."""
        kwargs = kwargs or {}
        self.counters[function] = self.counters.get(function, 0) + 1
        self.line += 1
        name = f"20261122_101500_{self.line:03d}_pid{self.pid}_{function}_call{self.counters[function]:04d}"
        d = self.root / name
        d.mkdir()
        all_args = ((self_obj,) if self_obj is not None else ()) + tuple(args)
        tensors: dict[str, Tensor] = {}
        meta: dict[str, Any] = {}
        for i, a in enumerate(all_args):
            if isinstance(a, Tensor):
                tensors[f"arg_{i}"] = a
            else:
                meta[f"arg_{i}"] = _meta(a, f"arg_{i}", tensors)
        for k, v in kwargs.items():
            if isinstance(v, Tensor):
                tensors[f"kwarg_{k}"] = v
            else:
                meta[f"kwarg_{k}"] = _meta(v, f"kwarg_{k}", tensors)
        record: dict[str, Any] = {
            "function_name": function, "module": MODULES[function.split(".")[0]], "call_sequence": self.counters[function], "timestamp": "20261122_101500_000",
            "process_id": self.pid, "input_metadata": meta, "output_metadata": {}, "tensor_info": {"input_tensor_keys": list(tensors), "output_tensor_keys": []},
            "tensor_details": {}, "tensor_format": "torch", "function_signature": SIGNATURES.get(function, "(self, *args, **kwargs)"),
            "versions": {"torch": torch.__version__, "python": "3.12", "flashinfer": "0.7.2.post1"},
            "execution_status": "graph_capture_pending_flush" if capture else "inputs_saved", "graph_capture": capture, "dump_dir": f"/remote/dumps/{name}",
        }  # fmt: skip
        if self_obj is not None:
            record["self_id"] = self_obj.ident
        if not capture:
            torch.save(tensors, d / "inputs.pt")
        self._append(d / "metadata.jsonl", record)
        self._append(self.root / "session.jsonl", record)
        if crash is not None:
            if crash:
                with open(self.log, "a") as f:
                    f.write(f"Failed to dump outputs to /remote/dumps/{name}: {crash}\nTraceback (most recent call last):\n  ...\n")
            return d
        outputs = {"result": result} if isinstance(result, Tensor) else {f"result_{i}": r for i, r in enumerate(result)} if isinstance(result, tuple) else {}
        if outputs and not capture:
            torch.save(outputs, d / "outputs.pt")
        done = dict(record, execution_status="graph_capture_pending_flush" if capture else "completed")
        done["tensor_info"] = dict(record["tensor_info"], output_tensor_keys=list(outputs))
        self._append(d / "metadata.jsonl", done)
        self._append(self.root / "session.jsonl", done)
        if capture:
            self._pending = getattr(self, "_pending", {})
            self._pending[name] = (tensors, outputs, done)
        return d

    def flush(self, name: str, tensors: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """One graph replay's flush of the captured call `name` with the tensors' values now."""
        k = self.flushes[name] = self.flushes.get(name, 0) + 1
        base = self.root / name
        snap = base / "graph_flushes" / f"flush_{k:04d}"
        snap.mkdir(parents=True)
        record = self._pending[name][2]
        for kind, data, status in (("inputs", tensors, "inputs_saved"), ("outputs", outputs, "completed")):
            torch.save(data, base / f"{kind}.pt")
            torch.save(data, snap / f"{kind}.pt")
            last = dict(record, execution_status=status, graph_capture_flushed=True, graph_capture_flush_index=k, graph_capture_snapshot_dir=f"/remote/dumps/{name}/graph_flushes/flush_{k:04d}")
            self._append(base / "metadata.jsonl", last)
            self._append(self.root / "session.jsonl", last)
            snapshot = dict(last, dump_dir=last["graph_capture_snapshot_dir"], graph_capture_base_dump_dir=f"/remote/dumps/{name}")
            self._append(snap / "metadata.jsonl", snapshot)
            self._append(self.root / "session.jsonl", snapshot)


# --- the float64 reference the fixtures' "recorded" outputs come from ---------------------------


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D], k/v [kv, Hkv, D], visible [n, kv] -> output [n, Hq, Dv] (float64), LSE base 2 [n, Hq]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,khd->hnk", q.double(), kk) * scale
    logits = logits.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # [H, n]
    out = torch.einsum("hnk,khd->nhd", torch.softmax(logits, dim=-1), vv)
    return out, (lse / math.log(2)).T.contiguous()


def causal(n: int, kv: int) -> Tensor:
    return torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]


def paged_batch(kv_lens: list[int], page_size: int, heads: int, dim: int, *, dtype=torch.float16, seed: int = 0, spare_pages: int = 2) -> dict[str, Any]:
    """A paged KV pool holding the requests' keys in shuffled pages: the plan's CSR arrays and the pool."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // page_size) for n in kv_lens]
    total = sum(counts) + spare_pages
    order = torch.randperm(total, generator=g)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    k = torch.randn(total, page_size, heads, dim, generator=g).to(dtype)
    v = torch.randn(total, page_size, heads, dim, generator=g).to(dtype)
    rows = []
    for b, n in enumerate(kv_lens):
        pages = order[indptr[b] : indptr[b + 1]].long()
        rows.append((pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n])
    return {"indptr": indptr, "indices": order, "last": last, "k": k, "v": v, "rows": rows}


def gather(pool: Tensor, rows: Tensor) -> Tensor:
    return pool.reshape(-1, *pool.shape[2:])[rows]


# --- the scenarios ---------------------------------------------------------------------------

HQ, HKV, DIM, PAGE = 4, 2, 64, 4
SCALE = 1 / math.sqrt(DIM)
F16 = torch.float16


def _q(n: int, seed: int) -> Tensor:
    return torch.randn(n, HQ, DIM, generator=torch.Generator().manual_seed(seed)).to(F16)


def _run_outputs(q: Tensor, b: dict, q_lens: list[int], visible: list[Tensor]) -> tuple[Tensor, Tensor]:
    outs, lses, start = [], [], 0
    for r, n in enumerate(q_lens):
        o, s = attend(q[start : start + n], gather(b["k"], b["rows"][r]), gather(b["v"], b["rows"][r]), visible[r], SCALE)
        outs.append(o)
        lses.append(s)
        start += n
    return torch.cat(outs).to(F16), torch.cat(lses).float()


def write_decode(
    w: DumpWriter, *, ident: int = 0x1000, kv_lens=(5, 9, 1), seed: int = 1, explicit: bool = True, last_page_mod: bool = False, crash: str | None = None, layers: int = 2
) -> None:
    """Decode wrapper: __init__, plan (positional, as SGLang passes it), `layers` runs returning the LSE.
    `last_page_mod`: the engine's mistake of computing last_page_len as seq_len % page_size (0 for a
    full last page); the runs' outputs are then over what FlashInfer reads of each request,
    (pages - 1) * page + last_page_len keys. `crash`: each run crashes with this logged error."""
    b = paged_batch(list(kv_lens), PAGE, HKV, DIM, seed=seed)
    read = list(kv_lens)
    if last_page_mod:
        b["last"] = torch.tensor([n % PAGE for n in kv_lens], dtype=torch.int32)
        read = [(-(-n // PAGE) - 1) * PAGE + n % PAGE for n in kv_lens]
    me = Obj(DECODE, ident)
    w.call(f"{DECODE}.__init__", (torch.zeros(8, dtype=torch.uint8), "NHD"), {"use_tensor_cores": False}, self_obj=me)
    extra = {"window_left": -1, "logits_soft_cap": 0.0, "sm_scale": SCALE} if explicit else {}
    w.call(f"{DECODE}.plan", (b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), {"data_type": F16, "q_data_type": F16, **extra}, self_obj=me)
    for layer in range(layers):
        q = _q(len(kv_lens), seed * 10 + layer)
        visible = [torch.arange(n)[None, :] < r for n, r in zip(kv_lens, read)]
        out = None if crash is not None else _run_outputs(q, b, [1] * len(kv_lens), visible)
        w.call(f"{DECODE}.run", (q, (b["k"], b["v"])), {"return_lse": True}, out, self_obj=me, crash=crash)


def write_paged_extend(w: DumpWriter, *, ident: int = 0x2000, seed: int = 2, explicit: bool = True) -> None:
    """Paged prefill, causal over a cached prefix (SGLang's paged-only extend). `explicit`: the
    plan passes sm_scale, window_left and logits_soft_cap (else FlashInfer's defaults apply)."""
    kv_lens, q_lens = [7, 12], [3, 5]
    b = paged_batch(kv_lens, PAGE, HKV, DIM, seed=seed)
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    me = Obj(PAGED, ident)
    extra = {"sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0} if explicit else {}
    w.call(f"{PAGED}.plan", (qo, b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), {"causal": True, **extra}, self_obj=me)
    q = _q(8, seed)
    out = _run_outputs(q, b, q_lens, [causal(n, kv) for n, kv in zip(q_lens, kv_lens)])
    w.call(f"{PAGED}.run", (q, (b["k"], b["v"])), {"return_lse": True}, out, self_obj=me)


def tree_visible(parents: list[int], prefix: int) -> Tensor:
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return torch.cat([torch.ones(n, prefix, dtype=torch.bool), anc], dim=1)


def write_verify(w: DumpWriter, *, ident: int = 0x3000, seed: int = 3, parents=((-1, 0, 0, 1), (-1, 0, 1, 1)), packed: bool = False) -> None:
    """Paged prefill with a custom (tree) mask: an EAGLE verify, n = 4 drafts per request."""
    n = len(parents[0])
    prefixes = [6, 10]
    kv_lens = [p + n for p in prefixes]
    b = paged_batch(kv_lens, PAGE, HKV, DIM, seed=seed)
    qo = torch.arange(0, (len(kv_lens) + 1) * n, n, dtype=torch.int32)
    masks = [tree_visible(list(p), pre) for p, pre in zip(parents, prefixes)]
    flat = torch.cat([m.flatten() for m in masks])
    me = Obj(PAGED, ident)
    mask_arg = {"custom_mask": flat}
    if packed:
        blocks = [m.flatten() for m in masks]
        mask_arg = {"packed_custom_mask": torch.cat([_pack(bk) for bk in blocks])}
    w.call(f"{PAGED}.plan", (qo, b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), {**mask_arg, "causal": False, "sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0}, self_obj=me)
    q = _q(n * len(kv_lens), seed)
    out = _run_outputs(q, b, [n] * len(kv_lens), masks)
    w.call(f"{PAGED}.run", (q, (b["k"], b["v"])), {"return_lse": True}, out, self_obj=me)


# FlashInfer #3176's shape: one request verifying 10 tokens over a prefix of 10 (q_len 10, kv_len 20).
MASK_TREE = (-1, 0, 0, 1, 1, 2, 3, 3, 4, 6)
MASK_PREFIX = 10


def write_mask_shape(w: DumpWriter, *, ident: int = 0x3100, seed: int = 31, columns: int = 20, packed: bool = False) -> None:
    """A paged prefill planned with a custom mask of `columns` columns per query row for q_len 10,
    kv_len 20 (flattened, or packed as segment_packbits packs it): 20 is the right mask (the tree
    over the whole row), 15 the mask of FlashInfer #3176, built for a prefix of 5. plan() before
    the fix packed it unchecked; the run's output is what the kernel computes reading each row's 20
    bits at offset row x 20 of the flat mask, bits past its end read as 0 (what lay there)."""
    n, kv = len(MASK_TREE), MASK_PREFIX + len(MASK_TREE)
    b = paged_batch([kv], PAGE, HKV, DIM, seed=seed)
    qo = torch.tensor([0, n], dtype=torch.int32)
    given = tree_visible(list(MASK_TREE), columns - n).flatten()
    read = torch.zeros(n * kv, dtype=torch.bool)
    read[: min(given.numel(), read.numel())] = given[: read.numel()]
    mask_arg = {"packed_custom_mask": _pack(given)} if packed else {"custom_mask": given}
    me = Obj(PAGED, ident)
    w.call(f"{PAGED}.plan", (qo, b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), {**mask_arg, "causal": False, "sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0}, self_obj=me)
    q = _q(n, seed)
    out = _run_outputs(q, b, [n], [read.view(n, kv)])
    w.call(f"{PAGED}.run", (q, (b["k"], b["v"])), {"return_lse": True}, out, self_obj=me)


def _pack(bits: Tensor) -> Tensor:
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (padded.long() << torch.arange(8)).sum(1).to(torch.uint8)


def write_ragged(w: DumpWriter, *, ident: int = 0x4000, seed: int = 4) -> None:
    """Ragged prefill of new prompts (no prefix), causal."""
    lens = [5, 3]
    g = torch.Generator().manual_seed(seed)
    qo = torch.tensor([0, 5, 8], dtype=torch.int32)
    k, v = (torch.randn(8, HKV, DIM, generator=g).to(F16) for _ in range(2))
    q = _q(8, seed)
    me = Obj(RAGGED, ident)
    w.call(f"{RAGGED}.plan", (qo, qo.clone(), HQ, HKV, DIM), {"causal": True, "sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0}, self_obj=me)
    outs, lses, start = [], [], 0
    for n in lens:
        o, s = attend(q[start : start + n], k[start : start + n], v[start : start + n], causal(n, n), SCALE)
        outs.append(o)
        lses.append(s)
        start += n
    w.call(f"{RAGGED}.run", (q, k, v), {"return_lse": True}, (torch.cat(outs).to(F16), torch.cat(lses).float()), self_obj=me)


def write_cascade(w: DumpWriter, *, ident: int = 0x5000, seed: int = 5) -> None:
    """SGLang's cached extend: ragged (new tokens, causal) + paged (prefix, non-causal) + merge_state."""
    prefixes, lens = [6, 9], [3, 2]
    b = paged_batch(prefixes, PAGE, HKV, DIM, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    total = sum(lens)
    qo = torch.tensor([0, 3, 5], dtype=torch.int32)
    k, v = (torch.randn(total, HKV, DIM, generator=g).to(F16) for _ in range(2))
    q = _q(total, seed)
    rag, pag = Obj(RAGGED, ident), Obj(PAGED, ident + 1)
    w.call(f"{RAGGED}.plan", (qo, qo.clone(), HQ, HKV, DIM), {"causal": True, "sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0}, self_obj=rag)
    w.call(f"{PAGED}.plan", (qo, b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), {"causal": False, "sm_scale": SCALE, "window_left": -1, "logits_soft_cap": 0.0}, self_obj=pag)
    o1, s1, o2, s2, om, sm, start = [], [], [], [], [], [], 0
    for r, n in enumerate(lens):
        qr = q[start : start + n]
        kp, vp = gather(b["k"], b["rows"][r]), gather(b["v"], b["rows"][r])
        kn, vn = k[start : start + n], v[start : start + n]
        a = attend(qr, kn, vn, causal(n, n), SCALE)
        p = attend(qr, kp, vp, torch.ones(n, prefixes[r], dtype=torch.bool), SCALE)
        m = attend(qr, torch.cat([kp, kn]), torch.cat([vp, vn]), causal(n, prefixes[r] + n), SCALE)
        for lst, val in ((o1, a[0]), (s1, a[1]), (o2, p[0]), (s2, p[1]), (om, m[0]), (sm, m[1])):
            lst.append(val)
        start += n
    ragged_out = (torch.cat(o1).to(F16), torch.cat(s1).float())
    paged_out = (torch.cat(o2).to(F16), torch.cat(s2).float())
    w.call(f"{RAGGED}.run", (q, k, v), {"return_lse": True}, ragged_out, self_obj=rag)
    w.call(f"{PAGED}.run", (q, (b["k"], b["v"])), {"return_lse": True}, paged_out, self_obj=pag)
    w.call("merge_state", (*ragged_out, *paged_out), {}, (torch.cat(om).to(F16), torch.cat(sm).float()))


def write_graph_decode(w: DumpWriter, *, ident: int = 0x6000, seed: int = 6, replays: int = 2, last_page_mod: bool = False) -> None:
    """A decode run captured in a CUDA graph and replayed: plan before each replay, one flush each.
    `last_page_mod`: each replay's plan computes last_page_len as seq_len % page_size (the second
    replay's request 1 fills its last page: 0), its output over the keys FlashInfer then reads."""
    me = Obj(DECODE, ident)
    w.call(f"{DECODE}.__init__", (torch.zeros(8, dtype=torch.uint8), "NHD", True), {"use_tensor_cores": True}, self_obj=me)
    kv_lens = [4, 6]
    b = paged_batch(kv_lens, PAGE, HKV, DIM, seed=seed)
    extra = {"window_left": -1, "logits_soft_cap": 0.0, "sm_scale": SCALE}
    w.call(f"{DECODE}.plan", (b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), extra, self_obj=me)
    name = w.call(f"{DECODE}.run", (_q(2, 0), (b["k"], b["v"])), {"return_lse": True}, None, self_obj=me, capture=True).name
    for r in range(replays):
        kv_lens = [4 + r + 1, 6 + r + 1]
        b = paged_batch(kv_lens, PAGE, HKV, DIM, seed=seed + r + 1)
        read = list(kv_lens)
        if last_page_mod:
            b["last"] = torch.tensor([n % PAGE for n in kv_lens], dtype=torch.int32)
            read = [(-(-n // PAGE) - 1) * PAGE + n % PAGE for n in kv_lens]
        w.call(f"{DECODE}.plan", (b["indptr"], b["indices"], b["last"], HQ, HKV, DIM, PAGE), extra, self_obj=me)
        q = _q(2, seed + 50 + r)
        out = _run_outputs(q, b, [1, 1], [torch.arange(n)[None, :] < k for n, k in zip(kv_lens, read)])
        w.flush(name, {"arg_1": q, "arg_2__0": b["k"], "arg_2__1": b["v"]}, {"result_0": out[0], "result_1": out[1]})


def write_mla(w: DumpWriter, *, ident: int = 0x7000, seed: int = 7, heads: int = 2, ckv: int = 64, kpe: int = 16, page: int = 1) -> None:
    """FlashInfer's MLA wrapper, decode, keyword arguments (0.7.2 warns on positional ones)."""
    kv_lens = [5, 3]
    g = torch.Generator().manual_seed(seed)
    pages = sum(kv_lens) + 2
    ckv_cache = torch.randn(pages, page, ckv, generator=g).to(F16)
    kpe_cache = torch.randn(pages, page, kpe, generator=g).to(F16)
    order = torch.randperm(pages, generator=g)[: sum(kv_lens)].to(torch.int32)
    indptr = torch.tensor([0, 5, 8], dtype=torch.int32)
    q_nope, q_pe = torch.randn(2, heads, ckv, generator=g).to(F16), torch.randn(2, heads, kpe, generator=g).to(F16)
    scale = 1 / math.sqrt(ckv + kpe)
    me = Obj(MLA, ident)
    plan = {"qo_indptr": torch.tensor([0, 1, 2], dtype=torch.int32), "kv_indptr": indptr, "kv_indices": order, "kv_len_arr": torch.tensor(kv_lens, dtype=torch.int32),
            "num_heads": heads, "head_dim_ckv": ckv, "head_dim_kpe": kpe, "page_size": page, "causal": False, "sm_scale": scale, "q_data_type": F16, "kv_data_type": F16}  # fmt: skip
    w.call(f"{MLA}.plan", (), plan, self_obj=me)
    outs, lses = [], []
    for r in range(2):
        rows = order[indptr[r] : indptr[r + 1]].long()
        keys = torch.cat([ckv_cache.reshape(-1, ckv)[rows], kpe_cache.reshape(-1, kpe)[rows]], dim=-1)[:, None]
        q = torch.cat([q_nope[r : r + 1], q_pe[r : r + 1]], dim=-1)
        o, s = attend(q, keys, keys[..., :ckv], torch.ones(1, kv_lens[r], dtype=torch.bool), scale)
        outs.append(o)
        lses.append(s)
    w.call(f"{MLA}.run", (), {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache, "return_lse": True}, (torch.cat(outs).to(F16), torch.cat(lses).float()), self_obj=me)


def write_all(root: Path) -> DumpWriter:
    w = DumpWriter(root)
    write_decode(w)
    write_paged_extend(w)
    write_verify(w)
    write_ragged(w)
    write_cascade(w)
    write_graph_decode(w)
    return w
