"""Our Triton split-KV decode against FlashInfer decode, and against the device's copy bandwidth.

The shape: bs 64, kv 4096 per request, GQA 32 query / 8 KV heads, head dim 128, bf16, slots
scattered over the pool. Targets: Triton >= 0.9x FlashInfer, and >= 75 % of the HBM copy
bandwidth measured in the same run (bytes read + written by a device-to-device copy).
All backends are timed the same way: `attndbg.replay.timing.time_backend` (CUDA-graph replays
between CUDA events, median of samples).

Run on the GPU machine:  bash .gpu/env.sh python bench/decode_vs_flashinfer.py
"""

from __future__ import annotations

from attndbg.backends.flashinfer import FlashInferBackend, FlashInferOptions
from attndbg.backends.triton import TritonBackend
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.timing import copy_bandwidth_gbps, time_backend
from attndbg.trace import synth

SHAPES = {
    "bs64 kv4096 32/8 d128": ["decode-gqa", "kv_lens=" + ",".join(["4096"] * 64), "heads=32:8", "head_dim=128", "shared_prefix=0"],
    "bs64 kv4096 32/8 d128 page16": ["decode-gqa", "kv_lens=" + ",".join(["4096"] * 64), "heads=32:8", "page_size=16", "shared_prefix=0"],
    "bs16 kv16384 32/8 d128": ["decode-gqa", "kv_lens=" + ",".join(["16384"] * 16), "heads=32:8", "shared_prefix=0"],
}


def main() -> None:
    peak = copy_bandwidth_gbps()
    print(f"device copy bandwidth (read + write): {peak:.0f} GB/s")
    print(f"{'shape':30s} {'backend':26s} {'median us':>10s} {'GB/s':>7s} {'of copy':>8s} {'triton / this':>14s}")
    for shape, words in SHAPES.items():
        trace = synth.build(synth.parse_spec(words))
        inputs = to_device(build_inputs(trace), "cuda")
        backends = {
            "triton (our kernels)": TritonBackend(),
            "flashinfer cuda cores": FlashInferBackend(FlashInferOptions(decode_tensor_cores=False)),
            "flashinfer tensor cores": FlashInferBackend(FlashInferOptions(decode_tensor_cores=True)),
        }
        timings = {name: time_backend(b, trace, inputs) for name, b in backends.items()}
        ours = timings["triton (our kernels)"].median_us
        for name, t in timings.items():
            print(f"{shape:30s} {name:26s} {t.median_us:10.1f} {t.achieved_gbps:7.0f} {t.achieved_gbps / peak:8.0%} {t.median_us / ours:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
