"""Host time of the flight recorder's hook per step, on the CPU (no GPU needed).

transformers' continuous batching on a small random Llama on the CPU, recorded in ring mode
(`record --ring K`, metadata only, nothing written): prints the hook's microseconds per step
(`Stats.hook_seconds`, the engine thread's time in the recorder: the mean, and the median over
the steps once the ring is full, robust to a shared machine's scheduler) and the step's wall
time. With `--profile`, the hook's functions under cProfile (the engine's call left out), by own
time; bench/record_overhead.py --profile-hook prints the same on a GPU.

Comparing two versions of the recorder in one run, interleaved rounds:
  for r in 1 2 3; do for tree in BEFORE AFTER; do
    PYTHONPATH=$tree python bench/ring_hook_cpu.py --label $tree; done; done
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--ring", type=int, default=64)
    parser.add_argument("--layers", default="", help="comma-separated layers to record (in-graph probes on a GPU)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from attndbg.examples.transformers_generate import generate, tiny_llama
    from attndbg.record.options import RecordOptions
    from attndbg.record.session import end_session, start_session
    from attndbg.record.transformers import adapter

    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (int(n),), generator=g).tolist() for n in torch.randint(8, 32, (args.requests,), generator=g)]
    kwargs = dict(prompts=prompts, max_new_tokens=args.new_tokens, num_blocks=256, max_batch_tokens=256)
    generate(model, **kwargs)  # warm-up
    adapter.install()
    layers = tuple(int(x) for x in args.layers.split(",") if x)
    with tempfile.TemporaryDirectory() as tmp:
        session = start_session(RecordOptions(out_dir=tmp, ring=args.ring, layers=layers))
        profiler = cProfile.Profile() if args.profile else None
        per_step = _hook_per_step(adapter)
        if profiler is not None:
            profile_hook(adapter, profiler)
        start = time.perf_counter()
        generate(model, **kwargs)
        if profiler is not None:
            adapter._on_step = adapter._on_step.__wrapped__
        adapter._on_step = adapter._on_step.__wrapped__
        seconds = time.perf_counter() - start
        steps = session.last_step + 1
        held = len(session.flight.ring.take())
        stats = end_session()
    adapter.uninstall()
    assert stats is not None and stats.written == 0, "ring mode wrote a step without a trigger"
    print(json.dumps({"label": args.label, "steps": steps, "ring_steps": held, "hook_us_per_step": round(stats.hook_seconds / steps * 1e6, 1),
                      # the median step is robust to the scheduler taking the core mid-hook (a shared machine)
                      "hook_us_median_full_ring": round(statistics.median(per_step[args.ring :] or per_step) * 1e6, 1), "wall_us_per_step": round(seconds / steps * 1e6, 1)}))
    if profiler is not None:
        print(hook_profile_text(profiler))
    return 0


def hook_profile_text(profiler: cProfile.Profile) -> str:
    """The recorder's and torch's functions the hook ran, by own time (the top 40)."""
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats("attndbg|torch", 40)
    return out.getvalue()


def _hook_per_step(adapter) -> list[float]:  # type: ignore[no-untyped-def]
    """Each step's hook seconds (Stats.hook_seconds before and after the step)."""
    on_step = adapter._on_step
    seconds: list[float] = []

    def timed(session, runner, model, batch_data, call):  # type: ignore[no-untyped-def]
        before = session.stats.hook_seconds
        try:
            return on_step(session, runner, model, batch_data, call)
        finally:
            seconds.append(session.stats.hook_seconds - before)

    timed.__wrapped__ = on_step  # type: ignore[attr-defined]
    adapter._on_step = timed
    return seconds


def profile_hook(adapter, profiler: cProfile.Profile) -> None:  # type: ignore[no-untyped-def]
    """Profile the recorder's step hook, in the thread that runs it, without the engine's call."""
    on_step = adapter._on_step

    def profiled(session, runner, model, batch_data, call):  # type: ignore[no-untyped-def]
        def unprofiled():  # type: ignore[no-untyped-def]
            profiler.disable()
            try:
                return call()
            finally:
                profiler.enable()

        profiler.enable()
        try:
            return on_step(session, runner, model, batch_data, unprofiled)
        finally:
            profiler.disable()

    profiled.__wrapped__ = on_step  # type: ignore[attr-defined]
    adapter._on_step = profiled


if __name__ == "__main__":
    sys.exit(main())
