"""The installed hook on vLLM's real TritonAttentionMetadataBuilder, end to end on the CPU.

The builder is vLLM's own class, constructed with a real VllmConfig (a real ModelConfig read from
a tiny Llama config.json: no weights, no tokenizer) and a real FullAttentionSpec; build() runs
vLLM's code on real CommonAttentionMetadata. A recording session writes the steps; the tests read
them back from the recording directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attndbg.record import hooks
from attndbg.record.vllm import adapter
from attndbg.record.session import RecordingSession, end_session
from attndbg.trace.schema import ForwardMode
from tests.record.vllm_builder_env import HEAD_DIM, KV_HEADS, LAYERS, Q_HEADS, kv_cache_interface, new_builder, triton_attn, written
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import BLOCK_SIZE, AttentionMetadataBuilder, make_layout, usable


def test_build_is_recorded_and_returns_the_engines_metadata(session: RecordingSession, vllm_config, tmp_path: Path) -> None:
    builder = new_builder(vllm_config)
    layout = make_layout([30, 17, 25], [1, 1, 6], seed=11)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=layout.cm)
    assert isinstance(metadata, triton_attn.TritonAttentionMetadata)
    assert metadata.seq_lens is layout.cm.seq_lens and metadata.block_table is layout.cm.block_table_tensor
    [trace] = written(session)
    assert session.stats.stopped_reason is None
    assert (trace.source.engine, trace.source.backend, trace.source.step) == ("vllm", "TRITON_ATTN", 0)
    assert trace.batch.forward_mode is ForwardMode.MIXED
    assert trace.batch.out_cache_loc.tolist() == layout.new_token_slots()
    assert [trace.batch.request_slots(b).tolist() for b in range(3)] == [layout.slots(b) for b in range(3)]
    model = trace.model
    assert (model.num_qo_heads, model.num_kv_heads, model.head_dim, model.page_size) == (Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    assert (model.q_dtype, model.kv_dtype, model.sm_scale) == ("float32", "float32", HEAD_DIM**-0.5)
    plan = trace.plan
    assert plan.backend == "TRITON_ATTN"
    assert plan.tensors["query_start_loc"].tolist() == [0, 1, 2, 8]
    assert plan.tensors["seq_lens"].tolist() == [30, 17, 25]
    assert plan.tensors["slot_mapping"].tolist() == layout.new_token_slots()
    assert plan.tensors["block_table"].shape == (3, 2)  # cut to ceil(max_seq_len 30 / 16) columns
    # Scratch workspaces are not data: only their shape is kept.
    assert "softmax_segm_output" not in plan.tensors and "softmax_segm_output_shape" in plan.scalars
    assert plan.scalars["seq_threshold_3D"] == builder.seq_threshold_3D
    assert plan.scalars["vllm.call"] == "build" and plan.scalars["vllm.num_reqs"] == 3
    assert plan.scalars["block_table_data_ptr"] == layout.cm.block_table_tensor.data_ptr()
    usable(trace, tmp_path / "again.pt")


def test_capture_is_skipped_and_drafting_is_recorded(session: RecordingSession, vllm_config) -> None:
    builder = new_builder(vllm_config)
    capture = make_layout([1, 1, 1, 1], [1, 1, 1, 1], seed=2)
    metadata = builder.build_for_cudagraph_capture(capture.cm)
    assert metadata.seq_lens.tolist() == [1, 1, 1, 1]  # vLLM's own capture path ran
    draft = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    builder.build_for_drafting(draft.cm, draft_index=1)
    [trace] = written(session)
    assert session.stats.skipped_in_capture == 1
    assert trace.source.step == 0  # the capture took no step number
    assert trace.batch.forward_mode is ForwardMode.DECODE and trace.batch.out_cache_loc.tolist() == [51, 144]
    assert (trace.plan.scalars["vllm.call"], trace.plan.scalars["vllm.draft_index"]) == ("build_for_drafting", 1)


def test_graph_padded_step_through_the_builder(session: RecordingSession, vllm_config) -> None:
    builder = new_builder(vllm_config)
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]], pad_reqs=2, pad_tokens=2)
    builder.build(0, layout.cm)
    [trace] = written(session)
    assert trace.batch.batch_size == 2 and trace.graph.capture_bs == 4
    assert trace.graph.padded_out_cache_loc.tolist() == [51, 144, -1, -1]
    assert trace.plan.tensors["seq_lens"].tolist() == [20, 33, 0, 0]  # the built metadata is padded too


def test_a_failing_hook_stops_recording_once_and_the_engine_goes_on(
    session: RecordingSession, vllm_config, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(builder):
        raise RuntimeError("boom")

    monkeypatch.setattr(adapter.vllm_model, "model_from_builder", broken)
    builder = new_builder(vllm_config)
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    first = builder.build(0, layout.cm)
    second = builder.build(0, layout.cm)
    for metadata in (first, second):
        assert isinstance(metadata, triton_attn.TritonAttentionMetadata) and metadata.slot_mapping is layout.cm.slot_mapping
    assert not session.enabled and "RuntimeError: boom" in session.stats.stopped_reason
    log = [line for line in capsys.readouterr().err.splitlines() if "recording stopped" in line]
    assert len(log) == 1 and "TritonAttentionMetadataBuilder.build" in log[0]
    assert written(session) == []


def test_install_is_idempotent_and_wraps_later_subclasses(session: RecordingSession) -> None:
    adapter.install()
    adapter.register()
    build = triton_attn.TritonAttentionMetadataBuilder.build
    assert getattr(build, hooks.MARK) and not getattr(build.__wrapped__, hooks.MARK, False)

    @dataclass
    class LateMetadata:
        seq_lens: torch.Tensor
        slot_mapping: torch.Tensor
        num_actual_tokens: int

    # Scaffolding: a backend defined after install() (vLLM imports backends lazily). The base class
    # and the metadata passed in are vLLM's own.
    class LateBuilder(AttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            cm = common_attn_metadata
            return LateMetadata(cm.seq_lens, cm.slot_mapping, cm.num_actual_tokens)

    assert getattr(LateBuilder.build, hooks.MARK)
    spec = kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    layout = make_layout([24, 9], [4, 9], seed=4)
    LateBuilder(spec, LAYERS, None, torch.device("cpu")).build(0, layout.cm)
    [trace] = written(session)
    assert trace.plan.backend == "LateBuilder" and trace.plan.scalars["vllm.metadata"] == "LateMetadata"
    assert trace.batch.forward_mode is ForwardMode.EXTEND and trace.model.num_qo_heads == KV_HEADS


def test_without_a_session_nothing_is_installed_or_recorded(tmp_path: Path, vllm_config) -> None:
    end_session()
    adapter.install()  # a no-op: no ATTNDBG_RECORD
    builder = new_builder(vllm_config)
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    assert isinstance(builder.build(0, layout.cm), triton_attn.TritonAttentionMetadata)
    assert not (tmp_path / "rec").exists()
