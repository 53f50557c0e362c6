"""The plan reading (attndbg/plans): facts of a recorded plan, read once per step.

Clean plans (each adapter's own, on small and server-shaped steps) read with no problem and every
request covered; a planted break is a problem naming its element, as data; each scalar says where
its value comes from; pieces come from the backend's declaration; and one check of a step reads
the plan once (one adapter, one verify visibility) however many detectors ask.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attndbg.backends import registry
from attndbg.backends.fa3 import FA3Backend, FA3Options
from attndbg.checks.selection import parse_only
from attndbg.checks.step import check_one
from attndbg.detector_api.context import CheckOptions
from attndbg.plans import reading as reading_module
from attndbg.plans.pieces import Cut, Piece
from attndbg.plans.problems import ProblemKind
from attndbg.plans.reading import read
from attndbg.plans.scalars import ScalarSource
from attndbg.trace import io
from attndbg.trace.schema import Trace
from tests.factories import make_trace

SMALL = ("heads=4:2", "head_dim=32")
# Server shapes: 64 decode requests with long, uneven rows; a verify batch of 16 with long prefixes.
SERVER_DECODE = ("decode-mha", *SMALL, "kv_lens=" + ",".join(str(1 + (b * 997) % 3000) for b in range(64)))
SERVER_VERIFY = ("verify", *SMALL, "prefix_lens=" + ",".join(str(100 + (b * 389) % 2500) for b in range(16)))
STEPS = {
    "decode": ("decode-mha", *SMALL),
    "paged-decode": ("decode-paged", *SMALL),
    "extend": ("extend-prefix", *SMALL),
    "verify": ("verify", *SMALL),
    "window": ("window", *SMALL),
    "server-decode": SERVER_DECODE,
    "server-verify": SERVER_VERIFY,
}
ADAPTERS = ("triton", "flashinfer", "fa3")


def _with_plan(trace: Trace, backend: str, **options) -> Trace:
    adapter = registry.create(backend) if not options else FA3Backend(FA3Options(**options))
    return replace(trace, plan=adapter.derive_plan(trace))


@pytest.mark.parametrize("backend", ADAPTERS)
@pytest.mark.parametrize("step", STEPS)
def test_an_adapters_own_plan_reads_clean(step: str, backend: str) -> None:
    trace = _with_plan(make_trace(*STEPS[step]), backend)
    reading = read(trace)
    assert reading.unread is None and reading.problems == () and reading.refusal is None
    assert reading.coverage is not None and None not in reading.coverage
    if trace.is_tree_verify:
        view = reading.visibility
        assert view is not None and sorted(view.blocks) == list(range(trace.batch.batch_size))
    else:
        assert reading.visibility is None


def test_a_planted_decrease_is_a_problem_at_its_first_bad_element() -> None:
    trace = _with_plan(make_trace(*STEPS["decode"]), "triton")
    indptr = trace.plan.tensors["kv_indptr"].clone()
    indptr[2] = indptr[1] - 1
    broken = read(replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "kv_indptr": indptr})))
    [problem] = broken.offsets_problems
    assert (problem.kind, problem.field, problem.index, problem.request) == (ProblemKind.OFFSETS_DECREASE, "kv_indptr", 2, 1)
    assert (problem.found, problem.expected) == (int(indptr[2]), int(indptr[1]))
    assert "kv_indptr" not in broken.well_formed_offsets and broken.kv is None


def test_a_last_page_length_outside_the_page_stops_the_kv_reading() -> None:
    trace = _with_plan(make_trace(*STEPS["paged-decode"]), "flashinfer")
    last = trace.plan.tensors["kv_last_page_len"].clone()
    last[1] = 0
    broken = read(replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "kv_last_page_len": last})))
    [problem] = broken.kv_problems
    assert (problem.kind, problem.request, problem.found, problem.detail["page_size"]) == (ProblemKind.LAST_PAGE_LEN, 1, 0, 16)
    assert broken.kv is None and broken.coverage is None


def test_a_short_mask_is_a_problem_and_stops_the_visibility() -> None:
    trace = _with_plan(make_trace(*STEPS["verify"]), "triton")
    mask = trace.plan.tensors["custom_mask"]
    short = read(replace(trace, plan=replace(trace.plan, tensors={**trace.plan.tensors, "custom_mask": mask[:-3]})))
    [problem] = short.mask_problems
    assert (problem.kind, problem.found, problem.expected) == (ProblemKind.MASK_LENGTH, mask.numel() - 3, mask.numel())
    assert short.visibility is None


def test_each_scalar_says_where_it_comes_from() -> None:
    triton = _with_plan(make_trace(*STEPS["window"]), "triton")
    scalars = read(triton).scalars
    assert scalars["window"].source is ScalarSource.RECORDED and scalars["window"].name == "sliding_window"
    assert (scalars["page_size"].value, scalars["page_size"].source) == (1, ScalarSource.LIBRARY_DEFAULT)  # slot ids
    assert scalars["skip_prefix"].source is ScalarSource.RECORDED
    bare = replace(triton.plan, scalars={k: v for k, v in triton.plan.scalars.items() if k not in ("sliding_window", "skip_prefix_custom_mask")})
    scalars = read(replace(triton, plan=bare)).scalars
    assert (scalars["window"].value, scalars["window"].source) == (triton.model.sliding_window, ScalarSource.DERIVED)
    assert (scalars["skip_prefix"].value, scalars["skip_prefix"].source) == (1, ScalarSource.LIBRARY_DEFAULT)
    flashinfer = _with_plan(make_trace(*STEPS["paged-decode"]), "flashinfer")
    assert read(flashinfer).scalars["page_size"].source is ScalarSource.RECORDED
    no_size = replace(flashinfer.plan, scalars={k: v for k, v in flashinfer.plan.scalars.items() if k != "page_size"})
    derived = read(replace(flashinfer, plan=no_size)).scalars["page_size"]
    assert (derived.value, derived.source) == (flashinfer.model.page_size, ScalarSource.DERIVED)


def test_pieces_come_from_the_backends_declaration() -> None:
    decode = read(_with_plan(make_trace(*STEPS["decode"]), "triton")).pieces
    assert decode["kv_indptr"] == Piece(Cut.OFFSETS) and decode["kv_indices"] == Piece(Cut.SEGMENTS, 1, "kv_indptr")
    assert decode["num_kv_splits"] == Piece(Cut.ROWS)
    verify = make_trace(*STEPS["verify"])
    two_call = read(_with_plan(verify, "fa3", verify_path="two-call")).pieces
    n = verify.spec.draft_token_num
    assert two_call["expand_page_table"] == Piece(Cut.ROWS, n) and two_call["page_table"] == Piece(Cut.ROWS)
    assert two_call["expand_cu_seqlens_q"] == Piece(Cut.OFFSETS, n)
    # A plan no adapter reads: its engine's declared metadata (vLLM's), or nothing.
    trace = make_trace(*STEPS["decode"])
    plan = replace(trace.plan or registry.create("triton").derive_plan(trace), backend="FLASH_ATTN")
    vllm = read(replace(trace, plan=plan, source=replace(trace.source, engine="vllm"))).pieces
    assert vllm["common.query_start_loc"] == Piece(Cut.OFFSETS) and vllm["common.block_table_tensor"] == Piece(Cut.ROWS)
    assert read(replace(trace, plan=plan)).pieces == {}


def test_one_check_of_a_step_reads_its_plan_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = _with_plan(make_trace(*STEPS["verify"]), "triton")
    path = io.save(trace, tmp_path / "step.pt")
    adapters, visibilities = [], []
    adapter_of, read_visibility = registry.adapter_of, reading_module.read_visibility
    monkeypatch.setattr(registry, "adapter_of", lambda plan: adapters.append(plan.backend) or adapter_of(plan))
    monkeypatch.setattr(reading_module, "read_visibility", lambda *a: visibilities.append(1) or read_visibility(*a))
    # No kernel backend: the plan detectors and fill-value judge the recorded plan alone.
    result = check_one(path, parse_only("invariants,tree-mask,fill-value"), CheckOptions(backends=("reference",)))
    assert result.report.checked and result.report.findings == []
    assert adapters == ["triton"] and visibilities == [1]
    assert torch.equal(read(trace).tensors["kv_indptr"], trace.plan.tensors["kv_indptr"].to(torch.int64))
