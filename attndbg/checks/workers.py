"""Check steps in worker processes: `attndbg check --jobs N [--devices 0,1]`.

Each worker is a spawned process (CUDA cannot be forked) that checks one step at a time and sends
back its `StepResult`. The steps in `first` (one of each kernel shape) go out before the others, so
the kernels a recording needs are compiled up front by several workers at once. Worker i runs on device `devices[i % len(devices)]` (it sees only that GPU,
through CUDA_VISIBLE_DEVICES set before CUDA starts). Results are yielded in recording order,
whatever order the workers finish in; at most `WINDOW_PER_JOB * jobs` steps are dispatched ahead
of the oldest unfinished one, so memory stays bounded.

A worker is also a crash boundary: when one dies (a segfault in a kernel library, an abort, the
out-of-memory killer), the step it was checking is reported as not checked, with the signal, and a
fresh worker takes its place for the remaining steps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from attndbg.checks.context import CheckOptions
from attndbg.checks.findings import FindingClass
from attndbg.checks.run import StepReport, StepResult, check_one

WINDOW_PER_JOB = 4


CheckOne = Callable[[str, list[FindingClass], CheckOptions], StepResult]


def _worker_main(
    conn: Connection, device: int | None, share: float, threads: int, only: list[FindingClass], options: CheckOptions, check: CheckOne
) -> None:
    import torch

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
        index, path = task
        conn.send((index, check(path, only, options)))


class _Worker:
    def __init__(self, ctx: mp.context.SpawnContext, device: int | None, *setup: Any):
        self.setup = setup  # share, threads, only, options, check
        self.device = device
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, device, *setup), daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[int, Path] | None = None

    def send(self, index: int, path: Path) -> None:
        self.task = (index, path)
        self.conn.send((index, str(path)))

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
    next_task, next_out = 0, 0  # next_task indexes `order`; next_out the recording
    window = WINDOW_PER_JOB * len(workers)
    try:
        while next_out < len(paths):
            for worker in workers:
                # The early steps go out whatever their place; the others within the window
                # (an early step far down the recording once stalled dispatch for good: with no
                # worker busy, wait() below had nothing to wake it).
                if worker.task is None and next_task < len(order) and (order[next_task] in early or order[next_task] < next_out + window):
                    worker.send(order[next_task], paths[order[next_task]])
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
                        done[index] = result
                        worker.task = None
                        continue
                if worker.process.sentinel in ready and not worker.process.is_alive():
                    index, path = worker.task
                    reason = f"not checked: the worker checking this step {_death(worker.process)}"
                    done[index] = StepResult(StepReport(str(path), -1, "crashed", [], error=reason))
                    worker.conn.close()
                    workers[i] = _Worker(ctx, worker.device, *worker.setup)  # same share and options
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        for worker in workers:
            worker.stop()
