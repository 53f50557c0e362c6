"""vLLM v1 `CommonAttentionMetadata` -> attndbg Batch (+ Spec, + Graph): pure host-side functions.

vLLM's vocabulary (engines.md B1, B5), translated here and nowhere else:

    query_start_loc     [rows+1] cumulative query lengths; padded rows repeat the last value
    seq_lens            [rows] KV length *including* this step's tokens (drafts too); 0 for padded rows
    block_table_tensor  [rows, max_blocks] block ids; padded rows hold NULL_BLOCK_ID 0
    slot_mapping        [tokens] block * block_size + offset of each new token; -1 for padded tokens
    positions           [tokens] rope positions (vLLM 0.33+; absent in older versions)
    is_prefilling       [rows] bool (vLLM 0.33+): the request is still in its prompt

Older vLLM ("classic", 0.11) builds the metadata with the unpadded `num_reqs`: padding lives in
the persistent buffers' tails and is invisible here. vLLM 0.33 builds FULL-CUDA-graph steps with
`num_reqs_padded` / `num_tokens_padded`, so padded rows (seq_len 0, query_len 0) and padded tokens
(slot -1) show, real rows first. Such a step is recorded as a graph replay with fill value 0.

Speculative verify: vLLM's draft tokens are ordinary query tokens (seq_lens count them) and a
linear chain attends causally, so any batch with drafts is a correct causal EXTEND/MIXED batch.
When *every* request is a verify request (query_len == 1 + num_speculative_tokens, a cached
prefix, not prefilling), the step is recorded as TARGET_VERIFY with a Spec whose parents are the
chain [-1, 0, 1, ...] (or the token tree of vLLM's tree attention, when given): the same attention,
plus the draft structure the tree-mask detector and replay use. `Spec.custom_mask` stays None:
vLLM builds no bool mask (a chain is causal; tree attention adds a float bias, kept in the plan).

Nothing here touches a device: the hook hands in host copies (`HostCommon`). Tests may pass a
real `CommonAttentionMetadata` on the CPU (`host_common` copies its fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record.build import batch_from_rows, mode_from_lengths
from attndbg.trace.schema import Batch, ForwardMode, Graph, MaskLayout, Spec

VLLM_FILL_VALUE = 0  # seq_len of padded rows (engines.md B5)
PADDED_SLOT = -1  # slot_mapping of padded tokens: vLLM skips their KV write
CHAIN_TOPK = 1


@dataclass(frozen=True)
class HostCommon:
    """Host copies of the `CommonAttentionMetadata` fields a Batch needs, under vLLM's names."""

    query_start_loc: Tensor  # [rows+1]
    seq_lens: Tensor  # [rows]
    block_table_tensor: Tensor  # [rows, >= ceil(max seq_len / block_size)]
    slot_mapping: Tensor  # [num_actual_tokens]
    positions: Tensor | None  # [num_actual_tokens] or None (older vLLM)
    is_prefilling: Tensor | None  # [rows] bool or None (older vLLM)


@dataclass(frozen=True)
class Speculation:
    """What the engine's speculative config says a verify request looks like."""

    method: str  # vLLM's speculative method ("eagle", "ngram", "mtp", ...)
    num_speculative_tokens: int  # drafts per request; a verify request has 1 + this many tokens


@dataclass(frozen=True)
class Converted:
    batch: Batch
    spec: Spec | None
    graph: Graph | None


def device_fields(cm: Any, block_size: int | None = None) -> dict[str, Tensor | None]:
    """The tensors of `cm` to copy to the host, sliced to what the step uses (views: no sync).

    With `block_size`, the block table is cut to the columns `max_seq_len` can reach (an upper
    bound in vLLM 0.33, the exact maximum before): a [max_num_reqs, max_model_len / block_size]
    table would be megabytes per step.
    """
    num_reqs, tokens = int(cm.num_reqs), int(cm.num_actual_tokens)
    table = cm.block_table_tensor[:num_reqs]
    if block_size:
        table = table[:, : used_block_columns(cm.max_seq_len, block_size, table.shape[1])]
    positions = getattr(cm, "positions", None)
    prefilling = getattr(cm, "is_prefilling", None)
    return {
        "query_start_loc": cm.query_start_loc[: num_reqs + 1],
        "seq_lens": cm.seq_lens[:num_reqs],
        "block_table_tensor": table,
        "slot_mapping": cm.slot_mapping[:tokens],
        "positions": positions[:tokens] if positions is not None else None,
        "is_prefilling": prefilling[:num_reqs] if prefilling is not None else None,
    }


def used_block_columns(max_seq_len: int, block_size: int, width: int) -> int:
    """Block-table columns a step can read: ceil(max_seq_len / block_size), at most the width."""
    return min(-(-int(max_seq_len) // int(block_size)), int(width))


def host_common(cm: Any, block_size: int | None = None) -> HostCommon:
    """A `HostCommon` from a real `CommonAttentionMetadata` (or one already on the host).

    This copies device tensors with `.cpu()`, a device sync: tests and offline tools only; the
    recording hook copies asynchronously through the session instead.
    """
    if isinstance(cm, HostCommon):
        return cm
    fields = device_fields(cm, block_size)
    return HostCommon(**{k: (v.detach().cpu().clone() if v is not None else None) for k, v in fields.items()})


def _i64(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.int64).reshape(-1)


def real_rows(seq_lens: Tensor, query_lens: Tensor) -> int:
    """Rows before vLLM's CUDA-graph padding: a padded row has seq_len 0 and query_len 0, and
    padded rows only trail (real requests always have >= 1 token)."""
    pad = (seq_lens == 0) & (query_lens == 0)
    n = int(seq_lens.numel())
    while n > 0 and bool(pad[n - 1]):
        n -= 1
    if bool(pad[:n].any()):
        b = int(torch.nonzero(pad[:n])[0, 0])
        raise ValueError(f"seq_lens[{b}] = 0 with no query tokens before real row {n - 1}: vLLM pads only after the real rows")
    return n


def row_slots(block_row: Tensor, kv_len: int, block_size: int) -> Tensor:
    """Slot of each of a request's columns 0..kv_len-1: block_table[b, col // bs] * bs + col % bs."""
    cols = torch.arange(kv_len, dtype=torch.int64)
    blocks_needed = -(-kv_len // block_size)
    if blocks_needed > block_row.numel():
        raise ValueError(f"a request of {kv_len} KV columns needs {blocks_needed} blocks, the block table row has {block_row.numel()}")
    return block_row[cols // block_size] * block_size + cols % block_size


def chain_parents(num_tokens: int) -> Tensor:
    """[n] parents of a linear draft chain: the root (the verified token) and drafts 1..n-1."""
    return torch.arange(-1, num_tokens - 1, dtype=torch.int64)


def parents_from_tree_bias(bias: Tensor) -> Tensor:
    """[n] parents from vLLM's classic `tree_attn_bias` ([n, n], 0 where a token sees a token).

    Tokens are in level order (vLLM sorts `speculative_token_tree` by depth), so a token's parent
    is its ancestor with the largest index.
    """
    visible = bias.detach().cpu() == 0
    n = int(visible.shape[0])
    parents = torch.full((n,), -1, dtype=torch.int64)
    for i in range(1, n):
        ancestors = torch.nonzero(visible[i, :i]).flatten()
        if ancestors.numel() == 0:
            raise ValueError(f"tree_attn_bias row {i} sees no earlier token: not a draft tree rooted at token 0")
        parents[i] = int(ancestors.max())
    return parents


def _is_verify(extend: Tensor, prefix: Tensor, prefilling: Tensor | None, speculation: Speculation | None) -> bool:
    if speculation is None or speculation.num_speculative_tokens < 1 or extend.numel() == 0:
        return False
    n = speculation.num_speculative_tokens + 1
    if not bool((extend == n).all()) or not bool((prefix > 0).all()):
        return False
    return prefilling is None or not bool(prefilling.any())


def convert_common(
    cm: Any,
    *,
    block_size: int,
    kv_cache_size: int | None = None,
    speculation: Speculation | None = None,
    tree_parents: Tensor | None = None,
) -> Converted:
    """Batch (+ chain/tree Spec for an all-verify step, + Graph when vLLM padded the step).

    `kv_cache_size`: slots in the engine's pool (num_blocks * block_size) when known; the pool
    must at least hold every block the step references, so a smaller or missing value is raised
    to that lower bound.
    """
    host = host_common(cm, block_size)
    qsl, seq = _i64(host.query_start_loc), _i64(host.seq_lens)
    rows = int(seq.numel())
    if qsl.numel() != rows + 1:
        raise ValueError(f"query_start_loc has {qsl.numel()} entries for {rows} seq_lens, expected {rows + 1}")
    query_lens = qsl[1:] - qsl[:-1]
    n = real_rows(seq, query_lens)
    tokens = int(qsl[n])
    extend, kv = query_lens[:n], seq[:n]
    prefix = kv - extend
    if bool((prefix < 0).any()):
        b = int(torch.nonzero(prefix < 0)[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(kv[b])} < query length {int(extend[b])}: vLLM's seq_lens include the step's tokens")
    table = _i64(host.block_table_tensor).reshape(host.block_table_tensor.shape)
    slot_rows = [row_slots(table[b], int(kv[b]), block_size) for b in range(n)]
    slot_mapping = _i64(host.slot_mapping)
    if slot_mapping.numel() < tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries, the real requests have {tokens} tokens")
    token_prefix = torch.repeat_interleave(prefix, extend)
    token_index = torch.arange(tokens, dtype=torch.int64) - torch.repeat_interleave(qsl[:n], extend)
    prefilling = host.is_prefilling[:n].detach().cpu().bool() if host.is_prefilling is not None else None

    spec = None
    if _is_verify(extend, prefix, prefilling, speculation):
        assert speculation is not None
        width = speculation.num_speculative_tokens + 1
        parents = tree_parents if tree_parents is not None and tree_parents.numel() == width else chain_parents(width)
        spec = Spec(
            algorithm=speculation.method,
            draft_token_num=width,
            topk=_widest_fanout(parents),
            steps=width - 1,
            parents=parents.to(torch.int64).expand(n, width).clone(),
            custom_mask=None,
            mask_layout=MaskLayout.QLEN_ONLY,
        )
        mode = ForwardMode.TARGET_VERIFY
        depth = _depths(spec.parents[0])
        derived_positions = token_prefix + depth.repeat(n)
    else:
        mode = mode_from_lengths(extend, prefix)
        derived_positions = token_prefix + token_index
    positions_all = _i64(host.positions) if host.positions is not None else None
    positions = positions_all[:tokens] if positions_all is not None else derived_positions

    lower_bound = _referenced_slots(table[:n], kv, block_size)
    batch = batch_from_rows(
        forward_mode=mode,
        prefix_lens=prefix,
        extend_lens=extend,
        rows=slot_rows,
        out_cache_loc=slot_mapping[:tokens],
        positions=positions,
        seq_lens_raw=kv,
        kv_cache_size=max(int(kv_cache_size or 0), lower_bound),
    )
    graph = None
    if rows > n or slot_mapping.numel() > tokens:
        graph = Graph(
            is_graph_replay=True,
            capture_bs=rows,
            fill_value=VLLM_FILL_VALUE,
            padded_seq_lens=seq,
            # vLLM has no request pool: a request's KV row is its block-table row, so the padded
            # "pool index" of row b is b, and 0 (NULL_BLOCK_ID rows) for padding.
            padded_req_pool_indices=torch.cat([torch.arange(n, dtype=torch.int64), torch.zeros(rows - n, dtype=torch.int64)]),
            padded_out_cache_loc=slot_mapping,
            padded_positions=positions_all
            if positions_all is not None
            else torch.cat([positions, torch.zeros(slot_mapping.numel() - tokens, dtype=torch.int64)]),
        )
    return Converted(batch=batch, spec=spec, graph=graph)


def batch_from_common_metadata(cm: Any, block_size: int, kv_cache_size: int | None = None) -> Batch:
    """The engine-neutral Batch of one vLLM step (no speculation info: drafts are extend tokens)."""
    return convert_common(cm, block_size=block_size, kv_cache_size=kv_cache_size).batch


def _widest_fanout(parents: Tensor) -> int:
    """topk of the draft tree: the most children any token has (1 for a chain)."""
    children = torch.bincount(parents[1:].to(torch.int64), minlength=parents.numel())
    return max(int(children.max()), CHAIN_TOPK) if parents.numel() > 1 else CHAIN_TOPK


def _depths(parents: Tensor) -> Tensor:
    depth = torch.zeros(parents.numel(), dtype=torch.int64)
    for i in range(1, parents.numel()):
        depth[i] = depth[int(parents[i])] + 1
    return depth


def _referenced_slots(table: Tensor, kv: Tensor, block_size: int) -> int:
    """Slots a pool needs to hold every block the real requests use (at least the null block)."""
    top = 0
    for b in range(int(kv.numel())):
        blocks = -(-int(kv[b]) // block_size)
        if blocks:
            top = max(top, int(table[b, :blocks].max()))
    return (top + 1) * block_size
