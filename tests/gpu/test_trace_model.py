"""The layer kinds engines run today, on the GPU: the nine synth commands of the trace model, each
replayed by every backend that claims support (against the float64 reference), each refusal a
declared reason; `attndbg replay --backend all` exits 0 on each; graph replays of the decode ones.

Each test records what ran (`record_property`: backend, status, max_abs, max_lse_abs, reason), so
`-o junit_family=xunit1 --junitxml=FILE` keeps the numbers behind a green run. FlashInfer
JIT-compiles its kernels on first use (the sink wrapper's module among them): run the file in one
pytest call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends import registry
from attndbg.cli import main
from attndbg.replay.runner import ReplayOptions, RunStatus, replay
from attndbg.trace import io, synth

pytestmark = pytest.mark.gpu

NINE = (
    ("decode-mha", "sinks=1"),
    ("extend-prefix", "causal=0"),
    ("decode-gqa", "kv_dtype=float8_e4m3fn", "k_scale=0.5", "v_scale=2.0"),
    ("window", "window_right=8"),
    ("extend-prefix", "cross=1"),
    ("extend-prefix", "extend_mask=random"),
    ("verify", "parents=-1,0,0,1,2"),
    ("decode-paged", "slots=shuffled_pages"),
    ("mixed", "graph_mode=mixed", "capture_bs=8"),
)
# Which GPU backend claims which (on an SM90 machine with FlashInfer and no other FA3 library): a
# claim that disappears, or one that appears, is a change to look at, not a pass.
CLAIMS = {
    "flashinfer": {0, 1, 2, 5, 6, 7, 8},  # not: a right window (window_left only), kv_len 0 (seq_len >= 1)
    "fa3": {1, 4, 6, 7, 8},  # not: sinks, fp8 scales, right window (FlashInfer's fa3 wrapper), extend mask
}
IDS = [" ".join(words) for words in NINE]


def _trace(words):
    return synth.build(synth.parse_spec(list(words)))


@pytest.mark.parametrize("name", ["reference", "triton", "flashinfer", "fa3", "mla", "vllm_paged"])
@pytest.mark.parametrize("index", range(len(NINE)), ids=IDS)
def test_every_claim_passes_and_every_refusal_says_why(index: int, name: str, record_property) -> None:
    trace = _trace(NINE[index])
    backend = registry.create(name)
    unavailable = backend.unavailable_reason()
    record_property("backend", name)
    if unavailable is not None:
        record_property("status", f"unavailable: {unavailable}")
        pytest.skip(unavailable)
    reason = backend.unsupported_reason(trace)
    claims = reason is None
    if name in CLAIMS:
        assert claims == (index in CLAIMS[name]), f"{name} {'claims' if claims else 'refuses'} {IDS[index]}: {reason}"
    if not claims:
        record_property("status", f"unsupported: {reason}")
        assert reason.strip(), "a refusal names its reason"
        return
    run = replay(trace, IDS[index], [name]).runs[0]
    comparison = run.comparison
    record_property("status", run.status.value)
    if comparison is not None:
        record_property("max_abs", f"{comparison.max_abs:.3e}")
        record_property("max_lse_abs", f"{comparison.max_lse_abs:.3e}")
    assert run.status is RunStatus.PASSED, (run.status.value, run.reason, comparison)
    assert comparison.nonfinite == 0


@pytest.mark.parametrize("index", range(len(NINE)), ids=IDS)
def test_replay_all_exits_0(index: int, tmp_path: Path) -> None:
    path = io.save(_trace(NINE[index]), tmp_path / "step.pt")
    result = CliRunner().invoke(main, ["replay", str(path), "--backend", "all"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("words", [NINE[0], NINE[2], NINE[7], ("decode-gqa", "kv_lens=0,9,300", "cross=1")], ids=lambda w: " ".join(w))
def test_decode_graph_replays(words, name: str, record_property) -> None:
    """Decode steps of the new kinds replayed in a CUDA graph (padded, poisoned) as well as eagerly."""
    trace = _trace(words)
    backend = registry.create(name)
    if backend.unavailable_reason() is not None:
        pytest.skip(backend.unavailable_reason())
    reason = backend.unsupported_reason(trace) or backend.graph_unsupported_reason(trace)
    if reason is not None:
        record_property("status", f"not captured: {reason}")
        pytest.skip(reason)
    result = replay(trace, " ".join(words), [name], ReplayOptions(cuda_graph=True))
    for run in result.runs:
        record_property(run.variant.label, run.status.value)
        assert run.status is RunStatus.PASSED, (run.variant, run.status.value, run.reason, run.comparison)
