"""Where a multi-worker check's wall time goes: start-up, steps, waiting, tail.

An H200 run (2026-11-26) found ~59 s of a 1,000-step server-mix check that does
not grow with the steps (5,000 steps took 2.2x the time of 1,000), while one worker's own start-up
(worker_startup.py) is ~15-20 s. This runs the check's worker pool as `attndbg check` does (same
workers, order, window and kernel-shapes-first dispatch) with a check function that logs, in each
worker, when each step started and ended, and reports per worker:

  start-up   from the pool's start to the worker's first step (process start, imports, CUDA)
  busy       the sum of its steps (the first ones pay kernel loads)
  waiting    between its first step's start and its last step's end, not in a step (dispatch,
             the window, the parent reading results)
  tail       from its last step's end to the end of the check

    bash .gpu/env.sh python bench/worker_utilisation.py REC --backend triton,flashinfer,mla --out $OUT

With --cli, the pool is the one `attndbg check REC --backend ...` runs (the command itself, in a
child process, its pool's check function swapped for the logging one), and the command's wall time
is split too: start-up (interpreter and imports, to the command's first line), before the pool
(reading the recording, the kernel shapes), the pool, and after it (the report). On an H200 this
script's pool took 47 s of 1,000 steps where the command took 63 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_LOG = "ATTNDBG_UTILISATION_LOG"


def logged_check(path, only, options):
    """check_one, with its start and end (wall clock, shared by the processes) appended to the log."""
    from attndbg.checks.step import check_one

    start = time.time()
    result = check_one(path, only, options)
    with open(os.environ[_LOG], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "path": str(path), "mode": result.report.mode, "start": start, "end": time.time()}) + "\n")
    return result


def summarise(rows: list[dict], begin: float, end: float) -> list[str]:
    """Per worker and overall: start-up, busy, waiting, tail, in seconds."""
    by_pid: dict[int, list[dict]] = {}
    for row in rows:
        by_pid.setdefault(row["pid"], []).append(row)
    wall = end - begin
    lines = [f"wall {wall:.1f} s, {len(rows)} steps, {len(by_pid)} workers"]
    totals = dict(startup=0.0, busy=0.0, waiting=0.0, tail=0.0)
    for pid, steps in sorted(by_pid.items(), key=lambda item: min(r["start"] for r in item[1])):
        steps.sort(key=lambda r: r["start"])
        busy = sum(r["end"] - r["start"] for r in steps)
        part = dict(startup=steps[0]["start"] - begin, busy=busy, waiting=steps[-1]["end"] - steps[0]["start"] - busy, tail=end - steps[-1]["end"])
        for key, value in part.items():
            totals[key] += value
        first = steps[0]["end"] - steps[0]["start"]
        lines.append(f"  worker {pid}: {len(steps)} steps; " + ", ".join(f"{k} {v:.1f} s" for k, v in part.items()) + f"; first step {first:.1f} s")
    share = {k: v / max(1e-9, wall * len(by_pid)) for k, v in totals.items()}
    lines.append("worker time: " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in share.items()))
    modes: dict[str, list[float]] = {}
    for row in rows:
        modes.setdefault(row["mode"], []).append(row["end"] - row["start"])
    lines.append("step seconds in workers: " + ", ".join(f"{m} {len(v)} x {1000 * sum(v) / len(v):.0f} ms" for m, v in sorted(modes.items())))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recording")
    parser.add_argument("--backend", default="triton,flashinfer,fa3")
    parser.add_argument("--jobs", type=int, default=None, help="workers (default: as --jobs auto)")
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--tag", default="")
    parser.add_argument("--cli", action="store_true", help="time `attndbg check` itself (see above)")
    args = parser.parse_args()
    if args.cli:
        return time_the_command(args)

    from attndbg.checks.run import auto_jobs, first_of_each_shape
    from attndbg.checks.selection import parse_only, select_paths
    from attndbg.checks.workers import check_in_workers
    from attndbg.cli.options import parse_devices
    from attndbg.detector_api.context import CheckOptions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"worker_utilisation{args.tag}.jsonl"
    log.unlink(missing_ok=True)
    os.environ[_LOG] = str(log.resolve())  # the workers inherit it
    paths = select_paths(args.recording)
    devices = parse_devices(None)
    jobs = args.jobs or auto_jobs(len(paths), devices)
    options = CheckOptions(backends=tuple(args.backend.split(",")), cuda_graph=args.cuda_graph)
    begin = time.time()
    first = first_of_each_shape(paths)
    for _ in check_in_workers(paths, parse_only(None), options, jobs=jobs, devices=devices, check=logged_check, first=first):
        pass
    end = time.time()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    lines = [f"{args.recording}: --backend {args.backend}{' --cuda-graph' if args.cuda_graph else ''}, {jobs} workers, {len(first)} steps sent first (one per kernel shape)", *summarise(rows, begin, end)]
    (out / f"worker_utilisation{args.tag}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


_MARKS = "ATTNDBG_UTILISATION_MARKS"


def command_child(argv: list[str]) -> None:
    """In the child: `attndbg check argv` with the pool's steps logged and its edges marked."""
    import attndbg.checks.workers as workers
    from attndbg.cli import main as cli

    marks = open(os.environ[_MARKS], "a")  # open until the child exits: a mark is flushed as written

    def mark(what: str) -> None:
        marks.write(json.dumps({"mark": what, "t": time.time()}) + "\n")
        marks.flush()

    pool = workers.check_in_workers

    def logged_pool(*a, **k):
        mark("pool start")
        k["check"] = logged_check
        yield from pool(*a, **k)
        mark("pool end")

    workers.check_in_workers = logged_pool  # checks.run imports it when the check starts
    mark("command start")
    try:
        cli.main(["check", *argv], standalone_mode=False)
    except SystemExit:
        pass
    mark("command end")


def time_the_command(args) -> int:
    import subprocess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log, marks = out / f"command_utilisation{args.tag}.jsonl", out / f"command_marks{args.tag}.jsonl"
    log.unlink(missing_ok=True)
    marks.unlink(missing_ok=True)
    argv = [args.recording, "--backend", args.backend] + (["--cuda-graph"] if args.cuda_graph else []) + ([f"--jobs={args.jobs}"] if args.jobs else [])
    env = dict(os.environ, **{_LOG: str(log.resolve()), _MARKS: str(marks.resolve())})
    begin = time.time()
    code = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, stdout=subprocess.DEVNULL).returncode
    end = time.time()
    at = {}
    for line in marks.read_text().splitlines():
        row = json.loads(line)
        at.setdefault(row["mark"], row["t"])
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    edges = [("start-up (interpreter, imports)", begin, at.get("command start")), ("before the pool (options, steps, shapes)", at.get("command start"), at.get("pool start")),
             ("the pool", at.get("pool start"), at.get("pool end")), ("after the pool (report)", at.get("pool end"), at.get("command end")),
             ("exit", at.get("command end"), end)]  # fmt: skip
    lines = [f"attndbg check {' '.join(argv)}: exit {code}, wall {end - begin:.1f} s"]
    lines += [f"  {name}: {b - a:.1f} s" if a and b else f"  {name}: not reached" for name, a, b in edges]
    if rows and at.get("pool start") and at.get("pool end"):
        lines += ["the pool:", *summarise(rows, at["pool start"], at["pool end"])]
    (out / f"command_utilisation{args.tag}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    command_child(sys.argv[2:])
    sys.exit(0)
if __name__ == "__main__":
    sys.exit(main())
