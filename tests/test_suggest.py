"""'Did you mean': the name closest to one typed wrong, in each command's one-line error (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attndbg.suggest import closest
from tests.cli.helpers import invoke, one_line_error

TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "decode_gqa.pt")


def test_closest_folds_underscores_matches_a_bare_mistake_and_keeps_quiet_when_nothing_is_close() -> None:
    assert closest("tree_mask", ["invariants", "tree-mask", "split-merge"]) == "tree-mask"
    assert closest("kv_len", ["kv_lens", "prefix_lens", "seed"]) == "kv_lens"
    assert closest("tritonn", ["reference", "triton", "flashinfer"]) == "triton"
    assert closest("bit-order", ["tree-mask:bit-order", "tree-mask:short-buffer", "split-merge:lse-base-2"]) == "tree-mask:bit-order"
    assert closest("xyzzy", ["reference", "triton"]) is None
    assert closest("triton", ["reference", "triton"]) is None  # known: nothing to suggest


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["replay", TRACE, "--backend", "tritonn"], ["unknown backend 'tritonn' (did you mean 'triton'?)", "known: reference, triton"]),
        (["check", TRACE, "--only", "tree_mask"], ["unknown detector 'tree_mask' (did you mean 'tree-mask'?)", "detectors: "]),
        (["synth", "decode_gqa", "-o", "x.pt"], ["unknown preset 'decode_gqa' (did you mean 'decode-gqa'?)"]),
        (["synth", "decode-gqa", "kv_len=1,2", "-o", "x.pt"], ["unknown key 'kv_len' (did you mean 'kv_lens'?)"]),
        (["synth", "verify", "--inject", "bit-order", "-o", "x.pt"], ["unknown mistake 'bit-order' (did you mean 'tree-mask:bit-order'?)"]),
        (["replay", TRACE, "--backend-option", "trition.num_kv_splits=1"], ["unknown backend 'trition' (did you mean 'triton'?)"]),
        (["record", "--engine", "vlm", "--", "true"], ["unknown engine 'vlm' (did you mean 'vllm'?)"]),
    ],
    ids=["backend", "detector", "preset", "synth-key", "mistake", "backend-option", "engine"],
)
def test_a_name_typed_wrong_gets_the_closest_in_one_line(args: list[str], needles: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # synth's -o x.pt, never written
    one_line_error(invoke(*args), *needles)
    assert not (tmp_path / "x.pt").exists()


def test_a_name_nothing_is_close_to_gets_the_list_alone() -> None:
    result = invoke("replay", TRACE, "--backend", "xyzzy")
    one_line_error(result, "unknown backend 'xyzzy'; known: ")
    assert "did you mean" not in result.stderr
