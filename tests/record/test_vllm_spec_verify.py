"""A vLLM speculative verify step recorded through the installed hook: vLLM's real
SpeculativeConfig (ngram, 3 speculative tokens) in a real VllmConfig, vLLM's real
TritonAttentionMetadataBuilder built from it (it sizes its 3-D softmax scratch by the verify query
length, 1 + num_speculative_tokens), and a real CommonAttentionMetadata laid out as vLLM's runner
lays out a uniform spec-decode batch: every request `max_decode_query_len` tokens (the verified
token and its drafts), seq_lens counting the drafts, FULL-graph padded rows seq_len 0 with their
tokens at slot -1. Recorded, the step is TARGET_VERIFY with a chain tree and `attndbg check` has no
finding; with one planted mistake it names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attndbg.record.session import RecordingSession
from attndbg.trace.schema import ForwardMode, Trace
from tests.record.check_cli import findings
from tests.record.engines import import_engine
from tests.record.vllm_builder_env import HEAD_DIM, KV_HEADS, LAYERS, kv_cache_interface, triton_attn, written
from tests.record.vllm_builder_env import session  # noqa: F401  (fixture)
from tests.record.vllm_env import BLOCK_SIZE, NUM_BLOCKS, make_layout, tiny_vllm_config

vllm_cfg = import_engine("vllm.config")
vllm_backend = import_engine("vllm.v1.attention.backend")

SPEC_TOKENS = 3
PREFIX = [17, 30]  # tokens already in the cache before this step


@pytest.fixture(scope="module")
def spec_config(tmp_path_factory: pytest.TempPathFactory):
    """A VllmConfig with vLLM's own SpeculativeConfig (ngram drafts need no draft model)."""
    base = tiny_vllm_config(tmp_path_factory.mktemp("tiny-llama-spec"), q_heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    speculative = vllm_cfg.SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=SPEC_TOKENS,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=base.model_config,
        target_parallel_config=base.parallel_config,
    )
    config = vllm_cfg.VllmConfig(
        model_config=base.model_config,
        cache_config=vllm_cfg.CacheConfig(block_size=BLOCK_SIZE),
        device_config=vllm_cfg.DeviceConfig(device="cpu"),
        speculative_config=speculative,
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # the engine process's pool after profiling
    return config


def verify_layout(config, *, pad_reqs: int = 0):
    """The runner's uniform spec-decode batch: each request 1 + num_speculative_tokens query tokens
    (vLLM's own max_decode_query_len), seq_len = prefix + those tokens; padded rows as vLLM 0.33 pads."""
    query_len = vllm_backend.max_decode_query_len(config)
    assert query_len == 1 + SPEC_TOKENS
    return make_layout([p + query_len for p in PREFIX], [query_len] * len(PREFIX), seed=5, pad_reqs=pad_reqs, pad_tokens=pad_reqs * query_len)


def record(session: RecordingSession, config, cm) -> tuple[Trace, Path]:  # noqa: F811 - the fixture's value
    spec = kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    builder = triton_attn.TritonAttentionMetadataBuilder(spec, LAYERS, config, torch.device("cpu"))
    # vLLM sized the 3-D scratch for verify batches: rows = sequences x (1 + num_speculative_tokens).
    assert builder.softmax_segm_output.shape[0] % (1 + SPEC_TOKENS) == 0
    builder.build(0, cm)
    [trace] = written(session)
    assert session.stats.stopped_reason is None
    entry = next(iter(sorted(session.out_dir.glob("*.pt"))))
    return trace, entry


@pytest.mark.parametrize("pad_reqs", [0, 2], ids=["eager", "graph-padded"])
def test_a_spec_decode_verify_step_is_recorded_as_verify_and_clean(session, spec_config, pad_reqs: int) -> None:  # noqa: F811
    layout = verify_layout(spec_config, pad_reqs=pad_reqs)
    trace, path = record(session, spec_config, layout.cm)
    assert trace.batch.forward_mode is ForwardMode.TARGET_VERIFY and trace.batch.batch_size == len(PREFIX)
    assert trace.spec.algorithm == "ngram" and trace.spec.draft_token_num == 1 + SPEC_TOKENS
    assert trace.spec.parents.tolist() == [[-1, 0, 1, 2]] * len(PREFIX)  # vLLM drafts a chain
    assert trace.batch.prefix_lens.tolist() == PREFIX
    assert trace.batch.out_cache_loc.tolist() == layout.new_token_slots()
    assert (trace.graph is not None) == bool(pad_reqs)
    if pad_reqs:
        assert trace.graph.capture_bs == len(PREFIX) + pad_reqs and trace.graph.padded_seq_lens.tolist()[len(PREFIX) :] == [0] * pad_reqs
    assert findings(path) == set()


def test_a_verify_step_whose_seq_lens_miss_the_drafts_is_named(session, spec_config) -> None:  # noqa: F811
    """seq_lens written as prefix + 1 (a decode's), the drafts forgotten: the kernel would read only
    the prefix and the verified token, never the drafts' own KV."""
    layout = verify_layout(spec_config, pad_reqs=2)
    cm = layout.cm
    wrong = cm.seq_lens.clone()
    wrong[: len(PREFIX)] = torch.tensor([p + 1 for p in PREFIX], dtype=wrong.dtype)
    trace, path = record(session, spec_config, cm.replace(seq_lens=wrong, seq_lens_cpu_upper_bound=wrong.clone()))
    assert trace.plan.tensors["common.seq_lens"].tolist() == [p + 1 for p in PREFIX] + [0, 0]  # verbatim
    found = findings(path, only="invariants,fill-value,tree-mask", backend="reference")
    # The batch takes the engine's seq_lens (kv 18 and 31: prefix 14 and 27): its positions and
    # slots disagree with the engine's by the 3 drafts, at request 0's first token.
    assert findings(path, only="invariants,fill-value,tree-mask", backend="reference") == {
        ("invariants", "positions", "batch.positions[0]"),
        ("invariants", "slot-mapping", "plan.common.slot_mapping[0]"),
    }
