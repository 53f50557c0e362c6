"""`attndbg record --layers` on vLLM: per-layer tensors from `AttentionImpl.forward`, checked.

The main fixture runs vLLM's real Triton backend on the CPU in a child process
(`vllm_triton_steps.py`: the real metadata builder, the real `TritonAttentionImpl`, whose kernel
is vLLM's Triton `unified_attention` under the Triton interpreter) with the recorder armed for
`--layers 0,2 --steps 1:5`, and saves what it fed the engine. The tests compare the recording
with that exactly, check it with `attndbg check`, and show that a wrong engine (the kernel handed
one key too few for one request) is caught at that request.

The in-process tests at the end use a stand-in impl (test scaffolding: a subclass of vLLM's real
`AttentionImpl` whose forward writes a plain-torch result) where the point is the hook, not the
kernel: a backend defined after `install()`, failures, and recording without `--layers`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.record.engines import import_engine

triton_attn = import_engine("vllm.v1.attention.backends.triton_attn")
kv_cache_interface = import_engine("vllm.v1.kv_cache_interface")

from attndbg.checks.run import check_steps  # noqa: E402
from attndbg.checks.selection import parse_only  # noqa: E402
from attndbg.detector_api.context import CheckContext, CheckOptions  # noqa: E402
from attndbg.detectors.split_merge.recorded import recorded_tensors  # noqa: E402
from attndbg.record import hooks  # noqa: E402
from attndbg.record.options import RecordOptions  # noqa: E402
from attndbg.record.session import RecordingSession, end_session, start_session  # noqa: E402
from attndbg.record.vllm import adapter  # noqa: E402
from attndbg.record.vllm import tensors as vllm_tensors  # noqa: E402
from attndbg.trace import io  # noqa: E402
from attndbg.trace.schema import ForwardMode, Trace  # noqa: E402
from tests.record import vllm_triton_steps as child  # noqa: E402
from tests.record.vllm_env import (  # noqa: E402
    BLOCK_SIZE,
    AttentionLayerStub,
    cache_rows,
    layer_name,
    make_layout,
    new_kv_cache,
    tiny_vllm_config,
    write_new_kv,
)

REPO = Path(__file__).resolve().parents[2]
STEP = {name: i for i, (name, _) in enumerate(child.STEPS)}




@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    """(the child's summary, what it fed the engine per step, the recording directory)."""
    out = tmp_path_factory.mktemp("vllm-triton")
    done = subprocess.run([sys.executable, "-m", "tests.record.vllm_triton_steps", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    expected = torch.load(out / "expected.pt", weights_only=False)
    return summary, expected, out / "rec"


def _trace(rec: Path, name: str) -> Trace:
    return io.load(rec / f"step_{STEP[name]:06d}.pt")


def _real_tokens(step: dict[str, Any]) -> int:
    return sum(step["query_lens"])


def test_tensors_are_recorded_for_the_requested_layers_and_steps_only(run) -> None:
    summary, _, rec = run
    assert summary["stopped_reason"] is None
    entries = io.read_manifest(rec)
    # Step 0 is outside --steps 1:5; the capturing step is metadata only.
    assert [(e.step, e.layers) for e in entries] == [(1, [0, 2]), (2, [0, 2]), (3, [0, 2]), (4, [])]
    assert [e.mode for e in entries] == ["MIXED", "DECODE", "DECODE", "DECODE"]
    copies: dict[str, list[list[str]]] = {}
    for label, keys in summary["snapshots"]:
        copies.setdefault(label, []).append(keys)
    layer_keys = ["k_new", "k_rows", "output", "q", "v_new", "v_rows"]
    assert "outside-steps" not in copies  # nothing at all is copied for a step that is not recorded
    for name in ("mixed", "decode-padded", "decode-missing-key"):
        # One copy of the metadata at build(), then one per requested layer (0 and 2, not 1).
        assert copies[name][0][0].startswith("cm.") and copies[name][1:] == [layer_keys, layer_keys]
    assert len(copies["capturing"]) == 1 and copies["capturing"][0][0].startswith("cm.")  # no layer copy under capture
    # A step is held until its builder builds again; the last one until finish().
    assert summary["held"] == [0, 1, 1, 1, 1]
    assert (summary["written_before_finish"], summary["written"]) == (3, 4)
    assert _trace(rec, "capturing").tensors == {}


@pytest.mark.parametrize("name", ["mixed", "decode-padded", "decode-missing-key"])
def test_recorded_tensors_are_exactly_what_the_engine_saw(run, name: str) -> None:
    _, expected, rec = run
    step = expected[STEP[name]]
    trace = _trace(rec, name)
    assert sorted(trace.tensors) == [0, 2]
    tokens = _real_tokens(step)
    assert trace.batch.num_tokens == tokens
    read = sorted({slot for row in step["slots"] for slot in row})
    new = {slot for b, row in enumerate(step["slots"]) for slot in row[len(row) - step["query_lens"][b] :]}
    for layer, recorded in trace.tensors.items():
        fed = step["layers"][layer]
        # q and the new K/V: the engine's inputs, trimmed to the real tokens (padded ones dropped).
        assert torch.equal(recorded.q, fed["q"][:tokens])
        assert torch.equal(recorded.k_new, fed["k"][:tokens]) and torch.equal(recorded.v_new, fed["v"][:tokens])
        assert torch.equal(recorded.output, fed["output"][:tokens])
        assert recorded.lse is None
        # KV rows: exactly the slots the batch reads, as the cache held them when forward ran.
        assert recorded.kv_slots.tolist() == read
        k_after, v_after = cache_rows(fed["cache_after"], read)
        assert torch.equal(recorded.k_rows, k_after) and torch.equal(recorded.v_rows, v_after)
        # Cached slots hold the earlier steps' K/V; the new tokens' slots already hold k_new / v_new
        # (vLLM 0.33's Triton backend writes them before forward), which replay writes there too.
        old = [i for i, slot in enumerate(read) if slot not in new]
        k_before, _ = cache_rows(fed["cache_before"], [read[i] for i in old])
        assert torch.equal(recorded.k_rows[old], k_before)
        at = [read.index(int(slot)) for slot in trace.batch.out_cache_loc]
        assert torch.equal(recorded.k_rows[at], recorded.k_new)


def test_the_padded_step_keeps_its_graph_padding_and_trims_the_tensors(run) -> None:
    _, expected, rec = run
    trace = _trace(rec, "decode-padded")
    assert trace.graph is not None and trace.graph.capture_bs == 4
    assert expected[STEP["decode-padded"]]["layers"][0]["q"].shape[0] == 4  # the engine saw 2 padded tokens
    assert trace.tensors[0].q.shape[0] == 2


def test_recording_round_trips_and_checks_clean(run, tmp_path: Path) -> None:
    _, _, rec = run
    for name in ("mixed", "decode-padded", "capturing"):
        path = rec / f"step_{STEP[name]:06d}.pt"
        trace = io.load(path)
        again = io.load(io.save(trace, tmp_path / path.name))
        assert sorted(again.tensors) == sorted(trace.tensors)
        for layer, t in trace.tensors.items():
            u = again.tensors[layer]
            assert all(torch.equal(getattr(t, f), getattr(u, f)) for f in ("q", "k_new", "v_new", "kv_slots", "k_rows", "v_rows", "output"))
        if not trace.tensors:
            continue  # metadata only: the builder tests check such steps
        reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("reference", "triton"))))
        assert [f for r in reports for f in r.findings] == [], name
    # The engine's outputs agree with attention over the recorded inputs (vLLM's kernel is right).
    ctx = CheckContext(trace=_trace(rec, "mixed"), path="mixed", options=CheckOptions(backends=("reference",)))
    assert recorded_tensors(ctx) == []


def test_a_kernel_missing_one_key_of_one_request_is_caught_there(run) -> None:
    _, _, rec = run
    trace = _trace(rec, "decode-missing-key")
    assert trace.batch.forward_mode is ForwardMode.DECODE
    findings = recorded_tensors(CheckContext(trace=trace, path="missing-key", options=CheckOptions(backends=("reference",))))
    assert findings and {f.location.request for f in findings} == {child.MISSING_KEY_REQUEST}
    assert {f.location.layer for f in findings} <= {0, 2}
    # And the recorded output is what that kernel computed: attention over all but request 1's last key.
    t, b = trace.tensors[0], child.MISSING_KEY_REQUEST
    slots = trace.batch.request_slots(b)[:-1]
    rows = torch.searchsorted(t.kv_slots, slots)
    k = t.k_rows[rows].double().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    v = t.v_rows[rows].double().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    q = t.q[b].double()  # a decode step: token b is request b's
    probs = (torch.einsum("hd,khd->hk", q, k) * HEAD_DIM**-0.5).softmax(-1)
    torch.testing.assert_close(t.output[b].double(), torch.einsum("hk,khd->hd", probs, v), rtol=1e-5, atol=1e-5)


# -- in-process: the hook itself, with a stand-in impl ----------------------------------------------

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
AttentionImpl = vllm_tensors.impl_base_class()


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    return tiny_vllm_config(tmp_path_factory.mktemp("tiny-llama"), num_layers=2)


def new_builder(vllm_config, names: list[str]):
    spec = kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return triton_attn.TritonAttentionMetadataBuilder(spec, names, vllm_config, torch.device("cpu"))


def _session(tmp_path: Path, **options: Any) -> Iterator[RecordingSession]:
    started = start_session(RecordOptions(out_dir=str(tmp_path / "rec"), writer="thread", **options))
    adapter.install()
    yield started
    vllm_tensors.finish()
    end_session()


@pytest.fixture
def layers_session(tmp_path: Path) -> Iterator[RecordingSession]:
    yield from _session(tmp_path, layers=(1,))


@pytest.fixture
def plain_session(tmp_path: Path) -> Iterator[RecordingSession]:
    yield from _session(tmp_path)


def written(session: RecordingSession) -> list[Trace]:
    vllm_tensors.finish()
    session.flush()
    if not (session.out_dir / io.MANIFEST).exists():
        return []
    return [io.load(session.out_dir / e.file) for e in io.read_manifest(session.out_dir)]


def _stand_in_impl(kv_cache_dtype: str = "auto") -> Any:
    """Scaffolding, not vLLM's kernel: a backend defined after install() (vLLM imports backends
    lazily), on vLLM's real AttentionImpl base class. Its forward writes q's first KV-head group
    mean into `output` so that the recorded output is recognisably this call's."""

    class StandInImpl(AttentionImpl):
        def __init__(self) -> None:
            self.num_heads, self.head_size, self.scale = Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5
            self.num_kv_heads, self.kv_cache_dtype = KV_HEADS, kv_cache_dtype

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
            n = attn_metadata.num_actual_tokens
            output[:n] = query[:n] * 2.0
            return output

    return StandInImpl()


def _step(builder, impl, layout, name: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    metadata = builder.build(0, layout.cm)
    tokens = int(layout.cm.num_actual_tokens)
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
    cache = new_kv_cache(g)
    write_new_kv(cache, layout.cm.slot_mapping, k, v)
    output = torch.zeros(tokens, Q_HEADS, HEAD_DIM)
    impl.forward(AttentionLayerStub(name), q, k, v, cache, metadata, output)
    return {"q": q, "k": k, "output": output, "cache": cache}


def test_a_backend_defined_later_is_wrapped_and_only_requested_layers_copied(layers_session: RecordingSession, vllm_config) -> None:
    impl = _stand_in_impl()
    assert getattr(type(impl).forward, hooks.MARK)
    assert getattr(triton_attn.TritonAttentionImpl.forward, hooks.MARK)
    names = [layer_name(0), layer_name(1)]
    builder = new_builder(vllm_config, names)
    g = torch.Generator().manual_seed(3)
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    metadata = builder.build(0, layout.cm)
    fed = {}
    for name in names:
        q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=g)
        k = torch.randn(2, KV_HEADS, HEAD_DIM, generator=g)
        cache = new_kv_cache(g)
        write_new_kv(cache, layout.cm.slot_mapping, k, k)
        fed[name] = (q, cache)
        impl.forward(AttentionLayerStub(name), q, k, k, cache, metadata, torch.zeros(2, Q_HEADS, HEAD_DIM))
    [trace] = written(layers_session)
    assert sorted(trace.tensors) == [1]  # --layers 1: layer 0 ran but was not copied
    q, cache = fed[layer_name(1)]
    t = trace.tensors[1]
    assert torch.equal(t.q, q) and torch.equal(t.output, 2.0 * q)
    assert torch.equal(t.k_rows, cache_rows(cache, t.kv_slots)[0])
    assert t.kv_slots.tolist() == sorted(layout.slots(0) + layout.slots(1))


def test_without_key_and_value_the_new_kv_is_read_from_the_cache(layers_session: RecordingSession, vllm_config) -> None:
    # A layer sharing another layer's KV cache (or a fused update) gets key = value = None: the
    # cache already holds this step's K/V, and the recorded k_new / v_new are those rows.
    impl = _stand_in_impl()
    builder = new_builder(vllm_config, [layer_name(1)])
    g = torch.Generator().manual_seed(8)
    layout = make_layout([30, 17, 25], [1, 1, 6], seed=11)
    metadata = builder.build(0, layout.cm)
    cache = new_kv_cache(g)
    q = torch.randn(8, Q_HEADS, HEAD_DIM, generator=g)
    impl.forward(AttentionLayerStub(layer_name(1)), q, None, None, cache, metadata, torch.zeros(8, Q_HEADS, HEAD_DIM))
    [trace] = written(layers_session)
    k_new, v_new = cache_rows(cache, layout.new_token_slots())
    assert torch.equal(trace.tensors[1].k_new, k_new) and torch.equal(trace.tensors[1].v_new, v_new)


def test_a_block_table_outside_the_pool_keeps_the_step_as_metadata_and_recording_goes_on(layers_session: RecordingSession, vllm_config) -> None:
    # Request 1's second block is -1 in vLLM's own table: no cache row holds what the batch reads
    # there, so that step has no layer tensors; the next, correct step has them.
    impl = _stand_in_impl()
    builder = new_builder(vllm_config, [layer_name(1)])
    g = torch.Generator().manual_seed(5)
    for broken in (True, False):
        layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
        cm = layout.cm
        if broken:
            table = cm.block_table_tensor.clone()
            table[1, 1] = -1
            cm = cm.replace(block_table_tensor=table)
        metadata = builder.build(0, cm)
        q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=g)
        impl.forward(AttentionLayerStub(layer_name(1)), q, q[:, :2], q[:, :2], new_kv_cache(g), metadata, torch.zeros(2, Q_HEADS, HEAD_DIM))
    first, second = written(layers_session)
    assert layers_session.stats.stopped_reason is None
    assert first.tensors == {} and "vllm.layers_dropped" in first.plan.scalars
    assert first.plan.tensors["common.block_table_tensor"][1, 1] == -1
    assert sorted(second.tensors) == [1] and "vllm.layers_dropped" not in second.plan.scalars


def test_a_forward_of_unrecorded_metadata_or_unparsable_name_copies_nothing(layers_session: RecordingSession, vllm_config) -> None:
    impl = _stand_in_impl()
    builder = new_builder(vllm_config, [layer_name(1)])
    g = torch.Generator().manual_seed(4)
    layout = make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]])
    # Not a step: nothing to attach to (and vLLM fills its seq_lens with 1: a layout of its own).
    capture = builder.build_for_cudagraph_capture(make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]]).cm)
    cache = new_kv_cache(g)
    q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=g)
    impl.forward(AttentionLayerStub(layer_name(1)), q, q[:, :2], q[:, :2], cache, capture, torch.zeros(2, Q_HEADS, HEAD_DIM))
    metadata = builder.build(0, layout.cm)
    impl.forward(AttentionLayerStub("model.layers.1.mlp.experts.1.attn"), q, q[:, :2], q[:, :2], cache, metadata, torch.zeros(2, Q_HEADS, HEAD_DIM))
    [trace] = written(layers_session)
    assert trace.tensors == {} and layers_session.stats.stopped_reason is None


def test_a_quantized_cache_stops_recording_once_and_the_engine_goes_on(layers_session: RecordingSession, vllm_config, capsys: pytest.CaptureFixture[str]) -> None:
    impl = _stand_in_impl(kv_cache_dtype="fp8")
    builder = new_builder(vllm_config, [layer_name(1)])
    g = torch.Generator().manual_seed(5)
    result = _step(builder, impl, make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]]), layer_name(1), g)
    assert torch.equal(result["output"], 2.0 * result["q"])  # the engine's forward ran and returned normally
    assert not layers_session.enabled and "quantized" in (layers_session.stats.stopped_reason or "")
    assert sum("recording stopped" in line for line in capsys.readouterr().err.splitlines()) == 1
    _step(builder, impl, make_layout([21, 34], [1, 1], blocks=[[7, 3], [5, 1, 9]]), layer_name(1), g)
    assert written(layers_session) == []


def test_without_layers_steps_are_written_at_once_and_nothing_is_held(plain_session: RecordingSession, vllm_config) -> None:
    impl = _stand_in_impl()
    builder = new_builder(vllm_config, [layer_name(1)])
    g = torch.Generator().manual_seed(6)
    _step(builder, impl, make_layout([20, 33], [1, 1], blocks=[[7, 3], [5, 1, 9]]), layer_name(1), g)
    assert vllm_tensors.pending_steps() == 0
    plain_session.flush()
    [trace] = [io.load(p) for p in io.trace_paths(plain_session.out_dir)]
    assert trace.tensors == {} and trace.source.step == 0


def test_layer_index_is_the_names_one_integer() -> None:
    assert vllm_tensors.layer_index("model.layers.5.self_attn.attn") == 5
    assert vllm_tensors.layer_index("language_model.model.layers.12.self_attn.attn") == 12
    assert vllm_tensors.layer_index("model.layers.1.mlp.experts.1.attn") is None  # two integers: ambiguous
    assert vllm_tensors.layer_index("attn") is None and vllm_tensors.layer_index(None) is None


def test_kv_views_read_the_cache_the_way_vllms_triton_backend_does() -> None:
    cache = new_kv_cache(torch.Generator().manual_seed(7))
    impl = _stand_in_impl()
    k, v = vllm_tensors.kv_views(impl, cache)
    # TritonAttentionImpl.forward: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    k_ref, v_ref = cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref) and k.shape == (cache.shape[0], BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    with pytest.raises(NotImplementedError):
        vllm_tensors.kv_views(impl, torch.zeros(4, 3, BLOCK_SIZE, 2 * HEAD_DIM))  # 3 heads: not this layer's cache
