"""The flight recorder on a real GPU, around transformers' continuous batching with CUDA graphs
(tests/record/flight_engine.py: the CPU test engine with a fault put in on purpose):

- crash: a corrupted KV read index at a graph-replayed decode step makes the engine fault on the
  device (a device-side assert or an illegal memory access, surfacing late); the ring written
  holds that step, in flight, with one `cuda-error` line, then `record`'s `exit` line, and
  `attndbg check` flags its index;
- NaN: `--when nan` fires on the step whose layer-0 output carries the NaN (request 0's row
  alone), and the ring holds it with layer 0's tensors as the in-graph probes copied them out of
  the replay;
- probe values are exact: each of a few replayed decode steps is first run eagerly on the same
  padded inputs (CUDA graphs off for that call, recorded as a step of its own), then replayed; the
  probe values equal the eager recording bit for bit;
- pointer audit: a graph input reallocated before a replay fires the ring once, naming it; the
  runs above, whose inputs stay put, fire none.

transformers >= 5.20 must be importable (on the GPU machine carried as a wheel, like
tests/gpu/test_timeline.py's engine test).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attndbg.record.options import RecordOptions
from attndbg.record.probes import Phase
from attndbg.record.session import Stats, current_session, end_session, start_session
from attndbg.record.transformers import adapter
from attndbg.record.transformers.graphs import graph_step
from attndbg.trace import io
from tests.gpu.engines import continuous_batching_missing
from tests.record import flight_engine
from attndbg.examples import transformers_generate as live

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tests" / "record" / "flight_engine.py"
ON_GPU = ["--device", "cuda", "--cuda-graph", "--dtype", "bfloat16", "--new-tokens", "12"]
FAULT_STEP = 6  # the 7th real step: a decode that replays a captured graph


needs_engine = pytest.mark.skipif(continuous_batching_missing() is not None, reason=str(continuous_batching_missing()))


def _record_engine(out: Path, record_options: list[str], engine_options: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "attndbg", "record", "-o", str(out), *record_options, "--", sys.executable, str(ENGINE), *ON_GPU, *engine_options]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _explain(done: subprocess.CompletedProcess[str], out: Path) -> str:
    """What a failed assertion shows: record's exit, the child's stderr tail, the manifest."""
    manifest = out / io.MANIFEST
    lines = manifest.read_text().splitlines() if manifest.exists() else ["(no manifest)"]
    return f"\nrecord exited {done.returncode}\n--- stderr tail ---\n{done.stderr[-5000:]}\n--- manifest ---\n" + "\n".join(lines[-40:])


@needs_engine
def test_a_device_fault_under_cuda_graphs_leaves_the_faulting_step_in_the_ring(tmp_path: Path) -> None:
    """The fault surfaces late (at a later step's event query or copy, or at the engine's final
    sync); the thread that sees it writes the ring at once, host memory only, before the process
    can abort (device_fault.py); `record` adds the exit line, whether the process exited 1 or the
    engine's own teardown aborted it (134)."""
    out = tmp_path / "rec"
    done = _record_engine(out, ["--ring", "8"], ["--corrupt-step", str(FAULT_STEP)])
    why = _explain(done, out)
    assert done.returncode != 0, "the engine should have faulted" + why
    triggers = io.read_triggers(out)
    cuda = [t for t in triggers if t.kind == "cuda-error"]
    assert len(cuda) == 1, why
    exits = [t for t in triggers if t.kind == "exit"]
    assert [t.code for t in exits] == [done.returncode] and exits[0].pid == cuda[0].pid, why
    entries = io.read_manifest(out)
    faulty = [e for e in entries if (plan := io.load(out / e.file).plan) is not None and plan.backend == "transformers"]
    assert len(faulty) == 1, [e.file for e in entries] + [why]
    step = faulty[0]
    assert step.in_flight and step.mode == "DECODE", why
    # The trigger names the oldest step in flight: the faulty one, or one before it whose event was
    # not seen complete before the error went sticky (every query fails after it).
    flying = [e.step for e in entries if e.in_flight]
    assert cuda[0].step in flying and cuda[0].step <= step.step, why
    trace = io.load(out / step.file)
    assert int(trace.plan.tensors["read_index"][0]) >= trace.plan.scalars["token_rows"]
    check = subprocess.run([sys.executable, "-m", "attndbg", "check", str(out), "--backend", "reference", "--json", "-"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert check.returncode == 1, check.stdout[-3000:] + check.stderr[-3000:]
    assert '"index-outside-cache"' in check.stdout and f'"step": {step.step}' in check.stdout


@needs_engine
def test_when_nan_fires_with_the_tensors_of_a_graph_replay(tmp_path: Path) -> None:
    """The NaN is planted in request 0's attention-mask row (flight_engine.py says why not in a
    cached key: on the GPU that makes every row NaN), so request 0's layer-0 output row alone is
    NaN, as the probes copied it out of the replay."""
    out = tmp_path / "rec"
    done = _record_engine(out, ["--ring", "6", "--layers", "0", "--when", "nan"], ["--nan-step", str(FAULT_STEP)])
    why = _explain(done, out)
    assert done.returncode == 0, why
    triggers = io.read_triggers(out)
    assert len(triggers) == 1, why
    [trigger] = triggers
    assert trigger.kind == "nan" and trigger.message.startswith("layer0.output: "), why
    entries = {e.step: e for e in io.read_manifest(out)}
    assert trigger.step in entries and entries[trigger.step].layers == [0], why
    trace = io.load(out / entries[trigger.step].file)
    layer = trace.tensors[0]
    assert trace.batch.forward_mode.value == "DECODE" and layer.kv_slots.numel() == 0, why  # probe values: no KV rows (probes.py)
    finite = torch.isfinite(layer.output.float()).flatten(1).all(1)
    assert finite.numel() > 1 and not bool(finite[0]) and bool(finite[1:].all()), f"{finite}{why}"  # the poisoned request's row alone
    before = [e for s, e in entries.items() if s < trigger.step]
    assert all(bool(torch.isfinite(io.load(out / e.file).tensors[0].output.float()).all()) for e in before), why


def _generate_under(options: RecordOptions, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Stats | None:
    """Generate with CUDA graphs (bf16, on the GPU) under a session of `options`, with `wrap` around
    the recorder's compute_batch (the test's own doing at chosen steps); the session's stats."""
    from transformers.generation.continuous_batching import model_runner

    model = live.tiny_llama(dtype=torch.bfloat16, device="cuda")
    start_session(options)
    adapter.install()
    recorded = model_runner.ModelRunner.compute_batch
    model_runner.ModelRunner.compute_batch = wrap(recorded)
    try:
        live.generate(model, max_new_tokens=10, cuda_graph=True)
    finally:
        model_runner.ModelRunner.compute_batch = recorded
        stats = end_session()
        adapter.uninstall()
    return stats


def _replay_of_a_real_step(runner: Any) -> bool:
    return flight_engine._real_step(runner) and graph_step(runner).phase == Phase.REPLAY


@needs_engine
def test_probe_values_equal_the_eager_recording_of_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    pairs: list[tuple[int, int]] = []

    def eager_then_replay(recorded: Callable[..., Any]) -> Callable[..., Any]:
        def compute_batch(self, model, batch_data):  # type: ignore[no-untyped-def]
            if len(pairs) < 4 and _replay_of_a_real_step(self):
                saved = self.use_cuda_graph_varlen, self.use_cuda_graph_decode
                self.use_cuda_graph_varlen = self.use_cuda_graph_decode = False
                try:
                    recorded(self, model, batch_data)  # the same padded inputs, eagerly: its own recorded step
                finally:
                    self.use_cuda_graph_varlen, self.use_cuda_graph_decode = saved
                eager = current_session().last_step
                result = recorded(self, model, batch_data)
                pairs.append((eager, current_session().last_step))
                return result
            return recorded(self, model, batch_data)

        return compute_batch

    stats = _generate_under(RecordOptions(out_dir=str(out), layers=(0,), writer="thread"), eager_then_replay)
    assert len(pairs) == 4, pairs
    files = {e.step: out / e.file for e in io.read_manifest(out)}
    for eager_step, replay_step in pairs:
        eager, replay = io.load(files[eager_step]), io.load(files[replay_step])
        assert torch.equal(eager.batch.slot_ids, replay.batch.slot_ids)
        a, b = eager.tensors[0], replay.tensors[0]
        assert a.kv_slots.numel() > 0 and b.kv_slots.numel() == 0  # eager: KV rows; the replay: probes
        for name in ("q", "k_new", "v_new", "output"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.int16), y.view(torch.int16)), (eager_step, replay_step, name)
    assert stats is not None and stats.stopped_reason is None


@needs_engine
def test_a_graph_input_moved_before_a_replay_fires_the_ring_once(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    replays = [0]

    def moving(recorded: Callable[..., Any]) -> Callable[..., Any]:
        def compute_batch(self, model, batch_data):  # type: ignore[no-untyped-def]
            if _replay_of_a_real_step(self):
                replays[0] += 1
                if replays[0] >= 3:  # from the third replay on, a fresh tensor stands where the graph's input was
                    batch_data = dict(batch_data, position_ids=batch_data["position_ids"].clone())
            return recorded(self, model, batch_data)

        return compute_batch

    _generate_under(RecordOptions(out_dir=str(out), ring=4, writer="thread"), moving)
    triggers = io.read_triggers(out)
    assert [t.kind for t in triggers] == ["pointer"], triggers
    assert "transformers batch_data position_ids moved since its CUDA graph" in triggers[0].message
