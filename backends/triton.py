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
from attndbg.environment import package_version
from attndbg.backends.base import (
    AttentionInputs,
    AttentionResult,
    Backend,
    FillRequirement,
    GraphCapacity,
    GraphState,
    KernelError,
    KernelUnsupported,
    LibraryRelease,
    Padding,
    PartialStates,
    ScriptLibrary,
)
from attndbg.backends.host_hints import HostHint, Measures, Sizes
from attndbg.backends.capabilities import ALL_MODES, ENGINE_GRAPH_MODES, EVERY_LAYER_KIND, Capabilities
from attndbg.backends import plan_declaration as pd
from attndbg.backends import script_calls
from attndbg.backends import plan_layout as pl
from attndbg.trace import tree
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.visibility import visibility
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, ForwardMode, MaskLayout, Plan, Trace, indptr

# SGLang's default `--triton-attention-num-kv-splits`.
DEFAULT_MAX_KV_SPLITS = 8
# Core count the split heuristic assumes when no GPU is present: an H100 SXM's SM count, so a
# plan derived on a laptop matches the one an H100 would derive.
FALLBACK_CORE_COUNT = 132


@dataclass(frozen=True)
class TritonOptions:
    num_kv_splits: int | None = None  # force this many splits for every request (else the heuristic)
    # The heuristic's cap. None: the engine's own, as the trace records it (capture.max_kv_splits,
    # SGLang's --triton-attention-num-kv-splits), else SGLang's default.
    max_kv_splits: int | None = None

    def cap(self, trace: Trace) -> int:
        """The split cap a plan for `trace` uses."""
        if self.max_kv_splits is not None:
            return self.max_kv_splits
        recorded = trace.capture.max_kv_splits if trace.capture is not None else None
        return recorded if recorded else DEFAULT_MAX_KV_SPLITS

    def __post_init__(self) -> None:
        for field in ("num_kv_splits", "max_kv_splits"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{field}={value}: a split count is at least 1")


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


def _kernel_source() -> str:
    """Our Triton kernels as one module's source: split_rule, common, decode, extend, with their
    imports of each other and of attndbg removed (a stand-in for attndbg.machine's mode)."""
    import inspect
    import re
    from pathlib import Path

    from attndbg.backends.triton_kernels import common, decode, extend, split_rule

    shim = (
        "class TritonMode(enum.Enum):\n"
        "    COMPILED = 'compiled'\n"
        "    INTERPRETER = 'interpreter'\n\n\n"
        "def select_triton_mode():\n"
        "    return TritonMode.INTERPRETER if os.environ.get('TRITON_INTERPRET') == '1' else TritonMode.COMPILED\n"
    )
    parts = [shim]
    for module in (split_rule, common, decode, extend):
        source = inspect.getsource(module)
        source = re.sub(r"^from (__future__|\.|attndbg)[^\n]*(\([^)]*\))?\n", "", source, flags=re.M)
        parts.append(f"# ---- attndbg backends/triton_kernels/{Path(module.__file__).name} ----\n{source}")
    return "\n\n".join(parts)


def _kernels():
    """Import the kernel modules only after the Triton mode is chosen (see machine.select_triton_mode);
    while `attndbg repro` records a script's calls, their stand-ins (script_calls.py)."""
    library = script_calls.stand_in()
    if library is not None:
        return library.decode, library.extend
    machine.select_triton_mode()
    from attndbg.backends.triton_kernels import decode, extend

    return decode, extend


def _merge_kernel():
    """Our merge of given states (triton_kernels/merge.py), imported once the Triton mode is chosen."""
    machine.select_triton_mode()
    from attndbg.backends.triton_kernels import merge

    return merge


def _triton_errors() -> tuple[type[BaseException], ...]:
    import triton

    errors = getattr(triton, "errors", None)
    return (RuntimeError, errors.TritonError) if errors and hasattr(errors, "TritonError") else (RuntimeError,)


class TritonBackend(Backend):
    name = "triton"
    options_class = TritonOptions
    fill_requirement = FillRequirement(
        1,
        "SGLang's Triton stage 2 divides by the merged exp-sum, which is 0 for a row with no KV (0/0 = NaN), "
        "so SGLang's Triton backend fills 1",
    )
    engine_names = {"triton": None}  # SGLang's Triton backend
    # SGLang's extend kernel launches ceil(max_extend_len / BLOCK_M) query blocks per request
    # (extend_attention_fwd's max_len_extend; triton_kernels/extend.py's grid): extend, verify and
    # draft-extend metadata carry it (engines.md A4.2); a decode plan has none.
    host_hints = {"triton": (HostHint("max_extend_len", Measures.QUERY_LEN, Sizes.ROWS, "SGLang's Triton extend kernel (max_len_extend sizes its grid)", replayed=True),)}

    def __init__(self, options: TritonOptions | None = None):
        self.options = options or TritonOptions()
        # Decide compiled vs interpreted before anything imports triton: Triton reads
        # TRITON_INTERPRET when kernels and its language module are set up.
        machine.select_triton_mode()

    def unavailable_reason(self) -> str | None:
        if not machine.module_available("triton"):
            return "triton is not installed: `pip install triton`"
        return None

    def device(self) -> str:
        return machine.kernel_device()

    def first_use_note(self) -> str | None:
        if machine.select_triton_mode() is machine.TritonMode.INTERPRETER:
            return None
        return "Triton compiles each kernel on first use (seconds each, cached on disk for later runs)"

    def library(self) -> LibraryRelease:
        # Our kernels (SGLang's decode/extend design), built by the installed Triton.
        return LibraryRelease("attndbg's Triton kernels on Triton", package_version("triton") or "version unknown")

    def describe(self) -> str:
        import triton

        mode = machine.select_triton_mode()
        if mode is machine.TritonMode.INTERPRETER:
            why = "no CUDA GPU" if not machine.cuda_available() else "TRITON_INTERPRET=1 set"
            return f"our Triton kernels, triton {triton.__version__}, interpreted on the CPU ({why})"
        info = machine.gpu_info()
        return f"our Triton kernels, triton {triton.__version__}, compiled for {info.arch if info else 'cuda'}"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            kernels="our Triton kernels",
            attention=frozenset(AttentionKind),
            modes={AttentionKind.MHA: ALL_MODES, AttentionKind.MLA: frozenset({ForwardMode.DECODE})},
            graph_modes=ENGINE_GRAPH_MODES,
            q_dtypes=frozenset(Q_DTYPES),
            # An fp8 cache is read as stored and computed in q's dtype (k_scale folded into
            # sm_scale, v_scale on the output), as SGLang's Triton kernels read one.
            kv_dtypes=frozenset(DTYPES),
            tree_mask=True,
            column_mask=True,
            sliding_window=True,
            soft_cap=True,
            merge_state=True,  # triton_kernels/merge.py
            **EVERY_LAYER_KIND,
            why={
                "window_in_tree_verify": "needs SGLang's window_kv_offsets, not implemented",
            },
        )

    # -- plan ---------------------------------------------------------------------------------

    def core_count(self) -> int:
        info = machine.gpu_info()
        return info.num_sms if info else FALLBACK_CORE_COUNT

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        if trace.batch.forward_mode is ForwardMode.DECODE:
            return self._decode_plan(trace, padding)
        if padding is not None and not trace.is_tree_verify:
            raise ValueError("only decode and verify steps are padded for CUDA graphs")
        return self._extend_plan(trace, padding)

    def _decode_plan(self, trace: Trace, padding: Padding | None) -> Plan:
        batch, model = trace.batch, trace.model
        window = model.sliding_window
        rows = []
        for b in range(batch.batch_size):
            slots = batch.request_slots(b)
            # Sliding window: SGLang passes only the window's slots (window_kv_indices).
            rows.append(slots[-(window + 1) :] if window >= 0 else slots)
        rows += _padded_rows(batch.batch_size, padding)
        lens = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        if self.options.num_kv_splits is not None:
            splits = [self.options.num_kv_splits] * len(rows)
        else:
            splits = sglang_num_kv_splits(
                lens.tolist(),
                num_qo_heads=model.num_qo_heads,
                num_kv_heads=model.num_kv_heads,
                max_kv_splits=self.options.cap(trace),
                core_count=self.core_count(),
            )
        return Plan(
            backend=self.name,
            tensors={
                "kv_indptr": indptr(lens).to(torch.int32),
                "kv_indices": torch.cat(rows).to(torch.int64),
                "num_kv_splits": torch.tensor(splits, dtype=torch.int32),
            },
            scalars={"max_kv_splits": max([self.options.cap(trace), *splits])},
        )

    def _extend_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        batch = trace.batch
        extend_lens = batch.extend_lens
        if padding is not None:  # verify: padded requests carry draft_token_num tokens too
            pad = padding.capture_bs - batch.batch_size
            extend_lens = torch.cat([extend_lens, torch.full((pad,), trace.spec.draft_token_num)])
        tensors: dict[str, torch.Tensor] = {"qo_indptr": indptr(extend_lens).to(torch.int32)}
        scalars: dict[str, int | float | bool | str] = {
            "max_extend_len": int(batch.extend_lens.max()) if batch.batch_size else 0,
            "is_causal": True,
            "skip_prefix_custom_mask": True,
            "sliding_window": trace.model.sliding_window,
        }
        if batch.selective or batch.cross or batch.custom_mask is not None:
            # The whole row is read from the cache as "prefix" and a custom mask says what each
            # query sees by column (causality, the step's own mask, the windows folded in); the
            # extend block's columns are all masked. Selective recompute: the recomputed tokens'
            # K/V are already in their slots; cross-attention: the row is the encoder's KV and the
            # queries' own K/V are no keys; a custom mask: this step's K/V are in the cache too.
            prefix_lens = batch.kv_lens
            masks = []
            for b in range(batch.batch_size):
                seen = visibility(trace, b)
                extend_block = torch.zeros(seen.shape[0], seen.shape[0], dtype=torch.bool)
                masks.append(torch.cat([seen, extend_block], 1).flatten())
            tensors["custom_mask"] = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
            tensors["mask_indptr"] = MaskGeometry.full(rows=batch.extend_lens, prefix_lens=prefix_lens).indptr
            scalars["sliding_window"] = -1  # folded into the mask: kernel columns are shifted here
            scalars["skip_prefix_custom_mask"] = False
        else:
            prefix_lens = batch.prefix_lens
            if not trace.model.causal:
                scalars["is_causal"] = False
                if trace.model.window_right >= 0:
                    scalars["window_right"] = trace.model.window_right
        rows = [batch.request_slots(b)[: int(prefix_lens[b])] for b in range(batch.batch_size)]
        rows += _padded_rows(batch.batch_size, padding)
        if trace.is_tree_verify:
            n = trace.spec.draft_token_num
            parents = trace.spec.parents
            if padding is not None:
                # Padded requests get a valid chain tree over their dummy prefix.
                chain = torch.arange(-1, n - 1).expand(padding.capture_bs - batch.batch_size, n)
                parents = torch.cat([parents, chain])
            prefix_lens = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
            tensors["custom_mask"] = tree.full_mask(parents, prefix_lens)
            tensors["mask_indptr"] = MaskGeometry.verify(MaskLayout.FULL, draft_token_num=n, prefix_lens=prefix_lens).indptr
        tensors["kv_indptr"] = indptr(torch.tensor([r.numel() for r in rows])).to(torch.int32)
        tensors["kv_indices"] = torch.cat(rows).to(torch.int64)
        return Plan(backend=self.name, tensors=tensors, scalars=scalars)

    def plan_declaration(self, trace: Trace, plan: Plan) -> pd.PlanDeclaration:
        return triton_plan_declaration(plan)

    # -- run ----------------------------------------------------------------------------------

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        try:
            return self._run(trace, inputs, plan)
        except _triton_errors() as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise KernelError(f"{type(e).__name__}: {first[:300]}") from e

    def _run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        device = inputs.q.device
        model = trace.model
        tokens = inputs.q.shape[0]
        tensors = {k: v.to(device) for k, v in plan.tensors.items()}
        out = torch.full((tokens, model.num_qo_heads, model.v_head_dim), float("nan"), dtype=inputs.q.dtype, device=device)
        lse = torch.full((tokens, model.num_qo_heads), float("nan"), dtype=torch.float32, device=device)
        scratch = _split_scratch(model, tokens, int(plan.scalars.get("max_kv_splits", 0)), device)
        _launch(model, tensors, plan.scalars, inputs, out, lse, scratch, sinks=_device_sinks(model, device))
        return AttentionResult(output=out, lse=lse)

    def merge_states(self, states: PartialStates) -> AttentionResult:
        """With each row's KV length and split count: stage 2 alone (decode_stage2) on `states` as
        stage 1's scratch, each row's non-empty splits merged by SGLang's rule. Without them: our
        merge of given states (triton_kernels/merge.py), by their LSEs alone. Natural-log LSEs;
        outputs NaN-filled before the kernel writes."""
        rows, heads, parts, dv = states.output.shape
        device = states.output.device
        out = torch.full((rows, heads, dv), float("nan"), dtype=states.output.dtype, device=device)
        lse = torch.full((rows, heads), float("nan"), dtype=torch.float32, device=device)
        if states.kv_lens is None and states.num_splits is None:
            _merge_kernel().merge_states(v=states.output, s=states.lse.to(torch.float32), o=out, lse=lse, rows=states.rows)
            return AttentionResult(output=out, lse=lse)
        if states.kv_lens is None or states.num_splits is None:
            raise KernelUnsupported("our stage 2 tells empty splits by each row's KV length and split count; the states give one of them")
        decode, _ = _kernels()
        decode.decode_stage2(
            attn_logits=states.output,
            attn_lse=states.lse,
            o=out,
            lse=lse,
            kv_indptr=indptr(states.kv_lens).to(torch.int32),
            num_kv_splits=states.num_splits.to(torch.int32),
            max_kv_splits=parts,
        )
        return AttentionResult(output=out, lse=lse)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def script_library(self) -> ScriptLibrary:
        """Our Triton kernels' source goes into the script, so it runs with torch and triton alone
        (the Triton interpreter on the CPU when there is no GPU)."""
        return ScriptLibrary(
            label="triton",
            setup='if not torch.cuda.is_available():\n    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the Triton interpreter runs the kernels on the CPU\n',
            imports="import triton\nimport triton.language as tl",
            install="pip install triton",
            needs_gpu=False,
            version="triton.__version__",
            prelude=f"# ===== our Triton kernels, as attndbg ships them (backends/triton_kernels) =====\n\n{_kernel_source()}\n\n\n"
            "class decode:  # the kernels' modules, as the adapter calls them\n    decode_attention_fwd = staticmethod(decode_attention_fwd)\n\n\n"
            "class extend:\n    extend_attention_fwd = staticmethod(extend_attention_fwd)\n",
            tensors_on_device=True,
        )

    def graph_state(self, trace: Trace, capacity: GraphCapacity) -> GraphState:
        return _TritonGraphState(trace, capacity, self.options)


def triton_plan_declaration(plan: Plan) -> pd.PlanDeclaration:
    """SGLang's Triton ForwardMetadata as `_launch` hands it to the kernels.

    Slot ids over kv_indptr, both kernels, so a request's length is its count of ids (whole rows in
    the by-column form, prefix otherwise). Decode (a
    plan with num_kv_splits): one query row per request, and split counts in [1, max_kv_splits]
    (stage 1 writes one partial per split into scratch sized by max_kv_splits). Extend and verify:
    qo_indptr over query rows (and this step's K/V rows, which extend.py takes separately: the ids
    list the prefix only); a verify mask is the FULL [q_len, kv_len + q_len] block per request at
    mask_indptr[b] (extend.py reads all of it, the prefix columns unless skipped too), read by the
    detectors from the first listed column by `window_kv_offsets` and, unless
    `skip_prefix_custom_mask` is false, only over the draft columns. Sliding-window layers read
    SGLang's window list instead of kv_indices.
    """
    decode = "num_kv_splits" in plan.tensors
    # A mask over the prefix columns too (skip_prefix_custom_mask false) is the by-column form
    # (selective recompute, cross-attention, an extend's own mask): the ids list whole rows.
    by_column = "custom_mask" in plan.tensors and plan.scalars.get("skip_prefix_custom_mask") is False
    return pd.PlanDeclaration(
        call=pd.Call(pl.KvIds.SLOTS, ids="kv_indices", count="kv_indptr", length=None, page_size=1, queries=None if decode else "qo_indptr"),
        scalars=() if decode else ("is_causal", "max_extend_len", "skip_prefix_custom_mask", "sliding_window"),
        splits=pd.SplitCounts("num_kv_splits", "max_kv_splits") if decode else None,
        ends=(pl.KvEnd.KV,) if by_column else (pl.KvEnd.PREFIX,),
        mask=pl.MaskReading.FULL_BLOCKS if "custom_mask" in plan.tensors else pl.MaskReading.CAUSAL,
        mask_offsets="mask_indptr",
        window="sliding_window",
        window_list=pl.WindowList("window_kv_indptr", "window_kv_indices", "window_kv_offsets"),
        skip_prefix="skip_prefix_custom_mask",
    )


def _split_scratch(model, tokens: int, max_kv_splits: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stage-1 partials, NaN-poisoned: stage 2 must read only the splits stage 1 wrote."""
    if max_kv_splits == 0:
        return None
    logits = torch.full((tokens, model.num_qo_heads, max_kv_splits, model.v_head_dim), float("nan"), dtype=torch.float32, device=device)
    lse = torch.full((tokens, model.num_qo_heads, max_kv_splits), float("nan"), dtype=torch.float32, device=device)
    return logits, lse


def _device_sinks(model, device: torch.device) -> torch.Tensor | None:
    """The layer's sink logits on the kernel's device, in float32 (the kernels' dtype for them)."""
    return None if model.sinks is None else model.sinks.to(device=device, dtype=torch.float32)


def _launch(model, t: dict[str, torch.Tensor], scalars, inputs: AttentionInputs, out, lse, scratch, *, sinks: torch.Tensor | None) -> None:
    """One forward with plan tensors `t` (SGLang names): decode when the plan has split counts.

    The layer's sinks (`sinks`, already on the device: a graph state makes them before its capture,
    which may copy nothing from the host) and KV scales are the model's, not the plan's: a scaled
    fp8 cache folds k_scale into sm_scale and hands v_scale to the kernel's output."""
    decode, extend = _kernels()
    layer = {"sm_scale": model.sm_scale * model.k_scale, "logit_cap": model.logit_cap, "sinks": sinks, "v_scale": model.v_scale}
    if "num_kv_splits" in t:
        decode.decode_attention_fwd(
            q=inputs.q,
            k_buffer=inputs.k_cache,
            v_buffer=inputs.v_cache,
            o=out,
            lse=lse,
            kv_indptr=t["kv_indptr"],
            kv_indices=t["kv_indices"],
            attn_logits=scratch[0],
            attn_lse=scratch[1],
            num_kv_splits=t["num_kv_splits"],
            max_kv_splits=scratch[0].shape[2],
            **layer,
        )
        return
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
        is_causal=bool(scalars["is_causal"]),
        max_len_extend=int(scalars["max_extend_len"]),
        skip_prefix_custom_mask=bool(scalars["skip_prefix_custom_mask"]),
        sliding_window=int(scalars["sliding_window"]),
        window_right=int(scalars.get("window_right", -1)),
        **layer,
    )


class _TritonGraphState(GraphState):
    """SGLang's Triton CUDA-graph buffers: plan tensors sized for the capture, updated in place."""

    def __init__(self, trace: Trace, capacity: GraphCapacity, options: TritonOptions):
        self.model = trace.model
        self.capacity = capacity
        self.decode = trace.batch.forward_mode is ForwardMode.DECODE
        device = machine.kernel_device()
        bs = capacity.capture_bs
        self.buffers: dict[str, torch.Tensor] = {
            "kv_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=device),
            "kv_indices": torch.zeros(max(capacity.max_kv_slots, 1), dtype=torch.int64, device=device),
        }
        if self.decode:
            # SGLang fills the static split counts with max_kv_splits.
            cap = options.cap(trace)
            self.max_kv_splits = cap if options.num_kv_splits is None else max(cap, options.num_kv_splits)
            self.buffers["num_kv_splits"] = torch.full((bs,), self.max_kv_splits, dtype=torch.int32, device=device)
            self.scratch = _split_scratch(self.model, capacity.max_tokens, self.max_kv_splits, device)
            self.scalars: dict = {}
        else:
            self.buffers["qo_indptr"] = torch.zeros(bs + 1, dtype=torch.int32, device=device)
            self.buffers["custom_mask"] = torch.zeros(max(capacity.max_mask, 1), dtype=torch.bool, device=device)
            self.buffers["mask_indptr"] = torch.zeros(bs + 1, dtype=torch.int64, device=device)
            self.scratch = None
            self.scalars = {}
        self.out = torch.full((capacity.max_tokens, self.model.num_qo_heads, self.model.v_head_dim), float("nan"), dtype=DTYPES[self.model.q_dtype], device=device)
        self.lse = torch.full((capacity.max_tokens, self.model.num_qo_heads), float("nan"), dtype=torch.float32, device=device)
        self.sinks = _device_sinks(self.model, device)

    def load_plan(self, plan: Plan) -> None:
        if self.decode and int(plan.scalars["max_kv_splits"]) > self.max_kv_splits:
            raise ValueError(f"plan wants {plan.scalars['max_kv_splits']} KV splits, the graph was captured with {self.max_kv_splits}")
        if not self.decode:
            if self.scalars and plan.scalars != self.scalars:
                raise ValueError(f"plan scalars {plan.scalars} differ from the captured {self.scalars}")
            self.scalars = dict(plan.scalars)
        for name, buffer in self.buffers.items():
            value = plan.tensors[name]
            if value.numel() > buffer.numel():
                raise ValueError(f"plan {name} has {value.numel()} elements, the graph holds {buffer.numel()}")
            # In place: the captured graph keeps these pointers.
            buffer[: value.numel()].copy_(value.to(buffer.dtype), non_blocking=True)

    def poison_scratch(self) -> None:
        if self.scratch is not None:
            self.scratch[0].fill_(float("nan"))
            self.scratch[1].fill_(float("nan"))

    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        _launch(self.model, self.buffers, self.scalars, inputs, self.out, self.lse, self.scratch, sinks=self.sinks)
        return AttentionResult(output=self.out, lse=self.lse)


def _padded_rows(bs: int, padding: Padding | None) -> list[torch.Tensor]:
    """KV rows of the padded requests: `fill_value` columns, all at the dummy slot."""
    if padding is None:
        return []
    row = torch.full((padding.fill_value,), padding.dummy_slot, dtype=torch.int64)
    return [row] * (padding.capture_bs - bs)
