"""A check function for worker tests of the GPU memory share: a step whose file name says "big" is
over a worker's share (as memory_share.OverShare makes it) unless its worker holds the workers'
whole part; every check writes the share it ran under to shares.txt beside the step."""

from __future__ import annotations

from pathlib import Path

from attndbg.checks.step import StepReport, StepResult, check_one
from attndbg.replay import memory_share


def check_with_a_big_step(path, only, options):
    share = memory_share.share()
    with open(Path(path).parent / "shares.txt", "a") as log:
        log.write(f"{Path(path).name} {share}\n")
    if "big" in Path(path).name and share is not None and share < memory_share.WORKERS_PART:
        return StepResult(StepReport(str(path), -1, "decode", [], error="over the share", bad_input=True), over_share=True)
    return check_one(path, only, options)
