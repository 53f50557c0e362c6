"""Ground truth: attention computed from the batch alone, in float64 (or, for the tolerance model,
in the run's own low precision).

Nothing here reads a plan. Which keys a query sees comes from the batch: its column in the
request's KV row (causal or not), a custom mask, the draft tree (verify), the sliding windows; the
scores take the soft-cap, the softmax a per-head sink logit (one more term with no value, as
gpt-oss's sinks), and the fp8 cache its dequantisation scales (k_scale, v_scale).

Fully masked rows (a row that sees no key): output 0 and LSE -inf, the logsumexp of nothing; with
a sink, the sink alone: output 0 and LSE = the sink's logit (FlashInfer's AttentionSink variant
writes the same). Adapters map their library's convention onto this one.

The whole batch is computed at once, on the inputs' device: requests are sorted by KV length and
packed into groups whose padded work fits a memory budget; each group is one gather of its KV
rows and one masked batched matmul per K and V. A request too large for the budget on its own is
split over its query rows (rows are independent: every row's softmax still sees its whole row of
keys, so the result is the same math as one pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg import numerics
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, KernelUnsupported, PartialStates
from attndbg.backends.capabilities import EVERY_LAYER_KIND, Capabilities
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, ForwardMode, LseBase, MergeStates, Plan, Trace
from attndbg.trace.visibility import visibility

# Bytes of padded work (gathered K/V in the compute dtype plus scores and their softmax) one group
# may hold. Large enough that a decode step of 64 x 8k keys is a handful of groups, small enough
# for a 24 GB CPU machine or beside a kernel's own buffers on the GPU.
GROUP_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}

# (b, query rows of request b) -> [rows, kv_len] bool: which columns of its KV row each row sees.
Visible = Callable[[int, slice], Tensor]


@dataclass(frozen=True)
class _Unit:
    """Query rows [row0, row1) of request b (all of them unless the request alone exceeds the budget)."""

    b: int
    row0: int
    row1: int
    kv: int


def attention(
    trace: Trace,
    inputs: AttentionInputs,
    compute_dtype: torch.dtype = torch.float64,
    *,
    columns: Tensor | None = None,  # [bs, 2] int64: per request, only KV columns [start, end) (a partial state)
    tables: list[GroupTables] | None = None,  # filled on the first call, reused by the next (same trace, inputs and columns)
    visible: Visible | None = None,  # which columns each query sees, in place of the step's own visibility
) -> AttentionResult:
    """Masked softmax attention for the whole batch.

    float64: the reference. A low dtype: what a plain PyTorch implementation in the run's dtype
    commits (scores and the weighted sum in that dtype, softmax in float32 then cast, as
    FlashAttention's `attention_ref(upcast=False)`), used to size tolerances.

    With `columns`, each request attends only to its columns in [start, end): the partial state a
    split-KV kernel computes for that split (output normalised over those keys, their LSE); a row
    that sees none of them has output 0 and LSE -inf. A partial state holds no sink: the merge of
    the splits adds it once.

    `tables`: the gather and mask tables of every group, built by the first call that gets an empty
    list and reused by later calls on the same step (the float64 and the low-precision reference
    read the same rows and columns; building the tables is most of their host time).

    `visible`: (b, rows) -> [rows, kv_len] bool, what a kernel with a wrong mask let request b's
    query rows see (attndbg/diagnose's mask mistakes); default the truth, trace/visibility.py.
    """
    model, batch = trace.model, trace.batch
    device = inputs.q.device
    out = torch.zeros(batch.num_tokens, model.num_qo_heads, model.v_head_dim, dtype=compute_dtype, device=device)
    lse = torch.full((batch.num_tokens, model.num_qo_heads), float("-inf"), dtype=torch.float64, device=device)
    budget = GROUP_BYTES.get(device.type, GROUP_BYTES["cpu"])
    if tables is None or not tables:
        # Sized for float64 whatever the dtype: both references then share one grouping.
        built = [_group_tables(trace, group, columns, device, visible) for group in _groups(trace, torch.float64, budget)]
        if tables is not None:
            tables.extend(built)
    else:
        built = tables
    sinks = trace.model.sinks if columns is None else None
    for group in built:
        _attend_group(trace, inputs, group, compute_dtype, out, lse, sinks=sinks)
    return AttentionResult(output=out, lse=lse)


def natural_lse(lse: Tensor, base: LseBase) -> Tensor:
    """LSEs in `base` as natural logs, in float64 (a base-2 LSE times ln 2)."""
    lse = lse.to(torch.float64)
    return lse * numerics.LN2 if base is LseBase.TWO else lse


def merge(states: MergeStates, compute_dtype: torch.dtype = torch.float64) -> AttentionResult:
    """A standalone merge of given partial states (trace.merge): output [tokens, heads, Dv] and
    natural-log LSE [tokens, heads] float64.

    float64: the reference, numerics.merge_states's rule (a state of LSE -inf weighs 0 and its
    output is never read, NaN included; a row whose every state is empty gives 0 / -inf); a row
    the row mask leaves out keeps state 0. A low
    dtype: what a merge kernel commits, float32 math with the output rounded to that dtype (the
    tolerance model's same-dtype run)."""
    math_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    lse = natural_lse(states.s, states.lse_base).to(math_dtype)
    output, merged = numerics.merge_states(states.v.to(math_dtype), lse)
    if states.mask is not None:  # rows not merged keep state 0 as given
        output = torch.where(states.mask[:, None, None], output, states.v[0].to(math_dtype))
        merged = torch.where(states.mask[:, None], merged, lse[0])
    return AttentionResult(output=output.to(compute_dtype), lse=merged.to(torch.float64))


def _unit_bytes(trace: Trace, rows: int, kv: int, compute_dtype: torch.dtype) -> int:
    m = trace.model
    item = torch.finfo(compute_dtype).bits // 8
    kv_bytes = kv * m.num_kv_heads * (m.head_dim + m.v_head_dim) * item
    # scores, their softmax in float32/float64 and the float64 logsumexp input: about 4 copies.
    score_bytes = 4 * m.num_qo_heads * rows * kv * 8
    return kv_bytes + score_bytes


def _groups(trace: Trace, compute_dtype: torch.dtype, budget: int) -> list[list[_Unit]]:
    batch = trace.batch
    qo = batch.qo_indptr.tolist()
    kv_lens = batch.kv_lens.tolist()
    units = []
    for b in sorted(range(batch.batch_size), key=lambda r: kv_lens[r]):
        rows, kv = qo[b + 1] - qo[b], kv_lens[b]
        if rows == 0:
            continue
        per_row = max(1, _unit_bytes(trace, 1, kv, compute_dtype))
        step = max(1, min(rows, budget // per_row))
        units += [_Unit(b, qo[b] + r, qo[b] + min(rows, r + step), kv) for r in range(0, rows, step)]
    groups: list[list[_Unit]] = []
    current: list[_Unit] = []
    for unit in units:  # sorted by KV length: the group's padding is its last unit's
        trial = current + [unit]
        rows = max(u.row1 - u.row0 for u in trial)
        if current and len(trial) * _unit_bytes(trace, rows, unit.kv, compute_dtype) > budget:
            groups.append(current)
            trial = [unit]
        current = trial
    if current:
        groups.append(current)
    return groups


def _group_masks(trace: Trace, group: list[_Unit], kv_max: int, rows_max: int, columns: Tensor | None, visible: Visible | None) -> Tensor:
    """[B, rows_max, kv_max] bool on the CPU: which padded columns each padded row sees."""
    batch = trace.batch
    mask = torch.zeros(len(group), rows_max, kv_max, dtype=torch.bool)
    for i, u in enumerate(group):
        start = int(batch.qo_indptr[u.b])
        rows = slice(u.row0 - start, u.row1 - start)
        seen = visibility(trace, u.b, rows) if visible is None else visible(u.b, rows)
        if columns is not None:
            start, end = (int(x) for x in columns[u.b])
            cols = torch.arange(u.kv)
            seen = seen & ((cols >= start) & (cols < end))[None, :]
        mask[i, : u.row1 - u.row0, : u.kv] = seen
    return mask


@dataclass(frozen=True)
class GroupTables:
    """One group's gather tables on the device: padded slots and rows (padding points at slot 0 /
    row 0 and is masked out), which padded columns each padded row sees, and which rows are real."""

    slots: Tensor  # [B, kv_max] int64
    rows: Tensor  # [B, rows_max] int64
    mask: Tensor  # [B, rows_max, kv_max] bool
    real: Tensor  # [B, rows_max] bool


def _group_tables(trace: Trace, group: list[_Unit], columns: Tensor | None, device: torch.device, visible: Visible | None = None) -> GroupTables:
    batch = trace.batch
    n, kv_max = len(group), max(u.kv for u in group)
    rows_max = max(u.row1 - u.row0 for u in group)
    slots = torch.zeros(n, kv_max, dtype=torch.int64)
    rows = torch.zeros(n, rows_max, dtype=torch.int64)
    real = torch.zeros(n, rows_max, dtype=torch.bool)
    for i, u in enumerate(group):
        slots[i, : u.kv] = batch.request_slots(u.b)
        rows[i, : u.row1 - u.row0] = torch.arange(u.row0, u.row1)
        real[i, : u.row1 - u.row0] = True
    mask = _group_masks(trace, group, kv_max, rows_max, columns, visible)
    return GroupTables(slots=slots.to(device), rows=rows.to(device), mask=mask.to(device), real=real.to(device))


def _attend_group(
    trace: Trace,
    inputs: AttentionInputs,
    tables: GroupTables,
    compute_dtype: torch.dtype,
    out: Tensor,
    lse: Tensor,
    *,
    sinks: Tensor | None,  # [Hq] float32 sink logits, or None
) -> None:
    model = trace.model
    low = compute_dtype != torch.float64
    hkv, group_size = model.num_kv_heads, model.gqa_group
    slots, rows, mask, real = tables.slots, tables.rows, tables.mask, tables.real
    (n, rows_max), kv_max = rows.shape, slots.shape[1]

    # GQA without copying K/V per query head: query heads of one KV head become extra rows.
    k = inputs.k_cache[slots].to(compute_dtype).permute(0, 2, 1, 3)  # [B, Hkv, kv, Dk]
    v = inputs.v_cache[slots].to(compute_dtype).permute(0, 2, 1, 3)  # [B, Hkv, kv, Dv]
    if model.k_scale != 1.0:  # the cache stores K / k_scale (fp8): dequantise
        k = k * model.k_scale
    if model.v_scale != 1.0:
        v = v * model.v_scale
    q = inputs.q[rows].to(compute_dtype)  # [B, e, Hq, Dk]
    q = q.view(n, rows_max, hkv, group_size, -1).permute(0, 2, 3, 1, 4).reshape(n, hkv, group_size * rows_max, -1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * model.sm_scale  # [B, Hkv, g*e, kv]
    if model.logit_cap > 0:
        scores = model.logit_cap * torch.tanh(scores / model.logit_cap)
    visible = mask[:, None, None].expand(n, 1, group_size, rows_max, kv_max).reshape(n, 1, group_size * rows_max, kv_max)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        # One more softmax term per query head, with no value: [Hq] -> a last column of every row
        # (rows are (head in group, query row) per KV head, as q above).
        sink = sinks.to(device=scores.device, dtype=scores.dtype).view(hkv, group_size, 1).expand(hkv, group_size, rows_max)
        scores = torch.cat([scores, sink.reshape(1, hkv, group_size * rows_max, 1).expand(n, -1, -1, -1)], dim=-1)
    softmax_dtype = torch.float32 if low else torch.float64
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(compute_dtype)
    probs = torch.nan_to_num(probs, nan=0.0)  # a row that sees nothing has no weights
    if sinks is not None:
        probs = probs[..., :kv_max]  # the sink's weight has no value
    o = _weighted_values(probs, v, visible)  # [B, Hkv, g*e, Dv]
    o = o.view(n, hkv, group_size, rows_max, -1).permute(0, 3, 1, 2, 4).reshape(n, rows_max, model.num_qo_heads, -1)
    m = torch.logsumexp(scores.to(torch.float64), dim=-1)  # [B, Hkv, g*e]
    m = m.view(n, hkv, group_size, rows_max).permute(0, 3, 1, 2).reshape(n, rows_max, model.num_qo_heads)
    out.index_copy_(0, rows[real], o[real])
    lse.index_copy_(0, rows[real], m[real])


def _weighted_values(probs: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """probs @ v, reading only the values each row sees.

    A column a row does not see has weight 0, but 0 x NaN is NaN: a NaN or Inf in a value no row
    of the group may read (outside its window, masked by the tree, past its length, a padded
    column gathered from slot 0) would still reach the output through a plain matmul. Such values
    are read as 0; a row that does see one gets the plain product (its true, non-finite, result).
    probs: [B, Hkv, rows, kv]; v: [B, Hkv, kv, Dv]; visible: [B, 1, rows, kv] bool."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return torch.matmul(probs, v)
    clean = torch.matmul(probs, v.masked_fill(bad, 0.0))
    sees_bad = torch.matmul(visible.to(v.dtype), bad.to(v.dtype)) > 0  # [B, Hkv, rows, Dv]
    return torch.where(sees_bad, torch.matmul(probs, v), clean)


class ReferenceBackend(Backend):
    name = "reference"

    def unavailable_reason(self) -> str | None:
        return None

    def describe(self) -> str:
        return "float64 PyTorch attention from the batch alone (ground truth)"

    def device(self) -> str:
        return "cpu"

    def capabilities(self) -> Capabilities:
        # Everything a valid trace can hold (IDLE included: zero rows); no CUDA graph.
        return Capabilities(
            kernels="the float64 reference",
            attention=frozenset(AttentionKind),
            modes={kind: frozenset(ForwardMode) for kind in AttentionKind},
            q_dtypes=frozenset(Q_DTYPES),
            kv_dtypes=frozenset(DTYPES),
            tree_mask=True,
            column_mask=True,
            sliding_window=True,
            window_in_tree_verify=True,
            soft_cap=True,
            merge_state=True,
            **EVERY_LAYER_KIND,
        )

    def derive_plan(self, trace: Trace) -> Plan:
        return Plan(backend=self.name, tensors={}, scalars={})

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        return attention(trace, inputs, torch.float64)

    def merge_states(self, states: PartialStates) -> AttentionResult:
        """The float64 merge of [rows, Hq, parts, Dv] states by their natural-log LSEs alone."""
        if states.kv_lens is not None or states.num_splits is not None:
            raise KernelUnsupported(f"{self.name} has no merge of partial states by the split rule (kv_lens, num_splits): it merges given states by their LSEs alone")
        v, lse = states.output.permute(2, 0, 1, 3).double(), states.lse.permute(2, 0, 1).double()
        output, merged = numerics.merge_states(v, lse)
        if states.rows is not None:
            output = torch.where(states.rows[:, None, None], output, v[0])
            merged = torch.where(states.rows[:, None], merged, lse[0])
        return AttentionResult(output=output, lse=merged)
