"""SGLang steps recorded through attndbg's installed SGLang hooks, for the real-bug corpus.

The hooks (attndbg/record/sglang/adapter.py) wrap the metadata entry points of every subclass of
SGLang's real `AttentionBackend`. The backends here are subclasses of SGLang's real backend classes
(`TritonAttnBackend`, `FlashInferAttnBackend`; FA3's class needs sgl_kernel, so its stand-in is a
plain `AttentionBackend` subclass that names itself "fa3" the way SGL-new stamps
`decode_attention_backend_str`). Their metadata methods do what the SGLang code of the bug (or of
its fix) did, with tensors only: the real bodies call GPU kernels. The metadata objects are
SGLang's own classes (Triton's `ForwardMetadata`, FlashInfer's `DecodeMetadata` /
`PrefillMetadata`, FA3's `FlashAttentionMetadata` read from SGLang's source); a FlashInfer wrapper
cannot be built without a GPU, so a namespace holds the attributes FlashInfer's `plan()` keeps.
Graph replays go through SGL-new's real `build_replay_fb_view`, over static buffers filled the way
the engine version of the bug filled them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from attndbg.record.options import RecordOptions
from attndbg.record.session import RecordingSession, end_session, start_session
from attndbg.record.sglang import adapter
from attndbg.record.sglang import layers as sglang_layers
from attndbg.trace import io, tree
from tests.record import sglang_env as env
from tests.record.engines import import_engine
from tests.record.test_sglang_plans import sglang_class

runner_module = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
flashinfer_backend = env.sgl.flashinfer_backend
AttentionBackend = env.sgl.base_attn_backend.AttentionBackend
FlashAttentionMetadata = sglang_class("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionMetadata")
I64, I32 = torch.int64, torch.int32
POOL_SLOTS = 95  # KV pool slots; SGLang allocates size + page_size rows, slot 0 is the dummy slot
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@contextlib.contextmanager
def recording(out: Path, *, layers: tuple[int, ...] = ()) -> Iterator[RecordingSession]:
    """A recording session writing into `out` (in this process), with the SGLang hooks installed."""
    end_session()
    session = start_session(RecordOptions(out_dir=str(out), layers=layers, writer="thread"))
    adapter.install()
    try:
        yield session
    finally:
        sglang_layers.flush()  # a step still waiting for its layers (ModelRunner.forward would submit it)
        session.flush()
        stopped = session.stats.stopped_reason
        end_session()
        if stopped:
            raise RuntimeError(f"the recorder stopped: {stopped}")


def written(session: RecordingSession) -> list[dict]:
    session.flush()
    path = session.out_dir / io.MANIFEST
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def layer(*, window: int | None = None, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, v_head_dim: int | None = None) -> Any:
    """A real RadixAttention layer (the recorder reads the model's shape from the latest one)."""
    kwargs: dict[str, Any] = {}
    if window is not None:
        kwargs["sliding_window_size"] = window
    if v_head_dim is not None:
        kwargs["v_head_dim"] = v_head_dim
    return env.sgl.radix_attention.RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0, **kwargs)


def prepare(backend: Any, rows: dict[int, list[int]], *, req_to_token: Tensor | None = None, page_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Set the attributes the recorder reads of a backend built with object.__new__ (the real
    __init__ needs a ModelRunner and a GPU): its pools, head count, window."""
    pool = env.req_pool(rows, size=max(8, max(rows) + 1), width=max(64, *(len(r) for r in rows.values())))
    if req_to_token is not None:
        pool.req_to_token = req_to_token
    backend.req_to_token_pool = pool
    backend.token_to_kv_pool = SimpleNamespace(size=POOL_SLOTS, dtype=dtype, page_size=page_size)
    backend.page_size = page_size
    backend.num_head = HEADS
    backend.data_type = dtype
    backend.max_kv_splits = 8
    backend.sliding_window_size = None
    backend.forward_metadata = None
    return backend


Plan = Callable[[Any, Any], None]  # (backend, forward batch or replay view) -> sets the metadata / graph buffers


class PlannedBackend(AttentionBackend):
    """The metadata entry points and the attention call of a corpus backend: `plan_step` (the
    engine code of the step) fills its metadata, eager or at a graph replay. A subclass of SGLang's
    AttentionBackend, so the recorder's hooks wrap these methods as they wrap the real backends'."""

    plan_step: Plan
    fill: int = 1

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.plan_step(self, forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        self.plan_step(self, forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.fill

    run_layer: Callable[..., Tensor]  # (q, k, v, layer, forward_batch) -> the output the engine computed

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: Any, forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> Tensor:
        """The attention call (the real one launches GPU kernels): what `run_layer` says the engine computed."""
        return self.run_layer(q, k, v, layer, forward_batch)


class CorpusTriton(PlannedBackend, env.TritonAttnBackend):
    """SGLang's Triton backend."""


class CorpusFlashInfer(PlannedBackend, flashinfer_backend.FlashInferAttnBackend):
    """SGLang's FlashInfer backend."""


class CorpusFA3(PlannedBackend):
    """SGLang's FlashAttention (FA3) backend: its module imports sgl_kernel (GPU only), so this
    subclass of the real AttentionBackend carries the name SGL-new stamps on backends."""

    decode_attention_backend_str = "fa3"
    prefill_attention_backend_str = "fa3"


def kv_pool(k_rows: Tensor, v_rows: Tensor, *, page_size: int = 1) -> SimpleNamespace:
    """The KV pool as the recorder reads it (MHATokenToKVPool.get_kv_buffer(layer_id) -> the
    layer's [slots, H_kv, D] key and value buffers): one layer's contents."""
    return SimpleNamespace(size=k_rows.shape[0] - page_size, dtype=k_rows.dtype, page_size=page_size, get_kv_buffer=lambda layer_id: (k_rows, v_rows))


def backend(cls: type, rows: dict[int, list[int]], plan_step: Plan, **options: Any) -> Any:
    """An instance of `cls` (built without its GPU __init__) planning with `plan_step`."""
    made = object.__new__(cls)
    made.plan_step = plan_step
    return prepare(made, rows, **options)


def wrapper(**buffers: Tensor) -> SimpleNamespace:
    """What a FlashInfer wrapper keeps of its plan() (flashinfer/decode.py, prefill.py), under
    FlashInfer's attribute names: `_paged_kv_indptr_buf`, `_qo_indptr_buf`, `_custom_mask_buf`, ..."""
    return SimpleNamespace(**{f"_{name}": value for name, value in buffers.items()})


# -- forward batches ---------------------------------------------------------------------------------------


def decode_batch(rows: dict[int, list[int]], seq_lens: list[int]) -> Any:
    """A DECODE ForwardBatch: seq_lens include the token of this step (written to the last column)."""
    pools = list(rows)
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=torch.arange(100, 100 + len(seq_lens), dtype=I64),
        req_pool_indices=torch.tensor(pools, dtype=I64),
        seq_lens=torch.tensor(seq_lens, dtype=I64),
        out_cache_loc=torch.tensor([rows[r][n - 1] for r, n in zip(pools, seq_lens)], dtype=I64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor([n - 1 for n in seq_lens], dtype=I64),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=I64),
    )


def extend_batch(rows: dict[int, list[int]], prefix_lens: list[int], extend_lens: list[int]) -> Any:
    """An EXTEND ForwardBatch: each request's new tokens follow its cached prefix in its row."""
    pools = list(rows)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    return env.ForwardBatch(
        forward_mode=env.ForwardMode.EXTEND,
        batch_size=len(seq_lens),
        input_ids=torch.arange(sum(extend_lens), dtype=I64),
        req_pool_indices=torch.tensor(pools, dtype=I64),
        seq_lens=torch.tensor(seq_lens, dtype=I64),
        out_cache_loc=torch.tensor([s for r, p, n in zip(pools, prefix_lens, seq_lens) for s in rows[r][p:n]], dtype=I64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor([c for p, n in zip(prefix_lens, seq_lens) for c in range(p, n)], dtype=I64),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=I64),
        extend_num_tokens=sum(extend_lens),
        extend_seq_lens=torch.tensor(extend_lens, dtype=I32),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=I32),
        extend_start_loc=torch.tensor([sum(extend_lens[:b]) for b in range(len(extend_lens))], dtype=I32),
        extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
    )


def draft_extend_v2_batch(rows: dict[int, list[int]], prefix_lens: list[int], window: int, accepted: list[int]) -> Any:
    """A DRAFT_EXTEND_V2 ForwardBatch as spec v2's `prepare_for_draft_extend` builds it (SGLang
    0.5.23, speculative/eagle_worker_common.py): every request runs its whole verify window of
    `window` tokens (the slots after its prefix), whatever it accepted; extend_prefix_lens = the
    prefix, extend_seq_lens = window, and seq_lens bumped to prefix + window before the backend
    plans; the spec input carries the window as num_tokens_per_req and the accepted counts."""
    fb = extend_batch(rows, prefix_lens, [window] * len(prefix_lens))
    fb.forward_mode = env.ForwardMode.DRAFT_EXTEND_V2
    accept = torch.tensor(accepted, dtype=I32)
    fb.spec_info = env.EagleDraftExtendInput(
        num_correct_drafts=accept - 1, num_accept_tokens=accept, num_tokens_per_req=window, num_tokens_for_logprob_per_req=window
    )
    return fb


def verify_batch(rows: dict[int, list[int]], prefix_lens: list[int], parents: list[list[int]], *, custom_mask: Tensor | None = None, algorithm: Any = None) -> Any:
    """A TARGET_VERIFY ForwardBatch of an EAGLE tree (`parents`: each draft token's parent index,
    -1 for the root): seq_lens are the prefixes, the draft tokens' slots follow them in the row,
    positions are prefix + depth, and the FULL mask is SGLang's (unless `custom_mask` is given)."""
    n = len(parents[0])
    bs = len(prefix_lens)
    parents_t = torch.tensor(parents, dtype=I64)
    depths = [tree.depths(torch.tensor(p)).tolist() for p in parents]
    first_child = [[next((j for j in range(n) if p[j] == i), -1) for i in range(n)] for p in parents]
    sibling = [[next((j for j in range(i + 1, n) if p[j] == p[i] and p[i] >= 0), -1) for i in range(n)] for p in parents]
    mask = tree.full_mask(parents_t, torch.tensor(prefix_lens)) if custom_mask is None else custom_mask
    spec_info = env.EagleVerifyInput(
        draft_token=torch.arange(bs * n, dtype=I64),
        custom_mask=mask,
        positions=torch.tensor([p + d for p, ds in zip(prefix_lens, depths) for d in ds], dtype=I64),
        retrieve_index=torch.arange(bs * n, dtype=I64).view(bs, n),
        retrieve_next_token=torch.tensor(first_child, dtype=I64),
        retrieve_next_sibling=torch.tensor(sibling, dtype=I64),
        retrieve_cum_len=None,
        spec_steps=max(max(d) for d in depths),
        topk=max(sum(1 for q in p if q == 0) for p in parents),
        draft_token_num=n,
        capture_hidden_mode=env.CaptureHiddenMode.FULL,
        seq_lens_sum=sum(prefix_lens),
        seq_lens_cpu=torch.tensor(prefix_lens, dtype=I64),
    )
    pools = list(rows)
    fb = env.ForwardBatch(
        forward_mode=env.ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=spec_info.draft_token,
        req_pool_indices=torch.tensor(pools, dtype=I64),
        seq_lens=torch.tensor(prefix_lens, dtype=I64),
        out_cache_loc=torch.tensor([s for r, p in zip(pools, prefix_lens) for s in rows[r][p : p + n]], dtype=I64),
        seq_lens_sum=sum(prefix_lens),
        positions=spec_info.positions,
        spec_info=spec_info,
        seq_lens_cpu=torch.tensor(prefix_lens, dtype=I64),
    )
    if algorithm is not None:
        fb.spec_algorithm = algorithm
    return fb


def replay_view(
    fb: Any,
    *,
    capture_bs: int,
    fill: int,
    per_req: int = 1,
    max_bs: int = 8,
    seq_lens_sum: int | None = None,
    padded_positions: Tensor | None = None,
    padded_req_pool_indices: Tensor | None = None,
) -> Any:
    """SGL-new's replay view of `fb` padded to `capture_bs`, over static buffers of `max_bs` rows
    filled as its runner fills them (seq_lens with `fill`; req_pool_indices, out_cache_loc and
    positions zeroed), unless the step's engine left `padded_positions` / `padded_req_pool_indices`
    (the padded rows' values) stale. `seq_lens_sum`: what the runner handed the backend, when not
    SGLang's own padded sum."""
    raw_bs = int(fb.batch_size)
    pad = capture_bs - raw_bs
    tokens = capture_bs * per_req

    def padded(head: Tensor, width: int, rows: int, tail: Tensor | None, value: int) -> Tensor:
        buffer = torch.full((rows,), value, dtype=I64)
        buffer[: head.numel()] = head
        if tail is not None:
            buffer[head.numel() : head.numel() + tail.numel()] = tail
        return buffer[: max(width, rows)]

    buffers = SimpleNamespace(
        input_ids=torch.zeros(max_bs * per_req, dtype=I64),
        req_pool_indices=padded(fb.req_pool_indices, capture_bs, max_bs, padded_req_pool_indices, 0),
        seq_lens=padded(fb.seq_lens, capture_bs, max_bs, None, fill),
        seq_lens_cpu=padded(fb.seq_lens_cpu, capture_bs, max_bs, None, fill),
        out_cache_loc=padded(fb.out_cache_loc, tokens, max_bs * per_req, None, 0),
        positions=padded(fb.positions, tokens, max_bs * per_req, padded_positions, 0),
        encoder_lens=None,
        mamba_track_indices=None,
    )
    fb.max_seq_len_host = None
    view = runner_module.build_replay_fb_view(fb, buffers, capture_bs, raw_bs, tokens, None, fill, fb.forward_mode, False)
    assert view.num_padding == pad
    if seq_lens_sum is not None:
        view.seq_lens_sum = seq_lens_sum
    return view


def record_eager(session: RecordingSession, made: Any, fb: Any) -> None:
    """Plan `fb`; the hook writes the step (with --layers, once its layers ran: not checked here)."""
    before = len(written(session))
    made.init_forward_metadata(fb)
    if not session.options.layers and len(written(session)) != before + 1:
        raise RuntimeError(f"the SGLang hooks recorded no step ({session.stats.stopped_reason or 'no reason given'})")


def record_replay(session: RecordingSession, made: Any, view: Any) -> None:
    before = len(written(session))
    made.init_forward_metadata_out_graph(view)
    if len(written(session)) != before + 1:
        raise RuntimeError(f"the SGLang hooks recorded no graph replay ({session.stats.stopped_reason or 'no reason given'})")


# -- the plans SGLang's backends build (tensors only; the real bodies launch Triton kernels) ------------------


def kv_lists(made: Any, fb: Any, lens: Tensor, *, size: int | None = None, garbage: int = -1) -> tuple[Tensor, Tensor]:
    """(kv_indptr, kv_indices) as `create_flashinfer_kv_indices_triton` fills them: each request's
    req_to_token row head at its offset, in a buffer of `size` elements (the rest `garbage`)."""
    rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices.to(torch.long)]
    indptr = torch.nn.functional.pad(torch.cumsum(lens.to(I64), 0), (1, 0)).to(I32)
    total = int(indptr[-1]) if size is None else size
    indices = torch.full((total,), garbage, dtype=I64)
    for b in range(lens.numel()):
        start, n = int(indptr[b]), int(lens[b])
        indices[start : start + n] = rows[b, :n].to(I64)
    return indptr, indices


def split_counts(lens: Tensor, max_splits: int = 8) -> Tensor:
    """A split count per request in [1, max_splits] (SGLang's heuristic depends on the device;
    any count in range is a correct plan)."""
    return torch.clamp((lens.to(I64) + 3) // 4, 1, max_splits).to(I32)


def triton_decode_metadata(made: Any, fb: Any, *, size: int | None = None) -> Any:
    """SGLang Triton's eager decode ForwardMetadata."""
    lens = fb.seq_lens.to(I64)
    indptr, indices = kv_lists(made, fb, lens, size=size)
    bs = lens.numel()
    return env.TritonForwardMetadata(
        torch.empty(bs, HEADS, 8, HEAD_DIM), torch.empty(bs, HEADS, 8), None, split_counts(lens), indptr, indices, None, None, None, None, None, None, None
    )


# -- what the engine's attention computed (float32 torch; the real kernels need a GPU) ----------------


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of queries q [T, Hq, D] over keys k / values v [K, Hkv, D] (KV heads repeated for
    their query heads), query t seeing key j where visible[t, j]: output [T, Hq, Dv] and its
    natural-log LSE [T, Hq], in float32. A row that sees no key gets output 0 and LSE -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("thd,khd->thk", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    return torch.einsum("thk,khd->thd", weights, v), lse


def unpack_bits(packed: Tensor, first_bit: int, count: int) -> Tensor:
    """`count` bits of FlashInfer's little-endian packed mask from bit `first_bit` on."""
    bits = ((packed.to(I64)[:, None] >> torch.arange(8)) & 1).flatten().to(torch.bool)
    return bits[first_bit : first_bit + count]


def flashinfer_paged_prefill(paged: Any, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
    """What FlashInfer's paged prefill kernel computes from what a wrapper holds after plan() (page
    size 1): request b's queries (`_qo_indptr_buf`) over the slots it lists (`_paged_kv_indptr_buf`
    / `_paged_kv_indices_buf`), with the custom mask `_custom_mask_buf` when the wrapper holds one
    (request b's q_len x kv_len block, row-major, from byte `_mask_indptr_buf[b]`; it replaces the
    causal mask), else causal with the queries at the end of the KV. The caches hold this step's
    new K/V already (SGLang writes them before the paged call)."""
    qo, indptr, indices = paged._qo_indptr_buf.to(I64), paged._paged_kv_indptr_buf.to(I64), paged._paged_kv_indices_buf.to(I64)
    mask = getattr(paged, "_custom_mask_buf", None)
    out = []
    for b in range(qo.numel() - 1):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        slots = indices[int(indptr[b]) : int(indptr[b + 1])]
        n, kv = rows.stop - rows.start, slots.numel()
        if mask is not None:
            visible = unpack_bits(mask, int(paged._mask_indptr_buf[b]) * 8, n * kv).view(n, kv)
        else:
            visible = torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]
        out.append(attend(q[rows], k_cache[slots], v_cache[slots], visible, scale)[0])
    return torch.cat(out)


def triton_extend(metadata: Any, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
    """What SGLang's Triton extend kernel computes from its ForwardMetadata: request b's queries
    (`qo_indptr`) over the slots its prefix list names (`kv_indptr` / `kv_indices`, read from the
    cache, every one visible to every query) and over this step's new K/V from its inputs, causally.
    The cache holds the new K/V already (SGLang writes them before the kernel)."""
    qo, indptr, indices = metadata.qo_indptr.to(I64), metadata.kv_indptr.to(I64), metadata.kv_indices.to(I64)
    out = []
    for b in range(qo.numel() - 1):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        listed = indices[int(indptr[b]) : int(indptr[b + 1])]
        n, length = rows.stop - rows.start, listed.numel()
        visible = torch.cat([torch.ones(n, length, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
        keys, values = torch.cat([k_cache[listed], k[rows]]), torch.cat([v_cache[listed], v[rows]])
        out.append(attend(q[rows], keys, values, visible, scale)[0])
    return torch.cat(out)


def layer_data(seed: int, *, tokens: int, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, v_dim: int | None = None) -> dict[str, Tensor]:
    """One layer's q and new K/V for `tokens` tokens, and the KV pool's rows (bf16, drawn)."""
    g = torch.Generator().manual_seed(seed)
    v_dim = head_dim if v_dim is None else v_dim
    slots = POOL_SLOTS + 1 + 200
    return {
        "q": torch.randn(tokens, heads, head_dim, generator=g).to(torch.bfloat16),
        "k": torch.randn(tokens, kv_heads, head_dim, generator=g).to(torch.bfloat16),
        "v": torch.randn(tokens, kv_heads, v_dim, generator=g).to(torch.bfloat16),
        "k_pool": torch.randn(slots, kv_heads, head_dim, generator=g).to(torch.bfloat16),
        "v_pool": torch.randn(slots, kv_heads, v_dim, generator=g).to(torch.bfloat16),
    }


def with_new_kv(data: dict[str, Tensor], fb: Any) -> tuple[Tensor, Tensor]:
    """The pool's K/V with this step's new tokens written to their slots (out_cache_loc)."""
    k, v = data["k_pool"].clone(), data["v_pool"].clone()
    k[fb.out_cache_loc.to(I64)], v[fb.out_cache_loc.to(I64)] = data["k"], data["v"]
    return k, v
