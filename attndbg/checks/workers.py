"""Check steps in worker processes: `attndbg check --jobs N [--devices 0,1]`.

Each worker is a spawned process (CUDA cannot be forked) that checks one step at a time and sends
back its `StepResult`. The steps in `first` (one of each kernel shape) go out before the others, so
the kernels a recording needs are compiled up front by several workers at once. Worker i runs on device `devices[i % len(devices)]` (it sees only that GPU,
through CUDA_VISIBLE_DEVICES set before CUDA starts). Results are yielded in recording order,
whatever order the workers finish in; at most `WINDOW_PER_JOB * jobs` steps are dispatched ahead
of the oldest unfinished one, so memory stays bounded.

A worker is also a crash boundary (issues 15 and 21). Every kernel a step launches is announced
(`replay/activity.py`: the runner's runs and the detectors' own launches) and the detector running
is named, in shared memory the parent reads after the worker is gone. When a worker dies in a
launch (a segfault in a kernel library, an abort), or ends itself on a poisoned CUDA context (an
illegal memory access, a device-side assert, wherever in the step it surfaced: a poisoned worker
never sends its step's result, so it never takes another step), the step gets one `backend-crash`
finding naming what is known (backend, what was launched, detector, signal or error) and is checked
again by a fresh worker: without that backend, or, for a fault outside any announced launch,
without that detector, so the step's other backends and detectors still report. A worker that dies
outside any launch by a signal (the out-of-memory killer, say) leaves its step reported as not
checked, with the reason. A fresh worker takes the dead one's place for the remaining steps either
way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from attndbg import machine
from attndbg.checks.crashes import Recheck, crash_finding, with_crashes
from attndbg.checks.step import StepReport, StepResult, check_one, step_of
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import Finding, FindingClass
from attndbg.replay import activity, memory_share

# What a worker may write about the launch it is in (backend, what, an error's first line, detector).
ACTIVITY_BYTES = 1024

# Steps a worker may run ahead of the oldest unfinished one, per worker. A slow step at the front
# (an EXTEND of seconds) idles the others once the window is used: on an H200's 1,000 server steps in
# 8 workers, 4 left each worker ~3 s waiting; replayed on those step times (bench/dispatch_window.py),
# 8 ends the last step 2.9 s sooner and more gains nothing. The results held meanwhile are small.
WINDOW_PER_JOB = 8
# The task index that asks a worker to empty its GPU cache (before another checks a step alone).
RELEASE = -1
# How often the parent reads the awaited step's worker for a progress display (`now`).
NOW_EVERY_S = 0.5
# How long the workers together get to exit once asked, before they are killed.
STOP_TIMEOUT_S = 5.0


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
        os.environ["CUDA_VISIBLE_DEVICES"] = worker_devices(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # Workers share the GPU (with --devices or not): each keeps to its part, so the caching
    # allocators of several workers never take the card between them.
    memory_share.take(share)
    while True:
        task = conn.recv()
        if task is None:
            return
        index, path, exclude, skip, alone = task
        if index == RELEASE:  # another worker will check a step alone: give back this one's cache
            memory_share.take(share)
            conn.send((index, None))
            continue
        if alone:
            memory_share.take(memory_share.WORKERS_PART)
        detectors = [kind for kind in only if kind.value not in skip]
        result = check(path, detectors, replace(options, exclude=tuple(exclude)) if exclude else options)
        if alone:
            memory_share.take(share)
        conn.send((index, result))


def worker_devices(device: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker on GPU `device`, numbered as its parent sees the GPUs: under
    the parent's own CUDA_VISIBLE_DEVICES (a scheduler's, a user's "=3"), the device'th entry of
    it, not physical GPU `device` (which put every worker of `CUDA_VISIBLE_DEVICES=3 attndbg check`
    on GPU 0)."""
    if visible is None or not visible.strip():
        return str(device)
    entries = [entry.strip() for entry in visible.split(",")]
    if not 0 <= device < len(entries):
        raise ValueError(f"GPU {device} is not among the {len(entries)} of CUDA_VISIBLE_DEVICES={visible}")
    return entries[device]


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
        self.alone = False  # its task is a step checked alone (over a worker's share of the GPU)

    def send(self, index: int, path: Path, exclude: tuple[str, ...], skip: tuple[str, ...], alone: bool = False) -> None:
        self.task, self.alone = (index, path), alone
        self.launch.value = b""
        self.conn.send((index, str(path), exclude, skip, alone))

    def release(self) -> None:
        """Have the worker empty its GPU cache (it answers when done)."""
        self.task = (RELEASE, Path())
        self.conn.send((RELEASE, "", (), (), False))

    def last_launch(self) -> activity.Launch | None:
        """What the worker was running when it ended (launch, detector, CUDA error), if anything."""
        return activity.parse(self.launch.value.decode("utf-8", "replace"))

    def ask_to_stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass


def _stop(workers: list[_Worker]) -> None:
    """End every worker: all are asked first, then awaited against one deadline, so their exits
    (interpreter, CUDA context and kernel modules torn down: about a second each on an H200) run at
    once. Stopped one after another, they were the last ~8 s of a 1,000-step check of 8 workers
    (bench/worker_utilisation.py on an H200: every worker idle for its last 8-9 s)."""
    for worker in workers:
        worker.ask_to_stop()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()


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
    now: Callable[[int, str], None] | None = None,  # told what the awaited step's worker runs (its activity record)
) -> Iterator[StepResult]:
    ctx = mp.get_context("spawn")
    order = list(dict.fromkeys([*first, *range(len(paths))]))
    early = set(first)
    slots = [devices[i % len(devices)] if devices else None for i in range(min(jobs, max(1, len(paths))))]
    # A little under an equal share of each GPU per worker on it (the CUDA context lives outside it).
    share = {d: memory_share.WORKERS_PART / slots.count(d) if len(slots) > 1 else None for d in set(slots)}
    threads = max(1, machine.host_cores() // len(slots))
    workers = [_Worker(ctx, device, share[device], threads, only, options, check) for device in slots]
    done: dict[int, StepResult] = {}
    crashes: dict[int, list[Finding]] = {}  # per step: its crashes, in order
    retry: deque[int] = deque()  # steps to check again without the backends (or detectors) that crashed on them
    # Steps over a worker's share of the GPU that fit the workers' whole part: each is checked by
    # one worker while the others, their caches emptied, wait. Rare (a step of gigabytes), so the
    # whole pool waits rather than track which workers share which card.
    alone: deque[int] = deque()
    released = False  # the other workers have emptied their caches since the last ordinary step
    next_task, next_out = 0, 0  # next_task indexes `order`; next_out the recording
    window = WINDOW_PER_JOB * len(workers)

    def excluded(index: int) -> tuple[str, ...]:
        """The backends left out of the step's next check (those that crashed on it)."""
        return tuple(f.data["backend"] for f in crashes.get(index, []) if f.data["rechecked"] == Recheck.WITHOUT_BACKEND.value)

    def skipped(index: int) -> tuple[str, ...]:
        """The detectors left out of it (those in which a kernel crashed outside any launch)."""
        return tuple(f.data["detector"] for f in crashes.get(index, []) if f.data["rechecked"] == Recheck.WITHOUT_DETECTOR.value)

    try:
        while next_out < len(paths):
            if alone and all(w.task is None for w in workers):
                if not released and len(workers) > 1:
                    for worker in workers[1:]:
                        worker.release()
                    released = True
                else:
                    index = alone.popleft()
                    workers[0].send(index, paths[index], excluded(index), skipped(index), alone=True)
            for worker in workers:
                if worker.task is not None or alone:
                    continue
                released = False
                if retry:
                    index = retry.popleft()
                    worker.send(index, paths[index], excluded(index), skipped(index))
                # The early steps go out whatever their place; the others within the window
                # (an early step far down the recording once stalled dispatch for good: with no
                # worker busy, wait() below had nothing to wake it).
                elif next_task < len(order) and (order[next_task] in early or order[next_task] < next_out + window):
                    worker.send(order[next_task], paths[order[next_task]], (), ())
                    next_task += 1
            busy = [w for w in workers if w.task is not None]
            if not busy:
                raise RuntimeError(f"check workers: nothing dispatched and nothing running at step {next_out} of {len(paths)}")
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=NOW_EVERY_S if now else None)
            if now is not None:
                # The worker's activity record (the crash boundary's evidence) says what it runs.
                for worker in busy:
                    if worker.task is not None and worker.task[0] == next_out:
                        launch = worker.last_launch()
                        now(next_out, launch.phase() if launch is not None else "")
            for i, worker in enumerate(workers):
                if worker.task is None:
                    continue
                if worker.conn in ready or worker.conn.poll():
                    try:
                        index, result = worker.conn.recv()
                    except (EOFError, OSError):
                        pass  # it died while sending: handled below
                    else:
                        was_alone, worker.task, worker.alone = worker.alone, None, False
                        if index == RELEASE:
                            continue
                        if result.over_share and not was_alone:
                            alone.append(index)
                            continue
                        done[index] = replace(result, report=with_crashes(result.report, crashes.pop(index, [])))
                        continue
                if worker.process.sentinel in ready and not worker.process.is_alive():
                    index, path = worker.task
                    if index == RELEASE:  # it died emptying its cache: no step of it is lost
                        worker.conn.close()
                        workers[i] = _Worker(ctx, worker.device, *worker.setup)
                        continue
                    death = _death(worker.process)
                    crash = worker.last_launch()
                    recheck = _recheck(crash, excluded(index), skipped(index))
                    again = recheck is Recheck.NONE and index in crashes
                    if crash is not None and (crash.backend or crash.error) and not again:
                        crashes.setdefault(index, []).append(crash_finding(str(path), crash, death, recheck, backend_options=options.backend_options))
                    if recheck is Recheck.NONE:
                        reason = f"not checked: the worker checking this step {'again ' if again else ''}{death}"
                        if crash is not None:
                            reason += f" ({crash.where()})"
                        step, mode = step_of(path)
                        done[index] = StepResult(with_crashes(StepReport(str(path), step, mode, [], error=reason), crashes.pop(index, [])))
                    else:
                        retry.append(index)
                    worker.conn.close()
                    workers[i] = _Worker(ctx, worker.device, *worker.setup)  # same share and options
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
    finally:
        _stop(workers)


def _recheck(crash: activity.Launch | None, excluded: tuple[str, ...], skipped: tuple[str, ...]) -> Recheck:
    """How a step whose worker ended on `crash` is checked again: without the backend launched,
    else (a CUDA fault outside any announced launch) without the detector it happened in; not again
    when neither is known, or when it crashed there before. One detector at most is left out: a
    fault outside any launch that follows the step from detector to detector (in the data they
    share, say) would otherwise cost a worker per detector. A death by a signal outside any launch
    (the out-of-memory killer, say) is not the step's crash."""
    if crash is None:
        return Recheck.NONE
    if crash.backend:
        return Recheck.WITHOUT_BACKEND if crash.backend not in excluded else Recheck.NONE
    if crash.error and crash.detector and not skipped:
        return Recheck.WITHOUT_DETECTOR
    return Recheck.NONE
