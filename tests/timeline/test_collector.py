"""The collector's choice of API records, on a stand-in of cupti-python's module (no CUPTI here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from attndbg.timeline import collector as collector_module
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


class _Registering:
    """The parts of cupti-python `_register_buffers` uses: a first call, and its own registration."""

    def __init__(self) -> None:
        self.registered: list[Any] = []

    def get_timestamp(self) -> int:
        return 1

    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        self.registered.append((requested, completed))


def _collector(reads_buffers: bool) -> Collector:
    collector = Collector("t")
    collector._converter = SimpleNamespace(reads_buffers=reads_buffers)  # type: ignore[assignment]
    return collector


def test_buffers_are_registered_through_cuptis_c_api_where_every_kind_has_a_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, Any]] = []
    monkeypatch.setattr(collector_module, "loaded_cupti", lambda: "/site/cupti/lib/libcupti.so.13")
    monkeypatch.setattr(collector_module, "Buffers", lambda library, on_buffer: made.append((library, on_buffer)) or SimpleNamespace(problems=["a CUPTI buffer's records were lost: ValueError: x"]))
    cupti, collector = _Registering(), _collector(True)
    collector._register_buffers(cupti)
    assert made == [("/site/cupti/lib/libcupti.so.13", collector._completed_buffer)] and collector._buffers is not None
    # What went wrong in CUPTI's thread reaches the timeline's notes at the next take.
    assert cupti.registered == [] and collector.take().notes == ["a CUPTI buffer's records were lost: ValueError: x"]


@pytest.mark.parametrize("case", ["no layout", "no library", "registration fails"])
def test_otherwise_cupti_pythons_objects_are_read_and_the_timeline_says_why(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector_module, "loaded_cupti", lambda: None if case == "no library" else "/lib/libcupti.so")

    def refused(library: str, on_buffer: Any) -> None:
        raise OSError("cuptiActivityRegisterCallbacks returned CUPTI error 7")

    monkeypatch.setattr(collector_module, "Buffers", refused)
    cupti, collector = _Registering(), _collector(case != "no layout")
    collector._register_buffers(cupti)
    assert cupti.registered == [(collector._requested, collector._completed)] and collector._buffers is None
    why = {
        "no layout": "this cupti-python has no layout for one of the record kinds placed",
        "no library": "CUPTI's library is not mapped in this process",
        "registration fails": "OSError: cuptiActivityRegisterCallbacks returned CUPTI error 7",
    }[case]
    assert collector.take().notes == [f"CUPTI's records are read through cupti-python's objects, a slower --timeline ({why})"]
