"""Compile a recording's FlashInfer modules before its first step is checked, all at once.

Kernel libraries that compile on first use (FlashInfer: 7-60 s a module, minutes for some) made a
fresh machine's first `check` wait minutes, one module after another, as each step reached one. Here,
before the steps are handed out, in one pass and one build:

1. up to SHAPE_SCAN steps are read (evenly spread over the recording). For each, every backend the
   check will use names the FlashInfer JIT specs its runs of that step would load (`Backend.jit_specs`,
   with the check's backend options: backends/flashinfer_modules.py holds FlashInfer's choices), and
   so does each detector for the runs it forces (`Detector.forced_runs`: split-merge's cascade and
   paged extend paths). Nothing runs: naming a module costs microseconds;
2. the modules not on disk are built together, on every core, each by its own ninja in its own build
   directory as FlashInfer builds it (`flashinfer_jit.build`), with a line per module as it lands.
   They were once built by one ninja over all of them, and ninja's log then lived where
   FlashInfer's first load does not look: the check rebuilt every module a second time (H100: 41
   modules, 818 s up front, then the whole first slice of the sweep spent compiling them again).

A module the declaration misses (a FlashInfer choice not read into flashinfer_modules.py) still
compiles on first use in the check, as before: a miss costs time, never a verdict. Triton's kernels
are not compiled here: they compile on first use in the check's workers, into the disk cache they share.

Opt-in (`attndbg compile`, `check --compile-first`) until measured on a GPU. Its earlier form found
the modules by running: it checked one step of each kernel shape with FlashInfer's loads watched,
built what those looks noted, and looked again, since a failed call hid the modules it would have
loaded next. On an H200 (2026-11-26) that did not pay: over
bench/server_sweep.py's 182 kernel shapes, pass 1 in 8 workers and the 34 modules it noted (built in
211 s in one ninja), then pass 2 over 155 shapes, unfinished after 1,090 s in two device calls, against
521 s for the whole eager check once the modules were on disk. A look cost a whole check of a step
(every backend and detector, Triton compiling for real). bench/flashinfer_module_names.py compares
what this form declares for that recording with what the looks noted. This form, measured on a fresh
H200 (docs/benchmarks.md, "The compile phase and cold start"): a 4-step recording's verdict in
176 s against 242 s without it, and no module rebuilt by the checks after it.

When it runs: `check` decides from what FlashInfer's cache holds (`worth_compiling`). One step of
each kernel shape (the steps check's workers take first) names its modules, and those not on disk
are counted: from PAYS_FROM missing, the phase runs over the whole recording (on a cold cache its
reading, about 9 ms a step on a 2-core CPU, is nothing beside minutes of compiling); fewer, and each
compiles on first use, as it would have in the phase, one at a time either way. A warm machine
pays the reading of those few steps (up to run.SHAPE_SAMPLE), never every step's.
`--compile-first` runs the phase whatever the cache holds; `--no-compile-first` never.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attndbg import machine
from attndbg.backends import flashinfer_jit, flashinfer_modules, registry
from attndbg.backends.options import BackendOptions
from attndbg.checks.step import detectors_of
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.plural import counted
from attndbg.replay.runner import PREBUILT_VARIABLE
from attndbg.trace import io
from attndbg.trace.schema import Trace
from attndbg.trace.validate import TraceError

# Steps read for their modules (evenly spread when the recording has more).
SHAPE_SCAN = 4000


def kernel_shape(trace: Trace) -> tuple:
    """What decides which kernels checking a step compiles: mode, the attention layer's shape and
    dtypes, page size, window, soft-cap, graph replay, and the path of the recorded plan (FlashInfer's
    extend runs ragged, paged or cascade, each its own modules). check's workers take one step of
    each shape first (run.first_of_each_shape)."""
    m = trace.model
    path = "" if trace.plan is None else str(trace.plan.scalars.get("path", ""))
    return (
        trace.batch.forward_mode.value, m.attention.value, m.head_dim, m.v_head_dim, m.gqa_group, m.q_dtype, m.kv_dtype,
        m.page_size, m.sliding_window >= 0, m.logit_cap > 0, trace.graph is not None, path,
    )  # fmt: skip


def scanned(paths: list[Path]) -> list[Path]:
    """The steps read: all, or SHAPE_SCAN evenly spread."""
    n = len(paths)
    if n <= SHAPE_SCAN:
        return list(paths)
    return [paths[i] for i in sorted({round(i * (n - 1) / (SHAPE_SCAN - 1)) for i in range(SHAPE_SCAN)})]


def backends_of(options: CheckOptions) -> list[str]:
    """The kernel backends the check will use: those asked for, or every one registered (an adapter
    that cannot run on the target declares nothing)."""
    names = options.backends or tuple(registry.backend_names())
    return [n for n in names if n != "reference" and n not in options.exclude]


def declare(trace: Trace, only: list[FindingClass], options: CheckOptions, at: flashinfer_modules.Target) -> list[Any]:
    """The FlashInfer JIT specs checking `trace`'s step would load on `at`: each backend's own runs,
    then the runs each detector forces on a backend among them."""
    names = backends_of(options)
    runs: list[tuple[str, BackendOptions]] = [(name, options.backend_options) for name in names]
    for detector in detectors_of(only).values():
        runs += [(name, options.backend_options.overridden_by(BackendOptions(((name, forced),)))) for name, forced in detector.forced_runs_of(trace) if name in names]
    specs: list[Any] = []
    for name, backend_options in runs:
        adapter = registry.create(name, options=backend_options)
        if machine.cuda_available() and adapter.unavailable_reason():
            continue
        specs += adapter.jit_specs(trace, at)
    return specs


def declared(paths: list[Path], only: list[FindingClass], options: CheckOptions, at: flashinfer_modules.Target) -> dict[str, Any]:
    """Module name -> its spec, over the steps `scanned` picks (an unreadable step is left to the check)."""
    specs: dict[str, Any] = {}
    for path in scanned(paths):
        try:
            trace = io.load(path)
        except TraceError:
            continue  # reported when its turn comes
        for spec in declare(trace, only, options, at):
            specs.setdefault(spec.name, spec)
    return specs


@dataclass(frozen=True)
class Compiled:
    """What the compile phase did: modules built, its seconds, the modules the steps need (built or
    already on disk), and why it stopped short (None when it finished)."""

    modules: int
    seconds: float
    needed: int
    problem: str | None = None


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# Modules missing from the cache from which compiling them up front pays: several build at once,
# on every core, instead of one after another as steps reach them (176 s against 242 s for a
# fresh H200's first check of 4 steps, docs/benchmarks.md); one module takes as long either way.
PAYS_FROM = 2


def worth_compiling(paths: list[Path], only: list[FindingClass], options: CheckOptions, shapes: list[int]) -> int | None:
    """How many FlashInfer modules the first step of each kernel shape (`shapes`: indices into
    `paths`, run.first_of_each_shape) needs that FlashInfer's cache does not hold, when that is
    PAYS_FROM or more; else None (nothing to gain: no FlashInfer, or the cache holds nearly all)."""
    if not flashinfer_jit.available():
        return None
    specs = declared([paths[i] for i in shapes], only, options, flashinfer_modules.target())
    missing = len(flashinfer_jit.unbuilt(list(specs.values())))
    return missing if missing >= PAYS_FROM else None


def before_checking(
    paths: list[Path], only: list[FindingClass], options: CheckOptions, *, asked: bool | None, shapes: list[int], say: Callable[[str], None] = _say
) -> Compiled | None:
    """check's compile phase, on a GPU: when `asked` (--compile-first), never when asked not to,
    and otherwise when `worth_compiling` finds enough of the shapes' modules missing from the cache."""
    if asked is False or not machine.cuda_available():
        return None
    if asked is None:
        missing = worth_compiling(paths, only, options, shapes)
        if missing is None:
            return None
        say(
            f"attndbg: FlashInfer's cache lacks {counted(missing, 'module')} that one step of each kernel shape needs: "
            "compiling what the recording needs first (--no-compile-first: each on first use instead)"
        )
    return precompile(paths, only, options, say=say)


def precompile(paths: list[Path], only: list[FindingClass], options: CheckOptions, *, say: Callable[[str], None] = _say) -> Compiled | None:
    """Build the FlashInfer modules `paths` need before they are checked (see the module docstring).
    None when there is nothing to do: no FlashInfer, no module declared, or all of them on disk."""
    if not flashinfer_jit.available():
        return None
    start = time.monotonic()
    specs = declared(paths, only, options, flashinfer_modules.target())
    missing = flashinfer_jit.unbuilt(list(specs.values()))
    os.environ[PREBUILT_VARIABLE] = "1"  # workers spawned after this inherit it: no first-use notes
    if not missing:
        return None
    total = len(missing)
    say(
        f"attndbg: compile phase: {len(specs)} FlashInfer module{'s' * (len(specs) != 1)} named by the steps' kernels, "
        f"{total} not on disk: compiling them at once ({flashinfer_jit.default_jobs()} jobs)"
    )
    hint = flashinfer_jit.prebuilt_hint()
    if hint:
        say(f"attndbg: {hint}")
    count = iter(range(1, total + 1))
    problem: str | None = None
    try:
        flashinfer_jit.build(missing, lambda name, seconds: say(f"attndbg: compiled {next(count)}/{total} ({seconds:.0f} s): {name}"))
    except RuntimeError as e:
        problem = str(e).splitlines()[0]
        say(f"attndbg: {problem}; the rest compiles on first use")
    built = sum(m.library.exists() for m in missing)
    seconds = time.monotonic() - start
    say(f"attndbg: compile phase done in {seconds:.0f} s: {built} FlashInfer module{'s' * (built != 1)} compiled" + (f"; {problem}" if problem else ""))
    return Compiled(built, seconds, len(specs), problem)
