"""The SGLang adapter keeps the evidence: each mistake is planted in the engine's own metadata (a real
ForwardBatch, EagleVerifyInput, VerifyMask, the real Triton ForwardMetadata and SGL-new's replay view),
recorded through the installed hooks, and `check` must name it with its class and location; the
same step without the mistake gives no finding, eager and under CUDA-graph padding.

The backends are subclasses of the real TritonAttnBackend whose metadata methods do what SGLang
0.5.23's do (triton_backend.py: `kv_indices = torch.empty(seq_lens_sum)` filled up to
kv_indptr[-1], `update_sliding_window_buffer`, `mask_indptr = cumsum(n * (seq_len + n))`); the
real bodies need a GPU and a KV index translator. `torch.empty`'s garbage is -1 here, so it is
deterministic.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.engines import import_engine
from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io, tree
from tests.record.sglang_steps import decode_batch
from tests.record.test_sglang_hooks import make_backend, manifest, session  # noqa: F401 - `session` is a fixture

runner_module = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
VerifyMask = import_engine("sglang.srt.layers.attention.verify_mask").VerifyMask
I64, I32 = env.I64, env.I32
DECODE_ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}
GARBAGE = -1  # what torch.empty left in a slot no request owns


def filled(rows: torch.Tensor, lens: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr, indices): `indices = torch.empty(size)` with each request's row head written at its indptr."""
    indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(I32)
    indices = torch.full((size,), GARBAGE, dtype=I64)
    for b in range(lens.numel()):
        n = int(lens[b])
        indices[int(indptr[b]) : int(indptr[b]) + n][: max(min(n, size - int(indptr[b])), 0)] = rows[b, :n][: max(min(n, size - int(indptr[b])), 0)].to(I64)
    return indptr, indices


def window_list(rows: torch.Tensor, lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's update_sliding_window_buffer: (window_kv_indptr, window_kv_indices, window_kv_offsets)."""
    wlen = torch.clamp(lens, max=window)
    start = lens - wlen
    indptr = torch.nn.functional.pad(torch.cumsum(wlen, 0), (1, 0)).to(I32)
    indices = torch.cat([rows[b, int(start[b]) : int(lens[b])] for b in range(lens.numel())]).to(I64)
    return indptr, indices, start.to(I32)


def triton_metadata(backend, fb, *, offsets_shift: int = 0):
    """The ForwardMetadata SGLang's eager init_forward_metadata builds for a decode or verify batch."""
    rows = backend.req_to_token_pool.req_to_token[fb.req_pool_indices]
    lens = fb.seq_lens.to(I64)
    kv_indptr, kv_indices = filled(rows, lens, fb.seq_lens_sum)
    window = backend.sliding_window_size
    w_indptr = w_indices = w_offsets = w_splits = None
    if window:
        w_indptr, w_indices, w_offsets = window_list(rows, lens, window)
        w_offsets = w_offsets + offsets_shift
    verify = fb.forward_mode == env.ForwardMode.TARGET_VERIFY
    if not verify:
        splits = torch.clamp((lens + 3) // 4, 1, 8).to(I32)
        if window:
            w_splits = torch.ones_like(splits)
        bs = lens.numel()
        return env.TritonForwardMetadata(
            torch.empty(bs, 4, 8, 16), torch.empty(bs, 4, 8), None, splits, kv_indptr, kv_indices, None, None, None, w_indptr, w_indices, w_splits, None
        )
    n = fb.spec_info.draft_token_num
    qo_indptr = torch.arange(0, (lens.numel() + 1) * n, n, dtype=I32)
    mask_indptr = torch.nn.functional.pad(torch.cumsum(n * (lens + n), 0), (1, 0)).to(I64)
    return env.TritonForwardMetadata(None, None, n, None, kv_indptr, kv_indices, qo_indptr, fb.spec_info.custom_mask, mask_indptr, w_indptr, w_indices, None, w_offsets)


def eager_backend(rows: dict[int, list[int]], *, window: int | None = None, offsets_shift: int = 0, plant=None):
    """`plant(metadata)`: a mistake made in the metadata before the hook records it."""

    class EagerTriton(env.TritonAttnBackend):
        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = triton_metadata(self, forward_batch, offsets_shift=offsets_shift)
            if plant is not None:
                plant(self.forward_metadata)

    backend = make_backend(EagerTriton)
    backend.req_to_token_pool = env.req_pool(rows)
    backend.sliding_window_size = window
    backend._verify_mask = None
    return backend


def record(session, backend, fb) -> str:  # noqa: F811 - the fixture's value
    before = len(manifest(session))
    backend.init_forward_metadata(fb)
    entries = manifest(session)
    assert len(entries) == before + 1, entries
    return str(session.out_dir / entries[-1]["file"])


def findings(path: str) -> set[tuple[str, str, str]]:
    reports = list(check_steps(path, parse_only(None), CheckOptions(backends=("triton",))))
    assert all(r.checked for r in reports), [r.error for r in reports]
    return {(f.kind.value, f.check, f.location.field or "") for r in reports for f in r.findings}


# -- seq_lens_sum and the kv_indices SGLang sizes from it ---------------------------------------------------


@pytest.mark.parametrize("seq_lens_sum", [14, 20, 12])
def test_decode_seq_lens_sum(session, seq_lens_sum: int) -> None:  # noqa: F811
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - the model's layer, alive while recording
    fb = decode_batch()  # seq_lens [5, 9]: sum 14
    fb.seq_lens_sum = seq_lens_sum
    path = record(session, eager_backend(DECODE_ROWS), fb)
    trace = io.load(path)
    assert trace.plan.scalars["seq_lens_sum"] == seq_lens_sum
    assert trace.plan.tensors["kv_indices"].numel() == seq_lens_sum  # as the engine allocated it, untrimmed
    assert trace.buffers["plan.kv_indices"].capacity is False and trace.buffers["plan.kv_indices"].read == 14
    if seq_lens_sum == 14:
        assert findings(path) == set()
        return
    found = findings(path)
    assert ("invariants", "seq-lens-sum", "plan.scalars.seq_lens_sum") in found
    assert ("invariants", "indptr-end", "plan.kv_indptr[-1]") in found, found


def test_graph_decode_seq_lens_sum_and_padding(session) -> None:  # noqa: F811
    """SGL-new replay: the view's seq_lens_sum is SGLang's own (raw + padded x fill); a runner that
    passes the raw sum, or pads with seq_len 0 for Triton, is named."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841

    class GraphTriton(env.TritonAttnBackend):
        fill = 1

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            bs, lens = forward_batch.batch_size, forward_batch.seq_lens.to(I64)
            indptr, indices = filled(self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices], lens, int(lens.sum()))
            self.kv_indptr[: bs + 1] = indptr
            self.cuda_graph_kv_indices[: indices.numel()] = indices
            self.cuda_graph_num_kv_splits[:bs] = torch.clamp((lens + 3) // 4, 1, 8).to(I32)

        def get_cuda_graph_seq_len_fill_value(self):
            return self.fill

    def replay(fill: int, raw_sum: bool) -> set:
        backend = make_backend(GraphTriton)
        backend.fill = fill
        backend.kv_indptr = torch.zeros(9, dtype=I32)
        backend.cuda_graph_kv_indices = torch.full((64,), 99, dtype=I64)  # stale from earlier replays
        backend.cuda_graph_num_kv_splits = torch.full((8,), 8, dtype=I32)
        buffers = SimpleNamespace(
            input_ids=torch.zeros(8, dtype=I64),
            req_pool_indices=torch.tensor([1, 5] + [0] * 6, dtype=I64),
            seq_lens=torch.tensor([5, 9] + [fill] * 6, dtype=I64),
            seq_lens_cpu=torch.tensor([5, 9] + [fill] * 6, dtype=I64),
            out_cache_loc=torch.tensor([15, 38] + [0] * 6, dtype=I64),
            positions=torch.tensor([4, 8] + [0] * 6, dtype=I64),
            encoder_lens=None,
            mamba_track_indices=None,
        )
        view = runner_module.build_replay_fb_view(decode_batch(), buffers, 4, 2, 4, None, fill, env.ForwardMode.DECODE, False)
        if raw_sum:
            view.seq_lens_sum = 14  # the raw batch's sum, padding ignored
        before = len(manifest(session))
        backend.init_forward_metadata_out_graph(view)
        entries = manifest(session)
        assert len(entries) == before + 1 and entries[-1]["graph"]
        path = str(session.out_dir / entries[-1]["file"])
        assert io.load(path).buffers["plan.kv_indices"].capacity  # a graph buffer: cut where the kernel stops
        return findings(path)

    assert replay(1, raw_sum=False) == set()
    assert ("fill-value", "seq-lens-sum-ignores-padding", "plan.seq_lens_sum") in replay(1, raw_sum=True)
    assert ("fill-value", "padded-seq-len-unsupported", "graph.padded_seq_lens[2]") in replay(0, raw_sum=False)


# -- verify masks: too long, stale tail, capacity buffers ------------------------------------------------------

N = 4
PREFIX = [3, 2]
PARENTS = [[-1, 0, 0, 1], [-1, 0, 1, 0]]
NEXT_TOKEN = [[1, 3, -1, -1], [1, 2, -1, -1]]
NEXT_SIBLING = [[-1, 2, -1, -1], [-1, 3, -1, -1]]
VERIFY_ROWS = {1: [11, 12, 13, 44, 45, 46, 47], 6: [21, 22, 30, 31, 32, 33]}
NEED = N * sum(PREFIX) + 2 * N * N  # 52: SGLang's FULL mask for this step


def verify_batch(mask: torch.Tensor, *, prefix=PREFIX, parents=PARENTS, next_token=NEXT_TOKEN, next_sibling=NEXT_SIBLING, rows=VERIFY_ROWS, spec_seq_lens_sum=None):
    depths = [tree.depths(torch.tensor(p)).tolist() for p in parents]
    bs = len(prefix)
    spec_info = env.EagleVerifyInput(
        draft_token=torch.arange(bs * N, dtype=I64),
        custom_mask=mask,
        positions=torch.tensor([p + d for p, ds in zip(prefix, depths) for d in ds], dtype=I64),
        retrieve_index=torch.arange(bs * N, dtype=I64).view(bs, N),
        retrieve_next_token=torch.tensor(next_token, dtype=I64),
        retrieve_next_sibling=torch.tensor(next_sibling, dtype=I64),
        retrieve_cum_len=None,
        spec_steps=N - 1,
        topk=max(sum(1 for q in p if q == 0) for p in parents),
        draft_token_num=N,
        capture_hidden_mode=env.CaptureHiddenMode.FULL,
        seq_lens_sum=sum(prefix) if spec_seq_lens_sum is None else spec_seq_lens_sum,
        seq_lens_cpu=torch.tensor(prefix, dtype=I64),
    )
    pools = list(rows)
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=spec_info.draft_token,
        req_pool_indices=torch.tensor(pools, dtype=I64),
        seq_lens=torch.tensor(prefix, dtype=I64),
        out_cache_loc=torch.tensor([s for r, p in zip(pools, prefix) for s in rows[r][p : p + N]], dtype=I64),
        seq_lens_sum=sum(prefix),
        positions=spec_info.positions,
        spec_info=spec_info,
        seq_lens_cpu=torch.tensor(prefix, dtype=I64),
    )


def this_steps_mask() -> torch.Tensor:
    return tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX))


def test_verify_mask_clean(session) -> None:  # noqa: F811
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    path = record(session, eager_backend(VERIFY_ROWS), verify_batch(this_steps_mask()))
    trace = io.load(path)
    assert trace.buffers["spec.custom_mask"].length == NEED and not trace.buffers["spec.custom_mask"].capacity
    assert trace.buffers["plan.custom_mask"].read == NEED
    assert findings(path) == set()


def test_verify_mask_too_long(session) -> None:  # noqa: F811
    """EagleVerifyInput.seq_lens_sum = 10 instead of 5: build_tree sizes the FULL mask 10·n + bs·n²
    (torch.full True) and writes this step's blocks into its head."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    mask = torch.ones(N * 10 + 2 * N * N, dtype=torch.bool)
    mask[:NEED] = this_steps_mask()
    path = record(session, eager_backend(VERIFY_ROWS), verify_batch(mask, spec_seq_lens_sum=10))
    assert io.load(path).spec.custom_mask.numel() == N * 10 + 2 * N * N  # recorded at its real length
    found = findings(path)
    assert ("tree-mask", "mask-length", f"spec.custom_mask[{NEED}]") in found
    assert ("tree-mask", "mask-length", f"plan.custom_mask[{NEED}]") in found
    assert ("invariants", "seq-lens-sum", "plan.scalars.spec_seq_lens_sum") in found
    spec_finding = next(f for r in check_steps(path, parse_only("tree-mask")) for f in r.findings if f.location.field == f"spec.custom_mask[{NEED}]")
    assert "spec_seq_lens_sum = 10" in spec_finding.cause and "all the fill value True" in spec_finding.evidence


def test_verify_mask_stale_tail(session) -> None:  # noqa: F811
    """The mask buffer of an earlier, larger step (prefixes 6 and 5) reused: this step's blocks in its
    head, that step's tree rows left in its tail."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    earlier = tree.full_mask(torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0]]), torch.tensor([6, 5]))
    mask = earlier.clone()
    mask[:NEED] = this_steps_mask()
    path = record(session, eager_backend(VERIFY_ROWS), verify_batch(mask))
    found = findings(path)
    assert {f for f in found if f[0] == "tree-mask"} == {("tree-mask", "mask-length", f"spec.custom_mask[{NEED}]"), ("tree-mask", "mask-length", f"plan.custom_mask[{NEED}]")}
    causes = [f.cause for r in check_steps(path, parse_only("tree-mask")) for f in r.findings]
    assert all("stale tail" in c for c in causes), causes


def test_verify_mask_in_a_capacity_buffer_is_clean(session) -> None:  # noqa: F811
    """SGL-new's VerifyMask: spec_info.custom_mask is the backend's buffer for max_bs x max_context_len;
    its tail holds earlier steps' rows that no kernel of this step reads."""
    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841
    buffer = torch.zeros(4 * N * (16 + N), dtype=torch.bool)
    buffer[NEED:] = torch.rand(buffer.numel() - NEED, generator=torch.Generator().manual_seed(0)) < 0.5
    buffer[:NEED] = this_steps_mask()
    backend = eager_backend(VERIFY_ROWS)
    backend._verify_mask = VerifyMask(buffer=buffer, mode=env.TreeMaskMode.FULL_MASK, max_bs=4)
    path = record(session, backend, verify_batch(buffer))
    trace = io.load(path)
    assert trace.spec.custom_mask.numel() == NEED and trace.buffers["spec.custom_mask"].length == buffer.numel()
    assert trace.buffers["plan.custom_mask"].capacity and trace.plan.tensors["custom_mask"].numel() == NEED
    assert findings(path) == set()


# -- sliding-window lists ---------------------------------------------------------------------------------------

WINDOW = 4
CHAIN = dict(prefix=[7, 3], parents=[[-1, 0, 1, 2]] * 2, next_token=[[1, 2, 3, -1]] * 2, next_sibling=[[-1] * 4] * 2, rows={1: [11, 12, 13, 14, 15, 16, 17, 44, 45, 46, 47], 6: [21, 22, 23, 30, 31, 32, 33]})


@pytest.mark.parametrize("shift", [0, 1])
def test_verify_window_offsets(session, shift: int) -> None:  # noqa: F811
    """SGLang's Triton SWA verify: kv_indices hold the whole prefix (full-attention layers read them),
    window_kv_* the window; window_kv_offsets = prefix - window_len (3 and 0 here) index the mask.
    Right offsets are clean (the detector once matched them against kv_indices: 0 != 3)."""
    layer = env.sgl.radix_attention.RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=WINDOW)  # noqa: F841
    mask = tree.full_mask(torch.tensor(CHAIN["parents"]), torch.tensor(CHAIN["prefix"]))
    backend = eager_backend(CHAIN["rows"], window=WINDOW, offsets_shift=shift)
    path = record(session, backend, verify_batch(mask, **CHAIN))
    trace = io.load(path)
    assert trace.model.sliding_window == WINDOW
    assert trace.plan.tensors["window_kv_offsets"].tolist() == [3 + shift, shift]
    assert trace.plan.tensors["window_kv_indices"].tolist() == [14, 15, 16, 17, 21, 22, 23]
    found = findings(path)
    if shift == 0:
        assert found == set()
    else:
        assert ("tree-mask", "window-offset", "plan.window_kv_offsets[0]") in found, found


ONE_SHORT = ("invariants", "window-kv", "plan.window_kv_indptr[1]")


@pytest.mark.parametrize("planted", [False, True])
def test_decode_window_list(session, planted: bool) -> None:  # noqa: F811
    """SGLang's decode window list as 0.5.23 builds it, min(seq_len, W) keys, is one key short of a
    window of radius W (sglang PR #32087): named on request 0 (kv_len 5 > W = 4); a wrong gather
    within the list the engine built is still named."""
    layer = env.sgl.radix_attention.RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=WINDOW)  # noqa: F841

    def early(metadata) -> None:  # request 1's window gathered one column early (a wrong window_kv_start_idx)
        metadata.window_kv_indices[4:8] = torch.tensor([34, 35, 36, 37])

    backend = eager_backend(DECODE_ROWS, window=WINDOW, plant=early if planted else None)
    path = record(session, backend, decode_batch())
    trace = io.load(path)
    assert trace.plan.tensors["window_kv_indptr"].tolist() == [0, 4, 8]
    found = findings(path)
    expected = {ONE_SHORT, ("invariants", "window-kv", "plan.window_kv_indices[4]")} if planted else {ONE_SHORT}
    assert {f for f in found if f[0] == "invariants"} == expected and found == expected, found
    reports = list(check_steps(path, parse_only("invariants"), CheckOptions(backends=("triton",))))
    [one_short] = [f for r in reports for f in r.findings if f.location.field == ONE_SHORT[2]]
    assert "sglang PR #32087" in one_short.cause and (one_short.data["expected"], one_short.data["found"]) == (5, 4)


def test_a_decode_window_list_of_w_plus_1_keys_is_clean(session) -> None:  # noqa: F811
    """The list PR #32087 asks for (and FlashInfer keeps): min(seq_len, W + 1) keys, the query's own included."""
    layer = env.sgl.radix_attention.RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=WINDOW)  # noqa: F841

    def whole_window(metadata) -> None:
        rows = torch.tensor([[11, 12, 13, 14, 15, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35, 36, 37, 38]])
        indptr, indices, _ = window_list(rows, torch.tensor([5, 9]), WINDOW + 1)
        metadata.window_kv_indptr, metadata.window_kv_indices = indptr, indices

    path = record(session, eager_backend(DECODE_ROWS, window=WINDOW, plant=whole_window), decode_batch())
    assert io.load(path).plan.tensors["window_kv_indptr"].tolist() == [0, 5, 10]
    assert findings(path) == set()


def test_every_plan_field_the_table_says_is_recorded_is(session) -> None:  # noqa: F811
    """SGLANG_FIELDS against a windowed eager decode and verify step: every Triton plan tensor and
    scalar the table places in the trace is there."""
    from attndbg.record.sglang.fields import SGLANG_FIELDS

    layer = env.sgl.radix_attention.RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=WINDOW)  # noqa: F841
    mask = tree.full_mask(torch.tensor(CHAIN["parents"]), torch.tensor(CHAIN["prefix"]))
    traces = [
        io.load(record(session, eager_backend(DECODE_ROWS, window=WINDOW), decode_batch())),
        io.load(record(session, eager_backend(CHAIN["rows"], window=WINDOW), verify_batch(mask, **CHAIN))),
    ]
    names = {name for row in SGLANG_FIELDS for name in row.plan}
    assert {"kv_indices", "custom_mask", "window_kv_offsets", "scalars.seq_lens_sum", "scalars.spec_seq_lens_sum"} <= names
    for name in names:
        scalar = name.removeprefix("scalars.")
        assert any(scalar in t.plan.scalars if name != scalar else name in t.plan.tensors for t in traces), name
