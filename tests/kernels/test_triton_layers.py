"""Our Triton kernels, through the triton adapter, on the layer kinds engines run today, against
the float64 reference with the project's tolerance (compare/tolerance.py): sinks (decode: in the
split merge; extend: at the end), a non-causal layer and its right window, a scaled fp8 cache,
cross-attention (empty requests, fully masked rows), an extend step's custom mask, zero-length
requests. Interpreted on the CPU (CI), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from attndbg.backends.triton import TritonBackend, TritonOptions
from attndbg.machine import kernel_device
from attndbg.replay.step_data import StepData
from tests.factories import make_trace

SMALL = ("heads=4:2", "head_dim=16")


def _run(*spec: str, options: TritonOptions | None = None):
    trace = make_trace(*spec, *SMALL)
    backend = TritonBackend(options)
    assert backend.unsupported_reason(trace) is None
    data = StepData(trace, device=kernel_device())
    result = backend.run(trace, data.inputs, backend.derive_plan(trace))
    return trace, data, result


@pytest.mark.parametrize(
    "spec",
    [
        ("decode-mha", "kv_lens=1,40,130", "sinks=1"),
        ("decode-mha", "kv_lens=0,40", "cross=1", "sinks=1"),
        ("extend-prefix", "prefix_lens=0,20", "extend_lens=17,6", "sinks=1"),
        ("extend-prefix", "prefix_lens=0,20", "extend_lens=17,6", "causal=0"),
        ("window", "prefix_lens=30,0", "extend_lens=12,40", "window=9", "window_right=5"),
        ("decode-gqa", "kv_lens=3,70", "kv_dtype=float8_e4m3fn", "k_scale=0.5", "v_scale=2.0"),
        ("extend-prefix", "prefix_lens=0,20", "extend_lens=17,6", "kv_dtype=float8_e5m2", "k_scale=0.25", "v_scale=3.0"),
        ("extend-prefix", "prefix_lens=0,3,40", "extend_lens=9,20,5", "cross=1"),
        ("extend-prefix", "prefix_lens=0,3,40", "extend_lens=9,20,5", "cross=1", "causal=1", "sinks=1"),
        ("extend-prefix", "prefix_lens=0,20", "extend_lens=17,6", "extend_mask=random"),
        ("mixed", "prefix_lens=10,0,30", "extend_lens=12,9,1", "extend_mask=blocks", "window=6"),
        ("extend-prefix", "prefix_lens=0,20,0", "extend_lens=17,0,0", "slots=non_monotonic", "page_size=4"),
    ],
    ids=lambda spec: " ".join(spec),
)
def test_triton_matches_the_reference(spec: tuple[str, ...]) -> None:
    trace, data, result = _run(*spec)
    comparison = data.compare(result)
    assert comparison.passed, comparison


def test_split_count_with_sinks_adds_the_sink_once() -> None:
    """Sinks belong to the merge: 1 split and 4 splits give the same answer, within float rounding."""
    _, data, one = _run("decode-mha", "kv_lens=130,260", "sinks=1", options=TritonOptions(num_kv_splits=1))
    _, _, four = _run("decode-mha", "kv_lens=130,260", "sinks=1", options=TritonOptions(num_kv_splits=4))
    assert data.compare(four).passed
    torch.testing.assert_close(four.lse.cpu(), one.lse.cpu(), rtol=0, atol=1e-5)


def test_fully_masked_rows_match_the_convention() -> None:
    """Causal cross-attention with more queries than keys: the top rows write 0 and LSE -inf (with
    sinks: the sink's logit), as the reference defines them."""
    trace, data, result = _run("extend-prefix", "prefix_lens=2", "extend_lens=5", "cross=1", "causal=1")
    assert bool(torch.isneginf(result.lse[:3].cpu()).all()) and bool((result.output[:3].cpu() == 0).all())
    trace, data, result = _run("extend-prefix", "prefix_lens=2", "extend_lens=5", "cross=1", "causal=1", "sinks=1")
    torch.testing.assert_close(result.lse[:3].cpu(), trace.model.sinks.expand(3, -1), rtol=0, atol=1e-6)


def test_the_split_cap_is_the_engines() -> None:
    """max_kv_splits= records the engine's cap (capture.max_kv_splits); the derived plan keeps to it."""
    trace = make_trace("decode-long", "max_kv_splits=2")
    plan = TritonBackend().derive_plan(trace)
    assert trace.capture.max_kv_splits == 2
    assert int(plan.tensors["num_kv_splits"].max()) <= 2 and plan.scalars["max_kv_splits"] == 2
    assert int(TritonBackend().derive_plan(make_trace("decode-long")).tensors["num_kv_splits"].max()) > 2
