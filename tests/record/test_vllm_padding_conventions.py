"""vLLM 0.33's CUDA-graph padding, recorded through the vLLM adapter, judged by the kernel that
consumes it.

The steps are vLLM's real `CommonAttentionMetadata`, padded the way vLLM 0.33's runner pads a
FULL-CUDA-graph step (`GPUModelRunner._build_attention_metadata` and `_prepare_inputs`): the
metadata is built with `num_reqs_padded` rows; padded rows have query_len 0 (query_start_loc's
tail repeats its last real entry), seq_len 0 (`seq_lens[num_reqs:].fill_(0)`), block-table rows
of NULL_BLOCK_ID 0 (`blk_table_tensor[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)`), padded
tokens slot -1 and stale positions; `is_prefilling` False. Two shapes: a decode (2 requests padded
to a capture size of 4) and a uniform spec-decode step (2 requests of 1 + 3 tokens under vLLM's
real ngram SpeculativeConfig, padded by 2 rows of 4 tokens).

Each step is recorded through the installed hook, i.e. by calling a wrapped
`AttentionMetadataBuilder.build`, and checked with `attndbg check --json` (every detector, the
Triton kernels):

- TRITON_ATTN: vLLM's real `TritonAttentionMetadataBuilder` builds it. vLLM's unified Triton
  attention reads nothing of a request without query tokens: clean.
- FLASHINFER: vLLM's FlashInfer backend module imports the `flashinfer` package at its top, which
  is not installed here, so neither vLLM's `FlashInferBackend` nor its `FlashInferMetadataBuilder`
  exists in this process and no FlashInfer metadata can be built. The step goes through the same
  hook on `FlashInferBuilderUnavailable`, a subclass of vLLM's real `AttentionMetadataBuilder`
  that builds nothing (`build` returns None): the trace holds what the adapter records when the
  builder's output is unavailable, the engine's `CommonAttentionMetadata` verbatim (`common.*`)
  and no FlashInfer plan, under vLLM's own name for its FlashInfer backend (its registry's
  `AttentionBackendEnum.FLASHINFER`, which is what `FlashInferBackend.get_name()` returns in
  vLLM's source: both checked below). No FlashInfer output is made up. `check` judges the
  recorded padding by FlashInfer's requirement (seq_len >= 1: FlashInfer #2883, vLLM #38436):
  exactly one finding naming FLASHINFER, the fill 0, the first padded request and its field; a
  hazard (the real rows are right), so `check` exits 0 and names it on the verdict line, and
  `check --strict` exits 1.
- The same FlashInfer step padded with seq_len 1 (what vLLM #38436 proposed; closed unmerged)
  meets the requirement: no `padded-seq-len-unsupported`. It is not clean, though: the converter
  records vLLM's fill as 0 (`record/vllm/convert.py` VLLM_FILL_VALUE: vLLM 0.33's runner resets
  padded rows to 0 every step), so fill-value reports the 1s as a `padded-seq-len-stale` hazard,
  as test_vllm_evidence.py does for TRITON_ATTN.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends import engine_names
from attndbg.cli import main
from attndbg.record.session import RecordingSession
from attndbg.trace.schema import ForwardMode, Trace
from tests.record.check_cli import check_json
from tests.record.engines import import_engine
from tests.record.test_vllm_evidence import PADDED, pool_config, seq_lens  # noqa: F401  (fixture)
from tests.record.test_vllm_spec_verify import PREFIX, spec_config, verify_layout  # noqa: F401  (fixture)
from tests.record.vllm_builder_env import HEAD_DIM, KV_HEADS, LAYERS, kv_cache_interface, written
from tests.record.vllm_builder_env import session, vllm_config  # noqa: F401  (fixtures)
from tests.record.vllm_env import BLOCK_SIZE, CommonAttentionMetadata, make_layout

vllm_backend = import_engine("vllm.v1.attention.backend")
vllm_registry = import_engine("vllm.v1.attention.backends.registry")
triton_attn = import_engine("vllm.v1.attention.backends.triton_attn")

FLASHINFER_MODULE = "vllm.v1.attention.backends.flashinfer"
REAL_ROWS = len(PADDED["seq_lens"])  # == len(PREFIX): both steps pad 2 real requests to 4 rows
assert REAL_ROWS == len(PREFIX)
CAPTURE_BS = REAL_ROWS + PADDED["pad_reqs"]


class FlashInferBuilderUnavailable(vllm_backend.AttentionMetadataBuilder):
    """Stands where vLLM's FlashInferMetadataBuilder would be, which cannot be imported without the
    flashinfer package: vLLM's base class (so the adapter wraps it like any builder), no output."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False) -> None:
        return None  # FlashInfer's plan needs the flashinfer package: nothing is built


class FlashInferNameOnly(vllm_backend.AttentionBackend):
    """vLLM's name for its FlashInfer backend, from vLLM's registry; the adapter finds a builder's
    backend name in the builder's module (`record/vllm/model.py` backend_name)."""

    @staticmethod
    def get_name() -> str:
        return vllm_registry.AttentionBackendEnum.FLASHINFER.name

    @staticmethod
    def get_builder_cls() -> type:
        return FlashInferBuilderUnavailable

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError(f"{FLASHINFER_MODULE} needs the flashinfer package")


def _source_get_name(module: str, cls: str) -> str:
    """What `cls.get_name()` returns in vLLM's source of `module`, read without importing it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not in this vLLM"
    tree = ast.parse(Path(spec.origin).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    method = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "get_name")
    [returned] = [n.value for n in ast.walk(method) if isinstance(n, ast.Return)]
    assert isinstance(returned, ast.Constant), ast.dump(returned)
    return returned.value


def test_the_flashinfer_steps_carry_vllms_own_name_for_its_flashinfer_backend() -> None:
    registry = vllm_registry.AttentionBackendEnum.FLASHINFER
    assert registry.value == f"{FLASHINFER_MODULE}.FlashInferBackend"
    assert _source_get_name(FLASHINFER_MODULE, "FlashInferBackend") == registry.name == FlashInferNameOnly.get_name() == "FLASHINFER"
    # The name our FlashInfer adapter answers to, and what its kernels need of padded rows.
    assert engine_names.fill_requirement("FLASHINFER").min_seq_len == 1
    assert engine_names.fill_requirement("TRITON_ATTN").min_seq_len == 0


def _spec() -> Any:
    return kv_cache_interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)


def _builder(backend: str, config: Any) -> Any:
    if backend == "TRITON_ATTN":
        return triton_attn.TritonAttentionMetadataBuilder(_spec(), LAYERS, config, torch.device("cpu"))
    return FlashInferBuilderUnavailable(_spec(), LAYERS, config, torch.device("cpu"))


def _step(shape: str, config: Any, padded_seq_len: int) -> CommonAttentionMetadata:
    """The padded step; padded rows' seq_len (and its host upper bound) set to `padded_seq_len`."""
    cm = make_layout(**PADDED).cm if shape == "decode" else verify_layout(config, pad_reqs=CAPTURE_BS - REAL_ROWS).cm
    if padded_seq_len == 0:
        return cm
    lens = cm.seq_lens.tolist()[:REAL_ROWS] + [padded_seq_len] * (CAPTURE_BS - REAL_ROWS)
    return cm.replace(**seq_lens(lens))


def _record(session: RecordingSession, backend: str, config: Any, cm: CommonAttentionMetadata) -> Trace:
    _builder(backend, config).build(0, cm)
    [trace] = written(session)
    assert session.stats.stopped_reason is None
    return trace


SHAPES = ["decode", "spec-decode"]


def _checked(session: RecordingSession) -> list[dict[str, Any]]:
    """Every finding of `attndbg check --json` on the recording (every detector); the Triton
    kernels replayed the step, padded replays included."""
    [step] = check_json(session.out_dir)["steps"]
    assert step["backends"] == ["triton"], step
    return step["findings"]


@pytest.fixture
def configs(pool_config, spec_config) -> dict[str, Any]:  # noqa: F811
    return {"decode": pool_config, "spec-decode": spec_config}


def _recorded_as_padding(trace: Trace, shape: str, cm: CommonAttentionMetadata, backend: str) -> None:
    assert trace.source.engine == "vllm" and trace.source.backend == backend
    mode = ForwardMode.DECODE if shape == "decode" else ForwardMode.TARGET_VERIFY
    assert trace.batch.forward_mode is mode and trace.batch.batch_size == REAL_ROWS
    graph = trace.graph
    assert (graph.is_graph_replay, graph.capture_bs, graph.fill_value) == (True, CAPTURE_BS, 0)
    assert graph.padded_seq_lens.tolist() == cm.seq_lens.tolist()
    assert graph.padded_out_cache_loc.tolist() == cm.slot_mapping.tolist()  # padded tokens: -1
    # The engine's metadata verbatim: the padded rows' query_start_loc tail and NULL_BLOCK_ID rows.
    plan = trace.plan.tensors
    assert plan["common.query_start_loc"].tolist() == cm.query_start_loc.tolist()
    assert plan["common.block_table_tensor"][REAL_ROWS:].eq(0).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_attn_takes_vllms_seq_len_0_padding(session: RecordingSession, configs, shape: str) -> None:  # noqa: F811
    cm = _step(shape, configs[shape], padded_seq_len=0)
    trace = _record(session, "TRITON_ATTN", configs[shape], cm)
    _recorded_as_padding(trace, shape, cm, "TRITON_ATTN")
    assert trace.plan.scalars["vllm.builder"] == "TritonAttentionMetadataBuilder"
    assert _checked(session) == []


@pytest.mark.parametrize("shape", SHAPES)
def test_flashinfer_cannot_take_it_and_the_finding_names_backend_fill_and_row(session: RecordingSession, configs, shape: str) -> None:  # noqa: F811
    cm = _step(shape, configs[shape], padded_seq_len=0)
    trace = _record(session, "FLASHINFER", configs[shape], cm)
    _recorded_as_padding(trace, shape, cm, "FLASHINFER")
    # The builder built nothing: the plan is the engine's common metadata alone.
    assert trace.plan.backend == "FLASHINFER" and trace.plan.scalars["vllm.metadata"] == "NoneType"
    assert all(name.startswith("common.") for name in trace.plan.tensors)
    [found] = _checked(session)
    need = engine_names.fill_requirement("FLASHINFER")
    assert (found["class"], found["check"]) == ("fill-value", "padded-seq-len-unsupported")
    assert (found["location"]["request"], found["location"]["field"]) == (REAL_ROWS, f"graph.padded_seq_lens[{REAL_ROWS}]")
    assert found["data"]["backend"] == "FLASHINFER" and found["data"]["fill_value"] == 0 and found["data"]["min_seq_len"] == 1
    assert found["data"]["padded_seq_lens"] == [0] * (CAPTURE_BS - REAL_ROWS)
    assert f"graph.padded_seq_lens[{REAL_ROWS}] = 0" in found["evidence"] and "ran on FLASHINFER, which needs >= 1" in found["evidence"]
    assert need.why in found["cause"] and "#38436" in found["cause"] and "#2883" in found["cause"]
    # vLLM's own convention leaves the real rows right: a hazard (FlashInfer #2883, NaN in padded
    # rows, harmful only where a later op mixes rows). Named on the verdict line; exit 0, --strict 1.
    assert found["severity"] == "hazard"
    args = ["check", str(session.out_dir), "--backend", "triton", "--in-process", "--jobs", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "0 defects, 1 hazard (fill-value/padded-seq-len-unsupported;" in " ".join(result.output.split())
    assert CliRunner().invoke(main, [*args, "--strict"]).exit_code == 1


@pytest.mark.parametrize("shape", SHAPES)
def test_flashinfer_padded_with_seq_len_1_meets_its_requirement(session: RecordingSession, configs, shape: str) -> None:  # noqa: F811
    cm = _step(shape, configs[shape], padded_seq_len=1)
    trace = _record(session, "FLASHINFER", configs[shape], cm)
    assert trace.graph.padded_seq_lens.tolist()[REAL_ROWS:] == [1] * (CAPTURE_BS - REAL_ROWS)
    found = [(f["class"], f["check"], f["location"].get("field"), f["severity"]) for f in _checked(session)]
    # No kernel requirement is broken. What remains is the converter's vLLM fill (0) against the 1s
    # the runner left: a hazard (see the module docstring).
    assert found == [("fill-value", "padded-seq-len-stale", f"graph.padded_seq_lens[{REAL_ROWS}]", "hazard")]
