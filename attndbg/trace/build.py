"""Engine-neutral pieces every maker of traces needs: a Batch from per-request KV rows, a step's
mode from its lengths, a Source.

The live-engine recorders (attndbg/record) and the importers of other tools' evidence
(attndbg/interop) resolve their source's length conventions (SGLang verify `seq_lens` exclude the
draft tokens, vLLM `seq_lens` include every scheduled token) into prefix/extend lengths and hand
the used part of each request's KV row here; this module lays them out the way the schema wants.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import metadata

import torch
from torch import Tensor

from attndbg.trace.errors import TraceError
from attndbg.trace.schema import Batch, ForwardMode, Source, indptr


def _i64(x: Tensor | Sequence[int]) -> Tensor:
    return torch.as_tensor(x).detach().to("cpu", torch.int64).reshape(-1)


def _host_ints(values: Tensor | Sequence[int]) -> list[int]:
    """Per-request lengths as host ints (a tensor's copied once; a recorder's list taken as is)."""
    return values.reshape(-1).tolist() if isinstance(values, Tensor) else list(values)


def mode_from_lengths(extend_lens: Tensor | Sequence[int], prefix_lens: Tensor | Sequence[int], *, path: str | None = None) -> ForwardMode:
    """DECODE if every request adds one token to a cached prefix, MIXED if only some do, else EXTEND.

    A one-token prompt without prefix is a prefill (EXTEND), as in SGLang. Lists of different
    lengths are bad input (a TraceError naming `path` when given), never a guess.
    """
    extend, prefix = _host_ints(extend_lens), _host_ints(prefix_lens)
    if len(extend) != len(prefix):
        raise TraceError("batch.prefix_lens", f"has {len(prefix)} entries, batch.extend_lens {len(extend)}: one of each per request", path)
    decode = [e == 1 and p > 0 for e, p in zip(extend, prefix)]
    if decode and all(decode):
        return ForwardMode.DECODE
    return ForwardMode.MIXED if any(decode) else ForwardMode.EXTEND


def batch_from_rows(
    *,
    forward_mode: ForwardMode,
    prefix_lens: Tensor | Sequence[int],
    extend_lens: Tensor | Sequence[int],
    rows: Sequence[Tensor],
    out_cache_loc: Tensor,
    positions: Tensor,
    seq_lens_raw: Tensor | Sequence[int],
    kv_cache_size: int,
    query_cols: Tensor | None = None,
) -> Batch:
    """rows[b] holds the slot of each of request b's columns 0..prefix+extend-1 (extra ignored).

    Query tokens sit at the tail of their row (columns prefix..prefix+extend-1) unless
    `query_cols` says otherwise (selective recompute).
    """
    prefix = _i64(prefix_lens)
    extend = _i64(extend_lens)
    kv = prefix + extend
    if len(rows) != kv.numel():
        raise ValueError(f"{len(rows)} KV rows for {kv.numel()} requests")
    used = [_i64(row)[: int(n)] for row, n in zip(rows, kv.tolist())]
    for b, (row, n) in enumerate(zip(used, kv.tolist())):
        if row.numel() != n:
            raise ValueError(f"request {b}: KV row has {row.numel()} slots, needs {n}")
    if query_cols is None:
        query_cols = torch.cat([torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix.tolist(), extend.tolist())]) if kv.numel() else torch.zeros(0, dtype=torch.int64)
    return Batch(
        forward_mode=forward_mode,
        prefix_lens=prefix,
        extend_lens=extend,
        kv_lens=kv,
        slot_indptr=indptr(kv),
        slot_ids=torch.cat(used) if used else torch.zeros(0, dtype=torch.int64),
        query_cols=_i64(query_cols),
        out_cache_loc=_i64(out_cache_loc),
        positions=_i64(positions),
        seq_lens_raw=_i64(seq_lens_raw),
        kv_cache_size=int(kv_cache_size),
    )


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device | str) -> str:
    """'cuda:NVIDIA H100 80GB HBM3' (asked once per device: a flight recorder builds traces after
    a CUDA error, when the device can no longer be asked)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def source(*, engine: str, backend: str, device: torch.device | str, step: int, tp_rank: int = 0, engine_version: str | None = None) -> Source:
    return Source(
        engine=engine,
        engine_version=engine_version or package_version(engine),
        backend=backend,
        device=device_name(device),
        tp_rank=tp_rank,
        step=step,
        attndbg_version=package_version("attndbg"),
    )
