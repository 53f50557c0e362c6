"""A standalone merge of given partial states (trace.merge) on the GPU: FlashInfer's merge_state
(two states) and merge_states (more), and our Triton merge kernel compiled, each against the
float64 merge; the backends that take no merge say why; `attndbg replay` and `attndbg check` exit
0 on a correct step, and check names an LSE base mix-up recorded in one.

Each test records what ran (`record_property`: backend, status, max_abs, max_lse_abs, reason).
FlashInfer JIT-compiles its cascade module on first use: run the file in one pytest call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attndbg.backends import reference, registry
from attndbg.backends.base import PartialStates
from attndbg.replay.runner import ReplayOptions, RunStatus, given_states, merge, replay
from attndbg.trace import io
from attndbg.trace.schema import LseBase
from tests.cli.helpers import invoke
from tests.factories import make_trace

pytestmark = pytest.mark.gpu

SPECS = (
    ("merge-state",),  # two base-2 states: flashinfer.cascade.merge_state
    ("merge-state", "lse_base=e", "empty=1", "dtype=float16"),  # natural-log states, an empty chunk on every other row
    ("merge-chunks",),  # five natural-log states, one an empty chunk: merge_states
    ("merge-chunks", "lse_base=2", "heads=32", "head_dim=64", "tokens=300"),
    ("merge-state", "states=1", "head_dim=256"),
    ("merge-state", "row_mask=1", "tokens=100"),  # merge_state_in_place(mask=): rows left out keep state a
)
IDS = [" ".join(words) for words in SPECS]


@pytest.mark.parametrize("name", ["reference", "triton", "flashinfer"])
@pytest.mark.parametrize("words", SPECS, ids=IDS)
def test_merges_pass_against_the_float64_merge(words: tuple[str, ...], name: str, record_property) -> None:
    backend = registry.create(name)
    if backend.unavailable_reason() is not None:
        pytest.fail(f"{name} must run on this GPU machine: {backend.unavailable_reason()}")
    trace = make_trace(*words)
    run = replay(trace, IDS[0], [name], ReplayOptions(repeat=2)).runs[0]
    record_property("backend", name)
    record_property("status", run.status.value)
    assert run.status is RunStatus.PASSED, (run.status, run.reason, run.comparison)
    record_property("max_abs", run.comparison.max_abs)
    record_property("max_lse_abs", run.comparison.max_lse_abs)
    assert run.repeat_identical is True and run.comparison.nonfinite == 0
    assert run.comparison.total_rows == trace.merge.num_tokens
    if name != "reference" and trace.merge.num_states > 1:
        # a kernel's rounding, not the reference again (a merge of one state is that state: exact,
        # as the H100 run showed for both kernels)
        assert run.comparison.max_abs > 0


@pytest.mark.parametrize("name", ["fa3", "mla", "vllm_paged"])
def test_the_others_say_why(name: str, record_property) -> None:
    run = replay(make_trace("merge-state"), "merge-state", [name]).runs[0]
    record_property("reason", run.reason)
    assert run.status in (RunStatus.UNSUPPORTED, RunStatus.UNAVAILABLE), run.status
    if run.status is RunStatus.UNSUPPORTED:
        assert "a standalone merge of given partial states" in run.reason


def test_flashinfer_reads_base_2() -> None:
    """The comparison sees a base mix-up in the library's own kernel: natural-log LSEs handed to
    merge_state unconverted fail the float64 merge; converted they pass."""
    trace = make_trace("merge-state", "lse_base=e")
    backend = registry.create("flashinfer")
    ref = reference.merge(trace.merge)
    right = merge(backend, given_states(trace.merge, LseBase.TWO), what="base-2 states")
    wrong = merge(backend, given_states(trace.merge, LseBase.E), what="natural-log states as base 2")
    assert (right.output.double() - ref.output).abs().max() < 2e-2
    assert (wrong.output.double() - ref.output).abs().max() > 5e-2


def test_empty_states_weigh_nothing(record_property) -> None:
    """An empty state (LSE -inf) beside a real one: the row is the real state. Its output as
    FlashAttention writes it (0) for both libraries; holding NaN (an empty chunk's scratch), our
    Triton merge must skip it, and FlashInfer's behaviour there is recorded, not judged (it weighs
    the state by 2**-inf = 0 and may still read 0 x NaN)."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(64, 8, 2, 128, generator=g).to(torch.bfloat16)
    s = torch.randn(64, 8, 2, generator=g) * 3.0
    s[:, :, 1] = float("-inf")
    v[:, :, 1] = 0
    garbage = v.clone()
    garbage[:, :, 1] = float("nan")
    for name, values in (("flashinfer", v), ("triton", v), ("triton", garbage)):
        merged = merge(registry.create(name), PartialStates(values, s), what=f"{name}: an empty state beside a real one")
        assert bool(torch.isfinite(merged.output).all()), name
        assert (merged.output.float() - v[:, :, 0].float()).abs().max() < 1e-2, name
        assert torch.allclose(merged.lse.float(), s[:, :, 0], atol=1e-3), name
    merged = merge(registry.create("flashinfer"), PartialStates(garbage, s), what="flashinfer: an empty state holding NaN")
    record_property("flashinfer_nan_rows_from_an_empty_state", int((~torch.isfinite(merged.output)).any(-1).sum()))


def test_commands_exit_0_and_check_names_the_mistake(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    assert invoke("synth", "merge-chunks", "-o", str(good)).exit_code == 0
    assert invoke("synth", "merge-state", "-o", str(bad), "--inject", "split-merge:merge-step-lse-base").exit_code == 0
    result = invoke("replay", str(good), "--backend", "reference,triton,flashinfer")
    assert result.exit_code == 0, result.output
    result = invoke("check", str(good))
    assert result.exit_code == 0 and "no findings" in result.output, result.output
    result = invoke("check", str(bad))
    assert result.exit_code == 1 and "merge-step-lse-base" in result.output, result.output
    assert io.load(bad).merge.lse is None
