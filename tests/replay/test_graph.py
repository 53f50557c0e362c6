"""CUDA-graph replay: padding, poisoning, decoy batch, and the checks that must catch real bugs.

On CPU the graph sequence runs without capture (same buffers, same order); on the GPU
(`-m gpu`) the same tests capture a real torch.cuda.CUDAGraph.
"""

from __future__ import annotations

import pytest
import torch

from attndbg.backends import registry
from attndbg.backends import triton as triton_backend
from attndbg.backends.base import Padding
from attndbg.machine import cuda_available
from attndbg.replay.graph import decoy, default_capture_bs
from attndbg.replay.runner import ReplayOptions, RunStatus, replay
from attndbg.replay.variants import Graph
from attndbg.trace.validate import from_dict
from attndbg.trace.schema import to_dict
from tests.factories import make_trace

CAPTURE = [pytest.param(False, id="no-capture"), pytest.param(True, id="cuda-graph", marks=pytest.mark.gpu)]


def _graph_run(trace, capture: bool, **kw):
    options = ReplayOptions(cuda_graph=True, graph_capture=capture, **kw)
    runs = [r for r in replay(trace, "t", ["triton"], options).runs if isinstance(r.variant, Graph)]
    assert len(runs) == 1
    return runs[0]


@pytest.mark.parametrize("capture", CAPTURE)
@pytest.mark.parametrize("spec", [("decode-gqa",), ("verify",), ("mla-decode",), ("decode-paged",), ("verify-chain",), ("window-decode",)])
def test_graph_replay_passes(spec, capture: bool) -> None:
    run = _graph_run(make_trace(*spec), capture)
    assert run.status is RunStatus.PASSED, (run.reason, run.problems, run.comparison)


@pytest.mark.parametrize("capture", CAPTURE)
@pytest.mark.parametrize("fill", [0, 1, 3])
def test_fill_values_and_capture_sizes(fill: int, capture: bool) -> None:
    run = _graph_run(make_trace("decode-gqa", "kv_lens=5,70,300"), capture, fill_value=fill, capture_bs=12)
    assert run.variant == Graph(capture_bs=12, fill=fill) and run.variant.label == f"graph bs=12 fill={fill}"
    assert run.status is RunStatus.PASSED, (run.problems, run.comparison)


def test_extend_is_not_graphed() -> None:
    run = _graph_run(make_trace("extend-prefix"), False)
    assert run.status is RunStatus.UNSUPPORTED and "decode and verify" in run.reason


def test_default_capture_bs_is_the_next_sglang_size() -> None:
    assert default_capture_bs(make_trace("decode-gqa", "kv_lens=3,4,5")) == 4
    assert default_capture_bs(make_trace("decode-gqa", "kv_lens=" + ",".join(["3"] * 12))) == 16
    assert default_capture_bs(make_trace("verify", "prefix_lens=3,4,5")) == 4


def test_decoy_is_a_valid_different_batch() -> None:
    for preset in ("decode-gqa", "verify", "mla-decode", "decode-paged"):
        trace = make_trace(preset)
        d = decoy(trace)
        from_dict(to_dict(d))  # a valid trace
        assert torch.equal(d.batch.out_cache_loc, trace.batch.out_cache_loc)
        assert (d.batch.kv_lens <= trace.batch.kv_lens).all() and not torch.equal(d.batch.kv_lens, trace.batch.kv_lens)


def test_padded_plan_rows_point_at_the_dummy_slot() -> None:
    trace = make_trace("decode-gqa", "kv_lens=5,9")
    plan = registry.create("triton").derive_plan(trace, Padding(capture_bs=4, fill_value=2, dummy_slot=0))
    indptr = plan.tensors["kv_indptr"].tolist()
    assert indptr == [0, 5, 14, 16, 18]
    assert plan.tensors["kv_indices"][14:].tolist() == [0, 0, 0, 0]
    assert plan.tensors["num_kv_splits"].numel() == 4


class _ReallocatingState(triton_backend._TritonGraphState):
    """SGLang PR #26019's mistake: fresh metadata tensors at replay instead of in-place copies."""

    def load_plan(self, plan) -> None:
        self.buffers = {name: buf.clone() for name, buf in self.buffers.items()}
        super().load_plan(plan)


class _StaleIndicesState(triton_backend._TritonGraphState):
    """A replay path that forgets to refresh kv_indices: the decoy batch's indices stay behind."""

    def load_plan(self, plan) -> None:
        if getattr(self, "_loaded", False):
            plan = type(plan)(backend=plan.backend, tensors={k: v for k, v in plan.tensors.items() if k != "kv_indices"}, scalars=plan.scalars)
            kept = self.buffers.pop("kv_indices")
            super().load_plan(plan)
            self.buffers["kv_indices"] = kept
            return
        self._loaded = True
        super().load_plan(plan)


@pytest.mark.parametrize("capture", CAPTURE)
def test_reallocated_plan_buffers_are_caught(monkeypatch: pytest.MonkeyPatch, capture: bool) -> None:
    monkeypatch.setattr(triton_backend, "_TritonGraphState", _ReallocatingState)
    run = _graph_run(make_trace("decode-gqa"), capture)
    assert run.status is RunStatus.FAILED
    assert any("moved" in p for p in run.problems)


@pytest.mark.parametrize("capture", CAPTURE)
def test_stale_indices_from_the_decoy_are_caught(monkeypatch: pytest.MonkeyPatch, capture: bool) -> None:
    monkeypatch.setattr(triton_backend, "_TritonGraphState", _StaleIndicesState)
    run = _graph_run(make_trace("decode-gqa", "kv_lens=40,90,200"), capture)
    assert run.status is RunStatus.FAILED
    assert run.comparison.failing_rows > 0


def test_cli_refuses_cuda_graph_without_gpu(tmp_path) -> None:
    if cuda_available():
        pytest.skip("this machine has a GPU")
    from click.testing import CliRunner

    from attndbg.cli import main
    from tests.factories import write_trace

    path = write_trace(tmp_path / "t.pt", "decode-mha")
    result = CliRunner().invoke(main, ["replay", str(path), "--cuda-graph"])
    assert result.exit_code == 3 and "needs a CUDA GPU" in result.output  # 3: not run here (nothing failed)
