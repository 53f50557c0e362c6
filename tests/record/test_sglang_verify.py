"""SGLang TARGET_VERIFY steps: a real EagleVerifyInput with a topk=2 draft tree whose parents are
written by hand, its tree mask in SGLang's FULL and QLEN_ONLY layouts -> the trace's Spec."""

from __future__ import annotations

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.record.sglang.spec import parents_from_links, spec_from_verify_input
from attndbg.trace import tree
from attndbg.trace.schema import ForwardMode, MaskLayout
from tests.record.sglang_steps import assert_checks_clean, assert_replays_clean, extend_metadata, make_trace, saved_and_loaded, triton_backend

I64 = env.I64
N = 4  # draft_token_num: the verified token (root) + 3 drafts
PREFIX = [3, 2]
# Request 0: tokens 1 and 2 are children of the root, 3 is a child of 1.
# Request 1: 1 and 3 are children of the root, 2 is a child of 1.
PARENTS = [[-1, 0, 0, 1], [-1, 0, 1, 0]]
# The same trees as SGLang stores them (build_tree_efficient): first child, next sibling; -1 = none.
NEXT_TOKEN = [[1, 3, -1, -1], [1, 2, -1, -1]]
NEXT_SIBLING = [[-1, 2, -1, -1], [-1, 3, -1, -1]]
DEPTHS = [[0, 1, 1, 2], [0, 1, 2, 1]]
ROWS = {1: [11, 12, 13, 44, 45, 46, 47], 6: [21, 22, 30, 31, 32, 33]}  # prefix slots, then the drafts'


def verify_input(custom_mask: torch.Tensor) -> object:
    return env.EagleVerifyInput(
        draft_token=torch.arange(2 * N, dtype=I64),
        custom_mask=custom_mask,
        positions=torch.tensor([p + d for p, depths in zip(PREFIX, DEPTHS) for d in depths], dtype=I64),
        retrieve_index=torch.arange(2 * N, dtype=I64).view(2, N),
        retrieve_next_token=torch.tensor(NEXT_TOKEN, dtype=I64),
        retrieve_next_sibling=torch.tensor(NEXT_SIBLING, dtype=I64),
        retrieve_cum_len=None,
        spec_steps=2,
        topk=2,
        draft_token_num=N,
        capture_hidden_mode=env.CaptureHiddenMode.FULL,
        seq_lens_sum=sum(PREFIX),
        seq_lens_cpu=torch.tensor(PREFIX, dtype=I64),
    )


def verify_batch(spec_info) -> object:
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.TARGET_VERIFY,
        batch_size=2,
        input_ids=spec_info.draft_token,
        req_pool_indices=torch.tensor([1, 6], dtype=I64),
        seq_lens=torch.tensor(PREFIX, dtype=I64),  # SGLang: the prefix only, drafts excluded
        out_cache_loc=torch.tensor([44, 45, 46, 47, 30, 31, 32, 33], dtype=I64),
        seq_lens_sum=sum(PREFIX),
        positions=spec_info.positions,
        spec_info=spec_info,
    )


def full_mask() -> torch.Tensor:
    mask = tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX))
    # Spot checks written by hand, so the mask under test is not only our own utility's word.
    block0 = mask[: N * (3 + N)].view(N, 3 + N)
    assert block0[3].tolist() == [True, True, True, True, True, False, True]  # token 3 sees root, 1, itself
    assert block0[2].tolist() == [True, True, True, True, False, True, False]
    block1 = mask[N * (3 + N) :].view(N, 2 + N)
    assert block1[2].tolist() == [True, True, True, True, True, False]  # request 1: token 2 under 1
    assert mask.numel() == N * sum(PREFIX) + 2 * N * N
    return mask


def test_parents_from_sglang_links() -> None:
    parents = parents_from_links(torch.tensor(NEXT_TOKEN), torch.tensor(NEXT_SIBLING))
    assert parents.tolist() == PARENTS


def test_unreachable_draft_token_is_named() -> None:
    with pytest.raises(ValueError, match="draft token 3 is not reachable"):
        parents_from_links(torch.tensor([[1, -1, -1, -1]]), torch.tensor([[-1, 2, -1, -1]]))


def test_verify_full_mask(tmp_path) -> None:
    pool = env.req_pool(ROWS)
    mask = full_mask()
    fb = verify_batch(verify_input(mask))
    batch = batch_from_forward_batch(fb, pool.req_to_token, 48)
    assert batch.forward_mode is ForwardMode.TARGET_VERIFY
    assert batch.prefix_lens.tolist() == PREFIX
    assert batch.extend_lens.tolist() == [N, N]
    assert batch.kv_lens.tolist() == [7, 6]
    assert batch.seq_lens_raw.tolist() == PREFIX
    assert batch.slot_ids.tolist() == ROWS[1] + ROWS[6]
    assert batch.positions.tolist() == [3, 4, 4, 5, 2, 3, 4, 3]
    spec = spec_from_verify_input(fb.spec_info, fb.seq_lens)
    assert spec.mask_layout is MaskLayout.FULL
    assert spec.parents.tolist() == PARENTS
    assert (spec.topk, spec.steps, spec.draft_token_num) == (2, 2, N)
    assert torch.equal(spec.custom_mask, mask)

    # Triton verify: kv over the prefix only, mask_indptr = cumsum(n * (prefix + n)).
    metadata = extend_metadata(
        qo_indptr=[0, N, 2 * N], kv_indptr=[0, 3, 5], kv_indices=[11, 12, 13, 21, 22], max_extend_len=N, custom_mask=mask, mask_indptr=[0, 28, 52]
    )
    plan = plan_from_backend(triton_backend(metadata))
    assert plan.tensors["mask_indptr"].tolist() == [0, 28, 52]
    trace, path = saved_and_loaded(make_trace(batch, plan=plan, spec=spec), tmp_path)
    assert trace.is_tree_verify
    assert_replays_clean(trace, path)
    assert_checks_clean(path)


def test_verify_full_mask_from_a_graph_buffer_is_cut() -> None:
    """Under CUDA graphs the mask is a preallocated buffer (SGL-new VerifyMask): the Spec keeps the
    FULL layout's length only."""
    mask = full_mask()
    buffer = torch.ones(mask.numel() + 100, dtype=torch.bool)
    buffer[: mask.numel()] = mask
    spec = spec_from_verify_input(verify_input(buffer), torch.tensor(PREFIX), MaskLayout.FULL, capacity=True)
    assert torch.equal(spec.custom_mask, mask)


def test_verify_qlen_only_mask(tmp_path) -> None:
    pool = env.req_pool(ROWS)
    mask = tree.qlen_only_mask(torch.tensor(PARENTS))
    assert mask.view(2, N, N)[0, 3].tolist() == [True, True, False, True]  # by hand
    assert mask.view(2, N, N)[1, 3].tolist() == [True, False, False, True]
    fb = verify_batch(verify_input(mask))
    batch = batch_from_forward_batch(fb, pool.req_to_token, 48)
    spec = spec_from_verify_input(fb.spec_info, fb.seq_lens)
    assert spec.mask_layout is MaskLayout.QLEN_ONLY
    assert spec.parents.tolist() == PARENTS
    trace, path = saved_and_loaded(make_trace(batch, plan=None, spec=spec), tmp_path)
    assert_replays_clean(trace, path, expect_recorded=False)
    assert_checks_clean(path)


def test_verify_bitpacked_mask_layout() -> None:
    mask = tree.qlen_only_bitpacked_mask(torch.tensor(PARENTS))
    assert mask.dtype == torch.uint8 and mask[3] == 0b1011  # request 0, token 3: root, 1, itself
    spec = spec_from_verify_input(verify_input(mask), torch.tensor(PREFIX))
    assert spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED
