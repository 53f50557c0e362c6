"""NVTX: every replay phase sits in an `attndbg/<phase>` range carrying step, mode and batch size;
a step file's work is one range named for the file; what a timeline reads from the messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attndbg import profiling
from attndbg.backends import registry
from attndbg.backends.base import PartialStates
from attndbg.checks.step import check_one
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.replay import runner
from attndbg.replay.runner import ReplayOptions, replay
from attndbg.timeline import ranges
from tests.factories import make_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"


def test_replay_phases_are_nvtx_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def annotate(message: str, domain: str):
        seen.append((message, domain))
        yield

    monkeypatch.setattr(profiling.nvtx, "annotate", annotate)
    replay(make_trace("decode-mha"), "t", ["triton"], ReplayOptions(cuda_graph=True, graph_capture=False))
    names = [m.split(" ")[0] for m, _ in seen]
    for expected in ("attndbg/data", "attndbg/reference", "attndbg/backend/triton", "attndbg/plan", "attndbg/run", "attndbg/compare", "attndbg/capture+replay"):
        assert expected in names, names
    assert all(domain == "attndbg" for _, domain in seen)
    run = next(m for m, _ in seen if m.startswith("attndbg/run"))
    assert "step=0" in run and "mode=DECODE" in run and "bs=3" in run and "backend=triton" in run


class _Phases:
    """A profiling observer that keeps the messages of the phases pushed (the timeline's collector's seat)."""

    def __init__(self) -> None:
        self.pushed: list[str] = []

    def push(self, message: str) -> None:
        self.pushed.append(message)

    def pop(self) -> None:
        pass


@pytest.fixture
def phases() -> Iterator[_Phases]:
    observer = _Phases()
    profiling.observe(observer)
    try:
        yield observer
    finally:
        profiling.observe(None)


def test_a_padded_sequence_run_without_capture_is_not_named_a_graph(phases: _Phases) -> None:
    # check without --cuda-graph: the graph's padded sequence runs eagerly, no cudaGraphLaunch to look for
    # (on the H200, check's timeline failed for 'replay ... batch=real holds 0 graph launches').
    replay(make_trace("decode-mha"), "t", ["triton"], ReplayOptions(cuda_graph=True, graph_capture=False))
    outer = next(m for m in phases.pushed if m.startswith("attndbg/capture+replay"))
    assert "variant=padded capture_bs=" in outer and "variant=graph" not in outer


def test_a_merge_probe_names_its_backend_and_probe_in_words_of_their_own(phases: _Phases) -> None:
    # The H200 run's 'attndbg/merge backend=triton decode_stage2 on crafted partials' read as backend
    # 'triton decode_stage2 on crafted partials' with no variant.
    states = PartialStates(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2), kv_lens=torch.tensor([64, 20]), num_splits=torch.tensor([2, 1]))
    runner.merge(registry.create("triton"), states, what="decode_stage2 on crafted partials")
    message = next(m for m in phases.pushed if m.startswith("attndbg/merge"))
    _, words = ranges.parse(message)
    assert (words["backend"], words["probe"]) == ("triton", "decode_stage2 on crafted partials")


def test_a_checked_step_is_one_range_named_for_its_file_with_the_context_probe_in_ranges(phases: _Phases) -> None:
    check_one(TRACES / "decode_gqa.pt", [FindingClass.INVARIANT, FindingClass.TREE_MASK], CheckOptions(backends=("triton",)))
    assert phases.pushed[0] == "attndbg/step trace=decode_gqa.pt step=0 mode=DECODE bs=4"
    # The CUDA-context probe after each detector launches kernels (zeros once, add_ each time): on
    # the H200 they ran outside every range.
    assert [m for m in phases.pushed if "context-probe" in m] == ["attndbg/context-probe detector=invariants", "attndbg/context-probe detector=tree-mask"]
