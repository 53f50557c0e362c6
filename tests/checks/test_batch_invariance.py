"""batch-invariance detector: a request's output must not change when it runs alone or in half of
its batch.

Clean steps run through our real Triton kernels, whose plans do change with the batch (SGLang's
split heuristic picks other num_kv_splits for a request alone): the tolerance absorbs that, and the
detector stays silent. The faulty backend (tests/checks/neighbour_row_backend.py, registered
through ATTNDBG_BACKENDS as a third party's adapter is) launches the same kernels with a plan
builder that gives the last request of a batch its neighbour's KV row: the detector must name that
request, the sub-batch, and say which run matches the reference. No mock stands in for a kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attndbg import machine
from attndbg.backends.triton import TritonBackend
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors import registry
from attndbg.detectors.base import Detector
from attndbg.detectors.batch_invariance import detect as batch_invariance
from attndbg.trace.subbatch import sub_batch
from tests.cli.helpers import invoke
from tests.factories import make_trace, write_trace

machine.select_triton_mode()

SMALL = ("heads=2:1", "head_dim=32", "shared_prefix=0")
# Four requests: each alone and both halves run; their split counts differ alone (SGLang's heuristic).
DECODE = ("decode-gqa", *SMALL, "kv_lens=5,40,70,300")
EXTEND = ("extend-prefix", *SMALL, "prefix_lens=0,9,20", "extend_lens=7,3,12")
# The neighbour of the last request has the longer row (the faulty plan copies the first kv_len of it).
FAULTY_3 = ("decode-gqa", *SMALL, "kv_lens=90,40,20")
FAULTY_4 = ("decode-gqa", *SMALL, "kv_lens=90,70,40,5")
NEIGHBOUR_ROW = "neighbour_row=tests.checks.neighbour_row_backend:NeighbourRowBackend"


@pytest.fixture
def neighbour_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", NEIGHBOUR_ROW)


def detect(trace, *backends: str):
    return batch_invariance.detect(CheckContext(trace=trace, path="t", options=CheckOptions(backends=backends)))


def test_the_sub_batches_are_each_request_alone_and_the_halves_from_four_on() -> None:
    assert batch_invariance.parts(1) == []
    assert [p.requests for p in batch_invariance.parts(3)] == [(0,), (1,), (2,)]
    assert [p.requests for p in batch_invariance.parts(5)] == [(0,), (1,), (2,), (3,), (4,), (0, 1), (2, 3, 4)]


def test_a_nan_in_one_run_only_is_a_difference_and_in_both_is_not() -> None:
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([[[1.0, nan]], [[nan, 2.0]], [[inf, 0.5]]])
    b = torch.tensor([[[1.0, nan]], [[0.0, 2.0]], [[inf, 0.25]]])
    assert batch_invariance._difference(a, b).flatten().tolist() == [0.0, inf, 0.25]


def test_a_clean_decode_step_is_silent_though_its_plans_differ_alone() -> None:
    trace = make_trace(*DECODE)
    triton = TritonBackend()
    whole = triton.derive_plan(trace).tensors["num_kv_splits"].tolist()
    alone = [int(triton.derive_plan(sub_batch(trace, (b,)).trace).tensors["num_kv_splits"]) for b in range(4)]
    assert whole != alone  # the batch-dependent plan the tolerance has to absorb
    assert detect(trace, "triton") == []


def test_a_clean_extend_step_is_silent() -> None:
    assert detect(make_trace(*EXTEND), "triton") == []


def test_a_batch_of_one_runs_nothing() -> None:
    assert detect(make_trace("decode-gqa", *SMALL, "kv_lens=40"), "triton") == []


def test_a_neighbours_kv_row_in_the_batch_names_the_request_and_says_alone_matches(neighbour_row: None) -> None:
    findings = detect(make_trace(*FAULTY_3), "neighbour_row", "triton")
    assert len(findings) == 1, [f.evidence for f in findings]  # triton's own plans are right: silent
    [found] = findings
    assert found.kind is FindingClass.BATCH_INVARIANCE and found.check == "output-depends-on-batch"
    assert (found.location.request, found.location.row) == (2, 2)
    data = found.data
    assert (data["backend"], data["sub_batch"], data["batch_size"], data["agrees_with_reference"]) == ("neighbour_row", [2], 3, "sub-batch")
    [request] = data["requests"]
    assert request["request"] == 2 and request["sub_batch_error"] <= 1 < request["batch_error"]
    assert data["max_diff"] > data["tolerance"] > 0
    assert found.evidence.startswith("neighbour_row: request 2 alone differs from the whole batch of 3 in requests [2]")
    assert "alone it matches the float64 reference, in the batch of 3 it does not" in found.cause


def test_halves_name_a_request_that_is_right_in_the_batch_and_wrong_in_its_half(neighbour_row: None) -> None:
    """In the first half the last request is request 1, which borrows request 0's row there only."""
    findings = detect(make_trace(*FAULTY_4), "neighbour_row")
    assert [(f.data["sub_batch"], f.location.request, f.data["agrees_with_reference"]) for f in findings] == [
        ([3], 3, "sub-batch"),
        ([0, 1], 1, "whole batch"),
    ]  # the second half's last request borrows the same row as in the batch: no difference
    assert "in the batch of 4 it matches the float64 reference, in the first half (requests 0-1) it does not" in findings[1].cause


def test_under_cuda_graphs_each_sub_batch_replays_padded_to_its_own_capture_size(neighbour_row: None) -> None:
    """--cuda-graph: graph replays compared too (on a CPU the runner's padded graph sequence runs
    eagerly on its static buffers; on a GPU it is captured). The faulty plan is derived for the
    padded batch too, so the graph replay of the batch of 3 (capture 4) differs from request 2's
    (capture 2) as the eager runs do; triton's graph replays stay silent."""
    trace = make_trace("decode-gqa", *SMALL, "kv_lens=40,20,10")
    findings = batch_invariance.detect(CheckContext(trace=trace, path="t", options=CheckOptions(backends=("neighbour_row", "triton"), cuda_graph=True)))
    assert [(f.data["variant"], f.data["batch_variant"], f.data["sub_batch"], f.data["agrees_with_reference"]) for f in findings] == [
        ("eager", "eager", [2], "sub-batch"),
        ("graph bs=2 fill=1", "graph bs=4 fill=1", [2], "sub-batch"),
    ]
    assert findings[1].evidence.startswith("neighbour_row graph bs=2 fill=1: request 2 alone differs from the whole batch of 3 (graph bs=4 fill=1) in requests [2]")


def test_opt_in_the_default_check_leaves_it_out() -> None:
    assert registry.load(FindingClass.BATCH_INVARIANCE).opt_in
    assert FindingClass.BATCH_INVARIANCE not in parse_only(None)
    assert parse_only("batch-invariance") == [FindingClass.BATCH_INVARIANCE]
    help_text = invoke("check", "--help", columns=200).output
    assert "batch-invariance  opt-in, runs only when named in --only" in help_text


# A third party's opt-in detector (registered below through ATTNDBG_DETECTORS): the default leaves it out too.
COSTLY = Detector(kind=FindingClass("costly"), summary="a costly toy, opt-in", detect=lambda ctx: [], opt_in=True)


def test_a_third_partys_opt_in_detector_runs_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_DETECTORS", "costly=tests.checks.test_batch_invariance:COSTLY")
    assert "costly" in registry.names() and "costly" not in registry.default_names()
    assert FindingClass("costly") not in parse_only(None) and parse_only("costly,invariants") == [FindingClass("costly"), FindingClass.INVARIANT]


def test_check_only_batch_invariance_through_the_cli(neighbour_row: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_trace(tmp_path / "step.pt", *FAULTY_3, plan=False)
    clean = invoke("check", str(path), "--only", "batch-invariance", "--backend", "triton")
    assert clean.exit_code == 0, clean.output
    assert "detectors: batch-invariance;" in clean.output and "0 findings" in clean.output

    report = tmp_path / "bad.json"
    bad = invoke("check", str(path), "--only", "batch-invariance", "--backend", "neighbour_row", "--json", str(report))
    assert bad.exit_code == 1, bad.output
    [step] = json.loads(report.read_text())["steps"]
    [found] = step["findings"]
    assert (found["class"], found["check"], found["location"]["request"], found["data"]["sub_batch"]) == ("batch-invariance", "output-depends-on-batch", 2, [2])

    # The default check runs every other detector and not this one.
    calls = []
    monkeypatch.setattr(batch_invariance, "detect", lambda ctx: calls.append(ctx) or [])
    # In process: the spy patches this process, and a GPU machine checks in spawned workers by default.
    default = invoke("check", str(path), "--backend", "triton", "--in-process")
    assert default.exit_code == 0, default.output
    assert "detectors: invariants, fill-value, tree-mask, split-merge, kernels;" in default.output and calls == []
    invoke("check", str(path), "--only", "batch-invariance", "--backend", "triton", "--in-process")
    assert len(calls) == 1  # named, it runs: the spy sees it


def test_sub_batches_share_the_steps_data_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """bs + 3 runs, one set of inputs and one float64 + one low-precision reference (the
    sub-batches take their rows of them: StepData.sub_batch)."""
    from attndbg.backends import reference
    from attndbg.replay import step_data

    calls = {"inputs": 0, "reference": 0}

    def counted(key: str, real):
        def call(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(step_data, "build_inputs", counted("inputs", step_data.build_inputs))
    monkeypatch.setattr(reference, "attention", counted("reference", reference.attention))
    assert detect(make_trace(*DECODE), "triton") == []
    assert calls == {"inputs": 1, "reference": 2}
