"""Compile a recording's kernels before its first step is checked, all at once (issue 24, item 1).

Kernel libraries that compile on first use (FlashInfer: 7-60 s a module, minutes for some) made a
fresh machine's first `check` wait minutes, one module after another, as each step reached one. Here,
before the steps are handed out:

1. one step of each kernel shape is picked (`kernel_shape`: mode, layer shape, dtypes, page size,
   window, soft-cap, graph, the recorded plan's path), the smallest of its shape;
2. check workers (workers.py: crash boundaries, in parallel) check those steps with FlashInfer's
   module loads watched (`backends/flashinfer_jit.py`): a module not on disk is noted, its build
   file written, and its call fails before any of its kernels runs. Triton's kernels compile for
   real here, into the disk cache every later worker reads;
3. this process builds the noted modules together, one ninja over all their sources on every core,
   with progress; then 2 again for the shapes that noted something, since a failed call hid the
   modules it would have loaded next, until a pass notes nothing new (at most MAX_PASSES).

The modules each shape loaded are remembered (after each pass) in FlashInfer's JIT directory, so a
shape whose modules are all on disk is not looked at again: a warm machine pays nothing here.
Whatever this misses (a module a detector loads only on some steps of a shape) is compiled on first
use, as before. A worker that dies on a shape leaves that shape to the check.

Opt-in (`attndbg compile`, `check --compile-first`) until measured to pay on the server mix. What was
measured on an H200 (bench/results/server_sweep_h200_session7.md) was this phase's first form, which
looked at the shapes one after another in one process: bench/server_sweep.py's 1,000 steps have 278
kernel shapes; the first pass noted 34 modules and built them at once (all done 150 s into one
ninja, on 16 cores, against ~8 min one after another in session 6), but each look is a whole check of
a step, about a second, and the passes over 278 shapes did not finish within a device call. Looking
in the check workers, in parallel, is this form. On the H200 in session 8
(bench/results/server_sweep_h200_session8.md) it did not pay either: pass 1 in 8 workers over 182
shapes, the 34 modules in 211 s, then pass 2 over 155 shapes, unfinished after two calls (1,090 s);
the whole eager check without it took 521 s once the modules were on disk. A look costs a whole
check (every backend and detector, Triton compiling for real) and pass 2 repeats it for every shape
whose look hit an unbuilt module. What would pay: naming a shape's modules without running it (each
adapter declaring the JIT specs its plan loads), so one pass and one build suffice.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from attndbg.backends import flashinfer_jit
from attndbg.checks.run import StepResult, auto_jobs, check_one
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


@dataclass(frozen=True)
class Look:
    """What a look at one step found: the modules it loaded, and those it needed but found unbuilt."""

    used: tuple[str, ...]
    unbuilt: tuple[flashinfer_jit.Unbuilt, ...]


@dataclass(frozen=True)
class LookResult(StepResult):
    """A step checked with FlashInfer's loads watched (its report is not the step's verdict)."""

    look: Look = field(default_factory=lambda: Look((), ()))


def look_one(path: str, only: list[FindingClass], options: CheckOptions) -> StepResult:
    """In a check worker: check `path` with FlashInfer's module loads watched (workers.CheckOne)."""
    os.environ[PREBUILT_VARIABLE] = "1"  # a look's first-use notes would say what the phase says
    with flashinfer_jit.watching_modules() as watch:
        result = check_one(path, only, options)
    unbuilt = flashinfer_jit.build_files(watch) if watch.unbuilt else []
    return LookResult(result.report, look=Look(tuple(sorted(watch.used)), tuple(unbuilt)))


@dataclass(frozen=True)
class Compiled:
    """What the compile phase did: modules built, its seconds, shapes looked at, and why it stopped
    short (None when it finished)."""

    modules: int
    seconds: float
    shapes: int
    problem: str | None = None


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def precompile(
    paths: list[Path],
    only: list[FindingClass],
    options: CheckOptions,
    *,
    jobs: int | None = None,
    devices: tuple[int, ...] | None = None,
    say: Callable[[str], None] = _say,
) -> Compiled | None:
    """Compile the kernels `paths` need before they are checked (see the module docstring), looking
    in `jobs` check workers (None: as `check --jobs auto` would for that many steps, at least one per
    GPU). None when there is nothing to do: no FlashInfer, or every shape's modules already on disk."""
    from attndbg.checks.workers import check_in_workers

    if not flashinfer_jit.available():
        return None
    start = time.monotonic()
    shapes = representatives(paths)
    memo = flashinfer_jit.read_memo()
    todo = {key: path for key, path in shapes.items() if key not in memo or not flashinfer_jit.compiled(memo[key])}
    os.environ[PREBUILT_VARIABLE] = "1"  # workers spawned after this inherit it: no first-use notes
    if not todo:
        return None
    # A graph replays the modules its eager run loads: the looks capture no graph.
    look_options = replace(options, cuda_graph=False)
    used: dict[str, set[str]] = {key: set() for key in todo}
    built: set[str] = set()
    problem: str | None = None
    for n in range(1, MAX_PASSES + 1):
        workers = jobs or max(auto_jobs(len(todo) * 50, devices), len(devices or ()) or 1)
        workers = min(workers, len(todo))
        say(f"attndbg: compile phase, pass {n}: looking at {len(todo)} kernel shape{'s' * (len(todo) != 1)} (one step each) in {workers} worker{'s' * (workers != 1)}")
        keys = list(todo)
        results = check_in_workers([todo[k] for k in keys], only, look_options, jobs=workers, devices=devices, check=look_one)
        needed: dict[str, flashinfer_jit.Unbuilt] = {}
        learnt: dict[str, list[str]] = {}
        still: dict[str, Path] = {}
        for key, result in zip(keys, results):
            look = result.look if isinstance(result, LookResult) else None
            if look is None:
                continue  # the worker died on it: left to the check, which reports it
            used[key] |= set(look.used)
            if look.unbuilt:
                needed.update({u.name: u for u in look.unbuilt})
                still[key] = todo[key]
            else:
                learnt[key] = sorted(used[key])
        flashinfer_jit.remember(learnt)
        new = [u for name, u in sorted(needed.items()) if name not in built]
        if not new:
            if still:
                problem = f"{len(still)} shape{'s' * (len(still) != 1)} still lack modules that were built (see FlashInfer's log)"
            break
        total = len(new)
        say(f"attndbg: compiling {total} FlashInfer module{'s' * (total != 1)} at once ({os.environ.get('MAX_JOBS') or os.cpu_count()} jobs)")
        count = iter(range(1, total + 1))
        try:
            flashinfer_jit.build(new, lambda name, seconds: say(f"attndbg: compiled {next(count)}/{total} ({seconds:.0f} s): {name}"))
        except RuntimeError as e:
            problem = str(e).splitlines()[0]
            say(f"attndbg: {problem}; the rest compiles on first use")
            break
        built |= {u.name for u in new}
        todo = still
        if not todo:
            break
    else:
        problem = f"{len(todo)} shape{'s' * (len(todo) != 1)} still noted modules after {MAX_PASSES} passes"
    seconds = time.monotonic() - start
    say(f"attndbg: compile phase done in {seconds:.0f} s: {len(built)} FlashInfer module{'s' * (len(built) != 1)} compiled" + (f"; {problem}" if problem else ""))
    return Compiled(len(built), seconds, len(shapes), problem)
