"""Real vLLM `CommonAttentionMetadata` batches on the CPU, laid out the way vLLM's own tests do
(tests/v1/attention/utils.py, engines.md B7): block_size 16, block 0 is the null block, blocks
handed out in a permuted order, `slot_mapping = block * block_size + offset`, decodes first.

Importing this module skips the test module when vLLM is missing (fails under
ATTNDBG_REQUIRE_ENGINES=1). The expectations the tests compare against are computed here from the
block lists with plain Python integers, not by the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace.build import source
from attndbg.record.vllm.convert import Converted
from attndbg.replay.runner import RunStatus, replay
from attndbg.trace import io
from attndbg.trace.schema import AttentionKind, Model, Plan, Trace
from tests.record.engines import import_engine

vllm_backend = import_engine("vllm.v1.attention.backend")
CommonAttentionMetadata = vllm_backend.CommonAttentionMetadata
AttentionMetadataBuilder = vllm_backend.AttentionMetadataBuilder

BLOCK_SIZE = 16
NUM_BLOCKS = 12  # pool of 192 slots; block 0 is vLLM's null block
STALE_POSITION = 9  # vLLM leaves the positions of padded tokens stale (engines.md B5)


@dataclass(frozen=True)
class Layout:
    """One step as vLLM's runner hands it to the builders, plus what attndbg must record."""

    cm: CommonAttentionMetadata
    seq_lens: list[int]
    query_lens: list[int]
    blocks: list[list[int]]  # block ids of each real request, in column order
    pad_reqs: int
    pad_tokens: int

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]

    def slots(self, b: int) -> list[int]:
        """Slot of each KV column of request b: its block's id * 16 + the column's offset."""
        return [self.blocks[b][col // BLOCK_SIZE] * BLOCK_SIZE + col % BLOCK_SIZE for col in range(self.seq_lens[b])]

    def new_token_slots(self) -> list[int]:
        return [slot for b in range(len(self.seq_lens)) for slot in self.slots(b)[self.context_lens[b] :]]

    def positions(self) -> list[int]:
        return [c + i for c, q in zip(self.context_lens, self.query_lens) for i in range(q)]


def permuted_blocks(seq_lens: list[int], seed: int) -> list[list[int]]:
    """Give each request ceil(seq_len / 16) blocks from a random permutation of 1..NUM_BLOCKS-1."""
    order = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    out, cursor = [], 0
    for s in seq_lens:
        need = -(-s // BLOCK_SIZE)
        out.append(order[cursor : cursor + need])
        cursor += need
    assert cursor < NUM_BLOCKS, "the test batch needs more blocks than the pool has"
    return out


def make_layout(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    blocks: list[list[int]] | None = None,
    seed: int = 0,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    prefilling: list[bool] | None = None,
    with_positions: bool = True,
) -> Layout:
    """A real CommonAttentionMetadata; with padding shaped like vLLM 0.33's FULL-graph steps:
    padded rows have seq_len 0, query_len 0 and NULL_BLOCK_ID rows, padded tokens slot -1."""
    blocks = blocks if blocks is not None else permuted_blocks(seq_lens, seed)
    layout = Layout(None, seq_lens, query_lens, blocks, pad_reqs, pad_tokens)  # type: ignore[arg-type]
    rows = len(seq_lens) + pad_reqs
    width = max(len(b) for b in blocks) + 1
    table = torch.zeros(rows, width, dtype=torch.int32)  # padded rows stay NULL_BLOCK_ID 0
    for b, ids in enumerate(blocks):
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    cu += [cu[-1]] * pad_reqs
    tokens = cu[-1] + pad_tokens
    query_start_loc = torch.tensor(cu, dtype=torch.int32)
    slots = torch.tensor(layout.new_token_slots() + [-1] * pad_tokens, dtype=torch.int64)
    positions = torch.tensor(layout.positions() + [STALE_POSITION] * pad_tokens, dtype=torch.int64)
    seq = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    is_prefilling = torch.tensor((prefilling or [False] * len(seq_lens)) + [False] * pad_reqs)
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq,
        num_reqs=rows,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=slots,
        causal=True,
        positions=positions if with_positions else None,
        is_prefilling=is_prefilling,
        seq_lens_cpu_upper_bound=seq.clone(),
    )
    return replace(layout, cm=cm)


def tiny_model(*, q_dtype: str = "bfloat16") -> Model:
    """Small enough for the Triton interpreter: 4 query heads over 2 KV heads of width 32."""
    return Model(
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=32,
        v_head_dim=32,
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=32**-0.5,
        logit_cap=0.0,
        sliding_window=-1,
        q_dtype=q_dtype,
        kv_dtype=q_dtype,
        page_size=BLOCK_SIZE,
    )


def trace_of(converted: Converted, *, model: Model | None = None, plan: Plan | None = None, backend: str = "TRITON_ATTN") -> Trace:
    return Trace(
        source=source(engine="vllm", backend=backend, device="cpu", step=0),
        model=model or tiny_model(),
        batch=converted.batch,
        seed=0,
        spec=converted.spec,
        graph=converted.graph,
        plan=plan,
    )


def usable(trace: Trace, path: Path) -> Trace:
    """Save (validates), load, replay through reference + Triton, run every detector: all clean."""
    loaded = io.load(io.save(trace, path))
    result = replay(loaded, str(path), ["reference", "triton"])
    for run in result.runs:
        assert run.status is RunStatus.PASSED, (run.name, run.variant, run.reason, run.comparison)
    findings = [f for report in check_steps(str(path), parse_only(None), CheckOptions(backends=("triton",))) for f in report.findings]
    assert findings == [], [(f.kind.value, f.check, f.evidence) for f in findings]
    return loaded


def tiny_vllm_config(model_dir: Path, *, num_layers: int = 1, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 32):
    """A real VllmConfig on the CPU: a real ModelConfig read from a tiny Llama config.json written
    to `model_dir` (no weights, no tokenizer), float32, block size 16."""
    from transformers import LlamaConfig
    from vllm import config as cfg

    LlamaConfig(
        hidden_size=q_heads * head_dim,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=128,
        max_position_embeddings=256,
    ).save_pretrained(model_dir)
    model = cfg.ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256)
    return cfg.VllmConfig(model_config=model, cache_config=cfg.CacheConfig(block_size=BLOCK_SIZE), device_config=cfg.DeviceConfig(device="cpu"))


def layer_name(index: int) -> str:
    """vLLM's name of a Llama decoder layer's attention (`Attention.layer_name`)."""
    return f"model.layers.{index}.self_attn.attn"


class AttentionLayerStub(torch.nn.Module):
    """What `AttentionImpl.forward` reads from its `layer` argument (vLLM's `AttentionLayer`
    protocol: the name and unit q/k/v scales), like vLLM's own tests' MockAttentionLayer; the real
    `Attention` module needs a model being loaded to exist."""

    def __init__(self, name: str):
        super().__init__()
        self.layer_name = name
        for scale in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu"):
            setattr(self, scale, torch.ones(1))
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0


def new_kv_cache(generator: torch.Generator, *, kv_heads: int = 2, head_dim: int = 32) -> torch.Tensor:
    """One layer's KV cache in vLLM 0.33's per-layer layout [blocks, Hkv, block_size, K | V],
    filled with random "earlier steps" contents."""
    return torch.randn(NUM_BLOCKS, kv_heads, BLOCK_SIZE, 2 * head_dim, generator=generator)


def cache_rows(kv_cache: torch.Tensor, slots: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) rows [len(slots), Hkv, D] of `slots`, read with plain indexing: block = slot // 16."""
    slots = torch.as_tensor(slots, dtype=torch.int64)
    head_dim = kv_cache.shape[-1] // 2
    rows = kv_cache[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]  # [n, Hkv, 2D]
    return rows[..., :head_dim], rows[..., head_dim:]


def write_new_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """What vLLM's `do_kv_cache_update` does before `forward` (Triton backend), in plain torch:
    token t's K/V into slot_mapping[t]; padded tokens (slot -1) are skipped. (vLLM's own
    reshape_and_cache kernel asks the CUDA device for its capability: it cannot run on the CPU.)"""
    head_dim = kv_cache.shape[-1] // 2
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE, :head_dim] = key[t]
            kv_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE, head_dim:] = value[t]
