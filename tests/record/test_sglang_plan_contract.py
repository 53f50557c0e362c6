"""One plan contract between the SGLang recorder and the checker: per (backend,
mode, eager or graph-padded), the metadata SGLang's backend holds -> the recorder's own reader
(`plan_from_backend` with the recorded layer's Model, as `record_step` calls it) -> a saved trace ->
`attndbg check`: no finding on correct metadata, the planted mistake named on wrong metadata.

The metadata classes are SGLang's own where they build on the CPU (FlashInfer's DecodeMetadata and
PrefillMetadata; FA3's FlashAttentionMetadata and FlashMLA's FlashMLADecodeMetadata loaded from
SGLang's source, see test_sglang_plans.sglang_class). What they hold cannot: FlashInfer's wrappers
allocate CUDA workspaces and plan on the GPU, and SGLang's backends need a ModelRunner and a GPU. So
the wrappers and backends are SimpleNamespaces holding, field by field, the attributes SGLang and
FlashInfer keep, under their exact names (FlashInfer prefill.py/decode.py plan(): `_qo_indptr_buf`,
`_paged_kv_indptr_buf`, `_paged_kv_indices_buf`, `_paged_kv_last_page_len_buf`,
`_custom_mask_buf`, `_mask_indptr_buf`, `_use_tensor_cores`; SGLang flashinfer_backend.py
`decode_use_tensor_cores`, flashattention_backend.py `page_size`, `topk`,
`forward_metadata_spec_decode_expand`, flashmla_backend.py `page_size`, `num_draft_tokens`), with the
values SGLang's code computes for the step (engines.md A4.1, A4.4, A4.5).

Checked with `--only invariants,tree-mask,fill-value` on the CPU: the recorded plans of FlashInfer,
FA3 and FlashMLA are read by their adapters' plan views and layouts without running their kernels
(tree-mask also replays verify steps through our Triton kernels, interpreted: tiny shapes).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace.build import source
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.record.sglang.model import model_from_layer
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.record.sglang.spec import spec_from_verify_input
from attndbg.trace import io, tree
from attndbg.trace.schema import Batch, Graph, Model, Plan, Spec, Trace
from tests.record.test_sglang_hooks import session as hook_session  # noqa: F401  (fixture)
from tests.record.test_sglang_plans import sglang_class
from tests.record.test_sglang_verify import N, PARENTS, PREFIX, verify_batch, verify_input
from tests.record.test_sglang_verify import ROWS as VERIFY_ROWS

I64, I32 = env.I64, env.I32
KV_CACHE_SIZE = 48
ONLY = "invariants,tree-mask,fill-value"
ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}  # decode: KV 5 and 9
SLACK = [0] * 4  # SGLang sizes FlashInfer's kv_indices with slack (paged_kernel_lens_sum + 256)

DecodeMetadata = env.sgl.flashinfer_backend.DecodeMetadata
PrefillMetadata = env.sgl.flashinfer_backend.PrefillMetadata


def layer_model(*, page_size: int = 1) -> Model:
    """The recorded layer: a real RadixAttention (4 q heads, 2 KV heads, d 16), no window, no soft-cap."""
    return model_from_layer(env.layer(heads=4, kv_heads=2, head_dim=16), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=page_size)


def recorded(backend: object, model: Model, **kw) -> Plan:
    plan = plan_from_backend(backend, model=model, **kw)
    assert plan is not None
    return plan


def check(tmp_path, batch: Batch, plan: Plan, *, engine_backend: str, model: Model, spec: Spec | None = None, graph: Graph | None = None, name: str = "step") -> list[tuple[str, str, str]]:
    """(class, check, field) of every finding `attndbg check --only invariants,tree-mask,fill-value` gives the step."""
    src = source(engine="sglang", backend=engine_backend, device="cpu", step=0, engine_version="test")
    trace = Trace(source=src, model=model, batch=batch, seed=1, spec=spec, graph=graph, plan=plan)
    path = io.save(trace, tmp_path / f"{name}.pt")
    reports = list(check_steps(str(path), parse_only(ONLY), CheckOptions(backends=("triton",))))
    assert all(report.checked for report in reports), [report.error for report in reports]
    return [(f.kind.value, f.check, f.location.field or "") for report in reports for f in report.findings]


def with_tensor(plan: Plan, name: str, values: torch.Tensor) -> Plan:
    return Plan(plan.backend, {**plan.tensors, name: values}, dict(plan.scalars))


# -- FlashInfer ---------------------------------------------------------------------------------


def decode_step():
    pool = env.req_pool(ROWS)
    from tests.record.sglang_steps import decode_batch

    return batch_from_forward_batch(decode_batch(), pool.req_to_token, KV_CACHE_SIZE)


def flashinfer_decode_backend(kv_indices: list[int], *, tensor_cores: bool = False) -> SimpleNamespace:
    """FlashInferAttnBackend after init_forward_metadata of the decode step: one decode wrapper
    planned by FlashInferIndicesUpdaterDecode.call_begin_forward (kv_indptr = cumsum(seq_lens),
    kv_indices the req_to_token rows, kv_last_page_len ones: page size 1)."""
    wrapper = SimpleNamespace(
        _paged_kv_indptr_buf=torch.tensor([0, 5, 14], dtype=I32),
        _paged_kv_indices_buf=torch.tensor(kv_indices + SLACK, dtype=I32),
        _paged_kv_last_page_len_buf=torch.ones(2, dtype=I32),
        _use_tensor_cores=tensor_cores,
        is_cuda_graph_enabled=False,
    )
    return SimpleNamespace(forward_metadata=DecodeMetadata(decode_wrappers=[wrapper]), decode_use_tensor_cores=tensor_cores, page_size=1)


def test_flashinfer_decode_eager(tmp_path) -> None:
    model, batch = layer_model(), decode_step()
    plan = recorded(flashinfer_decode_backend(ROWS[1] + ROWS[5]), model)
    assert plan.scalars == {"path": "decode", "page_size": 1, "num_wrappers": 1, "use_tensor_cores": False, "window_left": -1, "logits_soft_cap": 0.0}
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model) == []

    # Planted: request 1's indices built from request 0's req_to_token row (a wrong req_pool_indices entry).
    wrong = recorded(flashinfer_decode_backend(ROWS[1] + ROWS[1] + ROWS[5][5:]), model)
    assert ("invariants", "kv-index", "plan.kv_indices[5]") in check(tmp_path, batch, wrong, engine_backend="flashinfer", model=model, name="wrong")


def test_flashinfer_plan_info_is_recorded_and_judged(tmp_path) -> None:
    """The wrapper's schedule (`_plan_info`, `_pin_memory_int_workspace_buffer`, as FlashInfer's
    plan() leaves them; made by the scheduler's rules: tests/plans/flashinfer_scheduler.py) goes to
    plan.plan_info, cut at the arrays' end; checked clean for this batch, and a schedule left from an
    earlier, larger batch is named."""
    from tests.plans.flashinfer_scheduler import decode_plan_info

    model, batch = layer_model(), decode_step()

    def planned_for(pages: list[int]) -> SimpleNamespace:
        backend = flashinfer_decode_backend(ROWS[1] + ROWS[5])
        vector, workspace = decode_plan_info(pages, 1, max_grid_size=132, gdy=2, graph=False)
        pinned = torch.zeros(8 * 1024 * 1024, dtype=torch.uint8)
        pinned[: len(workspace)] = torch.frombuffer(bytearray(workspace), dtype=torch.uint8)
        wrapper = backend.forward_metadata.decode_wrappers[0]
        wrapper._plan_info, wrapper._pin_memory_int_workspace_buffer, wrapper._backend = vector, pinned, "auto"
        return backend

    plan = recorded(planned_for([5, 9]), model)
    assert plan.plan_info is not None and plan.plan_info.vector.tolist()[0] == 2  # two work items: no split at these lengths
    assert plan.plan_info.workspace.numel() < 256  # the arrays, not the 8 MiB buffer
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model) == []
    # A schedule left from an earlier batch of three requests: its third work item reads request 2.
    stale = recorded(planned_for([5, 9, 4]), model)
    assert ("invariants", "plan-info-request-index", "plan.plan_info.request_indices[2]") in check(tmp_path, batch, stale, engine_backend="flashinfer", model=model, name="stale")


CAPTURE_BS, RAW_BS, FILL = 4, 2, 1


def padded_replay(fb, mode, *, tokens_per_req: int = 1):
    """SGL-new's runner replaying `fb` (RAW_BS requests) in the bs-4 graph: static buffers padded as
    its registry pads them (seq_lens with the fill value 1; req_pool_indices, out_cache_loc and
    positions zeroed), then its own build_replay_fb_view. Returns (view, graph, graph tensors)."""
    from tests.record.engines import import_engine
    from attndbg.record.sglang.adapter import _wrap_view_builder
    from attndbg.record.sglang.graph import capture_graph_from_view, graph_from_host

    runner = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
    pad, n = CAPTURE_BS - RAW_BS, tokens_per_req
    seq_lens = torch.cat([fb.seq_lens, torch.full((pad,), FILL, dtype=I64)])
    buffers = SimpleNamespace(
        input_ids=torch.zeros(CAPTURE_BS * n, dtype=I64),
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=I64)]),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * n, dtype=I64)]),
        positions=torch.cat([fb.positions, torch.zeros(pad * n, dtype=I64)]),
        encoder_lens=None,
        mamba_track_indices=None,
    )
    fb.max_seq_len_host = None
    view = _wrap_view_builder(runner.build_replay_fb_view)(fb, buffers, CAPTURE_BS, RAW_BS, CAPTURE_BS * n, None, FILL, mode, False)
    info, tensors = capture_graph_from_view(view, fill_value=FILL, tokens_per_req=n)
    return view, graph_from_host(info, tensors), tensors


def graph_step() -> tuple[Batch, Graph]:
    """The decode step replayed in a graph captured at bs 4."""
    from tests.record.sglang_steps import decode_batch

    view, graph, _ = padded_replay(decode_batch(), env.ForwardMode.DECODE)
    return batch_from_forward_batch(view, env.req_pool(ROWS).req_to_token, KV_CACHE_SIZE, raw_bs=RAW_BS), graph


def flashinfer_graph_backend(kv_indptr: list[int]) -> SimpleNamespace:
    """The bs-4 CUDA-graph decode wrapper after replay re-planned it: FlashInfer copies the plan
    into the buffers it was built with (use_cuda_graph=True; indices into a buffer sized for the
    capture), the padded requests' seq_len 1 reading req_to_token row 0: slot 0, the dummy slot."""
    indices = torch.zeros(64, dtype=I32)
    indices[:16] = torch.tensor(ROWS[1] + ROWS[5] + [0, 0], dtype=I32)
    wrapper = SimpleNamespace(
        # A tensor-core decode wrapper in graph mode keeps a query offset per request (decode.py __init__).
        _qo_indptr_buf=torch.arange(CAPTURE_BS + 1, dtype=I32),
        _paged_kv_indptr_buf=torch.tensor(kv_indptr, dtype=I32),
        _paged_kv_indices_buf=indices,
        _paged_kv_last_page_len_buf=torch.ones(CAPTURE_BS, dtype=I32),
        _use_tensor_cores=True,
        is_cuda_graph_enabled=True,
    )
    return SimpleNamespace(forward_metadata=DecodeMetadata(decode_wrappers=[wrapper]), decode_use_tensor_cores=True, page_size=1)


def test_flashinfer_decode_graph_padded(tmp_path) -> None:
    model, (batch, graph) = layer_model(), graph_step()
    plan = recorded(flashinfer_graph_backend([0, 5, 14, 15, 16]), model, graph_bs=CAPTURE_BS)
    assert plan.tensors["kv_indices"].numel() == 16 and plan.scalars["use_tensor_cores"] is True
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model, graph=graph) == []

    # Planted: replay rewrote kv_indptr[1:raw_bs+1] only, the padded entries keep zeros.
    wrong = recorded(flashinfer_graph_backend([0, 5, 14, 0, 0]), model, graph_bs=CAPTURE_BS)
    found = check(tmp_path, batch, wrong, engine_backend="flashinfer", model=model, graph=graph, name="wrong")
    assert any(check_id == "indptr-decreases" or "padded-indptr" in check_id for _, check_id, _ in found), found


EXTEND_ROWS = {2: [7, 8, 9, 40, 41, 42, 43], 4: [17, 18]}


def extend_step(prefix: list[int], mode=None) -> Batch:
    """Requests of pool rows 2 and 4 (7 and 2 tokens in all), `prefix` of them cached; EXTEND, or
    MIXED (a chunked prefill beside decode rows)."""
    from tests.record.test_sglang_batch import extend_batch

    extend = [7 - prefix[0], 2 - prefix[1]]
    fb = extend_batch(
        mode or env.ForwardMode.EXTEND,
        pool_rows=[2, 4],
        prefix=prefix,
        extend=extend,
        out_cache_loc=EXTEND_ROWS[2][prefix[0] :] + EXTEND_ROWS[4][prefix[1] :],
        positions=list(range(prefix[0], 7)) + list(range(prefix[1], 2)),
    )
    return batch_from_forward_batch(fb, env.req_pool(EXTEND_ROWS).req_to_token, KV_CACHE_SIZE)


def flashinfer_extend_backend(*, qo: list[int], kv_rows: list[list[int]], use_ragged: bool, extend_no_prefix: bool) -> SimpleNamespace:
    """A paged prefill wrapper planned by FlashInferIndicesUpdaterPrefill.call_begin_forward:
    qo_indptr = cumsum(extend lens), kv over the prefix (use_ragged: the new tokens go through the
    ragged wrapper) or over the whole row (paged), kv_indices with slack, last page lens ones."""
    lens = [len(r) for r in kv_rows]
    wrapper = SimpleNamespace(
        _qo_indptr_buf=torch.tensor(qo, dtype=I32),
        _paged_kv_indptr_buf=torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=I32),
        _paged_kv_indices_buf=torch.tensor(kv_rows[0] + kv_rows[1] + SLACK, dtype=I32),
        _paged_kv_last_page_len_buf=torch.ones(2, dtype=I32),
        is_cuda_graph_enabled=False,
    )
    md = PrefillMetadata(prefill_wrappers=[wrapper], use_ragged=use_ragged, extend_no_prefix=extend_no_prefix)
    return SimpleNamespace(forward_metadata=md, page_size=1)


@pytest.mark.parametrize(
    ("path", "prefix", "use_ragged", "mixed"),
    [("ragged", [0, 0], True, False), ("cascade", [3, 1], True, False), ("paged", [3, 1], False, False), ("cascade", [5, 1], True, True)],
    ids=["ragged", "cascade", "paged", "cascade-mixed"],
)
def test_flashinfer_extend(tmp_path, path: str, prefix: list[int], use_ragged: bool, mixed: bool) -> None:
    model, batch = layer_model(), extend_step(prefix, env.ForwardMode.MIXED if mixed else None)
    qo = [0, 7 - prefix[0], 9 - prefix[0] - prefix[1]]
    listed = prefix if use_ragged else [7, 2]  # ragged and cascade plan the paged wrapper over the prefix
    kv_rows = [EXTEND_ROWS[2][: listed[0]], EXTEND_ROWS[4][: listed[1]]]
    plan = recorded(flashinfer_extend_backend(qo=qo, kv_rows=kv_rows, use_ragged=use_ragged, extend_no_prefix=not any(prefix)), model)
    assert plan.scalars["path"] == path
    assert {"window_left", "logits_soft_cap"} <= set(plan.scalars) and plan.scalars["causal"] is (path != "cascade")  # the prefix pass is not causal
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model, name=path) == []

    # Planted: qo_indptr of another batch (request 0 given one token less).
    wrong = recorded(flashinfer_extend_backend(qo=[0, qo[1] - 1, qo[2]], kv_rows=kv_rows, use_ragged=use_ragged, extend_no_prefix=not any(prefix)), model)
    found = check(tmp_path, batch, wrong, engine_backend="flashinfer", model=model, name=f"{path}_wrong")
    assert any(field.startswith("plan.qo_indptr") for _, _, field in found), found


# -- FlashInfer verify: the mask as FlashInfer packed it ------------------------------------------


def pack_little(mask: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_packbits(mask, cumsum(sizes), bitorder="little") written out: each segment padded to
    whole bytes, bit i of a byte = element 8j + i. Returns (bytes uint8, byte offsets int32)."""
    out, offsets, start = [], [0], 0
    for size in sizes:
        bits = mask[start : start + size].to(torch.int64)
        start += size
        bits = torch.nn.functional.pad(bits, (0, (-size) % 8)).view(-1, 8)
        out.append((bits << torch.arange(8)).sum(1).to(torch.uint8))
        offsets.append(offsets[-1] + bits.shape[0])
    return torch.cat(out), torch.tensor(offsets, dtype=I32)


def flashinfer_verify_backend(mask: torch.Tensor) -> SimpleNamespace:
    """SGLang's verify wrapper (prefill_wrappers_verify) planned from EagleVerifyInput.generate_attn_arg_prefill:
    qo_indptr = arange(0, (bs+1)*n, n), kv over prefix + drafts, the FULL bool mask packed by plan()."""
    kv = [PREFIX[0] + N, PREFIX[1] + N]
    packed, offsets = pack_little(mask, [N * kv[0], N * kv[1]])
    wrapper = SimpleNamespace(
        _qo_indptr_buf=torch.tensor([0, N, 2 * N], dtype=I32),
        _paged_kv_indptr_buf=torch.tensor([0, kv[0], kv[0] + kv[1]], dtype=I32),
        _paged_kv_indices_buf=torch.tensor(VERIFY_ROWS[1] + VERIFY_ROWS[6] + SLACK, dtype=I32),
        _paged_kv_last_page_len_buf=torch.ones(2, dtype=I32),
        _custom_mask_buf=packed,
        _mask_indptr_buf=offsets,
        is_cuda_graph_enabled=False,
    )
    return SimpleNamespace(forward_metadata=PrefillMetadata(prefill_wrappers=[wrapper], use_ragged=False, extend_no_prefix=False), page_size=1)


def verify_step() -> tuple[Batch, Spec, object]:
    mask = tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX))
    fb = verify_batch(verify_input(mask))
    batch = batch_from_forward_batch(fb, env.req_pool(VERIFY_ROWS).req_to_token, KV_CACHE_SIZE)
    return batch, spec_from_verify_input(fb.spec_info, fb.seq_lens), fb.spec_info


def test_flashinfer_verify_packed_mask(tmp_path) -> None:
    model, (batch, spec, spec_info) = layer_model(), verify_step()
    plan = recorded(flashinfer_verify_backend(spec.custom_mask), model, verify=True, spec_info=spec_info)
    assert plan.tensors["packed_custom_mask"].dtype == torch.uint8 and "custom_mask" not in plan.tensors
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model, spec=spec) == []

    # Planted: draft token 2 of request 0 sees its sibling 1 (a next-sibling link taken for a parent).
    sibling = tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX)).clone()
    sibling[2 * (PREFIX[0] + N) + PREFIX[0] + 1] = True
    wrong = recorded(flashinfer_verify_backend(sibling), model, verify=True, spec_info=spec_info)
    found = check(tmp_path, batch, wrong, engine_backend="flashinfer", model=model, spec=spec, name="sibling")
    # Row 2, column 3 + 1 of request 0's [4, 7] block: element 2 * 7 + 4 = 18, byte 2 bit 2.
    assert ("tree-mask", "mask-mismatch", "plan.packed_custom_mask[2] bit 2") in found, found

    # Planted: the packed bytes' offsets computed for another batch (request 0 one byte short).
    short = recorded(flashinfer_verify_backend(spec.custom_mask), model, verify=True, spec_info=spec_info)
    offsets = short.tensors["packed_mask_indptr"].clone()
    offsets[1] -= 1
    found = check(tmp_path, batch, with_tensor(short, "packed_mask_indptr", offsets), engine_backend="flashinfer", model=model, spec=spec, name="offsets")
    assert ("tree-mask", "mask-indptr", "plan.packed_mask_indptr[1]") in found, found


# -- FA3 ----------------------------------------------------------------------------------------

FlashAttentionMetadata = sglang_class("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionMetadata")


def page_table(pool_rows: list[int], rows: dict[int, list[int]], width: int) -> torch.Tensor:
    """req_to_token[req_pool_indices, :width] (page size 1: the slot ids themselves)."""
    return env.req_pool(rows).req_to_token[torch.tensor(pool_rows), :width].to(I32)


def fa3_backend(md, *, topk: int = 0, expand=None) -> SimpleNamespace:
    """FlashAttentionBackend after init_forward_metadata: the metadata, and what its forward reads
    beside it (page_size, topk, the tree verify's forward_metadata_spec_decode_expand)."""
    return SimpleNamespace(forward_metadata=md, page_size=1, topk=topk, forward_metadata_spec_decode_expand=expand)


def fa3_decode_metadata(cache_seqlens: list[int], pool_rows: list[int], rows: dict[int, list[int]]):
    """Normal decode (flashattention_backend.py init_forward_metadata): cache_seqlens = seq_lens,
    cu_seqlens_q = arange(bs + 1), cu_seqlens_k = cumsum, page_table = the rows up to max_seq_len_k."""
    lens = torch.tensor(cache_seqlens, dtype=I32)
    width = max(cache_seqlens)
    return FlashAttentionMetadata(
        cache_seqlens_int32=lens,
        max_seq_len_q=1,
        max_seq_len_k=width,
        cu_seqlens_q=torch.arange(len(cache_seqlens) + 1, dtype=I32),
        cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0, dtype=I32), (1, 0)),
        page_table=page_table(pool_rows, rows, width),
    )


def test_fa3_decode_eager(tmp_path) -> None:
    model, batch = layer_model(), decode_step()
    plan = recorded(fa3_backend(fa3_decode_metadata([5, 9], [1, 5], ROWS)), model)
    assert plan.scalars == {"max_seqlen_q": 1, "max_seqlen_k": 9, "page_size": 1, "window_left": -1, "verify_path": "causal", "causal": True}
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model) == []

    # Planted: request 1's page-table row read from request 0's req_to_token row.
    wrong = recorded(fa3_backend(fa3_decode_metadata([5, 9], [1, 1], {1: ROWS[1] + ROWS[5][5:]})), model)
    found = check(tmp_path, batch, wrong, engine_backend="fa3", model=model, name="wrong")
    assert any(check_id == "kv-index" and field.startswith("plan.page_table") for _, check_id, field in found), found


def test_fa3_decode_graph_padded(tmp_path) -> None:
    """The bs-4 graph's metadata (decode_cuda_graph_metadata[4]) refilled at replay: padded requests
    with seq_len 1 read req_to_token row 0."""
    model, (batch, graph) = layer_model(), graph_step()
    md = fa3_decode_metadata([5, 9, 1, 1], [1, 5, 0, 0], {**ROWS, 0: [0]})
    plan = recorded(fa3_backend(md), model, graph_bs=CAPTURE_BS)
    assert plan.tensors["page_table"].shape == (CAPTURE_BS, 9)
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, graph=graph) == []

    # Planted: cu_seqlens_k refilled for the real requests only; the padded entries keep zeros.
    md.cu_seqlens_k = torch.tensor([0, 5, 14, 0, 0], dtype=I32)
    found = check(tmp_path, batch, recorded(fa3_backend(md), model, graph_bs=CAPTURE_BS), engine_backend="fa3", model=model, graph=graph, name="wrong")
    assert any(field.startswith("plan.cu_seqlens_k") for _, _, field in found), found


def test_fa3_extend(tmp_path) -> None:
    """An extend with prefixes [3, 1] (init_forward_metadata: any prefix -> cu_seqlens_q over the
    extend lens, max_seq_len_q their max; cache_seqlens the whole rows)."""
    model, batch = layer_model(), extend_step([3, 1])

    def metadata(cu_q: list[int]):
        lens = torch.tensor([7, 2], dtype=I32)
        return FlashAttentionMetadata(
            cache_seqlens_int32=lens,
            max_seq_len_q=4,
            max_seq_len_k=7,
            cu_seqlens_q=torch.tensor(cu_q, dtype=I32),
            cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0, dtype=I32), (1, 0)),
            page_table=page_table([2, 4], EXTEND_ROWS, 7),
        )

    plan = recorded(fa3_backend(metadata([0, 4, 5])), model)
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model) == []
    # Planted: cu_seqlens_q of another batch (request 0 one token short).
    found = check(tmp_path, batch, recorded(fa3_backend(metadata([0, 3, 5])), model), engine_backend="fa3", model=model, name="wrong")
    assert any(field.startswith("plan.cu_seqlens_q") for _, _, field in found), found


def fa3_tree_verify(mask: torch.Tensor, *, prefix_lens: list[int] = PREFIX, pool_rows: list[int] = (1, 6)):
    """A topk-2 verify as SGLang's FA3 backend plans it (init_forward_metadata, target verify with
    topk > 1): call 1 over each prefix; the expand metadata with one row per draft token, the n x n
    draft block gathered from the FULL mask, the draft slots sorted so the visible ones come first,
    cache_seqlens = the block row's sum (the source's steps, written out). `prefix_lens` and
    `pool_rows` of every request the metadata covers (a graph's padded ones included)."""
    bs, prefix = len(prefix_lens), torch.tensor(prefix_lens)
    lens = prefix.to(I32)
    rows = torch.tensor(list(pool_rows))
    main = FlashAttentionMetadata(
        cache_seqlens_int32=lens,
        max_seq_len_q=N,
        max_seq_len_k=max(prefix_lens),
        cu_seqlens_q=torch.arange(0, bs * N + 1, N, dtype=I32),
        cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0, dtype=I32), (1, 0)),
        page_table=page_table(list(pool_rows), VERIFY_ROWS, max(prefix_lens)),
    )
    offsets = torch.arange(N)[None, :]
    cols = offsets.expand(bs, -1) + prefix[:, None]
    cum_len = torch.nn.functional.pad(torch.cumsum((prefix + N).repeat_interleave(N), 0), (1, 0))[:-1]
    block = mask[(cols.repeat_interleave(N, dim=0) + cum_len[:, None]).view(1, -1)].view(-1, N)
    keys = torch.where(block, offsets.expand(block.shape[0], N), offsets + N)
    _, order = torch.sort(keys, dim=1)
    draft_slots = env.req_pool(VERIFY_ROWS).req_to_token[rows, :].to(torch.int64).gather(1, cols).repeat_interleave(N, dim=0)
    expand = FlashAttentionMetadata(
        max_seq_len_q=1,
        cu_seqlens_q=torch.arange(bs * N + 1, dtype=I32),
        page_table=draft_slots.gather(1, order).to(I32),
        cache_seqlens_int32=block.sum(1).to(I32),
    )
    expand.cu_seqlens_k = torch.nn.functional.pad(expand.cache_seqlens_int32.cumsum(0, dtype=I32), (1, 0))
    return fa3_backend(main, topk=2, expand=expand)


def test_fa3_tree_verify_two_calls(tmp_path) -> None:
    model, (batch, spec, spec_info) = layer_model(), verify_step()
    plan = recorded(fa3_tree_verify(spec.custom_mask), model, verify=True, spec_info=spec_info)
    assert plan.scalars["verify_path"] == "two-call" and plan.scalars["expand_page_size"] == 1
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec) == []

    # Planted: draft token 2 of request 0 sees its sibling 1 in the mask the expand call is cut from.
    sibling = spec.custom_mask.clone()
    sibling[2 * (PREFIX[0] + N) + PREFIX[0] + 1] = True
    found = check(tmp_path, batch, recorded(fa3_tree_verify(sibling), model, verify=True, spec_info=spec_info), engine_backend="fa3", model=model, spec=spec, name="sibling")
    assert ("tree-mask", "mask-mismatch", "plan.expand_page_table[2]") in found, found


def test_fa3_stale_expand_metadata_is_not_recorded_on_an_extend() -> None:
    """SGLang leaves forward_metadata_spec_decode_expand of the last tree verify on the backend; an
    extend step does not read it, so its plan has no expand_ tables."""
    backend = fa3_tree_verify(tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX)))
    plan = recorded(backend, layer_model())
    assert not any(name.startswith("expand_") for name in plan.tensors) and plan.scalars["verify_path"] == "causal"


# -- FlashMLA -----------------------------------------------------------------------------------

FlashMLADecodeMetadata = sglang_class("sglang.srt.layers.attention.flashmla_backend", "FlashMLADecodeMetadata")
MLA_ROWS = {1: list(range(64, 69)), 5: list(range(128, 137))}  # pages 1 and 2 of 64 slots
MLA_CACHE = 256


def mla_model() -> Model:
    """DeepSeek's absorbed MLA layer as SGLang builds it: one KV head of 512 latent + 64 rope, page 64."""
    layer = env.RadixAttention(4, 576, 576**-0.5, 1, 0, v_head_dim=512)
    return model_from_layer(layer, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=64, mla=True)


def mla_decode_step() -> tuple[Batch, object]:
    fb = env.ForwardBatch(
        forward_mode=env.ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.tensor([101, 102], dtype=I64),
        req_pool_indices=torch.tensor([1, 5], dtype=I64),
        seq_lens=torch.tensor([5, 9], dtype=I64),
        out_cache_loc=torch.tensor([68, 136], dtype=I64),
        seq_lens_sum=14,
        positions=torch.tensor([4, 8], dtype=I64),
        seq_lens_cpu=torch.tensor([5, 9], dtype=I64),
    )
    return batch_from_forward_batch(fb, env.req_pool(MLA_ROWS, width=128).req_to_token, MLA_CACHE), fb


def flashmla_backend(block_kv_indices: list[list[int]]) -> SimpleNamespace:
    """FlashMLABackend after init_forward_metadata of a decode step: block_kv_indices [bs,
    cdiv(max_seq_len, 64)] (req_to_token[req, 64 p] // 64, -1 past a row's pages), the tile
    scheduler's metadata and num_splits from get_mla_metadata (values of no consequence here)."""
    md = FlashMLADecodeMetadata(flashmla_metadata=None, num_splits=torch.tensor([0, 1, 2], dtype=I32), block_kv_indices=torch.tensor(block_kv_indices, dtype=I32))
    return SimpleNamespace(forward_metadata=md, page_size=64, num_draft_tokens=None)


def test_flashmla_decode_eager(tmp_path) -> None:
    model, (batch, fb) = mla_model(), mla_decode_step()
    plan = recorded(flashmla_backend([[1], [2]]), model, seq_lens=fb.seq_lens)
    assert plan.scalars == {"impl": "flashmla", "page_size": 64, "causal": True, "q_len": 1}
    assert plan.tensors["cache_seqlens"].tolist() == [5, 9]  # what forward_decode hands the kernel
    assert check(tmp_path, batch, plan, engine_backend="flashmla", model=model) == []

    # Planted: request 1's block table row holds request 0's page.
    found = check(tmp_path, batch, recorded(flashmla_backend([[1], [1]]), model, seq_lens=fb.seq_lens), engine_backend="flashmla", model=model, name="wrong")
    assert any(check_id == "kv-index" and field.startswith("plan.block_table") for _, check_id, field in found), found


# -- graph-padded verify (FlashInfer) and chain verify (FA3) -----------------------------------


def verify_graph_step(mask: torch.Tensor) -> tuple[Batch, Spec, Graph, object]:
    """The verify step replayed in a bs-4 graph (test_sglang_graph_verify.replay's padding)."""
    fb = verify_batch(verify_input(mask))
    view, graph, _ = padded_replay(fb, env.ForwardMode.TARGET_VERIFY, tokens_per_req=N)
    batch = batch_from_forward_batch(view, env.req_pool(VERIFY_ROWS).req_to_token, KV_CACHE_SIZE, raw_bs=RAW_BS)
    return batch, spec_from_verify_input(fb.spec_info, fb.seq_lens), graph, fb.spec_info


def flashinfer_graph_verify_backend(mask: torch.Tensor) -> SimpleNamespace:
    """The bs-4 verify wrapper (use_cuda_graph=True, custom_mask_buf / mask_indptr_buf given at
    capture) after fast_prefill_plan refilled it: kv over each padded request's prefix + n (padded
    ones: seq_len 1 + n columns of req_to_token row 0, the dummy slot 0), the byte offsets
    cumsum(ceil(kv_len * n / 8)), the packed bytes at the head of a buffer sized for the capture
    (its tail left from earlier replays). Padded requests' blocks are chains over their columns."""
    kv = [PREFIX[0] + N, PREFIX[1] + N, FILL + N, FILL + N]
    chain = tree.full_mask(torch.arange(-1, N - 1).expand(2, N), torch.tensor([FILL, FILL]))
    packed, offsets = pack_little(torch.cat([mask, chain]), [N * k for k in kv])
    buffer = torch.full((256,), 0xA5, dtype=torch.uint8)
    buffer[: packed.numel()] = packed
    indices = torch.full((64,), 7, dtype=I32)  # stale entries past what this replay wrote
    indices[: sum(kv)] = torch.tensor(VERIFY_ROWS[1] + VERIFY_ROWS[6] + [0] * 2 * (FILL + N), dtype=I32)
    wrapper = SimpleNamespace(
        _qo_indptr_buf=torch.arange(0, (CAPTURE_BS + 1) * N, N, dtype=I32),
        _paged_kv_indptr_buf=torch.nn.functional.pad(torch.tensor(kv).cumsum(0), (1, 0)).to(I32),
        _paged_kv_indices_buf=indices,
        _paged_kv_last_page_len_buf=torch.ones(CAPTURE_BS, dtype=I32),
        _custom_mask_buf=buffer,
        _mask_indptr_buf=offsets,
        is_cuda_graph_enabled=True,
    )
    return SimpleNamespace(forward_metadata=PrefillMetadata(prefill_wrappers=[wrapper], use_ragged=False, extend_no_prefix=False), page_size=1)


def test_flashinfer_verify_graph_padded(tmp_path) -> None:
    model = layer_model()
    batch, spec, graph, spec_info = verify_graph_step(tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX)))
    plan = recorded(flashinfer_graph_verify_backend(spec.custom_mask), model, graph_bs=CAPTURE_BS, verify=True, spec_info=spec_info)
    assert plan.tensors["packed_custom_mask"].numel() == int(plan.tensors["packed_mask_indptr"][-1])  # the capacity buffer, cut
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model, spec=spec, graph=graph) == []

    # Planted: the tree packed big-endian (bit 0 = the last element of each byte).
    def big_endian(mask: torch.Tensor) -> torch.Tensor:
        return torch.cat([mask[i : i + 8].flip(0) if mask[i:].numel() >= 8 else mask[i:] for i in range(0, mask.numel(), 8)])

    sizes = [N * (PREFIX[0] + N), N * (PREFIX[1] + N)]
    flipped = torch.cat([big_endian(spec.custom_mask[: sizes[0]]), big_endian(spec.custom_mask[sizes[0] :])])
    found = check(tmp_path, batch, recorded(flashinfer_graph_verify_backend(flipped), model, graph_bs=CAPTURE_BS, verify=True, spec_info=spec_info), engine_backend="flashinfer", model=model, spec=spec, graph=graph, name="flipped")
    assert any(kind == "tree-mask" and field.startswith("plan.packed_custom_mask[") for kind, _, field in found), found


CHAIN = [[-1, 0, 1, 2], [-1, 0, 1, 2]]


def chain_verify_step() -> tuple[Batch, Spec, object]:
    """A topk-1 verify (a chain of N tokens per request) as SGLang builds it: next-token links only."""
    mask = tree.full_mask(torch.tensor(CHAIN), torch.tensor(PREFIX))
    spec_info = env.EagleVerifyInput(
        draft_token=torch.arange(2 * N, dtype=I64),
        custom_mask=mask,
        positions=torch.tensor([p + d for p in PREFIX for d in range(N)], dtype=I64),
        retrieve_index=torch.arange(2 * N, dtype=I64).view(2, N),
        retrieve_next_token=torch.tensor([[1, 2, 3, -1]] * 2, dtype=I64),
        retrieve_next_sibling=torch.full((2, N), -1, dtype=I64),
        retrieve_cum_len=None,
        spec_steps=N - 1,
        topk=1,
        draft_token_num=N,
        capture_hidden_mode=env.CaptureHiddenMode.FULL,
        seq_lens_sum=sum(PREFIX),
        seq_lens_cpu=torch.tensor(PREFIX, dtype=I64),
    )
    fb = verify_batch(spec_info)
    batch = batch_from_forward_batch(fb, env.req_pool(VERIFY_ROWS).req_to_token, KV_CACHE_SIZE)
    return batch, spec_from_verify_input(spec_info, fb.seq_lens), spec_info


def test_fa3_chain_verify(tmp_path) -> None:
    """topk 1: one causal call over prefix + drafts (cache_seqlens = seq_lens + n, cu_seqlens_q =
    arange(0, bs*n + 1, n)); the backend's stale expand metadata of topk > 1 plays no part."""
    model, (batch, spec, spec_info) = layer_model(), chain_verify_step()

    def metadata(extra: int):
        lens = torch.tensor(PREFIX, dtype=I32) + extra
        return FlashAttentionMetadata(
            cache_seqlens_int32=lens,
            max_seq_len_q=N,
            max_seq_len_k=int(lens.max()),
            cu_seqlens_q=torch.arange(0, 2 * N + 1, N, dtype=I32),
            cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0, dtype=I32), (1, 0)),
            page_table=page_table([1, 6], VERIFY_ROWS, int(lens.max())),
        )

    plan = recorded(fa3_backend(metadata(N), topk=1), model, verify=True, spec_info=spec_info)
    assert plan.scalars["verify_path"] == "causal" and plan.scalars["causal"] is True
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec) == []

    # Planted: cache_seqlens without the draft tokens (SGLang's verify seq_lens exclude them).
    found = check(tmp_path, batch, recorded(fa3_backend(metadata(0), topk=1), model, verify=True, spec_info=spec_info), engine_backend="fa3", model=model, spec=spec, name="short")
    assert any(field.startswith("plan.cache_seqlens") for _, _, field in found), found


# -- through the live hook ----------------------------------------------------------------------


def test_flashinfer_decode_through_the_installed_hook(hook_session) -> None:
    """`record_step` as a live recording runs it, on a subclass of SGLang's real FlashInferAttnBackend
    (its __init__ needs a ModelRunner and a GPU: bypassed, the attributes the recorder reads set):
    the plan it writes carries the recorded layer's call arguments and checks clean."""
    from tests.record.test_sglang_hooks import make_backend, manifest
    from tests.record.sglang_steps import decode_batch

    layer = env.layer(heads=4, kv_heads=2, head_dim=16)  # noqa: F841 - the model keeps its layers alive
    wrapper_backend = flashinfer_decode_backend(ROWS[1] + ROWS[5])

    class Backend(env.sgl.flashinfer_backend.FlashInferAttnBackend):
        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = wrapper_backend.forward_metadata

    backend = make_backend(Backend)
    backend.decode_use_tensor_cores = False
    backend.page_size = 1
    backend.init_forward_metadata(decode_batch())
    [entry] = manifest(hook_session)
    trace = io.load(hook_session.out_dir / entry["file"])
    assert trace.source.backend == "flashinfer"
    assert {"window_left": -1, "logits_soft_cap": 0.0, "use_tensor_cores": False}.items() <= trace.plan.scalars.items()
    reports = list(check_steps(str(hook_session.out_dir / entry["file"]), parse_only(ONLY), CheckOptions(backends=("triton",))))
    assert [f for report in reports for f in report.findings] == []


WINDOW = 3  # the layer's sliding_window_size: a query sees itself and the 3 keys before it


def window_model() -> Model:
    layer = env.RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=WINDOW)
    return model_from_layer(layer, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)


def test_flashinfer_sliding_window_decode(tmp_path) -> None:
    """A sliding-window model: SGLang runs two decode wrappers (WrapperDispatch.SLIDING_WINDOW),
    wrapper 0 planned over each request's last min(seq_len, window + 1) keys (update_sliding_window:
    kv_start_idx = seq_len - that), its forward given no window_left: the list is the window."""
    model, batch = window_model(), decode_step()

    def backend(keep: int) -> SimpleNamespace:
        lists = [ROWS[1][-keep:], ROWS[5][-keep:]]
        swa = SimpleNamespace(
            _paged_kv_indptr_buf=torch.tensor([0, keep, 2 * keep], dtype=I32),
            _paged_kv_indices_buf=torch.tensor(lists[0] + lists[1] + SLACK, dtype=I32),
            _paged_kv_last_page_len_buf=torch.ones(2, dtype=I32),
            _use_tensor_cores=False,
        )
        full = flashinfer_decode_backend(ROWS[1] + ROWS[5]).forward_metadata.decode_wrappers[0]
        dispatch = env.sgl.flashinfer_backend.WrapperDispatch.SLIDING_WINDOW
        return SimpleNamespace(forward_metadata=DecodeMetadata(decode_wrappers=[swa, full]), decode_use_tensor_cores=False, page_size=1, dispatch_reason=dispatch)

    plan = recorded(backend(WINDOW + 1), model)
    assert (plan.scalars["num_wrappers"], plan.scalars["window_left"]) == (2, -1)
    assert plan.tensors["kv_indptr"].tolist() == [0, WINDOW + 1, 2 * (WINDOW + 1)]  # wrapper 0: the window layers'
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model) == []

    # The same step recorded at a full-attention layer of the model (Gemma-style interleaving):
    # SGLang's _get_wrapper_idx runs it on wrapper 1, the whole rows.
    full_layer = layer_model()
    plan = recorded(backend(WINDOW + 1), full_layer)
    assert plan.tensors["kv_indptr"].tolist() == [0, 5, 14]
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=full_layer, name="full_layer") == []

    # Planted: the window list one key short (min(seq_len, window), sglang PR #32087's mechanism).
    found = check(tmp_path, batch, recorded(backend(WINDOW), model), engine_backend="flashinfer", model=model, name="short")
    assert ("invariants", "kv-length", "plan.kv_indptr/kv_last_page_len") in found, found


MLA_VERIFY_ROWS = {1: list(range(64, 64 + PREFIX[0] + N)), 6: list(range(128, 128 + PREFIX[1] + N))}


def mla_chain_verify_step() -> tuple[Batch, Spec, object, object]:
    """A chain verify (topk 1) of 2 MLA requests on 64-token pages: (batch, spec, forward batch, spec input)."""
    _, _, chain_info = chain_verify_step()
    drafts = [s for b, p in zip((1, 6), PREFIX) for s in MLA_VERIFY_ROWS[b][p:]]
    fb = env.ForwardBatch(
        forward_mode=env.ForwardMode.TARGET_VERIFY,
        batch_size=2,
        input_ids=chain_info.draft_token,
        req_pool_indices=torch.tensor([1, 6], dtype=I64),
        seq_lens=torch.tensor(PREFIX, dtype=I64),
        out_cache_loc=torch.tensor(drafts, dtype=I64),
        seq_lens_sum=sum(PREFIX),
        positions=chain_info.positions,
        spec_info=chain_info,
    )
    batch = batch_from_forward_batch(fb, env.req_pool(MLA_VERIFY_ROWS, width=128).req_to_token, MLA_CACHE)
    return batch, spec_from_verify_input(chain_info, fb.seq_lens), fb, chain_info


def test_flashmla_chain_verify(tmp_path) -> None:
    """FlashMLA verifies a chain (topk 1) causally: forward_extend hands the kernel
    cache_seqlens = seq_lens + num_draft_tokens and q as [bs, n, H, 576]."""
    model = mla_model()
    batch, spec, fb, chain_info = mla_chain_verify_step()
    backend = flashmla_backend([[1], [2]])
    backend.num_draft_tokens = N
    plan = recorded(backend, model, verify=True, spec_info=chain_info, seq_lens=fb.seq_lens)
    assert plan.tensors["cache_seqlens"].tolist() == [PREFIX[0] + N, PREFIX[1] + N] and plan.scalars["q_len"] == N
    assert check(tmp_path, batch, plan, engine_backend="flashmla", model=model, spec=spec) == []

    # Planted: request 1's block table row holds request 0's page.
    wrong = recorded(flashmla_backend([[1], [1]]), model, verify=True, spec_info=chain_info, seq_lens=fb.seq_lens)
    found = check(tmp_path, batch, wrong, engine_backend="flashmla", model=model, spec=spec, name="wrong")
    assert any(check_id == "kv-index" and field.startswith("plan.block_table") for _, check_id, field in found), found


def test_flashmla_decode_graph_padded(tmp_path) -> None:
    """At a bs-4 replay SGLang rebuilds forward_metadata over its graph buffer
    (cuda_graph_kv_indices[:bs, :max_seqlen_pad]); padded requests (seq_len 1, req_to_token row 0)
    read page 0, the dummy page, and the kernel's cache_seqlens are the padded seq_lens."""
    model, (_, fb) = mla_model(), mla_decode_step()
    view, graph, tensors = padded_replay(fb, env.ForwardMode.DECODE)
    batch = batch_from_forward_batch(view, env.req_pool(MLA_ROWS, width=128).req_to_token, MLA_CACHE, raw_bs=RAW_BS)
    plan = recorded(flashmla_backend([[1], [2], [0], [0]]), model, graph_bs=CAPTURE_BS, seq_lens=tensors["padded_seq_lens"])
    assert plan.tensors["cache_seqlens"].tolist() == [5, 9, 1, 1]
    assert check(tmp_path, batch, plan, engine_backend="flashmla", model=model, graph=graph) == []

    # Planted: a padded request's block table entry past the pool (a stale graph buffer row).
    found = check(tmp_path, batch, recorded(flashmla_backend([[1], [2], [0], [9]]), model, graph_bs=CAPTURE_BS, seq_lens=tensors["padded_seq_lens"]), engine_backend="flashmla", model=model, graph=graph, name="wrong")
    assert any(field.startswith("plan.block_table[3") for _, _, field in found), found


def test_fa3_sliding_window_decode(tmp_path) -> None:
    """FA3 lists whole rows and applies the window in the kernel (window_size = (layer's
    sliding_window_size, 0)): the recorded plan says so, and checks clean."""
    model, batch = window_model(), decode_step()
    plan = recorded(fa3_backend(fa3_decode_metadata([5, 9], [1, 5], ROWS)), model)
    assert plan.scalars["window_left"] == WINDOW
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model) == []


P16_ROWS = {1: list(range(16, 21)), 5: list(range(32, 41))}  # a pool of 16-token pages (--page-size 16)


def test_flashinfer_decode_on_a_paged_pool(tmp_path) -> None:
    """SGLang plans FlashInfer at page size 1 on any pool (call_begin_forward passes a literal 1;
    kv_indices are slot ids): the adapter hands the cache over in the plan's pages, so the step is
    read and clean."""
    from tests.record.sglang_steps import decode_batch

    fb = decode_batch()
    fb.out_cache_loc = torch.tensor([20, 40], dtype=I64)
    batch = batch_from_forward_batch(fb, env.req_pool(P16_ROWS).req_to_token, 64)
    model = layer_model(page_size=16)
    plan = recorded(flashinfer_decode_backend(P16_ROWS[1] + P16_ROWS[5]), model)
    assert plan.scalars["page_size"] == 1
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model) == []


def test_fa3_tree_verify_graph_padded(tmp_path) -> None:
    """The bs-4 verify graph's metadata refilled at replay: padded requests (seq_len 1, req_to_token
    row 0) with chain blocks in the mask buffer; the expand call has a row per padded draft token too."""
    model = layer_model()
    batch, spec, graph, spec_info = verify_graph_step(tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX)))
    chain = tree.full_mask(torch.arange(-1, N - 1).expand(2, N), torch.tensor([FILL, FILL]))
    padded = dict(prefix_lens=PREFIX + [FILL, FILL], pool_rows=(1, 6, 0, 0))
    plan = recorded(fa3_tree_verify(torch.cat([spec.custom_mask, chain]), **padded), model, graph_bs=CAPTURE_BS, verify=True, spec_info=spec_info)
    assert plan.tensors["expand_page_table"].shape[0] == CAPTURE_BS * N
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec, graph=graph) == []

    # Planted: draft token 2 of request 0 sees its sibling 1.
    sibling = spec.custom_mask.clone()
    sibling[2 * (PREFIX[0] + N) + PREFIX[0] + 1] = True
    wrong = recorded(fa3_tree_verify(torch.cat([sibling, chain]), **padded), model, graph_bs=CAPTURE_BS, verify=True, spec_info=spec_info)
    found = check(tmp_path, batch, wrong, engine_backend="fa3", model=model, spec=spec, graph=graph, name="sibling")
    assert ("tree-mask", "mask-mismatch", "plan.expand_page_table[2]") in found, found


def test_fa3_tree_verify_at_a_sliding_window_layer_without_its_metadata_records_no_plan() -> None:
    """SGLang builds swa_spec_metadata for every model with sliding-window layers and runs them in one
    call over it; with the field there but unset, the layer's forward is none the reader knows (a
    plan of the full layers' two calls would be judged for a layer that does not run them): no plan."""
    _, spec, spec_info = verify_step()
    assert plan_from_backend(fa3_tree_verify(spec.custom_mask), model=window_model(), verify=True, spec_info=spec_info) is None


# -- FA3, sliding-window layers of a tree verify (sglang#9658) -------------------------------------

def with_swa_spec_metadata(backend: SimpleNamespace) -> SimpleNamespace:
    """`_init_sliding_window_attn_spec_metadata` after the tree verify's metadata (page size 1, no
    SWA sub-pool): per draft token, its request's prefix row then its expand row
    (prepare_swa_spec_page_table_triton), cache_seqlens = prefix + the expand row's sum, one query each."""
    md, expand = backend.forward_metadata, backend.forward_metadata_spec_decode_expand
    n = N
    lens = md.cache_seqlens_int32.repeat_interleave(n) + expand.cache_seqlens_int32
    table = torch.zeros(lens.numel(), md.max_seq_len_k + expand.page_table.shape[1], dtype=I32)
    for r in range(lens.numel()):
        prefix, own = int(md.cache_seqlens_int32[r // n]), int(expand.cache_seqlens_int32[r])
        table[r, :prefix] = md.page_table[r // n, :prefix]
        table[r, prefix : prefix + own] = expand.page_table[r, :own]
    md.swa_spec_metadata = FlashAttentionMetadata(
        max_seq_len_q=1, cu_seqlens_q=expand.cu_seqlens_q, cache_seqlens_int32=lens.to(I32), cu_seqlens_k=torch.nn.functional.pad(lens.cumsum(0, dtype=I32), (1, 0)), page_table=table
    )
    return backend


def without_swa_field(backend: SimpleNamespace) -> SimpleNamespace:
    """The same metadata as FlashAttentionMetadata was before #9658 added swa_spec_metadata."""
    md = backend.forward_metadata
    names = [f.name for f in dataclasses.fields(md) if f.name != "swa_spec_metadata"]
    backend.forward_metadata = SimpleNamespace(**{name: getattr(md, name) for name in names})
    return backend


def test_fa3_sliding_window_layer_of_a_tree_verify(tmp_path) -> None:
    """SGLang since #9658: a sliding-window layer's tree verify is one causal call over
    swa_spec_metadata, recorded as the swa_ tables, and checks clean against the tree and the window."""
    model, (batch, spec, spec_info) = window_model(), verify_step()
    plan = recorded(with_swa_spec_metadata(fa3_tree_verify(spec.custom_mask)), model, verify=True, spec_info=spec_info)
    assert plan.scalars["verify_path"] == "window-expand" and plan.scalars["window_left"] == WINDOW
    assert plan.tensors["swa_page_table"].shape[0] == len(PREFIX) * N and not any(name.startswith("expand_") for name in plan.tensors)
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec) == []

    # With the SWA sub-pool the table holds the sub-pool's slot ids (translate_loc_from_full_to_swa),
    # not the step's req_to_token ids: no plan rather than one judged against the wrong ids.
    sub_pool = with_swa_spec_metadata(fa3_tree_verify(spec.custom_mask))
    sub_pool.use_sliding_window_kv_pool = True
    assert plan_from_backend(sub_pool, model=model, verify=True, spec_info=spec_info) is None

    # Planted: request 0's draft token 2 lists its sibling 1 in its sliding-window row.
    wrong = with_swa_spec_metadata(fa3_tree_verify(spec.custom_mask))
    swa = wrong.forward_metadata.swa_spec_metadata
    swa.page_table[2, PREFIX[0] + 2] = VERIFY_ROWS[1][PREFIX[0] + 1]
    swa.cache_seqlens_int32[2] += 1
    swa.cu_seqlens_k[3:] += 1
    found = check(tmp_path, batch, recorded(wrong, model, verify=True, spec_info=spec_info), engine_backend="fa3", model=model, spec=spec, name="sibling")
    assert ("tree-mask", "mask-mismatch", "plan.swa_page_table[2]") in found, found


def test_fa3_sliding_window_layer_through_the_full_layers_cascade(tmp_path) -> None:
    """Before #9658 (no swa_spec_metadata) a sliding-window layer ran the full layers' two calls with
    window_size=(sw, 0): the prefix call aligns every draft row's window to the prefix's last keys."""
    model, (batch, spec, spec_info) = window_model(), verify_step()
    plan = recorded(without_swa_field(fa3_tree_verify(spec.custom_mask)), model, verify=True, spec_info=spec_info)
    assert plan.scalars["verify_path"] == "two-call" and plan.scalars["window_right"] == 0
    found = check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec)
    assert ("tree-mask", "window-cascade", "plan.page_table[0]") in found, found

    # A full layer's two calls of the same step stay clean: the cascade is right without a window.
    assert check(tmp_path, batch, recorded(without_swa_field(fa3_tree_verify(spec.custom_mask)), layer_model(), verify=True, spec_info=spec_info), engine_backend="fa3", model=layer_model(), spec=spec, name="full") == []


def test_fa3_sliding_window_layer_graph_padded(tmp_path) -> None:
    """The bs-4 verify graph (target_verify_metadata_topk_swa[bs]): the padded requests' draft tokens
    have sliding-window rows too; the real requests' rows check clean."""
    model = window_model()
    batch, spec, graph, spec_info = verify_graph_step(tree.full_mask(torch.tensor(PARENTS), torch.tensor(PREFIX)))
    chain = tree.full_mask(torch.arange(-1, N - 1).expand(2, N), torch.tensor([FILL, FILL]))
    backend = with_swa_spec_metadata(fa3_tree_verify(torch.cat([spec.custom_mask, chain]), prefix_lens=PREFIX + [FILL, FILL], pool_rows=(1, 6, 0, 0)))
    plan = recorded(backend, model, graph_bs=CAPTURE_BS, verify=True, spec_info=spec_info)
    assert plan.tensors["swa_page_table"].shape[0] == CAPTURE_BS * N
    assert check(tmp_path, batch, plan, engine_backend="fa3", model=model, spec=spec, graph=graph) == []


def test_flashinfer_sliding_window_cascade_with_its_prefix_mask(tmp_path) -> None:
    """A sliding-window layer's cascade extend (update_sliding_window with use_ragged): wrapper 0's
    paged pass over each prefix's last `window` keys (kv_start_idx = prefix - window), planned with
    the custom mask _build_swa_prefix_custom_mask builds ([extend, listed] blocks, k >= q - window),
    which FlashInfer packs: recorded packed, read back, clean; a list one column off named."""
    model, prefix, extend = window_model(), [5, 1], [2, 1]
    batch = extend_step(prefix)
    start = [max(p - WINDOW, 0) for p in prefix]

    def backend(shift: int = 0) -> SimpleNamespace:
        kv_rows = [EXTEND_ROWS[2][start[0] - shift : prefix[0] - shift], EXTEND_ROWS[4][start[1] : prefix[1]]]
        blocks = [(torch.arange(p - s)[None, :] + s >= torch.arange(e)[:, None] + p - WINDOW).flatten() for p, e, s in zip(prefix, extend, start)]
        swa = flashinfer_extend_backend(qo=[0, 2, 3], kv_rows=kv_rows, use_ragged=True, extend_no_prefix=False).forward_metadata.prefill_wrappers[0]
        swa._custom_mask_buf, swa._mask_indptr_buf = pack_little(torch.cat(blocks), [b.numel() for b in blocks])
        full = flashinfer_extend_backend(qo=[0, 2, 3], kv_rows=[EXTEND_ROWS[2][:5], EXTEND_ROWS[4][:1]], use_ragged=True, extend_no_prefix=False).forward_metadata.prefill_wrappers[0]
        md = PrefillMetadata(prefill_wrappers=[swa, full], use_ragged=True, extend_no_prefix=False)
        return SimpleNamespace(forward_metadata=md, page_size=1, dispatch_reason=env.sgl.flashinfer_backend.WrapperDispatch.SLIDING_WINDOW)

    plan = recorded(backend(), model)
    assert (plan.scalars["path"], plan.scalars["window_left"], plan.scalars["causal"]) == ("cascade", WINDOW, False)
    assert check(tmp_path, batch, plan, engine_backend="flashinfer", model=model) == []

    # Planted: request 0's window list starts one column early (a wrong kv_start_idx).
    found = check(tmp_path, batch, recorded(backend(shift=1), model), engine_backend="flashinfer", model=model, name="shifted")
    assert any(field.startswith("plan.kv_indices") for _, _, field in found), found
