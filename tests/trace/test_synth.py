"""Synth: reproducible, valid, and shaped like the engine batches it imitates."""

from __future__ import annotations

import pytest
import torch

from attndbg.trace import synth, tree
from attndbg.trace.mask_geometry import MaskGeometry, unpack_bits
from attndbg.trace.schema import ForwardMode, MaskLayout, to_dict
from attndbg.trace.validate import from_dict
from tests.factories import make_trace


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_every_preset_builds_a_valid_trace(preset: str) -> None:
    trace = make_trace(preset, plan=True)
    from_dict(to_dict(trace))  # raises on any inconsistency


def test_same_spec_same_bits() -> None:
    a, b = to_dict(make_trace("verify", "seed=7")), to_dict(make_trace("verify", "seed=7"))
    c = to_dict(make_trace("verify", "seed=8"))
    assert torch.equal(a["batch"]["slot_ids"], b["batch"]["slot_ids"])
    assert torch.equal(a["spec"]["parents"], b["spec"]["parents"])
    assert not torch.equal(a["batch"]["slot_ids"], c["batch"]["slot_ids"])


def test_decode_lengths_and_positions() -> None:
    t = make_trace("decode-gqa", "kv_lens=1,5,20000")
    b = t.batch
    assert b.forward_mode is ForwardMode.DECODE
    assert b.kv_lens.tolist() == [1, 5, 20000]
    assert b.prefix_lens.tolist() == [0, 4, 19999]
    assert b.positions.tolist() == [0, 4, 19999]
    assert b.seq_lens_raw.tolist() == [1, 5, 20000]  # SGLang decode seq_lens include the current token


def test_slot_zero_is_never_handed_out_and_written_slots_are_private() -> None:
    for preset in ("decode-gqa", "decode-paged", "extend-prefix", "mixed", "verify", "selective"):
        b = make_trace(preset, "shared_prefix=32").batch
        page = make_trace(preset).model.page_size
        assert int((b.slot_ids // page == 0).sum()) == 0, preset
        written = b.out_cache_loc.tolist()
        assert len(set(written)) == len(written), preset
        # No request reads another request's freshly written slot.
        for r in range(b.batch_size):
            row = set(b.request_slots(r).tolist())
            mine = set(b.out_cache_loc[int(b.qo_indptr[r]) : int(b.qo_indptr[r + 1])].tolist())
            assert not (row - mine) & (set(written) - mine), preset


def test_shared_prefix_is_shared_like_a_radix_cache() -> None:
    b = make_trace("decode-paged", "kv_lens=40,70,100", "shared_prefix=32", "page_size=16").batch
    rows = [b.request_slots(r) for r in range(3)]
    assert torch.equal(rows[0][:32], rows[1][:32]) and torch.equal(rows[1][:32], rows[2][:32])
    assert not set(rows[0][32:].tolist()) & set(rows[1][32:].tolist())


def test_scatter_off_gives_contiguous_rows() -> None:
    b = make_trace("decode-mha", "kv_lens=10,20", "scatter=0").batch
    row = b.request_slots(1)
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 20))


def test_extend_modes() -> None:
    cached = make_trace("extend-cached").batch
    assert cached.extend_lens.tolist() == [1, 1] and cached.prefix_lens.tolist() == [63, 200]
    mixed = make_trace("mixed").batch
    assert mixed.forward_mode is ForwardMode.MIXED and 1 in mixed.extend_lens.tolist()
    noprefix = make_trace("extend-noprefix").batch
    assert noprefix.prefix_lens.tolist() == [0, 0]
    assert noprefix.positions.tolist() == list(range(37)) + list(range(70))


def test_selective_recompute_queries_a_subset_ending_at_the_last_column() -> None:
    b = make_trace("selective", "kv_lens=64,150", "select=6").batch
    assert b.selective and b.extend_lens.tolist() == [6, 6]
    for r in range(2):
        cols = b.query_cols[int(b.qo_indptr[r]) : int(b.qo_indptr[r + 1])]
        assert int(cols[-1]) == int(b.kv_lens[r]) - 1
        assert bool((cols[1:] > cols[:-1]).all())


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] != -1:
        i = parents[i]
        out.add(i)
    return out


def test_full_mask_layout_matches_sglang_by_hand() -> None:
    # Root 0; 1 and 2 children of 0; 3 child of 1.
    parents = torch.tensor([[-1, 0, 0, 1]])
    prefix = torch.tensor([2])
    mask = tree.full_mask(parents, prefix)
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    ).flatten()
    assert torch.equal(mask, expected)
    assert MaskGeometry.verify(MaskLayout.FULL, draft_token_num=4, prefix_lens=torch.tensor([2, 5])).indptr.tolist() == [0, 24, 60]


def test_verify_trace_layout() -> None:
    t = make_trace("verify", "prefix_lens=3,10", "draft_tokens=6", "topk=2", "steps=3")
    n = 6
    spec, b = t.spec, t.batch
    assert b.seq_lens_raw.tolist() == [3, 10]  # SGLang verify seq_lens exclude the draft tokens
    mask = spec.custom_mask
    assert mask.numel() == n * (3 + n) + n * (10 + n)
    offset = 0
    for r, prefix in enumerate([3, 10]):
        parents = spec.parents[r].tolist()
        block = mask[offset : offset + n * (prefix + n)].view(n, prefix + n)
        offset += n * (prefix + n)
        assert bool(block[:, :prefix].all())
        for i in range(n):
            visible = {j for j in range(n) if block[i, prefix + j]}
            assert visible == _ancestors(parents, i)
        depth = [len(_ancestors(parents, i)) - 1 for i in range(n)]
        positions = b.positions[int(b.qo_indptr[r]) : int(b.qo_indptr[r + 1])].tolist()
        assert positions == [prefix + d for d in depth]


def test_bitpacked_and_qlen_only_layouts() -> None:
    parents = torch.tensor([[-1, 0, 1, 0, 3, 3, 2, 6, 0, 8]])  # n = 10 -> 2-byte words
    words = tree.qlen_only_bitpacked_mask(parents)
    assert words.dtype == torch.uint16
    for i in range(10):
        expected = sum(1 << j for j in _ancestors(parents[0].tolist(), i))
        assert int(words[i]) == expected
    assert torch.equal(unpack_bits(words, 10).flatten(), tree.qlen_only_mask(parents))
    t = make_trace("verify", "mask_layout=qlen_only_bitpacked")
    assert t.spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED and t.spec.custom_mask.dtype == torch.uint8


@pytest.mark.parametrize("topk,steps,n", [(1, 4, 5), (4, 3, 8), (8, 5, 32), (2, 6, 12)])
def test_eagle_tree_is_a_tree_with_topk_fanout(topk: int, steps: int, n: int) -> None:
    parents = tree.eagle_tree(topk=topk, steps=steps, draft_token_num=n, generator=torch.Generator().manual_seed(1))
    assert parents[0] == -1
    for i in range(1, n):
        assert 0 <= int(parents[i]) < i
    children = torch.bincount(parents[1:], minlength=n)
    assert int(children.max()) <= topk
    assert int(tree.depths(parents).max()) <= steps
    if topk == 1:
        assert parents.tolist() == [-1] + list(range(n - 1))


def test_spec_errors_name_the_key() -> None:
    with pytest.raises(synth.SpecError, match="unknown key 'kv_len'"):
        synth.parse_spec(["decode-gqa", "kv_len=3"])
    with pytest.raises(synth.SpecError, match="unknown preset"):
        synth.parse_spec(["nope"])
    with pytest.raises(synth.SpecError, match="page_size='x'"):
        synth.parse_spec(["page_size=x"])
    with pytest.raises(synth.SpecError, match="needs 9 candidates"):
        synth.build(synth.parse_spec(["verify", "topk=1", "steps=2", "draft_tokens=10"]))
