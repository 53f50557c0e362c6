"""`toy`: a test adapter, written as a third party writes one, that `test_toy_backend.py` registers
with one line (ATTNDBG_BACKENDS="toy=tests.backends.toy_backend:ToyBackend").

It imitates no kernel: it runs OUR Triton split-KV decode kernels (backends/triton_kernels/decode.py),
decode steps only. What makes it an adapter of its own is its plan, in its own vocabulary, a block
table as vLLM's paged attention takes it:

    block_table  [bs, max_blocks] int32: each request's blocks of `page_size` tokens (the model's)
    seq_lens     [bs] int32: the tokens each request reads

which `run` translates, in one place, into what the decode launch reads (slot ids over kv_indptr /
kv_indices, split counts) and launches through the triton adapter's `run`. The engine backend it stands for is "toy_attn": a trace whose `source.backend` carries
that name was recorded by the toy engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends import plan_declaration as pd
from attndbg.backends import plan_layout as pl
from attndbg.backends import plan_view as pv
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, FillRequirement, Padding
from attndbg.backends.capabilities import Capabilities
from attndbg.backends.tables import build_page_table, padded_requests
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import Q_DTYPES, AttentionKind, ForwardMode, Plan, Trace, indptr

ENGINE_NAME = "toy_attn"
# Every request's KV in two splits, so stage 2's merge runs on every row.
NUM_KV_SPLITS = 2


class ToyBackend(Backend):
    name = "toy"
    fill_requirement = FillRequirement(
        1, "the toy runs our Triton decode, whose stage 2 divides by the merged exp-sum, 0 for a request with no KV (0/0 = NaN)"
    )
    engine_names = {ENGINE_NAME: None}

    def __init__(self) -> None:
        self._triton = TritonBackend()  # says whether, where and how our kernels run here

    def unavailable_reason(self) -> str | None:
        return self._triton.unavailable_reason()

    def describe(self) -> str:
        return f"toy block-table adapter over {self._triton.describe()}"

    def device(self) -> str:
        return self._triton.device()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            kernels="the toy's Triton decode kernels",
            modes={AttentionKind.MHA: frozenset({ForwardMode.DECODE})},
            q_dtypes=frozenset(Q_DTYPES),
            kv_dtypes=frozenset(Q_DTYPES),
            tree_mask=False,  # decode only: no mask of any kind, and no window (the decode kernel has none)
            column_mask=False,
            sliding_window=False,
            why={"modes": "a test adapter: decode is all it launches"},
        )

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        rows, _ = padded_requests(trace, padding)  # slot ids per request, padded ones at the dummy slot
        return Plan(
            backend=self.name,
            tensors={
                "block_table": build_page_table(rows, trace.model.page_size),
                "seq_lens": torch.tensor([r.numel() for r in rows], dtype=torch.int32),
            },
            scalars={},
        )

    def plan_declaration(self, trace: Trace, plan: Plan) -> pd.PlanDeclaration:
        """The whole plan, once: row b of block_table is read up to seq_lens[b] tokens, in blocks of
        the model's page size (the plan carries none), each a block of the KV cache; decode only,
        so every row is read whole and no mask or window exists. Both tensors have a row per request."""
        return pd.PlanDeclaration(
            call=pd.Call(pl.KvIds.TABLE, ids="block_table", count="seq_lens", length="seq_lens", page_size=None),
            ends=(pl.KvEnd.KV,),
            mask=pl.MaskReading.CAUSAL,
            window="sliding_window",  # no such scalar: the toy runs no window (capabilities)
            rows=(pv.RequestRows(1, ("block_table", "seq_lens")),),
        )

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        """Our split-KV decode kernels, launched through the triton adapter with the toy's plan in
        SGLang's words: its slot ids, and NUM_KV_SPLITS splits for every request."""
        kv_indptr, kv_indices = slot_ids(plan.tensors["block_table"], plan.tensors["seq_lens"], trace.model.page_size)
        launch = Plan(
            backend=TritonBackend.name,
            tensors={"kv_indptr": kv_indptr, "kv_indices": kv_indices, "num_kv_splits": torch.full((kv_indptr.numel() - 1,), NUM_KV_SPLITS, dtype=torch.int32)},
            scalars={"max_kv_splits": NUM_KV_SPLITS},
        )
        return self._triton.run(trace, inputs, launch)


def slot_ids(block_table: Tensor, seq_lens: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """The toy's plan -> the decode launch's (kv_indptr [bs+1] int32, kv_indices int64): token j of
    request b is slot block_table[b, j // page_size] * page_size + j % page_size."""
    lens = seq_lens.to(torch.int64)
    rows = [torch.arange(int(n)) for n in lens]
    slots = [block_table[b, j // page_size].to(torch.int64) * page_size + j % page_size for b, j in enumerate(rows)]
    return indptr(lens).to(torch.int32), torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
