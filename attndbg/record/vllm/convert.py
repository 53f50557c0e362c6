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
`num_reqs_padded` / `num_tokens_padded`, so padded rows and padded tokens show, real rows first.
A padded row is a trailing row that owns no query token (every scheduled request has one),
whatever seq_len it holds: vLLM writes 0, a stale capture buffer may hold 1 (Triton's
`build_for_cudagraph_capture` fills 1). Such a step is recorded as a graph replay (the Graph
section: every row's seq_len, every token's slot and position, verbatim) with vLLM's fill value 0,
and the Batch holds the real rows only.

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

from attndbg.trace.build import batch_from_rows, mode_from_lengths
from attndbg.record.vllm.fields import common_parts
from attndbg.trace.schema import Batch, ForwardMode, Graph, MaskLayout, Spec, indptr

VLLM_FILL_VALUE = 0  # seq_len of padded rows (engines.md B5)
PADDED_SLOT = -1  # slot_mapping of padded tokens: vLLM skips their KV write
NULL_BLOCK = 0  # vLLM's NULL_BLOCK_ID: block 0 is never handed to a request
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


def host_common(cm: Any, block_size: int | None = None) -> HostCommon:
    """A `HostCommon` from a real `CommonAttentionMetadata` (or one already on the host).

    This copies device tensors with `.cpu()`, a device sync: tests and offline tools only; the
    recording hook copies asynchronously through the session instead.
    """
    if isinstance(cm, HostCommon):
        return cm
    tensors, _ = common_parts(cm, int(block_size or 1))
    return host_from_parts({k: v.detach().cpu().clone() for k, v in tensors.items()})


def host_from_parts(tensors: dict[str, Tensor | None]) -> HostCommon:
    """The `HostCommon` of `common_parts`' tensors (host copies); KeyError only when vLLM handed in
    no query_start_loc / seq_lens / block table / slot_mapping at all (unreadable metadata)."""
    return HostCommon(
        query_start_loc=_required(tensors, "query_start_loc"),
        seq_lens=_required(tensors, "seq_lens"),
        block_table_tensor=_required(tensors, "block_table_tensor"),
        slot_mapping=_required(tensors, "slot_mapping"),
        positions=tensors.get("positions"),
        is_prefilling=tensors.get("is_prefilling"),
    )


def _required(tensors: dict[str, Tensor | None], name: str) -> Tensor:
    value = tensors.get(name)
    if value is None:
        raise KeyError(f"CommonAttentionMetadata.{name} is missing: the metadata cannot be read")
    return value


def _i64(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.int64).reshape(-1)


def _offsets(qsl: Tensor, rows: int) -> Tensor:
    """query_start_loc with exactly rows + 1 entries: cut, or extended with its last value (a
    recorded length mismatch is the invariants detector's finding, not a reason to stop)."""
    if qsl.numel() >= rows + 1:
        return qsl[: rows + 1]
    last = qsl[-1:] if qsl.numel() else torch.zeros(1, dtype=torch.int64)
    return torch.cat([qsl, last.expand(rows + 1 - qsl.numel())])


def real_rows(query_lens: Tensor) -> int:
    """Rows before vLLM's CUDA-graph padding: padded rows trail and own no query token (their
    query_start_loc entries repeat the last one), whatever seq_len the runner left in them; every
    scheduled request has at least one token. A negative length (a decreasing padded tail) is
    padding too: the invariants detector reports the decrease."""
    real = torch.nonzero(query_lens > 0).flatten()
    return int(real[-1]) + 1 if real.numel() else 0


def row_slots(block_row: Tensor, kv_len: int, block_size: int) -> Tensor:
    """Slot of each of a request's columns 0..kv_len-1: block_table[b, col // bs] * bs + col % bs."""
    cols = torch.arange(kv_len, dtype=torch.int64)
    return block_row[cols // block_size] * block_size + cols % block_size


def readable_rows(table: Tensor, kv: Tensor, block_size: int, num_blocks: int | None) -> list[Tensor]:
    """Each real request's block ids for its kv columns, every one a block the batch can hold.

    An entry no pool has (negative, e.g. -1; past `num_blocks`; past the row's end), and the null
    block, get a spare block of their own just past the pool, so that the trace stays loadable and no other request's
    KV, nor the null block padded rows read, aliases it. The engine's table is kept verbatim beside
    the batch and the invariants detector names the entry.
    """
    rows = []
    for b in range(int(kv.numel())):
        need = -(-int(kv[b]) // block_size)
        row = torch.full((need,), -1, dtype=torch.int64)
        if b < table.shape[0]:
            have = min(need, int(table.shape[1]))
            row[:have] = table[b, :have]
        rows.append(row)

    def outside(ids: Tensor) -> Tensor:
        # The null block is never a live request's: vLLM fills it into padded rows (and, with a
        # sliding window, into columns no query sees, where any block will do).
        bad = (ids < 0) | (ids == NULL_BLOCK)
        return bad | (ids >= num_blocks) if num_blocks is not None else bad

    read = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    valid = read[~outside(read)]
    # Spares start past the pool, or, with no pool size known, past every valid id the step reads.
    spare = num_blocks if num_blocks is not None else int(valid.max()) + 1 if valid.numel() else NULL_BLOCK + 1
    for row in rows:
        bad = outside(row)
        count = int(bad.sum())
        row[bad] = torch.arange(spare, spare + count, dtype=torch.int64)
        spare += count
    return rows


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


def vllm_mode(extend: Tensor, prefix: Tensor) -> ForwardMode:
    """DECODE when every request has one query token, whatever its prefix: vLLM has no forward mode,
    and its runner takes a batch of query length 1 throughout (a one-token prompt among decodes
    included) as a uniform decode, the batch its FULL CUDA graphs are captured for. SGLang's rule
    (`mode_from_lengths`: a one-token prompt is a prefill) would make such a step MIXED, and
    fill-value replays graphs only for decode and verify steps: the padding of the graph vLLM ran
    would go unchecked."""
    if extend.numel() and bool((extend == 1).all()):
        return ForwardMode.DECODE
    return mode_from_lengths(extend, prefix)


def convert_common(
    cm: Any,
    *,
    block_size: int,
    kv_cache_size: int | None = None,
    speculation: Speculation | None = None,
    tree_parents: Tensor | None = None,
) -> Converted:
    """Batch (+ chain/tree Spec for an all-verify step, + Graph when vLLM padded the step).

    Never raises on values: whatever the engine built is recorded (a wrong plan is evidence).
    The Batch is what attention must compute, derived from the lengths and the block table: its
    `out_cache_loc` is each new token's slot by the block table, its `seq_lens_raw` and
    `positions` are the engine's own. Where the engine's values cannot be a batch (a seq_len
    below its query length, a block id no pool has) the Batch takes the nearest loadable value
    and the engine's tensors, kept verbatim in the plan, carry the evidence for the detectors.

    `kv_cache_size`: slots in the engine's pool (num_blocks * block_size) when known; without it
    the pool is taken as large as the blocks the step references.
    """
    host = host_common(cm, block_size)
    seq = _i64(host.seq_lens)
    rows = int(seq.numel())
    qsl = _offsets(_i64(host.query_start_loc), rows)
    query_lens = qsl[1:] - qsl[:-1]
    n = real_rows(query_lens)
    extend = query_lens[:n].clamp(min=0)
    table = _i64(host.block_table_tensor).reshape(host.block_table_tensor.shape[0], -1) if host.block_table_tensor.dim() else torch.zeros(0, 0, dtype=torch.int64)
    positions_all = _i64(host.positions) if host.positions is not None else None
    kv = _kv_lens(seq[:n], extend, qsl[:n], positions_all, table.shape[1] * block_size)
    prefix = kv - extend
    pool_blocks = int(kv_cache_size) // block_size if kv_cache_size else None
    empty = torch.zeros(0, dtype=torch.int64)
    slot_rows = [row_slots(row, int(k), block_size) for row, k in zip(readable_rows(table, kv, block_size, pool_blocks), kv.tolist())]
    tokens = int(extend.sum())
    token_index = torch.arange(tokens, dtype=torch.int64) - torch.repeat_interleave(indptr(extend)[:-1], extend)
    # Where each batch token sits in the engine's flat per-token tensors.
    engine_token = torch.repeat_interleave(qsl[:n], extend) + token_index
    token_prefix = torch.repeat_interleave(prefix, extend)
    out_cache_loc = torch.cat([row[p:] for row, p in zip(slot_rows, prefix.tolist())]) if n else empty
    slot_mapping = _i64(host.slot_mapping)
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
        derived_positions = token_prefix + _depths(spec.parents[0]).repeat(n)
    else:
        mode = vllm_mode(extend, prefix)
        derived_positions = token_prefix + token_index
    positions = _gather(positions_all, engine_token, derived_positions)

    used = torch.cat(slot_rows) if slot_rows else empty
    referenced = int(used.max()) // block_size + 1 if used.numel() else 1  # at least the null block
    batch = batch_from_rows(
        forward_mode=mode,
        prefix_lens=prefix,
        extend_lens=extend,
        rows=slot_rows,
        out_cache_loc=out_cache_loc,
        positions=positions,
        seq_lens_raw=seq[:n],
        kv_cache_size=max(int(kv_cache_size or 0), referenced * block_size),
    )
    graph = None
    if rows > n or slot_mapping.numel() > tokens:
        engine_qsl = _i64(host.query_start_loc)
        graph = Graph(
            is_graph_replay=True,
            capture_bs=rows,
            # vLLM's runners reset padded seq_lens to 0 every step (engines.md B5); what a padded
            # row really holds is in padded_seq_lens, and fill-value judges it against this.
            fill_value=VLLM_FILL_VALUE,
            padded_seq_lens=seq,
            # vLLM has no request pool (a request's KV row is its block-table row): nothing to record.
            padded_req_pool_indices=None,
            padded_out_cache_loc=slot_mapping,
            padded_positions=positions_all
            if positions_all is not None
            else torch.cat([positions, torch.zeros(max(slot_mapping.numel() - tokens, 0), dtype=torch.int64)]),
            # The engine's buffers as it filled them, padded rows included. One of another length
            # than the rows (a metadata bug) is left out here: `common.*` keeps it verbatim and the
            # invariants detector names it.
            padded_qo_indptr=engine_qsl if engine_qsl.numel() == rows + 1 else None,
            padded_block_table=table if table.shape[0] == rows else None,
        )
    return Converted(batch=batch, spec=spec, graph=graph)


def _kv_lens(seq: Tensor, extend: Tensor, starts: Tensor, positions: Tensor | None, row_capacity: int) -> Tensor:
    """Each request's KV length: its seq_len, unless that cannot hold its own query tokens (the
    engine's mistake, reported by invariants as seq-lens): then the length its last token's
    position implies (what the kernel should have read), within what its block-table row holds."""
    kv = seq.clone()
    for b in torch.nonzero(seq < extend).flatten().tolist():
        last = int(starts[b] + extend[b] - 1)
        implied = int(positions[last]) + 1 if positions is not None and 0 <= last < positions.numel() else 0
        kv[b] = max(int(extend[b]), min(implied, row_capacity))
    return kv


def _gather(values: Tensor | None, index: Tensor, fallback: Tensor) -> Tensor:
    """values[index] where the engine's tensor has the entry, else the fallback's value."""
    if values is None:
        return fallback
    inside = (index >= 0) & (index < values.numel())
    out = fallback.clone()
    out[inside] = values[index[inside]]
    return out


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
