"""The plan SGLang's live attention backend built, read by the backend's own field names.

Readers dispatch on the metadata's fields, not on class names (SGLang renames and subclasses its
backends between versions):

  Triton      ForwardMetadata: kv_indptr, kv_indices, num_kv_splits | qo_indptr, custom_mask,
              mask_indptr, max_extend_len; window_kv_* -> our `triton` plan names (identical)
  FA3         FlashAttentionMetadata: cache_seqlens_int32, cu_seqlens_q/k, page_table, max_seq_len_q/k
              -> `fa3` names (cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table, max_seqlen_q/k);
              a tree verify's second call (`forward_metadata_spec_decode_expand`) -> expand_*;
              a sliding-window layer's tree verify (`swa_spec_metadata`) -> swa_*
  FlashMLA    FlashMLADecodeMetadata: block_kv_indices, num_splits -> `mla` (impl flashmla): block_table
  trtllm_mla  TRTLLMMLADecodeMetadata (decode, verify, draft extend): block_kv_indices, seq_lens_k,
              max_seq_len_k; a draft extend's cu_seqlens_q, seq_lens_q, max_seq_len_q -> `mla`
              (impl trtllm), same names; at a graph replay the captured bs's metadata
              (`decode_cuda_graph_metadata[bs]`, refilled in place). Its plain extend runs a ragged
              MHA-form prefill (TRTLLMMLAPrefillMetadata) or FlashInfer MLA's: not read
  FlashInfer  DecodeMetadata / PrefillMetadata: wrappers whose planned buffers hold the indices
              (FlashInfer's `_paged_kv_*_buf`, `_qo_indptr_buf`) and a verify step's mask as
              FlashInfer packed it (`_custom_mask_buf`, `_mask_indptr_buf`) -> `flashinfer` names,
              the mask as `packed_custom_mask` / `packed_mask_indptr`; the wrapper's own schedule
              (`_plan_info` and the pinned int workspace it indexes) -> `Plan.plan_info`

Each plan carries the scalars its adapter's plan declares (backends/*.py), so the checker reads it
as written. Those the engine keeps on the object are read there (FA3's max_seq_len_q/k, the
backend's page_size and topk, a FlashInfer decode wrapper's `_use_tensor_cores`). The rest SGLang
passes its kernels at every layer's call, from the RadixAttention layer and the step, and keeps on
no object: they are derived in one place, `_call_arguments`, from the recorded Model.

Under a CUDA-graph replay SGLang does not rebuild `forward_metadata` (both the classic
`init_forward_metadata_replay_cuda_graph` and SGL-new's `init_forward_metadata_out_graph` refill
the captured buffers in place and keep the capture-time object, which may describe another batch
size). The Triton reader therefore reads the graph buffers themselves (`kv_indptr[:bs+1]`,
`cuda_graph_kv_indices`, `cuda_graph_num_kv_splits[:bs]`, ...) when it is told the padded bs.

Sliding-window layers (SGLang's Triton SWA path) read their own list: `window_kv_indptr`,
`window_kv_indices`, `window_kv_offsets` (each request's first window column: where its mask rows
start) and, for decode, `window_num_kv_splits`; they are recorded under those names when built.

What is recorded of an index or mask buffer depends on how the engine sized it (`Trace.buffers`):
- sized for this step from a host sum (Triton's eager `kv_indices = torch.empty(seq_lens_sum)`,
  `window_kv_indices = torch.empty(window_kv_indptr[-1])`, a mask `build_tree_kernel_efficient`
  allocated): recorded whole, so a length that disagrees with its indptr is evidence;
- a capacity buffer (CUDA-graph buffers, SGL-new's VerifyMask, an allocation that over-sizes by
  design when the host sum is unknown): cut at the end of its indptr, the elements the kernel
  reads; the rest no kernel of this step reads, and can be hundreds of MB.

Capture never syncs: the indptr's last entry is on the device, so the exact cut happens on the host
in `plan_from_host`. A graph buffer is first cut on the device (`cut_on_device`) at what the step's
padded seq_lens, known on the host, make its kernel read, so that only that part is copied: the
same elements the host cut keeps, unless the engine's device indptr reads past its own host
seq_lens (then the indptr, recorded whole, is judged by invariants, and `read` says how far it goes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from attndbg.backends.flashinfer_plan_info import wrapper_plan_info
from attndbg.trace.schema import EngineBuffer, Model, Plan, PlanInfo

Scalars = dict[str, int | float | bool | str]


@dataclass
class PlanCapture:
    """A plan on its way to the host: device tensors plus host scalars."""

    backend: str
    tensors: dict[str, Tensor | None]
    scalars: Scalars = field(default_factory=dict)
    # tensor name -> the indptr whose last entry is the number of elements the kernel reads
    trim: dict[str, str] = field(default_factory=dict)
    # tensors of `trim` that are capacity buffers (cut at their indptr's end); the others are whole
    capacity: set[str] = field(default_factory=set)
    # the engine buffer's real length, for a tensor already cut on the device (`cut_on_device`)
    length: dict[str, int] = field(default_factory=dict)
    # the library's own schedule, copied on the host when the plan was read (FlashInfer's wrapper
    # keeps it in a pinned host buffer the next plan() overwrites: nothing to copy from the device)
    plan_info: PlanInfo | None = None


def cut_on_device(capture: PlanCapture, reads: dict[str, int]) -> None:
    """Slice each capacity buffer of `capture` to `reads[name]` elements (what the step's kernel
    reads, from host facts) before it is copied, remembering the buffer's real length."""
    for name, read in reads.items():
        tensor = capture.tensors.get(name)
        if name not in capture.capacity or tensor is None or not 0 <= read < tensor.numel():
            continue
        capture.length.setdefault(name, tensor.numel())
        capture.tensors[name] = tensor[:read]


def _has(obj: Any, *names: str) -> bool:
    return all(hasattr(obj, n) for n in names)


def _window(backend: Any) -> int:
    window = getattr(backend, "sliding_window_size", None)
    return int(window) if isinstance(window, int) and window > 0 else -1


def _triton_extend_scalars(backend: Any, max_extend_len: Any) -> Scalars:
    # SGLang's Triton forward_extend: causal unless cross/encoder attention, prefix columns of a
    # custom mask skipped (skip_prefix_custom_mask defaults to True there).
    return {
        "max_extend_len": int(max_extend_len) if max_extend_len is not None else 0,
        "is_causal": True,
        "skip_prefix_custom_mask": True,
        "sliding_window": _window(backend),
    }


def _max_kv_splits(backend: Any, md: Any) -> int:
    """The stage-1 scratch width: the backend's setting, else attn_logits' split dimension."""
    value = getattr(backend, "max_kv_splits", None)
    if isinstance(value, int):
        return value
    return int(md.attn_logits.shape[2])  # [bs, heads, max_kv_splits, v_head_dim]


def _window_eager(md: Any, tensors: dict[str, Tensor | None], trim: dict[str, str]) -> None:
    """The SWA layers' list, when the backend built one (sliding_window_size > 0)."""
    if getattr(md, "window_kv_indices", None) is None or getattr(md, "window_kv_indptr", None) is None:
        return
    tensors["window_kv_indptr"] = md.window_kv_indptr
    tensors["window_kv_indices"] = md.window_kv_indices
    trim["window_kv_indices"] = "window_kv_indptr"
    for name in ("window_kv_offsets", "window_num_kv_splits"):
        if getattr(md, name, None) is not None:
            tensors[name] = getattr(md, name)


def is_verify_mask(backend: Any, mask: Tensor | None) -> bool:
    """`mask` is the backend's VerifyMask buffer (SGL-new hands that very tensor to spec_info)."""
    verify_mask = getattr(backend, "verify_mask", None)
    buffer = getattr(verify_mask, "buffer", None)
    return mask is not None and isinstance(buffer, Tensor) and buffer.numel() > 0 and mask.data_ptr() == buffer.data_ptr()


def _triton_eager(backend: Any, md: Any, sized: bool) -> PlanCapture:
    """`sized`: the engine sized kv_indices from a host sum for this step (seq_lens_sum,
    extend_prefix_lens_cpu); else it over-allocates by design and the buffer is a capacity one."""
    capacity = set() if sized else {"kv_indices"}
    if md.num_kv_splits is not None:
        tensors = {"kv_indptr": md.kv_indptr, "kv_indices": md.kv_indices, "num_kv_splits": md.num_kv_splits}
        trim = {"kv_indices": "kv_indptr"}
        _window_eager(md, tensors, trim)
        return PlanCapture("triton", tensors, {"max_kv_splits": _max_kv_splits(backend, md)}, trim, capacity)
    tensors = {"qo_indptr": md.qo_indptr, "kv_indptr": md.kv_indptr, "kv_indices": md.kv_indices}
    trim = {"kv_indices": "kv_indptr"}
    if md.custom_mask is not None:
        tensors["custom_mask"] = md.custom_mask
        tensors["mask_indptr"] = md.mask_indptr
        trim["custom_mask"] = "mask_indptr"
        if is_verify_mask(backend, md.custom_mask):
            capacity.add("custom_mask")
    _window_eager(md, tensors, trim)
    return PlanCapture("triton", tensors, _triton_extend_scalars(backend, md.max_extend_len), trim, capacity)


def _triton_graph(backend: Any, bs: int, verify: bool, spec_info: Any, *, draft_extend: bool = False) -> PlanCapture:
    """The Triton backend's CUDA-graph buffers after a replay refill, for padded batch size bs.
    A draft extend's replay refills qo_indptr and the prefix lists; its kernels keep the
    max_extend_len of the metadata built at capture (the backend's forward_metadata)."""
    tensors: dict[str, Tensor | None] = {"kv_indptr": backend.kv_indptr[: bs + 1], "kv_indices": backend.cuda_graph_kv_indices}
    trim = {"kv_indices": "kv_indptr"}
    window = isinstance(getattr(backend, "sliding_window_size", None), int) and backend.sliding_window_size > 0
    if window and getattr(backend, "cuda_graph_window_kv_indices", None) is not None:
        tensors["window_kv_indptr"] = backend.window_kv_indptr[: bs + 1]
        tensors["window_kv_indices"] = backend.cuda_graph_window_kv_indices
        trim["window_kv_indices"] = "window_kv_indptr"
        offsets = getattr(backend, "cuda_graph_window_kv_offsets", None)
        if verify and offsets is not None:
            tensors["window_kv_offsets"] = offsets[:bs]
    if not verify and not draft_extend:
        tensors["num_kv_splits"] = backend.cuda_graph_num_kv_splits[:bs]
        if "window_kv_indptr" in tensors and getattr(backend, "cuda_graph_window_num_kv_splits", None) is not None:
            tensors["window_num_kv_splits"] = backend.cuda_graph_window_num_kv_splits[:bs]
        return PlanCapture("triton", tensors, {"max_kv_splits": int(backend.max_kv_splits)}, trim, set(trim))
    tensors["qo_indptr"] = backend.qo_indptr[: bs + 1]
    if spec_info is not None and getattr(spec_info, "custom_mask", None) is not None:
        verify_mask = getattr(backend, "verify_mask", None)  # SGL-new: VerifyMask(buffer, ...)
        buffer = verify_mask.buffer if verify_mask is not None else getattr(backend, "cuda_graph_custom_mask", None)
        if buffer is not None:
            tensors["custom_mask"] = buffer
            tensors["mask_indptr"] = backend.mask_indptr[: bs + 1]
            trim["custom_mask"] = "mask_indptr"
    from attndbg.record.sglang.batch import draft_token_num

    if draft_extend:
        n = getattr(getattr(backend, "forward_metadata", None), "max_extend_len", None)
        n = n if isinstance(n, int) and not isinstance(n, bool) else getattr(backend, "num_draft_tokens", None)
    else:
        n = draft_token_num(spec_info) if spec_info is not None else int(backend.num_draft_tokens)
    return PlanCapture("triton", tensors, _triton_extend_scalars(backend, n), trim, set(trim))


def _fa3(backend: Any, md: Any, verify: bool, model: Model | None) -> PlanCapture | None:
    """FA3's metadata; for a tree verify, the calls the recorded layer runs: a full layer the
    prefix call and the expand call, a sliding-window layer its swa_spec_metadata call (`_fa3_swa`).
    None for a sliding-window layer of a tree verify whose metadata has the swa_spec_metadata
    field unset (SGLang builds it for every model with such layers, so that forward is not one
    this reader knows), or whose backend keeps those layers in the SWA sub-pool
    (`use_sliding_window_kv_pool`): its table then holds the sub-pool's slot ids, which the
    step's req_to_token rows do not, so it would be judged against the wrong ids."""
    tensors = {"page_table": md.page_table, "cache_seqlens": md.cache_seqlens_int32, "cu_seqlens_q": md.cu_seqlens_q, "cu_seqlens_k": md.cu_seqlens_k}
    # The page table holds page ids of the backend's page size (`page_table[:, ::page] // page`).
    scalars: Scalars = {"max_seqlen_q": int(md.max_seq_len_q), "max_seqlen_k": int(md.max_seq_len_k), "page_size": _page_size(backend)}
    # SGLang leaves the last expand metadata on the backend across steps; a verify step reads it
    # only with topk > 1 (forward_extend's use_cascade_attn).
    expand = getattr(backend, "forward_metadata_spec_decode_expand", None) if verify and getattr(backend, "topk", 0) > 1 else None
    if expand is not None and model is not None and model.sliding_window >= 0 and hasattr(md, "swa_spec_metadata"):
        # SGLang since #9658: sliding-window layers run no cascade (forward_extend's
        # use_cascade_attn excludes them). Before it the metadata had no such field and these
        # layers ran the full layers' two calls with their window: recorded as such below.
        swa = md.swa_spec_metadata
        if swa is None or getattr(backend, "use_sliding_window_kv_pool", False) is True:
            return None
        return _fa3_swa(tensors, scalars, swa, expand)
    if expand is not None and getattr(expand, "page_table", None) is not None:
        # A tree verify's second call: one row per draft token, its table of draft slot ids read
        # as 1-token pages ("the suffix table stores physical token slots"; flashattention_backend.py).
        tensors.update(
            {
                "expand_page_table": expand.page_table,
                "expand_cache_seqlens": expand.cache_seqlens_int32,
                "expand_cu_seqlens_q": expand.cu_seqlens_q,
                "expand_cu_seqlens_k": expand.cu_seqlens_k,
            }
        )
        scalars.update({"expand_max_seqlen_q": int(expand.max_seq_len_q), "expand_page_size": 1})
    return PlanCapture("fa3", tensors, scalars)


def _fa3_swa(tensors: dict[str, Tensor | None], scalars: Scalars, swa: Any, expand: Any) -> PlanCapture:
    """A sliding-window layer's tree verify (flashattention_backend.py
    `_init_sliding_window_attn_spec_metadata`): one row per draft token, its request's prefix slots
    then the draft slots it sees (prepare_swa_spec_page_table_triton, page size 1), cache_seqlens =
    prefix + the expand row's sum, one query each. The prefix call's tables it was built from stay
    in the plan. Its max_seq_len_k is left unset by SGLang (flash_attn_with_kvcache takes none):
    the table's width, prefix max + the expand table's, bounds it."""
    tensors.update(
        {
            "swa_page_table": swa.page_table,
            "swa_cache_seqlens": swa.cache_seqlens_int32,
            "swa_cu_seqlens_q": swa.cu_seqlens_q,
            "swa_cu_seqlens_k": swa.cu_seqlens_k,
        }
    )
    width = int(scalars["max_seqlen_k"]) + int(expand.page_table.shape[1])
    scalars.update({"swa_max_seqlen_q": int(swa.max_seq_len_q), "swa_max_seqlen_k": width, "swa_page_size": 1, "verify_path": "window-expand"})
    return PlanCapture("fa3", tensors, scalars)


def _page_size(backend: Any) -> int:
    value = getattr(backend, "page_size", None)
    return int(value) if isinstance(value, int) and value >= 1 else 1


def _flashmla(backend: Any, md: Any) -> PlanCapture:
    return PlanCapture(
        "mla",
        {"block_table": md.block_kv_indices, "num_splits": md.num_splits},
        {"impl": "flashmla", "page_size": int(getattr(backend, "page_size", 64))},
    )


def _is_trtllm_mla(backend: Any) -> bool:
    """SGLang's trtllm_mla backend, by the state only it keeps: its decode-family metadata apart
    from the FlashInfer-MLA parent's `forward_metadata`, and that metadata per captured bs."""
    return _has(backend, "forward_decode_metadata", "decode_cuda_graph_metadata", "decode_cuda_graph_kv_indices")


def _trtllm_mla(backend: Any, graph_bs: int | None, *, verify: bool, draft_extend: bool) -> PlanCapture | None:
    """TRTLLMMLADecodeMetadata as the step's kernels read it: eager, the step's own
    (init_forward_metadata); at a replay, the captured bs's object, whose tensors the graph baked
    in and the replay refills (its Python ints, max_seq_len_q and max_seq_len_k, are what the
    capture launched with unless the replay rewrote them). Decode runs one query per request,
    verify num_draft_tokens; a draft extend's queries are laid out by cu_seqlens_q / seq_lens_q
    and padded to max_seq_len_q rows each."""
    md = _captured_for(backend, "decode_cuda_graph_metadata", graph_bs) if graph_bs is not None else backend.forward_decode_metadata
    if md is None or not _has(md, "block_kv_indices", "seq_lens_k", "max_seq_len_k") or md.block_kv_indices is None or md.seq_lens_k is None:
        return None
    rows = graph_bs if graph_bs is not None else int(md.seq_lens_k.numel())
    tensors: dict[str, Tensor | None] = {"block_kv_indices": md.block_kv_indices[:rows], "seq_lens_k": md.seq_lens_k[:rows]}
    scalars: Scalars = {"impl": "trtllm", "page_size": _page_size(backend), "max_seq_len_k": int(md.max_seq_len_k)}
    if draft_extend:
        if md.cu_seqlens_q is None or md.seq_lens_q is None or md.max_seq_len_q is None:
            return None  # a draft extend's query layout not built: nothing its kernel reads is known
        tensors.update({"cu_seqlens_q": md.cu_seqlens_q[: rows + 1], "seq_lens_q": md.seq_lens_q[:rows]})
        scalars["max_seq_len_q"] = int(md.max_seq_len_q)
    else:
        scalars["q_len"] = int(backend.num_draft_tokens) if verify else 1
    return PlanCapture("mla", tensors, scalars)


def _wrapper_buffers(wrapper: Any) -> dict[str, Tensor | None]:
    """FlashInfer keeps what `plan()` was given in these attributes (flashinfer/decode.py, prefill.py)."""
    names = {
        "qo_indptr": "_qo_indptr_buf",
        "kv_indptr": "_paged_kv_indptr_buf",
        "kv_indices": "_paged_kv_indices_buf",
        "kv_last_page_len": "_paged_kv_last_page_len_buf",
        # FlashInfer's plan() packs the bool mask, each request's q_len x kv_len segment padded to
        # whole bytes, little-endian (segment_packbits(..., bitorder="little")), and keeps the
        # packed bytes with their byte offsets: recorded as packed, read by backends/flashinfer.py.
        "packed_custom_mask": "_custom_mask_buf",
        "packed_mask_indptr": "_mask_indptr_buf",
    }
    return {ours: getattr(wrapper, theirs) for ours, theirs in names.items() if getattr(wrapper, theirs, None) is not None}


def _flashinfer(backend: Any, md: Any, model: Model | None) -> PlanCapture:
    decode = hasattr(md, "decode_wrappers")
    wrappers = md.decode_wrappers if decode else md.prefill_wrappers
    wrapper = wrappers[_wrapper_index(backend, len(wrappers), model)]
    tensors = _wrapper_buffers(wrapper)
    if decode:
        path = "decode"
    elif md.use_ragged:
        path = "ragged" if md.extend_no_prefix else "cascade"
    else:
        path = "paged"
    # SGLang plans FlashInfer with page_size literal 1 whatever its pool's page size
    # (call_begin_forward: `wrapper.begin_forward(..., self.head_dim, 1, ...)`): kv_indices are slot ids.
    scalars: Scalars = {"path": path, "page_size": 1, "num_wrappers": len(wrappers)}
    if decode:
        # Fixed when the wrapper was built (BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=
        # backend.decode_use_tensor_cores)); FlashInfer keeps it as `_use_tensor_cores`.
        cores = getattr(wrapper, "_use_tensor_cores", getattr(backend, "decode_use_tensor_cores", None))
        if isinstance(cores, bool):
            scalars["use_tensor_cores"] = cores
    planned = getattr(wrapper, "_window_left", None)
    if isinstance(planned, int) and not isinstance(planned, bool) and not decode:
        # plan() keeps the window it was given; no layer's forward has run since this step's plan
        # (the hook runs right after init_forward_metadata), so this is the plan-time window, which
        # chose the compiled module (sglang#31501): read by _call_arguments.
        scalars["plan_window_left"] = planned
    # SGLang allocates FlashInfer's kv_indices with slack (paged_kernel_lens_sum + 256): capacity.
    trim = {"kv_indices": "kv_indptr"} if "kv_indptr" in tensors else {}
    capacity = set(trim)
    if "packed_custom_mask" in tensors and "packed_mask_indptr" in tensors:
        trim["packed_custom_mask"] = "packed_mask_indptr"
        if getattr(wrapper, "is_cuda_graph_enabled", False) or getattr(wrapper, "_use_cuda_graph", False):
            capacity.add("packed_custom_mask")  # the graph's custom_mask_buf, sized for the capture
    return PlanCapture("flashinfer", tensors, scalars, trim, capacity, plan_info=_plan_info(wrapper))


def _plan_info(wrapper: Any) -> PlanInfo | None:
    """The wrapper's schedule as its last plan() left it (this step's: the hook runs right after
    init_forward_metadata, and under a graph replay after SGLang re-planned the graph's wrapper)."""
    read = wrapper_plan_info(wrapper)
    if read is None:
        return None
    vector, workspace = read
    return PlanInfo(vector=torch.tensor(vector, dtype=torch.int64), workspace=workspace.to(torch.uint8))


def _wrapper_index(backend: Any, count: int, model: Model | None) -> int:
    """The wrapper the recorded layer runs: SGLang's `_get_wrapper_idx(layer)`. With two
    (WrapperDispatch.SLIDING_WINDOW) wrapper 0 serves sliding-window layers and wrapper 1 the others
    (`layer.sliding_window_size == -1`), so the recorded layer's window chooses; otherwise (one
    wrapper, or cross attention, which the recorder's decoder layers are not) wrapper 0."""
    dispatch = getattr(getattr(backend, "dispatch_reason", None), "name", None)
    if count == 2 and dispatch == "SLIDING_WINDOW" and model is not None:
        return 0 if model.sliding_window >= 0 else 1
    return 0


def _call_arguments(capture: PlanCapture, backend: Any, model: Model, *, verify: bool, spec: bool, draft_tokens: int | None, seq_lens: Tensor | None) -> None:
    """What SGLang hands its kernels at each layer's call and keeps on no metadata object, as the
    adapter's plan names it: derived here, and only here, from the recorded layer (`model`, read
    from the RadixAttention layer: sliding_window_size, logit_cap) and the step. A FlashInfer
    wrapper's `_window_left` / `_logits_soft_cap` / `_causal` are no source: every layer's
    `forward()` overwrites them, so at record time they hold the plan's or the previous step's.

    - FlashInfer (flashinfer_backend.py forward_decode / forward_extend): decode passes no
      window_left (FlashInfer's -1; wrapper 0 lists only the last window + 1 keys instead);
      paged extend, draft extend and verify pass window_left=layer.sliding_window_size and
      causal=True (a planned custom mask rules over causal); the cascade's paged prefix pass
      causal=False with the window; the ragged pass of an extend without prefix no window_left.
      A window given at forward applies only where the wrapper was *planned* with one: plan()
      compiles the per-element window in or out (sglang#31501), so the recorded window_left is the
      layer's window where the plan had one and -1 where it had none. The plan-time window is the
      wrapper's (`plan_window_left`, read right after this step's plan) when it keeps one; else
      SGLang's rule: verify and draft extend are planned without a window (the tree mask, or the
      accepted tokens' causal block, carries it; flashinfer_backend.py `window_left=... if
      spec_info is None else -1`), paged and cascade extends with the layer's.
      logits_soft_cap=layer.logit_cap everywhere.
    - FA3 (flashattention_backend.py forward_extend/forward_decode): window_size=(sw, 0) from the
      layer, softcap=layer.logit_cap, causal=True but in a tree verify (topk > 1: both calls
      causal=False, merged), which runs as two calls when the backend built the expand metadata;
      a sliding-window layer of a tree verify runs one causal call over swa_spec_metadata (before
      sglang#9658 it ran the two calls, each with window_size=(sw, 0)).
    - FlashMLA (flashmla_backend.py forward_decode/forward_extend): cache_seqlens=seq_lens (+
      draft_token_num on verify), causal=True, q viewed as [bs, q_len, H, D] with q_len 1 or n.
    """
    scalars = capture.scalars
    window, cap = model.sliding_window, model.logit_cap
    if capture.backend == "flashinfer":
        path = scalars["path"]
        scalars["logits_soft_cap"] = cap
        planned = scalars.pop("plan_window_left", None)
        if path not in ("paged", "cascade"):
            scalars["window_left"] = -1
        elif planned is not None:
            scalars["window_left"] = window if planned >= 0 else -1
        else:
            scalars["window_left"] = -1 if spec else window
        if path != "decode":
            scalars["causal"] = path != "cascade"
    elif capture.backend == "fa3" and scalars.get("verify_path") == "window-expand":
        # A sliding-window layer's one call over swa_spec_metadata: causal, window (sw, 0).
        scalars["window_left"] = window
        scalars["causal"] = True
        scalars["swa_causal"] = True
    elif capture.backend == "fa3":
        two_call = "expand_page_table" in capture.tensors
        scalars["window_left"] = window
        if verify and two_call and window >= 0:
            # The full layers' cascade run for a sliding-window layer (SGLang before #9658): both
            # calls get window_size=(sw, 0), the 0 from the layer being causal, not from the call.
            scalars["window_right"] = 0
        scalars["verify_path"] = "two-call" if verify and two_call else "causal"
        scalars["causal"] = not (verify and two_call)
        if verify and two_call:
            scalars["expand_causal"] = False
            # flash_attn_with_kvcache takes no max_seqlen_k; each draft token sees at most n keys.
            scalars["expand_max_seqlen_k"] = int(draft_tokens or 0)
    elif capture.backend == "mla" and scalars.get("impl") == "flashmla":
        n = int(draft_tokens or 0) if verify else 0
        scalars["causal"] = True
        scalars["q_len"] = n if verify else 1
        if seq_lens is not None:
            capture.tensors["cache_seqlens"] = (seq_lens + n).to(torch.int32) if n else seq_lens.to(torch.int32)


def capture_plan(
    backend: Any,
    *,
    graph_bs: int | None = None,
    verify: bool = False,
    draft_extend: bool = False,
    spec_info: Any = None,
    sized: bool = False,
    model: Model | None = None,
    seq_lens: Tensor | None = None,
    graph_rows: int | None = None,
    extend: bool = False,
) -> PlanCapture | None:
    """The live backend's plan as device views; None when its metadata is of no known kind.

    `graph_bs`: the padded batch size of a CUDA-graph replay (read graph buffers where the backend
    keeps them); None for an eager step. `graph_rows`: the rows its kernels run, when they are not
    its requests (a draft step's topk branches per request; Triton's graph buffers hold a row per
    branch). `verify` / `draft_extend`: the step's mode is
    TARGET_VERIFY / a draft extend (both planned with the spec input); `extend`: a plain extend
    (trtllm_mla keeps its decode metadata of an earlier step then). `sized`: the engine sized this step's index buffers from
    a host sum (see the module docstring); unknown is False, and the buffers are cut as capacity.
    `model` (the recorded layer) and `seq_lens` (the step's, as the backend's forward reads them)
    give the call arguments SGLang keeps on no object (`_call_arguments`); without `model` the
    plan lacks them, and the checker says it is not read.
    """
    if _is_trtllm_mla(backend):
        capture = None if extend else _trtllm_mla(backend, graph_bs, verify=verify, draft_extend=draft_extend)
    else:
        capture = _read_metadata(
            backend, graph_bs=graph_bs, graph_rows=graph_rows or graph_bs, verify=verify, draft_extend=draft_extend, spec_info=spec_info, sized=sized, model=model
        )
    if capture is not None and model is not None:
        if isinstance(seq_lens, Tensor) and graph_bs is not None:
            seq_lens = seq_lens[:graph_bs]
        _call_arguments(
            capture,
            backend,
            model,
            verify=verify,
            spec=verify or draft_extend,
            draft_tokens=_draft_tokens(backend, verify, spec_info),
            seq_lens=seq_lens if isinstance(seq_lens, Tensor) else None,
        )
    return capture


def _draft_tokens(backend: Any, verify: bool, spec_info: Any) -> int | None:
    """Tokens per request of a verify step: the spec input's, else the backend's own copy of
    speculative_num_draft_tokens (FlashMLA: num_draft_tokens; FA3: speculative_num_draft_tokens)."""
    from attndbg.record.sglang.batch import draft_token_num

    if verify and spec_info is not None:
        return draft_token_num(spec_info)
    return getattr(backend, "num_draft_tokens", None) or getattr(backend, "speculative_num_draft_tokens", None)


def _read_metadata(
    backend: Any, *, graph_bs: int | None, graph_rows: int | None, verify: bool, draft_extend: bool, spec_info: Any, sized: bool, model: Model | None
) -> PlanCapture | None:
    if graph_rows is not None and _has(backend, "cuda_graph_kv_indices", "kv_indptr", "max_kv_splits"):
        return _triton_graph(backend, graph_rows, verify, spec_info, draft_extend=draft_extend)
    if draft_extend:
        md = _flashinfer_graph_draft_extend(backend, graph_bs)
    else:
        md = _flashinfer_graph_decode(backend, graph_bs) if not verify else None
    if md is None:
        md = getattr(backend, "forward_metadata", None)
    if md is None:
        return None
    if _has(md, "kv_indptr", "kv_indices", "num_kv_splits", "max_extend_len"):
        return _triton_eager(backend, md, sized)
    if _has(md, "cache_seqlens_int32", "cu_seqlens_q", "page_table"):
        return _fa3(backend, md, verify, model)
    if _has(md, "block_kv_indices", "num_splits"):
        return _flashmla(backend, md)
    if hasattr(md, "decode_wrappers") or _has(md, "prefill_wrappers", "use_ragged"):
        return _flashinfer(backend, md, model)
    return None


def _captured_for(backend: Any, attribute: str, graph_bs: int | None) -> Any:
    """What a FlashInfer backend keeps per captured batch size in `attribute` for `graph_bs`; None
    for an eager step or a size never captured."""
    graphs = getattr(backend, attribute, None)
    if graph_bs is None or not isinstance(graphs, dict) or graph_bs not in graphs:
        return None
    return graphs[graph_bs]


def _flashinfer_graph_draft_extend(backend: Any, graph_bs: int | None) -> Any:
    """The paged prefill wrappers a FlashInfer DRAFT_EXTEND_V2 graph replay of `graph_bs` requests
    re-planned (`draft_extend_cuda_graph_metadata[bs]`, causal over the whole sequence, no ragged
    part)."""
    wrappers = _captured_for(backend, "draft_extend_cuda_graph_metadata", graph_bs)
    return None if wrappers is None else SimpleNamespace(prefill_wrappers=wrappers, use_ragged=False, extend_no_prefix=False)


def _flashinfer_graph_decode(backend: Any, graph_bs: int | None) -> Any:
    """The decode wrappers a FlashInfer graph replay of `graph_bs` requests re-planned
    (`decode_cuda_graph_metadata[bs]`, what init_forward_metadata_out_graph hands its updater):
    `forward_metadata` keeps the wrappers of the last size captured, which may be another graph's."""
    wrappers = _captured_for(backend, "decode_cuda_graph_metadata", graph_bs)
    return None if wrappers is None else SimpleNamespace(decode_wrappers=wrappers)


def plan_from_host(capture: PlanCapture, host: dict[str, Tensor | None]) -> tuple[Plan, dict[str, EngineBuffer]]:
    """The Plan (capacity buffers cut at their indptr's end, the rest as recorded, empty entries
    dropped) and, per buffer with an indptr, the engine buffer behind it (`Trace.buffers`)."""
    tensors = {k: v for k, v in host.items() if v is not None}
    buffers = {}
    for name, indptr_name in capture.trim.items():
        if name not in tensors or indptr_name not in tensors or not tensors[indptr_name].numel():
            continue
        length, read = capture.length.get(name, tensors[name].numel()), int(tensors[indptr_name][-1])
        if name in capture.capacity:
            tensors[name] = tensors[name][: max(min(read, length), 0)]
        buffers[f"plan.{name}"] = EngineBuffer(length=length, read=read, capacity=name in capture.capacity)
    return Plan(backend=capture.backend, tensors=tensors, scalars=dict(capture.scalars), plan_info=capture.plan_info), buffers


def plan_from_backend(backend: Any, **options: Any) -> Plan | None:
    """The plan `backend` holds now (host copies), or None for metadata of no known kind;
    `options` are capture_plan's."""
    capture = capture_plan(backend, **options)
    if capture is None:
        return None
    host = {k: None if v is None else v.detach().cpu() for k, v in capture.tensors.items()}
    return plan_from_host(capture, host)[0]
