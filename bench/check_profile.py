"""Where a warm `attndbg check` spends its time, step by step.

`check_scale.py` times the command as a user runs it; this profiles the steady state that timing is
made of. In one process: check `--warmup` steps (kernels compile, caches fill), then check the
next `--steps` steps under cProfile, and the same steps again without it for the wall time per step.
`--timeline FILE` does all of it inside `--timeline`'s CUPTI collection (where its cost per
step goes; the file is written at the end, timed apart). Run it with and without, same steps.

    bash .gpu/env.sh python bench/check_profile.py REC --backend triton,flashinfer,fa3 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from attndbg.checks.selection import parse_only, select_paths
from attndbg.checks.step import check_one
from attndbg.detector_api.context import CheckOptions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recording")
    parser.add_argument("--backend", default="triton,flashinfer,fa3")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--tag", default="")
    parser.add_argument("--timeline", metavar="FILE", help="collect --timeline's records throughout (needs cupti-python)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="the first pass over the measured steps without cProfile (a warm pass only): the per-step time alone, as timeline_check.sh steps compares it")
    args = parser.parse_args()
    recording = None
    if args.timeline:
        from attndbg.timeline import session

        recording = session.start(args.timeline, command="check")

    paths = select_paths(args.recording)
    warm, measured = paths[: args.warmup], paths[args.warmup : args.warmup + args.steps]
    options = CheckOptions(backends=tuple(args.backend.split(",")), cuda_graph=args.cuda_graph)
    only = parse_only(None)
    start = time.perf_counter()
    for path in warm:
        check_one(path, only, options)
    warm_s = time.perf_counter() - start

    profiler = cProfile.Profile()
    if args.profile:
        profiler.enable()
    for path in measured:
        check_one(path, only, options)
    profiler.disable()

    start = time.perf_counter()
    per_step = []
    by_mode: dict[str, list[float]] = {}
    for path in measured:
        t = time.perf_counter()
        mode = check_one(path, only, options).report.mode
        per_step.append(time.perf_counter() - t)
        by_mode.setdefault(mode, []).append(per_step[-1])
    wall = time.perf_counter() - start

    text = io.StringIO()
    if args.profile:
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
    per_step.sort()
    summary = (
        f"warm-up: {len(warm)} steps in {warm_s:.1f} s\n"
        f"measured: {len(measured)} steps in {wall:.2f} s without the profiler: {1000 * wall / max(1, len(measured)):.1f} ms/step "
        f"(median {1000 * per_step[len(per_step) // 2]:.1f}, max {1000 * per_step[-1]:.1f})\n"
    )
    for mode, times in sorted(by_mode.items()):
        summary += f"  {mode}: {len(times)} steps, {1000 * sum(times) / len(times):.1f} ms/step (max {1000 * max(times):.1f})\n"
    if recording is not None:
        start = time.perf_counter()
        recording.finish()
        summary += f"--timeline {args.timeline}: collected throughout; matching and writing it took {time.perf_counter() - start:.1f} s\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"check_profile{args.tag}.txt").write_text(summary + "\n" + text.getvalue())
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
