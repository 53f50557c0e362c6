"""install(): hooks on SGLang's real backend classes write steps into a recording; a failing hook
stops recording with one log line and the engine's call still returns its own result.

The backends here are subclasses of the real TritonAttnBackend defined after install() (SGLang
imports its backends lazily, so install() must instrument classes defined later too). Their
metadata methods stand in for the real bodies, which need a CUDA device and a KV index translator;
the hooks wrap them exactly as they wrap the real ones.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.engines import import_engine
from attndbg.record import hooks
from attndbg.record.sglang import adapter
from attndbg.record.options import RecordOptions
from attndbg.record.session import end_session, start_session
from attndbg.trace import io
from tests.record.sglang_steps import assert_checks_clean, decode_batch, decode_metadata

runner_module = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
I64, I32 = env.I64, env.I32
ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}


@pytest.fixture
def session(tmp_path):
    end_session()
    if not adapter._installed:
        adapter.install()  # no session: nothing is patched
        assert not adapter._installed
    session = start_session(RecordOptions(out_dir=str(tmp_path / "rec")))
    adapter.install()
    adapter.install()  # idempotent
    yield session
    end_session()


def make_backend(cls: type) -> object:
    backend = object.__new__(cls)
    backend.req_to_token_pool = env.req_pool(ROWS)
    # The KV pool's size and dtype are all the adapter reads of it (a real MHATokenToKVPool
    # allocates per-layer device buffers).
    backend.token_to_kv_pool = SimpleNamespace(size=47, dtype=torch.bfloat16, page_size=1)
    backend.num_head = 4
    backend.max_kv_splits = 8
    backend.sliding_window_size = None
    backend.forward_metadata = None
    return backend


def manifest(session) -> list[dict]:
    # Long: flush gives up at its timeout, and on a machine loaded by other test workers the writer
    # process's start can take a while; an early give-up reads as "nothing recorded".
    session.flush(timeout=300.0)
    path = session.out_dir / io.MANIFEST
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_hooks_wrap_the_real_classes(session) -> None:
    assert getattr(env.TritonAttnBackend.__dict__["init_forward_metadata"], hooks.MARK)
    assert getattr(env.TritonAttnBackend.__dict__["init_forward_metadata_out_graph"], hooks.MARK)
    assert getattr(env.RadixAttention.__dict__["__init__"], hooks.MARK)
    assert getattr(runner_module.build_replay_fb_view, hooks.MARK)


def test_eager_step_is_recorded(session) -> None:
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - the model keeps its layers alive; so do we

    class Backend(env.TritonAttnBackend):
        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = decode_metadata([0, 5, 14], ROWS[1] + ROWS[5], [2, 3])
            return "planned"

    assert getattr(Backend.__dict__["init_forward_metadata"], hooks.MARK)
    backend = make_backend(Backend)
    assert backend.init_forward_metadata(decode_batch()) == "planned"
    entries = manifest(session)
    assert [(e["mode"], e["batch_size"], e["graph"]) for e in entries] == [("DECODE", 2, False)]
    trace = io.load(session.out_dir / entries[0]["file"])
    assert trace.source.engine == "sglang" and trace.source.backend == "triton"
    assert trace.batch.kv_lens.tolist() == [5, 9]
    assert trace.batch.slot_ids.tolist() == ROWS[1] + ROWS[5]
    assert trace.plan.tensors["kv_indptr"].tolist() == [0, 5, 14]
    assert trace.plan.scalars["seq_lens_sum"] == 14
    assert (trace.model.num_qo_heads, trace.model.num_kv_heads, trace.model.head_dim) == (4, 2, 16)
    assert trace.batch.kv_cache_size == 48  # 47 slots + the dummy page
    assert_checks_clean(session.out_dir / entries[0]["file"])


def test_graph_replay_is_recorded_and_capture_is_not(session) -> None:
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - alive while the step records

    class GraphBackend(env.TritonAttnBackend):
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            bs = forward_batch.batch_size  # refill the graph buffers, as SGLang's replay does
            self.kv_indptr[: bs + 1] = torch.tensor([0, 5, 14, 15, 16], dtype=I32)
            self.cuda_graph_kv_indices[:16] = torch.tensor(ROWS[1] + ROWS[5] + [0, 0], dtype=I64)
            self.cuda_graph_num_kv_splits[:bs] = torch.tensor([2, 3, 1, 1], dtype=I32)

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

    backend = make_backend(GraphBackend)
    backend.kv_indptr = torch.zeros(9, dtype=I32)
    backend.cuda_graph_kv_indices = torch.zeros(64, dtype=I64)
    backend.cuda_graph_num_kv_splits = torch.full((8,), 8, dtype=I32)
    buffers = SimpleNamespace(
        input_ids=torch.zeros(8, dtype=I64),
        req_pool_indices=torch.tensor([1, 5] + [0] * 6, dtype=I64),
        seq_lens=torch.tensor([5, 9] + [1] * 6, dtype=I64),
        seq_lens_cpu=torch.tensor([5, 9] + [1] * 6, dtype=I64),
        out_cache_loc=torch.tensor([15, 38] + [0] * 6, dtype=I64),
        positions=torch.tensor([4, 8] + [0] * 6, dtype=I64),
        encoder_lens=None,
        mamba_track_indices=None,
    )
    view = runner_module.build_replay_fb_view(decode_batch(), buffers, 4, 2, 4, None, 1, env.ForwardMode.DECODE, False)
    backend.init_forward_metadata_out_graph(view, in_capture=True)  # startup capture: not recorded
    assert manifest(session) == []
    backend.init_forward_metadata_out_graph(view)
    entries = manifest(session)
    assert [(e["mode"], e["batch_size"], e["graph"]) for e in entries] == [("DECODE", 2, True)]
    trace = io.load(session.out_dir / entries[0]["file"])
    assert trace.graph.capture_bs == 4 and trace.graph.padded_seq_lens.tolist() == [5, 9, 1, 1]
    assert trace.plan.tensors["num_kv_splits"].tolist() == [2, 3, 1, 1]
    assert trace.plan.scalars["seq_lens_sum"] == 16


def test_a_failing_hook_stops_recording_once_and_the_engine_goes_on(session, capfd) -> None:
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - alive while the step records

    class Backend(env.TritonAttnBackend):
        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = decode_metadata([0, 5, 14], ROWS[1] + ROWS[5], [2, 3])
            return "planned"

    backend = make_backend(Backend)
    del backend.req_to_token_pool  # the recorder cannot find the request pool: its hook fails
    assert backend.init_forward_metadata(decode_batch()) == "planned"
    assert backend.init_forward_metadata(decode_batch()) == "planned"
    lines = [line for line in capfd.readouterr().err.splitlines() if "attndbg record" in line]
    assert len(lines) == 1 and "recording stopped, the engine goes on" in lines[0] and "req_to_token" in lines[0]
    assert not session.enabled
    assert manifest(session) == []


def test_register_is_the_plugin_entry_point() -> None:
    from importlib import metadata

    points = [p for p in metadata.entry_points(group="sglang.srt.plugins") if p.name == "attndbg_record"]
    assert points and points[0].value == "attndbg.record.sglang:register"
    end_session()
    adapter.register()  # without a session it does nothing and does not fail
