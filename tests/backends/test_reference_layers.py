"""The float64 reference on the layer kinds engines run today (non-causal, two-sided windows, sinks,
a scaled fp8 cache, cross-attention with empty and fully masked rows, an extend step's custom mask),
against a naive per-query, per-key loop written from each property's definition."""

from __future__ import annotations

import math

import pytest
import torch

from attndbg.backends import reference
from attndbg.replay.data import build_inputs
from tests.factories import make_trace


def _visible(trace, r: int, i: int, j: int) -> bool:
    """Whether query i of request r sees KV column j, from the definitions in schema.Model/Batch."""
    m, b = trace.model, trace.batch
    e, kv = int(b.extend_lens[r]), int(b.kv_lens[r])
    # A query's column: the row's tail (prefix + i); cross-attention: aligned bottom-right.
    qcol = kv - e + i if b.cross else int(b.prefix_lens[r]) + i
    if b.custom_mask is not None:
        start = int((b.extend_lens[:r] * b.kv_lens[:r]).sum())
        ok = bool(b.custom_mask[start + i * kv + j])
    else:
        ok = j <= qcol or not m.causal
    if m.sliding_window >= 0 and qcol - j > m.sliding_window:
        ok = False
    if m.window_right >= 0 and j - qcol > m.window_right:
        ok = False
    return ok


def _naive(trace, inputs):
    m, b = trace.model, trace.batch
    out = torch.zeros(b.num_tokens, m.num_qo_heads, m.v_head_dim, dtype=torch.float64)
    lse = torch.full((b.num_tokens, m.num_qo_heads), -math.inf, dtype=torch.float64)
    for r in range(b.batch_size):
        slots = b.request_slots(r).tolist()
        for i in range(int(b.extend_lens[r])):
            t = int(b.qo_indptr[r]) + i
            keys = [slots[j] for j in range(len(slots)) if _visible(trace, r, i, j)]
            for h in range(m.num_qo_heads):
                kh = h // (m.num_qo_heads // m.num_kv_heads)
                q = inputs.q[t, h].double()
                scores = [float(q @ (inputs.k_cache[s, kh].double() * m.k_scale)) * m.sm_scale for s in keys]
                # A sink is one more term of the softmax's denominator, with no value.
                terms = scores + ([float(m.sinks[h])] if m.sinks is not None else [])
                if not terms:
                    continue  # sees nothing: output 0, LSE -inf
                mx = max(terms)
                total = sum(math.exp(x - mx) for x in terms)
                lse[t, h] = mx + math.log(total)
                for x, s in zip(scores, keys):
                    out[t, h] += (math.exp(x - mx) / total) * inputs.v_cache[s, kh].double() * m.v_scale
    return out, lse


SMALL = ("heads=2:1", "head_dim=8", "dtype=float32")


@pytest.mark.parametrize(
    "spec",
    [
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "causal=0"),
        ("window", "prefix_lens=12,0", "extend_lens=6,9", "window=4", "window_right=2"),
        ("window", "prefix_lens=12,0", "extend_lens=6,9", "window=-1", "window_right=0", "causal=0"),
        ("decode-mha", "kv_lens=1,9,40", "sinks=1"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "heads=4:2", "sinks=1"),
        ("decode-gqa", "kv_lens=3,30", "heads=4:2", "kv_dtype=float8_e4m3fn", "k_scale=0.5", "v_scale=2.0"),
        ("extend-prefix", "prefix_lens=0,3,9", "extend_lens=4,6,2", "cross=1"),
        ("extend-prefix", "prefix_lens=0,3,9", "extend_lens=4,6,2", "cross=1", "causal=1"),
        ("extend-prefix", "prefix_lens=0,3,9", "extend_lens=4,6,2", "cross=1", "causal=1", "sinks=1"),
        ("decode-mha", "kv_lens=0,5", "cross=1"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "extend_mask=random"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=9,4", "extend_mask=blocks", "window=5"),
        ("extend-prefix", "prefix_lens=0,7,0", "extend_lens=5,0,0", "slots=non_monotonic"),
        ("mixed", "prefix_lens=8,0,5", "extend_lens=6,3,1", "causal=0", "slots=interleaved_pages"),
    ],
    ids=lambda spec: " ".join(spec),
)
def test_reference_matches_naive_loop(spec: tuple[str, ...]) -> None:
    trace = make_trace(*spec, *[w for w in SMALL if w.split("=")[0] not in {s.split("=")[0] for s in spec}])
    inputs = build_inputs(trace)
    result = reference.attention(trace, inputs)
    out, lse = _naive(trace, inputs)
    torch.testing.assert_close(result.output, out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(result.lse, lse, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_follow_the_convention() -> None:
    """More queries than keys, causal and bottom-right aligned: the top rows see nothing (output 0,
    LSE -inf); with sinks their LSE is the sink's logit."""
    plain = make_trace("extend-prefix", "prefix_lens=2", "extend_lens=5", "cross=1", "causal=1", *SMALL)
    result = reference.attention(plain, build_inputs(plain))
    assert bool(torch.isneginf(result.lse[:3]).all()) and bool((result.output[:3] == 0).all())
    assert bool(torch.isfinite(result.lse[3:]).all())
    sunk = make_trace("extend-prefix", "prefix_lens=2", "extend_lens=5", "cross=1", "causal=1", "sinks=1", *SMALL)
    result = reference.attention(sunk, build_inputs(sunk))
    torch.testing.assert_close(result.lse[:3], sunk.model.sinks.double().expand(3, -1))
    assert bool((result.output[:3] == 0).all())


def test_a_causal_extend_mask_is_plain_causal_attention() -> None:
    """extend_mask=causal writes the causal rule out: the same numbers as no mask (a correct twin)."""
    masked = make_trace("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "extend_mask=causal", *SMALL)
    plain = make_trace("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", *SMALL)
    assert torch.equal(masked.batch.slot_ids, plain.batch.slot_ids)
    a = reference.attention(masked, build_inputs(masked))
    b = reference.attention(plain, build_inputs(plain))
    assert torch.equal(a.output, b.output) and torch.equal(a.lse, b.lse)


def test_cross_attention_writes_nothing_into_the_cache() -> None:
    trace = make_trace("extend-prefix", "prefix_lens=3,9", "extend_lens=4,2", "cross=1", *SMALL)
    assert bool((trace.batch.out_cache_loc == -1).all())
    inputs = build_inputs(trace)
    read = torch.zeros(trace.batch.kv_cache_size, dtype=torch.bool)
    read[trace.batch.slot_ids] = True
    read[: trace.model.page_size] = True  # the dummy page
    # A -1 written as an index would land on the pool's last row; no unread slot holds data.
    assert not bool((inputs.k_cache[~read] != 0).any()) and not bool((inputs.v_cache[~read] != 0).any())


def test_partial_states_hold_no_sink() -> None:
    """A split's partial state has no sink: merged with the sink once, the halves give the full pass."""
    trace = make_trace("decode-mha", "kv_lens=9,40", "sinks=1", *SMALL)
    inputs = build_inputs(trace)
    full = reference.attention(trace, inputs)
    kv = trace.batch.kv_lens
    whole = reference.attention(trace, inputs, columns=torch.stack([torch.zeros_like(kv), kv], 1))
    sinks = trace.model.sinks.double()[None, :]
    lse = torch.logaddexp(whole.lse, sinks)
    torch.testing.assert_close(lse, full.lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(whole.output * torch.exp(whole.lse - lse)[..., None], full.output, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "spec",
    [
        ("window", "prefix_lens=12,0", "extend_lens=6,9", "window=3", "window_right=2"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "extend_mask=random"),
        ("extend-prefix", "prefix_lens=2,6", "extend_lens=5,3", "cross=1", "causal=1", "sinks=1"),
    ],
    ids=lambda spec: " ".join(spec),
)
def test_a_row_reads_only_the_keys_it_sees(spec: tuple[str, ...]) -> None:
    """NaN planted in one KV column reaches exactly the rows that see it (visibility.py's answer):
    the reference reads no key a row may not see, for each new mask kind."""
    from dataclasses import replace

    from attndbg.trace.visibility import visibility

    trace = make_trace(*spec, *SMALL)
    inputs = build_inputs(trace)
    b = trace.batch.batch_size - 1
    seen = visibility(trace, b)
    column = int(torch.nonzero(seen.any(0) & ~seen.all(0))[0])  # seen by some of the request's rows, not all
    slot = int(trace.batch.request_slots(b)[column])
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    k_cache[slot], v_cache[slot] = float("nan"), float("nan")
    result = reference.attention(trace, replace(inputs, k_cache=k_cache, v_cache=v_cache))
    rows = slice(int(trace.batch.qo_indptr[b]), int(trace.batch.qo_indptr[b + 1]))
    poisoned = torch.isnan(result.output[rows]).any(-1).any(-1)
    assert torch.equal(poisoned, seen[:, column])
