"""Engine conventions (attndbg/trace/engines.py): looked up from a trace's `source.engine`, with
SGLang's for an engine the table does not know; the vLLM and transformers plan names are the ones
their recorders write."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.record.vllm.fields import COMMON_PREFIX, FIELDS_BY_NAME
from attndbg.record.transformers import trace as transformers_trace
from attndbg.trace.engines import DEFAULT, SGLANG, TRANSFORMERS, VLLM, engine_conventions
from tests.factories import make_trace


@pytest.mark.parametrize(
    "engine, expected",
    [("sglang", SGLANG), ("vllm", VLLM), ("synth", SGLANG), ("transformers", TRANSFORMERS), ("tensorrt-llm", SGLANG), ("", SGLANG)],
)
def test_conventions_by_engine_name(engine: str, expected) -> None:
    """Every engine but vLLM and transformers reads as SGLang's (the DEFAULT): what the checker did
    before conventions were data. transformers differs only where SGLang's rules never applied to
    it: its raw cache indices (kept as evidence when one is outside the cache) and no request pool."""
    trace = make_trace("decode-gqa", "kv_lens=5,9")
    assert engine_conventions(replace(trace, source=replace(trace.source, engine=engine))) is expected
    assert DEFAULT is SGLANG


def test_vllm_metadata_names_are_what_its_recorder_writes() -> None:
    names = VLLM.metadata
    assert names is not None
    tensors = (names.query_start_loc[0], names.seq_lens[0], names.block_table[0], names.slot_mapping[0])
    mirrors = (names.query_start_loc_cpu, names.seq_lens_cpu, names.num_computed_tokens_cpu, names.seq_lens_cpu_upper_bound)
    for name in tensors + mirrors:
        assert name.startswith(COMMON_PREFIX) and name[len(COMMON_PREFIX) :] in FIELDS_BY_NAME, name


def test_transformers_token_index_names_are_what_its_recorder_writes() -> None:
    names = TRANSFORMERS.token_indices
    assert names is not None
    assert names.fields == transformers_trace.EVIDENCE_INDICES and names.bound == transformers_trace.TOKEN_ROWS
    assert TRANSFORMERS.verify_seq_lens is SGLANG.verify_seq_lens and TRANSFORMERS.metadata is None
