"""Plan readers for SGLang's non-Triton backends: the field mapping, on SGLang's own metadata classes.

FlashInfer's DecodeMetadata / PrefillMetadata import on CPU and are used as they are; the
FlashInfer wrappers inside them cannot be built without FlashInfer and a GPU, so a namespace holds
the attributes FlashInfer's `plan()` stores (`_paged_kv_indptr_buf`, ...). The modules of
FlashAttentionMetadata (FA3) and FlashMLADecodeMetadata import CUDA-only kernels (sgl_kernel,
flash_mla) at import time, so these two classes are loaded from SGLang's own source file with
`ast`: the class statement SGLang ships, executed without the rest of its module.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import typing
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.record.sglang.model import model_from_layer
from attndbg.record.sglang.plan import plan_from_backend

I32 = env.I32


def sglang_class(module: str, name: str) -> type:
    """Class `name` as defined in SGLang's source of `module`, without importing that module."""
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    namespace = {"dataclass": dataclasses.dataclass, "torch": torch, **{k: getattr(typing, k) for k in ("Optional", "Tuple", "List")}}
    exec(compile("from __future__ import annotations\n" + ast.unparse(node), str(path), "exec"), namespace)
    return namespace[name]


def test_fa3_metadata_fields() -> None:
    FlashAttentionMetadata = sglang_class("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionMetadata")
    md = FlashAttentionMetadata(
        cache_seqlens_int32=torch.tensor([5, 9], dtype=I32),
        max_seq_len_q=1,
        max_seq_len_k=9,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=I32),
        cu_seqlens_k=torch.tensor([0, 5, 14], dtype=I32),
        page_table=torch.tensor([[11, 12, 13, 14, 15, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35, 36, 37, 38]], dtype=I32),
    )
    model = model_from_layer(env.layer(), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    plan = plan_from_backend(SimpleNamespace(forward_metadata=md, page_size=1), model=model)
    assert plan.backend == "fa3"
    assert plan.tensors["cache_seqlens"].tolist() == [5, 9]
    assert plan.tensors["cu_seqlens_k"].tolist() == [0, 5, 14]
    assert plan.tensors["page_table"][1, 8] == 38
    # Read from the metadata and the backend; the call's window and causality from the layer.
    assert plan.scalars == {"max_seqlen_q": 1, "max_seqlen_k": 9, "page_size": 1, "window_left": -1, "verify_path": "causal", "causal": True}


def test_flashmla_metadata_fields() -> None:
    FlashMLADecodeMetadata = sglang_class("sglang.srt.layers.attention.flashmla_backend", "FlashMLADecodeMetadata")
    md = FlashMLADecodeMetadata(num_splits=torch.tensor([0, 1, 2], dtype=I32), block_kv_indices=torch.tensor([[1, -1], [2, 3]], dtype=I32))
    plan = plan_from_backend(SimpleNamespace(forward_metadata=md, page_size=64))
    assert plan.backend == "mla"
    assert plan.tensors["block_table"].tolist() == [[1, -1], [2, 3]]
    assert plan.scalars == {"impl": "flashmla", "page_size": 64}


def test_flashinfer_decode_and_prefill_metadata() -> None:
    wrapper = SimpleNamespace(
        _paged_kv_indptr_buf=torch.tensor([0, 5, 14], dtype=I32),
        _paged_kv_indices_buf=torch.tensor([11, 12, 13, 14, 15, 30, 31, 32, 33, 34, 35, 36, 37, 38, 0, 0], dtype=I32),
        _paged_kv_last_page_len_buf=torch.tensor([1, 1], dtype=I32),
    )
    plan = plan_from_backend(SimpleNamespace(forward_metadata=env.sgl.flashinfer_backend.DecodeMetadata(decode_wrappers=[wrapper])))
    assert plan.backend == "flashinfer" and plan.scalars["path"] == "decode"
    assert plan.tensors["kv_indices"].numel() == 14  # cut to kv_indptr[-1]
    assert plan.tensors["kv_last_page_len"].tolist() == [1, 1]

    prefill = SimpleNamespace(_qo_indptr_buf=torch.tensor([0, 4, 6], dtype=I32), **vars(wrapper))
    md = env.sgl.flashinfer_backend.PrefillMetadata(prefill_wrappers=[prefill], use_ragged=True, extend_no_prefix=False)
    plan = plan_from_backend(SimpleNamespace(forward_metadata=md))
    assert plan.scalars["path"] == "cascade"  # ragged over the new tokens, paged over the prefix
    assert plan.tensors["qo_indptr"].tolist() == [0, 4, 6]


def test_unknown_metadata_gives_no_plan() -> None:
    assert plan_from_backend(SimpleNamespace(forward_metadata=SimpleNamespace(something=1))) is None


def test_flashinfer_window_is_the_one_the_wrapper_was_planned_with() -> None:
    """FlashInfer compiles the per-element window in or out at plan() (sglang#31501): a window
    given at forward applies only where the plan had one. The recorded window_left is the layer's
    where the wrapper was planned with a window, -1 where it was planned without (the wrapper's
    plan-time `_window_left`); where the wrapper keeps none, SGLang's rule: a verify or draft
    extend is planned without one, a paged extend with the layer's."""
    layer = env.RadixAttention(4, 16, 16**-0.5, 2, 0, sliding_window_size=4)
    model = model_from_layer(layer, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    buffers = dict(
        _qo_indptr_buf=torch.tensor([0, 2, 4], dtype=I32),
        _paged_kv_indptr_buf=torch.tensor([0, 5, 10], dtype=I32),
        _paged_kv_indices_buf=torch.arange(10, 20, dtype=I32),
        _paged_kv_last_page_len_buf=torch.tensor([1, 1], dtype=I32),
    )

    def window(*, planned: int | None = None, **mode: bool) -> int:
        wrapper = SimpleNamespace(**buffers, **({} if planned is None else {"_window_left": planned}))
        md = env.sgl.flashinfer_backend.PrefillMetadata(prefill_wrappers=[wrapper], use_ragged=False, extend_no_prefix=False)
        return plan_from_backend(SimpleNamespace(forward_metadata=md), model=model, **mode).scalars["window_left"]

    assert window() == 4 and window(planned=4) == 4  # a paged extend planned with the layer's window
    assert window(planned=-1) == -1  # planned without one: compiled out, whatever forward passes
    assert window(verify=True) == -1 and window(draft_extend=True) == -1  # the tree mask carries it
    assert window(verify=True, planned=4) == 4  # an engine that did plan its verify with a window
