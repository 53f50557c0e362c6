"""split-merge detector: split counts, empty states, LSE bases, recorded merges.

Broken merges are test doubles of our stage 2 written in torch (each named after the real mistake
it imitates) patched in where the kernel wrapper calls it; the detector must find them from the
mechanism: which split configuration fails, which request has empty splits, what ratio the LSE
is off by. GPU-only parts (FlashInfer cascade and merge_state, graph capture) carry `gpu`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attndbg import machine, numerics
from attndbg.backends.base import AttentionResult
from attndbg.backends.triton_kernels import split_rule
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.split_merge import counts, gpu, recorded, stage2
from attndbg.detectors.split_merge import detect as split_merge
from attndbg.detectors.split_merge import injections as mutate
from attndbg.trace import synth
from attndbg.trace.schema import LseBase, to_dict
from attndbg.trace.validate import from_dict
from tests.checks.shapes import SMALL, SWEEP_SHAPES, kv_dtype_word
from tests.factories import make_trace

machine.select_triton_mode()
from attndbg.backends.triton_kernels import decode as decode_kernels  # noqa: E402  (after the Triton mode)

LN2 = math.log(2.0)
DECODES = {
    "gqa": ("decode-gqa", *SMALL, "kv_lens=5,70", "shared_prefix=0"),
    "mla": ("mla-decode", "heads=2", "kv_lora_rank=64", "rope_dim=32", "kv_lens=20,70"),
}


def sweep_trace(preset: str, dtype: str, *extra: str):
    shape = SMALL + SWEEP_SHAPES[preset] if preset in SWEEP_SHAPES else ()
    return make_trace(preset, *shape, f"dtype={dtype}", kv_dtype_word(preset, dtype), *extra, plan=True)


def detect(trace, **options):
    return split_merge.detect(CheckContext(trace=trace, path="t", options=CheckOptions(**options)))


def only(findings, check: str):
    hits = [f for f in findings if f.check == check]
    assert hits, f"no {check!r} among {[(f.check, f.evidence) for f in findings]}"
    assert all(f.kind is FindingClass.SPLIT_MERGE for f in findings)
    assert hits[0].cause.rstrip().endswith(".") and len(hits[0].cause.split()) > 6
    return hits


@pytest.fixture(autouse=True)
def fresh_probe():
    stage2.stage2_probe.cache_clear()
    yield
    stage2.stage2_probe.cache_clear()


# -- broken merges (torch doubles of stage 2) ------------------------------------------------


def torch_stage2(*, skip_empty: bool = True, exp=torch.exp, keep: int | None = None, skip_neg_inf: bool = False, scale: float = 1.0):
    """Stage 2 in torch with one switchable mistake:
    skip_empty=False  merges every split, empty ones too (FlashInfer #4051: exp(-inf - -inf));
    exp=torch.exp2    natural-log LSEs weighted as base 2 (FlashInfer #2113's confusion);
    keep=N            merges only the first N splits (a loop bound taken from the wrong count);
    skip_neg_inf      skips states by their -inf LSE instead of by the split boundaries (FA2's
                      +inf empty marker then gets in);
    scale             every output off by a factor, one split or many (an error outside the merge)."""

    def stage2(*, attn_logits, attn_lse, o, lse, kv_indptr, num_kv_splits, max_kv_splits, sinks=None, v_scale=1.0):
        assert sinks is None and v_scale == 1.0, "this stand-in merges layers without sinks or KV scales"
        for b in range(o.shape[0]):
            n = int(kv_indptr[b + 1] - kv_indptr[b])
            s = min(int(num_kv_splits[b]), max_kv_splits)
            per = split_rule.split_length(n, s)
            states = [i for i in range(s) if not skip_empty or (per and i * per < n)]
            if skip_neg_inf:
                states = [i for i in range(s) if not bool(torch.isneginf(attn_lse[b, 0, i]))]
            states = states[:keep] if keep else states
            if not states:
                o[b], lse[b] = 0.0, float("-inf")
                continue
            part_lse, part_o = attn_lse[b][:, states], attn_logits[b][:, states]
            m = part_lse.max(-1).values
            w = exp(part_lse - m[:, None])
            o[b] = (scale * (w[..., None] * part_o).sum(1) / w.sum(1)[:, None]).to(o.dtype)
            lse[b] = m + torch.log(w.sum(1))

    return stage2


BUGS = {
    "merges-empty-splits": dict(skip_empty=False),
    "base-2-weights": dict(exp=torch.exp2),
    "first-two-splits-only": dict(keep=2),
}


# -- split counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(DECODES))
@pytest.mark.parametrize("bug", list(BUGS))
def test_broken_merge_is_found_by_split_count(monkeypatch: pytest.MonkeyPatch, bug: str, model: str) -> None:
    monkeypatch.setattr(decode_kernels, "decode_stage2", torch_stage2(**BUGS[bug]))
    trace = make_trace(*DECODES[model], plan=True)
    findings = detect(trace)
    hits = only(findings, "split-count-fails-reference")
    labels = [h.evidence.split(":")[0] for h in hits]
    assert "num_kv_splits=1" not in labels  # one split has nothing to merge
    lengths = trace.batch.kv_lens.tolist()
    for h in hits:
        b = h.location.request
        assert h.location.row == b and h.location.head is not None
        assert f"kv {lengths[b]}" in h.evidence and "(1 split passes)" in h.evidence
        if bug == "merges-empty-splits":
            assert split_rule.empty_splits(lengths[b], h.data["splits"][b]) > 0 and "#4051" in h.cause
        else:
            assert "merged wrongly" in h.cause
    if bug == "first-two-splits-only":
        assert "num_kv_splits=2" not in labels and f"num_kv_splits={counts.MAX_KV_SPLITS} (max)" in labels
    if bug == "merges-empty-splits":
        probe = only(findings, "empty-split-merge")[0]
        assert probe.data["case"] == "empty splits marked -inf"


def test_vllm_v2_partitions_are_one_more_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = make_trace("decode-long", *SMALL, "kv_lens=1,1100", plan=True)
    configs, lengths = counts.split_configs(CheckContext(trace=trace, path="t"))
    v2 = [c for c in configs if c.vllm_v2]
    assert len(v2) == 1 and v2[0].splits == (1, 3) and lengths == [1, 1100]
    # Our kernels split 1100 tokens into 3 x cdiv(367, 32) * 32 = 384-token splits, not 512.
    assert split_rule.split_length(1100, 3) == 384 and split_rule.split_length(1000, 2) == 512
    monkeypatch.setattr(decode_kernels, "decode_stage2", torch_stage2(keep=2))
    labels = [f.evidence.split(":")[0] for f in only(detect(trace), "split-count-fails-reference")]
    assert any(label.startswith("vLLM PagedAttention v2") for label in labels)


def test_short_requests_dedupe_v2_into_one_split() -> None:
    configs, _ = counts.split_configs(CheckContext(trace=make_trace(*DECODES["gqa"], plan=True), path="t"))
    assert not any(c.vllm_v2 for c in configs)  # every request <= 512 tokens: v2 == 1 split
    assert [c.splits for c in configs][:2] == [(1, 1), (2, 2)] and (16, 16) in [c.splits for c in configs]


# -- empty states through our stage 2 ------------------------------------------------------------


@pytest.mark.parametrize("dv", [32, 64])
def test_our_stage2_skips_empty_states(dv: int) -> None:
    assert stage2.stage2_probe(dv) == {
        stage2.CONTROL: None,
        "empty splits marked -inf": None,
        "empty splits marked +inf (FA2's convention)": None,
        "every split empty (no KV)": None,
    }


@pytest.mark.parametrize(
    "bug,broken",
    [
        (dict(skip_empty=False), {"empty splits marked -inf", "empty splits marked +inf (FA2's convention)", "every split empty (no KV)"}),
        (dict(skip_neg_inf=True), {"empty splits marked +inf (FA2's convention)"}),
    ],
)
def test_probe_names_the_broken_case(monkeypatch: pytest.MonkeyPatch, bug: dict, broken: set) -> None:
    monkeypatch.setattr(decode_kernels, "decode_stage2", torch_stage2(**bug))
    cases = stage2.stage2_probe(64)
    assert {case for case, problem in cases.items() if problem} == broken


@pytest.mark.parametrize("merge_bug,expected", [({}, set()), (dict(exp=torch.exp2), {"split-count-changes-output"})])
def test_errors_outside_the_merge_are_not_split_findings(monkeypatch: pytest.MonkeyPatch, merge_bug: dict, expected: set) -> None:
    # Every output 10% off, with one split as with many: not the merge's doing, so nothing is
    # reported (the probe's control fails too) unless a split configuration moves on top of it.
    monkeypatch.setattr(decode_kernels, "decode_stage2", torch_stage2(scale=1.1, **merge_bug))
    findings = detect(make_trace(*DECODES["gqa"], plan=True))
    assert {f.check for f in findings} == expected
    for f in findings:
        assert f.location.request == 1 and "single-split run fails the reference too" in f.evidence  # kv 70: 2+ splits


def test_every_split_empty_is_reached_only_through_zero_fill_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_kernels, "decode_stage2", torch_stage2(skip_empty=False))
    # 512-token requests fill the splits of every configuration: the probe's empty-split cases are
    # broken but unreachable, and only a padded row with seq_len 0 reaches "every split empty".
    eager = make_trace("decode-gqa", *SMALL, "kv_lens=512,512", plan=True)
    assert stage2.empty_split_merge(CheckContext(trace=eager, path="t")) == []
    padded = make_trace("decode-gqa", *SMALL, "kv_lens=512,512", "capture_bs=4", "fill_value=0", plan=True)
    findings = stage2.empty_split_merge(CheckContext(trace=padded, path="t"))
    assert [f.data["case"] for f in findings] == ["every split empty (no KV)"]
    assert findings[0].location.request == 2 and "padded or empty request" in findings[0].evidence


# -- recorded tensors ----------------------------------------------------------------------------

RECORDED = {
    "decode": ("decode-gqa", *SMALL, "kv_lens=5,70", "shared_prefix=0"),
    "extend": ("extend-prefix", *SMALL, "prefix_lens=0,40", "extend_lens=5,6", "shared_prefix=0"),
    "verify": ("verify", *SMALL, "prefix_lens=20,33"),
    "mla": DECODES["mla"],
    "window": ("window", *SMALL, "prefix_lens=40,3", "extend_lens=5,6"),
}


@pytest.mark.parametrize("step", list(RECORDED))
def test_lse_in_base_2_read_as_natural(step: str) -> None:
    trace = from_dict(to_dict(mutate.lse_base_2(make_trace(*RECORDED[step], plan=True))))
    f = only(recorded_only(trace), "lse-base-confusion")[0]
    assert abs(f.data["ratio"] - 1 / LN2) < 1e-3 and "LSE in base 2 treated as natural" in f.evidence
    assert f.location.layer == 0 and f.location.row is not None


@pytest.mark.parametrize("step", ["decode", "extend"])
def test_natural_lse_read_as_base_2_and_correct_labels(step: str) -> None:
    trace = mutate.lse_base_2(make_trace(*RECORDED[step], plan=True))
    recorded = trace.tensors[0]
    as_base2 = replace(trace, tensors={0: replace(recorded, lse=recorded.lse * LN2, lse_base=LseBase.TWO)})
    f = only(recorded_only(as_base2), "lse-base-confusion")[0]
    assert abs(f.data["ratio"] - LN2) < 1e-3 and "natural LSE treated as base 2" in f.evidence
    # A true base-2 LSE labelled base 2, and a natural one labelled e, are both right.
    assert recorded_only(replace(trace, tensors={0: replace(recorded, lse_base=LseBase.TWO)})) == []
    assert recorded_only(replace(trace, tensors={0: replace(recorded, lse=recorded.lse * LN2)})) == []


def recorded_only(trace):
    return recorded.recorded_tensors(CheckContext(trace=trace, path="t"))


def test_fa2_plus_inf_marks_an_empty_row() -> None:
    trace = make_trace(*RECORDED["decode"], plan=True)
    ref = torch.tensor([[1.5, -float("inf")], [2.0, 3.0]], dtype=torch.float64)
    truth = recorded._Truth(inputs=None, ref=AttentionResult(torch.zeros(2, 2, 1), ref), lowp=AttentionResult(torch.zeros(2, 2, 1), ref))
    ctx = CheckContext(trace=trace, path="t")
    keep = torch.zeros(2, dtype=torch.bool)
    fa2 = torch.tensor([[1.5, float("inf")], [2.0, 3.0]])
    assert recorded._lse_findings(ctx, layer=0, lse=fa2, base=LseBase.E, truth=truth, skip_rows=keep) == []
    finite_for_empty = torch.tensor([[1.5, 0.25], [2.0, 3.0]])
    f = only(recorded._lse_findings(ctx, layer=0, lse=finite_for_empty, base=LseBase.E, truth=truth, skip_rows=keep), "recorded-lse-mismatch")[0]
    assert (f.location.row, f.location.head) == (0, 1)


def test_noisy_lse_and_output_are_mismatches_not_base_confusion() -> None:
    trace = mutate.lse_base_2(make_trace(*RECORDED["decode"], plan=True))
    recorded = trace.tensors[0]
    noisy = recorded.lse * LN2 + torch.linspace(0.0, 0.5, recorded.lse.numel()).view_as(recorded.lse)
    output = recorded.output.clone()
    output[1, 1] += 0.5
    findings = recorded_only(replace(trace, tensors={0: replace(recorded, lse=noisy, output=output)}))
    assert {f.check for f in findings} == {"recorded-lse-mismatch", "recorded-output-mismatch"}
    out = only(findings, "recorded-output-mismatch")[0]
    assert (out.location.request, out.location.row) == (1, 1) and "split-KV decode" in out.cause


@pytest.mark.parametrize("spec", [DECODES["gqa"], DECODES["mla"], ("decode-paged", *SMALL, "kv_lens=5,33,100")])
@pytest.mark.parametrize("with_plan", [True, False])
def test_nan_rows_of_requests_with_empty_splits(spec, with_plan: bool) -> None:
    trace = from_dict(to_dict(mutate.nan_empty_split(make_trace(*spec, plan=with_plan))))
    lengths, splits, _ = recorded.engine_splits(trace)
    victims = [b for b, (n, s) in enumerate(zip(lengths, splits)) if split_rule.empty_splits(n, s)]
    f = only(recorded_only(trace), "empty-split-nan")[0]
    assert f.location.request == victims[0] and f.location.row == victims[0]
    assert f.data["requests"] == victims and "#4051" in f.cause
    assert [g.check for g in recorded_only(trace)] == ["empty-split-nan"]  # its NaN LSE is not reported twice


@pytest.mark.parametrize(
    "spec",
    [
        RECORDED["extend"],
        ("mixed", *SMALL, "prefix_lens=48,0,33", "extend_lens=20,25,1"),
        ("fp16", *SMALL, "prefix_lens=30,0", "extend_lens=20,45"),
    ],
)
def test_cascade_merged_with_a_base_2_prefix_lse(spec) -> None:
    trace = from_dict(to_dict(mutate.cascade_lse_base_2(make_trace(*spec, plan=True))))
    f = only(recorded_only(trace), "merge-lse-base-confusion")[0]
    assert f.data["part"] == "prefix" and abs(f.data["factor"] - 1 / LN2) < 1e-12
    assert int(trace.batch.prefix_lens[f.location.request]) > 0 and f.location.layer == 0


# -- clean sweep and injections --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_clean_presets_have_no_findings(preset: str, dtype: str) -> None:
    assert detect(sweep_trace(preset, dtype)) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", list(SWEEP_SHAPES))
def test_clean_graph_steps_have_no_findings(preset: str, dtype: str) -> None:
    assert detect(sweep_trace(preset, dtype, "capture_bs=3")) == []


@pytest.mark.parametrize("preset", ["decode-gqa", "verify", "mla-decode", "extend-prefix", "selective", "window"])
def test_correct_recorded_tensors_have_no_findings(preset: str) -> None:
    # The engine's own tensors, correct: natural LSE labelled e.
    injected = mutate.lse_base_2(sweep_trace(preset, "bfloat16"))
    fixed = replace(injected.tensors[0], lse=injected.tensors[0].lse * LN2)
    assert recorded_only(replace(injected, tensors={0: fixed})) == []


INJECTED = {
    "split-merge:lse-base-2": (RECORDED["decode"], "lse-base-confusion"),
    "split-merge:nan-empty-split": (RECORDED["decode"], "empty-split-nan"),
    "split-merge:cascade-lse-base-2": (RECORDED["extend"], "merge-lse-base-confusion"),
    "split-merge:merge-step-lse-base": (("merge-state", "tokens=8", "heads=2"), "merge-step-lse-base"),
}


@pytest.mark.parametrize("kind", list(mutate.INJECTIONS))
def test_injections_round_trip_and_are_detected(kind: str) -> None:
    spec, check = INJECTED[kind]
    assert mutate.INJECTIONS[kind].__doc__.strip().splitlines()[0]
    original = make_trace(*spec, plan=True)
    trace = from_dict(to_dict(mutate.INJECTIONS[kind](original)))
    assert torch.equal(trace.batch.slot_ids, original.batch.slot_ids)  # ground truth untouched
    only(detect(trace), check)


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("split-merge:nan-empty-split", RECORDED["extend"]),
        ("split-merge:nan-empty-split", ("decode-gqa", *SMALL, "kv_lens=600,700")),  # no empty split
        ("split-merge:cascade-lse-base-2", RECORDED["decode"]),
        ("split-merge:cascade-lse-base-2", ("extend-noprefix", *SMALL)),
        ("split-merge:cascade-lse-base-2", RECORDED["window"]),
        ("split-merge:merge-step-lse-base", RECORDED["decode"]),
    ],
)
def test_injections_refuse_steps_they_do_not_apply_to(kind: str, spec) -> None:
    with pytest.raises(ValueError, match=kind):
        mutate.INJECTIONS[kind](make_trace(*spec, plan=True))


# -- GPU only ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_cascade_matches_a_single_pass_with_an_empty_prefix() -> None:
    trace = make_trace("extend-prefix", "prefix_lens=0,40,129", plan=True)  # request 0: empty prefix
    assert gpu.cascade_vs_single_pass(CheckContext(trace=trace, path="t")) == []


@pytest.mark.gpu
def test_gpu_broken_cascade_merge_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from attndbg.backends import flashinfer as fi_backend

    def cascade_with_natural_code(self, fi, trace, plan, inputs):
        """SGLang #40903: FlashInfer's base-2 LSEs merged by natural-log code."""
        o_new, s_new = self._ragged(fi, trace, plan, inputs)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(), "NHD", backend="fa2")
        fi_backend._plan_paged(wrapper, trace.model, plan, q_dtype=inputs.q.dtype, kv_dtype=inputs.k_cache.dtype)
        o_pre, s_pre = wrapper.run(inputs.q, fi_backend._paged_kv(inputs, trace.model.page_size), return_lse=True)
        m = torch.maximum(s_new, s_pre)
        w_new, w_pre = torch.exp(s_new - m), torch.exp(s_pre - m)
        out = (w_new[..., None] * o_new.float() + w_pre[..., None] * o_pre.float()) / (w_new + w_pre)[..., None]
        return out.to(o_new.dtype), (m + torch.log(w_new + w_pre)) / numerics.LN2

    monkeypatch.setattr(fi_backend.FlashInferBackend, "_cascade", cascade_with_natural_code)
    trace = make_trace("extend-prefix", "prefix_lens=0,3072", "extend_lens=5,64", plan=True)
    f = only(gpu.cascade_vs_single_pass(CheckContext(trace=trace, path="t")), "cascade-vs-single-pass")[0]
    assert f.location.request == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_flashinfer_merge_state_on_empty_states(dtype) -> None:
    pytest.importorskip("flashinfer")
    cases = gpu.merge_state_probe(dtype)
    assert cases["state + empty state (-inf)"] is None, cases
    # Recorded, not asserted: whether this FlashInfer merges two empty states without NaN (#4051) and
    # what it makes of FA2's +inf marker; the detector reports them only where a trace reaches them.
    print(cases)


@pytest.mark.gpu
def test_gpu_merge_launched_off_the_capture_stream_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    real_stage2 = decode_kernels.decode_stage2

    def stage2_outside_the_graph(**kw):
        """SGLang #5404: the merge went to another stream, so capture did not record it; warm-up
        ran it once, and every replay returns that stale merge."""
        if torch.cuda.is_current_stream_capturing():
            return
        real_stage2(**kw)

    monkeypatch.setattr(decode_kernels, "decode_stage2", stage2_outside_the_graph)
    trace = make_trace("decode-gqa", "kv_lens=40,90,200", plan=True)
    findings = gpu.merge_in_capture(CheckContext(trace=trace, path="t", options=CheckOptions(backends=("triton",), cuda_graph=True)))
    assert only(findings, "merge-off-capture-stream")[0].data["backend"] == "triton"


@pytest.mark.gpu
def test_gpu_clean_steps_have_no_findings_with_graphs() -> None:
    for preset in ("decode-gqa", "verify", "extend-prefix", "mla-decode"):
        assert detect(make_trace(preset, plan=True), cuda_graph=True) == []
