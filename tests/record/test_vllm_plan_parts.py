"""record/vllm/plan.py: what a builder's metadata is recorded as, nested parts and schedule holders
included."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attndbg.record.vllm.plan import plan_parts


class FlashMLASchedMeta:
    """The shape of FlashMLA's holder: a plain class whose instance attributes are set after it is
    made (the builder sets tile_scheduler_metadata and num_splits on it)."""

    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


class Planner:
    """A wrapper object the builder keeps a reference to (not a schedule holder): never recorded."""

    def __init__(self) -> None:
        self.workspace = torch.zeros(64, dtype=torch.int32)


@dataclass
class Decode:
    seq_lens: torch.Tensor
    scheduler_metadata: FlashMLASchedMeta
    planner: Planner


def test_a_schedule_holders_tensors_and_pointers_are_recorded_and_a_planner_is_not() -> None:
    holder = FlashMLASchedMeta()
    holder.tile_scheduler_metadata = torch.zeros(4, 8, dtype=torch.int32)
    holder.num_splits = torch.arange(5, dtype=torch.int32)
    tensors, scalars = plan_parts(Decode(torch.tensor([5, 7], dtype=torch.int32), holder, Planner()))
    assert torch.equal(tensors["scheduler_metadata.num_splits"], holder.num_splits)
    assert tensors["scheduler_metadata.tile_scheduler_metadata"].shape == (4, 8)
    assert scalars["scheduler_metadata.num_splits_data_ptr"] == holder.num_splits.data_ptr()
    assert not [name for name in tensors if name.startswith("planner")]
    # An unset holder (FlashMLA's bf16 path fills it at the first kernel call) records nothing.
    tensors, _ = plan_parts(Decode(torch.tensor([5], dtype=torch.int32), FlashMLASchedMeta(), Planner()))
    assert sorted(tensors) == ["seq_lens"]
