"""attndbg's own replay timing against a bare `triton.testing.do_bench_cudagraph` of the same kernel.

Target: the two medians at most 3 % apart. The bare side builds the plan and buffers by
hand, with no attndbg harness, and calls our Triton decode kernel directly.

Run on the GPU machine:  bash .gpu/env.sh python bench/replay_overhead.py
"""

from __future__ import annotations

import torch
import triton.testing

from attndbg.backends.triton import TritonBackend
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.timing import time_backend
from attndbg.trace import synth


def bare_decode_us(trace, inputs) -> float:
    from attndbg.backends.triton_kernels.decode import decode_attention_fwd

    m, b = trace.model, trace.batch
    plan = TritonBackend().derive_plan(trace)
    t = {k: v.cuda() for k, v in plan.tensors.items()}
    splits = int(plan.scalars["max_kv_splits"])
    out = torch.empty(b.num_tokens, m.num_qo_heads, m.v_head_dim, dtype=inputs.q.dtype, device="cuda")
    lse = torch.empty(b.num_tokens, m.num_qo_heads, dtype=torch.float32, device="cuda")
    logits = torch.empty(b.num_tokens, m.num_qo_heads, splits, m.v_head_dim, dtype=torch.float32, device="cuda")
    logits_lse = torch.empty(b.num_tokens, m.num_qo_heads, splits, dtype=torch.float32, device="cuda")

    def launch() -> None:
        decode_attention_fwd(
            q=inputs.q, k_buffer=inputs.k_cache, v_buffer=inputs.v_cache, o=out, lse=lse,
            kv_indptr=t["kv_indptr"], kv_indices=t["kv_indices"], attn_logits=logits, attn_lse=logits_lse,
            num_kv_splits=t["num_kv_splits"], max_kv_splits=splits, sm_scale=m.sm_scale,
        )

    launch()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(launch, rep=200, return_mode="median") * 1e3


def main() -> None:
    cases = {
        "decode bs64 kv4096 GQA32/8 d128": ["decode-gqa", "kv_lens=" + ",".join(["4096"] * 64), "shared_prefix=0"],
        "decode bs8 kv1024 GQA32/8 d128": ["decode-gqa", "kv_lens=" + ",".join(["1024"] * 8), "shared_prefix=0"],
        "mla decode bs16 kv2048": ["mla-decode", "kv_lens=" + ",".join(["2048"] * 16)],
    }
    print(f"{'case':36s} {'attndbg us':>11s} {'do_bench us':>12s} {'apart':>7s}")
    for name, words in cases.items():
        trace = synth.build(synth.parse_spec(words))
        inputs = to_device(build_inputs(trace), "cuda")
        ours = time_backend(TritonBackend(), trace, inputs).median_us
        bare = bare_decode_us(trace, inputs)
        print(f"{name:36s} {ours:11.2f} {bare:12.2f} {abs(ours - bare) / bare:7.1%}", flush=True)


if __name__ == "__main__":
    main()
