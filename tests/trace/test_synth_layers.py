"""synth's keys for the layer kinds and batch forms engines run today, their trace fields, the
validation of each field on load, and `synth --recording N`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attndbg.trace import io, synth
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import ForwardMode, GraphCapture, to_dict
from attndbg.trace.synth_spec import SpecError
from attndbg.trace.validate import from_dict
from tests.cli.helpers import invoke, one_line_error
from tests.factories import make_trace, stored

NEW_KEYS = ("graph_mode", "causal", "window_right", "sinks", "k_scale", "v_scale", "cross", "extend_mask", "parents", "slots", "max_kv_splits")
NEW_MODEL_FIELDS = ("causal", "window_right", "sinks", "k_scale", "v_scale")


def test_every_new_key_is_listed_with_an_example() -> None:
    listed = subprocess.run([sys.executable, "-m", "attndbg", "synth", "--list"], capture_output=True, text=True, check=True).stdout
    for key in NEW_KEYS:
        assert f"\n    {key} " in listed, key
    # Each property has a preset as its example (the clean sweep runs every preset).
    for preset in ("sinks-decode", "bidirectional", "fp8-scaled", "cross", "extend-mask", "mixed-graph"):
        assert f"\n  {preset} " in listed, preset


def test_absent_fields_are_not_stored() -> None:
    """A trace without the new properties stores none of their keys (byte-identical to before them)."""
    data = stored("extend-prefix")
    assert not set(NEW_MODEL_FIELDS) & set(data["model"])
    assert "cross" not in data["batch"] and "custom_mask" not in data["batch"]
    data = stored("decode-gqa", "capture_bs=8")
    assert "captured" not in data["graph"]


def test_layer_fields_round_trip(tmp_path: Path) -> None:
    trace = make_trace("decode-gqa", "kv_dtype=float8_e4m3fn", "k_scale=0.5", "v_scale=2.0", "sinks=1", "heads=4:2")
    loaded = io.load(io.save(trace, tmp_path / "t.pt"))
    m = loaded.model
    assert (m.k_scale, m.v_scale, m.causal, m.window_right) == (0.5, 2.0, True, -1)
    assert m.sinks.dtype == torch.float32 and torch.equal(m.sinks, trace.model.sinks)
    assert make_trace("window", "window_right=8").model.causal is False  # a right window is non-causal
    assert make_trace("cross").model.causal is False  # cross-attention is, unless causal=1
    assert make_trace("cross", "causal=1").model.causal is True


def test_sinks_are_drawn_last() -> None:
    """sinks=1 changes nothing else of the trace: every other draw is the same."""
    a, b = make_trace("decode-mha", "sinks=1"), make_trace("decode-mha")
    assert a.model.sinks.shape == (a.model.num_qo_heads,)
    assert torch.equal(a.batch.slot_ids, b.batch.slot_ids)


def test_cross_attention_lengths() -> None:
    trace = make_trace("extend-prefix", "prefix_lens=0,3,9", "extend_lens=4,6,2", "cross=1")
    b = trace.batch
    assert b.cross and b.kv_lens.tolist() == [0, 3, 9] and b.prefix_lens.tolist() == [0, 3, 9]
    assert b.extend_lens.tolist() == [4, 6, 2]
    # Bottom-right aligned columns: kv - q + i, negative where a request has more queries than keys.
    assert b.query_cols.tolist() == [-4, -3, -2, -1, -3, -2, -1, 0, 1, 2, 7, 8]
    assert bool((b.out_cache_loc == -1).all())
    decode = make_trace("decode-mha", "kv_lens=0,5", "cross=1")
    assert decode.batch.kv_lens.tolist() == [0, 5] and decode.batch.extend_lens.tolist() == [1, 1]


def test_zero_lengths_where_the_mode_allows_them() -> None:
    trace = make_trace("extend-prefix", "prefix_lens=0,7,0", "extend_lens=5,0,0")
    assert trace.batch.kv_lens.tolist() == [5, 7, 0]
    with pytest.raises(SpecError, match="a decode request has at least its current token"):
        make_trace("decode-mha", "kv_lens=0,5")


def test_extend_masks() -> None:
    causal = make_trace("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "extend_mask=causal")
    b = causal.batch
    assert b.custom_mask.numel() == int((b.extend_lens * b.kv_lens).sum())
    assert torch.equal(b.mask_block(1), torch.arange(11)[None, :] <= torch.arange(7, 11)[:, None])
    random = make_trace("extend-prefix", "prefix_lens=0,7", "extend_lens=5,4", "extend_mask=random").batch
    assert bool(random.mask_block(1)[torch.arange(4), torch.arange(7, 11)].all())  # own column kept
    blocks = make_trace("extend-prefix", "prefix_lens=0", "extend_lens=40", "extend_mask=blocks").batch.mask_block(0)
    assert bool((blocks | ~torch.ones(40, 40, dtype=torch.bool).tril()).all())  # causal kept
    assert bool(blocks.triu(1).any())  # some span sees ahead
    with pytest.raises(SpecError, match="extend_mask=random: a custom mask on an extend or mixed step"):
        make_trace("decode-mha", "extend_mask=random")


def test_explicit_draft_tree() -> None:
    trace = make_trace("verify", "parents=-1,0,0,1,2")
    spec = trace.spec
    assert spec.draft_token_num == 5 and (spec.topk, spec.steps) == (2, 2)
    assert bool((spec.parents == torch.tensor([-1, 0, 0, 1, 2])).all())
    assert trace.batch.extend_lens.tolist() == [5] * trace.batch.batch_size
    with pytest.raises(SpecError, match="entry 2 is 3"):
        make_trace("verify", "parents=-1,0,3")


def _pages(trace, b: int) -> list[int]:
    return (trace.batch.request_slots(b)[:: trace.model.page_size] // trace.model.page_size).tolist()


def test_slot_layouts() -> None:
    spec = ("decode-paged", "kv_lens=40,70,33", "shared_prefix=0")
    contiguous = make_trace(*spec, "slots=contiguous")
    assert _pages(contiguous, 0) == [1, 2, 3] and _pages(contiguous, 1)[0] == 4
    shuffled = make_trace(*spec, "slots=shuffled_pages")
    assert sorted(_pages(shuffled, 1)) == _pages(contiguous, 1) and _pages(shuffled, 1) != _pages(contiguous, 1)
    interleaved = make_trace(*spec, "slots=interleaved_pages")
    assert _pages(interleaved, 0)[:2] == [1, 4] and _pages(interleaved, 1)[:2] == [2, 5]
    descending = make_trace(*spec, "slots=non_monotonic")
    assert _pages(descending, 1) == sorted(_pages(contiguous, 1), reverse=True)
    extend = make_trace("extend-prefix", "prefix_lens=0", "extend_lens=9", "slots=non_monotonic")
    assert bool((extend.batch.out_cache_loc.diff() < 0).all())  # out_cache_loc decreasing within the extend
    # The default keeps `scatter`'s layout, bit for bit.
    assert torch.equal(make_trace(*spec, "slots=scatter").batch.slot_ids, make_trace(*spec).batch.slot_ids)
    assert torch.equal(make_trace(*spec, "slots=contiguous").batch.slot_ids, make_trace(*spec, "scatter=0").batch.slot_ids)


def test_graph_of_a_mixed_step() -> None:
    trace = make_trace("mixed", "graph_mode=mixed", "capture_bs=8")
    g, b = trace.graph, trace.batch
    assert g.captured is GraphCapture.MIXED and g.capture_bs == 8
    assert g.padded_qo_indptr.tolist() == b.qo_indptr.tolist() + [b.num_tokens + i for i in range(1, 5)]
    assert g.padded_out_cache_loc.numel() == b.num_tokens + 4 and g.padded_seq_lens.tolist()[4:] == [1] * 4
    with pytest.raises(SpecError, match="engines capture only decode and verify steps, not MIXED"):
        make_trace("mixed", "capture_bs=8")
    with pytest.raises(SpecError, match="graph_mode=mixed: such a runner does not capture EXTEND"):
        make_trace("extend-prefix", "capture_bs=8", "graph_mode=mixed")
    assert make_trace("extend-prefix", "capture_bs=8", "graph_mode=full").batch.forward_mode is ForwardMode.EXTEND


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (("window", "window_right=4", "causal=1"), "a causal layer sees no key after the query"),
        (("decode-gqa", "k_scale=0.5"), "engines scale only an fp8 KV cache"),
        (("verify", "causal=0"), "a verify step attends by its draft tree"),
        (("verify", "cross=1"), "cross-attention steps are decode, extend or mixed"),
        (("decode-gqa", "sinks=2"), "expected 0 or 1"),
        (("decode-gqa", "slots=random"), "expected one of contiguous"),
    ],
)
def test_spec_errors(words: tuple[str, ...], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        make_trace(*words)


def _stored_with(base: tuple[str, ...], section: str, **fields) -> dict:
    data = to_dict(make_trace(*base))
    data[section].update(fields)
    return data


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (_stored_with(("window",), "model", window_right=3), "model.window_right: = 3, but model.causal is true"),
        (_stored_with(("decode-gqa",), "model", k_scale=0.5), "model.k_scale: = 0.5, but the KV cache is bfloat16"),
        (_stored_with(("decode-gqa", "kv_dtype=float8_e4m3fn"), "model", v_scale=-1.0), "model.v_scale: = -1.0, must be > 0"),
        (_stored_with(("decode-gqa",), "model", sinks=torch.zeros(5)), "model.sinks: has 5 elements, expected one per query head (32)"),
        (_stored_with(("decode-gqa",), "model", sinks=torch.full((32,), float("nan"))), "model.sinks[0]: = nan, expected a finite logit"),
        (_stored_with(("decode-gqa",), "model", sinks=torch.zeros(32, dtype=torch.float64)), "model.sinks: dtype float64, expected float32"),
        (_stored_with(("extend-prefix",), "batch", cross=True), "batch.kv_lens[0]: = 37, expected prefix_lens = 0"),
        (_stored_with(("extend-prefix",), "batch", custom_mask=torch.ones(3, dtype=torch.bool)), "batch.custom_mask: has 3 elements, expected sum(extend_lens * kv_lens)"),
        (_stored_with(("extend-prefix",), "batch", custom_mask=torch.ones(3)), "batch.custom_mask: dtype float32, expected bool"),
        (_stored_with(("verify",), "model", causal=False), "model.causal: is set on a TARGET_VERIFY step"),
        (_stored_with(("decode-gqa", "capture_bs=8"), "graph", captured="always"), "graph.captured: = 'always', expected one of decode, mixed, full"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_fields_name_field_and_element(data: dict, field: str) -> None:
    with pytest.raises(TraceError) as error:
        from_dict(data)
    assert str(error.value).startswith(field), str(error.value)


def test_cross_attention_queries_are_checked() -> None:
    data = to_dict(make_trace("cross"))
    loc = data["batch"]["out_cache_loc"].clone()
    loc[2] = 5
    data["batch"]["out_cache_loc"] = loc
    with pytest.raises(TraceError, match=r"batch.out_cache_loc\[2\]: = 5, expected -1"):
        from_dict(data)
    data = to_dict(make_trace("cross"))
    cols = data["batch"]["query_cols"].clone()
    cols[0] = 0
    data["batch"]["query_cols"] = cols
    with pytest.raises(TraceError, match=r"batch.query_cols\[0\]: = 0, expected kv_len - q_len \+ token index = 1"):
        from_dict(data)


def test_bad_field_in_a_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save(_stored_with(("decode-gqa",), "model", k_scale=float("inf")), path)
    one_line_error(invoke("show", str(path)), "model.k_scale", "expected a finite number")


def test_recording_of_n_steps(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    result = invoke("synth", "decode-gqa", "capture_bs=8", "--recording", "6", "-o", str(out))
    assert result.exit_code == 0, result.output
    entries = io.read_manifest(out)
    assert [e.step for e in entries] == list(range(6))
    assert [e.batch_size for e in entries] == [4, 3, 2, 1, 2, 3]  # shrinks, then grows back
    steps = [io.load(out / e.file) for e in entries]
    assert all(t.graph.capture_bs == 8 and t.plan is not None for t in steps)
    assert steps[1].batch.kv_lens.tolist() == [n + 1 for n in steps[0].batch.kv_lens.tolist()[:3]]
    assert steps[0].seed != steps[1].seed
    one_line_error(invoke("synth", "decode-gqa", "--recording", "2", "-o", str(out)), "exists and is not an empty directory")
    one_line_error(invoke("synth", "decode-gqa", "-o", str(out)), "is a directory")


def test_recording_specs_cover_every_mode() -> None:
    for preset in ("extend-prefix", "mixed", "verify", "selective"):
        specs = synth.recording_specs(synth.parse_spec([preset]), 5)
        sizes = [synth.build(s).batch.batch_size for s in specs]
        assert sizes[0] > min(sizes) and len(set(s.seed for s in specs)) == 5, (preset, sizes)


def test_show_names_the_layer_kinds(tmp_path: Path) -> None:
    path = io.save(make_trace("cross", "sinks=1"), tmp_path / "t.pt")
    text = " ".join(invoke("show", str(path), columns=200).output.split())
    assert "causal no (queries see later keys)" in text and "sinks 8 logits" in text and "EXTEND (cross-attention)" in text
    plain = " ".join(invoke("show", str(io.save(make_trace("extend-prefix"), tmp_path / "p.pt")), columns=200).output.split())
    assert "causal" not in plain and "sinks" not in plain
    scaled = " ".join(invoke("show", str(io.save(make_trace("fp8-scaled"), tmp_path / "s.pt")), columns=200).output.split())
    assert "(k_scale 0.5, v_scale 2)" in scaled
