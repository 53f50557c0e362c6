"""One plan contract between the vLLM recorder and the checker, for the builders
the hook wraps that build on the CPU beside TRITON_ATTN (test_vllm_evidence.py): vLLM 0.33's real
`FlashAttentionMetadataBuilder` (FLASH_ATTN), constructed with a real VllmConfig and a real
FullAttentionSpec, its `build` called through the installed hook on real CommonAttentionMetadata,
the recorded step checked with every detector (Triton kernels, interpreted): no finding on vLLM's
own steps, eager and FULL-graph padded; a planted mistake named with its class and location.

vLLM's FlashInfer builder cannot be imported without the flashinfer package (see
test_vllm_padding_conventions.py), so its round trip is GPU-only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attndbg.checks.selection import parse_only
from attndbg.detector_api.findings import FindingClass
from attndbg.record.session import RecordingSession
from attndbg.trace.schema import Trace
from tests.record.engines import import_engine
from tests.record.test_vllm_evidence import CLEAN, MIXED, NO_KERNELS, OUTSIDE_POOL, PADDED, clean_step, findings_of, pool_config, slot, table_entry  # noqa: F401  (fixture)
from tests.record.vllm_builder_env import HEAD_DIM, KV_HEADS, LAYERS, kv_cache_interface, written
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import BLOCK_SIZE, CommonAttentionMetadata, make_layout

flash_attn = import_engine("vllm.v1.attention.backends.flash_attn")


def record(session: RecordingSession, config: Any, cm: CommonAttentionMetadata) -> Trace:
    spec = kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    builder = flash_attn.FlashAttentionMetadataBuilder(spec, LAYERS, config, torch.device("cpu"))
    metadata = builder.build(0, cm)
    assert isinstance(metadata, flash_attn.FlashAttentionMetadata)
    [trace] = written(session)
    assert session.stats.stopped_reason is None
    return trace


@pytest.mark.parametrize(("name", "layout"), CLEAN, ids=[c[0] for c in CLEAN])
def test_flash_attn_steps_are_clean(session: RecordingSession, pool_config, name: str, layout: dict[str, Any]) -> None:
    with clean_step(pool_config, layout) as (cm, _):
        trace = record(session, pool_config, cm)
    assert trace.plan.backend == "FLASH_ATTN" and trace.plan.scalars["vllm.metadata"] == "FlashAttentionMetadata"
    assert {"block_table", "seq_lens", "query_start_loc"} <= set(trace.plan.tensors)  # the builder's own fields, as built
    assert findings_of(session, parse_only(None)) == []


MISTAKES = [
    ("block-past-the-pool", MIXED, lambda cm: table_entry(cm, 2, 0, OUTSIDE_POOL), ("invariants", "index-outside-cache", 2, "plan.common.block_table_tensor[2, 0]")),
    ("slot-mapping-of-another-request", PADDED, lambda cm: slot(cm, 1, 51), ("invariants", "slot-mapping", 1, "plan.common.slot_mapping[1]")),
]


@pytest.mark.parametrize(("name", "layout", "plant", "expected"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_flash_attn_planted_mistake_is_named(session: RecordingSession, pool_config, name: str, layout: dict[str, Any], plant, expected) -> None:
    cm = make_layout(**layout).cm
    record(session, pool_config, cm.replace(**plant(cm)))
    assert findings_of(session, [FindingClass.INVARIANT, FindingClass.FILL_VALUE], backends=NO_KERNELS) == [expected]
