"""Capabilities are data and "why not" is derived from them, the same way for every backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.backends import registry
from attndbg.backends.capabilities import ENGINE_GRAPH_MODES, Capabilities, HeadDims, LatentDims
from attndbg.backends.fa3 import FA3Backend
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import AttentionKind, ForwardMode, LseBase
from tests.factories import make_trace

NARROW = Capabilities(
    kernels="toy kernels",
    modes={AttentionKind.MHA: frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND})},
    graph_modes=frozenset({ForwardMode.DECODE}),
    kv_dtype_is_q_dtype=True,
    head_dims=HeadDims(pairs=frozenset({(64, 64), (128, 128)}), why="instantiated for these"),
    page_sizes=frozenset({1, 16}),
    tree_mask=False,
    column_mask=False,
    window_in_tree_verify=False,
    soft_cap=False,
    why={"tree_mask": "causal only"},
)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (("mla-decode",), "an MLA model: toy kernels run MHA/GQA only"),
        (("mixed", "head_dim=64"), "MHA mixed: toy kernels run MHA decode/extend/target verify only"),
        (("decode-mha", "dtype=float32"), "toy kernels take fp16 or bf16 queries; this trace's are float32"),
        (("decode-mha", "dtype=float16", "kv_dtype=float8_e4m3fn"), "toy kernels take fp16 or bf16 KV; this trace's is float8_e4m3fn"),
        (("decode-mha", "dtype=float16", "kv_dtype=bfloat16"), "toy kernels take q and KV of one dtype; this trace has q float16, KV bfloat16"),
        (("verify", "head_dim=64"), "tree verify (topk=4) needs a custom mask, and toy kernels take no custom mask (causal only)"),
        (("softcap", "head_dim=64"), "toy kernels have no logit soft-cap"),
        (("decode-mha", "head_dim=96"), "head dims 96: toy kernels take 64/64, 128/128 (instantiated for these)"),
        (("decode-paged", "head_dim=64", "page_size=8"), "page_size 8: toy kernels read 1 or 16-token blocks"),
    ],
)
def test_the_first_gap_is_named_from_the_data(spec: tuple[str, ...], reason: str) -> None:
    assert NARROW.gap(make_trace(*spec)) == reason


def test_a_trace_inside_the_capabilities_has_no_gap() -> None:
    assert NARROW.gap(make_trace("decode-mha", "head_dim=64")) is None
    assert NARROW.gap(make_trace("verify-chain", "head_dim=64")) is None  # a chain needs no mask
    assert NARROW.graph_gap(make_trace("decode-mha", "head_dim=64")) is None


def test_graph_gap_separates_what_engines_capture_from_what_the_kernels_do() -> None:
    assert NARROW.graph_gap(make_trace("extend-prefix")) == "engines capture only decode and verify steps in CUDA graphs, not EXTEND"
    assert NARROW.graph_gap(make_trace("verify-chain")) == "toy kernels: no CUDA-graph replay of TARGET_VERIFY here"


def test_latent_dims_and_idle() -> None:
    mla = Capabilities(
        kernels="toy MLA kernels",
        attention=frozenset({AttentionKind.MLA}),
        modes={AttentionKind.MLA: frozenset({ForwardMode.DECODE})},
        latent_dims=LatentDims(multiples=(128, 64)),
    )
    assert mla.gap(make_trace("mla-decode", "kv_lora_rank=96")) == "kv_lora_rank 96 / rope 64: toy MLA kernels need multiples of 128 / 64"
    assert mla.gap(make_trace("decode-mha")) == "not an MLA model (attention=mha): toy MLA kernels run MLA only"
    exact = replace(mla, latent_dims=LatentDims(pairs=frozenset({(512, 64)})))
    assert exact.gap(make_trace("mla-decode", "rope_dim=32")) == "kv_lora_rank 512 / rope 32: toy MLA kernels take 512/64"


def test_an_adapter_that_declares_nothing_claims_nothing() -> None:
    bare = Capabilities(kernels="bare kernels")
    assert bare.gap(make_trace("decode-gqa")) is None
    assert bare.gap(make_trace("extend-prefix")) == "MHA extend: bare kernels run MHA decode only"
    assert bare.gap(make_trace("window-decode")) == "bare kernels have no sliding window"
    assert bare.gap(make_trace("softcap")) == "bare kernels have no logit soft-cap"
    assert bare.graph_modes == frozenset()


@pytest.mark.parametrize("name", registry.backend_names())
def test_every_backend_declares_capabilities_and_derives_its_reasons_from_them(name: str) -> None:
    backend = registry.create(name)
    capabilities = backend.capabilities()
    assert isinstance(capabilities, Capabilities)
    for spec in (("decode-gqa",), ("mla-decode",), ("verify",), ("selective",), ("decode-gqa", "dtype=float32")):
        trace = make_trace(*spec)
        gap = capabilities.gap(trace)
        if gap is not None:  # the declared gap is the reason given: nothing is checked twice, differently
            assert backend.unsupported_reason(trace) == gap


def test_what_the_builtin_backends_declare() -> None:
    assert TritonBackend().capabilities().keys_in_window(31) == 32  # SGLang's window_kv_indices: W + 1 slots
    assert FlashInferBackend().capabilities().lse_base is LseBase.TWO
    assert FlashInferBackend().capabilities().graph_modes == ENGINE_GRAPH_MODES
    assert not FA3Backend().capabilities().column_mask
    flashinfer_mla = MLABackend(MLAOptions("flashinfer")).capabilities()
    assert not flashinfer_mla.tree_mask and flashinfer_mla.attention == frozenset({AttentionKind.MLA})
    triton_mla = MLABackend(MLAOptions("triton")).capabilities()
    assert triton_mla.modes[AttentionKind.MLA] == frozenset({ForwardMode.DECODE})
    assert registry.create("reference").capabilities().graph_modes == frozenset()


def test_backends_command_prints_the_declarations() -> None:
    from click.testing import CliRunner

    from attndbg.cli import main

    plain = CliRunner().invoke(main, ["backends"])
    assert plain.exit_code == 0 and "what each declares" not in plain.output
    result = CliRunner().invoke(main, ["backends", "--capabilities"], env={"COLUMNS": "400"})  # wide enough for the whole table
    assert result.exit_code == 0, result.output
    declared = result.output.split("what each declares", 1)[1].splitlines()
    triton_row = next(line for line in declared if line.startswith("│ triton "))
    assert "W+1 keys, not in tree verify" in triton_row and "natural" in triton_row and ">= 1" in triton_row
    flashinfer_row = next(line for line in declared if line.startswith("│ flashinfer "))
    assert "base 2" in flashinfer_row and ">= 32 outside decode" in flashinfer_row
    # Narrower, the same declarations stacked, one a line under each backend's name.
    stacked = [line.rstrip() for line in CliRunner().invoke(main, ["backends", "--capabilities"], env={"COLUMNS": "120"}).output.split("what each declares", 1)[1].splitlines()]
    triton = stacked[stacked.index("  triton") + 1 :][:9]
    assert [line.split(None, 1)[0] for line in triton][-3:] == ["soft-cap", "LSE", "padded"]
    assert "    window           W+1 keys, not in tree verify" in triton and "    LSE              natural" in triton and "    padded seq_len   >= 1" in triton
