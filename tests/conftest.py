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
