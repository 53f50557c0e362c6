"""Check steps in worker processes: `attndbg check --jobs N [--devices 0,1]`.

Each worker is a spawned process (CUDA cannot be forked) that checks one step at a time and sends
back its `StepResult`. The steps in `first` (one of each kernel shape) go out before the others, so
the kernels a recording needs are compiled up front by several workers at once. Worker i runs on device `devices[i % len(devices)]` (it sees only that GPU,
through CUDA_VISIBLE_DEVICES set before CUDA starts). Results are yielded in recording order,
whatever order the workers finish in; at most `WINDOW_PER_JOB * jobs` steps are dispatched ahead
of the oldest unfinished one, so memory stays bounded.

A worker is also a crash boundary (issue 15). Around each kernel launch it names the backend and
variant in shared memory (`replay/activity.py`). When it dies in a launch (a segfault in a kernel
library, an abort) or ends itself on a poisoned CUDA context (an illegal memory access, a
device-side assert), the step gets a `backend-crash` finding naming backend, variant and signal or
error, and is checked again by a fresh worker without that backend, so its other backends and
detectors still report. A worker that dies outside any launch (the out-of-memory killer, say)
leaves its step reported as not checked, with the reason. A fresh worker takes the dead one's
place for the remaining steps either way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from attndbg.checks.context import CheckOptions
from attndbg.checks.findings import Finding, FindingClass, finding
from attndbg.checks.run import StepReport, StepResult, check_one
from attndbg.replay import activity

# What a worker may write about the launch it is in (backend, variant, an error's first line).
ACTIVITY_BYTES = 1024

WINDOW_PER_JOB = 4


CheckOne = Callable[[str, list[FindingClass], CheckOptions], StepResult]


def _worker_main(
    conn: Connection,
    launch: Any,  # multiprocessing Array of ACTIVITY_BYTES chars: the launch this worker is in
    device: int | None,
    share: float,
    threads: int,
    only: list[FindingClass],
    options: CheckOptions,
    check: CheckOne,
) -> None:
    import torch

    def note(text: str) -> None:
        data = text.encode("utf-8", "replace")[: ACTIVITY_BYTES - 1]
        launch[: len(data) + 1] = data + b"\0"

    activity.set_sink(note)

    # Each worker gets its part of the cores: N workers with a thread per core each spin against
    # one another (measured: 4 workers slower than 1 on a 16-core host).
    torch.set_num_threads(threads)
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
        if torch.cuda.is_available():
            # Workers share the GPU: each keeps to its part, so the caching allocators of several
            # workers never take the card between them (an allocator at its limit frees its cache).
            torch.cuda.set_per_process_memory_fraction(share)
    while True:
        task = conn.recv()
        if task is None:
            return
        index, path, exclude = task
        conn.send((index, check(path, only, replace(options, exclude=tuple(exclude)) if exclude else options)))


class _Worker:
    def __init__(self, ctx: mp.context.SpawnContext, device: int | None, *setup: Any):
        self.setup = setup  # share, threads, only, options, check
        self.device = device
        self.conn, child = ctx.Pipe()
        self.launch = ctx.Array("c", ACTIVITY_BYTES, lock=False)
        self.process = ctx.Process(target=_worker_main, args=(child, self.launch, device, *setup), daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[int, Path] | None = None

    def send(self, index: int, path: Path, exclude: tuple[str, ...]) -> None:
        self.task = (index, path)
        self.launch.value = b""
        self.conn.send((index, str(path), exclude))

    def last_launch(self) -> tuple[str, str, str] | None:
        """(backend, variant, error) of the launch the worker was in when it ended, if any."""
        return activity.parse(self.launch.value.decode("utf-8", "replace"))

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()


def _death(process: mp.process.BaseProcess) -> str:
    code = process.exitcode
    if code == activity.POISONED_EXIT:
        return "left its CUDA context unusable"
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def check_in_workers(
    paths: list[Path],
    only: list[FindingClass],
    options: CheckOptions,
    *,
    jobs: int,
    devices: tuple[int, ...] | None,
    check: CheckOne = check_one,  # a module-level function (workers import it by name)
    first: list[int] = (),  # indices to check before the others (one step of each kernel shape: compiles in parallel)
) -> Iterator[StepResult]:
    ctx = mp.get_context("spawn")
    order = list(dict.fromkeys([*first, *range(len(paths))]))
    early = set(first)
    slots = [devices[i % len(devices)] if devices else None for i in range(min(jobs, max(1, len(paths))))]
    # A little under an equal share of each GPU per worker on it (the CUDA context lives outside it).
    share = {d: 0.9 / slots.count(d) for d in set(slots)}
    threads = max(1, (os.cpu_count() or 1) // len(slots))
    workers = [_Worker(ctx, device, share[device], threads, only, options, check) for device in slots]
    done: dict[int, StepResult] = {}
    crashes: dict[int, list[Finding]] = {}  # per step: the backends that crashed on it, in order
    retry: deque[int] = deque()  # steps to check again without the backends that crashed on them
    next_task, next_out = 0, 0  # next_task indexes `order`; next_out the recording
    window = WINDOW_PER_JOB * len(workers)

    def excluded(index: int) -> tuple[str, ...]:
        return tuple(f.data["backend"] for f in crashes.get(index, []))

    try:
        while next_out < len(paths):
            for worker in workers:
                if worker.task is not None:
                    continue
                if retry:
                    index = retry.popleft()
                    worker.send(index, paths[index], excluded(index))
                # The early steps go out whatever their place; the others within the window
                # (an early step far down the recording once stalled dispatch for good: with no
                # worker busy, wait() below had nothing to wake it).
                elif next_task < len(order) and (order[next_task] in early or order[next_task] < next_out + window):
                    worker.send(order[next_task], paths[order[next_task]], ())
                    next_task += 1
            busy = [w for w in workers if w.task is not None]
            if not busy:
                raise RuntimeError(f"check workers: nothing dispatched and nothing running at step {next_out} of {len(paths)}")
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
            for i, worker in enumerate(workers):
                if worker.task is None:
                    continue
                if worker.conn in ready or worker.conn.poll():
                    try:
                        index, result = worker.conn.recv()
                    except (EOFError, OSError):
                        pass  # it died while sending: handled below
                    else:
                        done[index] = _with_crashes(result, crashes.pop(index, []))
                        worker.task = None
                        continue
                if worker.process.sentinel in ready and not worker.process.is_alive():
                    index, path = worker.task
                    death = _death(worker.process)
                    launch = worker.last_launch()
                    if launch is not None and launch[0] not in excluded(index):
                        crashes.setdefault(index, []).append(_crash_finding(path, launch, death))
                        retry.append(index)
                    else:
                        reason = f"not checked: the worker checking this step {death}"
                        if launch is not None:
                            reason += f" in {launch[0]} ({launch[1]})"
                        done[index] = _with_crashes(StepResult(StepReport(str(path), -1, "crashed", [], error=reason)), crashes.pop(index, []))
                    worker.conn.close()
                    workers[i] = _Worker(ctx, worker.device, *worker.setup)  # same share and options
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        for worker in workers:
            worker.stop()


def _crash_finding(path: Path, launch: tuple[str, str, str], death: str) -> Finding:
    backend, variant, error = launch
    how = f"{death}: {error}" if error else death
    return finding(
        FindingClass.BACKEND_CRASH,
        "backend-crashed",
        step=-1,  # the step number is known once the step is read again
        evidence=f"{backend} crashed on this step ({variant}): the worker running it {how}",
        cause=f"The {backend} kernels crashed on this step's inputs and plan; the step's other backends and detectors were "
        f"checked again without {backend} in a fresh worker. Replay it alone (`attndbg replay {path} --backend {backend}`) "
        "to reproduce; run it under compute-sanitizer to find the faulting access.",
        trace=str(path),
        backend=backend,
        variant=variant,
        death=death,
        error=error,
    )


def _with_crashes(result: StepResult, crashes: list[Finding]) -> StepResult:
    """The step's report with the crash findings first, located at the step once it is known."""
    if not crashes:
        return result
    report = result.report
    located = [replace(f, location=replace(f.location, step=report.step)) for f in crashes]
    return replace(result, report=replace(report, findings=located + list(report.findings)))
