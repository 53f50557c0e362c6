"""NVTX: every replay phase sits in an `attndbg/<phase>` range carrying step, mode and batch size."""

from __future__ import annotations

import contextlib

import pytest

from attndbg import profiling
from attndbg.replay.runner import ReplayOptions, replay
from tests.factories import make_trace


def test_replay_phases_are_nvtx_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def annotate(message: str, domain: str):
        seen.append((message, domain))
        yield

    monkeypatch.setattr(profiling.nvtx, "annotate", annotate)
    replay(make_trace("decode-mha"), "t", ["triton"], ReplayOptions(cuda_graph=True, graph_capture=False))
    names = [m.split(" ")[0] for m, _ in seen]
    for expected in ("attndbg/data", "attndbg/reference", "attndbg/backend/triton", "attndbg/plan", "attndbg/run", "attndbg/compare", "attndbg/capture+replay"):
        assert expected in names, names
    assert all(domain == "attndbg" for _, domain in seen)
    run = next(m for m, _ in seen if m.startswith("attndbg/run"))
    assert "step=0" in run and "mode=DECODE" in run and "bs=3" in run and "backend=triton" in run
