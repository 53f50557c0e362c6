"""CUDA-graph replay, padded the way engines pad (DESIGN.md "CUDA-graph replay").

One graph per backend, captured at a batch size larger than the trace's: static input buffers,
warm-up on a side stream, capture, then for each replayed batch an in-place copy of inputs and
plan (the plan is built outside the graph) followed by `graph.replay()`. What a correct kernel
must not read is poisoned first: outputs and scratch are NaN, padded query rows are garbage, and a
decoy batch is replayed before the real one so stale state shows. Checks: real rows against the
eager run (bitwise where the kernel is deterministic) and against the reference, padded rows
finite, plan buffers never moved, and padded tokens writing KV only to the dummy slot.

Without a GPU `capture=False` runs the same sequence eagerly on the static buffers, which tests
everything but the capture itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch

from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, GraphCapacity, Padding
from attndbg.profiling import phase, step_label
from attndbg.trace.schema import ForwardMode, Plan, Trace

# SGLang's default capture sizes without speculative decoding (cuda_graph_runner.py), and with it.
SGLANG_CAPTURE_BS = [1, 2, 4, 8, 12] + list(range(16, 257, 8))
SGLANG_SPEC_CAPTURE_BS = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 64, 4)) + list(range(72, 257, 8))
# Padded query rows hold large finite garbage: a kernel that lets them reach real rows shows it.
GARBAGE_SCALE = 1e3


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes for 1-byte floats (fp8 KV): index_copy_ and != have no fp8 kernels
    (measured: "index_copy_cuda" not implemented for 'Float8_e4m3fn', on the CPU too)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def default_capture_bs(trace: Trace) -> int:
    """The smallest SGLang capture size strictly above the trace's batch, so at least one row is padded."""
    sizes = SGLANG_SPEC_CAPTURE_BS if trace.is_tree_verify else SGLANG_CAPTURE_BS
    i = bisect.bisect_right(sizes, trace.batch.batch_size)
    return sizes[i] if i < len(sizes) else trace.batch.batch_size + 1


def step_capture_bs(trace: Trace) -> int:
    """The capture size a check replays the step padded to (every detector the same, so their
    padded replays are one memoised run): the recorded one where the step was recorded as a graph
    replay of at most that many requests, else the next SGLang capture size above the batch."""
    graph = trace.graph
    if graph is not None and graph.is_graph_replay and graph.capture_bs >= trace.batch.batch_size:
        return graph.capture_bs
    return default_capture_bs(trace)


# The last trace's decoy: every backend's padded replay of one step uses the same one.
_last_decoy: tuple[Trace, Trace] | None = None


def decoy(trace: Trace) -> Trace:
    """A different batch of the same shape class: about half of each request's cached KV dropped.

    Replayed into the graph first, so anything the real replay reads but does not rewrite (stale
    indices, masks, split counts) holds the decoy's values instead of zeros.
    """
    global _last_decoy
    if _last_decoy is not None and _last_decoy[0] is trace:
        return _last_decoy[1]
    made = _make_decoy(trace)
    _last_decoy = (trace, made)
    return made


def _make_decoy(trace: Trace) -> Trace:
    b = trace.batch
    page = trace.model.page_size
    rows, kv, prefix, cols, masks = [], [], [], [], []
    for r in range(b.batch_size):
        slots = b.request_slots(r)
        p, e = int(b.prefix_lens[r]), int(b.extend_lens[r])
        # Drop whole pages before the page holding column p, so every column keeps its page offset.
        page_start = (p // page) * page
        drop = ((page_start // 2) // page) * page
        new_p = p - drop
        rows.append(torch.cat([slots[: page_start - drop], slots[page_start:]]))
        prefix.append(new_p)
        # A cross-attention row is all cached encoder KV, its queries aligned bottom-right.
        kv.append(new_p if b.cross else new_p + e)
        cols.append(torch.arange(new_p - e, new_p) if b.cross else torch.arange(new_p, new_p + e))
        if b.custom_mask is not None:
            block = b.mask_block(r)
            masks.append(torch.cat([block[:, : page_start - drop], block[:, page_start:]], 1).flatten())
    query_cols = torch.cat(cols)
    positions = b.positions if b.cross else b.positions - torch.repeat_interleave(b.prefix_lens - torch.tensor(prefix), b.extend_lens)
    batch = replace(
        b,
        prefix_lens=torch.tensor(prefix),
        kv_lens=torch.tensor(kv),
        slot_indptr=torch.nn.functional.pad(torch.cumsum(torch.tensor(kv), 0), (1, 0)),
        slot_ids=torch.cat(rows),
        query_cols=query_cols,
        positions=positions,
        seq_lens_raw=torch.tensor(prefix if trace.is_tree_verify else kv),
        custom_mask=torch.cat(masks) if masks else b.custom_mask,
    )
    return replace(trace, batch=batch)


@dataclass(frozen=True)
class GraphOutcome:
    """What one graph replay showed, for the real rows and the padding."""

    capture_bs: int
    fill_value: int
    result: AttentionResult  # real rows only, CPU
    eager_bitwise_equal: bool  # the same step, same plan and buffers, run without the graph (True when not captured)
    eager_max_abs: float
    padded_nonfinite: int  # NaN/Inf in padded rows' output, NaN in their LSE (-inf = no keys, allowed)
    stray_kv_slots: list[int]  # KV slots changed by the replay that no token should write
    pointers_stable: bool
    captured: bool


def _capacity(traces: list[Trace], padding: Padding, plans: list[Plan]) -> GraphCapacity:
    """Static sizes that hold every batch replayed into the graph, from the batches themselves
    (plans name their tensors differently per backend; only a custom mask is read from them)."""
    tokens_per_req = max(int(t.batch.extend_lens.max()) for t in traces)
    padded = [padding.capture_bs - t.batch.batch_size for t in traces]
    return GraphCapacity(
        capture_bs=padding.capture_bs,
        max_tokens=padding.capture_bs * tokens_per_req,
        # Padded requests hold fill_value columns, plus their tokens' own columns in verify.
        max_kv_slots=max(int(t.batch.kv_lens.sum()) + pad * (padding.fill_value + tokens_per_req) for t, pad in zip(traces, padded)),
        max_kv_len=max(int(t.batch.kv_lens.max()) for t in traces) + padding.fill_value + tokens_per_req,
        max_mask=max(int(p.tensors["custom_mask"].numel()) if "custom_mask" in p.tensors else 0 for p in plans),
    )


class GraphHarness:
    """Static inputs, the engine's KV write and one backend's graph state, captured once.

    `step()` is what an engine's captured forward does for attention: write this step's K/V into
    the cache (padded tokens into the dummy slot), then attend. `capture=False` runs it eagerly.
    """

    def __init__(
        self,
        backend: Backend,
        trace: Trace,
        inputs: AttentionInputs,
        *,
        padding: Padding,
        plans: list[Plan],
        traces: list[Trace],
        seed: int,
        write_kv: bool = True,  # False: attention alone (timing)
    ):
        self.padding = padding
        # A cross-attention step writes no K/V (its out_cache_loc is -1: the encoder's are cached).
        self.write_kv = write_kv and not trace.batch.cross
        self.capacity = _capacity(traces, padding, plans)
        self.state = backend.graph_state(trace, self.capacity)
        self.device = inputs.q.device
        self.generator = torch.Generator().manual_seed(seed)
        total = self.capacity.max_tokens
        self.tokens_per_req = total // padding.capture_bs

        def static_like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=self.device)

        self.mla = inputs.v_cache.data_ptr() == inputs.k_cache.data_ptr()
        self.k_cache = inputs.k_cache.clone()
        self.v_cache = self.k_cache[..., : inputs.v_cache.shape[-1]] if self.mla else inputs.v_cache.clone()
        k_static = static_like(inputs.k_new)
        self.static = AttentionInputs(
            q=static_like(inputs.q),
            k_new=k_static,
            v_new=k_static[..., : inputs.v_new.shape[-1]] if self.mla else static_like(inputs.v_new),
            k_cache=self.k_cache,
            v_cache=self.v_cache,
        )
        self.loc = torch.full((total,), padding.dummy_slot, dtype=torch.int64, device=self.device)
        self.used = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: AttentionResult | None = None

    def load(self, step_trace: Trace, data: AttentionInputs, plan: Plan) -> None:
        """Copy a step's inputs into the static buffers (garbage in padded rows) and its plan."""
        n = step_trace.batch.num_tokens
        self.used = n + (self.padding.capture_bs - step_trace.batch.batch_size) * self.tokens_per_req
        pairs = [(self.static.q, data.q), (self.static.k_new, data.k_new)]
        if not self.mla:
            pairs.append((self.static.v_new, data.v_new))
        for static, value in pairs:
            garbage = torch.randn((static.shape[0] - n, *static.shape[1:]), generator=self.generator) * GARBAGE_SCALE
            static[:n].copy_(value[:n])
            static[n:].copy_(garbage.to(static.dtype))
        self.loc[:n].copy_(step_trace.batch.out_cache_loc.to(self.device))
        self.loc[n:].fill_(self.padding.dummy_slot)  # SGLang zeroes out_cache_loc of padded tokens
        self.state.load_plan(plan)

    def restore_cache(self, cache: AttentionInputs) -> None:
        self.k_cache.copy_(cache.k_cache)
        if not self.mla:
            self.v_cache.copy_(cache.v_cache)

    def step(self) -> AttentionResult:
        if self.write_kv:
            # Every padded row writes too (to the dummy slot): the captured write covers the capacity.
            raw(self.k_cache).index_copy_(0, self.loc, raw(self.static.k_new))
            if not self.mla:
                raw(self.v_cache).index_copy_(0, self.loc, raw(self.static.v_new))
        return self.state.forward(self.static)

    def capture(self, capture: bool, unroll: int = 1) -> None:
        """Capture `step()` (`unroll` times back to back: timing amortises launch gaps that way)."""
        if not capture:
            self.out = self.step()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: autotuning, JIT, allocator
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(unroll):
                self.out = self.step()

    def poison(self) -> None:
        assert self.out is not None
        self.out.output.fill_(float("nan"))
        self.out.lse.fill_(float("nan"))
        self.state.poison_scratch()

    def replay(self) -> AttentionResult:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.step()
        assert self.out is not None
        return self.out


def graph_replay(
    backend: Backend,
    trace: Trace,
    inputs: AttentionInputs,
    *,
    padding: Padding,
    capture: bool,
    seed: int,
) -> GraphOutcome:
    """Replay `trace` through `backend` inside a graph captured at `padding.capture_bs`.

    `inputs` are the eager inputs on the backend's device (cache after this step's writes).
    """
    # Each part is an NVTX range of its own (inside the caller's, which names backend and variant),
    # so a timeline shows one cudaGraphLaunch per replay range and the launches captured in `capture`.
    label = step_label(trace)
    decoy_trace = decoy(trace)
    with phase("plan", label):
        real_plan = backend.derive_plan(trace, padding)
        decoy_plan = backend.derive_plan(decoy_trace, padding)
    with phase("load", f"{label} batch=decoy"):
        harness = GraphHarness(backend, trace, inputs, padding=padding, plans=[real_plan, decoy_plan], traces=[trace, decoy_trace], seed=seed)
        device = inputs.q.device
        # The decoy: other queries over the same cache, loaded first and captured with.
        decoy_q = torch.randn(inputs.q.shape, generator=harness.generator).to(inputs.q.dtype).to(device)
        harness.load(decoy_trace, replace(inputs, q=decoy_q), decoy_plan)
    pointers = harness.state.plan_pointers()
    with phase("capture", label):
        harness.capture(capture)
    with phase("replay", f"{label} batch=decoy"):
        harness.poison()
        harness.replay()  # the decoy leaves its state behind in every static buffer
    # The real batch: restore the cache the decoy's writes touched, then replay.
    with phase("load", f"{label} batch=real"):
        harness.restore_cache(inputs)
        harness.load(trace, inputs, real_plan)
        harness.poison()
    with phase("replay", f"{label} batch=real"):
        out = harness.replay()
        if device.type == "cuda":
            torch.cuda.synchronize()

    tokens, used = trace.batch.num_tokens, harness.used
    graph_out, graph_lse = out.output[:used].clone(), out.lse[:used].clone()
    pad_out, pad_lse = graph_out[tokens:], graph_lse[tokens:]
    padded_nonfinite = int((~torch.isfinite(pad_out)).sum() + torch.isnan(pad_lse).sum())
    changed = (raw(harness.k_cache) != raw(inputs.k_cache)).flatten(1).any(1)
    if not harness.mla:
        changed |= (raw(harness.v_cache) != raw(inputs.v_cache)).flatten(1).any(1)
    allowed = set(trace.batch.out_cache_loc.tolist()) | {padding.dummy_slot}
    stray = [s for s in torch.nonzero(changed).flatten().tolist() if s not in allowed]

    output, lse = graph_out[:tokens].cpu(), graph_lse[:tokens].cpu()
    bitwise, max_abs = True, 0.0
    if harness.graph is not None:
        # The eager twin: the same step on the same buffers and plan, without the graph. (Without a
        # capture the replay above already was eager: there is no twin to compare with.)
        with phase("eager-twin", label):
            harness.restore_cache(inputs)
            harness.poison()
            twin = harness.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        twin_out, twin_lse = twin.output[:used], twin.lse[:used]
        diff = (graph_out[:tokens].float() - twin_out[:tokens].float()).abs()
        bitwise = bool(torch.equal(graph_out[:tokens], twin_out[:tokens]) and torch.equal(graph_lse[:tokens], twin_lse[:tokens]))
        max_abs = float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0
    return GraphOutcome(
        capture_bs=padding.capture_bs,
        fill_value=padding.fill_value,
        result=AttentionResult(output=output, lse=lse),
        eager_bitwise_equal=bitwise,
        eager_max_abs=max_abs,
        padded_nonfinite=padded_nonfinite,
        stray_kv_slots=stray[:16],
        pointers_stable=harness.state.plan_pointers() == pointers,
        captured=harness.graph is not None,
    )


def supports_graph(trace: Trace) -> bool:
    return trace.batch.forward_mode is ForwardMode.DECODE or trace.is_tree_verify
