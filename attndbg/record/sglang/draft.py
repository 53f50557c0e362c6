"""SGLang's draft decode: the steps of a multi-step draft backend, one branch row per request and
top-k branch.

EAGLE's draft model runs `speculative_num_steps` decode steps before each verify; the multi-step
draft backends (`TritonMultiStepDraftBackend`, `FlashInferMultiStepDraftBackend`, ...) plan every
step up front through a sub-backend per step, handing it the step's `spec_info.kv_indptr` /
`kv_indices` (`generate_draft_decode_kv_indices`, kernels/ops/speculative/cache_locs.py in SGLang
0.5.23). Those lists have a row per request and branch (`bs * topk` rows, request-major): at step
i, branch t of request b reads the request's committed prefix (`seq_lens[b]` columns of its
req_to_token row) and then its own i + 1 draft tokens, which sit at columns
`seq_lens[b] + t * columns + 0..i` (`assign_draft_cache_locs`: each branch owns `columns` slots
after the prefix, `columns` = the draft window, `out_cache_loc` laid out [bs, topk, columns]).

So a draft step is a decode of `bs * topk` branch rows, each of its own KV length, and its
ForwardBatch keeps the request-level facts: `seq_lens` the committed prefixes (the draft tokens are
added by the backend, like a verify's), `positions` one per branch row. The backend plans all steps
before the first runs, so at plan time `positions` are step 0's; the worker advances them by one
after each step (eagle_worker_v2 `draft_forward`, `positions.add_(1)`, sglang#25015): step i
runs at the planned positions + i.

Under CUDA graphs (EAGLEDraftCudaGraphRunner) the runner pads the request-level buffers to the
captured bs and the multi-step backend refills its graph buffers for every step
(`init_forward_metadata_out_graph`); a step's graph kernels run `bs * topk` branch rows, so its
graph section is recorded in branch rows too (`branch_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record.sglang.graph import GraphInfo


class DraftStepUnknown(ValueError):
    """A draft decode step whose step index the backend does not reveal: not recorded (its branch
    rows cannot be told)."""


@dataclass(frozen=True)
class DraftDecode:
    """What makes a draft decode step's batch: branch rows per request, the step, the window."""

    topk: int  # branch rows per request
    step: int  # 0-based: each branch row reads step + 1 draft tokens after its prefix
    columns: int  # req_to_token columns each branch owns after the prefix (out_cache_loc is [bs, topk, columns])


def draft_step(backend: Any) -> int | None:
    """The draft step a sub-backend of a multi-step draft backend plans. FA3 names it
    (`speculative_step_id`); Triton's and FlashInfer's sub-backend i holds row i of the multi-step
    backend's [num_steps, rows] kv_indptr buffer (`kv_indptr_buf=self.kv_indptr[i]`; FlashInfer keeps
    it in a list), so the row is the step."""
    step = getattr(backend, "speculative_step_id", None)
    if isinstance(step, int) and not isinstance(step, bool) and step > 0:
        return step
    buffer = getattr(backend, "kv_indptr", None)
    if isinstance(buffer, list) and buffer:
        buffer = buffer[0]
    base = buffer._base if isinstance(buffer, Tensor) else None
    if isinstance(base, Tensor) and base.dim() == 2 and buffer.dim() == 1 and base.stride(0) > 0:
        return (buffer.storage_offset() - base.storage_offset()) // base.stride(0)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def draft_topk(spec_info: Any) -> int | None:
    """Branch rows per request of a draft decode's spec input (spec v2: `num_tokens_per_req`, else
    `topk`); None when it names none."""
    for name in ("num_tokens_per_req", "topk"):
        topk = getattr(spec_info, name, None)
        if isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1:
            return topk
    return None


def draft_decode(fb: Any, backend: Any, batch_size: int) -> DraftDecode | None:
    """The draft decode facts of a DECODE ForwardBatch planned by a multi-step draft backend (its
    spec input carries the step's kv_indices), None for any other decode; raises DraftStepUnknown
    when the step cannot be told. Host facts only: the spec input's ints and out_cache_loc's size."""
    spec_info = getattr(fb, "spec_info", None)
    if spec_info is None or getattr(spec_info, "kv_indices", None) is None:
        return None
    topk = draft_topk(spec_info)
    if topk is None:
        raise DraftStepUnknown("a draft decode step whose spec input names no topk (num_tokens_per_req)")
    step = draft_step(backend)
    if step is None:
        raise DraftStepUnknown(f"{type(backend).__name__} does not reveal which draft step it plans")
    columns = fb.out_cache_loc.numel() // max(batch_size * topk, 1)
    if columns <= step:
        raise DraftStepUnknown(f"draft step {step} of a window of {columns} columns (out_cache_loc has {fb.out_cache_loc.numel()} slots for {batch_size} x {topk} branches)")
    return DraftDecode(topk=topk, step=step, columns=columns)


def branch_parts(draft: DraftDecode, *, seq_lens: Tensor, rows: Tensor, out_cache_loc: Tensor, positions: Tensor | None) -> dict[str, Any]:
    """batch_from_rows' arguments of a draft step, from host copies of the request-level tensors:
    one decode row per (request, branch), request-major (the order of the backend's kv_indptr)."""
    k, i = draft.topk, draft.step
    if positions is None or positions.numel() < seq_lens.numel() * k:
        raise ValueError(f"a draft decode step needs a position per branch row ({seq_lens.numel()} x {k}); the ForwardBatch has {None if positions is None else positions.numel()}")
    branch_rows = []
    for b, prefix in enumerate(seq_lens.tolist()):
        for t in range(k):
            start = prefix + t * draft.columns
            branch_rows.append(torch.cat([rows[b, :prefix], rows[b, start : start + i + 1]]).to(torch.int64))
    prefix_lens = seq_lens.to(torch.int64).repeat_interleave(k) + i
    return {
        "prefix_lens": prefix_lens,
        "extend_lens": torch.ones_like(prefix_lens),
        "rows": branch_rows,
        # the slot each branch writes at this step: out_cache_loc[b, t, i]
        "out_cache_loc": out_cache_loc.reshape(-1, k, draft.columns)[:, :, i].reshape(-1),
        "positions": positions[: prefix_lens.numel()] + i,
        "seq_lens_raw": seq_lens.repeat_interleave(k),
    }


def branch_graph(info: GraphInfo, tensors: dict[str, Tensor], draft: DraftDecode) -> tuple[GraphInfo, dict[str, Tensor]]:
    """A draft step's graph padding in the branch rows its kernels run (request-major, like the
    batch): each padded request's seq_len and pool row once per branch, the slot each branch writes
    at this step (out_cache_loc[b, t, step]); positions as the buffer holds them at plan time (step
    0's, one per branch row: the graph advances them as it runs). Device ops only."""
    k = draft.topk
    rows = info.capture_bs * k
    host = info.host_seq_lens
    return (
        GraphInfo(
            capture_bs=rows,
            raw_bs=info.raw_bs * k,
            fill_value=info.fill_value,
            host_seq_lens=tuple(n for n in host for _ in range(k)) if host is not None else None,
            capture=info.capture,
        ),
        {
            "padded_seq_lens": tensors["padded_seq_lens"].repeat_interleave(k),
            "padded_req_pool_indices": tensors["padded_req_pool_indices"].repeat_interleave(k),
            "padded_out_cache_loc": tensors["padded_out_cache_loc"][: rows * draft.columns].reshape(-1, k, draft.columns)[:, :, draft.step].reshape(-1),
            "padded_positions": tensors["padded_positions"][:rows],
        },
    )
