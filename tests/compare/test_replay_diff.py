"""diff_replays: per request/row/head differences between saved replays, or two backends of one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from attndbg.compare.replay_diff import PairStatus, diff_replays
from attndbg.compare.saved import REFERENCE, BackendResult, SavedReplay, load_replay, save_replay
from attndbg.report.diff import render_replay_diff, replay_diff_to_json
from attndbg.trace.synth import build, parse_spec

# The "mixed" preset: requests of 40, 25, 1 and 1 query tokens.
QO_INDPTR = build(parse_spec(["mixed"])).batch.qo_indptr
T, HQ, DV = int(QO_INDPTR[-1]), 4, 8


def _tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, HQ, DV, generator=g), torch.randn(T, HQ, generator=g)


def _replay(results: dict[str, tuple[torch.Tensor, torch.Tensor]], path: str = "run.pt", qo_indptr=QO_INDPTR) -> SavedReplay:
    return SavedReplay(
        trace_file="mixed.pt",
        qo_indptr=qo_indptr,
        results={name: BackendResult(out.clone(), lse.clone()) for name, (out, lse) in results.items()},
        path=path,
    )


def _base() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {REFERENCE: _tensors(0), "triton": _tensors(1)}


def test_identical_replays(tmp_path: Path) -> None:
    # Through the file format too: a saved and reloaded run diffs clean against itself.
    save_replay(tmp_path / "a.pt", trace_file="mixed.pt", qo_indptr=QO_INDPTR, results=_base())
    a, b = load_replay(tmp_path / "a.pt"), _replay(_base())
    d = diff_replays(a, b)
    assert d.identical and not d.differs and d.qo_indptr_equal and not d.only_a and not d.only_b
    assert [(p.a_name, p.b_name) for p in d.pairs] == [(REFERENCE, REFERENCE), ("triton", "triton")]
    for p in d.pairs:
        assert p.status is PairStatus.COMPARED and p.bitwise_equal
        assert p.output.max_abs == 0.0 and p.lse.max_abs == 0.0 and p.output.worst is None
        assert p.differing_rows == 0 and p.num_rows == T
        assert [r.rows for r in p.requests] == [40, 25, 1, 1]
    assert "all pairs bitwise identical" in _render(render_replay_diff(d))


def test_one_output_element_changed_names_request_row_head() -> None:
    base = _base()
    changed = {name: (out.clone(), lse.clone()) for name, (out, lse) in base.items()}
    row, head, col = 40 + 7, 2, 5  # request 1, its row 7
    changed["triton"][0][row, head, col] += 0.375
    d = diff_replays(_replay(base, "a.pt"), _replay(changed, "b.pt"), backends=["triton"])
    (p,) = d.pairs
    assert d.differs and not p.bitwise_equal and p.lse.bitwise_equal and p.lse.worst is None
    assert p.output.max_abs == pytest.approx(0.375, abs=1e-6)
    assert p.output.differing == 1 and p.output.differing_rows == 1 and p.differing_rows == 1
    w = p.output.worst
    assert (w.request, w.row, w.row_in_request, w.head, w.col) == (1, row, 7, head, col)
    assert (w.a, w.b) == (float(base["triton"][0][row, head, col]), float(changed["triton"][0][row, head, col]))
    assert [r.differing_rows for r in p.requests] == [0, 1, 0, 0]
    assert p.requests[1].output_max_abs == pytest.approx(0.375, abs=1e-6) and p.requests[1].lse_max_abs == 0.0
    assert [h > 0 for h in p.output.head_max_abs] == [h == head for h in range(HQ)]
    text = _render(render_replay_diff(d))
    assert "request 1 row 7 (step row 47) head 2 col 5" in text


def test_lse_change_in_a_single_row_request() -> None:
    base = _base()
    changed = {name: (out.clone(), lse.clone()) for name, (out, lse) in base.items()}
    changed["triton"][1][66, 3] -= 1.0  # the last request has one row: token 66
    (p,) = diff_replays(_replay(base), _replay(changed), backends=["triton"]).pairs
    assert p.output.bitwise_equal and not p.lse.bitwise_equal
    w = p.lse.worst
    assert (w.request, w.row_in_request, w.head, w.col) == (3, 0, 3, -1)
    assert [r.differing_rows for r in p.requests] == [0, 0, 0, 1]


def test_nan_on_one_side_is_counted_and_is_the_worst_element() -> None:
    base = _base()
    changed = {name: (out.clone(), lse.clone()) for name, (out, lse) in base.items()}
    changed["triton"][0][3, 1, 0] = float("nan")  # request 0
    changed["triton"][0][50, 0, 0] += 10.0  # a larger finite difference elsewhere (request 1)
    changed["triton"][1][60, 0] = float("inf")
    (p,) = diff_replays(_replay(base), _replay(changed), backends=["triton"]).pairs
    assert (p.output.nan_a, p.output.nan_b, p.lse.inf_a, p.lse.inf_b) == (0, 1, 0, 1)
    assert p.output.nonfinite_mismatches == 1 and p.lse.nonfinite_mismatches == 1
    assert p.output.max_abs == pytest.approx(10.0, rel=1e-5)  # finite differences only
    w = p.output.worst
    assert (w.request, w.row, w.head) == (0, 3, 1) and w.b != w.b  # the NaN, not the larger finite diff
    assert [r.nonfinite_mismatches for r in p.requests] == [1, 1, 0, 0]
    data = json.loads(json.dumps(replay_diff_to_json(diff_replays(_replay(base), _replay(changed))), allow_nan=False))
    triton = next(x for x in data["pairs"] if x["a_name"] == "triton")
    assert triton["output"]["worst"]["b"] == "nan" and triton["bitwise_equal"] is False


def test_same_nan_on_both_sides_is_not_a_difference_but_signed_zero_is_not_bitwise() -> None:
    out, lse = _tensors(1)
    out[0, 0, 0] = float("nan")
    out[2, 0, 0] = 0.0
    other = out.clone()
    other[2, 0, 0] = -0.0
    (p,) = diff_replays(_replay({"x": (out, lse)}), _replay({"x": (other, lse)})).pairs
    assert p.output.nan_a == p.output.nan_b == 1
    assert p.output.differing == 0 and p.differing_rows == 0
    assert not p.output.bitwise_equal  # 0.0 vs -0.0


def test_two_backends_inside_one_file() -> None:
    run = _replay(_base())
    d = diff_replays(run, run, pairs=[("triton", REFERENCE)])
    (p,) = d.pairs
    out_t, lse_t = run.results["triton"].output, run.results["triton"].lse
    out_r, lse_r = run.results[REFERENCE].output, run.results[REFERENCE].lse
    assert p.output.max_abs == pytest.approx(float((out_t.double() - out_r.double()).abs().max()))
    assert p.lse.max_abs == pytest.approx(float((lse_t.double() - lse_r.double()).abs().max()))
    per_request = [float((out_t[s:e].double() - out_r[s:e].double()).abs().max()) for s, e in zip(QO_INDPTR[:-1], QO_INDPTR[1:])]
    assert [r.output_max_abs for r in p.requests] == pytest.approx(per_request)
    assert p.differing_rows == T
    assert "triton vs reference" in _render(render_replay_diff(d))


def test_backend_of_one_file_against_another_backend_of_another() -> None:
    a = _replay({"fa3": _tensors(5)}, "a.pt")
    b = _replay({"flashinfer": _tensors(5), "triton": _tensors(6)}, "b.pt")
    d = diff_replays(a, b, pairs=[("fa3", "flashinfer"), ("fa3", "triton")])
    assert [p.bitwise_equal for p in d.pairs] == [True, False]


def test_default_pairs_and_names_on_one_side() -> None:
    a = _replay({REFERENCE: _tensors(0), "triton": _tensors(1), "fa3": _tensors(2)})
    b = _replay({"flashinfer": _tensors(3), "triton": _tensors(1), REFERENCE: _tensors(0)})
    d = diff_replays(a, b)
    assert [p.a_name for p in d.pairs] == [REFERENCE, "triton"]
    assert (d.only_a, d.only_b) == (("fa3",), ("flashinfer",))
    assert all(p.bitwise_equal for p in d.pairs) and not d.identical


def test_missing_names_and_shape_mismatch_are_reported_not_raised() -> None:
    a = _replay(_base(), "a.pt")
    g = torch.Generator().manual_seed(0)
    b = _replay({"triton": (torch.randn(T, HQ * 2, DV, generator=g), torch.randn(T, HQ * 2, generator=g))}, "b.pt")
    d = diff_replays(a, b, backends=["triton", "fa3"])
    statuses = {(p.a_name, p.status) for p in d.pairs}
    assert statuses == {("triton", PairStatus.SHAPE_MISMATCH), ("fa3", PairStatus.MISSING)}
    missing = next(p for p in d.pairs if p.status is PairStatus.MISSING)
    assert "'fa3' is not in a.pt" in missing.reason
    assert not d.identical
    assert "fa3" in _render(render_replay_diff(d))


def test_backends_and_pairs_are_exclusive() -> None:
    run = _replay(_base())
    with pytest.raises(ValueError):
        diff_replays(run, run, backends=["triton"], pairs=[("triton", REFERENCE)])


def test_empty_batch_and_empty_requests() -> None:
    empty = torch.tensor([0, 0, 0])
    a = SavedReplay(trace_file="idle.pt", qo_indptr=empty, results={"x": BackendResult(torch.zeros(0, HQ, DV), torch.zeros(0, HQ))})
    (p,) = diff_replays(a, a).pairs
    assert p.bitwise_equal and p.num_rows == 0 and [r.rows for r in p.requests] == [0, 0]


def test_different_batches_are_flagged() -> None:
    other_indptr = torch.tensor([0, 30, 65, 66, 67])
    d = diff_replays(_replay(_base()), _replay(_base(), qo_indptr=other_indptr))
    assert not d.qo_indptr_equal and all(p.bitwise_equal for p in d.pairs)
    assert "different batches" in _render(render_replay_diff(d))


def _render(renderable) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()
