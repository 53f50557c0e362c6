"""bench/dispatch_window.py replays the check pool's dispatch policy on logged step times (the
evidence for workers.WINDOW_PER_JOB)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import dispatch_window  # noqa: E402


def test_a_slow_step_at_the_front_idles_the_other_worker_once_the_window_is_used() -> None:
    # Two workers; step 0 takes 10 s, the others 1 s each.
    durations = [10.0] + [1.0] * 8
    # A window of 1 per worker (2 steps ahead of step 0): the other worker runs step 1, then waits
    # for step 0; afterwards the two share the remaining 7 steps (4 rounds of 1 s).
    assert dispatch_window.replay(durations, [], jobs=2, window_per_job=1) == 14.0
    # A window wide enough: the other worker runs steps 1-8 while step 0 runs.
    assert dispatch_window.replay(durations, [], jobs=2, window_per_job=8) == 10.0


def test_early_steps_go_out_first_whatever_their_place() -> None:
    # Step 5 is early: it starts at once beside step 0, though outside a window of 1 per worker.
    durations = [1.0] * 5 + [6.0]
    assert dispatch_window.replay(durations, [5], jobs=2, window_per_job=1) == 6.0
    # Not early, it starts in its turn (at 2 s, after steps 0-3 on the two workers) and ends at 8 s.
    assert dispatch_window.replay(durations, [], jobs=2, window_per_job=1) == 8.0
