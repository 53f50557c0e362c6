"""`attndbg bench`: time each backend on a trace over CUDA-graph replays, against the device's
measured copy bandwidth.

The graph holds `inner` launches back to back and each sample is one replay between two CUDA
events, divided by `inner`: launch gaps are amortised as `triton.testing.do_bench_cudagraph`
amortises them (measured on an H200: 20 separate replays per sample put a 16 us kernel 6.7 %
above do_bench; large kernels were within 1 %). The median of the samples is reported. Only the attention is captured (not the KV write), so the number is the
kernel's, comparable with `triton.testing.do_bench` over a graph of the same launch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from attndbg.backends.base import AttentionInputs, Backend, Padding
from attndbg.replay.graph import GraphHarness
from attndbg.trace.schema import DTYPES, AttentionKind, ForwardMode, Trace


@dataclass(frozen=True)
class Timing:
    backend: str
    median_us: float
    min_us: float
    max_us: float
    bytes_moved: int  # KV read once + q read + output written
    achieved_gbps: float


def bytes_moved(trace: Trace) -> int:
    """The fewest bytes the step must move: every visible K/V row once, q in, output out."""
    m, b = trace.model, trace.batch
    kv_elem = DTYPES[m.kv_dtype].itemsize
    q_elem = DTYPES[m.q_dtype].itemsize
    window = m.sliding_window
    lens = torch.clamp(b.kv_lens, max=window + 1) if window >= 0 and b.forward_mode is ForwardMode.DECODE else b.kv_lens
    # MLA reads one 576-wide latent row per token: values are part of it.
    row = m.num_kv_heads * (m.head_dim if m.attention is AttentionKind.MLA else m.head_dim + m.v_head_dim)
    kv = int(lens.sum()) * row * kv_elem
    q = b.num_tokens * m.num_qo_heads * m.head_dim * q_elem
    out = b.num_tokens * m.num_qo_heads * m.v_head_dim * q_elem
    return kv + q + out


def time_backend(backend: Backend, trace: Trace, inputs: AttentionInputs, *, samples: int = 30, inner: int = 20) -> Timing:
    padding = Padding(capture_bs=trace.batch.batch_size, fill_value=backend.cuda_graph_fill_value)
    plan = backend.derive_plan(trace, padding)
    harness = GraphHarness(backend, trace, inputs, padding=padding, plans=[plan], traces=[trace], seed=trace.seed, write_kv=False)
    harness.load(trace, inputs, plan)
    harness.capture(True, unroll=inner)
    graph = harness.graph
    assert graph is not None
    for _ in range(3):  # warm the caches and clocks
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    median = statistics.median(times)
    moved = bytes_moved(trace)
    return Timing(backend.name, median, min(times), max(times), moved, moved / (median * 1e-6) / 1e9)


def copy_bandwidth_gbps(size_bytes: int = 1 << 30, samples: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (METHOD.md)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * size_bytes / statistics.median(times) / 1e9
