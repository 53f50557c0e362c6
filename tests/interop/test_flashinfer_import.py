"""`attndbg import flashinfer`: FlashInfer level-10 dumps (written as FlashInfer 0.7.2 writes them,
tests/interop/fi_dumps.py) import as recordings that check clean, keep the recorded output as the
engine's, mark what the dump does not carry as inferred, and name an incomplete plan "not read"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from attndbg.trace.schema import ForwardMode
from tests.interop import fi_dumps


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fi")
    fi_dumps.write_all(root / "dump")
    result = CliRunner().invoke(main, ["import", "flashinfer", str(root / "dump"), "-o", str(root / "rec")])
    assert result.exit_code == 0, result.output
    return root / "rec"


def _steps(rec: Path) -> list:
    return [io.load(p) for p in io.trace_paths(rec)]


def test_every_kind_of_run_becomes_a_step(imported: Path) -> None:
    steps = _steps(imported)
    modes = [t.batch.forward_mode for t in steps]
    # decode x2 layers, paged extend, verify, ragged, cascade, two graph replays
    assert modes == [ForwardMode.DECODE] * 2 + [ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND, ForwardMode.EXTEND] + [ForwardMode.DECODE] * 2
    assert [sorted(t.tensors) for t in steps[:2]] == [[0], [1]]  # the run's index since its plan is its layer
    assert [bool(t.graph and t.graph.is_graph_replay) for t in steps] == [False] * 6 + [True] * 2
    assert steps[5].plan.scalars["path"] == "cascade" and steps[5].batch.prefix_lens.tolist() == [6, 9]
    verify = steps[3]
    assert verify.spec.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 1]]
    assert all(t.source.engine == "flashinfer-dump" and t.source.engine_version == "0.7.2.post1" for t in steps)


def test_recorded_output_is_the_engine_output(imported: Path) -> None:
    trace = _steps(imported)[0]
    layer = trace.tensors[0]
    assert layer.output is not None and layer.lse is not None and layer.lse_base.value == "2"


def test_import_checks_and_replays_clean(imported: Path) -> None:
    report = imported.parent / "check.json"
    result = CliRunner().invoke(main, ["check", str(imported), "--backend", "triton", "--json", str(report)])
    assert result.exit_code == 0, result.output
    verdict = json.loads(report.read_text())["verdict"]
    assert verdict["checked_steps"] == 8 and verdict["findings"] == 0 and verdict["plans_unread"] == {}
    replay = CliRunner().invoke(main, ["replay", str(imported / "step_000003.pt"), "--backend", "triton"])
    assert replay.exit_code == 0, replay.output
    assert "recorded tensors" in replay.output


def test_inferred_fields_are_marked_and_shown(imported: Path) -> None:
    cascade = imported / "step_000005.pt"
    trace = io.load(cascade)
    assert "batch.out_cache_loc" in trace.source.inferred and "batch.positions" in trace.source.inferred
    shown = CliRunner().invoke(main, ["show", str(cascade)])
    assert shown.exit_code == 0, shown.output
    assert "inferred batch.out_cache_loc" in shown.output
    report = imported.parent / "show.json"
    assert CliRunner().invoke(main, ["show", str(cascade), "--json", str(report)]).exit_code == 0
    assert "batch.out_cache_loc" in json.loads(report.read_text())["source"]["inferred"]


def test_a_wrong_recorded_output_is_a_finding(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w)
    run = sorted((tmp_path / "dump").glob("*run_call0001"))[0]
    outputs = torch.load(run / "outputs.pt")
    outputs["result_0"][1] += 1.0  # request 1's row: what a broken kernel would return
    torch.save(outputs, run / "outputs.pt")
    runner = CliRunner()
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    result = runner.invoke(main, ["check", str(tmp_path / "rec" / "step_000000.pt"), "--backend", "triton", "--only", "split-merge"])
    assert result.exit_code == 1, result.output
    assert "recorded-output" in result.output


def test_arguments_left_out_are_filled_as_flashinfer_fills_them(tmp_path: Path) -> None:
    """SGLang's begin_forward passes neither window_left nor logits_soft_cap: FlashInfer's plan()
    then runs with its defaults, which the import fills in (marked inferred), so the plan detectors
    read the plan."""
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w, explicit=False)
    runner = CliRunner()
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    trace = io.load(tmp_path / "rec" / "step_000000.pt")
    inferred = trace.source.inferred
    assert {"model.sm_scale", "model.sliding_window", "model.logit_cap"} <= set(inferred)
    # The decode plan takes them through **kwargs: its forwarded defaults (decode.py _plan_impl).
    assert "window_left not passed: -1, FlashInfer 0.7.2.post1's default (_plan_impl" in inferred["model.sliding_window"]
    assert "logits_soft_cap not passed: None, which plan() makes 0.0" in inferred["model.logit_cap"]
    assert (trace.plan.scalars["window_left"], trace.plan.scalars["logits_soft_cap"]) == (-1, 0.0)
    report = tmp_path / "check.json"
    result = runner.invoke(main, ["check", str(tmp_path / "rec"), "--only", "invariants,tree-mask", "--json", str(report)])
    assert result.exit_code == 0, result.output
    verdict = json.loads(report.read_text())["verdict"]
    assert verdict["plans_unread"] == {} and verdict["findings"] == 0
    shown = runner.invoke(main, ["show", str(tmp_path / "rec" / "step_000000.pt")])
    assert "inferred model.sliding_window" in shown.output


def test_a_default_comes_from_the_dumped_signature(tmp_path: Path) -> None:
    """A paged prefill's plan() names its defaults in its own signature: the dumped version's
    signature is read, not a table (here a release whose window_left default differs, to tell)."""
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_paged_extend(w, explicit=False)
    signature = fi_dumps.SIGNATURES[f"{fi_dumps.PAGED}.plan"].replace("window_left: int = -1", "window_left: int = 5")
    session = tmp_path / "dump" / "session.jsonl"
    session.write_text(session.read_text().replace(json.dumps(fi_dumps.SIGNATURES[f"{fi_dumps.PAGED}.plan"]), json.dumps(signature)))
    assert CliRunner().invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    trace = io.load(tmp_path / "rec" / "step_000000.pt")
    assert trace.plan.scalars["window_left"] == 5 and trace.model.sliding_window == 5
    assert "the default in FlashInfer 0.7.2.post1's BatchPrefillWithPagedKVCacheWrapper.plan() signature" in trace.source.inferred["model.sliding_window"]


def test_a_wrong_last_page_len_is_imported_and_judged(tmp_path: Path) -> None:
    """last_page_len = seq_len % page_size is 0 for a full last page: the step imports (its
    request fills the pages listed, inferred), the plan keeps the 0, and check names the field; a
    correct decode beside it stays clean."""
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w, kv_lens=(5, 8, 3), last_page_mod=True, layers=1)
    fi_dumps.write_decode(w, ident=0x1100, kv_lens=(6, 9), seed=3, layers=1)
    runner = CliRunner()
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    bad = io.load(tmp_path / "rec" / "step_000000.pt")
    assert bad.batch.kv_lens.tolist() == [5, 8, 3] and bad.plan.tensors["kv_last_page_len"].tolist() == [1, 0, 3]
    assert "last_page_len[1] = 0" in bad.source.inferred["batch.kv_lens"]
    report = tmp_path / "check.json"
    result = runner.invoke(main, ["check", str(tmp_path / "rec"), "--only", "invariants", "--json", str(report)])
    assert result.exit_code == 1, result.output
    steps = json.loads(report.read_text())["steps"]
    (found,) = steps[0]["findings"]
    assert (found["class"], found["check"], found["severity"]) == ("invariants", "kv-last-page-len", "defect")
    assert "kv_last_page_len[1] = 0" in found["evidence"] and found["location"]["request"] == 1
    assert steps[1]["findings"] == []


def test_a_call_that_did_not_return_is_a_crashed_step(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w, crash="CUDA error: an illegal memory access was encountered", layers=1)
    runner = CliRunner()
    result = runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "--log", str(w.log), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 0, result.output
    assert "the call did not return: CUDA error: an illegal memory access was encountered: imported as a crashed step" in result.output
    trace = io.load(tmp_path / "rec" / "step_000000.pt")
    assert trace.source.crash == "CUDA error: an illegal memory access was encountered" and trace.tensors[0].output is None
    assert "crashed  " in runner.invoke(main, ["show", str(tmp_path / "rec" / "step_000000.pt")]).output
    # Without the log the crash is still kept, its error unknown.
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec2")]).exit_code == 0
    assert io.load(tmp_path / "rec2" / "step_000000.pt").source.crash == ""


def test_a_refused_import_leaves_no_folder(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w, layers=1)
    fi_dumps.write_paged_extend(w)
    plan = sorted((tmp_path / "dump").glob("*PrefillWithPagedKVCacheWrapper.plan_call*"))[0]
    (plan / "inputs.pt").write_bytes(b"not a torch file")  # hostile or broken: refused
    result = CliRunner().invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "out" / "rec")])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "out").exists()


def test_packed_mask_and_mla(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_verify(w, packed=True)
    fi_dumps.write_mla(w, ckv=512, kpe=64)
    runner = CliRunner()
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    verify, mla = _steps(tmp_path / "rec")
    assert "packed_custom_mask" in verify.plan.tensors and verify.spec.parents.tolist()[1] == [-1, 0, 1, 1]
    assert mla.model.attention.value == "mla" and mla.plan.backend == "mla" and mla.source.backend == "flashinfer_mla"
    result = runner.invoke(main, ["check", str(tmp_path / "rec"), "--backend", "triton"])
    assert result.exit_code == 0, result.output
    assert "0 findings" in result.output


def test_calls_without_a_step_form_are_named(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w, kv_lens=(3, 0))  # a padded row: no step
    out, lse = torch.zeros(2, 4, 8), torch.zeros(2, 4)
    w.call("merge_state", (out, lse, out, lse), {}, (out, lse))
    result = CliRunner().invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 3, result.output
    assert "merge_state not after a ragged and a paged run" in result.output
    assert "a decode request without KV" in result.output
