"""What a vLLM attention metadata builder built, as a `Plan` under the builder's own field names.

Generic over the built dataclass (FlashAttentionMetadata, FlashInferMetadata,
TritonAttentionMetadata, MLACommonMetadata with its nested decode/prefill parts, classic
TreeAttentionMetadata ...): fields are discovered, not listed, because they change between vLLM
versions. Rules:

- integer and bool tensors are recorded (they are the index metadata: query_start_loc, seq_lens,
  block_table, slot_mapping, paged_kv_indptr_gpu ...); 2-D `*block_table*` tensors are cut to the
  columns the step can read, like the batch's block table;
- float tensors are recorded when small (`tree_attn_bias` is [tree_len, tree_len]); large ones
  are scratch workspaces (`softmax_segm_output`, ...) whose contents mean nothing at build time:
  their shape and dtype are recorded as the string scalar `NAME_shape`;
- every tensor's data pointer is recorded as the int scalar `NAME_data_ptr` (the invariants
  detector checks that graph-replayed plans keep their pointers);
- int/float/bool/str/enum fields become scalars; nested dataclasses are flattened with dotted
  names (`decode.block_table`), and so are the few plain objects that hold a kernel's schedule
  (`SCHEDULE_HOLDERS`); wrapper objects (FlashInfer planners, ...) and dicts are skipped.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attndbg.trace.schema import Plan

SMALL_FLOAT_TENSOR = 1024  # elements: a tree bias of up to 32 tokens fits; per-step scratch workspaces do not
# Plain classes (not dataclasses) whose instance attributes are tensors a kernel reads: FlashMLA's
# FlashMLASchedMeta holds its FP8 decode's tile_scheduler_metadata and num_splits, which a FULL
# graph must read from persistent buffers (vLLM #35175).
SCHEDULE_HOLDERS = ("FlashMLASchedMeta",)
MAX_DEPTH = 3  # MLACommonMetadata.prefill.chunked_context is the deepest nesting seen (0.33)
Scalar = int | float | bool | str


def _fields(obj: Any) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Private fields are caches of the public ones (CommonAttentionMetadata._num_computed_tokens_cache).
        return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj) if not f.name.startswith("_")]
    return [(k, v) for k, v in vars(obj).items() if not k.startswith("_")] if hasattr(obj, "__dict__") else []


def plan_parts(metadata: Any, *, block_size: int | None = None, max_seq_len: int | None = None, pointers: bool = True) -> tuple[dict[str, Tensor], dict[str, Scalar]]:
    """(tensors to copy, scalars) of built metadata; tensors are the engine's own (views, no copy).
    `pointers=False` leaves out the `NAME_data_ptr` scalars."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Scalar] = {}
    _collect(metadata, "", 0, tensors, scalars, _Cut(block_size, max_seq_len, pointers))
    return tensors, scalars


@dataclass(frozen=True)
class _Cut:
    block_size: int | None
    max_seq_len: int | None
    pointers: bool


def _collect(obj: Any, prefix: str, depth: int, tensors: dict[str, Tensor], scalars: dict[str, Scalar], cut: _Cut) -> None:
    for name, value in _fields(obj):
        key = prefix + name
        if value is None:
            continue
        if isinstance(value, Tensor):
            _tensor(key, value, tensors, scalars, cut)
        elif isinstance(value, enum.Enum):
            scalars[key] = value.name
        elif isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (bool, int, float)) for v in value):
            scalars[key] = str(tuple(value))  # e.g. window_size=(-1, -1)
        elif ((dataclasses.is_dataclass(value) and not isinstance(value, type)) or type(value).__name__ in SCHEDULE_HOLDERS) and depth < MAX_DEPTH:
            _collect(value, key + ".", depth + 1, tensors, scalars, cut)


def _tensor(key: str, value: Tensor, tensors: dict[str, Tensor], scalars: dict[str, Scalar], cut: _Cut) -> None:
    if cut.pointers:
        scalars[f"{key}_data_ptr"] = int(value.data_ptr())
    if value.is_floating_point() or value.is_complex():
        if value.numel() > SMALL_FLOAT_TENSOR:
            scalars[f"{key}_shape"] = f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
            return
    elif "block_table" in key and value.dim() == 2 and cut.block_size and cut.max_seq_len:
        value = value[:, : -(-int(cut.max_seq_len) // int(cut.block_size))]
    tensors[key] = value


def plan_from_parts(backend: str, tensors: dict[str, Tensor | None], scalars: dict[str, Scalar]) -> Plan:
    """The Plan from host copies of `plan_parts`' tensors (contiguous CPU tensors, as stored)."""
    return Plan(
        backend=backend,
        tensors={k: v.detach().cpu().contiguous() for k, v in tensors.items() if v is not None},
        scalars=dict(scalars),
    )


def plan_from_metadata(metadata: Any, *, backend: str, block_size: int | None = None, max_seq_len: int | None = None) -> Plan:
    """Plan of built metadata in one call (copies device tensors: for tests and offline tools)."""
    tensors, scalars = plan_parts(metadata, block_size=block_size, max_seq_len=max_seq_len)
    return plan_from_parts(backend, {k: v.clone() if v.device.type == "cpu" else v for k, v in tensors.items()}, scalars)
