"""SGLang decode / extend / mixed steps: real ForwardBatch, ForwardMode, ReqToTokenPool and Triton
ForwardMetadata -> a trace whose lengths, slots and positions are the ones written below by hand,
which validates, replays clean (derived and recorded plan) and gives no finding."""

from __future__ import annotations

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.trace.schema import ForwardMode
from tests.record.sglang_steps import (
    assert_checks_clean,
    assert_replays_clean,
    decode_metadata,
    extend_metadata,
    make_trace,
    saved_and_loaded,
    triton_backend,
)

I64, I32 = env.I64, env.I32
KV_CACHE_SIZE = 48

# req_to_token rows (request-pool row -> KV slot per column), as the scheduler would have filled them.
ROWS = {
    1: [11, 12, 13, 14, 15],
    2: [7, 8, 9, 40, 41, 42, 43],
    3: [20],
    4: [17, 18],
    5: [30, 31, 32, 33, 34, 35, 36, 37, 38],
    6: [21, 22, 23, 24, 25, 26, 27],
}


def t(values, dtype=I64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def extend_batch(mode, *, pool_rows: list[int], prefix: list[int], extend: list[int], out_cache_loc: list[int], positions: list[int]):
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    return env.ForwardBatch(
        forward_mode=mode,
        batch_size=len(pool_rows),
        input_ids=torch.zeros(sum(extend), dtype=I64),
        req_pool_indices=t(pool_rows),
        seq_lens=t(seq_lens),
        out_cache_loc=t(out_cache_loc),
        seq_lens_sum=sum(seq_lens),
        positions=t(positions),
        extend_num_tokens=sum(extend),
        extend_prefix_lens=t(prefix, I32),
        extend_seq_lens=t(extend, I32),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        seq_lens_cpu=t(seq_lens),
    )


def test_decode_step(tmp_path) -> None:
    pool = env.req_pool(ROWS)
    # Decode: seq_lens already count the token of this step (ScheduleBatch.prepare_for_decode).
    fb = env.ForwardBatch(
        forward_mode=env.ForwardMode.DECODE,
        batch_size=3,
        input_ids=t([101, 102, 103]),
        req_pool_indices=t([1, 3, 5]),
        seq_lens=t([5, 1, 9]),
        out_cache_loc=t([15, 20, 38]),
        seq_lens_sum=15,
        positions=t([4, 0, 8]),
        seq_lens_cpu=t([5, 1, 9]),
    )
    batch = batch_from_forward_batch(fb, pool.req_to_token, KV_CACHE_SIZE)
    assert batch.forward_mode is ForwardMode.DECODE
    assert batch.prefix_lens.tolist() == [4, 0, 8]
    assert batch.extend_lens.tolist() == [1, 1, 1]
    assert batch.kv_lens.tolist() == [5, 1, 9]
    assert batch.slot_ids.tolist() == [11, 12, 13, 14, 15, 20, 30, 31, 32, 33, 34, 35, 36, 37, 38]
    assert batch.query_cols.tolist() == [4, 0, 8]
    assert batch.seq_lens_raw.tolist() == [5, 1, 9]

    metadata = decode_metadata([0, 5, 6, 15], batch.slot_ids.tolist(), [2, 1, 3])
    plan = plan_from_backend(triton_backend(metadata, max_kv_splits=8))
    assert plan.backend == "triton"
    assert plan.tensors["kv_indptr"].tolist() == [0, 5, 6, 15]
    assert plan.tensors["num_kv_splits"].tolist() == [2, 1, 3]
    assert plan.scalars == {"max_kv_splits": 8}
    trace, path = saved_and_loaded(make_trace(batch, plan=plan), tmp_path)
    assert_replays_clean(trace, path)
    assert_checks_clean(path)


def test_decode_plan_is_cut_to_its_used_length() -> None:
    """SGLang sizes kv_indices from seq_lens_sum or a larger buffer: the recorded plan keeps only
    the kv_indptr[-1] entries the kernel reads."""
    metadata = decode_metadata([0, 2, 3], [5, 6, 7, 0, 0, 0], [1, 1])
    plan = plan_from_backend(triton_backend(metadata))
    assert plan.tensors["kv_indices"].tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    ("prefix", "extend", "expect_kv_indices"),
    [([3, 0], [4, 2], [7, 8, 9]), ([0, 0], [7, 2], [])],
    ids=["with-prefix", "no-prefix"],
)
def test_extend_step(tmp_path, prefix, extend, expect_kv_indices) -> None:
    pool = env.req_pool(ROWS)
    # Request 0 uses pool row 2, request 1 row 4; new tokens occupy the tail of each row.
    out_cache_loc = ROWS[2][prefix[0] : prefix[0] + extend[0]] + ROWS[4][prefix[1] : prefix[1] + extend[1]]
    positions = list(range(prefix[0], prefix[0] + extend[0])) + list(range(prefix[1], prefix[1] + extend[1]))
    fb = extend_batch(env.ForwardMode.EXTEND, pool_rows=[2, 4], prefix=prefix, extend=extend, out_cache_loc=out_cache_loc, positions=positions)
    batch = batch_from_forward_batch(fb, pool.req_to_token, KV_CACHE_SIZE)
    assert batch.forward_mode is ForwardMode.EXTEND
    assert batch.prefix_lens.tolist() == prefix
    assert batch.extend_lens.tolist() == extend
    assert batch.kv_lens.tolist() == [p + e for p, e in zip(prefix, extend)]
    assert batch.slot_ids.tolist() == ROWS[2][: prefix[0] + extend[0]] + ROWS[4][: prefix[1] + extend[1]]
    assert batch.out_cache_loc.tolist() == out_cache_loc
    assert batch.query_cols.tolist() == positions  # the row's tail: prefix + i

    # Triton extend plans read only the prefix from the cache (the new K/V come as arguments).
    metadata = extend_metadata(qo_indptr=[0, extend[0], sum(extend)], kv_indptr=[0, prefix[0], sum(prefix)], kv_indices=expect_kv_indices, max_extend_len=max(extend))
    plan = plan_from_backend(triton_backend(metadata))
    assert plan.tensors["kv_indices"].tolist() == expect_kv_indices
    assert plan.scalars["max_extend_len"] == max(extend) and plan.scalars["is_causal"] is True
    trace, path = saved_and_loaded(make_trace(batch, plan=plan), tmp_path)
    assert_replays_clean(trace, path)
    assert_checks_clean(path)


def test_mixed_step(tmp_path) -> None:
    """MIXED: a chunked prefill (row 2: 2 cached + 3 new) with a decode request (row 6: 6 cached + 1)."""
    pool = env.req_pool(ROWS)
    fb = extend_batch(
        env.ForwardMode.MIXED,
        pool_rows=[2, 6],
        prefix=[2, 6],
        extend=[3, 1],
        out_cache_loc=[9, 40, 41, 27],
        positions=[2, 3, 4, 6],
    )
    batch = batch_from_forward_batch(fb, pool.req_to_token, KV_CACHE_SIZE)
    assert batch.forward_mode is ForwardMode.MIXED
    assert batch.prefix_lens.tolist() == [2, 6]
    assert batch.extend_lens.tolist() == [3, 1]
    assert batch.slot_ids.tolist() == [7, 8, 9, 40, 41, 21, 22, 23, 24, 25, 26, 27]
    assert batch.query_cols.tolist() == [2, 3, 4, 6]
    metadata = extend_metadata(qo_indptr=[0, 3, 4], kv_indptr=[0, 2, 8], kv_indices=[7, 8, 21, 22, 23, 24, 25, 26], max_extend_len=3)
    trace, path = saved_and_loaded(make_trace(batch, plan=plan_from_backend(triton_backend(metadata))), tmp_path)
    assert_replays_clean(trace, path)
    assert_checks_clean(path)


def test_inconsistent_lengths_are_a_clear_error() -> None:
    pool = env.req_pool(ROWS)
    fb = extend_batch(env.ForwardMode.EXTEND, pool_rows=[2], prefix=[3], extend=[4], out_cache_loc=[40, 41, 42, 43], positions=[3, 4, 5, 6])
    fb.seq_lens = t([6])  # disagrees with prefix 3 + extend 4
    with pytest.raises(ValueError, match=r"extend_prefix_lens 3 \+ extend_seq_lens 4 != seq_lens 6"):
        batch_from_forward_batch(fb, pool.req_to_token, KV_CACHE_SIZE)


def test_idle_steps_are_not_recorded() -> None:
    from attndbg.record.sglang.batch import UnsupportedStep

    pool = env.req_pool(ROWS)
    fb = env.ForwardBatch(
        forward_mode=env.ForwardMode.IDLE, batch_size=0, input_ids=t([]), req_pool_indices=t([]), seq_lens=t([]), out_cache_loc=t([]), seq_lens_sum=0
    )
    with pytest.raises(UnsupportedStep, match="IDLE"):
        batch_from_forward_batch(fb, pool.req_to_token, KV_CACHE_SIZE)
