"""attndbg minimize: injected mistakes of each class shrink to one or two requests with the same
finding; a failure that changes kind on a smaller step is not "the same failure"; a recorded
plan's mistake goes along with the batch. Triton interpreted on the CPU; each candidate is a
fresh worker process (about 1.5 s each here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attndbg.checks.step import check_one
from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors import registry
from attndbg.minimize import shrink
from attndbg.minimize.search import MinimizeOptions, NothingToKeep, minimize
from attndbg.minimize.target import Failure, FailureKind, parse_wanted, reproduces
from attndbg.trace import io
from tests.factories import make_trace

DECODE = ("decode-mha", "heads=4:2", "head_dim=16", "kv_lens=5,20,33,9")
VERIFY = ("verify", "heads=4:2", "head_dim=16", "prefix_lens=5,12,7", "mask_layout=qlen_only_bitpacked")
EXTEND = ("extend-prefix", "heads=4:2", "head_dim=16", "prefix_lens=0,9,13", "extend_lens=5,3,4")
TRITON = CheckOptions(backends=("triton",))


def _injected(tmp_path: Path, spec: tuple[str, ...], mistake: str) -> Path:
    return io.save(registry.inject(make_trace(*spec, plan=True), mistake), tmp_path / "bad.pt")


def _findings(path: Path, cls: str) -> set[tuple[str, str]]:
    report = check_one(path, [FindingClass(cls)], TRITON).report
    return {(f.kind.value, f.check) for f in report.findings}


# One mistake of each detector class (fill-value's on a graph step: its padded rows go too).
CASES = [
    (DECODE, "invariants:wrong-req-row", "invariants/kv-index"),
    ((*DECODE, "capture_bs=6"), "fill-value:decreasing-padded-indptr", "fill-value/padded-indptr-decreases"),
    (VERIFY, "tree-mask:bit-order", "tree-mask/mask-bit-order"),
    (EXTEND, "split-merge:cascade-lse-base-2", "split-merge/merge-lse-base-confusion"),
]


@pytest.mark.parametrize(("spec", "mistake", "expected"), CASES, ids=[c[1] for c in CASES])
def test_injected_mistake_shrinks_to_at_most_two_requests(tmp_path: Path, spec: tuple[str, ...], mistake: str, expected: str) -> None:
    bad = _injected(tmp_path, spec, mistake)
    cls = expected.split("/")[0]
    outcome = minimize(str(bad), MinimizeOptions("triton", parse_wanted(cls), TRITON))
    assert f"{outcome.target.finding_class}/{outcome.target.check}" == expected
    assert outcome.trace.batch.batch_size <= 2 < outcome.original.batch.batch_size
    assert outcome.trace.model.num_qo_heads < outcome.original.model.num_qo_heads
    small = io.save(outcome.trace, tmp_path / "small.pt")  # valid, and checked again here, in this process
    assert tuple(expected.split("/")) in _findings(small, cls)


# One step per shrink dimension beyond requests and heads, already at one KV head: page size (a
# Triton plan lists slots, so its mistake goes along), the draft tree (the sibling bit stays where
# its row and column stay), extend lengths (the base-2 prefix LSE merge stays wrong on fewer tokens).
DIMENSIONS = [
    (("decode-mha", "heads=1:1", "head_dim=16", "kv_lens=17,20", "page_size=16"), "invariants:wrong-req-row", "invariants/kv-index", lambda t: t.model.page_size == 1),
    (("verify", "heads=1:1", "head_dim=16", "prefix_lens=2", "topk=3", "steps=2", "draft_tokens=5"), "tree-mask:sibling-visible", "tree-mask/mask-mismatch", lambda t: t.spec.draft_token_num < 5),
    (("extend-prefix", "heads=1:1", "head_dim=16", "prefix_lens=2", "extend_lens=5"), "split-merge:cascade-lse-base-2", "split-merge/merge-lse-base-confusion", lambda t: int(t.batch.extend_lens.max()) == 1),
]


@pytest.mark.parametrize(("spec", "mistake", "expected", "shrunk"), DIMENSIONS, ids=["page-size", "draft-tree", "extend-lengths"])
def test_each_dimension_shrinks_with_the_same_finding(tmp_path: Path, spec: tuple[str, ...], mistake: str, expected: str, shrunk) -> None:
    bad = _injected(tmp_path, spec, mistake)
    outcome = minimize(str(bad), MinimizeOptions("triton", parse_wanted(expected), TRITON))
    assert shrunk(outcome.trace), outcome.removed
    small = io.save(outcome.trace, tmp_path / "small.pt")
    assert tuple(expected.split("/")) in _findings(small, expected.split("/")[0])


def test_draft_tree_cut_keeps_a_prefix_closed_tree(tmp_path: Path) -> None:
    """Kept tokens keep their ancestors; a correct recorded mask stays the tree's mask; the smaller step loads."""
    from attndbg.minimize import tokens
    from attndbg.trace import tree

    trace = make_trace(*VERIFY, plan=True)
    for count, topk in [(3, None), (8, 2), (8, 1)]:
        small = tokens.fewer_drafts(trace, count, topk).trace
        parents = small.spec.parents
        assert all(int(p) < i for row in parents for i, p in enumerate(row.tolist()) if i)
        assert topk != 1 or tree.is_chain(parents)
        expected = tree.build_mask(small.spec.mask_layout, parents, small.batch.prefix_lens)
        assert torch.equal(small.spec.custom_mask, expected.to(small.spec.custom_mask.dtype))
        assert io.load(io.save(small, tmp_path / "small.pt")).spec.draft_token_num == small.spec.draft_token_num


def test_a_failure_that_becomes_a_crash_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kind-test finds something with 3+ requests and crashes (an illegal memory access in a
    Triton launch) with fewer: the smaller steps crash, which is another failure, so the finding
    is kept at 3 requests; asked to keep the crash, it shrinks a crashing step to 1 request."""
    monkeypatch.setenv("ATTNDBG_DETECTORS", "kind-test=tests.minimize.kind_detector:DETECTOR")
    four = io.save(make_trace(*DECODE), tmp_path / "four.pt")
    outcome = minimize(str(four), MinimizeOptions("triton", parse_wanted("kind-test/seen"), TRITON))
    assert outcome.target.kind is FailureKind.FINDING
    assert outcome.trace.batch.batch_size == 3

    two = io.save(shrink.keep_requests(make_trace(*DECODE), [0, 1]).trace, tmp_path / "two.pt")
    crash = minimize(str(two), MinimizeOptions("triton", parse_wanted("backend-crash"), TRITON, only=("kind-test",)))
    assert crash.target.kind is FailureKind.CRASH and "illegal memory access" in crash.target.detail
    assert crash.trace.batch.batch_size == 1


def test_failure_kinds() -> None:
    finding = Failure(FailureKind.FINDING, "tree-mask", "mask-mismatch")
    crash = Failure(FailureKind.CRASH, "backend-crash", "backend-crashed", "triton: CUDA error: an illegal memory access was encountered")
    other_crash = Failure(FailureKind.CRASH, "backend-crash", "backend-crashed", "triton: killed by SIGSEGV")
    assert reproduces(finding, [finding], [finding])
    assert not reproduces(finding, [finding, crash], [finding])  # it crashed where the step did not
    assert reproduces(finding, [finding, crash], [finding, crash])
    assert reproduces(crash, [crash], [crash]) and not reproduces(crash, [other_crash, finding], [crash])


def test_requests_dropped_from_the_recorded_plan_keep_its_mistake() -> None:
    trace = registry.inject(make_trace(*DECODE, plan=True), "invariants:decreasing-indptr")
    indptr = trace.plan.tensors["kv_indptr"].tolist()
    request = next(b for b in range(1, len(indptr) - 1) if indptr[b + 1] < indptr[b])
    alone = shrink.keep_requests(trace, [request]).trace
    assert alone.plan.tensors["kv_indptr"].tolist() == [0, indptr[request + 1] - indptr[request]]  # still decreasing
    # A clean request's pieces are derived again for the smaller batch: the plan a correct engine builds.
    clean = shrink.keep_requests(trace, [0]).trace
    from attndbg.backends.triton import TritonBackend

    derived = TritonBackend().derive_plan(clean)
    for name, tensor in derived.tensors.items():
        assert clean.plan.tensors[name].tolist() == tensor.tolist(), name


def test_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner

    bad = _injected(tmp_path, DECODE, "invariants:index-outside-cache")
    small = tmp_path / "small.pt"
    result = CliRunner().invoke(main, ["minimize", str(bad), "--backend", "triton", "--finding", "invariants", "-o", str(small)])
    assert result.exit_code == 0, result.output
    assert "kept:    invariants/index-outside-cache (finding)" in result.output
    assert "after:   DECODE bs=1" in result.output and small.exists()

    for args, words in [
        (["--finding", "inveriants"], "did you mean 'invariants'"),
        (["--finding", "tree-mask"], "shows no tree-mask"),
        (["--backend", "triton,reference"], "name one"),
    ]:
        result = CliRunner().invoke(main, ["minimize", str(bad), "-o", str(small), *args])
        assert result.exit_code == 2 and words in result.output, result.output


def test_a_two_call_verify_plan_is_cut_by_draft_token_rows() -> None:
    """FA3's two-call verify declares its expand_ tables with one row per draft token: dropping
    requests keeps n rows each, a clean request's rows derived again, a wrong one's as recorded."""
    from dataclasses import replace

    from attndbg.backends.fa3 import FA3Backend, FA3Options

    fa3 = FA3Backend(FA3Options(verify_path="two-call"))
    trace = make_trace(*VERIFY)
    plan = fa3.derive_plan(trace)
    n = trace.spec.draft_token_num
    assert plan.tensors["expand_page_table"].shape[0] == 3 * n
    table = plan.tensors["expand_page_table"].clone()
    table[n : 2 * n] = table[n : 2 * n].flip(0)  # request 1's draft rows in reverse: a wrong expand table
    wrong = replace(trace, plan=replace(plan, tensors={**plan.tensors, "expand_page_table": table}))
    kept = shrink.keep_requests(wrong, [0, 2]).trace
    derived = fa3.derive_plan(kept)
    assert kept.plan.tensors.keys() == derived.tensors.keys()
    for name, tensor in derived.tensors.items():
        assert kept.plan.tensors[name].tolist() == tensor.tolist(), name
    alone = shrink.keep_requests(wrong, [1]).trace
    assert alone.plan.tensors["expand_page_table"].shape[0] == n
    assert alone.plan.tensors["expand_page_table"].tolist() == table[n : 2 * n].tolist()  # the mistake, as recorded
    assert alone.plan.tensors["expand_cu_seqlens_q"].tolist() == fa3.derive_plan(alone).tensors["expand_cu_seqlens_q"].tolist()
