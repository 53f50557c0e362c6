"""Typed access to a dumped call's arguments and outputs, and FlashInfer's KV cache layouts read as
one pool of slots. Every missing or malformed argument is a TraceError naming the call's folder
and the argument; a value the call did not pass is None (the importer then infers it and says so).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attndbg.interop.files import index_tensor
from attndbg.interop.flashinfer_dump import Call
from attndbg.trace.errors import TraceError, printable

FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


class NotImported(Exception):
    """A well-formed call attndbg has no step form for (non-causal attention over a cache, a decode
    row without KV, ...): skipped with this reason, never an error."""


def index(call: Call, name: str) -> Tensor:
    return index_tensor(call.args().get(name), name, call.directory)


def positive_int(call: Call, name: str, default: int | None = None) -> int:
    value = call.args().get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > 1 << 20:
        raise TraceError(name, f"= {printable(repr(value), 60)}, expected a positive int", call.where)
    return value


def _known(call: Call | None, name: str, ok: Any, expected: str) -> Any:
    """The value the call passed as `name` when `ok(value)` holds; None when it passed none (or None)."""
    if call is None or call.args().get(name) is None:
        return None
    value = call.args()[name]
    if not ok(value):
        raise TraceError(name, f"= {printable(repr(value), 60)}, expected {expected}", call.where)
    return value


def known_float(call: Call | None, name: str) -> float | None:
    value = _known(call, name, lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v), "a finite number")
    return None if value is None else float(value)


def known_int(call: Call | None, name: str) -> int | None:
    return _known(call, name, lambda v: not isinstance(v, bool) and isinstance(v, int) and abs(v) <= 1 << 40, "an int")


def known_bool(call: Call | None, name: str) -> bool | None:
    return _known(call, name, lambda v: isinstance(v, bool), "a bool")


def known_str(call: Call | None, name: str) -> str | None:
    return _known(call, name, lambda v: isinstance(v, str) and len(v) <= 64 and v.isprintable(), "a short string")


def float_tensor(call: Call, name: str, *, dims: int, value: Any = None) -> Tensor:
    value = call.args().get(name) if value is None else value
    if not isinstance(value, Tensor):
        raise TraceError(name, f"missing or not a tensor ({type(value).__name__})", call.where)
    if value.dtype not in FLOAT_TYPES or value.dim() != dims:
        raise TraceError(name, f"is a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}, expected a {dims}-D float tensor", call.where)
    return value


def results(call: Call) -> tuple[Tensor | None, Tensor | None]:
    """(output, LSE) the call returned: `result` alone, or `result_0` and `result_1`."""
    out = call.outputs()
    if "result" in out:
        return out["result"], None
    return out.get("result_0"), out.get("result_1")


def check_shape(tensor: Tensor | None, shape: tuple[int, ...], name: str, call: Call) -> Tensor | None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise TraceError(name, f"has shape {list(tensor.shape)}, expected {list(shape)}", call.where)
    return tensor


def kv_pool(call: Call, name: str, *, layout: str, page_size: int, heads: int, dim: int) -> tuple[Tensor, Tensor, int]:
    """FlashInfer's paged KV (utils.py _unpack_paged_kv_cache) as two [pages * page_size, heads, dim]
    slot-indexed pools and the page count: a (k, v) pair of [P, page, H, D] (NHD) / [P, H, page, D]
    (HND) or of [N, H, D] (page size 1, SGLang), or one [P, 2, page, H, D] / [P, 2, H, page, D]."""
    value = call.args().get(name)
    if isinstance(value, Tensor):
        cache = float_tensor(call, name, dims=5, value=value)
        if cache.shape[1] != 2:
            raise TraceError(name, f"has shape {list(cache.shape)}, expected [pages, 2, ...] (K and V)", call.where)
        k, v = cache[:, 0], cache[:, 1]
    elif isinstance(value, tuple) and len(value) == 2:
        k = float_tensor(call, f"{name}[0]", dims=value[0].dim() if isinstance(value[0], Tensor) else 4, value=value[0])
        v = float_tensor(call, f"{name}[1]", dims=value[1].dim() if isinstance(value[1], Tensor) else 4, value=value[1])
    else:
        raise TraceError(name, f"missing or not a tensor or (k, v) pair ({type(value).__name__})", call.where)
    pools = []
    for part, t in (("k", k), ("v", v)):
        if t.dim() == 3:  # [slots, H, D]: page size 1
            t = t.unsqueeze(1)
        if t.dim() != 4:
            raise TraceError(name, f"{part} has shape {list(t.shape)}, expected 3 or 4 dims", call.where)
        if layout == "HND":
            t = t.transpose(1, 2)
        if tuple(t.shape[1:]) != (page_size, heads, dim):
            raise TraceError(name, f"{part} has pages of shape {list(t.shape[1:])}, expected [{page_size}, {heads}, {dim}] ({layout})", call.where)
        pools.append(t.reshape(-1, heads, dim))
    if pools[0].shape != pools[1].shape:
        raise TraceError(name, f"k {list(pools[0].shape)} and v {list(pools[1].shape)} differ", call.where)
    return pools[0], pools[1], pools[0].shape[0] // page_size
