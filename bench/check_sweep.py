"""The detectors' clean sweep: every synth preset x dtype, and the specs of the synth keys no preset
shows (EXTRA: a right window, an explicit draft tree, slot layouts, empty cross-attention rows, a
split cap, full graphs), every backend here, eager and graph.

Run on the GPU machine:  bash .gpu/env.sh python bench/check_sweep.py [--cuda-graph] [--json FILE]
A finding on these clean traces is a false positive, i.e. a bug: the script prints each one and
exits 1. On a CPU machine it runs with the reference and Triton (interpreted) only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io, synth

DTYPES = ("bfloat16", "float16")
# Keys of the trace model no preset shows on its own (the presets sinks-decode, bidirectional,
# fp8-scaled, cross, extend-mask and mixed-graph show the rest).
EXTRA = (
    ("window", "window_right=8"),
    ("verify", "parents=-1,0,0,1,2"),
    ("decode-paged", "slots=shuffled_pages"),
    ("decode-paged", "slots=interleaved_pages", "capture_bs=8"),
    ("extend-prefix", "slots=non_monotonic", "page_size=16", "shared_prefix=16"),
    ("decode-mha", "kv_lens=0,7,30", "cross=1", "sinks=1"),
    ("extend-prefix", "cross=1", "causal=1", "sinks=1"),
    ("extend-prefix", "extend_mask=random"),
    ("decode-gqa", "max_kv_splits=2"),
    ("extend-prefix", "capture_bs=8", "graph_mode=full"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cuda-graph", action="store_true", help="detectors also replay under CUDA graphs")
    parser.add_argument("--backends", default=None, help="default: every backend that runs here")
    parser.add_argument("--json", help="write per-trace results as JSON")
    parser.add_argument("--only", default=None, help="detectors, as check --only (default: check's default set; opt-in ones only when named)")
    parser.add_argument("--presets", default=None, help="comma-separated synth presets (default: all, and EXTRA)")
    args = parser.parse_args()
    presets = args.presets.split(",") if args.presets else list(synth.PRESETS)
    unknown = [p for p in presets if p not in synth.PRESETS]
    if unknown:
        parser.error(f"unknown presets {unknown}; presets: {', '.join(synth.PRESETS)}")
    from attndbg.backends import registry

    names = tuple(registry.resolve(args.backends)) if args.backends else None
    options = CheckOptions(backends=names, cuda_graph=args.cuda_graph)
    rows, total_findings = [], 0
    specs = [[preset] for preset in presets] + ([] if args.presets else [list(words) for words in EXTRA])
    with tempfile.TemporaryDirectory() as tmp:
        for number, spec in enumerate(specs):
            preset = spec[0]
            for dtype in DTYPES:
                words = spec if preset == "fp16" or dtype == "bfloat16" else [*spec, f"dtype={dtype}"]
                if preset == "fp16" and dtype != "bfloat16":
                    continue
                path = Path(tmp) / f"{number}-{preset}-{dtype}.pt"
                io.save(synth.build(synth.parse_spec(words)), path)
                start = time.perf_counter()
                findings = [f for report in check_steps(str(path), parse_only(args.only), options) for f in report.findings]
                seconds = time.perf_counter() - start
                total_findings += len(findings)
                rows.append({"trace": " ".join(words), "findings": [f"{f.kind.value}/{f.check}: {f.evidence}" for f in findings], "seconds": round(seconds, 2)})
                print(f"{' '.join(words):40s} findings={len(findings)} t={seconds:.1f}s", flush=True)
                for f in findings:
                    print(f"    {f.kind.value}/{f.check} {f.location}: {f.evidence}", flush=True)
    print(f"{len(rows)} traces, {total_findings} findings (backends: {', '.join(names) if names else 'all available'}, cuda_graph={args.cuda_graph}, detectors: {args.only or 'default'})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if total_findings else 0


if __name__ == "__main__":
    sys.exit(main())
