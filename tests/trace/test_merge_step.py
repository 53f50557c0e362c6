"""A standalone merge of given partial states (trace.merge): the field, its validation, synth
mode=merge, the float64 merge against a naive loop, our Triton merge kernel on the CPU interpreter,
the backends' declarations, and the split-merge detector's judgement of a recorded merge."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg.backends import reference, registry
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detectors import registry as registry_of_detectors
from attndbg.detectors.split_merge.detect import detect
from attndbg.detectors.split_merge.injections import merge_step_lse_base
from attndbg.numerics import LN2, LOG2E
from attndbg.replay.runner import ReplayOptions, RunStatus, given_states, replay
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import LseBase, MergeStates, to_dict
from attndbg.trace.synth_merge import merged_as_recorded
from attndbg.trace.synth_spec import SpecError
from attndbg.trace.validate import from_dict
from tests.cli.helpers import invoke, one_line_error
from tests.factories import make_trace, stored

# Small enough for the Triton interpreter: 3 states x 5 tokens x 2 heads x 64.
SMALL = ("merge-state", "states=3", "tokens=5", "heads=2", "head_dim=64", "empty=1")


def naive_merge(v: torch.Tensor, s: torch.Tensor, base: LseBase) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, head by head, state by state in float64: sum w_i v_i / sum w_i, w_i = base**s_i,
    a state of LSE -inf left out; a row with none gets 0 and -inf."""
    states, tokens, heads, width = v.shape
    out = torch.zeros(tokens, heads, width, dtype=torch.float64)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
    ln_base = LN2 if base is LseBase.TWO else 1.0
    for t in range(tokens):
        for h in range(heads):
            kept = [i for i in range(states) if float(s[i, t, h]) != float("-inf")]
            if not kept:
                continue
            top = max(float(s[i, t, h]) * ln_base for i in kept)
            weights = [math.exp(float(s[i, t, h]) * ln_base - top) for i in kept]
            total = sum(weights)
            out[t, h] = sum(w * v[i, t, h].double() for w, i in zip(weights, kept)) / total
            lse[t, h] = top + math.log(total)
    return out, lse


def _states(base: LseBase, *, seed: int = 0) -> MergeStates:
    """4 states x 6 tokens x 3 heads: state 1 empty on rows 0-2 with NaN in its output there, every
    state empty on row 4 (head 0) with NaN in every output, a state far below the others on row 5
    (a weight that underflows in float32, not in float64: its large output must still weigh ~0)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(4, 6, 3, 16, generator=g)
    s = torch.randn(4, 6, 3, generator=g) * 3.0
    s[1, :3] = float("-inf")
    v[1, :3] = float("nan")  # an empty chunk's scratch: never read
    s[:, 4, 0] = float("-inf")
    v[:, 4, 0] = float("nan")
    s[2, 5] = -200.0
    v[2, 5] = 1e4
    return MergeStates(v=v.to(torch.bfloat16), s=s.to(torch.float32), lse_base=base)


@pytest.mark.parametrize("base", list(LseBase))
def test_reference_merge_matches_a_naive_loop(base: LseBase) -> None:
    states = _states(base)
    got = reference.merge(states)
    want_out, want_lse = naive_merge(states.v, states.s, base)
    assert got.output.dtype == torch.float64 and bool(torch.isfinite(got.output).all())  # no NaN leaks from a state of weight 0
    assert torch.allclose(got.output, want_out, atol=1e-12, rtol=0)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(got.lse[finite], want_lse[finite], atol=1e-12, rtol=0)
    assert torch.equal(got.output[4, 0], torch.zeros(16, dtype=torch.float64)) and float(got.lse[4, 0]) == float("-inf")


def test_a_row_mask_leaves_rows_as_state_0() -> None:
    """merge_state_in_place(mask=): rows left out keep state 0 (output and LSE) as given."""
    g = torch.Generator().manual_seed(5)
    v = torch.randn(2, 7, 3, 16, generator=g).to(torch.float16)
    s = (torch.randn(2, 7, 3, generator=g) * 2).to(torch.float32)
    mask = torch.tensor([True, False, True, True, False, False, True])
    got = reference.merge(MergeStates(v=v, s=s, lse_base=LseBase.TWO, mask=mask))
    want_out, want_lse = naive_merge(v, s, LseBase.TWO)
    assert torch.allclose(got.output[mask], want_out[mask], atol=1e-12, rtol=0)
    assert torch.equal(got.output[~mask], v[0][~mask].double()) and torch.equal(got.lse[~mask], s[0][~mask].double() * LN2)
    trace = make_trace(*SMALL[:1], "row_mask=1", "tokens=6", "heads=2", "head_dim=64")
    assert trace.merge.mask is not None and 0 < int(trace.merge.mask.sum()) < 6
    kept = ~trace.merge.mask
    assert torch.equal(trace.merge.output[kept], trace.merge.v[0][kept])  # the engine's in-place merge left them


def test_the_guard_refuses_a_row_mask_a_kernel_would_read_outside_of() -> None:
    from attndbg.plans.guard import merge_refusal

    states = given_states(make_trace(*SMALL[:1], "row_mask=1", "tokens=6", "heads=2").merge, LseBase.E)
    assert merge_refusal(states) is None
    assert "a row mask is one bool per row" in merge_refusal(replace(states, rows=states.rows[:5]))
    assert "a row mask is one bool per row" in merge_refusal(replace(states, rows=states.rows.to(torch.int32)))


def test_the_base_is_honoured() -> None:
    """The same numbers read in base 2 and in base e are different merges (the base is not ignored)."""
    two, e = _states(LseBase.TWO), _states(LseBase.E)
    assert not torch.allclose(reference.merge(two).output, reference.merge(e).output)
    assert torch.allclose(reference.merge(two).lse[0], reference.merge(replace(e, s=e.s * LN2)).lse[0], atol=1e-6)


def test_synth_merge_round_trips_and_records_a_correct_merge(tmp_path: Path) -> None:
    trace = make_trace(*SMALL, "lse_base=e", "seed=3")
    loaded = io.load(io.save(trace, tmp_path / "m.pt"))
    m = loaded.merge
    assert m is not None and m.v.shape == (3, 5, 2, 64) and m.s.shape == (3, 5, 2) and m.lse_base is LseBase.E
    assert torch.isneginf(m.s[1, ::2]).all() and torch.isfinite(m.s[1, 1::2]).all()
    assert torch.equal(m.v, trace.merge.v) and torch.equal(m.output, trace.merge.output)
    ref = reference.merge(m)
    assert (m.output.double() - ref.output).abs().max() < 2 ** -7 * 4  # bf16 rounding of a unit-scale output
    assert make_trace(*SMALL).merge.lse_base is LseBase.TWO
    assert torch.equal(make_trace(*SMALL).merge.v, make_trace(*SMALL).merge.v)  # seeded


def test_other_steps_store_no_merge_key() -> None:
    """Old trace files load unchanged: the field defaults away and is not stored."""
    assert "merge" not in stored("extend-prefix")
    for path in sorted(Path(__file__).resolve().parents[2].joinpath("traces").glob("*.pt")):
        raw = torch.load(path, weights_only=True)
        data = to_dict(io.load(path))
        assert "merge" not in data and set(data) == set(raw), path.name
        assert all(set(data[k]) == set(raw[k]) for k in raw if isinstance(raw[k], dict)), path.name


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["merge"].update(s=d["merge"]["s"].transpose(1, 2).contiguous()), "merge.s: shape [3, 2, 5]"),
        (lambda d: d["merge"]["s"].__setitem__((2, 1, 0), float("nan")), "merge.s[2, 1, 0]: = nan"),
        (lambda d: d["merge"]["s"].__setitem__((0, 0, 1), float("inf")), "merge.s[0, 0, 1]: = inf"),
        (lambda d: d["merge"].update(v=d["merge"]["v"].float()), "merge.v: dtype float32, expected model.q_dtype bfloat16"),
        (lambda d: d["merge"].update(v=d["merge"]["v"][:, :, :1]), "merge.v: shape [3, 5, 1, 64]"),
        (lambda d: d["merge"].update(output=d["merge"]["output"][:4]), "merge.output"),
        (lambda d: d["merge"].update(lse_base="10"), "merge.lse_base"),
        (lambda d: d["batch"].update(forward_mode="DECODE"), "batch.forward_mode"),
        (lambda d: d["merge"].update(mask=torch.ones(5, dtype=torch.bool)), "merge.mask: has 5 rows for 3 states"),
        (lambda d: d["merge"].update(mask=torch.ones(5, dtype=torch.int64)), "merge.mask: dtype int64"),
    ],
)
def test_bad_merge_sections_are_one_line(tmp_path: Path, edit, needle: str) -> None:
    data = stored(*SMALL)
    edit(data)
    with pytest.raises(TraceError) as info:
        from_dict(data)
    assert needle in f"{info.value.field}: {info.value.message}", f"{info.value.field}: {info.value.message}"
    path = tmp_path / "bad.pt"
    torch.save(data, path)
    for command in ("replay", "check", "show"):
        one_line_error(invoke(command, str(path)), "bad.pt", info.value.field)


def test_synth_keys_are_listed_and_checked(tmp_path: Path) -> None:
    listed = subprocess.run([sys.executable, "-m", "attndbg", "synth", "--list"], capture_output=True, text=True, check=True).stdout
    for key in ("states", "tokens", "lse_base", "empty", "row_mask"):
        assert f"\n    {key} " in listed, key
    assert "\n  merge-state " in listed and "\n  merge-chunks " in listed and "split-merge:merge-step-lse-base" in listed
    with pytest.raises(SpecError, match="empty=3: state 3 is not one of the 3 states"):
        make_trace(*SMALL, "empty=3")
    with pytest.raises(SpecError, match="row_mask=1: merge_state_in_place merges two states"):
        make_trace(*SMALL, "row_mask=1")
    with pytest.raises(SpecError, match="lse_base='10'"):
        make_trace(*SMALL, "lse_base=10")
    one_line_error(invoke("synth", "merge-state", "--recording", "2", "-o", str(tmp_path / "rec")), "a merge step has no batch")
    result = invoke("synth", *SMALL, "kv_lens=3", "-o", str(tmp_path / "m.pt"))
    assert result.exit_code == 0 and "kv_lens: not used by mode=merge" in result.stderr


def test_backends_declare_the_merge() -> None:
    trace = make_trace(*SMALL)
    for name in ("reference", "triton", "flashinfer"):
        assert registry.create(name).capabilities().gap(trace) is None, name
    for name, words in (("fa3", "no merge of given states"), ("mla", "runs MLA attention"), ("vllm_paged", "merge_attn_states")):
        reason = registry.create(name).capabilities().gap(trace)
        assert reason is not None and "a standalone merge of given partial states" in reason and words in reason, (name, reason)
    odd = make_trace(*SMALL, "head_dim=96")
    assert "merge widths 64/128/256/512 only" in registry.create("flashinfer").capabilities().gap(odd)
    assert "merge bf16 states" not in (registry.create("flashinfer").capabilities().gap(make_trace(*SMALL, "dtype=float32")) or "")
    assert "this merge's are float32" in registry.create("flashinfer").capabilities().gap(make_trace(*SMALL, "dtype=float32"))


@pytest.mark.parametrize("words", [("lse_base=2",), ("lse_base=e",), ("lse_base=e", "states=2", "empty=", "row_mask=1")])
def test_triton_merge_passes_on_the_cpu(words: tuple[str, ...]) -> None:
    trace = make_trace(*SMALL, *words)
    result = replay(trace, "m.pt", ["reference", "triton"], ReplayOptions(repeat=2))
    runs = {r.name: r for r in result.runs}
    # The backends get float32 LSEs in their own base (as kernels take them): the reference's run is
    # exact up to that conversion.
    assert runs["reference"].status is RunStatus.PASSED and runs["reference"].comparison.max_abs < 1e-6
    triton = runs["triton"]
    assert triton.status is RunStatus.PASSED, (triton.reason, triton.comparison)
    assert triton.repeat_identical is True and triton.comparison.total_rows == 5
    assert torch.isneginf(triton.result.lse).sum() == 0 and triton.comparison.max_abs > 0  # a real kernel's rounding, not a copy


def test_triton_merge_skips_empty_states_and_empties_rows() -> None:
    """NaN in an empty state's output never reaches the row; a row of empty states gives 0 / -inf;
    a merge of mis-based LSEs is caught by the comparison."""
    states = _states(LseBase.E)
    states = replace(states, v=states.v[..., :16], s=torch.where(states.s < -100, torch.full_like(states.s, float("-inf")), states.s))
    backend = registry.create("triton")
    merged = backend.merge_states(given_states(states, LseBase.E))
    want_out, want_lse = naive_merge(states.v, states.s, LseBase.E)
    assert bool(torch.isfinite(merged.output).all())
    assert (merged.output.double() - want_out).abs().max() < 2e-2
    assert torch.equal(torch.isneginf(merged.lse), torch.isneginf(want_lse))
    assert torch.equal(merged.output[4, 0].float(), torch.zeros(16))
    trace = make_trace(*SMALL, "lse_base=2")
    wrong = replace(trace, merge=replace(trace.merge, lse_base=LseBase.E))  # base-2 numbers handed over as natural logs
    run = next(r for r in replay(wrong, "m.pt", ["triton"]).runs)
    assert run.status is RunStatus.PASSED  # the kernel merges what it was given correctly...
    assert not torch.allclose(run.result.output.double(), reference.merge(trace.merge).output, atol=5e-2)  # ...which is not the right merge


def _findings(trace):
    return detect(CheckContext(trace=trace, path="m.pt", options=CheckOptions()))


@pytest.mark.parametrize("base", ["2", "e"])
def test_lse_base_mix_up_is_caught_and_its_twin_is_clean(base: str) -> None:
    clean = make_trace("merge-state", f"lse_base={base}", "empty=1", "states=3", "tokens=24")
    assert _findings(clean) == []
    findings = _findings(merge_step_lse_base(clean))
    assert [f.check for f in findings] == ["merge-step-lse-base"]
    assert findings[0].data["factor"] == (LOG2E if base == "2" else LN2) and findings[0].data["states"] == [0, 1, 2]
    assert findings[0].location.field == "merge.output"


def test_one_mis_based_state_and_an_unexplained_merge() -> None:
    clean = make_trace("merge-chunks", "tokens=16")
    m = clean.merge
    scale = torch.ones(m.num_states, 1, 1)
    scale[3] = LOG2E  # state 3's LSE was base 2, the rest natural (SGLang #40903's prefix)
    output, _ = merged_as_recorded(m.v, m.s * scale, m.lse_base)
    findings = _findings(replace(clean, merge=replace(m, output=output, lse=None)))
    assert [f.check for f in findings] == ["merge-step-lse-base"] and findings[0].data["states"] == [3]
    noisy = m.output.clone()
    noisy[7, 2] += 0.5
    findings = _findings(replace(clean, merge=replace(m, output=noisy)))
    assert [(f.check, f.location.row, f.location.head) for f in findings] == [("merge-step-mismatch", 7, 2)]
    nan = m.output.clone()
    nan[0, 0, 0] = float("nan")
    assert [f.check for f in _findings(replace(clean, merge=replace(m, output=nan)))] == ["merge-step-nonfinite"]


@pytest.mark.parametrize("preset", ["merge-state", "merge-chunks"])
def test_every_detector_is_clean_on_the_presets(preset: str) -> None:
    """The correct twins: no detector finds anything in a correct merge step (the kernels detector
    merging on our Triton kernel, the others finding no batch to judge)."""
    trace = make_trace(preset, "tokens=6", "heads=2")
    for kind in registry_of_detectors.names():
        detector = registry_of_detectors.load(kind)
        ctx = CheckContext(trace=trace, path="m.pt", options=CheckOptions(backends=("triton",)))
        assert detector.run(ctx) == [], kind


def test_a_kernel_defect_on_a_merge_step_names_the_merge_and_its_replay() -> None:
    """The kernels detector's report of a failing merge: the merge's shape, and a command that runs
    it again (repro scripts no merge step)."""
    from attndbg.backends.options import BackendOptions
    from attndbg.detector_api.library_defect import library_defect
    from attndbg.replay.variants import EAGER

    defect = library_defect(make_trace(*SMALL), "m.pt", registry.create("triton"), variant=EAGER, plan=None, options=BackendOptions())
    assert defect.shape.startswith("merge of 3 states x 5 tokens x 2 heads") and defect.repro == "attndbg replay m.pt --backend triton"


def test_check_and_replay_exit_0_on_a_correct_step_and_check_catches_the_mistake(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    assert invoke("synth", *SMALL, "-o", str(good)).exit_code == 0
    assert invoke("synth", *SMALL, "-o", str(bad), "--inject", "split-merge:merge-step-lse-base").exit_code == 0
    result = invoke("replay", str(good), "--backend", "reference,triton")
    assert result.exit_code == 0 and "merge of 3 states x 5 tokens x 2 heads" in result.output, result.output
    assert invoke("check", str(good), "--only", "split-merge,invariants").exit_code == 0
    result = invoke("check", str(bad), "--only", "split-merge")
    assert result.exit_code == 1 and "merge-step-lse-base" in result.output, result.output
    assert "merge of given states" in invoke("show", str(good)).output
