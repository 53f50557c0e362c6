"""Compile a recording's kernels before its first step is checked, all at once (issue 24, item 1).

Kernel libraries that compile on first use (FlashInfer: 7-60 s a module, minutes for some) made a
fresh machine's first `check` wait minutes, one module after another, as each step reached one. Here,
before the steps are handed out:

1. one step of each kernel shape is picked (`kernel_shape`: mode, layer shape, dtypes, page size,
   window, soft-cap, graph, engine and plan), the smallest of its shape;
2. a process of its own checks those steps with FlashInfer's loads watched
   (`backends/flashinfer_jit.py`): a module not on disk is noted and its call fails before any of
   its kernels runs. Triton's kernels compile for real here, into the disk cache workers share;
3. the noted modules are compiled together, one ninja over all their sources on every core, with
   progress; then 2 again, since a failed call hid the modules it would have loaded next, until a
   pass notes nothing new (at most MAX_PASSES).

The modules each shape loaded are remembered (after each pass) in FlashInfer's JIT directory, so a
shape whose modules are all on disk is not looked at again: a warm machine pays nothing here.

Opt-in (`attndbg compile`, `check --compile-first`) until it is measured to pay on the server mix.
Measured on an H200 (bench/results/server_sweep_h200_session7.md): bench/server_sweep.py's 1,000
steps have 278 kernel shapes; the first pass noted 34 modules and built them at once (the last
finished 150 s after the build started, on 16 cores, against ~8 min one after another), but each
look at a shape is a whole check of its smallest step, about a second, so the passes over 278
shapes, one after another in one process, did not finish within a device call. Next: look at the
shapes in the check workers, in parallel, and at a coarser key (page size chooses no FlashInfer
module; the GQA group only whether decode runs on tensor cores). Whatever this misses (a
shape outside the sample, a module a detector loads only on some steps) is compiled on first use as
before. The process is a crash boundary like a check worker: if it dies, the check goes on without
it and says so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

from attndbg.backends import flashinfer_jit
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.replay.runner import PREBUILT_VARIABLE
from attndbg.trace import io
from attndbg.trace.schema import Trace
from attndbg.trace.validate import TraceError

# Steps looked at for their kernel shapes (evenly spread when the recording has more).
SHAPE_SCAN = 4000
# Look-and-build passes at most (each pass finds the modules the previous build let calls reach).
MAX_PASSES = 6


def kernel_shape(trace: Trace) -> tuple:
    """What decides which kernels checking a step loads: mode, the attention layer's shape and
    dtypes, page size, window, soft-cap, graph replay, and the path of the recorded plan (FlashInfer's
    extend runs ragged, paged or cascade, each its own modules)."""
    m = trace.model
    path = "" if trace.plan is None else str(trace.plan.scalars.get("path", ""))
    return (
        trace.batch.forward_mode.value, m.attention.value, m.head_dim, m.v_head_dim, m.gqa_group, m.q_dtype, m.kv_dtype,
        m.page_size, m.sliding_window >= 0, m.logit_cap > 0, trace.graph is not None, path,
    )  # fmt: skip


def _size(trace: Trace) -> int:
    """How much work checking the step is, roughly: query rows plus KV read."""
    b = trace.batch
    return int(b.qo_indptr[-1]) + int(b.kv_lens.sum())


def representatives(paths: list[Path]) -> dict[str, Path]:
    """The smallest step of each kernel shape (by shape key, as text), from up to SHAPE_SCAN steps."""
    n = len(paths)
    picks = range(n) if n <= SHAPE_SCAN else sorted({round(i * (n - 1) / (SHAPE_SCAN - 1)) for i in range(SHAPE_SCAN)})
    best: dict[str, tuple[int, Path]] = {}
    for i in picks:
        try:
            trace = io.load(paths[i])
        except TraceError:
            continue  # reported when its turn comes
        key, size = repr(kernel_shape(trace)), _size(trace)
        if key not in best or size < best[key][0]:
            best[key] = (size, paths[i])
    return {key: path for key, (_, path) in best.items()}


def _precompile_main(conn: Connection, steps: dict[str, str], only: list[FindingClass], options: CheckOptions) -> None:
    """In a process of its own: look, build, look again (see the module docstring); report to `conn`."""
    from attndbg.checks.run import check_one

    os.environ[PREBUILT_VARIABLE] = "1"  # the discovery checks' own first-use notes say nothing new
    learnt: dict[str, list[str]] = {}
    pending = dict(steps)
    built: set[str] = set()
    used: dict[str, set[str]] = {key: set() for key in steps}
    for n in range(1, MAX_PASSES + 1):
        conn.send(("looking", n, len(pending)))
        unbuilt: dict[str, object] = {}
        done: list[str] = []
        for key, path in pending.items():
            with flashinfer_jit.watching_modules() as watch:
                check_one(path, only, options)
            used[key] |= watch.used
            if watch.unbuilt:
                unbuilt.update(watch.unbuilt)
            else:
                done.append(key)
                learnt[key] = sorted(used[key])
        for key in done:
            del pending[key]
        flashinfer_jit.remember({key: learnt[key] for key in done})
        new = [spec for name, spec in unbuilt.items() if name not in built]
        if not new:
            break
        conn.send(("building", [spec.name for spec in new]))
        flashinfer_jit.build(new, lambda name, seconds: conn.send(("built", name, seconds)))
        built |= {spec.name for spec in new}
    conn.send(("done", len(built), sorted(pending)))


@dataclass(frozen=True)
class Compiled:
    """What the compile phase did: modules built, its seconds, shapes looked at, and why it stopped
    short (None when it finished)."""

    modules: int
    seconds: float
    shapes: int
    problem: str | None = None


def precompile(
    paths: list[Path],
    only: list[FindingClass],
    options: CheckOptions,
    *,
    say: Callable[[str], None] = lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()),
) -> Compiled | None:
    """Compile the kernels `paths` need before they are checked (see the module docstring). None
    when there is nothing to do: no FlashInfer, or every shape's modules already on disk."""
    if not flashinfer_jit.available():
        return None
    start = time.monotonic()
    shapes = representatives(paths)
    memo = flashinfer_jit.read_memo()
    todo = {key: str(path) for key, path in shapes.items() if key not in memo or not flashinfer_jit.compiled(memo[key])}
    os.environ[PREBUILT_VARIABLE] = "1"  # workers, spawned after this, inherit it
    if not todo:
        return None
    say(f"attndbg: compile phase: looking for the kernels of {len(todo)} kernel shape{'s' * (len(todo) != 1)} (one step each)")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # Discovery sees every backend the check would run, but no CUDA graph capture: a graph replays
    # the modules its eager run loads.
    process = ctx.Process(target=_precompile_main, args=(child, todo, only, replace(options, cuda_graph=False)), daemon=True)
    process.start()
    child.close()
    modules, finished = 0, None
    total, built_now = 0, 0
    try:
        while True:
            try:
                message = parent.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "building":
                total, built_now = len(message[1]), 0
                say(f"attndbg: compiling {total} FlashInfer module{'s' * (total != 1)} at once ({os.environ.get('MAX_JOBS') or os.cpu_count()} jobs)")
            elif kind == "built":
                built_now += 1
                modules += 1
                say(f"attndbg: compiled {built_now}/{total}: {message[1]} ({message[2]:.0f} s)")
            elif kind == "done":
                finished = message
                break
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    seconds = time.monotonic() - start
    if finished is None:
        problem = f"the compile phase's process ended early (exit code {process.exitcode}); the rest compiles on first use"
        say(f"attndbg: {problem}")
        return Compiled(modules, seconds, len(todo), problem)
    left = finished[2]
    problem = f"{len(left)} shape{'s' * (len(left) != 1)} still missing modules after {MAX_PASSES} passes" if left else None
    say(f"attndbg: compile phase done in {seconds:.0f} s: {finished[1]} FlashInfer module{'s' * (finished[1] != 1)} compiled" + (f"; {problem}" if problem else ""))
    return Compiled(finished[1], seconds, len(todo), problem)
