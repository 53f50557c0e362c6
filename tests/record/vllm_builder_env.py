"""vLLM's real TritonAttentionMetadataBuilder under an armed recording session, for the tests that
record through the installed hook (test_vllm_builder, test_vllm_evidence).

The builder is vLLM's own class, constructed with a real VllmConfig (a real ModelConfig read from
a tiny Llama config.json: no weights, no tokenizer) and a real FullAttentionSpec. Import the
fixtures by name into a test module to use them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attndbg.record.vllm import adapter
from attndbg.record.options import RecordOptions
from attndbg.record.session import RecordingSession, end_session, start_session
from attndbg.trace import io
from attndbg.trace.schema import Trace
from tests.record import vllm_env
from tests.record.engines import import_engine
from tests.record.vllm_env import BLOCK_SIZE

triton_attn = import_engine("vllm.v1.attention.backends.triton_attn")
import_engine("vllm.config")  # the builder needs a real VllmConfig
kv_cache_interface = import_engine("vllm.v1.kv_cache_interface")

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
LAYERS = ["model.layers.0.self_attn.attn"]


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return vllm_env.tiny_vllm_config(tmp_path_factory.mktemp("tiny-llama"), q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def new_builder(vllm_config):
    spec = kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return triton_attn.TritonAttentionMetadataBuilder(spec, LAYERS, vllm_config, torch.device("cpu"))


@pytest.fixture
def session(tmp_path: Path) -> Iterator[RecordingSession]:
    started = start_session(RecordOptions(out_dir=str(tmp_path / "rec")))
    adapter.install()
    yield started
    end_session()


def written(session: RecordingSession) -> list[Trace]:
    session.flush()
    if not (session.out_dir / io.MANIFEST).exists():
        return []
    return [io.load(session.out_dir / e.file) for e in io.read_manifest(session.out_dir)]
