"""The check engine at recording scale: streaming, step selection, worker processes (same result
for any --jobs), a crashing worker, unreadable steps, and a verdict that says what ran."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.checks.run import check_steps
from attndbg.checks.selection import StepSelection, parse_only, select_paths
from attndbg.checks.workers import check_in_workers
from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.detectors import registry as detectors
from attndbg.trace import io
from tests.checks.crashing_worker import check_or_segfault, check_with_a_crashing_backend
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")
METADATA = parse_only("invariants,tree-mask,fill-value")


def _recording(directory: Path) -> Path:
    """Six steps, two carrying mistakes (a wrong tree mask, a decreasing indptr), and one verify step
    whose mask is left from the previous verify step (a recording-level finding)."""
    verify = make_trace("verify", "prefix_lens=4,7", *SMALL, plan=True)
    other_tree = make_trace("verify", "prefix_lens=4,7", *SMALL, "seed=9", plan=True)
    stale = replace(other_tree, spec=replace(other_tree.spec, custom_mask=verify.spec.custom_mask))
    steps = [
        make_trace("decode-mha", "kv_lens=3,20", *SMALL, plan=True),
        detectors.inject(make_trace("verify", "prefix_lens=4,7", *SMALL, plan=True), "tree-mask:sibling-visible"),
        make_trace("extend-prefix", "prefix_lens=0,9", "extend_lens=5,3", *SMALL, plan=True),
        verify,
        stale,
        detectors.inject(make_trace("decode-mha", "kv_lens=3,20,7", *SMALL, plan=True), "invariants:decreasing-indptr"),
    ]
    for step, trace in enumerate(steps):
        io.append_to_recording(directory, replace(trace, source=replace(trace.source, step=10 + step)))
    return directory


def _recording_with(tmp_path: Path, index: int, name: str) -> tuple[list[Path], Path]:
    """The test recording's steps with step `index` copied under the file name `name` (the test
    check functions act on a step by its name): the paths to check, and the renamed one."""
    paths = select_paths(_recording(tmp_path / "rec"))
    renamed = paths[index].with_name(name)
    shutil.copy(paths[index], renamed)
    paths[index] = renamed
    return paths, renamed


def _json(reports) -> str:
    from attndbg.report.checks import checks_to_json

    return json.dumps(checks_to_json(list(reports)), sort_keys=True)


def test_jobs_3_gives_the_same_json_as_jobs_1(tmp_path: Path) -> None:
    rec = _recording(tmp_path / "rec")
    one = list(check_steps(str(rec), METADATA, CheckOptions(backends=("reference",))))
    three = list(check_steps(str(rec), METADATA, CheckOptions(backends=("reference",)), jobs=3))
    assert _json(one) == _json(three)
    by_step = {r.step: r for r in one}
    assert by_step[11].findings and by_step[15].findings  # the injected mistakes
    assert not by_step[10].findings and not by_step[12].findings
    recording = [r for r in one if r.mode == "recording"]
    assert len(recording) == 1 and [f.check for f in recording[0].findings] == ["stale-mask"]
    assert recording[0].findings[0].location.step == 14


def test_cli_jobs_json_identical(tmp_path: Path) -> None:
    rec = _recording(tmp_path / "rec")
    outputs = []
    for jobs in ("1", "3"):
        path = tmp_path / f"j{jobs}.json"
        result = CliRunner().invoke(main, ["check", str(rec), "--only", "invariants,tree-mask", "--backend", "reference", "--jobs", jobs, "--json", str(path)])
        assert result.exit_code == 1, result.output
        outputs.append(json.loads(path.read_text()))
    assert outputs[0] == outputs[1]
    assert outputs[0]["schema"] == "attndbg.check/1"


def test_a_worker_that_dies_loses_only_its_step(tmp_path: Path) -> None:
    paths, _ = _recording_with(tmp_path, 2, "segfault.pt")
    results = list(check_in_workers(paths, METADATA, CheckOptions(backends=("reference",)), jobs=2, devices=None, check=check_or_segfault))
    assert [r.report.path for r in results] == [str(p) for p in paths]  # every step, in order
    dead = results[2].report
    assert dead.error is not None and "SIGSEGV" in dead.error and not dead.checked
    assert all(r.report.checked for i, r in enumerate(results) if i != 2)
    assert results[1].report.findings and results[5].report.findings  # the replacement worker went on


def test_a_backend_that_crashes_is_a_finding_and_the_step_is_checked_without_it(tmp_path: Path) -> None:
    """A worker killed inside a backend's launch: the step gets a backend-crash finding naming the
    backend, variant and signal, and is checked again in a fresh worker without that backend."""
    from attndbg.detector_api.findings import FindingClass

    paths, _ = _recording_with(tmp_path, 1, "kernelcrash.pt")  # the step with the injected tree-mask mistake
    results = list(check_in_workers(paths, METADATA, CheckOptions(backends=("reference",)), jobs=2, devices=None, check=check_with_a_crashing_backend))
    assert [r.report.path for r in results] == [str(p) for p in paths]
    report = results[1].report
    assert report.checked and report.step == 11
    crashed = report.findings[0]
    assert crashed.kind is FindingClass.BACKEND_CRASH and crashed.location.step == 11
    assert crashed.data["backend"] == "crashy" and crashed.data["variant"] == "eager"
    assert "crashy crashed on this step (eager)" in crashed.evidence and "SIGSEGV" in crashed.evidence
    # The step's own finding is still found by the re-check, and no other step saw a crash.
    assert any(f.kind is FindingClass.TREE_MASK for f in report.findings[1:])
    assert all(f.kind is not FindingClass.BACKEND_CRASH for i, r in enumerate(results) if i != 1 for f in r.report.findings)
    assert all(r.report.checked for r in results)


def test_jobs_auto_spreads_only_long_recordings(monkeypatch: pytest.MonkeyPatch) -> None:
    from attndbg.checks import run

    monkeypatch.setattr(run.machine, "host_cores", lambda: 16)
    assert run.auto_jobs(10, (0,)) == 1  # worker start-up would cost more than it saves
    assert run.auto_jobs(1000, (0,)) == 8  # 8 cores' worth, 8 per GPU
    assert run.auto_jobs(1000, (0, 1)) == 8  # still two cores a worker
    assert run.auto_jobs(120, None) == 2
    monkeypatch.setattr(run.machine, "host_cores", lambda: 2)
    assert run.auto_jobs(1000, None) == 1  # a 2-core machine checks in one process


def test_steps_and_sample_select_by_step_number(tmp_path: Path) -> None:
    rec = _recording(tmp_path / "rec")
    names = lambda sel: [p.name for p in select_paths(rec, sel)]  # noqa: E731
    assert names(StepSelection(start=12, stop=14)) == ["step_000012.pt", "step_000013.pt"]
    assert names(StepSelection(start=14)) == ["step_000014.pt", "step_000015.pt"]
    assert names(StepSelection(sample=3)) == ["step_000010.pt", "step_000012.pt", "step_000015.pt"]
    assert names(StepSelection(start=11, sample=1)) == ["step_000011.pt"]
    result = CliRunner().invoke(main, ["check", str(rec), "--only", "invariants", "--steps", "11:13"])
    assert "checked 2 of 2 steps" in result.output
    result = CliRunner().invoke(main, ["check", str(rec), "--steps", "5-9"])
    assert result.exit_code == 2 and "--steps" in result.output


def test_an_unreadable_step_is_reported_and_the_others_are_checked(tmp_path: Path) -> None:
    rec = _recording(tmp_path / "rec")
    (rec / "step_000012.pt").write_bytes(b"not a trace")
    (rec / "step_000013.pt").unlink()
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(rec), "--only", "invariants", "--json", str(report)])
    assert result.exit_code == 1, result.output  # findings elsewhere still win
    steps = json.loads(report.read_text())["steps"]
    errors = [s for s in steps if not s["checked"]]
    assert [Path(s["trace"]).name for s in errors] == ["step_000012.pt", "step_000013.pt"]
    assert "not a readable attndbg trace" in errors[0]["error"] and "cannot read" in errors[1]["error"]
    assert sum(1 for s in steps if s["checked"]) == 4
    assert "checked 4 of 6 steps" in result.output


def test_clean_check_with_a_named_backend_that_cannot_run_is_not_a_pass(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from attndbg import machine

    if machine.cuda_available():
        pytest.skip("flashinfer may run on a GPU")
    path = io.save(make_trace("decode-mha", *SMALL, plan=True), tmp_path / "t.pt")
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--backend", "flashinfer"])
    assert result.exit_code == 3, result.output
    assert "flashinfer unavailable: no CUDA GPU" in result.output


def test_backend_all_names_what_did_not_run_and_is_not_incomplete(tmp_path: Path) -> None:
    """`--backend all` means "whatever runs here", as in replay: a backend that cannot run on this
    machine (vLLM not installed, no GPU) is said on the verdict line and in the JSON, and a clean check
    exits 0, not 3 (on an H200 without vLLM, every `check --backend all` once exited 3 for vllm_paged)."""
    path = io.save(make_trace("decode-mha", *SMALL, plan=True), tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--backend", "all", "--json", str(report)])
    assert result.exit_code == 0, result.output
    skipped = json.loads(report.read_text())["verdict"]["skipped"]
    assert "vllm_paged" in skipped and "vllm_paged " in result.output  # ran on no step here, whatever the machine
    named = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--backend", "vllm_paged"])
    assert named.exit_code == 3, named.output  # named alone, it is still a check that did not run what it asked


def test_verdict_names_the_kernels_that_ran(tmp_path: Path) -> None:
    path = io.save(make_trace("decode-mha", "kv_lens=3,20", *SMALL, plan=True), tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "split-merge", "--backend", "triton", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "kernels compared with the float64 reference: triton (1 step)" in result.output
    verdict = json.loads(report.read_text())["verdict"]
    assert verdict["compared"] == {"triton": 1} and verdict["skipped"] == {}
    metadata_only = CliRunner().invoke(main, ["check", str(path), "--only", "invariants"])
    assert metadata_only.exit_code == 0 and "no kernel ran" in metadata_only.output


def test_a_step_builds_its_data_and_reference_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every run of a step (split-count sweep, padded replays, recorded plan) shares one set of
    inputs and one float64 + one low-precision reference."""
    from attndbg.backends import reference
    from attndbg.replay import step_data

    calls = {"inputs": 0, "reference": 0}
    real_build, real_attention = step_data.build_inputs, reference.attention

    def counting_build(*args, **kwargs):
        calls["inputs"] += 1
        return real_build(*args, **kwargs)

    def counting_attention(*args, **kwargs):
        calls["reference"] += 1
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(step_data, "build_inputs", counting_build)
    monkeypatch.setattr(reference, "attention", counting_attention)
    path = io.save(make_trace("decode-mha", "kv_lens=3,20", *SMALL, "capture_bs=4", plan=True), tmp_path / "t.pt")
    # In this process (a GPU machine would check in a worker, out of the monkeypatches' reach).
    reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("triton",)), isolate=False))
    assert reports and reports[0].backends == ("triton",)
    assert calls == {"inputs": 1, "reference": 2}


def test_findings_name_the_row_within_the_request(tmp_path: Path) -> None:
    """A finding at step row 7 of request 1 (whose rows start at 5) reads 'row 2 (step row 7)'."""
    from attndbg.checks.step import _located
    from attndbg.detector_api.findings import Finding, FindingClass, Location

    trace = make_trace("extend-prefix", "prefix_lens=0,9", "extend_lens=5,3", *SMALL)
    found = Finding(FindingClass.INVARIANT, "x", Location(step=0, request=1, row=7, head=0), "e", "c")
    located = _located(found, trace)
    assert located.location.request_row == 2
    assert "request 1 / row 2 (step row 7) / head 0" in str(located.location)
    assert located.to_json()["location"]["request_row"] == 2


def test_a_torch_attention_engine_is_not_said_to_merge_splits() -> None:
    """transformers' sdpa/eager attention computes each row in one pass: a wrong decode output there
    is not explained by a split-KV merge."""
    from attndbg.backends.engine_names import merge_path

    trace = make_trace("decode-mha", *SMALL)
    assert merge_path(trace) is not None  # synth records SGLang's Triton backend: split-KV decode
    for backend in ("sdpa", "paged|eager", "flex_attention"):
        assert merge_path(replace(trace, source=replace(trace.source, backend=backend))) is None


def test_a_step_whose_data_cannot_fit_is_refused_before_allocating(tmp_path: Path) -> None:
    """A valid trace claiming a 2**33-slot KV pool (1 TiB here) is refused with the number, never
    allocated: exit 2 for one file; in a recording, that step is not checked and the others are."""
    trace = make_trace("decode-mha", *SMALL, plan=True)
    huge = replace(trace, batch=replace(trace.batch, kv_cache_size=2**33))
    path = io.save(huge, tmp_path / "huge.pt")
    for command in (["replay", str(path), "--backend", "triton"], ["check", str(path)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "batch.kv_cache_size: = 8589934592 slots" in result.output and "GiB" in result.output
        assert "Traceback" not in result.output
    rec = tmp_path / "rec"
    for step, t in enumerate([trace, huge, trace]):
        io.append_to_recording(rec, replace(t, source=replace(t.source, step=step)))
    reports = list(check_steps(str(rec), parse_only("split-merge"), CheckOptions(backends=("triton",))))
    assert [r.checked for r in reports] == [True, False, True]
    assert "not replayed" in reports[1].error


def test_an_early_step_far_down_the_recording_does_not_stall_the_workers(tmp_path: Path) -> None:
    """The first step of a kernel shape may sit far past the dispatch window (one verify step at
    step 45 of a decode recording): it goes out first and every step still comes back, in order.
    (This stalled forever on the H100: with nothing dispatchable and no worker busy, nothing woke
    the dispatcher.)"""
    import signal

    rec = tmp_path / "rec"
    decode = make_trace("decode-mha", "kv_lens=3,5", *SMALL, plan=True)
    verify = make_trace("verify", "prefix_lens=4,7", *SMALL, plan=True)
    for step in range(50):
        trace = verify if step == 45 else decode
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    paths = select_paths(rec)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("the workers stalled")))
    signal.alarm(180)
    try:
        results = list(check_in_workers(paths, parse_only("invariants"), CheckOptions(backends=("reference",)), jobs=2, devices=None, first=[0, 45]))
    finally:
        signal.alarm(0)
    assert [r.report.path for r in results] == [str(p) for p in paths]
    assert results[45].report.mode == "TARGET_VERIFY" and all(r.report.checked for r in results)


def test_the_verdict_names_the_steps_no_kernel_was_compared_on() -> None:
    """A per-backend step count hides which steps no backend replayed (a plain extend, which no
    detector replays): the verdict says how many by mode, and says nothing when every step was."""
    from attndbg.checks.step import StepReport
    from attndbg.detector_api.findings import FindingClass
    from attndbg.report.checks import check_verdict

    steps = [
        StepReport("a.pt", 0, "DECODE", [], backends=("triton",)),
        StepReport("b.pt", 1, "EXTEND", []),
        StepReport("c.pt", 2, "EXTEND", []),
        StepReport("d.pt", 3, "MIXED", []),
        StepReport("e.pt", 4, "EXTEND", [], error="worker died"),  # not checked: counted as such, not here
    ]
    verdict = check_verdict(steps, [FindingClass.SPLIT_MERGE], ("triton",))
    assert "kernels compared with the float64 reference: triton (1 step)" in verdict.line
    assert "no kernel compared on 3 steps (EXTEND 2, MIXED 1: metadata and recorded tensors only)" in verdict.line
    assert verdict.unreplayed == {"EXTEND": 2, "MIXED": 1}
    every = check_verdict(steps[:1], [FindingClass.SPLIT_MERGE], ("triton",))
    assert "no kernel compared on" not in every.line and every.unreplayed == {}
    none = check_verdict(steps[1:4], [FindingClass.INVARIANT], None)
    assert "no kernel ran (metadata and recorded tensors only)" in none.line and "no kernel compared on" not in none.line


def test_jobs_auto_counts_the_cores_the_process_may_use() -> None:
    """A check started under `taskset -c 0` (or in a container's cpuset) on a many-core host sizes its
    workers by the one core it has, not by os.cpu_count()."""
    import subprocess
    import sys

    # os.cpu_count() says 64, as on a 4-GPU host: only the affinity can give 1.
    code = "import os; os.cpu_count = lambda: 64; from attndbg.checks import run; print(run.auto_jobs(1000, (0,)))"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"


def test_a_step_over_a_workers_share_of_the_gpu_is_checked_alone_with_the_whole_part(tmp_path: Path) -> None:
    """Workers on one GPU each keep to 0.9/N of it; a step that fits the card but not a share is
    handed back and checked once more, alone, with the workers' whole part (as with --jobs 1),
    instead of being refused as not fitting (754 of 1,000 server steps were, with 8 workers)."""
    from tests.checks.share_worker import check_with_a_big_step

    paths, big = _recording_with(tmp_path, 3, "big.pt")
    results = list(check_in_workers(paths, METADATA, CheckOptions(backends=("reference",)), jobs=3, devices=None, check=check_with_a_big_step))
    assert [r.report.path for r in results] == [str(p) for p in paths]
    assert all(r.report.checked and not r.over_share for r in results)
    runs = [line.split() for line in (big.parent / "shares.txt").read_text().splitlines()]
    assert [float(share) for name, share in runs if name == "big.pt"] == [0.3, 0.9]  # its share, then alone
    assert {float(share) for name, share in runs if name != "big.pt"} == {0.3}
    assert len(runs) == len(paths) + 1


def test_a_step_out_of_gpu_memory_in_a_worker_is_checked_again_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory error in a worker (its share, or a card the other workers' caches and
    contexts filled) is no verdict on the step: it is checked again alone, and only then reported."""
    log = tmp_path / "oom.log"
    monkeypatch.setenv("ATTNDBG_DETECTORS", "oom=tests.checks.oom_detector:DETECTOR")
    monkeypatch.setenv("ATTNDBG_TEST_OOM_STEP", "12")
    monkeypatch.setenv("ATTNDBG_TEST_OOM_LOG", str(log))
    rec = _recording(tmp_path / "rec")
    paths = select_paths(rec)
    results = list(check_in_workers(paths, parse_only("invariants,oom"), CheckOptions(backends=("reference",)), jobs=3, devices=None))
    assert [r.report.path for r in results] == [str(p) for p in paths]
    assert all(r.report.checked for r in results), [r.report.error for r in results if not r.report.checked]
    runs = [line.split() for line in log.read_text().splitlines()]
    assert [float(share) for step, share in runs if step == "12"] == [0.3, 0.9]  # its share, then alone
    assert len(runs) == len(paths) + 1


def test_a_worker_numbers_its_gpu_as_its_parent_does() -> None:
    """Under CUDA_VISIBLE_DEVICES=3 the parent's GPU 0 is physical GPU 3: a worker on GPU 0 must see
    GPU 3 alone, not physical GPU 0 (another job's card)."""
    from attndbg.checks.workers import worker_devices

    assert worker_devices(0, None) == "0" and worker_devices(1, "") == "1"
    assert worker_devices(0, "3") == "3"
    assert worker_devices(1, "2, 5") == "5"
    assert worker_devices(0, "GPU-8f1c2d3e-aaaa-bbbb-cccc-0123456789ab") == "GPU-8f1c2d3e-aaaa-bbbb-cccc-0123456789ab"
    with pytest.raises(ValueError, match="GPU 2 is not among the 2"):
        worker_devices(2, "2,5")


def test_workers_exit_together_at_the_end(tmp_path: Path) -> None:
    """The pool's end waits for its workers' exits at once, not one after another (8 workers of a
    1,000-step check on an H200 spent their last ~8 s stopped in turn)."""
    from tests.checks.slow_exit_worker import SLOW_EXIT_S, check_then_exit_slowly

    paths = select_paths(_recording(tmp_path / "rec"))
    results = iter(check_in_workers(paths, METADATA, CheckOptions(backends=("reference",)), jobs=4, devices=None, check=check_then_exit_slowly))
    *_, last = (next(results) for _ in paths)  # every step's result, the workers still up
    start = time.monotonic()
    assert next(results, None) is None  # the pool's end: its workers stopped
    stopped = time.monotonic() - start
    assert last.report.checked
    assert SLOW_EXIT_S <= stopped < 3 * SLOW_EXIT_S, stopped  # one by one: at least 4 x SLOW_EXIT_S
