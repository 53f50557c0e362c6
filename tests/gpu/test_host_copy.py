"""The recorder's packed host copies on a real GPU: one pinned buffer per batch of device tensors
(record/host_copy.py) gives back every tensor bit for bit, whatever its type, shape or layout,
marks its arrival in host memory, and keeps a host tensor apart from the packing."""

from __future__ import annotations

import pytest
import torch

from attndbg.record.host_copy import HostCopy

pytestmark = pytest.mark.gpu


def test_a_packed_copy_gives_back_every_tensor_bit_for_bit() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randint(-(1 << 40), 1 << 40, (7,), device="cuda", dtype=torch.int64, generator=g)
    tensors = {
        "cu_seq_lens_q": torch.arange(0, 33, 3, device="cuda", dtype=torch.int32),  # 11 int32: an odd byte count before wider ones
        "position_ids": wide,
        "flag": torch.tensor([True, False, True], device="cuda"),
        "scores": torch.randn(3, 5, device="cuda", generator=g).to(torch.bfloat16),
        "strided": torch.randn(6, 4, device="cuda", generator=g)[:, 1],  # not contiguous
        "scalar": torch.tensor(7.5, device="cuda", dtype=torch.float64),  # 0-dim
        "empty": torch.empty(0, 3, device="cuda", dtype=torch.int32),
        "none": None,
        "host": torch.arange(4),  # a host tensor: cloned, not packed
    }
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    copy = HostCopy(tensors, stream=stream)
    host = copy.wait()
    assert copy.landed()
    assert set(host) == set(tensors)
    for name, t in tensors.items():
        if t is None:
            assert host[name] is None
            continue
        got = host[name]
        assert got.device.type == "cpu" and got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, t.cpu().view(torch.uint8) if t.dim() else t.cpu()), name
        assert got.untyped_storage().nbytes() == t.numel() * t.element_size(), name  # its own memory, not the pinned buffer
    assert copy.nbytes == sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)


def test_each_add_is_its_own_packed_copy_with_its_own_marker() -> None:
    copy = HostCopy({"a": torch.ones(3, device="cuda", dtype=torch.int32)})
    copy.add({"layer0.q": torch.full((2, 4), 2.0, device="cuda", dtype=torch.float16)})
    host = copy.wait()
    assert len(copy._markers) == 2 and copy.landed()
    assert host["a"].tolist() == [1, 1, 1] and host["layer0.q"].eq(2).all()
