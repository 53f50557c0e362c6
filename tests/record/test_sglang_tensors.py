"""`attndbg record --layers` on SGLang: per-layer q, new k/v, KV rows read and output of eager steps.

Everything the recorder touches is SGLang's own: a real ForwardBatch, ReqToTokenPool,
MHATokenToKVPool (on the CPU), RadixAttention layers whose `forward` calls the backend through
SGLang's forward context, AttentionBackend.forward (the method the recorder wraps), and the real
ModelRunner.forward, at whose end the step is submitted. Only two things stand in:
- `ScaffoldKernel` (TEST SCAFFOLDING, not one of attndbg's backends): a subclass of SGLang's
  TritonAttnBackend whose forward_extend / forward_decode play the engine's kernel: they write this
  step's K/V with the pool's own `set_kv_buffer` and compute attention with a plain torch softmax
  over the rows they read; `drop` makes it skip one key of one request (a wrong engine output);
- `ModelRunner._forward_raw` (the model): it plans the step and runs the layers, as the eager runner
  does; ModelRunner's other collaborators (a scheduler config, expert recorders) are not built.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.engines import import_engine

runner_module = env.load_model_runner()
forward_context = import_engine("sglang.srt.model_executor.forward_context")

from attndbg.detector_api.context import CheckContext, CheckOptions  # noqa: E402
from attndbg.detectors.split_merge.recorded import recorded_tensors  # noqa: E402
from attndbg.record import hooks  # noqa: E402
from attndbg.record import session as session_module  # noqa: E402
from attndbg.record.options import RecordOptions  # noqa: E402
from attndbg.record.session import end_session, start_session  # noqa: E402
from attndbg.record.sglang import adapter  # noqa: E402
from attndbg.record.sglang import layers as sglang_layers  # noqa: E402
from attndbg.trace import io  # noqa: E402
from attndbg.trace.schema import LseBase  # noqa: E402
from tests.record.sglang_steps import assert_checks_clean, decode_batch  # noqa: E402

H, HKV, D = 4, 2, 16
NUM_LAYERS = 3
ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}
BF16 = torch.bfloat16


def extend_batch() -> Any:
    """Request row 1: 3 cached tokens + 2 new (slots 14, 15); row 5: a 4-token prompt (30..33)."""
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.EXTEND,
        batch_size=2,
        input_ids=torch.arange(6, dtype=torch.int64),
        req_pool_indices=torch.tensor([1, 5], dtype=torch.int64),
        seq_lens=torch.tensor([5, 4], dtype=torch.int64),
        out_cache_loc=torch.tensor([14, 15, 30, 31, 32, 33], dtype=torch.int64),
        seq_lens_sum=9,
        positions=torch.tensor([3, 4, 0, 1, 2, 3], dtype=torch.int64),
        seq_lens_cpu=torch.tensor([5, 4], dtype=torch.int64),
        extend_seq_lens=torch.tensor([2, 4], dtype=torch.int64),
        extend_prefix_lens=torch.tensor([3, 0], dtype=torch.int64),
        extend_seq_lens_cpu=[2, 4],
        extend_prefix_lens_cpu=[3, 0],
    )


def scaffold_class() -> type:
    """Defined after install(): SGLang imports its backends lazily, so classes defined later must be
    instrumented too (the subclass inherits AttentionBackend.forward, which the recorder wraps)."""

    class ScaffoldKernel(env.TritonAttnBackend):
        """TEST SCAFFOLDING: the engine's attention kernel standing in (not an attndbg backend)."""

        drop: tuple[int, int] | None = None  # (request, column) whose key the kernel skips

        def init_forward_metadata(self, forward_batch: Any) -> None:
            self.forward_metadata = None  # the recorder then derives the plan from the batch

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
            return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
            return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

        def _attend(self, q, k, v, layer, fb, save_kv_cache):  # noqa: ANN001, ANN202
            pool = self.token_to_kv_pool
            if save_kv_cache:
                pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
            hq, group = layer.tp_q_head_num, layer.tp_q_head_num // layer.tp_k_head_num
            queries = q.view(-1, hq, layer.qk_head_dim).float()
            out = torch.zeros(queries.shape[0], hq, layer.v_head_dim)
            decode = fb.forward_mode.is_decode()
            row = 0
            for b in range(fb.batch_size):
                kv = int(fb.seq_lens_cpu[b])
                new = 1 if decode else fb.extend_seq_lens_cpu[b]
                slots = self.req_to_token_pool.req_to_token[int(fb.req_pool_indices[b]), :kv].long()
                keys = k_buf[slots].float().repeat_interleave(group, 1)
                values = v_buf[slots].float().repeat_interleave(group, 1)
                for i in range(new):
                    cols = [c for c in range(kv - new + i + 1) if (b, c) != self.drop]
                    scores = torch.einsum("hd,khd->hk", queries[row], keys[cols]) * layer.scaling
                    out[row] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values[cols])
                    row += 1
            return out.to(q.dtype).view(queries.shape[0], -1)

    return ScaffoldKernel


class Engine:
    """The pieces of one SGLang model runner: pools, layers, backend, and the real ModelRunner."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        gen = torch.Generator().manual_seed(0)
        self.kv_pool = env.MHATokenToKVPool(size=47, page_size=1, dtype=BF16, head_num=HKV, head_dim=D, layer_num=NUM_LAYERS, device="cpu", enable_memory_saver=False)
        for layer in range(NUM_LAYERS):  # earlier steps' K/V: every slot holds something distinct
            k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
            k_buf.copy_(torch.randn(k_buf.shape, generator=gen))
            v_buf.copy_(torch.randn(v_buf.shape, generator=gen))
        self.layers = [env.layer(heads=H, kv_heads=HKV, head_dim=D, layer_id=i) for i in range(NUM_LAYERS)]
        backend = object.__new__(scaffold_class())
        backend.req_to_token_pool = env.req_pool(ROWS)
        backend.token_to_kv_pool = self.kv_pool
        backend.num_head = H
        backend.max_kv_splits = 8
        backend.sliding_window_size = None
        backend.forward_metadata = None
        self.backend = backend
        self.gen = gen
        # ModelRunner.forward reads two published configs; the rest it needs is set on the runner.
        monkeypatch.setattr(runner_module, "get_schedule", lambda: SimpleNamespace(disable_overlap_schedule=True))
        monkeypatch.setattr(runner_module, "get_exec", lambda: SimpleNamespace(moe=SimpleNamespace(elastic_ep_backend=None)))
        runner = object.__new__(runner_module.ModelRunner)
        runner.forward_pass_id = 0
        runner.msprobe_debugger = None
        runner.is_draft_worker = True
        runner.enable_elastic_ep = False
        runner.eplb_manager = None
        runner.decode_cuda_graph_runner = None
        runner._forward_raw = self._forward_raw
        self.runner = runner
        self.during_layers: Any = None  # called between planning and the layers (tests switch things there)

    def _forward_raw(self, fb: Any, *args: Any) -> Any:
        """The model standing in: plan the step, then every layer's attention, like the eager runner."""
        with forward_context.forward_context(forward_context.ForwardContext(attn_backend=self.backend), forward_batch=fb):
            self.backend.init_forward_metadata(fb)
            if self.during_layers is not None:
                self.during_layers()
            t = fb.out_cache_loc.numel()
            self.inputs, self.outputs = {}, {}
            for layer in self.layers:
                q = torch.randn(t, H * D, generator=self.gen).to(BF16)  # flat, as a model's projection gives it
                k = torch.randn(t, HKV, D, generator=self.gen).to(BF16)
                v = torch.randn(t, HKV, D, generator=self.gen).to(BF16)
                self.inputs[layer.layer_id] = (q, k, v)
                self.outputs[layer.layer_id] = layer(q, k, v, fb)
        return runner_module.ModelRunnerOutput(logits_output=None, can_run_graph=False)

    def step(self, fb: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Run one forward; returns each layer's (k, v) buffers as they were before it."""
        before = {layer: tuple(t.clone() for t in self.kv_pool.get_kv_buffer(layer)) for layer in range(NUM_LAYERS)}
        self.runner.forward(fb)
        return before


@pytest.fixture
def record(tmp_path, monkeypatch):
    def start(**options: Any) -> tuple[Any, Engine]:
        end_session()
        session = start_session(RecordOptions(out_dir=str(tmp_path / "rec"), writer="thread", **options))
        adapter.install()
        hooks.patch(runner_module.ModelRunner, "forward", adapter._wrap_model_forward)  # install() wraps it when SGLang imported it first
        return session, Engine(monkeypatch)

    yield start
    end_session()


def traces(session) -> list[tuple[int, Any, Any]]:
    session.flush()
    path = session.out_dir / io.MANIFEST
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(e["step"], io.load(session.out_dir / e["file"]), session.out_dir / e["file"]) for e in entries]


def count_snapshots(session, monkeypatch) -> list[dict]:
    calls: list[dict] = []
    original = session.snapshot

    def snapshot(tensors):  # noqa: ANN001, ANN202
        calls.append(tensors)
        return original(tensors)

    monkeypatch.setattr(session, "snapshot", snapshot)
    return calls


def test_requested_layers_are_recorded_exactly(record) -> None:
    session, engine = record(layers=(0, 2))
    assert getattr(env.sgl.base_attn_backend.AttentionBackend.__dict__["forward"], hooks.MARK)
    assert getattr(runner_module.ModelRunner.__dict__["forward"], hooks.MARK)
    recorded = []
    for fb in (extend_batch(), decode_batch()):
        before = engine.step(fb)
        recorded.append((before, dict(engine.inputs), dict(engine.outputs)))
    steps = traces(session)
    assert [(s, t.batch.forward_mode.value) for s, t, _ in steps] == [(0, "EXTEND"), (1, "DECODE")]
    for (_, trace, path), (before, inputs, outputs) in zip(steps, recorded):
        assert sorted(trace.tensors) == [0, 2]  # layer 1 ran but was not asked for
        n, slots = trace.batch.num_tokens, trace.batch.slot_ids
        for layer, t in trace.tensors.items():
            q, k, v = inputs[layer]
            assert torch.equal(t.q, q.view(n, H, D)) and torch.equal(t.k_new, k) and torch.equal(t.v_new, v)
            assert torch.equal(t.kv_slots, slots)
            # The rows as they were before this step wrote its K/V (the new tokens' slots included).
            assert torch.equal(t.k_rows, before[layer][0][slots]) and torch.equal(t.v_rows, before[layer][1][slots])
            assert not torch.equal(t.k_rows, engine.kv_pool.get_kv_buffer(layer)[0][slots])  # ...which the step then changed
            assert torch.equal(t.output, outputs[layer].view(n, H, D))
            assert t.lse is None and t.lse_base is LseBase.E  # the forward returned no LSE
        loaded = io.load(io.save(trace, path.parent / f"copy_{trace.source.step}.pt"))
        assert sorted(loaded.tensors) == [0, 2] and torch.equal(loaded.tensors[2].k_rows, trace.tensors[2].k_rows)
        assert recorded_tensors(CheckContext(trace=trace, path=str(path), options=CheckOptions(backends=("reference",)))) == []
        assert_checks_clean(path)


def test_a_wrong_engine_output_is_caught_at_its_request(record) -> None:
    session, engine = record(layers=(1,))
    engine.backend.drop = (1, 0)  # the kernel skips request 1's first key
    engine.step(decode_batch())
    [(_, trace, path)] = traces(session)
    findings = recorded_tensors(CheckContext(trace=trace, path=str(path), options=CheckOptions(backends=("reference",))))
    assert findings and {f.location.request for f in findings} == {1} and {f.location.layer for f in findings} == {1}


def test_steps_outside_the_range_record_nothing(record, monkeypatch) -> None:
    session, engine = record(layers=(0,), first_step=1, last_step=2)
    calls = count_snapshots(session, monkeypatch)
    engine.step(extend_batch())  # step 0
    assert calls == [] and sglang_layers.pending() is None
    engine.step(decode_batch())  # step 1
    engine.step(decode_batch())  # step 2
    assert [(s, sorted(t.tensors)) for s, t, _ in traces(session)] == [(1, [0])]
    assert len(calls) == 2  # step 1: its metadata and layer 0


def test_nothing_is_copied_under_a_graph_capture(record, monkeypatch) -> None:
    session, engine = record(layers=(0, 1))
    calls = count_snapshots(session, monkeypatch)
    inputs_seen = []
    capture = sglang_layers.capture_inputs

    def spy(*args: Any, **kwargs: Any) -> Any:
        inputs_seen.append(result := capture(*args, **kwargs))
        return result

    monkeypatch.setattr(sglang_layers, "capture_inputs", spy)

    def start_capture() -> None:  # the layers run as they would inside torch.cuda.graph(...)
        for module in (sglang_layers, session_module, adapter):
            monkeypatch.setattr(module, "capturing", lambda: True)

    engine.during_layers = start_capture
    engine.step(decode_batch())
    [(_, trace, _)] = traces(session)
    assert trace.tensors == {}  # metadata only
    assert inputs_seen == [None] * NUM_LAYERS and len(calls) == 1  # no layer copied anything (only the metadata was)
    engine.during_layers = None
    engine.step(decode_batch())  # the whole step under capture: no step at all
    assert [s for s, _, _ in traces(session)] == [0]
    assert len(calls) == 1


def test_without_layers_the_step_is_submitted_by_the_metadata_hook(record) -> None:
    session, engine = record()
    engine.backend.init_forward_metadata(decode_batch())  # no ModelRunner.forward, no layer
    assert sglang_layers.pending() is None
    [(_, trace, _)] = traces(session)
    assert trace.tensors == {}


def test_a_step_planned_outside_model_runner_is_submitted_by_the_next_step(record) -> None:
    """Warm-up and draft forwards call model.forward directly: the next step's hook submits them."""
    session, engine = record(layers=(2,))
    engine._forward_raw(decode_batch())  # not through ModelRunner.forward
    assert traces(session) == [] and sglang_layers.pending() is not None
    engine.step(extend_batch())
    assert [(s, sorted(t.tensors)) for s, t, _ in traces(session)] == [(0, [2]), (1, [2])]
