"""Diagnosis by reproduction, more mistakes: each made by its real mechanism (our
Triton kernels given the wrong plan, mask, split count or metadata; a float64 engine written here
where no kernel of ours has the path), attributed to its own model and to no other.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.detector_api.context import CheckContext
from attndbg.detectors.split_merge.recorded import recorded_tensors
from attndbg.diagnose.mask_models import _tree_rows
from attndbg.trace import tree
from attndbg.trace.mask_geometry import pack_bits, unpack_bits, reverse_bits, word_bits, word_dtype
from attndbg.trace.schema import Trace
from tests.checks.shapes import SMALL
from tests.diagnose.test_diagnose import DECODE, EXTEND, VERIFY, attributed, decode_kernels, engine_said, inputs_of, masked_engine, recorded, split_engine, triton_on, with_rows


def with_plan(trace: Trace, **tensors: Tensor) -> Trace:
    plan = trace.plan
    return replace(trace, plan=replace(plan, tensors={**plan.tensors, **tensors}))


def run_plan(trace: Trace) -> Tensor:
    """Our Triton kernels launched with the step's recorded plan (the engine's, wrong or not)."""
    backend = registry.create("triton")
    return backend.run(trace, inputs_of(trace), trace.plan).output.cpu()


# -- splits and plans -----------------------------------------------------------------------------


def test_split_count_beyond_the_captured_scratch() -> None:
    # Request 2: 300 keys in 12 splits of 32 -> 10 non-empty, but the grid and scratch hold 8: keys
    # from column 256 are never seen. Our real stage 1 and 2, launched as SGLang's are.
    trace = recorded("decode-gqa", *SMALL, "kv_lens=5,100,300", "shared_prefix=0", splits=[1, 3, 12])
    trace = replace(trace, plan=replace(trace.plan, scalars={**trace.plan.scalars, "max_kv_splits": 8}))
    params = attributed(engine_said(trace, split_engine(trace, stage2=decode_kernels.decode_stage2)), "splits-beyond-capture")
    assert params == [{"request": 2, "max_kv_splits": 8, "num_kv_splits": 12, "kept_columns": 256}]


def test_stale_tail_of_the_recorded_kv_indices() -> None:
    # Request 1's last 30 kv_indices hold request 2's slots (left from a larger earlier batch): the
    # real kernel, launched with that plan, reads them.
    trace = recorded(*DECODE, splits=[1, 3, 4])
    indptr, indices = trace.plan.tensors["kv_indptr"], trace.plan.tensors["kv_indices"].clone()
    start = int(indptr[1])
    indices[start + 70 : start + 100] = trace.batch.request_slots(2)[70:100].to(indices.dtype)
    engine = with_plan(trace, kv_indices=indices)
    params = attributed(engine_said(engine, run_plan(engine)), "recorded-plan-kv")
    assert params == [{"request": 1, "read": "its KV row", "slots_differ": 30}]


def test_graph_replayed_with_the_capture_batchs_lengths() -> None:
    trace = recorded("decode-gqa", *SMALL, "kv_lens=5,100,130", "shared_prefix=0", "capture_bs=4", "fill_value=1", splits=[1, 3, 4])
    told = with_rows(trace, {b: trace.batch.request_slots(b)[:1] for b in range(3)}, {b: -(int(trace.batch.kv_lens[b]) - 1) for b in range(3)})
    params = attributed(engine_said(trace, triton_on(trace, told)), "plan-from-capture")
    assert [(p["request"], p["fill"]) for p in params] == [(0, 1), (1, 1), (2, 1)]


def test_extend_positions_left_from_the_previous_chunk() -> None:
    trace = recorded(*EXTEND)
    cols, qo, ext = trace.batch.query_cols, trace.batch.qo_indptr, trace.batch.extend_lens

    def sees(b: int, r: int, c: int) -> bool:  # request 0's queries sit extend_len columns early
        return c <= int(cols[int(qo[b]) + r]) - (int(ext[0]) if b == 0 else 0)

    params = attributed(engine_said(trace, masked_engine(trace, sees)), "positions-stale")
    assert params == [{"request": 0, "shift": -5}]


# -- verify masks, through our real Triton extend kernel's FULL mask ---------------------------------


def triton_masked(trace: Trace, blocks: dict[int, Tensor]) -> Tensor:
    """Our Triton kernel launched with a FULL custom mask whose request b block is blocks[b] ([n,
    prefix + n], prefix columns read too), the tree's elsewhere: what a kernel that read the right
    mask wrongly applied."""
    backend = registry.create("triton")
    plan = backend.derive_plan(trace)
    masks = [blocks.get(b, _tree_rows(trace, b)).flatten() for b in range(trace.batch.batch_size)]
    plan = replace(plan, tensors={**plan.tensors, "custom_mask": torch.cat(masks)}, scalars={**plan.scalars, "skip_prefix_custom_mask": False})
    return backend.run(trace, inputs_of(trace), plan).output.cpu()


def branched(trace: Trace) -> list[int]:
    return [b for b in range(trace.batch.batch_size) if not tree.is_chain(trace.spec.parents[b : b + 1])]


def test_tree_mask_read_transposed() -> None:
    trace = recorded(*VERIFY)
    blocks = {}
    for b in range(trace.batch.batch_size):
        full = _tree_rows(trace, b)
        prefix = int(trace.batch.prefix_lens[b])
        full[:, prefix:] = tree.ancestor_matrix(trace.spec.parents[b]).T
        blocks[b] = full
    params = attributed(engine_said(trace, triton_masked(trace, blocks)), "mask-transposed")
    assert [p["request"] for p in params] == branched(trace) == [0, 1]


def test_bit_packed_mask_words_read_big_endian() -> None:
    trace = recorded(*VERIFY)
    n = trace.spec.draft_token_num
    width = word_bits(word_dtype(n))
    blocks = {}
    for b in range(trace.batch.batch_size):
        # SGLang packs each draft row little-endian; the kernel unpacks the words as if big-endian.
        words = pack_bits(tree.ancestor_matrix(trace.spec.parents[b]))
        read = unpack_bits(reverse_bits(words, width), width)[:, :n]
        full = _tree_rows(trace, b)
        full[:, int(trace.batch.prefix_lens[b]) :] = read
        blocks[b] = full
    params = attributed(engine_said(trace, triton_masked(trace, blocks)), "mask-bit-order")
    assert [(p["request"], p["packing"]) for p in params] == [(0, "word"), (1, "word")]


def test_custom_mask_ignored_past_the_causal_tile() -> None:
    # Drafts at columns 28-35 and 60-67: key tiles of 16 or 32 start a new tile at 32 and 64.
    trace = recorded("verify", *SMALL, "prefix_lens=28,60")
    blocks = {}
    for b, first in ((0, 32), (1, 64)):
        full = _tree_rows(trace, b)
        prefix = int(trace.batch.prefix_lens[b])
        n = trace.spec.draft_token_num
        full[:, first:] = torch.ones(n, n, dtype=torch.bool).tril()[:, first - prefix :]
        blocks[b] = full
    params = attributed(engine_said(trace, triton_masked(trace, blocks)), "mask-ignored-past-causal-tile")
    assert [(p["request"], p["first_causal_column"]) for p in params] == [(0, 32), (1, 64)]
    assert params[0]["tiles"] == [16, 32] and params[1]["tiles"] == [16, 32, 64]


def test_the_recorded_plans_wrong_mask_applied() -> None:
    # Request 1's block of the recorded mask lets draft row 5 see every draft key (a stale tail
    # written by an earlier, wider tree); the real kernel launched with that plan applies it.
    trace = recorded(*VERIFY)
    mask, indptr = trace.plan.tensors["custom_mask"].clone(), trace.plan.tensors["mask_indptr"]
    prefix, n = int(trace.batch.prefix_lens[1]), trace.spec.draft_token_num
    block = mask[int(indptr[1]) : int(indptr[2])].view(n, prefix + n)
    block[5, prefix:] = True
    engine = with_plan(trace, custom_mask=mask)
    params = attributed(engine_said(engine, run_plan(engine)), "recorded-plan-mask")
    assert [p["request"] for p in params] == [1]
    assert params[0]["entries_differ"] == int((~tree.ancestor_matrix(trace.spec.parents[1])[5]).sum())


def test_clean_graph_and_plan_steps_are_not_attributed() -> None:
    trace = recorded("decode-gqa", *SMALL, "kv_lens=5,100,130", "shared_prefix=0", "capture_bs=4", splits=[1, 3, 4])
    assert recorded_tensors(CheckContext(trace=trace, path="t")) == []
    trace = recorded("verify", *SMALL, "prefix_lens=28,60")
    assert recorded_tensors(CheckContext(trace=trace, path="t")) == []


def test_graph_replayed_with_metadata_it_never_read() -> None:
    # SGLang PR #26019's review: metadata rebuilt into fresh tensors at replay, every request attended slot 0.
    trace = recorded("decode-gqa", *SMALL, "kv_lens=5,100,130", "shared_prefix=0", "capture_bs=4", "fill_value=1", splits=[1, 3, 4])
    slot0 = torch.zeros(1, dtype=torch.int64)
    told = with_rows(trace, {b: slot0 for b in range(3)}, {b: -(int(trace.batch.kv_lens[b]) - 1) for b in range(3)})
    params = attributed(engine_said(trace, triton_on(trace, told)), "plan-from-capture")
    assert params == [{"request": b, "slot": 0} for b in range(3)]


def test_byte_packed_mask_read_with_each_bytes_bits_reversed() -> None:
    # FlashInfer's packing (the request's whole [n, prefix + n] mask in little-endian bytes) read
    # big-endian; tests/gpu/test_diagnose_flashinfer.py runs the same through FlashInfer's kernel.
    from tests.gpu.test_diagnose_flashinfer import byte_reversed

    trace = recorded(*VERIFY)
    blocks = {b: byte_reversed(_tree_rows(trace, b)) for b in range(trace.batch.batch_size)}
    params = attributed(engine_said(trace, triton_masked(trace, blocks)), "mask-bit-order")
    assert [(p["request"], p["packing"]) for p in params] == [(0, "byte"), (1, "byte")]
