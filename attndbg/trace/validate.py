"""Parse and validate a stored trace dict into `Trace`, or raise one precise `TraceError`.

Every message names the field and the first bad element, says what was expected and what was
found. The batch is checked for consistency (it is the ground truth replay trusts); the recorded
plan is only type-checked, because a wrong plan is evidence the user came to find.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

import torch
from torch import Tensor

from attndbg.trace import offsets
from attndbg.trace.errors import TraceError  # noqa: F401  (defined without torch, re-exported)
from attndbg.trace.offsets import OffsetsFault
from attndbg.trace.validate_merge import read_merge
from attndbg.trace.schema import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    Q_DTYPES,
    AttentionKind,
    Batch,
    CaptureSizes,
    EngineBuffer,
    ForwardMode,
    Graph,
    GraphCapture,
    LayerTensors,
    LseBase,
    MaskLayout,
    Model,
    Plan,
    PlanInfo,
    Source,
    Spec,
    Trace,
)

INDEX_DTYPES = (torch.int32, torch.int64)


# Longer strings are not names an engine records (a 10 MB plan.backend made `show` print 64k lines).
MAX_NAME_LENGTH = 256


class _Reader:
    """Typed access to one section of the stored dict, with field paths for errors."""

    def __init__(self, data: Any, prefix: str):
        if not isinstance(data, dict):
            raise TraceError(prefix, f"expected a dict, found {type(data).__name__}")
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}"

    def raw(self, key: str, optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise TraceError(self.name(key), "missing")
        return self.data[key]

    def int(self, key: str, *, min_value: int | None = None, optional: bool = False, default: int = 0) -> int:
        value = self.raw(key, optional)
        if value is None and optional:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise TraceError(self.name(key), f"expected an int, found {type(value).__name__}")
        if not -(2**63) <= value < 2**63:
            raise TraceError(self.name(key), f"= {reprlib.repr(value)}, does not fit in 64 bits")
        if min_value is not None and value < min_value:
            raise TraceError(self.name(key), f"= {value}, must be >= {min_value}")
        return value

    def float(self, key: str, *, optional: bool = False, default: float = 0.0) -> float:
        value = self.raw(key, optional)
        if value is None and optional:
            return default
        try:
            finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            raise TraceError(self.name(key), f"expected a finite number, found {reprlib.repr(value)}")
        return float(value)

    def bool(self, key: str, optional: bool = False, default: bool = False) -> bool:
        value = self.raw(key, optional)
        if value is None and optional:
            return default
        if not isinstance(value, bool):
            raise TraceError(self.name(key), f"expected a bool, found {type(value).__name__}")
        return value

    def str(self, key: str, choices: tuple[str, ...] | None = None) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise TraceError(self.name(key), f"expected a string, found {type(value).__name__}")
        if len(value) > MAX_NAME_LENGTH or not value.isprintable():
            raise TraceError(self.name(key), f"= {reprlib.repr(value)}: names are at most {MAX_NAME_LENGTH} printable characters")
        if choices is not None and value not in choices:
            raise TraceError(self.name(key), f"= {reprlib.repr(value)}, expected one of {', '.join(choices)}")
        return value

    def enum(self, key: str, kind: type):
        value = self.str(key, tuple(m.value for m in kind))
        return kind(value)

    def tensor(
        self,
        key: str,
        *,
        dtypes: tuple[torch.dtype, ...] | None = None,
        ndim: int | None = None,
        optional: bool = False,
    ) -> Tensor | None:
        value = self.raw(key, optional)
        if value is None:
            if optional:
                return None
            raise TraceError(self.name(key), "missing")
        if not isinstance(value, Tensor):
            raise TraceError(self.name(key), f"expected a tensor, found {type(value).__name__}")
        if dtypes is not None and value.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TraceError(self.name(key), f"dtype {str(value.dtype).replace('torch.', '')}, expected {names}")
        if ndim is not None and value.dim() != ndim:
            raise TraceError(self.name(key), f"has {value.dim()} dims {list(value.shape)}, expected {ndim}")
        return value

    def index(self, key: str, length: int | None = None) -> Tensor:
        """A 1-D integer tensor, returned as int64; checks the length when given."""
        value = self.tensor(key, dtypes=INDEX_DTYPES, ndim=1)
        assert value is not None
        if length is not None and value.numel() != length:
            raise TraceError(self.name(key), f"has {value.numel()} elements, expected {length}")
        return value.to(torch.int64)

    def section(self, key: str, optional: bool = False) -> "_Reader | None":
        value = self.raw(key, optional)
        if value is None:
            if optional:
                return None
            raise TraceError(self.name(key), "is None, expected a dict")
        return _Reader(value, self.name(key))


def _first_bad(mask: Tensor) -> int:
    return int(torch.nonzero(mask)[0, 0]) if mask.any() else -1


def _check_nonneg(name: str, values: Tensor) -> None:
    bad = _first_bad(values < 0)
    if bad >= 0:
        raise TraceError(f"{name}[{bad}]", f"= {int(values[bad])}, must be >= 0")


def check_indptr(name: str, indptr: Tensor, total: int | None = None) -> None:
    """indptr keeps the offsets rule (trace/offsets.py) and ends at `total` when given."""
    bad = offsets.broken(indptr)
    if bad is not None and bad.fault is OffsetsFault.SHAPE:
        raise TraceError(name, "is empty, expected at least [0]" if indptr.numel() == 0 else f"has shape {list(indptr.shape)}, expected one dimension")
    if bad is not None and bad.fault is OffsetsFault.START:
        raise TraceError(f"{name}[0]", f"= {int(indptr[0])}, indptr must start at 0")
    if bad is not None:
        i = bad.at
        raise TraceError(f"{name}[{i}]", f"= {int(indptr[i])} < {name}[{i - 1}] = {int(indptr[i - 1])}: indptr must not decrease")
    if total is not None and int(indptr[-1]) != total:
        raise TraceError(f"{name}[-1]", f"= {int(indptr[-1])}, expected {total} (the length it indexes)")


def _source(r: _Reader) -> Source:
    return Source(
        engine=r.str("engine"),
        engine_version=r.str("engine_version"),
        backend=r.str("backend"),
        device=r.str("device"),
        tp_rank=r.int("tp_rank", min_value=0),
        step=r.int("step", min_value=0),
        attndbg_version=r.str("attndbg_version"),
        inferred=_inferred(r),
        crash=_crash(r),
    )


def _crash(r: _Reader) -> str | None:
    """source.crash (optional): the error the step's call ended in where it ran, a printable string."""
    value = r.raw("crash", optional=True)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_INFERRED_TEXT or not value.isprintable():
        raise TraceError(r.name("crash"), f"= {reprlib.repr(value)}: expected the logged error, a printable string of at most {MAX_INFERRED_TEXT} characters")
    return value


# An importer names a handful of inferred fields; thousands is not a step's, it is a hostile file.
MAX_INFERRED = 64
MAX_INFERRED_TEXT = 1024


def _inferred(r: _Reader) -> dict[str, str]:
    """source.inferred (optional): field name -> how it was inferred, both short printable strings."""
    value = r.raw("inferred", optional=True)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TraceError(r.name("inferred"), f"expected a dict of field -> how it was inferred, found {type(value).__name__}")
    if len(value) > MAX_INFERRED:
        raise TraceError(r.name("inferred"), f"has {len(value)} entries, at most {MAX_INFERRED}")
    for key, why in value.items():
        if not isinstance(key, str) or len(key) > MAX_NAME_LENGTH or not key.isprintable():
            raise TraceError(f"{r.name('inferred')}[{reprlib.repr(key)}]", f"keys are field names of at most {MAX_NAME_LENGTH} printable characters")
        if not isinstance(why, str) or len(why) > MAX_INFERRED_TEXT or not why.isprintable():
            raise TraceError(f"{r.name('inferred')}[{key!r}]", f"= {reprlib.repr(why)}: expected a printable string of at most {MAX_INFERRED_TEXT} characters")
    return dict(value)


def _model(r: _Reader) -> Model:
    model = Model(
        num_qo_heads=r.int("num_qo_heads", min_value=1),
        num_kv_heads=r.int("num_kv_heads", min_value=1),
        head_dim=r.int("head_dim", min_value=1),
        v_head_dim=r.int("v_head_dim", min_value=1),
        attention=r.enum("attention", AttentionKind),
        kv_lora_rank=r.int("kv_lora_rank", min_value=0),
        qk_rope_head_dim=r.int("qk_rope_head_dim", min_value=0),
        sm_scale=r.float("sm_scale"),
        logit_cap=r.float("logit_cap"),
        sliding_window=r.int("sliding_window", min_value=-1),
        q_dtype=r.str("q_dtype", Q_DTYPES),
        kv_dtype=r.str("kv_dtype", tuple(DTYPES)),
        page_size=r.int("page_size", min_value=1),
        causal=r.bool("causal", optional=True, default=True),
        window_right=r.int("window_right", min_value=-1, optional=True, default=-1),
        sinks=_sinks(r),
        k_scale=r.float("k_scale", optional=True, default=1.0),
        v_scale=r.float("v_scale", optional=True, default=1.0),
    )
    if model.window_right >= 0 and model.causal:
        raise TraceError("model.window_right", f"= {model.window_right}, but model.causal is true: a causal query sees no key to its right (a right window needs causal = false)")
    for name in ("k_scale", "v_scale"):
        value = getattr(model, name)
        if value <= 0:
            raise TraceError(f"model.{name}", f"= {value}, must be > 0")
        if value != 1.0 and not model.kv_dtype.startswith("float8"):
            raise TraceError(f"model.{name}", f"= {value}, but the KV cache is {model.kv_dtype}: engines scale only an fp8 KV cache (1.0 otherwise)")
    if model.sinks is not None and model.sinks.numel() != model.num_qo_heads:
        raise TraceError("model.sinks", f"has {model.sinks.numel()} elements, expected one per query head ({model.num_qo_heads})")
    if model.num_qo_heads % model.num_kv_heads:
        raise TraceError(
            "model.num_qo_heads",
            f"= {model.num_qo_heads} is not a multiple of num_kv_heads = {model.num_kv_heads}",
        )
    if model.sm_scale <= 0:
        raise TraceError("model.sm_scale", f"= {model.sm_scale}, must be > 0")
    if model.logit_cap < 0:
        raise TraceError("model.logit_cap", f"= {model.logit_cap}, must be >= 0 (0 = off)")
    if model.attention is AttentionKind.MLA:
        if model.num_kv_heads != 1:
            raise TraceError("model.num_kv_heads", f"= {model.num_kv_heads}, MLA has one latent KV head")
        if model.head_dim != model.kv_lora_rank + model.qk_rope_head_dim:
            raise TraceError(
                "model.head_dim",
                f"= {model.head_dim}, MLA keys are kv_lora_rank + qk_rope_head_dim = "
                f"{model.kv_lora_rank + model.qk_rope_head_dim}",
            )
        if model.v_head_dim != model.kv_lora_rank:
            raise TraceError("model.v_head_dim", f"= {model.v_head_dim}, MLA values are the {model.kv_lora_rank}-wide latent")
    return model


def _sinks(r: _Reader) -> Tensor | None:
    """model.sinks (optional): a 1-D float32 tensor of finite logits (its length is checked with the heads)."""
    sinks = r.tensor("sinks", dtypes=(torch.float32,), ndim=1, optional=True)
    if sinks is not None:
        bad = _first_bad(~torch.isfinite(sinks))
        if bad >= 0:
            raise TraceError(f"model.sinks[{bad}]", f"= {float(sinks[bad])}, expected a finite logit")
    return sinks


def _batch(r: _Reader, model: Model) -> Batch:
    mode = r.enum("forward_mode", ForwardMode)
    prefix = r.index("prefix_lens")
    bs = prefix.numel()
    extend = r.index("extend_lens", bs)
    kv = r.index("kv_lens", bs)
    for name, values in (("prefix_lens", prefix), ("extend_lens", extend), ("kv_lens", kv)):
        _check_nonneg(r.name(name), values)
    cross = r.bool("cross", optional=True)
    if cross:
        # Cross-attention: every KV column is the encoder's, cached before the step.
        bad = _first_bad(kv != prefix)
        if bad >= 0:
            raise TraceError(f"batch.kv_lens[{bad}]", f"= {int(kv[bad])}, expected prefix_lens = {int(prefix[bad])}: a cross-attention row is all cached encoder KV")
    bad = -1 if cross else _first_bad(kv != prefix + extend)
    if bad >= 0:
        raise TraceError(
            f"batch.kv_lens[{bad}]",
            f"= {int(kv[bad])}, expected prefix_lens + extend_lens = {int(prefix[bad])} + {int(extend[bad])}",
        )
    cache_size = r.int("kv_cache_size", min_value=1)
    if cache_size % model.page_size:
        raise TraceError("batch.kv_cache_size", f"= {cache_size} is not a multiple of page_size {model.page_size}")
    slot_indptr = r.index("slot_indptr", bs + 1)
    slot_ids = r.index("slot_ids")
    check_indptr("batch.slot_indptr", slot_indptr, slot_ids.numel())
    bad = _first_bad(slot_indptr[1:] - slot_indptr[:-1] != kv)
    if bad >= 0:
        raise TraceError(
            f"batch.slot_indptr[{bad + 1}]",
            f"request {bad} has {int(slot_indptr[bad + 1] - slot_indptr[bad])} slot ids, expected kv_lens = {int(kv[bad])}",
        )
    bad = _first_bad((slot_ids < 0) | (slot_ids >= cache_size))
    if bad >= 0:
        raise TraceError(
            f"batch.slot_ids[{bad}]", f"= {int(slot_ids[bad])} is outside the KV cache [0, {cache_size})"
        )
    if model.page_size > 1:
        _check_pages(slot_indptr, slot_ids, model.page_size)

    num_tokens = int(extend.sum())
    query_cols = r.index("query_cols", num_tokens)
    out_cache_loc = r.index("out_cache_loc", num_tokens)
    positions = r.index("positions", num_tokens)
    seq_lens_raw = r.index("seq_lens_raw", bs)
    selective = r.bool("selective", optional=True)
    if cross and selective:
        raise TraceError("batch.cross", "is true, but the step is a selective recompute: a cross-attention query recomputes no column of its row")
    custom_mask = r.tensor("custom_mask", dtypes=(torch.bool,), ndim=1, optional=True)
    if custom_mask is not None:
        need = int((extend * kv).sum())
        if custom_mask.numel() != need:
            raise TraceError("batch.custom_mask", f"has {custom_mask.numel()} elements, expected sum(extend_lens * kv_lens) = {need} (a [extend_len, kv_len] block per request)")
        if selective:
            raise TraceError("batch.custom_mask", "is given on a selective recompute, whose columns already say what each query sees")
    batch = Batch(
        forward_mode=mode,
        prefix_lens=prefix,
        extend_lens=extend,
        kv_lens=kv,
        slot_indptr=slot_indptr,
        slot_ids=slot_ids,
        query_cols=query_cols,
        out_cache_loc=out_cache_loc,
        positions=positions,
        seq_lens_raw=seq_lens_raw,
        kv_cache_size=cache_size,
        selective=selective,
        cross=cross,
        custom_mask=custom_mask,
    )
    _check_query_cols(batch)
    if mode is ForwardMode.DECODE:
        bad = _first_bad(extend != 1)
        if bad >= 0:
            raise TraceError(f"batch.extend_lens[{bad}]", f"= {int(extend[bad])}, a DECODE step has 1 token per request")
    return batch


def _check_pages(slot_indptr: Tensor, slot_ids: Tensor, page_size: int) -> None:
    """With paging, column j of a row lives at offset j % page_size of its page."""
    starts = slot_indptr[:-1]
    lens = slot_indptr[1:] - starts
    cols = torch.arange(slot_ids.numel()) - torch.repeat_interleave(starts, lens)
    bad = _first_bad(slot_ids % page_size != cols % page_size)
    if bad >= 0:
        raise TraceError(
            f"batch.slot_ids[{bad}]",
            f"= {int(slot_ids[bad])} sits at page offset {int(slot_ids[bad]) % page_size}, but its column "
            f"{int(cols[bad])} needs offset {int(cols[bad]) % page_size} (page_size {page_size})",
        )
    # Consecutive columns inside one page must stay in the same page.
    same_page_col = (cols % page_size != 0) & (cols > 0)
    prev = torch.roll(slot_ids, 1)
    bad = _first_bad(same_page_col & (slot_ids // page_size != prev // page_size))
    if bad >= 0:
        raise TraceError(
            f"batch.slot_ids[{bad}]",
            f"= {int(slot_ids[bad])} is in page {int(slot_ids[bad]) // page_size}, but column {int(cols[bad])} "
            f"continues page {int(prev[bad]) // page_size} of the previous column",
        )


def _check_query_cols(batch: Batch) -> None:
    """Query columns lie in the row, increase, and their slots are where the new K/V go."""
    qo = batch.qo_indptr
    req_of_token = torch.repeat_interleave(torch.arange(batch.batch_size), batch.extend_lens)
    cols = batch.query_cols
    kv_of_token = batch.kv_lens[req_of_token]
    if batch.cross:
        _check_cross_queries(batch, req_of_token)
        return
    bad = _first_bad((cols < 0) | (cols >= kv_of_token))
    if bad >= 0:
        raise TraceError(
            f"batch.query_cols[{bad}]",
            f"= {int(cols[bad])} is outside request {int(req_of_token[bad])}'s row [0, {int(kv_of_token[bad])})",
        )
    if batch.selective:
        first_in_req = torch.zeros_like(cols, dtype=torch.bool)
        first_in_req[qo[:-1][batch.extend_lens > 0]] = True
        prev = torch.roll(cols, 1)
        bad = _first_bad(~first_in_req & (cols <= prev))
        if bad >= 0:
            raise TraceError(f"batch.query_cols[{bad}]", f"= {int(cols[bad])}, query columns must increase within a request")
    else:
        # Everything but selective recompute queries the row's tail: prefix + i.
        expected = batch.prefix_lens[req_of_token] + (torch.arange(cols.numel()) - qo[req_of_token])
        bad = _first_bad(cols != expected)
        if bad >= 0:
            raise TraceError(
                f"batch.query_cols[{bad}]", f"= {int(cols[bad])}, expected prefix + token index = {int(expected[bad])}"
            )
    expected_loc = batch.slot_ids[batch.slot_indptr[req_of_token] + cols]
    bad = _first_bad(batch.out_cache_loc != expected_loc)
    if bad >= 0:
        raise TraceError(
            f"batch.out_cache_loc[{bad}]",
            f"= {int(batch.out_cache_loc[bad])}, but the token's column {int(cols[bad])} maps to slot {int(expected_loc[bad])}",
        )


def _check_cross_queries(batch: Batch, req_of_token: Tensor) -> None:
    """A cross-attention query sits bottom-right aligned (kv_len - q_len + i) and writes nothing (-1)."""
    within = torch.arange(batch.num_tokens) - batch.qo_indptr[req_of_token]
    expected = batch.kv_lens[req_of_token] - batch.extend_lens[req_of_token] + within
    bad = _first_bad(batch.query_cols != expected)
    if bad >= 0:
        raise TraceError(
            f"batch.query_cols[{bad}]",
            f"= {int(batch.query_cols[bad])}, expected kv_len - q_len + token index = {int(expected[bad])} (cross-attention queries are aligned bottom-right)",
        )
    bad = _first_bad(batch.out_cache_loc != -1)
    if bad >= 0:
        raise TraceError(f"batch.out_cache_loc[{bad}]", f"= {int(batch.out_cache_loc[bad])}, expected -1: a cross-attention step writes no K/V (the encoder's are cached)")


def _spec(r: _Reader, batch: Batch) -> Spec:
    n = r.int("draft_token_num", min_value=1)
    parents = r.tensor("parents", dtypes=INDEX_DTYPES, ndim=2)
    assert parents is not None
    if tuple(parents.shape) != (batch.batch_size, n):
        raise TraceError("spec.parents", f"shape {list(parents.shape)}, expected [{batch.batch_size}, {n}]")
    parents = parents.to(torch.int64)
    for b in range(batch.batch_size):
        if int(parents[b, 0]) != -1:
            raise TraceError(f"spec.parents[{b}, 0]", f"= {int(parents[b, 0])}, the root's parent must be -1")
        bad = _first_bad((parents[b, 1:] < 0) | (parents[b, 1:] >= torch.arange(1, n)))
        if bad >= 0:
            raise TraceError(
                f"spec.parents[{b}, {bad + 1}]",
                f"= {int(parents[b, bad + 1])}, a draft token's parent must come before it (in [0, {bad + 1}))",
            )
    if batch.forward_mode is ForwardMode.TARGET_VERIFY:
        bad = _first_bad(batch.extend_lens != n)
        if bad >= 0:
            raise TraceError(
                f"batch.extend_lens[{bad}]", f"= {int(batch.extend_lens[bad])}, a verify step has draft_token_num = {n}"
            )
    mask = r.tensor("custom_mask", ndim=1, optional=True)
    return Spec(
        algorithm=r.str("algorithm"),
        draft_token_num=n,
        topk=r.int("topk", min_value=1),
        steps=r.int("steps", min_value=1),
        parents=parents,
        custom_mask=mask,
        mask_layout=r.enum("mask_layout", MaskLayout),
    )


def _graph(r: _Reader) -> Graph:
    capture_bs = r.int("capture_bs", min_value=0)
    # None: the engine has no request pool (vLLM). The key itself must be there (r.raw raises
    # without it): a dict that lost it is damaged, not an engine without a pool.
    pool = r.raw("padded_req_pool_indices")
    qo = r.tensor("padded_qo_indptr", dtypes=INDEX_DTYPES, ndim=1, optional=True)
    if qo is not None and qo.numel() != capture_bs + 1:
        raise TraceError(r.name("padded_qo_indptr"), f"has {qo.numel()} elements, expected capture_bs + 1 = {capture_bs + 1}")
    table = r.tensor("padded_block_table", dtypes=INDEX_DTYPES, ndim=2, optional=True)
    if table is not None and table.shape[0] != capture_bs:
        raise TraceError(r.name("padded_block_table"), f"has {table.shape[0]} rows {list(table.shape)}, expected capture_bs = {capture_bs}")
    return Graph(
        is_graph_replay=r.bool("is_graph_replay"),
        capture_bs=capture_bs,
        fill_value=r.int("fill_value"),
        padded_seq_lens=r.index("padded_seq_lens"),
        padded_req_pool_indices=r.index("padded_req_pool_indices") if pool is not None else None,
        padded_out_cache_loc=r.index("padded_out_cache_loc"),
        padded_positions=r.index("padded_positions"),
        # Values are evidence (a decreasing padded tail, a -1 block): only their shape is checked.
        padded_qo_indptr=qo.to(torch.int64) if qo is not None else None,
        padded_block_table=table.to(torch.int64) if table is not None else None,
        captured=r.enum("captured", GraphCapture) if r.raw("captured", optional=True) is not None else None,
    )


# No device holds 2**48 elements or bytes of one buffer: a capture size past it is not an engine's.
MAX_CAPTURE_SIZE = 1 << 48


def _capture(r: _Reader) -> CaptureSizes:
    """Each size is a non-negative int, or None when the engine gave none."""
    sizes: dict[str, int | None] = {}
    for name in CaptureSizes.__dataclass_fields__:
        value = r.int(name, min_value=0) if r.raw(name, optional=True) is not None else None
        if value is not None and value >= MAX_CAPTURE_SIZE:
            raise TraceError(r.name(name), f"= {value}, past any device's buffer (at most {MAX_CAPTURE_SIZE - 1})")
        sizes[name] = value
    for name in r.data:
        if name not in sizes:
            raise TraceError(f"{r.prefix}[{reprlib.repr(name)}]", f"is not a capture size (expected one of {', '.join(sizes)})")
    return CaptureSizes(**sizes)


def _plan(r: _Reader) -> Plan:
    tensors = r.raw("tensors")
    scalars = r.raw("scalars")
    if not isinstance(tensors, dict) or not all(isinstance(v, Tensor) for v in tensors.values()):
        raise TraceError("plan.tensors", "expected a dict of name -> tensor")
    if not isinstance(scalars, dict) or not all(isinstance(v, (int, float, bool, str)) for v in scalars.values()):
        raise TraceError("plan.scalars", "expected a dict of name -> int/float/bool/str")
    for name, value in scalars.items():
        # A wrong value is evidence; one no engine could have recorded (past 64 bits, a huge string) is not.
        if isinstance(value, float) and not math.isfinite(value):
            raise TraceError(f"plan.scalars.{name}", f"= {value}, expected a finite number")
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise TraceError(f"plan.scalars.{name}", f"= {reprlib.repr(value)}, does not fit in 64 bits")
        if isinstance(value, str) and len(value) > MAX_NAME_LENGTH:
            raise TraceError(f"plan.scalars.{name}", f"is a string of {len(value)} characters (at most {MAX_NAME_LENGTH})")
    info = r.data.get("plan_info")
    return Plan(backend=r.str("backend"), tensors=dict(tensors), scalars=dict(scalars), plan_info=None if info is None else _plan_info(_Reader(info, "plan.plan_info")))


# A plan-info vector is a few dozen entries (FlashInfer's: 10 or 15); its workspace head at most the
# library's int workspace (FlashInfer's is 8 MiB). Their values are read in attndbg/plans.
MAX_PLAN_INFO_ENTRIES = 64
MAX_PLAN_INFO_BYTES = 8 * 1024 * 1024


def _plan_info(r: _Reader) -> PlanInfo:
    vector, workspace = r.raw("vector"), r.raw("workspace")
    if not isinstance(vector, Tensor) or vector.dtype is not torch.int64 or vector.dim() != 1 or vector.numel() > MAX_PLAN_INFO_ENTRIES:
        raise TraceError(r.name("vector"), f"expected a 1-D int64 tensor of at most {MAX_PLAN_INFO_ENTRIES} entries, found {_described(vector)}")
    if not isinstance(workspace, Tensor) or workspace.dtype is not torch.uint8 or workspace.dim() != 1 or workspace.numel() > MAX_PLAN_INFO_BYTES:
        raise TraceError(r.name("workspace"), f"expected a 1-D uint8 tensor of at most {MAX_PLAN_INFO_BYTES} bytes, found {_described(workspace)}")
    for key in r.data:
        if key not in ("vector", "workspace"):
            raise TraceError(f"{r.prefix}[{reprlib.repr(key)}]", "is not a plan-info field (expected vector, workspace)")
    return PlanInfo(vector=vector, workspace=workspace)


def _described(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _layer_tensors(r: _Reader, model: Model, batch: Batch) -> LayerTensors:
    float_types = tuple(DTYPES.values())
    t = batch.num_tokens

    def shaped(key: str, shape: tuple[int, ...], optional: bool = False) -> Tensor | None:
        value = r.tensor(key, dtypes=float_types, optional=optional)
        if value is not None and tuple(value.shape) != shape:
            raise TraceError(r.name(key), f"shape {list(value.shape)}, expected {list(shape)}")
        return value

    kv_slots = r.index("kv_slots")
    rows = kv_slots.numel()
    v_cols = 0 if model.attention is AttentionKind.MLA else model.v_head_dim
    bad = _first_bad((kv_slots < 0) | (kv_slots >= batch.kv_cache_size))
    if bad >= 0:
        raise TraceError(r.name(f"kv_slots[{bad}]"), f"= {int(kv_slots[bad])} is outside the KV cache")
    return LayerTensors(
        q=shaped("q", (t, model.num_qo_heads, model.head_dim)),
        k_new=shaped("k_new", (t, model.num_kv_heads, model.head_dim)),
        v_new=shaped("v_new", (t, model.num_kv_heads, v_cols)),
        kv_slots=kv_slots,
        k_rows=shaped("k_rows", (rows, model.num_kv_heads, model.head_dim)),
        v_rows=shaped("v_rows", (rows, model.num_kv_heads, v_cols)),
        output=shaped("output", (t, model.num_qo_heads, model.v_head_dim), optional=True),
        lse=shaped("lse", (t, model.num_qo_heads), optional=True),
        lse_base=r.enum("lse_base", LseBase),
    )


def from_dict(data: Any) -> Trace:
    """Validate the storage form and build a `Trace`; raises `TraceError` on the first problem."""
    top = _Reader(data, "trace")
    if data.get("format") != FORMAT_NAME:
        raise TraceError("format", f"= {data.get('format')!r}, not an attndbg trace (expected {FORMAT_NAME!r})")
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise TraceError("version", f"= {version!r}, this attndbg reads trace version {FORMAT_VERSION}")
    source = _source(_section(top, "source"))
    model = _model(_section(top, "model"))
    batch = _batch(_section(top, "batch"), model)
    seed = top.int("seed", min_value=0)
    spec_r = _section(top, "spec", optional=True)
    graph_r = _section(top, "graph", optional=True)
    plan_r = _section(top, "plan", optional=True)
    tensors_raw = top.raw("tensors", optional=True) or {}
    if not isinstance(tensors_raw, dict):
        raise TraceError("tensors", f"expected a dict of layer -> tensors, found {type(tensors_raw).__name__}")
    tensors = {}
    for layer, section in tensors_raw.items():
        # A layer number, stored as an int or its digits; a 5,000-digit one is not converted (Python refuses).
        if isinstance(layer, bool) or not (isinstance(layer, int) and 0 <= layer < 2**31 or isinstance(layer, str) and layer.isascii() and layer.isdigit() and len(layer) < 10):
            raise TraceError(f"tensors[{reprlib.repr(layer)}]", "layer keys must be layer numbers")
        tensors[int(layer)] = _layer_tensors(_Reader(section, f"tensors.{layer}"), model, batch)
    if batch.forward_mode is ForwardMode.TARGET_VERIFY and spec_r is None:
        raise TraceError("spec", "missing: a TARGET_VERIFY step needs its draft tree")
    if batch.forward_mode is ForwardMode.TARGET_VERIFY:
        # A verify step attends by its draft tree (spec), which says everything a query sees.
        for name, set_ in (("model.causal", not model.causal), ("batch.cross", batch.cross), ("batch.custom_mask", batch.custom_mask is not None)):
            if set_:
                raise TraceError(name, "is set on a TARGET_VERIFY step, whose draft tree (spec) decides what each query sees")
    spec = _spec(spec_r, batch) if spec_r else None
    plan = _plan(plan_r) if plan_r else None
    buffers_r = _section(top, "buffers", optional=True)
    capture_r = _section(top, "capture", optional=True)
    merge_r = _section(top, "merge", optional=True)
    return Trace(
        source=source,
        model=model,
        batch=batch,
        seed=seed,
        spec=spec,
        graph=_graph(graph_r) if graph_r else None,
        plan=plan,
        tensors=tensors,
        buffers=_buffers(buffers_r, spec, plan) if buffers_r else {},
        capture=_capture(capture_r) if capture_r is not None else None,
        merge=read_merge(merge_r, model, batch) if merge_r is not None else None,
    )


def _buffers(r: _Reader, spec: Spec | None, plan: Plan | None) -> dict[str, EngineBuffer]:
    """Each entry describes a recorded tensor: `spec.custom_mask` or `plan.<name>`, which must exist
    and be no longer than the buffer it was cut from. A `read` past the buffer loads: it is evidence
    (the kernel reads past the end) for the detectors."""
    recorded: dict[str, Tensor | None] = {"spec.custom_mask": spec.custom_mask if spec is not None else None}
    if plan is not None:
        recorded.update({f"plan.{name}": t for name, t in plan.tensors.items()})
    out = {}
    for key in r.data:
        if not isinstance(key, str) or recorded.get(key) is None:
            raise TraceError(f"buffers[{reprlib.repr(key)}]", "names no recorded tensor (expected spec.custom_mask or plan.<tensor name>)")
        entry = _Reader(r.data[key], f"buffers[{key!r}]")
        buffer = EngineBuffer(length=entry.int("length", min_value=0), read=entry.int("read", min_value=-1), capacity=entry.bool("capacity"))
        kept = recorded[key].numel()
        if kept > buffer.length:
            raise TraceError(f"buffers[{key!r}].length", f"= {buffer.length}, but {key} records {kept} elements of it")
        if not buffer.capacity and kept != buffer.length:
            raise TraceError(f"buffers[{key!r}].length", f"= {buffer.length}, but {key} records {kept}: a buffer sized for the step is recorded whole")
        out[key] = buffer
    return out


def _section(top: _Reader, key: str, optional: bool = False) -> _Reader | None:
    reader = top.section(key, optional)
    if reader is not None:
        reader.prefix = key  # fields read as "batch.kv_lens", not "trace.batch.kv_lens"
    return reader
