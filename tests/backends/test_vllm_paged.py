"""vllm_paged (backends/vllm_paged.py): vLLM's PagedAttention v2 as a backend adapter. Its kernel
runs only on a GPU with a vLLM built for the installed torch (never on the CPU machine nor the GPU
image, whose torch vLLM does not pin): these tests pin down that it says exactly why, what it
declares, and the cache layout and plan it builds for the launch."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from click.testing import CliRunner

from attndbg import machine
from attndbg.backends import registry, vllm_paged
from attndbg.backends.vllm_paged import BLOCK_SIZE, INSTALL_HINT, VllmPagedBackend
from attndbg.cli import main
from attndbg.replay.runner import RunStatus, replay
from attndbg.replay.step_data import StepData
from tests.factories import make_trace


@pytest.fixture
def fresh_probe():
    vllm_paged._ops_problem.cache_clear()
    yield
    vllm_paged._ops_problem.cache_clear()


def test_backends_lists_it_with_why_it_cannot_run_here() -> None:
    if machine.cuda_available():
        pytest.skip("a CPU machine's reason")
    result = CliRunner().invoke(main, ["backends"], terminal_width=200)
    assert result.exit_code == 0 and "vllm_paged" in registry.backend_names()
    line = next(line for line in result.stdout.splitlines() if "vllm_paged" in line)
    assert "no CUDA GPU: vLLM's paged_attention_v2 runs only on NVIDIA GPUs" in line


def test_each_missing_piece_is_named(monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(machine, "module_available", lambda name: False)
    assert VllmPagedBackend().unavailable_reason() == INSTALL_HINT
    monkeypatch.setattr(machine, "module_available", lambda name: name == "vllm")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, as a torch mismatch does
    assert VllmPagedBackend().unavailable_reason().startswith("vllm is installed but vllm._custom_ops does not import (")
    vllm_paged._ops_problem.cache_clear()
    fake = types.ModuleType("vllm")
    fake._custom_ops = types.ModuleType("vllm._custom_ops")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", fake._custom_ops)
    assert VllmPagedBackend().unavailable_reason() == "this vllm's _custom_ops has no paged_attention_v2 (removed or renamed in this version)"
    fake._custom_ops.paged_attention_v2 = lambda *args: None
    vllm_paged._ops_problem.cache_clear()
    assert VllmPagedBackend().unavailable_reason() is None


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (("decode-gqa",), None),
        (("verify",), "MHA target verify: vLLM's PagedAttention v2 kernels run MHA decode only (a decode kernel: one query token per request)"),
        (("window-decode",), "vLLM's PagedAttention v2 kernels have no sliding window"),
        (("softcap",), "vLLM's PagedAttention v2 kernels have no logit soft-cap"),
    ],
)
def test_what_it_runs(spec: tuple[str, ...], reason: str | None) -> None:
    assert VllmPagedBackend().unsupported_reason(make_trace(*spec)) == reason


def test_replay_reports_it_unavailable_and_never_launches_it() -> None:
    if machine.cuda_available():
        pytest.skip("a CPU machine's reason")
    run = replay(make_trace("decode-gqa"), "t", [VllmPagedBackend.name]).runs[0]
    assert run.status is RunStatus.UNAVAILABLE and run.reason == VllmPagedBackend().unavailable_reason() and run.result is None


def test_plan_and_paged_cache_hold_each_request_in_its_blocks() -> None:
    """Token j of request b sits at block_tables[b, j // 16], position j % 16, in vLLM's v1/v2
    layout: key [blocks, Hkv, D/x, block, x], value [blocks, Hkv, D, block]; block 0 is null."""
    trace = make_trace("decode-gqa", "kv_lens=1,33,17", "dtype=float16")
    plan = VllmPagedBackend().derive_plan(trace)
    table, lens = plan.tensors["block_tables"], plan.tensors["seq_lens"]
    assert table.tolist() == [[1, 0, 0], [2, 3, 4], [5, 6, 0]] and lens.tolist() == [1, 33, 17]
    assert plan.scalars == {"block_size": BLOCK_SIZE, "max_seq_len": 33}
    inputs = StepData(trace).on("cpu")
    key, value = vllm_paged._paged_cache(trace, inputs, table, BLOCK_SIZE)
    x = 16 // key.element_size()
    for b in range(trace.batch.batch_size):
        slots = trace.batch.request_slots(b)
        for j in range(int(lens[b])):
            block, pos = int(table[b, j // BLOCK_SIZE]), j % BLOCK_SIZE
            k = key[block, :, :, pos, :].reshape(key.shape[1], -1)  # [Hkv, D/x * x]
            assert torch.equal(k, inputs.k_cache[slots[j]]) and key.shape[2] * x == trace.model.head_dim
            assert torch.equal(value[block, :, :, pos], inputs.v_cache[slots[j]])
    assert not key[0].any() and not value[0].any()  # the null block stays zero
