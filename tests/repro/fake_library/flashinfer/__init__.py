"""A stand-in for FlashInfer's paged attention wrappers, in plain torch, for CPU tests of repro
scripts: the same plan()/run() signatures the adapters call (decode, paged prefill positional and
keyword forms, use_cuda_graph buffers ignored), the same semantics (pages of `page_size` rows,
bottom-right causal alignment, custom masks as [q_len, kv_len] bool blocks, window_left, soft-cap,
LSE in base 2). It lets a generated script run end to end without a GPU; it is not FlashInfer."""

from __future__ import annotations

import math

import torch

__version__ = "fake (tests/repro/fake_library)"

_DECODE = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")
_PREFILL = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size")


def hand_back(o, s, *, out, lse, return_lse):
    """What run() returns: the output (and base-2 LSE), written into `out`/`lse` when given."""
    if out is not None:
        out.copy_(o.to(out.device))
        o = out
    if lse is not None:
        lse.copy_(s.to(lse.device))
        s = lse
    return (o, s) if return_lse else o


class _Paged:
    names: tuple[str, ...] = _PREFILL

    def __init__(self, workspace, layout="NHD", **options):
        self.options = options

    def plan(self, *args, **kwargs):
        p = dict(zip(self.names, args), **kwargs)
        if "indptr" in p:  # decode: one query row per request
            p["paged_kv_indptr"], p["paged_kv_indices"], p["paged_kv_last_page_len"] = p.pop("indptr"), p.pop("indices"), p.pop("last_page_len")
            p["qo_indptr"] = torch.arange(p["paged_kv_indptr"].numel())
            p["head_dim_qk"] = p.pop("head_dim")
        self.p = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}

    def run(self, q, paged_kv, out=None, lse=None, return_lse=False):
        p = self.p
        k_pages, v_pages = paged_kv
        page = p["page_size"]
        group = p["num_qo_heads"] // p["num_kv_heads"]
        scale = p.get("sm_scale") or 1 / math.sqrt(p["head_dim_qk"])
        cap, window = p.get("logits_soft_cap") or 0.0, p.get("window_left", -1)
        qo, kv, ids, last = (p[n].to(torch.int64) for n in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        mask = p.get("custom_mask")
        mask_at = 0
        o = torch.zeros(q.shape[0], q.shape[1], v_pages.shape[-1], dtype=q.dtype)
        s = torch.full((q.shape[0], q.shape[1]), float("-inf"))
        for b in range(qo.numel() - 1):
            pages = ids[kv[b] : kv[b + 1]]
            kv_len = max(int(pages.numel() - 1) * page + int(last[b]), 0) if pages.numel() else 0
            keys = k_pages.cpu()[pages].reshape(-1, *k_pages.shape[2:])[:kv_len].double().repeat_interleave(group, 1)
            values = v_pages.cpu()[pages].reshape(-1, *v_pages.shape[2:])[:kv_len].double().repeat_interleave(group, 1)
            rows = range(int(qo[b]), int(qo[b + 1]))
            q_len = len(rows)
            block = None
            if mask is not None:
                block = mask.cpu().flatten()[mask_at : mask_at + q_len * kv_len].reshape(q_len, kv_len).bool()
                mask_at += q_len * kv_len
            for i, t in enumerate(rows):
                logits = torch.einsum("hd,nhd->hn", q[t].cpu().double(), keys) * scale
                if cap > 0:
                    logits = cap * torch.tanh(logits / cap)
                last_col = kv_len - q_len + i
                cols = torch.arange(kv_len)
                seen = torch.ones(kv_len, dtype=torch.bool)
                if block is not None:
                    seen &= block[i]
                elif p.get("causal"):
                    seen &= cols <= last_col
                if window is not None and window >= 0:
                    seen &= cols >= last_col - window
                if not bool(seen.any()):
                    continue
                logits = logits.masked_fill(~seen, float("-inf"))
                s[t] = torch.logsumexp(logits, -1).float() / math.log(2.0)
                o[t] = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), values).to(q.dtype)
        return hand_back(o, s, out=out, lse=lse, return_lse=return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    names = _PREFILL


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    names = _DECODE


from flashinfer import mla  # noqa: E402,F401  (an attribute, as FlashInfer's own __init__ makes it)
