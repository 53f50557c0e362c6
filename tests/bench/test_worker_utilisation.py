"""bench/worker_utilisation.py's split of a worker pool's wall time: how much of it is start-up."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import worker_utilisation  # noqa: E402


def test_each_workers_wall_time_is_start_up_busy_waiting_and_tail() -> None:
    rows = [
        {"pid": 1, "mode": "DECODE", "start": 10.0, "end": 11.0},
        {"pid": 1, "mode": "DECODE", "start": 12.0, "end": 13.0},  # 1 s waiting between its steps
        {"pid": 2, "mode": "EXTEND", "start": 14.0, "end": 18.0},
    ]
    lines = worker_utilisation.summarise(rows, begin=0.0, end=20.0)
    assert lines[0] == "wall 20.0 s, 3 steps, 2 workers"
    assert lines[1] == "  worker 1: 2 steps; startup 10.0 s, busy 2.0 s, waiting 1.0 s, tail 7.0 s; first step 1.0 s"
    assert lines[2] == "  worker 2: 1 steps; startup 14.0 s, busy 4.0 s, waiting 0.0 s, tail 2.0 s; first step 4.0 s"
    # Of 40 worker-seconds: start-up 24, busy 6, waiting 1, tail 9.
    assert lines[3] == "worker time: startup 60 %, busy 15 %, waiting 2 %, tail 22 %"
    assert lines[4] == "step seconds in workers: DECODE 2 x 1000 ms, EXTEND 1 x 4000 ms"
