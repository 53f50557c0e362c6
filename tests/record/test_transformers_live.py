"""End to end on a live engine: transformers' continuous batching, recorded, replayed, checked.

`attndbg record` starts the generation script as a child process (the startup hook arms the
adapter there); the recording must replay and check clean. The engine's own outputs are in the
recording (`--layers`), so `check` compares them with our float64 reference on the engine's real
q/k/v: a wrong slot mapping or wrong lengths would show up as failing rows, and the last test
shows that it does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.record.engines import import_engine

import_engine("transformers.generation.continuous_batching")

from attndbg import profiling  # noqa: E402
from attndbg.checks.run import check_steps  # noqa: E402
from attndbg.checks.selection import parse_only  # noqa: E402
from attndbg.detector_api.context import CheckContext, CheckOptions  # noqa: E402
from attndbg.detectors.split_merge.recorded import recorded_tensors  # noqa: E402
from attndbg.record.options import RecordOptions  # noqa: E402
from attndbg.record.session import end_session, start_session  # noqa: E402
from attndbg.record.transformers import adapter as transformers_cb  # noqa: E402
from attndbg.replay.runner import ReplayOptions, replay  # noqa: E402
from attndbg.trace import io  # noqa: E402
from attndbg.examples import transformers_generate as live  # noqa: E402
from tests.record.corruptions import foreign_first_key  # noqa: E402

SCRIPT = Path(live.__file__)
PROMPT_LENS = sorted(len(p) for p in live.PROMPTS)  # 3, 5, 20
NEW_TOKENS = 5


def _record(tmp: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp / "rec"
    command = [sys.executable, "-m", "attndbg", "record", "-o", str(out), *options, "--", sys.executable, str(SCRIPT), "--new-tokens", str(NEW_TOKENS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    return done, out


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    return _record(tmp_path_factory.mktemp("live"), "--layers", "0,1")


def test_record_runs_the_engine_and_writes_every_step(recording) -> None:
    done, out = recording
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(tokens) == 3 and all(len(t) == NEW_TOKENS for t in tokens.values())
    entries = io.read_manifest(out)
    # One prefill of all three prompts, then one decode step per further token.
    assert [e.mode for e in entries] == ["EXTEND"] + ["DECODE"] * (NEW_TOKENS - 1)
    assert [e.step for e in entries] == list(range(NEW_TOKENS))
    assert all(e.layers == [0, 1] for e in entries)
    assert f"{NEW_TOKENS} steps in {out}" in done.stderr


def test_recorded_lengths_and_slots_are_the_engines(recording) -> None:
    _, out = recording
    traces = [io.load(p) for p in io.trace_paths(out)]
    first = traces[0].batch
    assert sorted(first.extend_lens.tolist()) == PROMPT_LENS and first.prefix_lens.tolist() == [0, 0, 0]
    assert traces[0].model.page_size == 16 and traces[0].model.num_qo_heads == 4 and traces[0].model.num_kv_heads == 2
    for step, trace in enumerate(traces[1:], start=1):
        batch = trace.batch
        assert batch.extend_lens.tolist() == [1, 1, 1]
        # After `step` decode steps request b has its prompt plus `step` generated tokens cached.
        assert sorted(batch.kv_lens.tolist()) == [n + step for n in PROMPT_LENS]
        assert batch.positions.tolist() == (batch.kv_lens - 1).tolist()
        for b in range(batch.batch_size):
            row = batch.request_slots(b)
            assert int(row[-1]) == int(batch.out_cache_loc[b])  # the new token is written at its column's slot
            assert len(set(row.tolist())) == row.numel() and bool((row > 0).all())  # no slot twice, none is the trash slot
            # A request keeps its slots from step to step: yesterday's row is today's prefix.
            previous = traces[step - 1].batch
            same = [i for i in range(previous.batch_size) if int(previous.kv_lens[i]) == int(batch.kv_lens[b]) - 1]
            assert any(previous.request_slots(i).tolist() == row[:-1].tolist() for i in same)


def test_recording_replays_and_checks_clean(recording) -> None:
    _, out = recording
    reports = list(check_steps(str(out), parse_only(None), CheckOptions(backends=("reference", "triton"))))
    assert [f for r in reports for f in r.findings] == []
    for path in io.trace_paths(out)[:2]:  # the prefill and the first decode
        trace = io.load(path)
        result = replay(trace, str(path), ["reference", "triton"], ReplayOptions(layer=0))
        assert not result.failed, [(r.name, r.status, r.reason, r.problems) for r in result.runs]


@pytest.mark.parametrize("step", [0, 2], ids=["prefill-no-merge", "decode-split-kv"])
def test_engine_outputs_are_compared_and_a_wrong_slot_map_is_caught(recording, step: int) -> None:
    _, out = recording
    trace = io.load(io.trace_paths(out)[step])  # the prefill (no merge on its path) and a decode step
    ctx = CheckContext(trace=trace, path="live", options=CheckOptions(backends=("reference",)))
    assert recorded_tensors(ctx) == []
    swapped, b = foreign_first_key(trace)
    findings = recorded_tensors(CheckContext(trace=swapped, path="live", options=CheckOptions(backends=("reference",))))
    assert findings and {f.location.request for f in findings} == {b}


def test_sampling_steps_and_metadata_only(tmp_path: Path) -> None:
    done, out = _record(tmp_path, "--steps", "1:4", "--every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    entries = io.read_manifest(out)
    assert [e.step for e in entries] == [1, 3] and all(e.layers == [] for e in entries)
    assert all(io.load(p).tensors == {} for p in io.trace_paths(out))


def test_a_failing_hook_stops_recording_and_the_engine_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    model = live.tiny_llama()
    expected = live.generate(model, max_new_tokens=3)
    session = start_session(RecordOptions(out_dir=str(tmp_path / "rec")))
    transformers_cb.install()
    calls = []

    def broken(cache):  # noqa: ANN001 - the engine's cache object
        calls.append(1)
        raise RuntimeError("allocator layout changed")

    monkeypatch.setattr(transformers_cb, "cache_geometry", broken)
    try:
        assert live.generate(model, max_new_tokens=3) == expected  # same tokens as without the recorder
    finally:
        stats = end_session()
        transformers_cb.uninstall()
    assert len(calls) == 1 and not session.enabled  # disabled at the first failure, never retried
    assert stats is not None and stats.written == 0 and "allocator layout changed" in (stats.stopped_reason or "")
    assert capsys.readouterr().err.count("recording stopped") == 1


def test_every_field_the_table_says_is_recorded_is_in_each_step(recording) -> None:
    """TRANSFORMERS_FIELDS (the adapter's table of engine fields the detectors read) against the steps."""
    _, out = recording
    recorded = [(engine, where) for engine, where in transformers_cb.TRANSFORMERS_FIELDS if where]
    assert recorded and all(where.startswith("batch.") for _, where in recorded)
    for entry in io.read_manifest(out):
        trace = io.load(out / entry.file)
        for engine, where in recorded:
            value = getattr(trace.batch, where.removeprefix("batch."))
            assert value.numel() > 0, (entry.file, engine, where)
        assert trace.plan is None and trace.graph is None  # the table's "not recorded" rows: the engine builds neither


def test_each_recorded_step_is_one_range_naming_it(tmp_path: Path) -> None:
    """The range around each recorded step (what nsys and `record --timeline` show): one per recorded
    step, none for a step not recorded, labelled before the step runs with what the recorded file
    says after it (mode and batch size), and eager here (no CUDA graph on the CPU)."""
    pushed: list[str] = []

    class Observer:
        def push(self, message: str) -> None:
            pushed.append(message)

        def pop(self) -> None:
            pass

    model = live.tiny_llama()
    out = tmp_path / "rec"
    start_session(RecordOptions(out_dir=str(out), first_step=0, last_step=5, every=2, writer="thread"))
    transformers_cb.install()
    profiling.observe(Observer())
    try:
        live.generate(model, max_new_tokens=NEW_TOKENS)
    finally:
        profiling.observe(None)
        end_session()
        transformers_cb.uninstall()
    entries = io.read_manifest(out)
    assert [e.step for e in entries] == [0, 2, 4]
    assert pushed == [f"attndbg/engine engine=transformers step={e.step} mode={e.mode} bs={e.batch_size} graph=eager" for e in entries]
    assert [e.mode for e in entries] == ["EXTEND", "DECODE", "DECODE"] and all(e.batch_size == 3 for e in entries)


def test_the_recorded_backend_follows_the_attention_implementation_between_generations(tmp_path: Path) -> None:
    """The recorder reads the model's attention implementation once per generation, not every step:
    one switched between two generations of the same model is what each one's steps name."""
    model = live.tiny_llama()
    transformers_cb.install()
    named = []
    try:
        for run, implementation in enumerate(["sdpa", "eager", "sdpa"]):
            model.set_attn_implementation(implementation)
            out = tmp_path / f"rec{run}"
            start_session(RecordOptions(out_dir=str(out), writer="thread", last_step=2))
            live.generate(model, max_new_tokens=3)
            end_session()
            named.append({io.load(path).source.backend for path in io.trace_paths(out)})
    finally:
        end_session()
        transformers_cb.uninstall()
    assert named == [{"sdpa"}, {"paged|eager"}, {"sdpa"}]  # transformers' paged eager attention under continuous batching
