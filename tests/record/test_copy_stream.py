"""Which stream a host copy's packing runs on (record/host_copy.py `_on`), on the CPU with stand-in
streams: with the current stream handed down it switches to the step's stream and back without
looking the current stream up again; without it, torch.cuda.stream() does as before."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attndbg.record import host_copy


@dataclass(frozen=True)
class _Stream:
    name: str
    device_index: int = 0


def test_a_known_current_stream_is_set_back_without_a_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: set_to.append(s.name))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: pytest.fail("current stream looked up"))
    with host_copy._on(_Stream("compute"), _Stream("engine")):
        assert set_to == ["compute"]
    assert set_to == ["compute", "engine"]
    with pytest.raises(ValueError), host_copy._on(_Stream("compute"), _Stream("engine")):
        raise ValueError("the packing failed")
    assert set_to[-1] == "engine"  # set back on the way out of an error too
    with host_copy._on(None, _Stream("engine")):
        pass
    assert len(set_to) == 4  # no stream: nothing switched


def test_without_the_current_stream_or_across_devices_torch_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[str] = []

    class _Context:
        def __init__(self, stream: _Stream):
            self.stream = stream

        def __enter__(self) -> None:
            entered.append(self.stream.name)

        def __exit__(self, *exc: object) -> None:
            entered.append("back")

    monkeypatch.setattr(torch.cuda, "stream", _Context)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: pytest.fail("set without knowing the current stream"))
    with host_copy._on(_Stream("compute"), None):
        pass
    with host_copy._on(_Stream("compute", device_index=1), _Stream("engine")):
        pass
    assert entered == ["compute", "back", "compute", "back"]
