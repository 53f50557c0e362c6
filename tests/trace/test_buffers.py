"""Trace.buffers: the engine buffer behind a recorded tensor, kept beside the engine-neutral fields."""

from __future__ import annotations

import dataclasses

import pytest

from attndbg.trace import io, synth
from attndbg.trace.schema import EngineBuffer, to_dict
from attndbg.trace.validate import TraceError, from_dict


def verify_trace():
    return synth.build(synth.parse_spec(["verify", "heads=4:2"]))


def test_buffers_roundtrip_and_absent_buffers_stay_out_of_the_file() -> None:
    trace = verify_trace()
    assert "buffers" not in to_dict(trace)  # files without buffers are what they were before
    n = trace.spec.custom_mask.numel()
    described = dataclasses.replace(trace, buffers={"spec.custom_mask": EngineBuffer(length=n + 64, read=n, capacity=True)})
    assert from_dict(to_dict(described)).buffers == {"spec.custom_mask": EngineBuffer(length=n + 64, read=n, capacity=True)}


def test_shipped_traces_load_without_buffers() -> None:
    for name in ("verify_tree.pt", "decode_gqa.pt", "transformers_step.pt"):
        assert io.load(f"traces/{name}").buffers == {}


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"plan.nothing": {"length": 1, "read": -1, "capacity": True}}, "buffers['plan.nothing']: names no recorded tensor"),
        ({"spec.custom_mask": {"length": 3, "read": -1, "capacity": True}}, "buffers['spec.custom_mask'].length: = 3, but spec.custom_mask records"),
        ({"spec.custom_mask": {"length": 10**6, "read": -1, "capacity": False}}, "a buffer sized for the step is recorded whole"),
        ({"spec.custom_mask": {"length": 10**6, "read": -2, "capacity": True}}, "read: = -2, must be >= -1"),
        ({"spec.custom_mask": 7}, "buffers['spec.custom_mask']: expected a dict"),
    ],
)
def test_a_bad_buffer_entry_is_one_error_naming_it(entry: dict, message: str) -> None:
    data = to_dict(verify_trace())
    data["buffers"] = entry
    with pytest.raises(TraceError, match=None) as caught:
        from_dict(data)
    assert message in str(caught.value), str(caught.value)
