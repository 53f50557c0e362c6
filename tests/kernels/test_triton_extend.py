"""Extend kernel (backends/triton_kernels/extend.py) against a float64 torch reference.

Runs on the kernel device of this machine: CPU tensors under TRITON_INTERPRET=1 (CI), CUDA tensors
with compiled Triton on a GPU. Shapes too large for the interpreter are marked `gpu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from attndbg.backends.triton_kernels.extend import extend_attention_fwd
from attndbg.machine import kernel_device
from tests.kernels.budget import LSE_ATOL, check_against_reference, output_atol

DEVICE = kernel_device()

# ---------------------------------------------------------------------------------------------
# Problem factory, masks and float64 reference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtendCase:
    q_extend: torch.Tensor  # [T, Hq, Dk]
    k_extend: torch.Tensor  # [T, Hkv, Dk]
    v_extend: torch.Tensor  # [T, Hkv, Dv]
    k_buffer: torch.Tensor  # [N, Hkv, Dk]
    v_buffer: torch.Tensor  # [N, Hkv, Dv]
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # prefix slot ids
    masks: list[torch.Tensor] | None  # per request [e_b, p_b + e_b] bool (CPU), or None
    is_causal: bool
    skip_prefix_custom_mask: bool
    sliding_window: int
    sm_scale: float
    logit_cap: float

    @property
    def prefix_lens(self) -> list[int]:
        return self.kv_indptr.diff().tolist()

    @property
    def extend_lens(self) -> list[int]:
        return self.qo_indptr.diff().tolist()

    @property
    def v_max(self) -> float:
        return max(float(self.v_buffer.abs().max()), float(self.v_extend.abs().max()))

    def flat_mask(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SGLang's layout: the row-major blocks back to back, mask_indptr = cumsum(e * (p + e))."""
        if self.masks is None:
            return None, None
        flat = torch.cat([m.flatten() for m in self.masks])
        sizes = torch.tensor([m.numel() for m in self.masks])
        mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        return flat.to(DEVICE), mask_indptr.to(DEVICE)


def tree_mask(prefix_len: int, extend_len: int, gen: torch.Generator) -> torch.Tensor:
    """Speculative-verify tree: token i > 0 hangs under a random earlier token; row i sees the
    whole prefix, its ancestors and itself."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, extend_len)]
    mask = torch.zeros(extend_len, prefix_len + extend_len, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i in range(extend_len):
        node = i
        while node >= 0:
            mask[i, prefix_len + node] = True
            node = parents[node]
    return mask


def random_mask(prefix_len: int, extend_len: int, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary visibility, prefix columns included (about 40% False)."""
    return torch.rand(extend_len, prefix_len + extend_len, generator=gen) < 0.6


MASK_BUILDERS = {"tree": tree_mask, "random": random_mask}


def make_extend_case(
    *,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    dk: int = 64,
    dv: int = 64,
    dtype: torch.dtype = torch.float16,
    is_causal: bool = True,
    mask: str | None = None,
    skip_prefix_custom_mask: bool = True,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    shared_slots: bool = False,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> ExtendCase:
    """Random tensors; prefix slots scattered over a cache twice the size needed. With
    shared_slots every request after the first reuses request 0's first prefix slots."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_slots = sum(extend_lens), 2 * sum(prefix_lens) + 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    free = torch.randperm(num_slots, generator=gen)
    per_request, used = [], 0
    for b, n in enumerate(prefix_lens):
        shared = per_request[0][: min(n, len(per_request[0])) // 2] if shared_slots and b > 0 else free[:0]
        own = free[used : used + n - len(shared)]
        used += n - len(shared)
        per_request.append(torch.cat([shared, own]))

    def indptr(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    masks = None
    if mask is not None:
        masks = [MASK_BUILDERS[mask](p, e, gen) for p, e in zip(prefix_lens, extend_lens)]
    return ExtendCase(
        q_extend=randn(num_tokens, num_q_heads, dk),
        k_extend=randn(num_tokens, num_kv_heads, dk),
        v_extend=randn(num_tokens, num_kv_heads, dv),
        k_buffer=randn(num_slots, num_kv_heads, dk),
        v_buffer=randn(num_slots, num_kv_heads, dv),
        qo_indptr=indptr(extend_lens),
        kv_indptr=indptr(prefix_lens),
        kv_indices=torch.cat(per_request).to(index_dtype).to(DEVICE),
        masks=masks,
        is_causal=is_causal,
        skip_prefix_custom_mask=skip_prefix_custom_mask,
        sliding_window=sliding_window,
        sm_scale=1.0 / math.sqrt(dk),
        logit_cap=logit_cap,
    )


def visibility(case: ExtendCase, b: int) -> torch.Tensor:
    """[e_b, p_b + e_b] bool: which key columns each new token of request b attends to."""
    p, e = case.prefix_lens[b], case.extend_lens[b]
    i = torch.arange(e)[:, None]  # query index; its own column is c = p + i
    j = torch.arange(p + e)[None, :]  # key column
    custom = case.masks[b] if case.masks is not None else None
    if custom is not None and not case.skip_prefix_custom_mask:
        prefix_visible = custom[:, :p]
    else:
        prefix_visible = torch.ones(e, p, dtype=torch.bool)
    if custom is not None:
        extend_visible = custom[:, p:]
    elif case.is_causal:
        extend_visible = j[:, p:] - p <= i
    else:
        extend_visible = torch.ones(e, e, dtype=torch.bool)
    visible = torch.cat([prefix_visible, extend_visible], dim=1)
    if case.sliding_window >= 0:
        visible &= (p + i) - j <= case.sliding_window
    return visible


def reference_extend(case: ExtendCase) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention per request over [prefix from the cache ; new tokens] with the explicit
    visibility matrix. Returns out [T, Hq, Dv] and natural-log lse [T, Hq] (-inf: nothing visible)."""
    q = case.q_extend.double().cpu()
    k_ext, v_ext = case.k_extend.double().cpu(), case.v_extend.double().cpu()
    k_buf, v_buf = case.k_buffer.double().cpu(), case.v_buffer.double().cpu()
    qo, kv, slots = case.qo_indptr.tolist(), case.kv_indptr.tolist(), case.kv_indices.cpu().long()
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // k_ext.shape[1]
    out = torch.zeros(num_tokens, num_q_heads, v_ext.shape[-1], dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float64)
    for b in range(len(qo) - 1):
        rows = slice(qo[b], qo[b + 1])
        prefix = slots[kv[b] : kv[b + 1]]
        k = torch.cat([k_buf[prefix], k_ext[rows]]).repeat_interleave(group, dim=1)  # [p+e, Hq, Dk]
        v = torch.cat([v_buf[prefix], v_ext[rows]]).repeat_interleave(group, dim=1)  # [p+e, Hq, Dv]
        scores = torch.einsum("ihd,jhd->hij", q[rows], k) * case.sm_scale
        if case.logit_cap > 0:
            scores = case.logit_cap * torch.tanh(scores / case.logit_cap)
        scores = scores.masked_fill(~visibility(case, b), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, e]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)  # rows with nothing: 0
        lse[rows] = row_lse.T
        out[rows] = torch.einsum("hij,jhd->ihd", probs, v)
    return out, lse


def run_extend(case: ExtendCase, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel into NaN-poisoned outputs (rows it should write but does not stay NaN)."""
    num_tokens, num_q_heads, _ = case.q_extend.shape
    o = torch.full((num_tokens, num_q_heads, case.v_extend.shape[-1]), float("nan"),
                   dtype=case.q_extend.dtype, device=DEVICE)
    lse = torch.full((num_tokens, num_q_heads), float("nan"), dtype=torch.float32, device=DEVICE)
    custom_mask, mask_indptr = case.flat_mask()
    args = dict(
        q_extend=case.q_extend,
        k_extend=case.k_extend,
        v_extend=case.v_extend,
        o_extend=o,
        lse_extend=lse,
        k_buffer=case.k_buffer,
        v_buffer=case.v_buffer,
        qo_indptr=case.qo_indptr,
        kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        is_causal=case.is_causal,
        max_len_extend=max(case.extend_lens),
        sm_scale=case.sm_scale,
        logit_cap=case.logit_cap,
        skip_prefix_custom_mask=case.skip_prefix_custom_mask,
        sliding_window=case.sliding_window,
    )
    extend_attention_fwd(**{**args, **overrides})
    return o, lse


def check_extend(case: ExtendCase) -> None:
    out, lse = run_extend(case)
    ref_out, ref_lse = reference_extend(case)
    check_against_reference(out, lse, ref_out, ref_lse, dtype=case.q_extend.dtype, v_max=case.v_max)


# A batch with: no prefix, a request with extend length 0 in the middle, extend length 1, and
# a long one spanning several query and key tiles.
PREFIX_LENS = [0, 37, 50, 70]
EXTEND_LENS = [20, 0, 1, 40]

MASK_MODES = {
    "causal": dict(is_causal=True),
    "non-causal": dict(is_causal=False),
    "tree": dict(mask="tree"),
    "random-skip-prefix": dict(mask="random", skip_prefix_custom_mask=True),
    "random-masked-prefix": dict(mask="random", skip_prefix_custom_mask=False),
}


# ---------------------------------------------------------------------------------------------
# Tests against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MASK_MODES.values(), ids=MASK_MODES.keys())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_extend_masks(dtype, mode):
    case = make_extend_case(prefix_lens=PREFIX_LENS, extend_lens=EXTEND_LENS, dtype=dtype, **mode)
    if case.masks is not None and not case.skip_prefix_custom_mask:
        assert not case.masks[3][:, :70].all()  # prefix columns partly hidden
    check_extend(case)


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"]
)
def test_extend_grouping(num_q_heads, num_kv_heads):
    case = make_extend_case(
        prefix_lens=PREFIX_LENS, extend_lens=EXTEND_LENS, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, dk=128, dv=128, dtype=torch.bfloat16,
    )
    check_extend(case)


def test_extend_fp32():
    case = make_extend_case(
        prefix_lens=PREFIX_LENS, extend_lens=EXTEND_LENS, dtype=torch.float32, mask="tree"
    )
    check_extend(case)


@pytest.mark.parametrize(
    "dk,dv", [(96, 96), (80, 80), (192, 128)], ids=["d96", "d80", "dk192-rope-tail"]
)
def test_extend_head_dims(dk, dv):
    case = make_extend_case(prefix_lens=[0, 45], extend_lens=[33, 17], dk=dk, dv=dv, dtype=torch.bfloat16)
    check_extend(case)


@pytest.mark.parametrize(
    "window,mode",
    [(0, "causal"), (16, "causal"), (16, "non-causal"), (24, "tree"), (100, "causal")],
    ids=["w0-causal", "w16-causal", "w16-non-causal", "w24-tree", "w100-causal"],
)
def test_extend_sliding_window(window, mode):
    # The 150-token prefix lets the kernel skip whole key tiles before the window.
    case = make_extend_case(
        prefix_lens=[150, 0, 20], extend_lens=[40, 30, 1], sliding_window=window, **MASK_MODES[mode]
    )
    check_extend(case)


def test_extend_logit_cap():
    case = make_extend_case(prefix_lens=[30, 64], extend_lens=[20, 8], logit_cap=5.0, dtype=torch.bfloat16)
    case = replace(case, q_extend=case.q_extend * 8)  # scores well past the cap
    check_extend(case)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_extend_shared_slots(index_dtype):
    case = make_extend_case(
        prefix_lens=[60, 50, 40], extend_lens=[5, 9, 3], shared_slots=True, index_dtype=index_dtype
    )
    slots = case.kv_indices.cpu()
    assert slots[60:85].tolist() == slots[:25].tolist()  # request 1 shares request 0's slots
    check_extend(case)


@pytest.mark.parametrize("skip_prefix", [True, False], ids=["skip-prefix", "masked-prefix"])
def test_extend_row_that_sees_nothing(skip_prefix):
    # A mask row that is all False (and, with no prefix or a masked prefix, sees no key at all)
    # must give output 0 and lse -inf, not NaN.
    case = make_extend_case(prefix_lens=[0, 12], extend_lens=[6, 6], mask="random",
                            skip_prefix_custom_mask=skip_prefix)
    for m in case.masks:
        m[2] = False
    check_extend(case)
    ref_lse = reference_extend(case)[1]
    assert (ref_lse[2] == float("-inf")).all()  # request 0's third row is truly empty


# ---------------------------------------------------------------------------------------------
# Mechanism: the two phases (prefix from the cache, new tokens from k/v_extend)
# ---------------------------------------------------------------------------------------------


def test_prefix_phase_equals_extend_phase():
    # The same 70 tokens, once as 50 cached + 20 new and once as 70 new: the last 20 queries see
    # the same keys through different phases, so the answers agree (within twice the output
    # tolerance: each is within it of float64).
    split = make_extend_case(prefix_lens=[50], extend_lens=[20], dtype=torch.bfloat16)
    prefix_slots = split.kv_indices.long()
    whole = replace(
        split,
        q_extend=torch.cat([torch.zeros_like(split.q_extend[:1]).expand(50, -1, -1), split.q_extend]),
        k_extend=torch.cat([split.k_buffer[prefix_slots], split.k_extend]),
        v_extend=torch.cat([split.v_buffer[prefix_slots], split.v_extend]),
        qo_indptr=torch.tensor([0, 70], dtype=torch.int32, device=DEVICE),
        kv_indptr=torch.tensor([0, 0], dtype=torch.int32, device=DEVICE),
        kv_indices=split.kv_indices[:0],
    )
    out_split, lse_split = run_extend(split)
    out_whole, lse_whole = run_extend(whole)
    check_extend(split)
    check_extend(whole)
    atol = output_atol(torch.bfloat16, split.v_max)
    assert (out_whole[50:].double() - out_split.double()).abs().max() <= 2 * atol
    assert (lse_whole[50:] - lse_split).abs().max() <= 2 * LSE_ATOL


def test_wrong_mask_indptr_is_detected():
    # Mask offsets that ignore the prefix (e * e instead of e * (p + e) per request: the kind of
    # layout bug the tree-mask detector hunts) read the wrong bits: the check fails.
    case = make_extend_case(prefix_lens=[10, 20, 30], extend_lens=[8, 8, 8], mask="tree")
    out, lse = run_extend(case)
    ref_out, ref_lse = reference_extend(case)
    check_against_reference(out, lse, ref_out, ref_lse, dtype=torch.float16, v_max=case.v_max)

    wrong_indptr = torch.arange(4, dtype=torch.int64, device=DEVICE) * 8 * 8
    out, lse = run_extend(case, mask_indptr=wrong_indptr)
    with pytest.raises(AssertionError):
        check_against_reference(out, lse, ref_out, ref_lse, dtype=torch.float16, v_max=case.v_max)


# ---------------------------------------------------------------------------------------------
# GPU-only shapes (too slow for the interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["causal", "tree"])
def test_extend_large_gpu(mode):
    case = make_extend_case(
        prefix_lens=[2000, 0, 513, 1200], extend_lens=[300, 700, 1, 129], num_q_heads=32,
        num_kv_heads=8, dk=128, dv=128, dtype=torch.bfloat16, **MASK_MODES[mode],
    )
    check_extend(case)


@pytest.mark.gpu
def test_extend_large_sliding_window_gpu():
    case = make_extend_case(
        prefix_lens=[3000, 100], extend_lens=[500, 257], num_q_heads=16, num_kv_heads=4,
        dk=128, dv=128, dtype=torch.float16, sliding_window=1024,
    )
    check_extend(case)
