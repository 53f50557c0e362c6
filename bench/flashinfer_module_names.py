"""The FlashInfer modules check's compile phase declares for a recording, against those a run needed.

    python bench/flashinfer_module_names.py REC --backend triton,flashinfer,fa3,mla
    python bench/flashinfer_module_names.py REC ... --expected LOG_OR_LIST [--also NAME ...]
    python bench/flashinfer_module_names.py REC ... --watch          # GPU: build, then run and watch
    python bench/flashinfer_module_names.py REC ... --without vllm   # as on a machine without vllm

Declared: what attndbg/checks/precompile.py would build (each backend's `jit_specs` and the runs
detectors force, over up to SHAPE_SCAN steps), named without running anything. Expected: module
names read from a compile log ("compiled k/N (...): NAME" lines, as `attndbg compile` prints them),
or a file of one name a line, plus `--also`. Default: an H200's compile log of the server mix
(bench/data/server_sweep_compile_h200.log, 2026-11-26) and the one module built during that check
afterwards. Printed:
matches, missing (expected, not declared), extra (declared, not expected), each extra with the
backends and modes of the steps that declare it.

Without a GPU the arch comes from FLASHINFER_CUDA_ARCH_LIST (9.0a: an H100/H200) and FlashInfer's
spec functions write generated sources under FLASHINFER_WORKSPACE_BASE (a temporary one is wise).
--watch (GPU): builds the declared modules, then checks one step of each kernel shape with
FlashInfer's loads watched (flashinfer_jit.watching_modules) and lists every module a run loaded
that was not declared: the declaration's misses on this machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attndbg import machine  # noqa: E402
from attndbg.backends import flashinfer_jit, flashinfer_modules  # noqa: E402
from attndbg.checks import precompile  # noqa: E402
from attndbg.checks.selection import parse_only  # noqa: E402
from attndbg.checks.step import check_one  # noqa: E402
from attndbg.detector_api.context import CheckOptions  # noqa: E402
from attndbg.trace import io  # noqa: E402
from attndbg.trace.validate import TraceError  # noqa: E402

DEFAULT_LOG = ROOT / "bench/data/server_sweep_compile_h200.log"
# Built during that check after the compile phase's 34, as the notes of that run name it.
BUILT_LATER = "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_256_head_dim_vo_256_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False"
COMPILED_LINE = re.compile(r"compiled \d+/\d+ \([^)]*\): (\S+)")


def expected_names(source: Path, also: list[str]) -> set[str]:
    text = source.read_text()
    names = set(COMPILED_LINE.findall(text)) or {line.strip() for line in text.splitlines() if line.strip() and " " not in line.strip()}
    return names | set(also)


def declared_by(paths: list[Path], backends: list[str], only) -> tuple[dict[str, object], dict[str, set[str]]]:
    """Name -> spec over the steps, and name -> 'backend MODE' of the steps that declare it."""
    at = flashinfer_modules.target()
    specs: dict[str, object] = {}
    where: dict[str, set[str]] = defaultdict(set)
    for path in precompile.scanned(paths):
        try:
            trace = io.load(path)
        except TraceError:
            continue
        for name in backends:
            for spec in precompile.declare(trace, only, CheckOptions(backends=(name,)), at):
                specs.setdefault(spec.name, spec)
                where[spec.name].add(f"{name} {trace.batch.forward_mode.value}")
    return specs, where


def watch(paths: list[Path], backends: list[str], only, specs: dict[str, object]) -> set[str]:
    """GPU: build the declared modules, check one step per kernel shape with loads watched; the
    modules loaded or needed that were not declared."""
    missing = flashinfer_jit.unbuilt(list(specs.values()))
    print(f"building {len(missing)} declared modules not on disk", flush=True)
    flashinfer_jit.build(missing, lambda name, seconds: print(f"  built ({seconds:.0f} s): {name}", flush=True))
    firsts: dict[tuple, Path] = {}
    for path in precompile.scanned(paths):
        try:
            firsts.setdefault(precompile.kernel_shape(io.load(path)), path)
        except TraceError:
            continue
    undeclared: set[str] = set()
    options = CheckOptions(backends=tuple(backends))
    for i, path in enumerate(firsts.values()):
        with flashinfer_jit.watching_modules() as seen:
            check_one(path, only, options)
        new = (seen.used | set(seen.unbuilt)) - set(specs)
        if new:
            print(f"  {path.name}: loaded, not declared: {', '.join(sorted(new))}", flush=True)
        undeclared |= new
        print(f"  watched {i + 1}/{len(firsts)} kernel shapes", file=sys.stderr, flush=True)
    return undeclared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording")
    parser.add_argument("--backend", default="triton,flashinfer,fa3,mla")
    parser.add_argument("--only", default=None, help="detectors, as check --only (default: check's)")
    parser.add_argument("--expected", type=Path, default=DEFAULT_LOG)
    parser.add_argument("--also", action="append", default=None, help=f"another expected name (default: {BUILT_LATER[:40]}...)")
    parser.add_argument("--watch", action="store_true", help="GPU: build the declared modules, run one step per shape watched")
    parser.add_argument(
        "--without",
        default="",
        help="comma-separated libraries to declare as if not installed (default: none). That H200 had no vllm, "
        "sgl_kernel or flash_attn_interface, so fa3 ran on FlashInfer there: on a machine that has one, give it here",
    )
    args = parser.parse_args()
    absent = {name for name in args.without.split(",") if name}
    if absent:
        available = machine.module_available
        machine.module_available = lambda name: name not in absent and available(name)  # type: ignore[assignment]

    backends = [b for b in args.backend.split(",") if b]
    only = parse_only(args.only)
    paths = io.trace_paths(args.recording)
    also = args.also if args.also is not None else ([BUILT_LATER] if args.expected == DEFAULT_LOG else [])
    expected = expected_names(args.expected, also)
    specs, where = declared_by(paths, backends, only)
    declared = set(specs)
    print(f"arch {flashinfer_modules.target().capability}; {len(paths)} steps, {len(precompile.scanned(paths))} read; backends {','.join(backends)}" + (f"; as without {','.join(sorted(absent))}" if absent else ""))
    print(f"declared {len(declared)}, expected {len(expected)} ({args.expected.name}{' + ' + str(len(also)) + ' more' if also else ''})")
    print(f"\nmatch ({len(declared & expected)}):")
    for name in sorted(declared & expected):
        print(f"  {name}")
    print(f"\nmissing: expected, not declared ({len(expected - declared)}):")
    for name in sorted(expected - declared):
        print(f"  {name}")
    print(f"\nextra: declared, not expected ({len(declared - expected)}):")
    for name in sorted(declared - expected):
        print(f"  {name}\n      declared by: {'; '.join(sorted(where[name]))}")
    if args.watch:
        undeclared = watch(paths, backends, only, specs)
        print(f"\nloaded by a run, not declared ({len(undeclared)}):")
        for name in sorted(undeclared):
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
