"""Structural diff of two traces: which fields of source, model, batch, spec, graph, plan, the engine
buffers behind them and the recorded layer tensors differ, and for tensors exactly where.

Every compared field gets a `FieldDiff`, equal ones included, so a report can say "model: 13
fields equal" as well as list the differences. Tensors are compared element by element; the first
differing element is named with both values and, where the trace defines what a flat index means
(slot ids, per-token arrays, tree masks), with the request/row/column it belongs to. NaN equals NaN
here: this is a diff of two recordings, not a numerical check.

`Trace.buffers` (the engine buffer behind a recorded mask or index tensor) is its own section,
`buffers.<field>`: the buffer's real `length`, the `read` extent of the step's kernel, the
`capacity` flag, and its `contents` (the recorded head of the buffer, the tensor at `<field>`),
whose first differing element is named like the field's own and placed before or past what the
kernel reads: two runs whose masks differ only in a stale tail read nothing different.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Union

import torch
from torch import Tensor

from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import MaskLayout, Trace

Value = Union[int, float, bool, str, tuple, None]  # a JSON-ready scalar, or a shape as a tuple


class FieldStatus(enum.Enum):
    EQUAL = "equal"
    VALUE = "value"  # a scalar (int, str, enum, ...) differs
    ELEMENTS = "elements"  # same shape and dtype, some elements differ
    SHAPE = "shape"  # tensor shapes differ (`index` may still name the first difference of 1-D tensors)
    DTYPE = "dtype"  # same shape, different dtype; values are compared too (`count` 0 = same values)
    ONLY_A = "only_a"  # present (not None) in a only: a section, a plan tensor, a layer
    ONLY_B = "only_b"


@dataclass(frozen=True)
class FieldDiff:
    field: str  # dotted path: "model.num_kv_heads", "batch.slot_ids", "plan.tensors.kv_indices", "tensors.3.q"
    status: FieldStatus
    a: Value = None  # VALUE: the values; ELEMENTS/SHAPE/DTYPE: the first differing elements; else None
    b: Value = None
    a_meta: str = ""  # tensors: "int64 [24]"; "" for scalars
    b_meta: str = ""
    index: tuple[int, ...] | None = None  # first differing element of a tensor
    count: int = 0  # differing elements (ELEMENTS, DTYPE); for SHAPE of 1-D tensors: in the common prefix
    numel: int = 0  # elements compared
    where: str = ""  # what `index` means in this trace ("request 1, column 37"), "" when self-evident

    @property
    def equal(self) -> bool:
        return self.status is FieldStatus.EQUAL


@dataclass(frozen=True)
class TraceDiff:
    fields: tuple[FieldDiff, ...]  # every compared field, in trace order

    @property
    def differences(self) -> tuple[FieldDiff, ...]:
        return tuple(f for f in self.fields if not f.equal)

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def differs(self) -> bool:
        return not self.identical

    def section(self, name: str) -> tuple[FieldDiff, ...]:
        """The fields of one top-level section ("model", "batch", ...)."""
        return tuple(f for f in self.fields if f.field.split(".", 1)[0] == name)


SECTIONS = ("source", "model", "seed", "batch", "spec", "graph", "capture", "plan", "buffers", "tensors", "merge")
CONTENTS = "contents"  # buffers.<field>.contents: the recorded head of the engine's buffer


def diff_traces(a: Trace, b: Trace) -> TraceDiff:
    out: list[FieldDiff] = []
    locate = _Locator(a)
    out += _compare_dataclass("source", a.source, b.source, locate)
    out += _compare_dataclass("model", a.model, b.model, locate)
    out.append(_compare_value("seed", a.seed, b.seed))
    out += _compare_dataclass("batch", a.batch, b.batch, locate)
    for name in ("spec", "graph", "capture", "plan"):
        out += _compare_optional(name, getattr(a, name), getattr(b, name), locate)
    for name in _union(a.buffers, b.buffers):
        out += _compare_buffer(name, a, b, locate)
    for layer in sorted(set(a.tensors) | set(b.tensors)):
        out += _compare_optional(f"tensors.{layer}", a.tensors.get(layer), b.tensors.get(layer), locate)
    out += _compare_optional("merge", a.merge, b.merge, locate)
    return TraceDiff(fields=tuple(out))


def _compare_optional(name: str, a: Any, b: Any, locate: "_Locator") -> list[FieldDiff]:
    if a is None and b is None:
        return []
    if a is None or b is None:
        return [FieldDiff(name, FieldStatus.ONLY_A if b is None else FieldStatus.ONLY_B)]
    if isinstance(a, dict):
        return [d for key in _union(a, b) for d in _compare_optional(f"{name}.{key}", a.get(key), b.get(key), locate)]
    if hasattr(a, "__dataclass_fields__"):
        return _compare_dataclass(name, a, b, locate)
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return [_compare_tensor(name, a, b, locate)]
    return [_compare_value(name, a, b)]


def buffer_tensor(trace: Trace, field: str) -> Tensor | None:
    """The recorded tensor a `Trace.buffers` key describes: "spec.custom_mask" or "plan.<name>"."""
    section, _, name = field.partition(".")
    if section == "spec" and trace.spec is not None:
        return getattr(trace.spec, name, None)
    if section == "plan" and trace.plan is not None:
        return trace.plan.tensors.get(name)
    return None


def _compare_buffer(field: str, a: Trace, b: Trace, locate: "_Locator") -> list[FieldDiff]:
    """buffers.<field>: length, read, capacity, then the contents (only when both sides have it)."""
    name = f"buffers.{field}"
    out = _compare_optional(name, a.buffers.get(field), b.buffers.get(field), locate)
    if field in a.buffers and field in b.buffers:
        out += _compare_optional(f"{name}.{CONTENTS}", buffer_tensor(a, field), buffer_tensor(b, field), locate)
    return out


def _compare_dataclass(name: str, a: Any, b: Any, locate: "_Locator") -> list[FieldDiff]:
    out = []
    for f in fields(a):
        out += _compare_optional(f"{name}.{f.name}", getattr(a, f.name), getattr(b, f.name), locate)
    return out


def _union(a: dict, b: dict) -> list:
    return list(a) + [k for k in b if k not in a]


def _plain(value: Any) -> Value:
    return value.value if isinstance(value, enum.Enum) else value


def _compare_value(name: str, a: Any, b: Any) -> FieldDiff:
    a, b = _plain(a), _plain(b)
    same = type(a) is type(b) and a == b
    return FieldDiff(name, FieldStatus.EQUAL if same else FieldStatus.VALUE, None if same else a, None if same else b)


def tensor_meta(t: Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _differs(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise 'not the same value', NaN equal to NaN; a and b have one shape."""
    if a.dtype != b.dtype:
        common = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    if a.dtype in (torch.uint16, torch.uint32, torch.uint64):
        a, b = a.to(torch.int64), b.to(torch.int64)  # few ops exist for these; values fit (uint64 aside)
    ne = a != b
    if a.is_floating_point():
        ne &= ~(torch.isnan(a) & torch.isnan(b))
    return ne


def _item(t: Tensor, index: tuple[int, ...]) -> Value:
    value = t[index]
    if value.dtype in (torch.uint16, torch.uint32, torch.uint64):
        value = value.to(torch.int64)
    return value.item()


def _compare_tensor(name: str, a: Tensor, b: Tensor, locate: "_Locator") -> FieldDiff:
    meta = {"a_meta": tensor_meta(a), "b_meta": tensor_meta(b)}
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        if a.dim() == 1 and b.dim() == 1:
            # Lengths differ (a request grew, a buffer is padded): the common prefix still tells where.
            n = min(a.numel(), b.numel())
            ne = _differs(a[:n], b[:n])
            first = int(torch.nonzero(ne)[0, 0]) if ne.any() else n
            both = first < n
            return FieldDiff(
                name,
                FieldStatus.SHAPE,
                _item(a, (first,)) if both else None,
                _item(b, (first,)) if both else None,
                index=(first,),
                count=int(ne.sum()),
                numel=n,
                where=locate(name, first),
                **meta,
            )
        return FieldDiff(name, FieldStatus.SHAPE, tuple(a.shape), tuple(b.shape), **meta)
    ne = _differs(a, b)
    count = int(ne.sum())
    status = FieldStatus.DTYPE if a.dtype != b.dtype else FieldStatus.ELEMENTS if count else FieldStatus.EQUAL
    if count == 0:
        return FieldDiff(name, status, numel=a.numel(), **meta)
    index = tuple(int(i) for i in torch.nonzero(ne)[0])
    return FieldDiff(
        name,
        status,
        _item(a, index),
        _item(b, index),
        index=index,
        count=count,
        numel=a.numel(),
        where=locate(name, index[0]) if a.dim() == 1 else "",
        **meta,
    )


class _Locator:
    """Says what a flat index of a 1-D trace tensor means, using trace a's layout."""

    def __init__(self, trace: Trace):
        self.trace = trace

    def __call__(self, name: str, k: int) -> str:
        if name.startswith("buffers.") and name.endswith(f".{CONTENTS}"):
            return self._buffer(name.removeprefix("buffers.").removesuffix(f".{CONTENTS}"), k)
        batch = self.trace.batch
        if name == "batch.slot_ids":
            return self._segment(batch.slot_indptr, k, "request", "column")
        if name in ("batch.query_cols", "batch.out_cache_loc", "batch.positions"):
            return self._segment(batch.qo_indptr, k, "request", "token")
        if name in ("batch.prefix_lens", "batch.extend_lens", "batch.kv_lens", "batch.seq_lens_raw"):
            return f"request {k}" if k < batch.batch_size else ""
        if name == "spec.custom_mask" and self.trace.spec is not None:
            return self._mask(k)
        plan = self.trace.plan
        if plan is not None and name.startswith("plan.tensors."):
            # A plan's flat arrays are indexed by its own indptrs; name the segment, not a request:
            # what a segment is (request, page, draft token) depends on the backend.
            indptr_name = {"kv_indices": "kv_indptr", "custom_mask": "mask_indptr"}.get(name.rsplit(".", 1)[1])
            indptr = plan.tensors.get(indptr_name) if indptr_name else None
            if indptr is not None and indptr.dim() == 1 and indptr.numel() > 1:
                return self._segment(indptr.to(torch.int64), k, f"{indptr_name} segment", "entry")
        return ""

    def _buffer(self, field: str, k: int) -> str:
        """Where element k of an engine buffer sits: as the recorded field names it, and whether the
        step's kernel reads it (trace a's read extent)."""
        section, _, rest = field.partition(".")
        where = self("plan.tensors." + rest if section == "plan" else field, k)
        read = self.trace.buffers[field].read
        if read < 0:
            return where
        extent = f"read by the kernel (read {read})" if k < read else f"past what the kernel reads (read {read})"
        return f"{where}; {extent}" if where else extent

    @staticmethod
    def _segment(indptr: Tensor, k: int, outer: str, inner: str) -> str:
        if k >= int(indptr[-1]):
            return ""
        seg = int(torch.searchsorted(indptr, torch.tensor(k), right=True)) - 1
        return f"{outer} {seg}, {inner} {k - int(indptr[seg])}"

    def _mask(self, k: int) -> str:
        spec, prefix = self.trace.spec, self.trace.batch.prefix_lens
        where = MaskGeometry.of_spec(spec, prefix).locate(k)
        if where is None:
            return ""
        b, row, col = where
        draft = col - int(prefix[b])
        if spec.mask_layout is MaskLayout.FULL:
            part = f"draft col {draft}" if draft >= 0 else "a prefix column"
            return f"request {b}, row {row}, col {col} ({part})"
        if spec.mask_layout is MaskLayout.QLEN_ONLY:
            return f"request {b}, row {row}, draft col {draft}"
        return f"request {b}, row {row}, packed word: bit j = draft col j"
