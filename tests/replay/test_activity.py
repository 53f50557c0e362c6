"""The launch a worker names for its parent: set while a kernel runs, cleared however it ends."""

from __future__ import annotations

import pytest

from attndbg.replay import activity


def test_a_launch_is_named_while_it_runs_and_cleared_after_an_error() -> None:
    seen: list[str] = []
    activity.set_sink(seen.append)
    try:
        with activity.launching("triton", "eager"):
            assert seen[-1] == "triton\teager"
        assert seen[-1] == ""
        # An error the runner reports (not a poisoned context) is no crash: a worker that dies
        # later must not be blamed on this backend.
        with pytest.raises(ValueError), activity.launching("flashinfer", "graph bs=8 fill=1"):
            raise ValueError("plan refused")
        assert seen[-1] == ""
    finally:
        activity.set_sink(None)
    assert activity.parse("fa3\teager\tCUDA error: an illegal memory access") == ("fa3", "eager", "CUDA error: an illegal memory access")
    assert activity.parse("") is None
