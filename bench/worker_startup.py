"""What a check worker pays once, before its steps run at their steady pace.

The server mix at 1,000 steps took 74-86 s with 8 workers on an H200 (16 cores), 5,000 steps 193 s:
~27 ms a step, and ~50 s that do not grow with the steps. This splits a fresh process's fixed cost:
imports, CUDA's start, then one step of each kernel shape of the recording (what `check` runs
first), each timed cold and again warm; what the cold pass spends beyond the warm one is loading
kernels (FlashInfer modules, Triton's cache), and the cold pass's profile says which.

    bash .gpu/env.sh python bench/worker_startup.py REC --backend triton,flashinfer,mla --out $OUT
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recording")
    parser.add_argument("--backend", default="triton,flashinfer,fa3")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    t = time.perf_counter()
    import torch

    say(f"import torch: {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    from attndbg.checks.run import first_of_each_shape
    from attndbg.checks.selection import parse_only, select_paths
    from attndbg.checks.step import check_one
    from attndbg.detector_api.context import CheckOptions

    say(f"import attndbg.checks: {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    say(f"CUDA context: {time.perf_counter() - t:.2f} s")

    paths = select_paths(args.recording)
    t = time.perf_counter()
    picks = [paths[i] for i in first_of_each_shape(paths)]
    say(f"kernel shapes (first_of_each_shape): {len(picks)} steps, {time.perf_counter() - t:.2f} s")
    options = CheckOptions(backends=tuple(args.backend.split(",")))
    only = parse_only(None)

    def one_pass() -> list[float]:
        seconds = []
        for path in picks:
            t = time.perf_counter()
            check_one(path, only, options)
            seconds.append(time.perf_counter() - t)
        return seconds

    profiler = cProfile.Profile()
    profiler.enable()
    cold = one_pass()
    profiler.disable()
    warm = one_pass()
    say(f"one step of each shape, cold process: {sum(cold):.2f} s; again, warm: {sum(warm):.2f} s; loads: {sum(cold) - sum(warm):.2f} s")
    for path, c, w in zip(picks, cold, warm):
        say(f"  {Path(path).name}: cold {c * 1000:.0f} ms, warm {w * 1000:.0f} ms")
    say(f"process total: {time.perf_counter() - T0:.2f} s")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(50)
    stats.sort_stats("tottime").print_stats(25)
    # Who pays the one-off costs (on an H200: torch.library.impl 5.6 s, bytecode compiles 3.2 s).
    stats.print_callers(r"library.py.*\(impl\)|_register_to_dispatcher|builtins.compile")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"worker_startup{args.tag}.txt").write_text("\n".join(lines) + "\n\n" + text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
