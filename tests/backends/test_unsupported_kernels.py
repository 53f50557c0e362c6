"""A configuration the library cannot build or run is reported as unsupported with its reason,
not as an error row.

FlashInfer is not installed on this CPU machine, so its JIT failure is tested as a classification
of the exception its builder raises (the text below is what flashinfer/jit/cpp_ext.py's run_ninja
raises: RuntimeError("Ninja build failed. Ninja output:\\n" + the build log)); the real compile of
head_dim 13 runs in tests/gpu/test_plan_guard_gpu.py. The runner's handling is tested through a real
path: an mla plan recorded for another implementation than the one this machine runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.backends.base import KernelError, KernelUnsupported
from attndbg.backends.flashinfer_runtime import compile_failure, library_error
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from tests.factories import make_trace

NVCC_ERROR = (
    "/flashinfer/include/flashinfer/attention/decode.cuh(712): error: static assertion failed with "
    '"head_dim must be a multiple of the vector size"'
)
NINJA_LOG = "\n".join(
    [
        "[1/3] /usr/local/cuda/bin/nvcc --generate-dependencies-with-compile ... -c batch_decode.cu",
        "FAILED: batch_decode.cuda.o",
        NVCC_ERROR,
        "1 error detected in the compilation of \"batch_decode.cu\".",
        "ninja: build stopped: subcommand failed.",
    ]
)


def test_a_failed_jit_build_is_unsupported_with_the_librarys_reason() -> None:
    model = make_trace("decode-mha", "head_dim=13", "kv_lens=5,9", "heads=4:4").model
    error = library_error(RuntimeError("Ninja build failed. Ninja output:\n" + NINJA_LOG), model)
    assert isinstance(error, KernelUnsupported)
    assert str(error) == f"FlashInfer does not compile head_dim 13 (Ninja build failed. Ninja output:; {NVCC_ERROR})"
    older = library_error(RuntimeError("Error building extension 'batch_decode_head_dim_13'"), model)
    assert isinstance(older, KernelUnsupported) and str(older).endswith("(Error building extension 'batch_decode_head_dim_13')")


@pytest.mark.parametrize(
    "raised",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("Invalid configuration : NUM_MMA_Q=1 NUM_MMA_D_QK=1"),
        ValueError("Ninja build failed"),  # not what the builder raises: not a build failure
    ],
)
def test_other_library_errors_stay_errors(raised: Exception) -> None:
    model = make_trace("decode-mha", "kv_lens=5,9").model
    error = library_error(raised, model)
    assert compile_failure(raised) is None
    assert type(error) is KernelError and str(error) == f"{type(raised).__name__}: {str(raised).splitlines()[0]}"


def test_the_runner_reports_unsupported_kernels_as_unsupported() -> None:
    trace = make_trace("mla-decode", "heads=2", "kv_lens=3,70", "page_size=64")
    running = MLABackend().impl().value
    if running == "flashmla":
        pytest.skip("this machine runs FlashMLA itself")
    recorded = MLABackend(MLAOptions(impl="flashmla")).derive_plan(trace)
    run = replay(replace(trace, plan=recorded), "t", ["mla"], ReplayOptions(plan=PlanSource.RECORDED)).runs[0]
    assert run.status is RunStatus.UNSUPPORTED, (run.status, run.reason)
    assert run.reason == f"the plan is for mla impl='flashmla'; this machine runs impl={running!r}"


@pytest.mark.parametrize(
    ("head_dim", "tensor_cores", "defect"),
    [(80, False, True), (80, True, True), (96, False, True), (192, False, True), (192, True, False), (128, False, False), (64, True, False), (13, False, False), (13, True, False)],
)
def test_flashinfer_decode_head_dim_defect_is_declared_for_the_measured_release(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, tensor_cores: bool, defect: bool
) -> None:
    """The release measured by bench/flashinfer_head_dims.py decodes non-power-of-two head dims
    wrongly (or faults): declared as a known library defect with the reproduction command; powers of
    two, 192 on tensor cores, and releases not measured are run; a head dim that is not a multiple
    of 8 (never measured: FlashInfer does not build it) keeps the compiler's reason."""
    import types

    from attndbg.backends import flashinfer

    monkeypatch.setattr(flashinfer.machine, "module_available", lambda name: True)
    monkeypatch.setattr(flashinfer, "_flashinfer", lambda: types.SimpleNamespace(__version__="0.7.2.post1"))
    reason = flashinfer.decode_head_dim_defect(head_dim, tensor_cores)
    assert (reason is not None) == defect
    if defect:
        assert reason.startswith(f"known FlashInfer 0.7.2.post1 defect: batch decode at head_dim {head_dim}")
        assert f"python bench/flashinfer_head_dims.py --one {head_dim}" in reason
    monkeypatch.setattr(flashinfer, "_flashinfer", lambda: types.SimpleNamespace(__version__="0.8.0"))
    assert flashinfer.decode_head_dim_defect(head_dim, tensor_cores) is None


@pytest.mark.parametrize(("head_dim", "defect"), [(80, True), (96, True), (64, False), (128, False), (192, False), (256, False)])
def test_flashinfer_prefill_head_dim_defect_is_declared_for_the_measured_release(monkeypatch: pytest.MonkeyPatch, head_dim: int, defect: bool) -> None:
    """bench/flashinfer_sweep.py's prefill part on the H100: the measured release's paged prefill faults
    at head_dim 80 and 96 (192 raises its own error, which needs no declaration); declared on extend
    steps only, and only for that release."""
    import types

    from attndbg.backends import flashinfer

    monkeypatch.setattr(flashinfer.machine, "module_available", lambda name: True)
    monkeypatch.setattr(flashinfer, "_flashinfer", lambda: types.SimpleNamespace(__version__="0.7.2.post1"))
    extend = make_trace("extend-prefix", "heads=4:4", f"head_dim={head_dim}")
    declared = flashinfer.FlashInferBackend().known_defect(extend)
    assert (declared is not None) == defect
    if defect:
        assert declared.startswith(f"known FlashInfer 0.7.2.post1 defect: paged prefill at head_dim {head_dim}")
    monkeypatch.setattr(flashinfer, "_flashinfer", lambda: types.SimpleNamespace(__version__="0.8.0"))
    assert flashinfer.FlashInferBackend().known_defect(extend) is None


def test_a_known_flashinfer_defect_is_refused_by_default_and_run_by_a_checks_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured release's head_dim-80 decode defect is a prediction (Backend.known_defect), not
    a capability gap: replay's adapters refuse the step with it, a check's adapters run it (their
    kernels detector then confirms or contradicts it), and nothing else about the step is refused."""
    import types

    from attndbg.backends import flashinfer
    from attndbg.detector_api.context import CheckContext

    monkeypatch.setattr(flashinfer.machine, "module_available", lambda name: True)
    monkeypatch.setattr(flashinfer, "_flashinfer", lambda: types.SimpleNamespace(__version__="0.7.2.post1"))
    trace = make_trace("decode-mha", "heads=4:4", "head_dim=80", "kv_lens=37,91")
    backend = flashinfer.FlashInferBackend()
    assert backend.capabilities().gap(trace) is None and backend.configuration_reason(trace) is None
    declared = backend.known_defect(trace)
    assert declared is not None and declared.startswith("known FlashInfer 0.7.2.post1 defect: batch decode at head_dim 80")
    assert backend.unsupported_reason(trace) == declared
    checking = CheckContext(trace=trace, path="t.pt").adapter("flashinfer")
    assert checking.run_known_defects and checking.unsupported_reason(trace) is None
    assert flashinfer.FlashInferBackend().known_defect(make_trace("decode-mha", "heads=4:4", "head_dim=128", "kv_lens=37,91")) is None
