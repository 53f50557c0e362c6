"""Run variants are types (replay/variants.py); their labels are the exact strings reports and the
JSON have always shown (docs/json.md), and the runner tags every run with one."""

from __future__ import annotations

import pytest

from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.replay.variants import EAGER, RECORDED, Eager, Graph, Recorded, parse_variant, run_name
from tests.factories import make_trace


@pytest.mark.parametrize(
    ("variant", "label"), [(EAGER, "eager"), (RECORDED, "recorded plan"), (Graph(capture_bs=8, fill=1), "graph bs=8 fill=1"), (Graph(capture_bs=12, fill=0), "graph bs=12 fill=0")]
)
def test_label_and_back(variant, label: str) -> None:
    assert variant.label == label
    assert parse_variant(label) == variant


@pytest.mark.parametrize("label", ["", "Eager", "recorded", "graph", "graph bs=8", "graph bs=x fill=1", "graph bs=8 fill=1 ", "eager (not launched)"])
def test_parse_refuses_what_is_no_label(label: str) -> None:
    with pytest.raises(ValueError, match="is not a run variant"):
        parse_variant(label)


def test_run_name() -> None:
    assert [run_name("triton", v) for v in (EAGER, RECORDED, Graph(capture_bs=4, fill=1))] == ["triton", "triton recorded plan", "triton graph bs=4 fill=1"]


def test_the_runner_tags_each_run_with_its_type() -> None:
    """Plan BOTH with the graph sequence run eagerly (no capture on a CPU): one run of each type."""
    trace = make_trace("decode-gqa", "kv_lens=5,70", plan=True)
    options = ReplayOptions(plan=PlanSource.BOTH, cuda_graph=True, graph_capture=False, capture_bs=4, fill_value=1)
    runs = replay(trace, "t", ["triton"], options).runs
    assert [type(r.variant) for r in runs] == [Eager, Recorded, Graph]
    assert runs[2].variant == Graph(capture_bs=4, fill=1)
    assert all(r.status is RunStatus.PASSED and r.refused is None for r in runs), [(r.variant, r.status, r.reason) for r in runs]


def test_a_refusal_by_another_name_is_not_refused() -> None:
    """A recorded plan another backend built is unsupported, not refused by the guard: `refused`
    is the guard's alone, whatever the reason says."""
    trace = make_trace("decode-gqa", "kv_lens=5,70", plan=True)
    run = replay(trace, "t", ["reference"], ReplayOptions(plan=PlanSource.RECORDED)).runs[0]
    assert run.variant == RECORDED and run.status is RunStatus.UNSUPPORTED and run.refused is None
