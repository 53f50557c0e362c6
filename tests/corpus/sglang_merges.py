"""Merges of partial attention states with their LSEs in the wrong base: the engine's recorded
output, not its metadata, carries the mistake.

- sgl-project/sglang#40903 (2026-09): DeepSeek's chunked-prefix prefill merged the prefix and
  new-token partials of FlashInfer's ragged kernels, whose LSEs are base 2, with merge_state_v2,
  which expects natural logs: both LSEs scaled by 1/ln 2, the softmax mass between the two parts
  shifted (11.8 % mean relative error on a 3072 + 64 token split, per the issue).

Encoded on SGLang's FlashInfer cascade path (ragged over the new tokens, paged over the prefix, one
merge): the same two-partial split and merge as the DeepSeek path, whose MLA pool the recorder's
MHA layer tensors do not cover. The step is recorded with its layer (`record --layers 0`): q, the
new K/V, the prefix KV rows and the engine's output. The output is computed in float32 torch the
way the engine's merge computed it (the real kernels need a GPU): each partial exactly, then the
merge with the LSEs as the buggy code fed them; the twin merges them as the fix does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
HEADS, HEAD_DIM, V_DIM = 4, 64, 32  # DeepSeek's MHA prefill is 192 / 128 wide; narrower here for the interpreter
PREFIX, NEW = [96, 40], [4, 3]  # a long cached prefix and a short chunk, as in the issue
ROWS = {2: list(range(1, 1 + PREFIX[0] + NEW[0])), 5: list(range(120, 120 + PREFIX[1] + NEW[1]))}


def _merge(o_a: Tensor, s_a: Tensor, o_b: Tensor, s_b: Tensor) -> Tensor:
    """merge_state_v2: natural-log LSEs (sgl-kernel's merge_state, exp/log base e)."""
    top = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - top), torch.exp(s_b - top)
    return (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b)[..., None]


def _cascade_plan(made: Any, fb: Any) -> None:
    """SGLang FlashInfer's extend with a prefix (use_ragged): the paged wrapper over the prefixes."""
    prefix = fb.extend_prefix_lens.to(I64)
    indptr, indices = sg.kv_lists(made, fb, prefix, size=int(prefix.sum()) + 256, garbage=0)
    paged = sg.wrapper(
        qo_indptr_buf=torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32),
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices.to(I32),
        paged_kv_last_page_len_buf=torch.ones(prefix.numel(), dtype=I32),
    )
    made.forward_metadata = sg.flashinfer_backend.PrefillMetadata(prefill_wrappers=[paged], use_ragged=True, extend_no_prefix=False)


def _engine_output(base_two: bool):
    """forward_extend's cascade: ragged (new tokens, causal) and paged (prefix) partials, merged."""

    def run(q: Tensor, k: Tensor, v: Tensor, layer: Any, fb: Any) -> Tensor:
        k_pool, v_pool = made_pool["k"], made_pool["v"]
        out, start = [], 0
        for b, req in enumerate(fb.req_pool_indices.tolist()):
            p, n = PREFIX[b], NEW[b]
            rows = slice(start, start + n)
            slots = torch.tensor(ROWS[req][:p])
            o_p, s_p = sg.attend(q[rows], k_pool[slots], v_pool[slots], torch.ones(n, p, dtype=torch.bool), layer.scaling)
            o_s, s_s = sg.attend(q[rows], k[rows], v[rows], torch.ones(n, n, dtype=torch.bool).tril(), layer.scaling)
            if base_two:  # FlashInfer's LSEs are base 2; merge_state_v2 reads natural logs
                s_p, s_s = s_p / math.log(2), s_s / math.log(2)
            out.append(_merge(o_p, s_p, o_s, s_s))
            start += n
        return torch.cat(out).to(q.dtype)

    made_pool: dict[str, Tensor] = {}
    return run, made_pool


def _chunked_prefix(out: Path, *, base_two: bool) -> None:
    data = sg.layer_data(40903, tokens=sum(NEW), heads=HEADS, kv_heads=HEADS, head_dim=HEAD_DIM, v_dim=V_DIM)
    with sg.recording(out, layers=(0,)) as session:
        layer = sg.layer(heads=HEADS, kv_heads=HEADS, head_dim=HEAD_DIM, v_head_dim=V_DIM)
        made = sg.backend(sg.CorpusFlashInfer, ROWS, _cascade_plan)
        made.token_to_kv_pool = sg.kv_pool(data["k_pool"], data["v_pool"])
        made.run_layer, pool = _engine_output(base_two)
        pool.update(k=data["k_pool"], v=data["v_pool"])
        made.num_head = HEADS
        fb = sg.extend_batch(ROWS, PREFIX, NEW)
        sg.record_eager(session, made, fb)
        made.forward(data["q"], data["k"], data["v"], layer, fb)


def write_40903(bug: Path, twin: Path) -> None:
    _chunked_prefix(bug, base_two=True)
    _chunked_prefix(twin, base_two=False)


BUGS = (
    RealBug(
        id="sglang-40903",
        title="Chunked-prefix prefill merges base-2 LSEs with a natural-log merge_state_v2",
        links=("https://github.com/sgl-project/sglang/issues/40903", "https://github.com/flashinfer-ai/flashinfer/issues/2113"),
        date="2026-09",
        engine="SGLang flashinfer",
        mode="EXTEND",
        mechanism="the prefix and new-token partials came from FlashInfer kernels whose LSEs are base 2 and were merged by "
        "merge_state_v2, which takes natural logs: both LSEs read 1/ln 2 too large, shifting softmax mass between the parts "
        "(silent accuracy loss on every prefix-cache hit)",
        encoding="2 requests, prefixes 96 and 40 cached, 4 and 3 new tokens; FlashInfer cascade plan; layer 0 recorded "
        "(q, new K/V, prefix rows) with the engine's output merged from base-2 LSEs read as natural logs",
        expected=("split-merge/recorded-output-mismatch", "split-merge/merge-lse-base-confusion"),
        keywords=("lse-base", "base 2", "base-2", "ln 2"),
        capabilities=(Capability.ALREADY, Capability.STRIDE_MODEL),
        write=write_40903,
    ),
)
