"""Diff two saved replays (or two backends of one): per request, row and head, where outputs and
LSEs differ and by how much.

This reports differences, not verdicts: two runs of one deterministic kernel must be bitwise
identical, two different kernels may differ within tolerance, and deciding which is which is the
checks' job. Non-finite values are counted on each side; a NaN or Inf facing a different value is
a "non-finite mismatch", kept out of `max_abs` (which stays a finite number) and always chosen as
the worst element, since it is the one a user must look at first.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.compare.saved import REFERENCE, SavedReplay


class PairStatus(enum.Enum):
    COMPARED = "compared"
    MISSING = "missing"  # a name of the pair is not in its file
    SHAPE_MISMATCH = "shape_mismatch"  # [T, Hq, Dv] differ: not the same trace or model


@dataclass(frozen=True)
class Worst:
    """The element that differs most (a non-finite mismatch first)."""

    request: int  # found through qo_indptr of file a
    row: int  # token row in [0, T)
    row_in_request: int
    head: int
    col: int  # output column; -1 for the LSE
    a: float
    b: float


@dataclass(frozen=True)
class TensorDelta:
    """Differences of one tensor (output [T, Hq, Dv] or LSE [T, Hq]) between the two sides."""

    max_abs: float  # over elements finite on both sides; 0.0 when none differ
    bitwise_equal: bool  # every element has the same bits (so NaN payloads and -0.0 count)
    differing: int  # elements that differ in value (NaN vs NaN and -0.0 vs 0.0 do not)
    differing_rows: int  # token rows with at least one differing element
    nonfinite_mismatches: int  # elements where one side is NaN/Inf and the other is not the same
    worst: Worst | None  # None when no element differs in value
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int
    head_max_abs: tuple[float, ...]  # [Hq] max_abs per query head


@dataclass(frozen=True)
class RequestDelta:
    request: int
    rows: int  # query tokens of the request
    output_max_abs: float
    lse_max_abs: float
    differing_rows: int  # rows whose output or LSE differ in value
    nonfinite_mismatches: int


@dataclass(frozen=True)
class PairDiff:
    a_name: str  # backend in file a
    b_name: str  # backend in file b
    status: PairStatus
    reason: str = ""  # why not COMPARED, one line
    output: TensorDelta | None = None
    lse: TensorDelta | None = None
    differing_rows: int = 0  # rows whose output or LSE differ in value
    num_rows: int = 0
    requests: tuple[RequestDelta, ...] = ()  # every request, in batch order
    # For scale: (output, LSE) max abs of each side's result against that file's own float64
    # reference; None where the file has no reference or the name is the reference.
    a_vs_reference: tuple[float, float] | None = None
    b_vs_reference: tuple[float, float] | None = None

    @property
    def bitwise_equal(self) -> bool:
        return self.status is PairStatus.COMPARED and self.output.bitwise_equal and self.lse.bitwise_equal


@dataclass(frozen=True)
class ReplayDiff:
    a_path: str
    b_path: str
    a_trace_file: str
    b_trace_file: str
    qo_indptr_equal: bool  # False: the files replayed different batches; requests follow file a
    pairs: tuple[PairDiff, ...]
    only_a: tuple[str, ...]  # backends in a only (default pairing only)
    only_b: tuple[str, ...]

    @property
    def identical(self) -> bool:
        """Every pair compared and bitwise equal, and nothing present on one side only."""
        return all(p.bitwise_equal for p in self.pairs) and not self.only_a and not self.only_b

    @property
    def differs(self) -> bool:
        return not self.identical


def diff_replays(
    a: SavedReplay,
    b: SavedReplay,
    *,
    backends: list[str] | None = None,
    pairs: list[tuple[str, str]] | None = None,
) -> ReplayDiff:
    """Compare backend results of `a` and `b` (pass one file twice to compare two of its backends).

    Default: every backend present in both, by name, in a's order. `backends`: only those names.
    `pairs`: explicit (name in a, name in b) pairs, e.g. [("triton", "reference")].
    """
    if backends is not None and pairs is not None:
        raise ValueError("give backends or pairs, not both")
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()
    if pairs is None:
        if backends is None:
            backends = [name for name in a.results if name in b.results]
            only_a = tuple(n for n in a.results if n not in b.results)
            only_b = tuple(n for n in b.results if n not in a.results)
        pairs = [(name, name) for name in backends]
    indptr_equal = a.qo_indptr.shape == b.qo_indptr.shape and bool(torch.equal(a.qo_indptr, b.qo_indptr))
    return ReplayDiff(
        a_path=a.path,
        b_path=b.path,
        a_trace_file=a.trace_file,
        b_trace_file=b.trace_file,
        qo_indptr_equal=indptr_equal,
        pairs=tuple(_pair(a, b, x, y) for x, y in pairs),
        only_a=only_a,
        only_b=only_b,
    )


def _pair(a: SavedReplay, b: SavedReplay, a_name: str, b_name: str) -> PairDiff:
    for name, side in ((a_name, a), (b_name, b)):
        if name not in side.results:
            label = side.path or "the file"
            reason = f"{name!r} is not in {label} (it has {', '.join(side.results) or 'no results'})"
            return PairDiff(a_name, b_name, PairStatus.MISSING, reason=reason)
    ra, rb = a.results[a_name], b.results[b_name]
    if ra.output.shape != rb.output.shape:
        reason = f"output shapes differ: {list(ra.output.shape)} vs {list(rb.output.shape)}"
        return PairDiff(a_name, b_name, PairStatus.SHAPE_MISMATCH, reason=reason)
    qo = a.qo_indptr
    e_out, e_lse = _elementwise(ra.output, rb.output), _elementwise(ra.lse, rb.lse)
    out, lse = _delta(ra.output, rb.output, e_out, qo), _delta(ra.lse, rb.lse, e_lse, qo)
    rows = _rowwise(e_out.differs, "any") | _rowwise(e_lse.differs, "any")
    return PairDiff(
        a_name,
        b_name,
        PairStatus.COMPARED,
        output=out,
        lse=lse,
        differing_rows=int(rows.sum()),
        num_rows=int(rows.numel()),
        requests=_requests(e_out, e_lse, qo),
        a_vs_reference=_vs_reference(a, a_name),
        b_vs_reference=_vs_reference(b, b_name),
    )


def _vs_reference(side: SavedReplay, name: str) -> tuple[float, float] | None:
    if name == REFERENCE or REFERENCE not in side.results:
        return None
    r, ref = side.results[name], side.results[REFERENCE]

    def max_abs(x: Tensor, y: Tensor) -> float:
        return float(_elementwise(x, y).abs_diff.max()) if x.numel() else 0.0

    return max_abs(r.output, ref.output), max_abs(r.lse, ref.lse)


def different_traces(a: SavedReplay, b: SavedReplay) -> str:
    """Why `a` and `b` cannot be replays of one trace ("" when they may be): the traces' digests,
    the batches (qo_indptr) or the result shapes differ."""
    if a.trace_digest and b.trace_digest and a.trace_digest != b.trace_digest:
        return f"{a.trace_file} and {b.trace_file} have different contents (sha256 {a.trace_digest[:12]}… vs {b.trace_digest[:12]}…)"
    if not (a.qo_indptr.shape == b.qo_indptr.shape and torch.equal(a.qo_indptr, b.qo_indptr)):
        return f"their batches differ: qo_indptr {a.qo_indptr.tolist()[:8]} vs {b.qo_indptr.tolist()[:8]}"
    shapes = {tuple(r.output.shape) for side in (a, b) for r in side.results.values()}
    if len(shapes) > 1:
        return f"their outputs have different shapes: {' vs '.join(str(list(s)) for s in sorted(shapes))}"
    return ""


@dataclass(frozen=True)
class _Elementwise:
    abs_diff: Tensor  # float64, same shape: |a - b| where both finite, else 0
    differs: Tensor  # bool: values differ (NaN == NaN, -0.0 == 0.0)
    nonfinite: Tensor  # bool: differs and one side is not finite


def _elementwise(a: Tensor, b: Tensor) -> _Elementwise:
    finite = torch.isfinite(a) & torch.isfinite(b)
    differs = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    abs_diff = torch.where(finite, (a.double() - b.double()).abs(), torch.zeros((), dtype=torch.float64))
    return _Elementwise(abs_diff=abs_diff, differs=differs, nonfinite=differs & ~finite)


def _rowwise(t: Tensor, op: str) -> Tensor:
    """Reduce [T, ...] to [T]."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    if flat.numel() == 0:
        return torch.zeros(t.shape[0], dtype=t.dtype)
    return flat.amax(1) if op == "max" else flat.any(1) if op == "any" else flat.sum(1)


def _delta(a: Tensor, b: Tensor, e: _Elementwise, qo_indptr: Tensor) -> TensorDelta:
    rows = _rowwise(e.differs, "any")
    per_head = e.abs_diff.transpose(0, 1).reshape(a.shape[1], a.numel() // max(a.shape[1], 1))
    head_max = per_head.amax(1) if per_head.numel() else torch.zeros(a.shape[1], dtype=torch.float64)
    worst = None
    if e.differs.any():
        # A non-finite mismatch outranks any finite difference: it is the bug to look at first.
        score = torch.where(e.nonfinite, torch.full((), float("inf"), dtype=torch.float64), e.abs_diff)
        score = torch.where(e.differs, score, torch.full((), -1.0, dtype=torch.float64))
        index = [int(i) for i in torch.unravel_index(torch.argmax(score), score.shape)]
        row, head = index[0], index[1]
        request = int(torch.searchsorted(qo_indptr, torch.tensor(row), right=True)) - 1
        worst = Worst(
            request=request,
            row=row,
            row_in_request=row - int(qo_indptr[request]),
            head=head,
            col=index[2] if a.dim() == 3 else -1,
            a=float(a[tuple(index)]),
            b=float(b[tuple(index)]),
        )
    bits = a.view(torch.int32), b.view(torch.int32)  # float32 by construction of SavedReplay
    return TensorDelta(
        max_abs=float(e.abs_diff.max()) if a.numel() else 0.0,
        bitwise_equal=bool(torch.equal(*bits)),
        differing=int(e.differs.sum()),
        differing_rows=int(rows.sum()),
        nonfinite_mismatches=int(e.nonfinite.sum()),
        worst=worst,
        nan_a=int(torch.isnan(a).sum()),
        nan_b=int(torch.isnan(b).sum()),
        inf_a=int(torch.isinf(a).sum()),
        inf_b=int(torch.isinf(b).sum()),
        head_max_abs=tuple(float(v) for v in head_max),
    )


def _requests(o: _Elementwise, l: _Elementwise, qo_indptr: Tensor) -> tuple[RequestDelta, ...]:
    bs = qo_indptr.numel() - 1
    counts = qo_indptr[1:] - qo_indptr[:-1]
    request_of_row = torch.repeat_interleave(torch.arange(bs), counts)

    def per_request(row_values: Tensor, reduce: str) -> Tensor:
        base = torch.zeros(bs, dtype=row_values.dtype)
        return base.scatter_reduce(0, request_of_row, row_values, reduce=reduce, include_self=True)

    out_max = per_request(_rowwise(o.abs_diff, "max"), "amax")
    lse_max = per_request(_rowwise(l.abs_diff, "max"), "amax")
    rows = (_rowwise(o.differs, "any") | _rowwise(l.differs, "any")).to(torch.int64)
    nonfinite = _rowwise(o.nonfinite, "sum").to(torch.int64) + _rowwise(l.nonfinite, "sum").to(torch.int64)
    differing_rows, nonfinite = per_request(rows, "sum"), per_request(nonfinite, "sum")
    return tuple(
        RequestDelta(
            request=r,
            rows=int(counts[r]),
            output_max_abs=float(out_max[r]),
            lse_max_abs=float(lse_max[r]),
            differing_rows=int(differing_rows[r]),
            nonfinite_mismatches=int(nonfinite[r]),
        )
        for r in range(bs)
    )
