"""What every recorded SGLang step must satisfy, and the pieces shared by the step tests.

A recorded trace must (1) survive `io.save` -> `io.load` (the validator accepts it), (2) replay
clean through the `reference` and `triton` backends, with the plan derived from the batch and with
the plan the engine recorded, and (3) give no finding in `attndbg check`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace.build import source
from attndbg.record.sglang.model import model_from_layer
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.replay.variants import Recorded
from attndbg.trace import io
from attndbg.trace.schema import Batch, Graph, Plan, Spec, Trace
from tests.record import sglang_env as env


def triton_backend(metadata: Any, *, max_kv_splits: int = 8, sliding_window_size: int | None = None) -> Any:
    """The real TritonAttnBackend class holding `metadata`; its __init__ needs a ModelRunner and a
    GPU, so it is bypassed and only the attributes the plan reader uses are set."""
    backend = object.__new__(env.TritonAttnBackend)
    backend.forward_metadata = metadata
    backend.max_kv_splits = max_kv_splits
    backend.sliding_window_size = sliding_window_size
    return backend


def decode_metadata(kv_indptr: list[int], kv_indices: list[int], num_kv_splits: list[int]) -> Any:
    """SGLang's Triton ForwardMetadata of a decode step, with the scratch shapes SGLang allocates."""
    bs = len(num_kv_splits)
    return env.TritonForwardMetadata(
        attn_logits=torch.empty(bs, 4, 8, 16),
        attn_lse=torch.empty(bs, 4, 8),
        max_extend_len=None,
        num_kv_splits=torch.tensor(num_kv_splits, dtype=env.I32),
        kv_indptr=torch.tensor(kv_indptr, dtype=env.I32),
        kv_indices=torch.tensor(kv_indices, dtype=env.I64),
        qo_indptr=None,
        custom_mask=None,
        mask_indptr=None,
        window_kv_indptr=None,
        window_kv_indices=None,
        window_num_kv_splits=None,
        window_kv_offsets=None,
    )


def extend_metadata(*, qo_indptr: list[int], kv_indptr: list[int], kv_indices: list[int], max_extend_len: int, custom_mask: torch.Tensor | None = None, mask_indptr: list[int] | None = None) -> Any:
    return env.TritonForwardMetadata(
        attn_logits=None,
        attn_lse=None,
        max_extend_len=max_extend_len,
        num_kv_splits=None,
        kv_indptr=torch.tensor(kv_indptr, dtype=env.I32),
        kv_indices=torch.tensor(kv_indices, dtype=env.I64),
        qo_indptr=torch.tensor(qo_indptr, dtype=env.I32),
        custom_mask=custom_mask,
        mask_indptr=None if mask_indptr is None else torch.tensor(mask_indptr, dtype=env.I64),
        window_kv_indptr=None,
        window_kv_indices=None,
        window_num_kv_splits=None,
        window_kv_offsets=None,
    )


def make_trace(batch: Batch, *, plan: Plan | None, spec: Spec | None = None, graph: Graph | None = None, step: int = 0) -> Trace:
    """A trace around recorded pieces; the Model comes from a real RadixAttention (4 q heads, 2 KV, d=16)."""
    model = model_from_layer(env.layer(heads=4, kv_heads=2, head_dim=16), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=1)
    src = source(engine="sglang", backend="triton", device="cpu", step=step, engine_version="test")
    return Trace(source=src, model=model, batch=batch, seed=step + 1, spec=spec, graph=graph, plan=plan)


def saved_and_loaded(trace: Trace, tmp_path: Path) -> tuple[Trace, Path]:
    path = io.save(trace, tmp_path / f"step_{trace.source.step}.pt")
    return io.load(path), path


def assert_replays_clean(trace: Trace, path: Path, *, expect_recorded: bool = True) -> None:
    source = PlanSource.BOTH if expect_recorded else PlanSource.DERIVED
    result = replay(trace, str(path), ["reference", "triton"], ReplayOptions(plan=source))
    variants = {(run.name, run.variant.label): run for run in result.runs}
    if expect_recorded:
        assert ("triton", "recorded plan") in variants, list(variants)
    for run in result.runs:
        if run.name == "reference" and isinstance(run.variant, Recorded):
            continue  # the plan was built by the engine's triton backend, not the reference's
        assert run.status is RunStatus.PASSED, (run.name, run.variant, run.reason, run.comparison)


def assert_checks_clean(path: Path) -> None:
    reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("triton",))))
    findings = [(f.kind.value, f.check, f.evidence) for report in reports for f in report.findings]
    assert findings == [], findings


def with_plan(trace: Trace, plan: Plan) -> Trace:
    return replace(trace, plan=plan)


def decode_batch() -> object:
    """Two decoding requests (pool rows 1 and 5, KV lengths 5 and 9) as SGLang builds them."""
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.tensor([101, 102], dtype=torch.int64),
        req_pool_indices=torch.tensor([1, 5], dtype=torch.int64),
        seq_lens=torch.tensor([5, 9], dtype=torch.int64),
        out_cache_loc=torch.tensor([15, 38], dtype=torch.int64),
        seq_lens_sum=14,
        positions=torch.tensor([4, 8], dtype=torch.int64),
        seq_lens_cpu=torch.tensor([5, 9], dtype=torch.int64),
    )
