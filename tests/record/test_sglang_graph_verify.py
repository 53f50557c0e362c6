"""A CUDA-graph padded SGLang speculative VERIFY step with its VerifyMask, recorded through the
installed hooks: SGL-new's real `build_replay_fb_view` builds the padded view, a
subclass of the real TritonAttnBackend refills its graph buffers as SGLang 0.5.23's
`_update_target_verify_buffers` does (triton_backend.py: qo_indptr = arange(0, (bs+1)*n, n),
kv_indptr/cuda_graph_kv_indices over the padded seq_lens, the step's mask copied into the head of
`VerifyMask.buffer`, mask_indptr = cumsum(n * (seq_len + n)) over the padded rows), and
`attndbg check` judges the recorded step: clean as SGLang builds it, each planted mistake named.

The real body calls Triton kernels and a KV index translator (GPU), hence the stand-in.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.check_cli import finding_texts, findings
from tests.record.engines import import_engine
from tests.record.test_sglang_evidence import N, NEED, PARENTS, PREFIX, VERIFY_ROWS, this_steps_mask, verify_batch
from tests.record.test_sglang_hooks import make_backend, manifest, session  # noqa: F401 - `session` is a fixture
from attndbg.trace import io, tree
from attndbg.trace.schema import EngineBuffer

runner_module = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
VerifyMask = import_engine("sglang.srt.layers.attention.verify_mask").VerifyMask
I64, I32 = env.I64, env.I32
CAPTURE_BS, RAW_BS, FILL = 4, 2, 1  # two verify requests replayed in the bs-4 graph, padded rows seq_len 1
MAX_CONTEXT = 16
PADDED_NEED = NEED + (CAPTURE_BS - RAW_BS) * N * (FILL + N)  # mask elements mask_indptr spans, padding included


class GraphVerifyTriton(env.TritonAttnBackend):
    """`init_forward_metadata_out_graph` of a TARGET_VERIFY replay, as SGLang 0.5.23 fills it."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        bs = len(forward_batch.req_pool_indices)  # the padded bs
        seq_lens = forward_batch.seq_lens.to(I64)
        n = forward_batch.spec_info.draft_token_num
        self.qo_indptr[: bs + 1] = torch.arange(0, (bs + 1) * n, n, dtype=I32)
        self.kv_indptr[1 : bs + 1] = torch.cumsum(seq_lens, 0).to(I32)
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.to(torch.long)]
        for b in range(bs):
            start = int(self.kv_indptr[b])
            self.cuda_graph_kv_indices[start : start + int(seq_lens[b])] = rows[b, : int(seq_lens[b])].to(I64)
        mask = forward_batch.spec_info.custom_mask
        self.verify_mask_buffer()[: mask.shape[0]] = mask  # a no-op copy when the mask is the buffer itself
        self.mask_indptr[1 : bs + 1] = torch.cumsum(n * (seq_lens + n), 0)
        if self.plant is not None:
            self.plant(self)

    def verify_mask_buffer(self) -> torch.Tensor:
        return self._verify_mask.buffer

    def get_cuda_graph_seq_len_fill_value(self):
        return self.fill


def graph_backend(plant=None, *, fill: int = FILL) -> GraphVerifyTriton:
    backend = make_backend(GraphVerifyTriton)
    backend.req_to_token_pool = env.req_pool(VERIFY_ROWS)
    backend.plant = plant
    backend.fill = fill
    backend.num_draft_tokens = N
    backend.qo_indptr = torch.zeros(CAPTURE_BS + 1, dtype=I32)
    backend.kv_indptr = torch.zeros(CAPTURE_BS + 1, dtype=I32)
    backend.mask_indptr = torch.zeros(CAPTURE_BS + 1, dtype=I64)
    backend.cuda_graph_kv_indices = torch.full((CAPTURE_BS * MAX_CONTEXT,), 99, dtype=I64)  # stale from earlier replays
    backend.cuda_graph_num_kv_splits = torch.full((CAPTURE_BS,), 8, dtype=I32)
    # SGL-new's VerifyMask for the captured max bs (tree_mask_numel, FULL_MASK): its tail holds earlier steps' rows.
    buffer = torch.rand(CAPTURE_BS * N * (MAX_CONTEXT + N), generator=torch.Generator().manual_seed(3)) < 0.5
    backend._verify_mask = VerifyMask(buffer=buffer, mode=env.TreeMaskMode.FULL_MASK, max_bs=CAPTURE_BS)
    return backend


def replay(session, backend: GraphVerifyTriton, fb) -> str:  # noqa: F811 - the fixture's value
    """SGL-new's runner: the padded input buffers, its own view builder, then the backend's out-graph init."""
    pad, fill = CAPTURE_BS - RAW_BS, backend.fill
    n_tokens = CAPTURE_BS * N
    buffers = SimpleNamespace(
        input_ids=torch.zeros(n_tokens, dtype=I64),
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=I64)]),
        seq_lens=torch.cat([fb.seq_lens, torch.full((pad,), fill, dtype=I64)]),
        seq_lens_cpu=torch.cat([fb.seq_lens_cpu, torch.full((pad,), fill, dtype=I64)]),
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * N, dtype=I64)]),
        positions=torch.cat([fb.positions, torch.zeros(pad * N, dtype=I64)]),
        encoder_lens=None,
        mamba_track_indices=None,
    )
    fb.max_seq_len_host = None
    view = runner_module.build_replay_fb_view(fb, buffers, CAPTURE_BS, RAW_BS, n_tokens, None, fill, env.ForwardMode.TARGET_VERIFY, False)
    before = len(manifest(session))
    backend.init_forward_metadata_out_graph(view)
    entries = manifest(session)
    assert len(entries) == before + 1 and entries[-1]["graph"], entries
    return str(session.out_dir / entries[-1]["file"])


def in_buffer(backend: GraphVerifyTriton) -> torch.Tensor:
    """SGL-new: build_tree_kernel_efficient writes the step's mask into the VerifyMask buffer, and
    spec_info.custom_mask is that very tensor."""
    buffer = backend._verify_mask.buffer
    buffer[:NEED] = this_steps_mask()
    return buffer


def test_graph_padded_verify_with_its_verify_mask_is_clean(session) -> None:  # noqa: F811
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - the model's layer, alive while recording
    backend = graph_backend()
    path = replay(session, backend, verify_batch(in_buffer(backend)))
    trace = io.load(path)
    assert trace.graph.capture_bs == CAPTURE_BS and trace.batch.batch_size == RAW_BS
    assert trace.graph.padded_seq_lens.tolist() == PREFIX + [FILL] * (CAPTURE_BS - RAW_BS)
    # The mask is the capacity buffer: the spec keeps this step's layout, the plan what mask_indptr spans.
    assert torch.equal(trace.spec.custom_mask, this_steps_mask())
    assert trace.buffers["spec.custom_mask"].capacity and trace.buffers["spec.custom_mask"].length == backend._verify_mask.buffer.numel()
    assert trace.plan.tensors["custom_mask"].numel() == PADDED_NEED and trace.buffers["plan.custom_mask"].read == PADDED_NEED
    assert trace.plan.scalars["seq_lens_sum"] == sum(PREFIX) + (CAPTURE_BS - RAW_BS) * FILL  # the view's, padding included
    assert findings(path) == set()


def test_graph_padded_verify_with_a_too_long_mask(session) -> None:  # noqa: F811
    """The step's own mask sized from a wrong EagleVerifyInput.seq_lens_sum (10, not 5): the replay
    copies all of it into the VerifyMask head; the spec keeps the engine's mask at its real length."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    mask = torch.ones(N * 10 + RAW_BS * N * N, dtype=torch.bool)
    mask[:NEED] = this_steps_mask()
    path = replay(session, graph_backend(), verify_batch(mask, spec_seq_lens_sum=10))
    assert io.load(path).spec.custom_mask.numel() == mask.numel()
    found = findings(path)
    assert ("tree-mask", "mask-length", f"spec.custom_mask[{NEED}]") in found, found
    assert ("invariants", "seq-lens-sum", "plan.scalars.spec_seq_lens_sum") in found, found


def test_graph_padded_verify_with_a_stale_request_block(session) -> None:  # noqa: F811
    """Request 1's block of the VerifyMask still holds an earlier step's tree (a chain) where this
    step's tree (token 3 under the root) should be: read by the kernel, so named at its row."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    backend = graph_backend()
    buffer = in_buffer(backend)
    earlier = tree.full_mask(torch.tensor([PARENTS[0], [-1, 0, 1, 2]]), torch.tensor(PREFIX))
    start = N * (PREFIX[0] + N)
    buffer[start:NEED] = earlier[start:NEED]
    path = replay(session, backend, verify_batch(buffer))
    texts = finding_texts(path, only="tree-mask")
    found = {(f["check"], f["location"].get("field"), f["location"].get("request")) for f in texts}
    assert {("mask-mismatch", "spec.custom_mask[49]", 1), ("mask-mismatch", "plan.custom_mask[49]", 1)} <= found, found
    assert all(f["location"].get("request") == 1 for f in texts), texts  # request 0's block is this step's


def test_graph_padded_verify_padded_with_seq_len_0(session) -> None:  # noqa: F811
    """A runner that pads verify rows with seq_len 0 for SGLang's Triton (whose kernels need 1)."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    backend = graph_backend(fill=0)
    path = replay(session, backend, verify_batch(in_buffer(backend)))
    assert ("fill-value", "padded-seq-len-unsupported", f"graph.padded_seq_lens[{RAW_BS}]") in findings(path, only="fill-value")


def test_graph_padded_verify_with_mask_indptr_over_the_prefix_only(session) -> None:  # noqa: F811
    """mask_indptr = cumsum(n * seq_len), the draft columns forgotten: every request after the first
    reads its mask rows from the wrong offset."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841

    def prefix_only(backend: GraphVerifyTriton) -> None:
        backend.mask_indptr[1 : CAPTURE_BS + 1] = torch.cumsum(N * backend.kv_indptr.diff().to(I64), 0)

    backend = graph_backend(prefix_only)
    path = replay(session, backend, verify_batch(in_buffer(backend)))
    assert findings(path, only="tree-mask,invariants", backend="reference") == {("tree-mask", "mask-indptr", "plan.mask_indptr[1]")}


def test_capacity_buffers_are_cut_on_the_device_and_the_trace_is_unchanged(session, tmp_path, monkeypatch) -> None:  # noqa: F811
    """The graph buffers are sliced to what the padded seq_lens make the kernels read before the host
    copy; the step written is byte for byte the one written when the whole buffer was copied and cut
    on the host (the recorder before the device cut)."""
    from attndbg.record.sglang import adapter
    from attndbg.record import session as session_module
    from attndbg.record.options import RecordOptions

    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    copied: list[dict[str, int]] = []
    real_copy = session_module.HostCopy

    def spy(tensors):
        copied.append({k: v.numel() for k, v in tensors.items() if v is not None})
        return real_copy(tensors)

    monkeypatch.setattr(session_module, "HostCopy", spy)

    def step_bytes(rec) -> bytes:
        backend = graph_backend()
        path = replay(rec, backend, verify_batch(in_buffer(backend)))
        rec.flush()
        return Path(path).read_bytes()

    cut = step_bytes(session)
    session_module.end_session()
    with monkeypatch.context() as m:
        m.setattr(adapter, "cut_on_device", lambda plan, reads: None)  # the recorder before: whole copies
        whole = step_bytes(session_module.start_session(RecordOptions(out_dir=str(tmp_path / "whole"))))
    assert cut == whole
    kv_read = sum(PREFIX) + (CAPTURE_BS - RAW_BS) * FILL
    assert copied[0]["plan.kv_indices"] == kv_read and copied[0]["plan.custom_mask"] == PADDED_NEED
    assert copied[1]["plan.kv_indices"] == CAPTURE_BS * MAX_CONTEXT and copied[1]["plan.custom_mask"] == CAPTURE_BS * N * (MAX_CONTEXT + N)
    trace = io.load(next(iter(sorted((tmp_path / "whole").glob("*.pt")))))
    assert trace.buffers["plan.kv_indices"] == EngineBuffer(length=CAPTURE_BS * MAX_CONTEXT, read=kv_read, capacity=True)
