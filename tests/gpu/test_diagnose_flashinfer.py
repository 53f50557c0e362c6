"""Diagnosis by reproduction on FlashInfer's own kernel (GPU): FlashInfer packs each request's
[n, prefix + n] verify mask into bytes, little-endian (segment_packbits); a kernel reading those
bytes big-endian applies, bit for bit, the mask that byte-reversing the true one gives. The real
FlashInfer paged prefill kernel, planned with that mask, produces the engine output, and check
must name `mask-bit-order` (byte packing) for every branched request, and no other model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attndbg.backends import registry
from attndbg.backends.flashinfer import INSTALL_HINT
from attndbg.diagnose.mask_models import _tree_rows
from attndbg.machine import module_available
from tests.diagnose.test_diagnose import attributed, engine_said, inputs_of, recorded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]

VERIFY = ("verify", "heads=4:2", "head_dim=128", "prefix_lens=20,33")


def byte_reversed(mask: torch.Tensor) -> torch.Tensor:
    """[n, k] bool -> the mask a reader of its little-endian packed bytes sees when it reads them big-endian."""
    flat = mask.flatten()
    pad = (-flat.numel()) % 8
    read = torch.cat([flat, torch.zeros(pad, dtype=torch.bool)]).view(-1, 8).flip(1).flatten()
    return read[: flat.numel()].view_as(mask)


def test_flashinfer_reading_its_packed_mask_bytes_big_endian() -> None:
    trace = recorded(*VERIFY)
    backend = registry.create("flashinfer")
    plan = backend.derive_plan(trace)
    mask = torch.cat([byte_reversed(_tree_rows(trace, b)).flatten() for b in range(trace.batch.batch_size)])
    plan = replace(plan, tensors={**plan.tensors, "custom_mask": mask})
    output = backend.run(trace, inputs_of(trace, "cuda"), plan).output.cpu()
    params = attributed(engine_said(trace, output), "mask-bit-order")
    assert [(p["request"], p["packing"]) for p in params] == [(0, "byte"), (1, "byte")]
