"""The collector's choice of API records, on a stand-in of cupti-python's module (no CUPTI here)."""

from __future__ import annotations

from types import SimpleNamespace

from attndbg.timeline.collector import Collector

RUNTIME, DRIVER = 1, 2
NAMES = {
    (RUNTIME, 1): "cudaGetDevice_v3020",
    (RUNTIME, 2): "cudaLaunchKernel_v7000",
    (RUNTIME, 3): "cudaStreamIsCapturing_v10000",
    (RUNTIME, 4): "cudaGraphLaunch_v10000",
    (DRIVER, 1): "cuCtxGetCurrent",
    (DRIVER, 2): "cuLaunchKernelEx",
}


class _CuptiError(Exception):
    pass


def _cupti(switches: list[tuple[str, int, int]], *, per_call: bool = True) -> SimpleNamespace:
    def name(domain: int, cbid: int) -> str:
        if (domain, cbid) not in NAMES:
            raise _CuptiError("CUPTI_ERROR_INVALID_PARAMETER")
        return NAMES[(domain, cbid)]

    module = SimpleNamespace(CallbackDomain=SimpleNamespace(RUNTIME_API=RUNTIME, DRIVER_API=DRIVER), cuptiError=_CuptiError, get_callback_name=name)
    if per_call:
        module.activity_enable_runtime_api = lambda cbid, on: switches.append(("runtime", cbid, on))
        module.activity_enable_driver_api = lambda cbid, on: switches.append(("driver", cbid, on))
    return module


def test_only_the_launch_calls_are_recorded() -> None:
    # torch makes many API calls per launch; only a launch's (and cudaGraphLaunch's) record places a
    # kernel, so every other call is switched off (the 200-step check's timeline cost +250%).
    switches: list[tuple[str, int, int]] = []
    Collector("t")._only_launches(_cupti(switches))
    assert switches == [("runtime", 1, 0), ("runtime", 3, 0), ("driver", 1, 0)]


def test_a_cupti_without_per_call_switches_records_everything_and_says_so() -> None:
    collector = Collector("t")
    collector._only_launches(_cupti([], per_call=False))
    assert collector.take().notes == ["this cupti-python cannot record single API calls: every runtime and driver call is recorded (a slower --timeline)"]
