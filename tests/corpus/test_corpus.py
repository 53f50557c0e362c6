"""The real-bug corpus: every bug's recording loads and validates (a wrong plan is evidence, never
refused), every correct twin checks clean, the bugs today's metadata detectors catch stay caught,
and diagnosis names each output-level bug (recorded with its layer) and nothing on its twin.

The checks here run the detectors on metadata and recorded tensors only (no kernel backend: the
float64 reference is not a kernel under test), so the module stays cheap on the CPU;
bench/real_bugs.py runs the kernels too and prints the whole table (docs/real-bugs.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io
from tests.corpus import catalog
from tests.corpus.bug import RealBug

NO_KERNELS = CheckOptions(backends=("reference",))
TRACKERS = ("https://github.com/sgl-project/sglang/", "https://github.com/vllm-project/vllm/", "https://github.com/flashinfer-ai/flashinfer/", "https://github.com/NVIDIA/TensorRT-LLM/")

# Twins that get a finding today, and why (each must be worked off, never widened):
# - a hazard by an engine's own convention (the twin is right; the hazard states its condition);
# - a false alarm of ours, known and reported: xfail (strict) until the check is fixed.
TWIN_HAZARDS = {
    # vLLM pads FlashInfer FULL-graph decodes with seq_len 0 by its own convention; the hazard says
    # NaN padded rows hurt only where a later op mixes rows (vLLM #38436, FlashInfer #3057).
    "vllm-28739": {"fill-value/padded-seq-len-unsupported"},
}
TWIN_FALSE_ALARMS: dict[str, str] = {}
# What today's metadata detectors name on each bug's recording (class/check): kept caught.
CAUGHT = {
    "sglang-1782": "invariants/index-outside-cache",
    "sglang-1789": "fill-value/seq-lens-sum-ignores-padding",
    "sglang-24361": "fill-value/stale-padded-positions",
    "sglang-32087": "invariants/window-kv",
    "sglang-35985": "invariants/kv-length",
    "sglang-27545": "invariants/qo-lens",
    "sglang-21987": "invariants/qo-lens",
    "sglang-22958": "fill-value/padded-kv-write",
    "sglang-26513": "invariants/kv-index",
    "sglang-39287": "invariants/kv-index",
    "sglang-9279": "tree-mask/window-offset",
    "sglang-9658": "tree-mask/window-cascade",
    "sglang-31501": "invariants/window-off",
    "sglang-27738": "invariants/kv-length",
    "sglang-26628": "invariants/kv-length",
    "sglang-25015": "invariants/positions",
    "sglang-26880": "fill-value/seq-lens-sum-ignores-padding",
    "sglang-27338": "invariants/capture-kv-indices",
    "sglang-40903": "split-merge/merge-lse-base-confusion",
    "vllm-28739": "invariants/plan-pointer-moved",
    "flashinfer-1028": "split-merge/recorded-output-mismatch",
    "flashinfer-4002": "invariants/plan-info-request-index",
    "flashinfer-4051": "split-merge/merge-step-nonfinite",
    "flashinfer-3176": "tree-mask/mask-length",
    "vllm-35969": "fill-value/padded-seq-len-unsupported",
    "vllm-35175": "invariants/plan-pointer-moved",
    "vllm-31282": "invariants/kv-last-page-len",
    "vllm-27753": "invariants/slot-mapping",
    "vllm-20301": "invariants/split-bound",
    "vllm-19321": "invariants/indptr-decreases",
    "vllm-43991": "invariants/host-hint",
    "vllm-40654": "invariants/host-hint",
    "vllm-39773": "invariants/builder-rows",
    "vllm-56181": "invariants/unowned-tokens",
}


def findings(path: Path) -> list:
    reports = list(check_steps(str(path), parse_only(None), NO_KERNELS))
    assert all(r.checked for r in reports), [r.error for r in reports]
    return [f for r in reports for f in r.findings]


def labels(found: list) -> set[str]:
    return {f"{f.kind.value}/{f.check}" for f in found}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every encoded bug and twin, recorded once for the module."""
    root = tmp_path_factory.mktemp("corpus")
    for bug in catalog.ENCODED:
        bug.write(root / bug.id / "bug", root / bug.id / "twin")
    return {bug.id: root / bug.id for bug in catalog.ENCODED}


def test_the_corpus_is_real_bugs_from_the_four_trackers() -> None:
    assert len(catalog.BUGS) >= 25
    for bug in catalog.BUGS:
        assert bug.links and all(link.startswith(TRACKERS) for link in bug.links[:1]), bug.id
        assert re.fullmatch(r"202[4-6]-\d\d", bug.date), (bug.id, bug.date)
        assert bug.mechanism and bug.capabilities, bug.id
        if bug.write is not None:
            assert bug.expected and bug.keywords, bug.id
    trackers = {bug.links[0].split("/")[3] for bug in catalog.BUGS}
    assert trackers == {"sgl-project", "vllm-project", "flashinfer-ai", "NVIDIA"}


@pytest.mark.parametrize("bug", catalog.ENCODED, ids=[b.id for b in catalog.ENCODED])
def test_every_step_loads_and_validates(written: dict[str, Path], bug: RealBug) -> None:
    for side in ("bug", "twin"):
        entries = io.read_manifest(written[bug.id] / side)
        assert entries, (bug.id, side)
        for entry in entries:
            trace = io.load(written[bug.id] / side / entry.file)  # validates; a wrong plan loads as evidence
            # A merge step is the library's merge call itself (no engine recorder writes one); a
            # user's FlashInfer dump comes through attndbg's importer.
            engines = ("sglang", "vllm", "flashinfer") if trace.merge is not None else ("sglang", "vllm", "flashinfer-dump")
            assert trace.source.engine in engines, trace.source.engine


def _twins() -> list:
    return [pytest.param(b, marks=pytest.mark.xfail(strict=True, reason=TWIN_FALSE_ALARMS[b.id])) if b.id in TWIN_FALSE_ALARMS else b for b in catalog.ENCODED]


@pytest.mark.parametrize("bug", _twins(), ids=[b.id for b in catalog.ENCODED])
def test_every_twin_checks_clean(written: dict[str, Path], bug: RealBug) -> None:
    found = findings(written[bug.id] / "twin")
    assert not [f for f in found if f.severity.value == "defect"], [(f.kind.value, f.check, f.evidence) for f in found]
    assert labels(found) <= TWIN_HAZARDS.get(bug.id, set()), [(f.kind.value, f.check, f.evidence) for f in found]


@pytest.mark.parametrize("bug_id", sorted(CAUGHT))
def test_the_bugs_caught_today_stay_caught(written: dict[str, Path], bug_id: str) -> None:
    found = findings(written[bug_id] / "bug")
    assert CAUGHT[bug_id] in labels(found), sorted(labels(found))
    assert any(f.severity.value == "defect" for f in found)



# Metadata-level bugs whose finding's cause names the mechanism (one of the bug's words, as
# bench/real_bugs.py's "named" column judges it): kept named.
NAMED_BY_CAUSE = ("flashinfer-3176", "flashinfer-4002", "sglang-22958", "sglang-26292", "sglang-27338", "sglang-27545", "sglang-35985", "sglang-9658", "vllm-56181")
# Bugs today's detectors flag only with a hazard (no defect, so not caught): the hazard's
# class/check, kept specific.
HAZARD_ONLY = {"sglang-26292": "fill-value/stale-padded-req-pool-index"}


@pytest.mark.parametrize("bug_id", NAMED_BY_CAUSE)
def test_a_finding_on_the_bug_names_its_mechanism(written: dict[str, Path], bug_id: str) -> None:
    causes = [f.cause.lower() for f in findings(written[bug_id] / "bug")]
    assert any(word.lower() in cause for word in catalog.by_id(bug_id).keywords for cause in causes), causes


@pytest.mark.parametrize("bug_id", sorted(HAZARD_ONLY))
def test_the_bugs_judged_a_hazard_stay_specific(written: dict[str, Path], bug_id: str) -> None:
    found = findings(written[bug_id] / "bug")
    assert HAZARD_ONLY[bug_id] in labels(found), sorted(labels(found))

OUTPUT_LEVEL = [b for b in catalog.ENCODED if b.id in ("sglang-40903", "sglang-39287", "sglang-27738", "flashinfer-1028")]


@pytest.mark.parametrize("bug", OUTPUT_LEVEL, ids=[b.id for b in OUTPUT_LEVEL])
def test_diagnosis_names_each_output_level_bug_and_nothing_on_its_twin(written: dict[str, Path], bug: RealBug) -> None:
    # The engine's output is in the step: diagnosis reproduces it by a mistake model whose words
    # name the bug's mechanism; on the twin's (right) output no model is attributed anything.
    assert catalog.holds_output(written[bug.id] / "bug") and catalog.holds_output(written[bug.id] / "twin")
    reproductions = [r for f in findings(written[bug.id] / "bug") for r in f.data.get("reproductions", [])]
    said = [f"{r['mechanism']}: {r['summary']}".lower() for r in reproductions]
    assert any(word.lower() in text for word in bug.keywords for text in said), said
    assert not [r for f in findings(written[bug.id] / "twin") for r in f.data.get("reproductions", [])]


def test_every_output_level_bug_is_judged_by_diagnosis(written: dict[str, Path]) -> None:
    assert sorted(b.id for b in catalog.ENCODED if catalog.holds_output(written[b.id] / "bug")) == sorted(b.id for b in OUTPUT_LEVEL)
