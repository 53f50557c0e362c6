"""A stand-in for FlashInfer's BatchMLAPagedAttentionWrapper (0.7.2's canonical form: plan(metadata=
MLAPlanMetadata.csr(...), ...), run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), ...)), in plain torch:
logits from the latent and rope parts, values the latent cache, LSE in base 2. Not FlashInfer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from flashinfer import hand_back


class MLAPlanMetadata:
    @staticmethod
    def csr(**tensors):
        return SimpleNamespace(**tensors)


class BatchMLAPagedAttentionWrapper:
    def __init__(self, workspace, use_cuda_graph=False, backend="auto", **buffers):
        self.backend = backend

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, **layout):
        self.m, self.page, self.causal, self.scale = metadata, page_size, causal, sm_scale

    def run(self, *, query, kv_cache, out=None, lse=None, return_lse=False):
        q_nope, q_pe = (t.cpu().double() for t in query)
        ckv, kpe = (t.cpu().double() for t in kv_cache)
        qo, kv, ids, lens = (getattr(self.m, n).cpu().to(torch.int64) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
        o = torch.zeros(q_nope.shape, dtype=query[0].dtype)
        s = torch.full(q_nope.shape[:2], float("-inf"))
        for b in range(qo.numel() - 1):
            pages = ids[kv[b] : kv[b + 1]]
            n = int(lens[b])
            latent = ckv[pages].reshape(-1, ckv.shape[-1])[:n]
            rope = kpe[pages].reshape(-1, kpe.shape[-1])[:n]
            rows = range(int(qo[b]), int(qo[b + 1]))
            for i, t in enumerate(rows):
                logits = (q_nope[t] @ latent.T + q_pe[t] @ rope.T) * self.scale  # [H, n]
                if self.causal:
                    logits[:, n - len(rows) + i + 1 :] = float("-inf")
                if n == 0:
                    continue
                s[t] = torch.logsumexp(logits, -1).float() / math.log(2.0)
                o[t] = (torch.softmax(logits, -1) @ latent).to(o.dtype)
        return hand_back(o, s, out=out, lse=lse, return_lse=return_lse)
