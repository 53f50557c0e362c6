"""SGLang's trtllm_mla backend through the recorder's reader and the checker: its
TRTLLMMLADecodeMetadata (loaded from SGLang's source: the module imports flashinfer and GPU-only
kernels) as its init_forward_metadata and graph refill leave it, read as the `mla` adapter's
`trtllm` form and checked on the CPU. A correct step of each mode checks clean; a planted mistake
is named by its field. trtllm-gen's kernels run only on SM100: the plan is judged, never run here
as another library's kernel."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.backends import engine_names
from attndbg.backends.base import KernelUnsupported
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.record.sglang.adapter import backend_name
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.trace.schema import ForwardMode
from tests.record.test_sglang_plan_contract import CAPTURE_BS, MLA_CACHE, MLA_ROWS, check, mla_chain_verify_step, mla_decode_step, mla_model, padded_replay, recorded
from tests.record.test_sglang_verify import N, PREFIX
from tests.record.test_sglang_plans import sglang_class

I64, I32 = env.I64, env.I32
TRTLLMMLADecodeMetadata = sglang_class("sglang.srt.layers.attention.trtllm_mla_backend", "TRTLLMMLADecodeMetadata")


def trtllm_backend(md: object | None = None, *, graphs: dict[int, object] | None = None, num_draft_tokens: int | None = None) -> SimpleNamespace:
    """TRTLLMMLABackend's state the reader reads (its attribute names): the step's decode metadata,
    the per-captured-bs metadata, the graph's block table buffer, page size 64."""
    return SimpleNamespace(
        forward_decode_metadata=md,
        decode_cuda_graph_metadata=graphs or {},
        decode_cuda_graph_kv_indices=torch.full((8, 4), -1, dtype=I32),
        page_size=64,
        num_draft_tokens=num_draft_tokens,
    )


def decode_metadata(table: list[list[int]], seq_lens: list[int]) -> object:
    """init_forward_metadata's decode branch: seq_lens_k = seq_lens (int32), block_kv_indices of
    the pool's 64-token pages (req_to_token[req, 64 p] // 64, -1 past a row's pages)."""
    return TRTLLMMLADecodeMetadata(block_kv_indices=torch.tensor(table, dtype=I32), max_seq_len_k=max(seq_lens), seq_lens_k=torch.tensor(seq_lens, dtype=I32))


def test_the_name_maps_to_the_mla_adapter_and_its_plans_are_not_run_as_another_library() -> None:
    assert engine_names.adapter_for("trtllm_mla") is MLABackend
    assert engine_names.fill_requirement("trtllm_mla").min_seq_len == 1
    named = SimpleNamespace(decode_attention_backend_str="trtllm_mla", prefill_attention_backend_str="trtllm_mla")
    assert backend_name(named, ForwardMode.DRAFT_EXTEND) == "trtllm_mla"
    assert MLABackend(MLAOptions(impl="trtllm")).unavailable_reason() is not None
    model, (batch, fb) = mla_model(), mla_decode_step()
    plan = recorded(trtllm_backend(decode_metadata([[1], [2]], [5, 9])), model)
    trace = SimpleNamespace(model=model, batch=batch)
    try:
        MLABackend(MLAOptions(impl="triton")).run(trace, None, plan)
    except KernelUnsupported as e:
        assert "SM100" in str(e) and "not run as another library's kernel" in str(e)
    else:
        raise AssertionError("a trtllm plan ran on another implementation")


def test_decode_eager(tmp_path) -> None:
    model, (batch, _) = mla_model(), mla_decode_step()
    plan = recorded(trtllm_backend(decode_metadata([[1], [2]], [5, 9])), model)
    assert plan.backend == "mla" and plan.scalars == {"impl": "trtllm", "page_size": 64, "max_seq_len_k": 9, "q_len": 1}
    assert plan.tensors["seq_lens_k"].tolist() == [5, 9]
    assert check(tmp_path, batch, plan, engine_backend="trtllm_mla", model=model) == []

    # Planted: request 1's block table row holds request 0's page.
    found = check(tmp_path, batch, recorded(trtllm_backend(decode_metadata([[1], [1]], [5, 9])), model), engine_backend="trtllm_mla", model=model, name="wrong")
    assert any(check_id == "kv-index" and field.startswith("plan.block_kv_indices") for _, check_id, field in found), found


def test_a_plain_extend_reads_no_stale_decode_metadata() -> None:
    """A plain extend runs trtllm_mla's ragged prefill (or FlashInfer MLA's): the decode metadata
    an earlier step left is not this step's plan."""
    from attndbg.record.sglang.plan import plan_from_backend

    assert plan_from_backend(trtllm_backend(decode_metadata([[1], [2]], [5, 9])), model=mla_model(), extend=True) is None


def test_decode_graph_padded(tmp_path) -> None:
    """At a bs-4 replay the captured bs's metadata is refilled in place: seq_lens_k the padded
    seq_lens (fill 1), block_kv_indices over them (padded rows: req_to_token row 0, page 0)."""
    model, (_, fb) = mla_model(), mla_decode_step()
    view, graph, tensors = padded_replay(fb, env.ForwardMode.DECODE)
    batch = batch_from_forward_batch(view, env.req_pool(MLA_ROWS, width=128).req_to_token, MLA_CACHE, raw_bs=2)
    captured = decode_metadata([[1, -1], [2, -1], [0, -1], [0, -1]], [5, 9, 1, 1])
    stale = decode_metadata([[3], [3]], [64, 64])  # the eager step's, left on the backend: not read
    plan = recorded(trtllm_backend(stale, graphs={CAPTURE_BS: captured}), model, graph_bs=CAPTURE_BS)
    assert plan.tensors["seq_lens_k"].tolist() == [5, 9, 1, 1]
    assert check(tmp_path, batch, plan, engine_backend="trtllm_mla", model=model, graph=graph) == []

    wrong = decode_metadata([[1, -1], [2, -1], [0, -1], [9, -1]], [5, 9, 1, 1])
    found = check(tmp_path, batch, recorded(trtllm_backend(stale, graphs={CAPTURE_BS: wrong}), model, graph_bs=CAPTURE_BS), engine_backend="trtllm_mla", model=model, graph=graph, name="wrong")
    assert any(field.startswith("plan.block_kv_indices[3") for _, _, field in found), found


def test_chain_verify_eager(tmp_path) -> None:
    """init_forward_metadata's verify branch: seq_lens_k = seq_lens + num_draft_tokens, the block
    table over them, q dense [bs, n]; the plan's q_len is the backend's num_draft_tokens."""
    model = mla_model()
    batch, spec, _, chain_info = mla_chain_verify_step()
    lens = [p + N for p in PREFIX]
    plan = recorded(trtllm_backend(decode_metadata([[1], [2]], lens), num_draft_tokens=N), model, verify=True, spec_info=chain_info)
    assert plan.scalars["q_len"] == N and plan.tensors["seq_lens_k"].tolist() == lens
    assert check(tmp_path, batch, plan, engine_backend="trtllm_mla", model=model, spec=spec) == []

    # Planted: seq_lens_k without the draft tokens (the kernel would not see them).
    short = recorded(trtllm_backend(decode_metadata([[1], [2]], PREFIX), num_draft_tokens=N), model, verify=True, spec_info=chain_info)
    found = check(tmp_path, batch, short, engine_backend="trtllm_mla", model=model, spec=spec, name="short")
    assert any(check_id == "kv-length" for _, check_id, _ in found), found


# -- DRAFT_EXTEND_V2 through the installed hooks: eager, and the multi-layer runner's replays ----------


def _eager_draft_extend(from_accepted: bool):
    from tests.corpus import sglang_engine as sg
    from tests.corpus.sglang_trtllm_mla import PAGE, TRTLLMMLADecodeMetadata as Metadata, _block_table

    def plan(made, fb) -> None:
        """init_forward_metadata's DRAFT_EXTEND_V2 branch: the queries from extend_seq_lens (the
        window), or, planted, from the spec input's accepted counts; seq_lens_k = seq_lens -
        extend_seq_lens + max_seq_len_q; the block table over seq_lens_k."""
        q = fb.spec_info.num_accept_tokens.to(I32) if from_accepted else fb.extend_seq_lens.to(I32)
        top = int(q.max())
        seq_lens_k = (fb.seq_lens - fb.extend_seq_lens + top).to(I32)
        table = torch.full((fb.batch_size, -(-int(fb.seq_lens_cpu.max()) // PAGE)), -1, dtype=I32)
        _block_table(made, fb.req_pool_indices, seq_lens_k, table)
        made.forward_decode_metadata = Metadata(
            block_kv_indices=table, max_seq_len_k=int(fb.seq_lens_cpu.max()), max_seq_len_q=top, sum_seq_lens_q=int(q.sum()),
            cu_seqlens_q=torch.nn.functional.pad(torch.cumsum(q, 0), (1, 0)).to(I32), seq_lens_q=q, seq_lens_k=seq_lens_k,
        )  # fmt: skip

    return plan, sg


def _record_eager(out, *, from_accepted: bool) -> None:
    from tests.corpus.sglang_trtllm_mla import ACCEPTED, HEADS, PREFIX as DRAFT_PREFIX, ROWS, WINDOW, trtllm_mla_backend

    plan, sg = _eager_draft_extend(from_accepted)
    with sg.recording(out) as session:
        layer = sg.layer(heads=HEADS, kv_heads=1, head_dim=576, v_head_dim=512)  # noqa: F841 (the recorder reads the latest live layer)
        sg.record_eager(session, trtllm_mla_backend(plan), sg.draft_extend_v2_batch(ROWS, DRAFT_PREFIX, WINDOW, ACCEPTED))


def _findings(out) -> list[tuple[str, str]]:
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import parse_only
    from attndbg.detector_api.context import CheckOptions

    reports = list(check_steps(str(out), parse_only("invariants,fill-value"), CheckOptions(backends=("reference",))))
    assert reports and all(report.checked for report in reports), [report.error for report in reports]
    return [(f.check, f.location.field or "") for report in reports for f in report.findings]


def test_draft_extend_eager_through_the_hooks(tmp_path) -> None:
    from attndbg.trace import io

    _record_eager(tmp_path / "right", from_accepted=False)
    [entry] = io.read_manifest(tmp_path / "right")
    trace = io.load(tmp_path / "right" / entry.file)
    assert trace.source.backend == "trtllm_mla" and trace.plan.scalars["impl"] == "trtllm" and trace.plan.scalars["max_seq_len_q"] == 4
    assert trace.plan.tensors["cu_seqlens_q"].tolist() == [0, 4, 8, 12]
    assert _findings(tmp_path / "right") == []

    _record_eager(tmp_path / "wrong", from_accepted=True)
    found = _findings(tmp_path / "wrong")
    assert ("qo-lens", "plan.cu_seqlens_q[1]") in found and ("qo-lens", "plan.seq_lens_q[0]") in found and ("qo-lens", "scalars.max_seq_len_q") in found, found


def test_multi_layer_draft_extend_replays_through_the_hooks(tmp_path) -> None:
    """The multi-layer runner's prepare and per-layer replays over two trtllm_mla draft layers:
    each layer's step reads its own backend's captured metadata; the fix's uniform layout is clean,
    the variable stride named on every layer's step (this runner's prepare leaves the padded row's
    num_accept_tokens at -1, so the bug's offsets also decrease there)."""
    from tests.corpus import sglang_engine as sg
    from tests.corpus.sglang_draft_modes import MultiLayerDraftExtendGraph, multi_layer_draft_extend_batch
    from tests.corpus.sglang_trtllm_mla import ACCEPTED, CAPTURE_BS, HEADS, PREFIX as DRAFT_PREFIX, ROWS, WINDOW, _replay, trtllm_mla_backend

    for name, variable in (("right", False), ("wrong", True)):
        with sg.recording(tmp_path / name) as session:
            layer = sg.layer(heads=HEADS, kv_heads=1, head_dim=576, v_head_dim=512)  # noqa: F841
            backends = [trtllm_mla_backend(_replay(variable)) for _ in range(2)]
            runner = MultiLayerDraftExtendGraph(backends, capture_bs=CAPTURE_BS, width=WINDOW, fill=1)
            runner.prepare(multi_layer_draft_extend_batch(ROWS, DRAFT_PREFIX, WINDOW, ACCEPTED))
            for step in range(2):
                runner.replay(step)
            assert len(sg.written(session)) == 2
    assert _findings(tmp_path / "right") == []
    found = _findings(tmp_path / "wrong")
    assert found.count(("qo-lens", "plan.seq_lens_q[0]")) == 2 and found.count(("indptr-decreases", "plan.cu_seqlens_q[4]")) == 2, found


def test_a_malformed_query_layout_in_a_trace_is_no_traceback(tmp_path) -> None:
    """A trace is untrusted: seq_lens_q of another shape and a max_seq_len_q that is no integer are
    not judged (no crash); the offsets beside them still are."""
    from dataclasses import replace

    from attndbg.trace import io

    _record_eager(tmp_path / "step", from_accepted=True)
    [entry] = io.read_manifest(tmp_path / "step")
    trace = io.load(tmp_path / "step" / entry.file)
    plan = trace.plan
    io.save(replace(trace, plan=replace(plan, tensors={**plan.tensors, "seq_lens_q": torch.zeros(3, 2, dtype=I32)}, scalars={**plan.scalars, "max_seq_len_q": "x"})), tmp_path / "step" / entry.file)
    found = _findings(tmp_path / "step")
    assert ("qo-lens", "plan.cu_seqlens_q[1]") in found and not [f for f in found if "seq_lens_q" in f[1] or "max_seq_len_q" in f[1]], found
