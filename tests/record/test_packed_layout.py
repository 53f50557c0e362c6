"""The layout a step's device tensors are packed by (record/host_copy.py), on the CPU: every
tensor comes back bit for bit from one byte buffer, whatever its type, shape or strides (a
non-contiguous column broke the first GPU run), and every offset suits its type. The pinned
buffer and the device copy are tests/gpu/test_host_copy.py's."""

from __future__ import annotations

import torch

from attndbg.record.host_copy import _Packed, packed_layout


def test_every_tensor_comes_back_bit_for_bit_from_the_packed_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "cu_seq_lens_q": torch.arange(0, 33, 3, dtype=torch.int32),  # 44 bytes: not a multiple of 8
        "position_ids": torch.randint(-(1 << 40), 1 << 40, (7,), dtype=torch.int64, generator=g),
        "flag": torch.tensor([True, False, True]),
        "scores": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "strided": torch.randn(6, 4, generator=g)[:, 1],  # a column: stride 4, not contiguous
        "transposed": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "scalar": torch.tensor(7.5, dtype=torch.float64),  # 0-dim
        "empty": torch.empty(0, 3, dtype=torch.int32),
    }
    layout, flat, total = packed_layout(list(tensors.items()))
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    assert [name for name, *_ in layout][:2] == ["position_ids", "scalar"]  # the 8-byte types first
    for name, dtype, shape, offset, n in layout:
        assert offset % torch.empty(0, dtype=dtype).element_size() == 0, name
    buffer = torch.cat(flat)
    assert buffer.numel() == total
    got = _Packed(buffer, layout).unpack()
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
        assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size(), name  # its own memory
