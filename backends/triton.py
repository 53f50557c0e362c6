"""`triton`: our own Triton kernels, reproducing SGLang's Triton attention backend.

The plan uses SGLang's `ForwardMetadata` names (kv_indptr, kv_indices, qo_indptr, custom_mask,
mask_indptr, num_kv_splits, max_extend_len), so a plan recorded from SGLang's Triton backend can
be run by the same code. Without a GPU the kernels run under the Triton interpreter on the CPU;
`describe()` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attndbg import machine
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, KernelError
from attndbg.trace import tree
from attndbg.trace.schema import AttentionKind, ForwardMode, Plan, Trace

# SGLang's default `--triton-attention-num-kv-splits`.
DEFAULT_MAX_KV_SPLITS = 8
# Core count the split heuristic assumes when no GPU is present: an H100 SXM's SM count, so a
# plan derived on a laptop matches the one an H100 would derive.
FALLBACK_CORE_COUNT = 132


@dataclass(frozen=True)
class TritonOptions:
    num_kv_splits: int | None = None  # force this many splits for every request (else the heuristic)
    max_kv_splits: int = DEFAULT_MAX_KV_SPLITS


def sglang_num_kv_splits(
    seq_lens: list[int], *, num_qo_heads: int, num_kv_heads: int, max_kv_splits: int, core_count: int
) -> list[int]:
    """SGLang's `get_num_kv_splits` heuristic (triton_backend.py), on the host.

    Two candidate chunk sizes: one that balances long against short requests (splits1), one that
    fills the GPU's cores (splits2, growing with log2 of the longest request); each request gets
    enough splits for the smaller chunk, capped at `max_kv_splits`.
    """
    if not seq_lens:
        return []
    max_len = max(seq_lens)
    min_len = max(min(seq_lens), 1)
    if max_len * 8 < min_len * 10:  # nearly uniform batch: treat as uniform
        min_len = max_len
    splits1 = min(-(-max_len // min_len), max_kv_splits)
    chunk1 = -(-max_len // splits1)
    ext_cores = int(core_count * max(math.log2(max(max_len, 1) / 64.0), 1.0))
    group = num_qo_heads // num_kv_heads
    if group == 1:
        token_grid = len(seq_lens) * num_qo_heads
    else:
        token_grid = len(seq_lens) * -(-num_qo_heads // min(16, group))
    splits2 = min(-(-ext_cores // token_grid), max_kv_splits)
    chunk2 = -(-max_len // max(splits2, 1))
    return [max(1, min(max(-(-n // chunk1), -(-n // chunk2)), max_kv_splits)) for n in seq_lens]


def _kernels():
    """Import the kernel modules only after the Triton mode is chosen (see machine.select_triton_mode)."""
    machine.select_triton_mode()
    from attndbg.backends.triton_kernels import decode, extend

    return decode, extend


def _triton_errors() -> tuple[type[BaseException], ...]:
    import triton

    errors = getattr(triton, "errors", None)
    return (RuntimeError, errors.TritonError) if errors and hasattr(errors, "TritonError") else (RuntimeError,)


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, options: TritonOptions | None = None):
        self.options = options or TritonOptions()
        # Decide compiled vs interpreted before anything imports triton: Triton reads
        # TRITON_INTERPRET when kernels and its language module are set up.
        machine.select_triton_mode()

    def unavailable_reason(self) -> str | None:
        if not machine.module_available("triton"):
            return "triton is not installed (pip install triton)"
        return None

    def device(self) -> str:
        return machine.kernel_device()

    def describe(self) -> str:
        import triton

        mode = machine.select_triton_mode()
        if mode is machine.TritonMode.INTERPRETER:
            why = "no CUDA GPU" if not machine.cuda_available() else "TRITON_INTERPRET=1 set"
            return f"our Triton kernels, triton {triton.__version__}, interpreted on the CPU ({why})"
        info = machine.gpu_info()
        return f"our Triton kernels, triton {triton.__version__}, compiled for {info.arch if info else 'cuda'}"

    def unsupported_reason(self, trace: Trace) -> str | None:
        model, batch = trace.model, trace.batch
        if model.kv_dtype.startswith("float8"):
            return "fp8 KV cache is not supported by our Triton kernels yet"
        if model.attention is AttentionKind.MLA and batch.forward_mode is not ForwardMode.DECODE:
            return f"MLA {batch.forward_mode.value} is not implemented in our Triton kernels (MLA decode only)"
        if trace.is_tree_verify and model.sliding_window >= 0:
            return "tree verify with a sliding window needs SGLang's window_kv_offsets, not implemented"
        if batch.forward_mode is ForwardMode.IDLE:
            return "an IDLE step has no attention to run"
        return None

    # -- plan ---------------------------------------------------------------------------------

    def core_count(self) -> int:
        info = machine.gpu_info()
        return info.num_sms if info else FALLBACK_CORE_COUNT

    def derive_plan(self, trace: Trace) -> Plan:
        if trace.batch.forward_mode is ForwardMode.DECODE:
            return self._decode_plan(trace)
        return self._extend_plan(trace)

    def _decode_plan(self, trace: Trace) -> Plan:
        batch, model = trace.batch, trace.model
        lens = batch.kv_lens
        window = model.sliding_window
        # Sliding window: SGLang passes only the window's slots (window_kv_indices).
        visible = torch.clamp(lens, max=window + 1) if window >= 0 else lens
        kv_indices = torch.cat(
            [batch.request_slots(b)[int(lens[b] - visible[b]) :] for b in range(batch.batch_size)]
        )
        if self.options.num_kv_splits is not None:
            splits = [self.options.num_kv_splits] * batch.batch_size
        else:
            splits = sglang_num_kv_splits(
                visible.tolist(),
                num_qo_heads=model.num_qo_heads,
                num_kv_heads=model.num_kv_heads,
                max_kv_splits=self.options.max_kv_splits,
                core_count=self.core_count(),
            )
        max_splits = max(self.options.max_kv_splits, max(splits))
        return Plan(
            backend=self.name,
            tensors={
                "kv_indptr": _indptr(visible).to(torch.int32),
                "kv_indices": kv_indices.to(torch.int64),
                "num_kv_splits": torch.tensor(splits, dtype=torch.int32),
            },
            scalars={"max_kv_splits": max_splits},
        )

    def _extend_plan(self, trace: Trace) -> Plan:
        batch = trace.batch
        tensors: dict[str, torch.Tensor] = {"qo_indptr": _indptr(batch.extend_lens).to(torch.int32)}
        scalars: dict[str, int | float | bool | str] = {
            "max_extend_len": int(batch.extend_lens.max()) if batch.batch_size else 0,
            "is_causal": True,
            "skip_prefix_custom_mask": True,
            "sliding_window": trace.model.sliding_window,
        }
        if batch.selective:
            # The recomputed tokens' K/V are already written into their slots, so the whole row is
            # read from the cache as "prefix" and a custom mask applies causality by column; the
            # extend block's columns are all masked (those keys were read from the cache).
            prefix_lens = batch.kv_lens
            window = trace.model.sliding_window
            masks = []
            qo = batch.qo_indptr
            for b in range(batch.batch_size):
                query_cols = batch.query_cols[int(qo[b]) : int(qo[b + 1])]
                distance = query_cols[:, None] - torch.arange(int(prefix_lens[b]))[None, :]
                seen = (distance >= 0) & ((distance <= window) if window >= 0 else True)
                extend_block = torch.zeros(seen.shape[0], seen.shape[0], dtype=torch.bool)
                masks.append(torch.cat([seen, extend_block], 1).flatten())
            tensors["custom_mask"] = torch.cat(masks)
            tensors["mask_indptr"] = _indptr(batch.extend_lens * (prefix_lens + batch.extend_lens))
            scalars["sliding_window"] = -1  # folded into the mask: kernel columns are shifted here
            scalars["skip_prefix_custom_mask"] = False
        else:
            prefix_lens = batch.prefix_lens
            if trace.is_tree_verify:
                tensors["custom_mask"] = tree.full_mask(trace.spec.parents, prefix_lens)
                tensors["mask_indptr"] = tree.full_mask_indptr(trace.spec.draft_token_num, prefix_lens)
        tensors["kv_indptr"] = _indptr(prefix_lens).to(torch.int32)
        tensors["kv_indices"] = torch.cat(
            [batch.request_slots(b)[: int(prefix_lens[b])] for b in range(batch.batch_size)]
        ).to(torch.int64)
        return Plan(backend=self.name, tensors=tensors, scalars=scalars)

    # -- run ----------------------------------------------------------------------------------

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        try:
            return self._run(trace, inputs, plan)
        except _triton_errors() as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise KernelError(f"{type(e).__name__}: {first[:300]}") from e

    def _run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        decode, extend = _kernels()
        device = inputs.q.device
        t = {k: v.to(device) for k, v in plan.tensors.items()}
        model = trace.model
        tokens = inputs.q.shape[0]
        out = torch.full((tokens, model.num_qo_heads, model.v_head_dim), float("nan"), dtype=inputs.q.dtype, device=device)
        lse = torch.full((tokens, model.num_qo_heads), float("nan"), dtype=torch.float32, device=device)
        if "num_kv_splits" in t:
            max_splits = int(plan.scalars["max_kv_splits"])
            attn_logits = torch.full((tokens, model.num_qo_heads, max_splits, model.v_head_dim), float("nan"), dtype=torch.float32, device=device)
            attn_lse = torch.full((tokens, model.num_qo_heads, max_splits), float("nan"), dtype=torch.float32, device=device)
            decode.decode_attention_fwd(
                q=inputs.q,
                k_buffer=inputs.k_cache,
                v_buffer=inputs.v_cache,
                o=out,
                lse=lse,
                kv_indptr=t["kv_indptr"],
                kv_indices=t["kv_indices"],
                attn_logits=attn_logits,
                attn_lse=attn_lse,
                num_kv_splits=t["num_kv_splits"],
                max_kv_splits=max_splits,
                sm_scale=model.sm_scale,
                logit_cap=model.logit_cap,
            )
        else:
            extend.extend_attention_fwd(
                q_extend=inputs.q,
                k_extend=inputs.k_new,
                v_extend=inputs.v_new,
                o_extend=out,
                lse_extend=lse,
                k_buffer=inputs.k_cache,
                v_buffer=inputs.v_cache,
                qo_indptr=t["qo_indptr"],
                kv_indptr=t["kv_indptr"],
                kv_indices=t["kv_indices"],
                custom_mask=t.get("custom_mask"),
                mask_indptr=t.get("mask_indptr"),
                is_causal=bool(plan.scalars["is_causal"]),
                max_len_extend=int(plan.scalars["max_extend_len"]),
                sm_scale=model.sm_scale,
                logit_cap=model.logit_cap,
                skip_prefix_custom_mask=bool(plan.scalars["skip_prefix_custom_mask"]),
                sliding_window=int(plan.scalars["sliding_window"]),
            )
        return AttentionResult(output=out, lse=lse)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths.to(torch.int64), 0), (1, 0))
