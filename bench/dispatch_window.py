"""How long a check's pool would take with other dispatch windows, replayed from the step times a
GPU run logged (bench/worker_utilisation.py's worker_utilisation.jsonl): the workers' 'waiting'.

The pool (attndbg/checks/workers.py) hands a free worker the next step only while it lies within
WINDOW_PER_JOB x jobs steps of the oldest step not yet finished (results are yielded in recording
order and held until then). A slow step (an EXTEND of seconds) at the front then idles the other
workers once the window is used up. This replays the pool's policy (the early steps, one per kernel
shape, first and outside the window; then recording order) on the logged step durations, for each
window, and prints the time to the last step's end. Start-up and the workers' exits are left out.

    python bench/dispatch_window.py OUT/worker_utilisation.jsonl --early 27
"""

from __future__ import annotations

import argparse
import heapq
import json
import re
import sys


def replay(durations: list[float], first: list[int], jobs: int, window_per_job: int) -> float:
    """Seconds to the end of the last step under the pool's dispatch policy."""
    n = len(durations)
    order = list(dict.fromkeys([*first, *range(n)]))
    early, window = set(first), window_per_job * jobs
    now, running, done = 0.0, [], set()
    next_out = next_task = 0
    idle = jobs
    while next_out < n:
        while idle and next_task < n and (order[next_task] in early or order[next_task] < next_out + window):
            index = order[next_task]
            heapq.heappush(running, (now + durations[index], index))
            next_task, idle = next_task + 1, idle - 1
        now, index = heapq.heappop(running)
        done.add(index)
        idle += 1
        while next_out in done:
            next_out += 1
    return now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="worker_utilisation.jsonl")
    parser.add_argument("--early", type=int, required=True, help="how many steps the pool sent first (one per kernel shape: worker_utilisation.txt says)")
    parser.add_argument("--windows", default="2,4,6,8,12,16")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.log)]
    step = {id(row): int(re.search(r"step_(\d+)", row["path"]).group(1)) for row in rows}
    by_step = sorted(rows, key=lambda row: step[id(row)])
    position = {step[id(row)]: i for i, row in enumerate(by_step)}
    durations = [row["end"] - row["start"] for row in by_step]
    jobs = len({row["pid"] for row in rows})
    # The early steps go out before all others, so they are the first to start.
    first = [position[step[id(row)]] for row in sorted(rows, key=lambda row: row["start"])[: args.early]]
    print(f"{args.log}: {len(rows)} steps, {jobs} workers; all steps' seconds / workers = {sum(durations) / jobs:.1f} s")
    for w in (int(x) for x in args.windows.split(",")):
        print(f"  WINDOW_PER_JOB {w:>2}: last step ends at {replay(durations, first, jobs, w):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
