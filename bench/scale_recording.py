"""A recording of many metadata-only decode steps, shaped like a live server's.

Each step: 1-64 requests, 1-8192 KV tokens each, page 1 or 16, GQA 32:8 or 8:1 at head_dim 128,
bf16, SGLang's Triton plan attached, drawn from one seed so the same call builds the same
recording. `check_scale.py` times `attndbg check` on it; tests build small ones.

    python bench/scale_recording.py OUT_DIR --steps 1000 [--max-bs 64] [--max-kv 8192]
"""

from __future__ import annotations

import argparse
import random
import shutil
from dataclasses import replace
from pathlib import Path

from attndbg.trace import io, synth


def step_spec(rng: random.Random, step: int, max_bs: int, max_kv: int) -> list[str]:
    bs = rng.randint(1, max_bs)
    kv = [rng.randint(1, max_kv) for _ in range(bs)]
    heads = rng.choice(["32:8", "8:1"])
    page = rng.choice([1, 16])
    return [
        "decode-gqa",
        f"kv_lens={','.join(map(str, kv))}",
        f"heads={heads}",
        "head_dim=128",
        f"page_size={page}",
        "dtype=bfloat16",
        "shared_prefix=0",
        f"seed={step}",
    ]


def build(out_dir: str | Path, steps: int, *, seed: int = 0, max_bs: int = 64, max_kv: int = 8192) -> Path:
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = random.Random(seed)
    for step in range(steps):
        trace = synth.build(synth.parse_spec(step_spec(rng, step, max_bs, max_kv)))
        trace = replace(trace, source=replace(trace.source, step=step))
        io.append_to_recording(out, trace)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-bs", type=int, default=64)
    parser.add_argument("--max-kv", type=int, default=8192)
    args = parser.parse_args()
    build(args.out_dir, args.steps, seed=args.seed, max_bs=args.max_bs, max_kv=args.max_kv)


if __name__ == "__main__":
    main()
