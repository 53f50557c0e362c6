"""--devices numbers the GPUs as the process sees them (after CUDA_VISIBLE_DEVICES), as its workers
will (checks/workers.py worker_devices); a GPU that is not there is one line, exit 2, before any work."""

from __future__ import annotations

import pytest
import torch

from attndbg import machine
from attndbg.cli.options import parse_devices
from attndbg.cli.common import BadInput


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_the_default_is_every_visible_gpu(two_gpus: None) -> None:
    assert parse_devices(None) == (0, 1)


def test_a_gpu_past_the_visible_ones_is_refused(two_gpus: None) -> None:
    assert parse_devices("1,0") == (1, 0)
    with pytest.raises(BadInput, match=r"--devices 0,2: GPU 2 is not here \(2 visible, numbered from 0\)"):
        parse_devices("0,2")


def test_numbers_only() -> None:
    with pytest.raises(BadInput, match="expected comma-separated GPU numbers"):
        parse_devices("a,b")
