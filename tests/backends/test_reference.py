"""The float64 reference against a naive per-query, per-key loop written from first principles."""

from __future__ import annotations

import math

import pytest
import torch

from attndbg.backends import reference
from attndbg.replay.data import build_inputs
from tests.factories import make_trace


def _naive(trace, inputs):
    """Loop over every query and key: which keys a query sees, decided from the batch alone."""
    m, b = trace.model, trace.batch
    out = torch.zeros(b.num_tokens, m.num_qo_heads, m.v_head_dim, dtype=torch.float64)
    lse = torch.zeros(b.num_tokens, m.num_qo_heads, dtype=torch.float64)
    for r in range(b.batch_size):
        slots = b.request_slots(r).tolist()
        prefix = int(b.prefix_lens[r])
        start = int(b.qo_indptr[r])
        for i in range(int(b.extend_lens[r])):
            t = start + i
            qcol = int(b.query_cols[t])
            keys = []
            for j in range(len(slots)):
                if trace.is_tree_verify:
                    if j < prefix:
                        ok, kpos = True, j
                    else:
                        node, chain = i, []
                        parents = trace.spec.parents[r].tolist()
                        while node != -1:
                            chain.append(node)
                            node = parents[node]
                        ok = (j - prefix) in chain
                        # depth of the key's draft token
                        d, node = 0, j - prefix
                        while parents[node] != -1:
                            node, d = parents[node], d + 1
                        kpos = prefix + d
                    qpos = int(b.positions[t])
                else:
                    ok, kpos, qpos = j <= qcol, j, qcol
                if m.sliding_window >= 0 and qpos - kpos > m.sliding_window:
                    ok = False
                if ok:
                    keys.append(slots[j])
            for h in range(m.num_qo_heads):
                kh = h // (m.num_qo_heads // m.num_kv_heads)
                q = inputs.q[t, h].double()
                scores = []
                for s in keys:
                    x = float(q @ inputs.k_cache[s, kh].double()) * m.sm_scale
                    if m.logit_cap > 0:
                        x = m.logit_cap * math.tanh(x / m.logit_cap)
                    scores.append(x)
                mx = max(scores)
                w = [math.exp(x - mx) for x in scores]
                total = sum(w)
                lse[t, h] = mx + math.log(total)
                for wi, s in zip(w, keys):
                    out[t, h] += (wi / total) * inputs.v_cache[s, kh].double()
    return out, lse


@pytest.mark.parametrize(
    "spec",
    [
        ("decode-mha", "kv_lens=1,9,40", "heads=2:2", "head_dim=16"),
        ("decode-gqa", "kv_lens=3,30", "heads=4:2", "head_dim=16", "page_size=4", "shared_prefix=8"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "heads=2:1", "head_dim=8"),
        ("verify", "prefix_lens=4,9", "heads=2:1", "head_dim=8", "topk=2", "steps=3", "draft_tokens=5"),
        ("verify", "prefix_lens=4,9", "heads=2:1", "head_dim=8", "parents=-1,0,0,1,2,2"),
        ("window", "prefix_lens=12,0", "extend_lens=6,9", "heads=2:1", "head_dim=8", "window=4"),
        ("softcap", "kv_lens=5,17", "heads=2:1", "head_dim=8", "logit_cap=0.7"),
        ("selective", "kv_lens=10,20", "select=3", "heads=2:1", "head_dim=8"),
        ("mla-decode", "kv_lens=3,11", "heads=2", "kv_lora_rank=16", "rope_dim=8"),
    ],
)
def test_reference_matches_naive_loop(spec: tuple[str, ...]) -> None:
    trace = make_trace(*spec, "dtype=float32")
    inputs = build_inputs(trace)
    result = reference.attention(trace, inputs)
    out, lse = _naive(trace, inputs)
    torch.testing.assert_close(result.output, out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(result.lse, lse, rtol=1e-10, atol=1e-10)


def test_mla_values_are_the_latent_part_of_the_keys() -> None:
    trace = make_trace("mla-decode", "kv_lens=4", "heads=2", "kv_lora_rank=16", "rope_dim=8")
    inputs = build_inputs(trace)
    assert inputs.v_cache.data_ptr() == inputs.k_cache.data_ptr()
    assert inputs.v_cache.shape[-1] == 16 and inputs.k_cache.shape[-1] == 24


def test_new_kv_is_written_before_attention() -> None:
    trace = make_trace("extend-prefix")
    inputs = build_inputs(trace)
    assert torch.equal(inputs.k_cache[trace.batch.out_cache_loc], inputs.k_new)
    assert torch.equal(inputs.v_cache[trace.batch.out_cache_loc], inputs.v_new)


def test_inputs_are_deterministic_from_the_seed() -> None:
    a = build_inputs(make_trace("decode-gqa", "seed=3"))
    b = build_inputs(make_trace("decode-gqa", "seed=3"))
    assert torch.equal(a.q, b.q) and torch.equal(a.k_cache, b.k_cache)


@pytest.mark.parametrize(
    "spec",
    [
        ("decode-gqa", "kv_lens=3,30,64", "heads=4:2", "head_dim=16", "dtype=float32"),
        ("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "heads=2:1", "head_dim=8", "dtype=float32"),
        ("verify", "prefix_lens=4,9", "heads=2:1", "head_dim=8", "topk=2", "steps=3", "draft_tokens=5", "dtype=float32"),
    ],
)
def test_partial_states_over_column_ranges_merge_to_the_full_attention(spec: tuple[str, ...]) -> None:
    """Partial states (what split-KV kernels compute per split) come from the same code: two halves
    of every request's row, merged by their LSEs, give the single pass; an empty range gives -inf / 0."""
    trace = make_trace(*spec)
    inputs = build_inputs(trace)
    full = reference.attention(trace, inputs)
    kv = trace.batch.kv_lens
    mid = kv // 2
    first = reference.attention(trace, inputs, columns=torch.stack([torch.zeros_like(kv), mid], 1))
    second = reference.attention(trace, inputs, columns=torch.stack([mid, kv], 1))
    lse = torch.logaddexp(first.lse, second.lse)
    w1 = torch.exp(first.lse - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(second.lse - lse).nan_to_num(0.0)[..., None]
    torch.testing.assert_close(w1 * first.output + w2 * second.output, full.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, full.lse, rtol=1e-10, atol=1e-10)
    empty = reference.attention(trace, inputs, columns=torch.stack([kv, kv], 1))
    assert bool(torch.isneginf(empty.lse).all()) and bool((empty.output == 0).all())


def test_groups_split_large_requests_without_changing_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny memory budget forces one group per request and row chunks inside a request: same numbers."""
    trace = make_trace("extend-prefix", "prefix_lens=0,40,9", "extend_lens=37,5,20", "heads=4:2", "head_dim=16", "dtype=float32")
    inputs = build_inputs(trace)
    whole = reference.attention(trace, inputs)
    monkeypatch.setitem(reference.GROUP_BYTES, "cpu", 1)
    assert len(reference._groups(trace, torch.float64, 1)) == trace.batch.num_tokens  # one row per group
    chunked = reference.attention(trace, inputs)
    torch.testing.assert_close(chunked.output, whole.output, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.lse, whole.lse, rtol=1e-12, atol=1e-12)


def test_only_the_slots_a_step_reads_are_drawn() -> None:
    """Data is drawn for the batch's rows, its writes and the dummy page; the rest of the pool is zero."""
    from attndbg.replay.data import slots_read

    trace = make_trace("decode-gqa", "kv_lens=3,30", "heads=4:2", "head_dim=16", "page_size=4", "scatter=1")
    inputs = build_inputs(trace)
    read = slots_read(trace)
    assert set(read.tolist()) == set(trace.batch.slot_ids.tolist()) | set(trace.batch.out_cache_loc.tolist()) | {0, 1, 2, 3}
    unread = torch.ones(trace.batch.kv_cache_size, dtype=torch.bool)
    unread[read] = False
    assert bool(unread.any()), "the pool should have slots no request reads"
    assert bool((inputs.k_cache[unread] == 0).all()) and bool((inputs.v_cache[unread] == 0).all())
    assert bool((inputs.k_cache[read] != 0).any(-1).any(-1).all())


def test_fp8_kv_rows_are_written_bytewise() -> None:
    trace = make_trace("decode-gqa", "kv_lens=3,30", "heads=4:2", "head_dim=16", "kv_dtype=float8_e4m3fn")
    inputs = build_inputs(trace)
    assert inputs.k_cache.dtype == torch.float8_e4m3fn
    assert torch.equal(inputs.k_cache[trace.batch.out_cache_loc].view(torch.uint8), inputs.k_new.view(torch.uint8))
