"""Replay every synth preset (and a few large shapes) through reference and Triton; print max errors.

Run on the GPU machine:  bash .gpu/env.sh python bench/modes_report.py [--backends all] [--cuda-graph] [--json FILE]
Prints one row per (mode, backend, variant): status, max abs / rel output error, max LSE error,
time, and for rows that did not run, exactly why.
"""

from __future__ import annotations

import argparse
import json
import sys

from attndbg.replay.runner import replay
from attndbg.report.replay import StepReport, run_to_json
from attndbg.trace import synth

LARGE = {
    "decode-bs64-kv4096": ["decode-gqa", "kv_lens=" + ",".join(["4096"] * 64), "shared_prefix=0"],
    "decode-paged-long": ["decode-paged", "kv_lens=1,7,4096,32768", "page_size=64"],
    "extend-long-prefix": ["extend-prefix", "prefix_lens=4000,0,1000", "extend_lens=512,1024,1"],
    "verify-topk8": ["verify", "prefix_lens=1000,3000,10", "topk=8", "steps=5", "draft_tokens=32"],
    "mla-decode-long": ["mla-decode", "kv_lens=1,4096,16000"],
    "fp16-decode": ["decode-gqa", "dtype=float16"],
    "fp32-extend": ["extend-prefix", "dtype=float32"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write all rows as JSON")
    parser.add_argument("--backends", default="reference,triton")
    parser.add_argument("--cuda-graph", action="store_true", help="also replay each step in a CUDA graph")
    args = parser.parse_args()
    from attndbg.backends import registry
    from attndbg.replay.runner import ReplayOptions

    names = registry.resolve(args.backends)
    options = ReplayOptions(cuda_graph=args.cuda_graph)
    specs = {name: [name] for name in synth.PRESETS}
    specs.update(LARGE)
    rows = []
    failed = False
    for name, words in specs.items():
        trace = synth.build(synth.parse_spec(words))
        result = replay(trace, name, names, options)
        failed |= result.failed
        for run in result.runs:
            row = run_to_json(run, StepReport(result=result, layer=None)) | {"mode": name}
            rows.append(row)
            print(
                f"{name:22s} {run.name:10s} {run.variant.label:18s} {run.status.value:11s} "
                f"abs={row.get('max_abs', float('nan')):.3e} rel={row.get('max_rel', float('nan')):.3e} "
                f"lse={row.get('max_lse_abs', float('nan')):.3e} fail={row.get('failing_rows', '-')}/{row.get('total_rows', '-')} "
                f"t={row.get('seconds', 0) * 1e3:.1f}ms {run.reason or ''} {'; '.join(run.problems)}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("ALL PASSED" if not failed else "SOME FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
