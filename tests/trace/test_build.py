"""A step's mode from its lengths (attndbg/trace/build.py): one rule over host ints, whether the
lengths come as a recorder's lists or an importer's tensors, and lists of different lengths named
as bad input."""

from __future__ import annotations

import pytest
import torch

from attndbg.trace.build import mode_from_lengths
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import ForwardMode

CASES = [
    ([1, 1, 1], [7, 1, 30], ForwardMode.DECODE),
    ([1, 5, 1], [7, 0, 30], ForwardMode.MIXED),
    ([4, 5], [0, 12], ForwardMode.EXTEND),
    ([1, 1], [0, 0], ForwardMode.EXTEND),  # one-token prompts without prefix are a prefill, as in SGLang
    ([1, 1], [0, 3], ForwardMode.MIXED),
    ([], [], ForwardMode.EXTEND),
]


@pytest.mark.parametrize(("extend", "prefix", "mode"), CASES)
def test_lists_and_tensors_give_the_same_mode(extend: list[int], prefix: list[int], mode: ForwardMode) -> None:
    assert mode_from_lengths(extend, prefix) is mode
    assert mode_from_lengths(torch.tensor(extend, dtype=torch.int64), torch.tensor(prefix, dtype=torch.int32)) is mode
    assert mode_from_lengths(tuple(extend), torch.tensor(prefix, dtype=torch.int64)) is mode


@pytest.mark.parametrize("as_tensor", [False, True])
def test_lengths_of_different_sizes_are_bad_input_naming_the_field(as_tensor: bool) -> None:
    extend, prefix = [1, 1, 1], [4, 9]
    args = (torch.tensor(extend), torch.tensor(prefix)) if as_tensor else (extend, prefix)
    with pytest.raises(TraceError) as raised:
        mode_from_lengths(*args, path="cases_rank0.jsonl")
    assert raised.value.field == "batch.prefix_lens"
    assert str(raised.value) == "cases_rank0.jsonl: batch.prefix_lens: has 2 entries, batch.extend_lens 3: one of each per request"
