"""Shared test setup: GPU tests are skipped without a GPU; Triton runs interpreted on CPU."""

from __future__ import annotations

import pytest

from attndbg.machine import cuda_available, select_triton_mode

# Must happen before any kernel module is imported by a test module.
select_triton_mode()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _terminal_width_of_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands' output as piped (160 columns): a COLUMNS=80 inherited from the machine running
    the tests (the GPU machine sets one) would wrap verdict lines the tests read."""
    monkeypatch.delenv("COLUMNS", raising=False)
