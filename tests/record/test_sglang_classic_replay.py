"""SGL-classic CUDA-graph replays: `CudaGraphRunner.replay_prepare` pads the runner's static buffers
and passes the backend `init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens,
seq_lens_sum, ...)`; the adapter keeps the seq_lens_sum the runner passed (the engine's own) and
records the step once replay_prepare returned.

The installed SGLang is 0.5.23, which has no classic runner: `sglang.srt.model_executor.cuda_graph_runner`
does not exist (`importlib.util.find_spec` gives None; no `class CudaGraphRunner` anywhere in the
package; the decode runner is `runner.decode_cuda_graph_runner.DecodeCudaGraphRunner`, whose replays
go through `init_forward_metadata_out_graph`, tested in test_sglang_evidence). `install()` therefore
patches no runner here; `Runner` below is a stand-in written after SGLang 0.5.3's `replay_prepare`
(engines.md A5), wrapped with the toolkit's `hooks.patch(..., "replay_prepare", ...)` as `install()`
wraps the real class. The backend is a subclass of the real TritonAttnBackend: its classic
`init_forward_metadata_replay_cuda_graph` is wrapped by the installed hooks (`__init_subclass__`).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.check_cli import findings
from tests.record.sglang_steps import decode_batch
from tests.record.test_sglang_hooks import ROWS, make_backend, manifest, session  # noqa: F401 - `session` is a fixture
from attndbg.record import hooks
from attndbg.record.sglang import adapter
from attndbg.trace import io

I64, I32 = env.I64, env.I32
CAPTURE_BS, FILL = 4, 1


class ClassicTriton(env.TritonAttnBackend):
    """SGL-classic's Triton graph refill (triton_backend.py 0.5.3): kv_indptr / cuda_graph_kv_indices
    over the padded seq_lens, num_kv_splits for each row."""

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu=None):
        lens = seq_lens[:bs].to(I64)
        self.kv_indptr[1 : bs + 1] = torch.cumsum(lens, 0).to(I32)
        rows = self.req_to_token_pool.req_to_token[req_pool_indices[:bs].to(torch.long)]
        for b in range(bs):
            start = int(self.kv_indptr[b])
            self.cuda_graph_kv_indices[start : start + int(lens[b])] = rows[b, : int(lens[b])].to(I64)
        self.cuda_graph_num_kv_splits[:bs] = torch.clamp((lens + 3) // 4, 1, 8).to(I32)


class Runner:
    """SGLang 0.5.3's CudaGraphRunner, its replay_prepare only (engines.md A5)."""

    def __init__(self, backend, *, pass_raw_sum: bool = False):
        self.model_runner = SimpleNamespace(attn_backend=backend)
        self.seq_len_fill_value = FILL
        self.num_tokens_per_bs = 1
        self.capture_bs = [1, CAPTURE_BS]  # as with --cuda-graph-bs 1 4
        self.req_pool_indices = torch.zeros(CAPTURE_BS, dtype=I32)  # padded entries are never reset after this
        self.seq_lens = torch.full((CAPTURE_BS,), FILL, dtype=I32)
        self.seq_lens_cpu = torch.full((CAPTURE_BS,), FILL, dtype=I32)
        self.out_cache_loc = torch.zeros(CAPTURE_BS, dtype=I64)
        self.positions = torch.zeros(CAPTURE_BS, dtype=I64)
        self.pass_raw_sum = pass_raw_sum

    def replay_prepare(self, forward_batch):
        raw_bs = forward_batch.batch_size
        bs = next(size for size in self.capture_bs if size >= raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        seq_lens_sum = forward_batch.seq_lens_sum + (0 if self.pass_raw_sum else (bs - raw_bs) * self.seq_len_fill_value)
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], seq_lens_sum, None, forward_batch.forward_mode, None, seq_lens_cpu=self.seq_lens_cpu[:bs]
        )
        self.raw_bs, self.bs = raw_bs, bs


def test_the_installed_sglang_has_no_classic_runner() -> None:
    """When a release brings it back, install() wraps it and this file should drive the real class."""
    assert importlib.util.find_spec("sglang.srt.model_executor.cuda_graph_runner") is None


@pytest.mark.parametrize("pass_raw_sum", [False, True], ids=["padded-sum", "raw-sum"])
def test_classic_replay_keeps_the_seq_lens_sum_the_runner_passed(session, pass_raw_sum: bool) -> None:  # noqa: F811
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - the model's layer, alive while recording
    assert getattr(ClassicTriton.__dict__["init_forward_metadata_replay_cuda_graph"], hooks.MARK)
    backend = make_backend(ClassicTriton)
    backend.kv_indptr = torch.zeros(CAPTURE_BS + 1, dtype=I32)
    backend.cuda_graph_kv_indices = torch.full((64,), 99, dtype=I64)
    backend.cuda_graph_num_kv_splits = torch.full((CAPTURE_BS,), 8, dtype=I32)
    runner = Runner(backend, pass_raw_sum=pass_raw_sum)
    assert hooks.patch(Runner, "replay_prepare", adapter._wrap_replay_prepare) or getattr(Runner.__dict__["replay_prepare"], hooks.MARK)
    runner.replay_prepare(decode_batch())  # seq_lens [5, 9] in the bs-4 graph
    [entry] = manifest(session)
    assert entry["graph"] and entry["batch_size"] == 2
    path = session.out_dir / entry["file"]
    trace = io.load(path)
    assert trace.graph.capture_bs == CAPTURE_BS and trace.graph.padded_seq_lens.tolist() == [5, 9, FILL, FILL]
    assert trace.batch.slot_ids.tolist() == ROWS[1] + ROWS[5]
    assert trace.plan.scalars["seq_lens_sum"] == (14 if pass_raw_sum else 16)  # as passed, never recomputed
    found = findings(path, only="invariants,fill-value", backend="reference")
    if pass_raw_sum:
        assert ("fill-value", "seq-lens-sum-ignores-padding", "plan.seq_lens_sum") in found, found
    else:
        assert found == set()
