"""The flight recorder on a live engine (transformers' continuous batching, on the CPU).

`attndbg record --ring K` writes nothing until a trigger fires, then the ring as a normal
recording: the command's non-zero exit (through the CLI), an exception
in the engine (its step kept, in flight), a NaN in a recorded output (`--when nan`), a wrong index
the engine hands its cache (the step kept as evidence that `check` flags). Each has a clean twin
that writes nothing. The GPU versions (CUDA errors, CUDA graphs, in-graph probes) are in
tests/gpu/test_flight_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.record.engines import import_engine

import_engine("transformers.generation.continuous_batching")

from attndbg.checks.run import check_steps  # noqa: E402
from attndbg.checks.selection import parse_only  # noqa: E402
from attndbg.detector_api.context import CheckOptions  # noqa: E402
from attndbg.record.options import RecordOptions  # noqa: E402
from attndbg.record.session import end_session, start_session  # noqa: E402
from attndbg.record.transformers import adapter as transformers_cb  # noqa: E402
from attndbg.trace import io  # noqa: E402
from tests.record import flight_engine  # noqa: E402
from attndbg.examples import transformers_generate as live  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(live.__file__)


def _record(out: Path, *options: str, command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attndbg", "record", "-o", str(out), *options, "--", *command], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _findings(out: Path) -> list[tuple[int, str]]:
    reports = check_steps(str(out), parse_only(None), CheckOptions(backends=("reference",)))
    return [(f.location.step, f.check) for r in reports for f in r.findings]


def test_exit_trigger_keeps_the_last_steps_of_a_command_that_exits_3(tmp_path: Path) -> None:
    """`record --ring 4 -- sh -c 'python transformers_generate.py && exit 3'`: exits 3, keeps the last
    four steps, names the trigger `exit` with code 3."""
    out = tmp_path / "rec"
    done = _record(out, "--ring", "4", command=["sh", "-c", f"{sys.executable} {SCRIPT} && exit 3"])
    assert done.returncode == 3, done.stderr[-3000:]
    entries = io.read_manifest(out)
    # Five steps ran (a prefill, four decodes); the ring keeps the last four.
    assert [e.step for e in entries] == [1, 2, 3, 4] and not any(e.in_flight for e in entries)
    [trigger] = io.read_triggers(out)
    assert (trigger.kind, trigger.code, trigger.step) == ("exit", 3, 4) and trigger.message == "the command exited 3"
    assert "ring written on exit at step 4: the command exited 3" in done.stderr
    assert _findings(out) == []  # a normal recording of correct steps: it checks clean


_TOY = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from dataclasses import replace
    from attndbg.record.session import HostCopy, current_session
    from attndbg.trace import synth

    session = current_session()
    for step in range(5):
        session.next_step()
        trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=3,9"]))
        session.submit(HostCopy({}), lambda host, trace=trace, step=step: replace(trace, source=replace(trace.source, step=step)))
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGTERM)
    if sys.argv[1] == "abort":  # a CUDA error seen by a hook, then the abort a freed pinned block causes on a GPU
        with session.guard("a test hook"):
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        signal.signal(signal.SIGABRT, signal.SIG_DFL)
        os.abort()
    if sys.argv[1] == "usr1":  # to `record`, which passes it on to this process
        os.kill(os.getppid(), signal.SIGUSR1)
        session.flight.drain(10)
        for _ in range(100):
            if session.flight.fired:
                break
            time.sleep(0.05)
        sys.exit(0)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize(("how", "code", "words"), [("0", 0, None), ("kill", 128 + 15, "killed by SIGTERM"), ("usr1", 0, "signal")], ids=["exit-0", "sigterm", "sigusr1"])
def test_a_clean_exit_writes_nothing_and_a_killed_process_leaves_its_ring(tmp_path: Path, how: str, code: int, words: str | None) -> None:
    """A process that exits 0 leaves no recording; one ended by SIGTERM leaves its ring first, and
    `record` exits 128 + 15 saying so; SIGUSR1 sent to `record` reaches the process holding the
    ring, which writes it (a toy process stands in for the engine: the launcher's part is tested)."""
    script = tmp_path / "toy.py"
    script.write_text(_TOY)
    out = tmp_path / "rec"
    done = _record(out, "--ring", "2", command=[sys.executable, str(script), how])
    assert done.returncode == code, done.stderr[-3000:]
    if words is None:
        assert not (out / io.MANIFEST).exists() and "no trigger fired, nothing written" in done.stderr
        return
    if words == "signal":
        assert [e.step for e in io.read_manifest(out)] == [3, 4]
        assert [(t.kind, t.step) for t in io.read_triggers(out)] == [("signal", 4)]
        return
    assert [e.step for e in io.read_manifest(out)] == [3, 4]
    assert [(t.kind, t.code, t.message) for t in io.read_triggers(out)] == [("exit", code, f"the command {words}")]
    assert f"the command {words}" in done.stderr


def test_a_process_aborting_after_a_cuda_error_leaves_its_ring_and_record_names_the_exit(tmp_path: Path) -> None:
    """A CUDA error seen by a hook writes the ring in the hook's own thread before the hook returns
    (on a GPU the process may abort at any moment after one); the process then dies by SIGABRT,
    running no exit code, and `record` writes the `exit` line the process could not, exiting 134."""
    script = tmp_path / "toy.py"
    script.write_text(_TOY)
    out = tmp_path / "rec"
    done = _record(out, "--ring", "2", command=[sys.executable, str(script), "abort"])
    assert done.returncode == 128 + 6, done.stderr[-3000:]
    assert [(e.step, e.in_flight) for e in io.read_manifest(out)] == [(3, False), (4, False)], done.stderr[-3000:]
    triggers = io.read_triggers(out)
    assert [(t.kind, t.step, t.code) for t in triggers] == [("cuda-error", 4, None), ("exit", 4, 134)], triggers
    assert triggers[0].pid == triggers[1].pid and "device-side assert" in triggers[0].message
    assert triggers[1].message.startswith("the command killed by SIGABRT; process ") and "without running its exit code" in triggers[1].message


@pytest.fixture
def engine() -> Iterator[torch.nn.Module]:
    model = live.tiny_llama()
    yield model
    end_session()
    transformers_cb.uninstall()


def test_an_exception_in_the_engine_keeps_its_step_in_flight_and_check_flags_the_index(tmp_path: Path, engine: torch.nn.Module) -> None:
    """A wrong KV read index at step 3: the gather raises (IndexError here, a CUDA error on a GPU),
    the ring is written with that step in flight, its trace keeps the engine's index as evidence,
    and `check` names it; the steps before it check clean."""
    out = tmp_path / "rec"
    start_session(RecordOptions(out_dir=str(out), writer="thread", ring=2))
    transformers_cb.install()
    remove = flight_engine.inject(corrupt_step=3)
    try:
        live.generate(engine, max_new_tokens=6)  # transformers catches it: the requests fail
    finally:
        remove()
        end_session()
    assert [(e.step, e.in_flight) for e in io.read_manifest(out)] == [(1, False), (2, False), (3, True)]
    [trigger] = io.read_triggers(out)
    assert (trigger.kind, trigger.step) == ("exception", 3) and "IndexError" in trigger.message
    faulty = io.load(out / "step_000003.pt")
    assert faulty.plan is not None and faulty.plan.backend == "transformers"
    assert int(faulty.plan.tensors["read_index"][0]) >= faulty.plan.scalars["token_rows"]
    assert _findings(out) == [(3, "index-outside-cache")]
    assert io.load(out / "step_000002.pt").plan is None  # evidence only where an index is outside


def test_when_nan_fires_on_the_step_whose_output_carries_it(tmp_path: Path, engine: torch.nn.Module) -> None:
    out, clean = tmp_path / "rec", tmp_path / "clean"
    start_session(RecordOptions(out_dir=str(out), writer="thread", ring=2, layers=(0,), when=("nan",)))
    transformers_cb.install()
    remove = flight_engine.inject(nan_step=3)
    try:
        live.generate(engine, max_new_tokens=6)
    finally:
        remove()
        end_session()
    [trigger] = io.read_triggers(out)
    assert (trigger.kind, trigger.step) == ("nan", 3) and trigger.message.startswith("layer0.output: ")
    steps = {e.step: e for e in io.read_manifest(out)}
    assert 3 in steps and steps[3].layers == [0]
    output = io.load(out / steps[3].file).tensors[0].output
    rows = torch.isfinite(output.float()).flatten(1).all(1)
    assert rows.numel() > 1 and not bool(rows[0]) and bool(rows[1:].all()), rows  # request 0's row alone (its mask row)
    assert all(bool(torch.isfinite(io.load(out / e.file).tensors[0].output).all()) for s, e in steps.items() if s < 3)
    # The clean twin: the same engine, no NaN, nothing fires and nothing is written.
    start_session(RecordOptions(out_dir=str(clean), writer="thread", ring=2, layers=(0,), when=("nan",)))
    live.generate(engine, max_new_tokens=6)
    stats = end_session()
    assert not (clean / io.MANIFEST).exists() and stats is not None and stats.stopped_reason is None


def test_a_layer_without_kv_rows_is_not_compared_one_with_them_is(tmp_path: Path, engine: torch.nn.Module) -> None:
    """What a graph replay's probes record (q, new k/v, output; no KV rows): check cannot compare
    the output with the reference (it would attend over drawn KV values) and does not; the same
    wrong output with the rows recorded is a finding."""
    from dataclasses import replace

    from attndbg.detector_api.context import CheckContext
    from attndbg.detectors.split_merge.recorded import kv_rows_cover, recorded_tensors

    out = tmp_path / "rec"
    start_session(RecordOptions(out_dir=str(out), writer="thread", layers=(0,), first_step=2, last_step=3))
    transformers_cb.install()
    live.generate(engine, max_new_tokens=4)
    end_session()
    trace = io.load(io.trace_paths(out)[0])
    layer = trace.tensors[0]
    wrong = replace(layer, output=layer.output * 2)
    probed = replace(wrong, kv_slots=layer.kv_slots[:0], k_rows=layer.k_rows[:0], v_rows=layer.v_rows[:0])
    assert kv_rows_cover(trace, layer) and not kv_rows_cover(trace, probed)

    def findings(tensors) -> list[str]:  # noqa: ANN001
        return [f.check for f in recorded_tensors(CheckContext(trace=replace(trace, tensors={0: tensors}), path="x", options=CheckOptions(backends=("reference",))))]

    assert findings(layer) == [] and findings(wrong) != [] and findings(probed) == []


@pytest.mark.parametrize("layers", [(), (0,)], ids=["metadata", "layer0"])
def test_a_ring_written_on_a_signal_holds_the_traces_a_plain_recording_writes(tmp_path: Path, engine: torch.nn.Module, layers: tuple[int, ...]) -> None:
    """The ring's per-step path (pooled buffers, steps opened before the call) records what the
    plain recorder does, bit for bit: the same generation, recorded both ways, gives equal files."""
    from attndbg.record.triggers import Trigger, TriggerKind
    from attndbg.trace.schema import to_dict

    plain, ring = tmp_path / "plain", tmp_path / "ring"
    transformers_cb.install()
    start_session(RecordOptions(out_dir=str(plain), writer="thread", layers=layers))
    live.generate(engine, max_new_tokens=6)
    end_session()
    session = start_session(RecordOptions(out_dir=str(ring), writer="thread", ring=64, layers=layers))
    live.generate(engine, max_new_tokens=6)
    session.flight.fire(Trigger(kind=TriggerKind.SIGNAL, step=None, message="test"))
    end_session()
    written = [e.file for e in io.read_manifest(plain)]
    assert len(written) == 6 and [e.file for e in io.read_manifest(ring)] == written
    for name in written:
        _assert_equal(to_dict(io.load(ring / name)), to_dict(io.load(plain / name)), name)


def _assert_equal(a: object, b: object, where: str) -> None:
    """Nested dicts, lists and tensors equal to the bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
