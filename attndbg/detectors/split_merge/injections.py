"""split-merge mistakes: engine tensors whose LSE or merged output went wrong the way real merges do.

The engine's tensors of one layer (`Trace.tensors`) are what these mutate. When the trace has none,
layer 0's are made here: q, K/V rows and this step's K/V drawn from the trace's seed. The output
and LSE a correct engine would record, and the partial states a wrong merge combines, come from
the float64 reference (backends/reference.py) over those tensors; merges are attndbg.numerics', the split rule the
kernel's (backends/triton_kernels/split_rule.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

# cascade-lse-base-2 is a mistake of SGLang's FlashInfer backend: the step is relabelled as its.
from attndbg.backends.flashinfer import SGLANG_NAME as SGLANG_FLASHINFER
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs
from attndbg.backends.triton_kernels.split_rule import empty_splits
from attndbg.numerics import LN2, LOG2E, merge_states
from attndbg.trace.schema import DTYPES, AttentionKind, ForwardMode, LayerTensors, LseBase, Trace

LAYER = 0
# SGLang's default --triton-attention-num-kv-splits, which its CUDA graph buffer holds for every request.
DEFAULT_KV_SPLITS = 8
# Seed offset for the drawn tensors, so they differ from replay's own draws of the same seed.
SEED_SALT = 0x5EED


@dataclass(frozen=True)
class _Step:
    """One layer's recorded tensors and the per-request views the float64 math needs."""

    tensors: LayerTensors
    k: Tensor  # [N, Hkv, Dk] float64: the cache after this step's writes, indexed by slot
    v: Tensor  # [N, Hkv, Dv] float64
    q: Tensor  # [T, Hq, Dk] float64


def _layer(trace: Trace) -> _Step:
    """Layer tensors: the recorded ones when the trace has them, else drawn for layer 0."""
    model, batch = trace.model, trace.batch
    if trace.merge is not None:
        raise ValueError("a merge step (trace.merge) has no attention tensors; its mistake is split-merge:merge-step-lse-base")
    recorded = trace.tensors.get(LAYER)
    mla = model.attention is AttentionKind.MLA
    if recorded is None:
        g = torch.Generator().manual_seed(trace.seed + SEED_SALT)
        kv_dtype, q_dtype = DTYPES[model.kv_dtype], DTYPES[model.q_dtype]
        slots = torch.unique(batch.slot_ids)
        hkv, dk = model.num_kv_heads, model.head_dim
        dv = 0 if mla else model.v_head_dim
        t = batch.num_tokens
        recorded = LayerTensors(
            q=torch.randn(t, model.num_qo_heads, dk, generator=g).to(q_dtype),
            k_new=torch.randn(t, hkv, dk, generator=g).to(kv_dtype),
            v_new=torch.randn(t, hkv, dv, generator=g).to(kv_dtype),
            kv_slots=slots,
            k_rows=torch.randn(slots.numel(), hkv, dk, generator=g).to(kv_dtype),
            v_rows=torch.randn(slots.numel(), hkv, dv, generator=g).to(kv_dtype),
            output=None,
            lse=None,
            lse_base=LseBase.E,
        )
    # The cache as attention reads it: rows before the step, then this step's K/V at out_cache_loc.
    k = torch.zeros(batch.kv_cache_size, model.num_kv_heads, model.head_dim, dtype=torch.float64)
    k[recorded.kv_slots] = recorded.k_rows.double()
    k[batch.out_cache_loc] = recorded.k_new.double()
    if mla:
        v = k[..., : model.kv_lora_rank]
    else:
        v = torch.zeros(batch.kv_cache_size, model.num_kv_heads, model.v_head_dim, dtype=torch.float64)
        v[recorded.kv_slots] = recorded.v_rows.double()
        v[batch.out_cache_loc] = recorded.v_new.double()
    return _Step(tensors=recorded, k=k, v=v, q=recorded.q.double())


def _reference(trace: Trace, step: _Step, columns: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The float64 reference output [T, Hq, Dv] and natural-log LSE [T, Hq] on the step's tensors;
    with `columns` ([bs, 2]: per request, KV columns [start, end) only) the partial states."""
    inputs = AttentionInputs(q=step.q, k_new=step.k[trace.batch.out_cache_loc], v_new=step.v[trace.batch.out_cache_loc], k_cache=step.k, v_cache=step.v)
    result = reference.attention(trace, inputs, torch.float64, columns=columns)
    return result.output, result.lse


def _recorded(trace: Trace, step: _Step, output: Tensor, lse: Tensor | None, base: LseBase) -> Trace:
    tensors = replace(
        step.tensors,
        output=output.to(DTYPES[trace.model.q_dtype]),
        lse=None if lse is None else lse.to(torch.float32),
        lse_base=base,
    )
    return replace(trace, tensors={**trace.tensors, LAYER: tensors})


def lse_base_2(trace: Trace) -> Trace:
    """FlashInfer #2113 / SGLang #40903: FlashInfer's base-2 LSE recorded (and merged) as natural log.

    The output is right; the LSE is the kernel's base-2 value (natural / ln 2) labelled base e, as
    an engine that forgets FlashInfer's convention hands it to natural-log merge code.
    """
    step = _layer(trace)
    recorded = step.tensors
    output, natural = _reference(trace, step)
    if recorded.lse is not None:
        natural = recorded.lse.double() * (LN2 if recorded.lse_base is LseBase.TWO else 1.0)
    if recorded.output is not None:
        output = recorded.output
    return _recorded(trace, step, output, natural * LOG2E, LseBase.E)


def _split_counts(trace: Trace) -> tuple[list[int], list[int], str]:
    """Per request: KV length the split kernel sees, its num_kv_splits, and where those came from."""
    batch, plan = trace.batch, trace.plan
    bs = batch.batch_size
    if plan is not None and "num_kv_splits" in plan.tensors and "kv_indptr" in plan.tensors:
        lengths = plan.tensors["kv_indptr"].to(torch.int64).diff()[:bs].tolist()
        return lengths, plan.tensors["num_kv_splits"][:bs].tolist(), "the recorded plan's num_kv_splits"
    window = trace.model.sliding_window
    lengths = [min(int(n), window + 1) if window >= 0 else int(n) for n in batch.kv_lens]
    return lengths, [DEFAULT_KV_SPLITS] * bs, f"SGLang's graph default num_kv_splits = {DEFAULT_KV_SPLITS}"


def nan_empty_split(trace: Trace) -> Trace:
    """FlashInfer #4051: merging two empty split states computes exp(-inf - -inf): NaN output rows.

    Decode only: the requests of this step that have an empty split under the recorded
    num_kv_splits (or, without a recorded split plan, SGLang's graph default of 8 for every request;
    a split covers cdiv(cdiv(len, splits), 32) * 32 tokens) get NaN output and LSE; the others the
    correct values.
    """
    if trace.batch.forward_mode is not ForwardMode.DECODE:
        raise ValueError(f"split-merge:nan-empty-split applies to split-KV decode steps, not {trace.batch.forward_mode.value}")
    lengths, splits, _ = _split_counts(trace)
    victims = [b for b, (n, s) in enumerate(zip(lengths, splits)) if empty_splits(n, s) > 0]
    if not victims:
        raise ValueError(f"split-merge:nan-empty-split: no request is shorter than its splits need (lengths {lengths}, splits {splits})")
    step = _layer(trace)
    output, lse = _reference(trace, step)
    qo = trace.batch.qo_indptr
    for b in victims:
        output[int(qo[b]) : int(qo[b + 1])] = float("nan")
        lse[int(qo[b]) : int(qo[b + 1])] = float("nan")
    return _recorded(trace, step, output, lse, LseBase.E)


def cascade_lse_base_2(trace: Trace) -> Trace:
    """SGLang #40903: a chunked-prefill merge fed FlashInfer's base-2 prefix LSE into natural-log code.

    Extend steps with a cached prefix: the output is the merge of the prefix partial (columns before
    the prefix, its LSE in base 2 read as natural, so weighted too heavily) with the new tokens'
    partial. The engine keeps the output and drops the merged LSE, as SGLang's extend does. Recorded
    from SGLang's FlashInfer backend (the cascade is its path); a plan of another backend is dropped.
    """
    batch = trace.batch
    if batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or batch.selective:
        raise ValueError("split-merge:cascade-lse-base-2 applies to extend steps with a cached prefix (cascade), not this step")
    if not bool((batch.prefix_lens > 0).any()):
        raise ValueError("split-merge:cascade-lse-base-2 needs a request with a cached prefix (the prefix partial)")
    if trace.model.sliding_window >= 0:
        raise ValueError("split-merge:cascade-lse-base-2: sliding-window layers run FlashInfer's paged path, not the cascade")
    step = _layer(trace)
    output, _ = _reference(trace, step)
    prefix = batch.prefix_lens.to(torch.int64)
    o_p, lse_p = _reference(trace, step, torch.stack([torch.zeros_like(prefix), prefix], dim=1))
    o_s, lse_s = _reference(trace, step, torch.stack([prefix, batch.kv_lens.to(torch.int64)], dim=1))
    merged, _ = merge_states(torch.stack([o_p, o_s]), torch.stack([lse_p * LOG2E, lse_s]))
    qo = batch.qo_indptr
    for b in range(batch.batch_size):
        if int(batch.prefix_lens[b]) and int(batch.extend_lens[b]):
            output[int(qo[b]) : int(qo[b + 1])] = merged[int(qo[b]) : int(qo[b + 1])]
    source = replace(trace.source, backend=SGLANG_FLASHINFER)
    plan = trace.plan if trace.plan is not None and trace.plan.backend == FlashInferBackend.name else None
    return replace(_recorded(trace, step, output, None, LseBase.E), source=source, plan=plan)


def merge_step_lse_base(trace: Trace) -> Trace:
    """A merge step's states handed to a merge kernel of the other LSE base (FlashInfer #2113).

    Base-2 states weighed as natural logs, or natural-log states as base 2: the recorded output is
    the merge of the given states with every LSE rescaled by log2 e (or ln 2). The engine keeps the
    output and drops the merged LSE, as SGLang's cascade does.
    """
    states = trace.merge
    if states is None:
        raise ValueError("split-merge:merge-step-lse-base applies to a merge step (synth merge-state), not this step")
    factor = LOG2E if states.lse_base is LseBase.TWO else LN2
    misread = replace(states, s=reference.natural_lse(states.s, states.lse_base) * factor, lse_base=LseBase.E)
    output = reference.merge(misread, states.v.dtype).output
    return replace(trace, merge=replace(states, output=output, lse=None))


INJECTIONS: dict[str, Callable[[Trace], Trace]] = {
    "split-merge:lse-base-2": lse_base_2,
    "split-merge:nan-empty-split": nan_empty_split,
    "split-merge:cascade-lse-base-2": cascade_lse_base_2,
    "split-merge:merge-step-lse-base": merge_step_lse_base,
}
