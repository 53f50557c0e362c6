"""An incomplete plan is not an unsafe plan.

A recorded plan missing a scalar or tensor its backend's layout declares (SGLang's FlashInfer decode
plan as the recorder writes it has no window_left; FA3's has no verify_path) cannot be read. It is
named on the verdict line and in the JSON ("recorded plan not read ... (flashinfer: plan has no
scalar window_left)"), never launched, and never an invariants finding: nothing says a kernel
given it would read out of bounds. A plan that violates a bound is still plan-unsafe
(tests/checks/test_plan_unsafe.py).

Per backend and plan form, every scalar the plan view declares is found by removing each scalar of
the clean plan in turn (the list is also pinned, so a view that stops declaring one is noticed).
FlashInfer, FA3 and FlashMLA kernels do not run on this CPU machine: their replays run with the
backend made available and `run` replaced by a spy, which proves the recorded plan is not
launched while the clean plan of the same step is.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends.base import Backend, KernelError
from attndbg.backends.fa3 import FA3Backend, FA3Options
from attndbg.backends.flashinfer import FlashInferBackend, FlashInferOptions
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.options import BackendOptions
from attndbg.backends.plan_view import PlanUnreadable
from attndbg.backends.triton import TritonBackend
from attndbg.cli import main
from attndbg.detector_api.context import CheckContext
from attndbg.detectors.invariants import detect as invariants
from attndbg.plans.reading import read
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.trace import io
from attndbg.trace.schema import Plan, Trace
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")
FA3_SMALL = ("heads=2:1", "head_dim=64")

# (id, backend, trace spec, the scalars its plan view declares, a tensor it declares)
FORMS = [
    ("triton-decode", TritonBackend(), ("decode-mha", "kv_lens=3,20", *SMALL), {"max_kv_splits"}, "kv_indices"),
    ("triton-extend", TritonBackend(), ("extend-prefix", *SMALL), {"is_causal", "max_extend_len", "skip_prefix_custom_mask", "sliding_window"}, "qo_indptr"),
    ("triton-verify", TritonBackend(), ("verify", "prefix_lens=4,7", *SMALL), {"is_causal", "max_extend_len", "skip_prefix_custom_mask", "sliding_window"}, "mask_indptr"),
    ("flashinfer-decode", FlashInferBackend(), ("decode-paged", *SMALL), {"path", "page_size", "window_left", "logits_soft_cap", "use_tensor_cores"}, "kv_last_page_len"),
    ("flashinfer-paged", FlashInferBackend(FlashInferOptions(extend_path="paged")), ("extend-prefix", *SMALL), {"path", "page_size", "window_left", "logits_soft_cap", "causal"}, "qo_indptr"),
    ("flashinfer-ragged", FlashInferBackend(FlashInferOptions(extend_path="ragged")), ("extend-noprefix", *SMALL), {"path", "window_left", "logits_soft_cap"}, "qo_indptr"),
    ("flashinfer-verify", FlashInferBackend(), ("verify", "prefix_lens=4,7", *SMALL), {"path", "page_size", "window_left", "logits_soft_cap", "causal"}, "kv_indices"),
    ("fa3-decode", FA3Backend(), ("decode-paged", *FA3_SMALL), {"window_left", "verify_path", "max_seqlen_q", "max_seqlen_k", "causal", "page_size"}, "page_table"),
    (
        "fa3-two-call-verify",
        FA3Backend(FA3Options(verify_path="two-call")),
        ("verify", "prefix_lens=4,7", *FA3_SMALL),
        {"window_left", "verify_path", "max_seqlen_q", "max_seqlen_k", "causal", "page_size", "expand_max_seqlen_q", "expand_max_seqlen_k", "expand_causal", "expand_page_size"},
        "expand_page_table",
    ),
    ("mla-triton", MLABackend(MLAOptions(impl="triton")), ("mla-decode", "heads=2", "kv_lens=3,9"), {"impl", "max_kv_splits"}, "kv_indices"),
    ("mla-flashinfer", MLABackend(MLAOptions(impl="flashinfer")), ("mla-decode", "heads=2", "kv_lens=3,40", "page_size=16"), {"impl", "page_size", "causal"}, "kv_len_arr"),
    ("mla-flashmla", MLABackend(MLAOptions(impl="flashmla")), ("mla-decode", "heads=2", "kv_lens=3,70", "page_size=64"), {"impl", "page_size", "causal", "q_len"}, "block_table"),
]
IDS = [form[0] for form in FORMS]


def _step(backend: Backend, spec: tuple[str, ...]) -> Trace:
    trace = make_trace(*spec)
    plan = backend.derive_plan(trace)
    return replace(trace, plan=plan, source=replace(trace.source, backend=backend.name))


def _without(plan: Plan, *, scalar: str | None = None, tensor: str | None = None) -> Plan:
    return replace(plan, scalars={k: v for k, v in plan.scalars.items() if k != scalar}, tensors={k: v for k, v in plan.tensors.items() if k != tensor})


def _declared(backend: Backend, trace: Trace) -> set[str]:
    declared = set()
    for name in trace.plan.scalars:
        try:
            backend.plan_view(trace, _without(trace.plan, scalar=name))
        except PlanUnreadable:
            declared.add(name)
    return declared


def _incomplete(backend: Backend, trace: Trace) -> list[tuple[str, Trace]]:
    """(what is missing, the step with that plan) for each declared scalar."""
    return [(f"scalar {name}", replace(trace, plan=_without(trace.plan, scalar=name))) for name in sorted(_declared(backend, trace))]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Plan]:
    """Every plan a backend's `run` is handed. Backends that need a GPU are made available on the
    CPU (their kernels are never reached: the spy records the plan and raises)."""
    seen: list[Plan] = []
    for cls in (FlashInferBackend, FA3Backend, MLABackend):
        monkeypatch.setattr(cls, "unavailable_reason", lambda self: None)
        monkeypatch.setattr(cls, "unsupported_reason", lambda self, trace: None)
        monkeypatch.setattr(cls, "device", lambda self: "cpu")
        monkeypatch.setattr(cls, "describe", lambda self: f"{self.name} (its library is not installed here: run is a spy)")
        monkeypatch.setattr(cls, "first_use_note", lambda self: None)

        def spy(self, trace, inputs, plan):
            seen.append(plan)
            raise KernelError("spy: the kernel is not run here")

        monkeypatch.setattr(cls, "run", spy)
    real = TritonBackend.run

    def counting(self, trace, inputs, plan):
        seen.append(plan)
        return real(self, trace, inputs, plan)

    monkeypatch.setattr(TritonBackend, "run", counting)
    return seen


@pytest.mark.parametrize("form,backend,spec,scalars,tensor", FORMS, ids=IDS)
def test_a_plan_missing_a_declared_field_is_not_read_not_launched_and_no_finding(
    launches: list[Plan], form: str, backend: Backend, spec: tuple[str, ...], scalars: set[str], tensor: str
) -> None:
    trace = _step(backend, spec)
    assert _declared(backend, trace) == scalars
    assert invariants.detect(CheckContext(trace=trace, path="t.pt")) == []
    assert read(trace).unread is None
    options = ReplayOptions(plan=PlanSource.RECORDED, backend_options=_options(backend))
    # The clean plan is launched (once, as recorded): the spy sees it.
    [clean] = replay(trace, "t", [backend.name], options).runs
    assert clean.refused is None and len(launches) == 1, (clean.status, clean.reason)
    launches.clear()
    cases = _incomplete(backend, trace) + [(tensor, replace(trace, plan=_without(trace.plan, tensor=tensor)))]
    for missing, step in cases:
        why = read(step).unread
        assert why is not None and missing.split()[-1] in why, (missing, why)
        assert invariants.detect(CheckContext(trace=step, path="t.pt")) == [], missing
        [run] = replay(step, "t", [backend.name], options).runs
        assert run.status is RunStatus.UNSUPPORTED and run.refused is not None and run.refused.unread, (missing, run.status, run.reason)
        assert run.reason == f"recorded plan not read: {why} (not launched)" and run.result is None
        assert launches == [], f"{form}: the plan without {missing} was launched"


def _options(backend: Backend) -> BackendOptions:
    return BackendOptions(((backend.name, backend.options),))


@pytest.mark.parametrize(
    "backend,spec,scalar",
    [
        (TritonBackend(), ("decode-mha", "kv_lens=3,20", *SMALL), "max_kv_splits"),
        (FlashInferBackend(), ("decode-paged", *SMALL), "window_left"),
        (FA3Backend(), ("decode-paged", *FA3_SMALL), "verify_path"),
        (MLABackend(MLAOptions(impl="flashinfer")), ("mla-decode", "heads=2", "kv_lens=3,40", "page_size=16"), "causal"),
    ],
    ids=["triton", "flashinfer", "fa3", "mla"],
)
def test_check_names_the_unread_plan_on_the_verdict_line_and_in_json(tmp_path: Path, backend: Backend, spec: tuple[str, ...], scalar: str) -> None:
    trace = _step(backend, spec)
    path = io.save(replace(trace, plan=_without(trace.plan, scalar=scalar)), tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--json", str(report)])
    assert result.exit_code == 0, result.output
    why = f"{backend.name}: plan has no scalar {scalar}"
    line = " ".join(result.output.split())
    assert f"recorded plan not read by the plan detectors on 1 step ({why})" in line and "0 findings" in line
    assert "plan-unsafe" not in result.output
    data = json.loads(report.read_text())
    assert data["verdict"]["plans_unread"] == {why: 1} and data["total_findings"] == 0


def test_a_verify_step_whose_triton_plan_is_incomplete_checks_clean_and_is_not_launched(tmp_path: Path, launches: list[Plan]) -> None:
    """tree-mask replays the recorded plan of a verify step: an incomplete one is not launched (the
    derived plans still are), and neither tree-mask nor invariants reports it."""
    trace = _step(TritonBackend(), ("verify", "prefix_lens=4,7", *SMALL))
    path = io.save(replace(trace, plan=_without(trace.plan, scalar="skip_prefix_custom_mask")), tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants,tree-mask", "--backend", "triton", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert launches and all("skip_prefix_custom_mask" in plan.scalars for plan in launches)  # derived plans only
    data = json.loads(report.read_text())
    assert data["total_findings"] == 0
    assert data["verdict"]["plans_unread"] == {"triton: plan has no scalar skip_prefix_custom_mask": 1}


@pytest.mark.parametrize("backend", [TritonBackend(), FlashInferBackend(), FA3Backend()], ids=lambda b: b.name)
@pytest.mark.parametrize("preset", ["window", "window-decode"])
def test_a_windowed_plan_without_its_window_scalar_is_not_guessed_at(backend: Backend, preset: str) -> None:
    """A sliding-window step's plan missing a declared scalar (its window among them) gives no
    invariants finding: the detectors do not read the plan as if the window were off."""
    trace = _step(backend, (preset, *FA3_SMALL))
    assert invariants.detect(CheckContext(trace=trace, path="t.pt")) == []
    declared = _declared(backend, trace)
    # Triton's decode plan carries no window scalar (its kernels read SGLang's window list).
    assert declared & {"sliding_window", "window_left"} or (backend.name == "triton" and preset == "window-decode")
    for missing, step in _incomplete(backend, trace):
        why = read(step).unread
        assert why is not None and missing.split()[-1] in why, (missing, why)
        assert invariants.detect(CheckContext(trace=step, path="t.pt")) == [], missing


def test_replay_of_an_incomplete_recorded_plan_says_not_read_and_runs_nothing(tmp_path: Path, launches: list[Plan]) -> None:
    """`replay --plan recorded`: nothing failed (not exit 1), nothing asked for ran (exit 3)."""
    trace = _step(TritonBackend(), ("decode-mha", "kv_lens=3,20", *SMALL))
    path = io.save(replace(trace, plan=_without(trace.plan, scalar="max_kv_splits")), tmp_path / "t.pt")
    result = CliRunner().invoke(main, ["replay", str(path), "--backend", "triton", "--plan", "recorded"])
    assert result.exit_code == 3, result.output
    assert "recorded plan not read: plan has no scalar max_kv_splits (not launched)" in " ".join(result.output.split())
    assert launches == [] and "Traceback" not in result.output
