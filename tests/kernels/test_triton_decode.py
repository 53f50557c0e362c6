"""Split-KV decode kernel (backends/triton_kernels/decode.py) against a float64 torch reference.

Runs on the kernel device of this machine: CPU tensors under TRITON_INTERPRET=1 (CI), CUDA tensors
with compiled Triton on a GPU. Shapes too large for the interpreter are marked `gpu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from attndbg.backends.triton_kernels.decode import (
    decode_attention_fwd,
    decode_stage1,
    decode_stage2,
)
from attndbg.machine import kernel_device
from tests.kernels.budget import LSE_ATOL, check_against_reference, output_atol

DEVICE = kernel_device()

def check_buffers(case: DecodeCase, buffers: DecodeBuffers, reference=None) -> None:
    """The kernel's o and lse in `buffers` against the float64 reference of `case`."""
    ref_out, ref_lse = reference if reference is not None else reference_decode(case)
    check_against_reference(buffers.o, buffers.lse, ref_out, ref_lse, dtype=case.q.dtype, v_max=case.v_max)


# ---------------------------------------------------------------------------------------------
# Problem factory and float64 reference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeCase:
    q: torch.Tensor  # [bs, Hq, Dk]
    k_buffer: torch.Tensor  # [N, Hkv, Dk]
    v_buffer: torch.Tensor  # [N, Hkv, Dv] (MLA: a view of k_buffer)
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # slot ids
    sm_scale: float
    logit_cap: float

    @property
    def v_max(self) -> float:
        return float(self.v_buffer.abs().max())


def make_decode_case(
    *,
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    mla: bool = False,
    shared_slots: bool = False,
    index_dtype: torch.dtype = torch.int32,
    logit_cap: float = 0.0,
    seed: int = 0,
) -> DecodeCase:
    """Random q and KV cache; each request's slots are scattered over a cache twice the size
    needed. With shared_slots, every request after the first starts with slots of request 0
    (a shared prefix, as with radix caching)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * sum(seq_lens) + 8
    if mla:
        # MLA: one latent head; V is the first dv columns of the same cache rows (a strided view)
        k_buffer = torch.randn(num_slots, 1, dk, generator=gen).to(dtype)
        v_buffer = k_buffer[..., :dv]
    else:
        k_buffer = torch.randn(num_slots, num_kv_heads, dk, generator=gen).to(dtype)
        v_buffer = torch.randn(num_slots, num_kv_heads, dv, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_q_heads, dk, generator=gen).to(dtype)

    free = torch.randperm(num_slots, generator=gen)
    per_request, used = [], 0
    for b, n in enumerate(seq_lens):
        shared = per_request[0][: min(n, len(per_request[0])) // 2] if shared_slots and b > 0 else free[:0]
        own = free[used : used + n - len(shared)]
        used += n - len(shared)
        per_request.append(torch.cat([shared, own]))
    kv_indices = torch.cat(per_request).to(index_dtype)
    kv_indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)

    k_buffer_dev = k_buffer.to(DEVICE)
    v_buffer_dev = k_buffer_dev[..., :dv] if mla else v_buffer.to(DEVICE)
    return DecodeCase(
        q=q.to(DEVICE),
        k_buffer=k_buffer_dev,
        v_buffer=v_buffer_dev,
        kv_indptr=kv_indptr.to(DEVICE),
        kv_indices=kv_indices.to(DEVICE),
        sm_scale=1.0 / math.sqrt(dk),
        logit_cap=logit_cap,
    )


def reference_decode(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention per request: gather the request's slots, softmax over them.
    Returns out [bs, Hq, Dv] and natural-log lse [bs, Hq] (-inf for a request with no KV)."""
    q = case.q.double().cpu()
    k_buffer, v_buffer = case.k_buffer.double().cpu(), case.v_buffer.double().cpu()
    indptr, indices = case.kv_indptr.cpu().tolist(), case.kv_indices.cpu().long()
    bs, num_q_heads, _ = q.shape
    group = num_q_heads // k_buffer.shape[1]
    out = torch.zeros(bs, num_q_heads, v_buffer.shape[-1], dtype=torch.float64)
    lse = torch.full((bs, num_q_heads), float("-inf"), dtype=torch.float64)
    for b in range(bs):
        slots = indices[indptr[b] : indptr[b + 1]]
        if len(slots) == 0:
            continue
        k = k_buffer[slots].repeat_interleave(group, dim=1)  # [L, Hq, Dk]
        v = v_buffer[slots].repeat_interleave(group, dim=1)  # [L, Hq, Dv]
        scores = torch.einsum("hd,lhd->hl", q[b], k) * case.sm_scale
        if case.logit_cap > 0:
            scores = case.logit_cap * torch.tanh(scores / case.logit_cap)
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out, lse


@dataclass
class DecodeBuffers:
    """Outputs and scratch, NaN-poisoned so anything the kernel should write but does not shows."""

    o: torch.Tensor  # [bs, Hq, Dv]
    lse: torch.Tensor  # [bs, Hq]
    attn_logits: torch.Tensor  # [bs, Hq, max_kv_splits, Dv]
    attn_lse: torch.Tensor  # [bs, Hq, max_kv_splits]

    @classmethod
    def poisoned(cls, case: DecodeCase, max_kv_splits: int, fill: float = float("nan")) -> DecodeBuffers:
        bs, num_q_heads, _ = case.q.shape
        dv = case.v_buffer.shape[-1]
        f32 = dict(dtype=torch.float32, device=DEVICE)
        return cls(
            o=torch.full((bs, num_q_heads, dv), float("nan"), dtype=case.q.dtype, device=DEVICE),
            lse=torch.full((bs, num_q_heads), float("nan"), **f32),
            attn_logits=torch.full((bs, num_q_heads, max_kv_splits, dv), fill, **f32),
            attn_lse=torch.full((bs, num_q_heads, max_kv_splits), fill, **f32),
        )


def splits_tensor(splits: list[int] | int, bs: int) -> torch.Tensor:
    splits = [splits] * bs if isinstance(splits, int) else splits
    return torch.tensor(splits, dtype=torch.int32, device=DEVICE)


def run_decode(case: DecodeCase, *, splits: list[int] | int, max_kv_splits: int) -> DecodeBuffers:
    buffers = DecodeBuffers.poisoned(case, max_kv_splits)
    decode_attention_fwd(
        q=case.q,
        k_buffer=case.k_buffer,
        v_buffer=case.v_buffer,
        o=buffers.o,
        lse=buffers.lse,
        kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices,
        attn_logits=buffers.attn_logits,
        attn_lse=buffers.attn_lse,
        num_kv_splits=splits_tensor(splits, case.q.shape[0]),
        max_kv_splits=max_kv_splits,
        sm_scale=case.sm_scale,
        logit_cap=case.logit_cap,
    )
    return buffers


def check_decode(case: DecodeCase, *, splits: list[int] | int, max_kv_splits: int) -> None:
    check_buffers(case, run_decode(case, splits=splits, max_kv_splits=max_kv_splits))


# Lengths around the 32-token split granule, length 1, and a few hundred (several tiles).
SEQ_LENS = [1, 31, 32, 33, 300]
# With 8 splits, requests of <= 7 * 32 tokens have empty splits.
SPLITS = {"1-split": 1, "2-splits": 2, "8-splits": 8, "mixed": [1, 8, 2, 8, 3]}


# ---------------------------------------------------------------------------------------------
# Tests against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads",
    [(4, 4), (8, 2), (12, 4), (16, 2), (8, 1)],
    ids=["mha", "gqa4", "gqa3", "gqa8", "mqa8"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_grouping_and_splits(dtype, num_q_heads, num_kv_heads, splits):
    case = make_decode_case(
        seq_lens=SEQ_LENS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dk=128, dv=128, dtype=dtype
    )
    check_decode(case, splits=splits, max_kv_splits=8)


def test_decode_fp32():
    case = make_decode_case(
        seq_lens=SEQ_LENS, num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.float32
    )
    check_decode(case, splits=SPLITS["mixed"], max_kv_splits=8)


@pytest.mark.parametrize(
    "dk,dv",
    [(64, 64), (80, 80), (96, 96), (192, 128), (288, 256)],
    ids=["d64", "d80", "d96", "dk192-rope-tail", "dk288-rope-tail"],
)
def test_decode_head_dims(dk, dv):
    case = make_decode_case(
        seq_lens=SEQ_LENS, num_q_heads=8, num_kv_heads=2, dk=dk, dv=dv, dtype=torch.bfloat16
    )
    check_decode(case, splits=SPLITS["mixed"], max_kv_splits=8)


@pytest.mark.parametrize("num_q_heads", [16, 32], ids=["16-heads", "32-heads-2-head-blocks"])
@pytest.mark.parametrize("splits", [1, 4], ids=["1-split", "4-splits"])
def test_decode_mla(num_q_heads, splits):
    # DeepSeek MLA: one latent kv head, Dk = 512 + 64 rope, V = the first 512 columns of K.
    case = make_decode_case(
        seq_lens=[1, 33, 130], num_q_heads=num_q_heads, num_kv_heads=1, dk=576, dv=512,
        dtype=torch.bfloat16, mla=True,
    )
    assert case.v_buffer.data_ptr() == case.k_buffer.data_ptr() and not case.v_buffer.is_contiguous()
    check_decode(case, splits=splits, max_kv_splits=4)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_decode_shared_slots(index_dtype):
    case = make_decode_case(
        seq_lens=[100, 80, 64], num_q_heads=8, num_kv_heads=2, dk=64, dv=64,
        dtype=torch.float16, shared_slots=True, index_dtype=index_dtype,
    )
    indices = case.kv_indices.cpu()
    assert indices[100:140].tolist() == indices[:40].tolist()  # request 1 shares request 0's slots
    check_decode(case, splits=[2, 3, 1], max_kv_splits=4)


@pytest.mark.parametrize("logit_cap", [5.0, 30.0])
def test_decode_logit_cap(logit_cap):
    case = make_decode_case(
        seq_lens=[40, 200], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.bfloat16,
        logit_cap=logit_cap,
    )
    # scale q up so the cap actually bends the scores (|q.k| * sm_scale well past the cap)
    case = replace(case, q=case.q * 8)
    check_decode(case, splits=[1, 4], max_kv_splits=4)


def test_decode_zero_length_request():
    # A padded request with seq_len 0 (CUDA-graph padding): 0 output and lse -inf, never NaN.
    case = make_decode_case(
        seq_lens=[0, 40, 0], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.float16
    )
    buffers = run_decode(case, splits=[1, 2, 4], max_kv_splits=4)
    assert (buffers.o[[0, 2]] == 0).all()
    assert (buffers.lse[[0, 2]] == float("-inf")).all()
    check_buffers(case, buffers)


def test_decode_scratch_larger_than_batch():
    # Engines keep one split scratch for the largest CUDA-graph batch and max split count and
    # pass it whole: the kernels must index it by its own strides.
    case = make_decode_case(
        seq_lens=[70, 5, 130], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.float16
    )
    buffers = DecodeBuffers.poisoned(case, max_kv_splits=4)
    big = DecodeBuffers.poisoned(replace(case, q=case.q.repeat(3, 1, 1)), max_kv_splits=16)
    decode_attention_fwd(
        q=case.q, k_buffer=case.k_buffer, v_buffer=case.v_buffer, o=buffers.o, lse=buffers.lse,
        kv_indptr=case.kv_indptr, kv_indices=case.kv_indices, attn_logits=big.attn_logits,
        attn_lse=big.attn_lse, num_kv_splits=splits_tensor([4, 1, 3], 3), max_kv_splits=4,
        sm_scale=case.sm_scale,
    )
    check_buffers(case, buffers)


# ---------------------------------------------------------------------------------------------
# Mechanism: the split / merge contract between the stages
# ---------------------------------------------------------------------------------------------


def test_stage1_writes_only_nonempty_splits():
    # 33 tokens in 8 splits: kv_len_per_split = 32, so splits 0-1 hold tokens and 2-7 are empty;
    # stage 1 leaves the scratch of empty splits untouched (here: still NaN).
    case = make_decode_case(
        seq_lens=[33], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.float16
    )
    buffers = DecodeBuffers.poisoned(case, max_kv_splits=8)
    decode_stage1(
        q=case.q, k_buffer=case.k_buffer, v_buffer=case.v_buffer, kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices, attn_logits=buffers.attn_logits, attn_lse=buffers.attn_lse,
        num_kv_splits=splits_tensor(8, 1), max_kv_splits=8, sm_scale=case.sm_scale,
    )
    written = ~torch.isnan(buffers.attn_lse[0, 0]).cpu()
    assert written.tolist() == [True, True] + [False] * 6
    assert torch.isfinite(buffers.attn_logits[:, :, :2]).all()


def test_split_count_does_not_change_the_answer():
    # stage 1 + stage 2 with 1, 2, 3 and 8 splits: each is within the output tolerance of the
    # float64 reference, so any two are within twice that of each other; LSEs likewise.
    case = make_decode_case(
        seq_lens=[300, 257], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.bfloat16
    )
    reference = reference_decode(case)
    runs = {splits: run_decode(case, splits=splits, max_kv_splits=8) for splits in (1, 2, 3, 8)}
    for run in runs.values():
        check_buffers(case, run, reference)
    atol = output_atol(torch.bfloat16, case.v_max)
    for splits, run in runs.items():
        assert (run.o.double() - runs[1].o.double()).abs().max() <= 2 * atol, f"{splits} splits vs 1"
        assert (run.lse - runs[1].lse).abs().max() <= 2 * LSE_ATOL, f"{splits} splits vs 1"


@pytest.mark.parametrize("poison", [float("nan"), 1e3], ids=["nan-scratch", "garbage-scratch"])
def test_stage2_with_more_splits_than_stage1_is_detected(poison):
    # Stage 2 must use the split count stage 1 used. Merging 4 splits over a stage 1 that wrote 2
    # reads partials of the wrong token ranges and unwritten scratch: the reference check fails.
    # (This proves the comparison above can fail.)
    case = make_decode_case(
        seq_lens=[200, 150], num_q_heads=8, num_kv_heads=2, dk=64, dv=64, dtype=torch.float16
    )
    buffers = DecodeBuffers.poisoned(case, max_kv_splits=4, fill=poison)
    scratch = dict(attn_logits=buffers.attn_logits, attn_lse=buffers.attn_lse, max_kv_splits=4)
    decode_stage1(
        q=case.q, k_buffer=case.k_buffer, v_buffer=case.v_buffer, kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices, num_kv_splits=splits_tensor(2, 2), sm_scale=case.sm_scale,
        **scratch,
    )
    reference = reference_decode(case)

    def stage2(splits: int) -> None:
        decode_stage2(
            o=buffers.o, lse=buffers.lse, kv_indptr=case.kv_indptr,
            num_kv_splits=splits_tensor(splits, 2), **scratch,
        )

    stage2(2)
    check_buffers(case, buffers, reference)
    stage2(4)
    with pytest.raises(AssertionError):
        check_buffers(case, buffers, reference)


# ---------------------------------------------------------------------------------------------
# GPU-only shapes (too slow for the interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_large_gqa_gpu(dtype):
    # the benchmark shape's layout (32 q heads / 8 kv heads, d 128) with long, uneven requests
    seq_lens = [4096, 1, 2000, 3333, 64, 4095, 777, 1024]
    case = make_decode_case(seq_lens=seq_lens, num_q_heads=32, num_kv_heads=8, dk=128, dv=128, dtype=dtype)
    check_decode(case, splits=[8, 1, 16, 5, 2, 16, 3, 8], max_kv_splits=16)


@pytest.mark.gpu
def test_decode_large_mla_gpu():
    case = make_decode_case(
        seq_lens=[4096, 1, 1500, 2049], num_q_heads=128, num_kv_heads=1, dk=576, dv=512,
        dtype=torch.bfloat16, mla=True,
    )
    check_decode(case, splits=[8, 1, 4, 16], max_kv_splits=16)
