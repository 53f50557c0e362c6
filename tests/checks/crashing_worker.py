"""A check function for worker tests: it kills its own process on a step whose file name says so,
as a kernel library's segfault would, and checks every other step normally."""

from __future__ import annotations

import os
import signal

from attndbg.checks.step import check_one


def check_or_segfault(path, only, options):
    if "segfault" in os.path.basename(str(path)):
        os.kill(os.getpid(), signal.SIGSEGV)
    return check_one(path, only, options)


def check_with_a_crashing_backend(path, only, options):
    """On a step named "kernelcrash", a backend named "crashy" segfaults inside its launch, unless the
    check engine has left it out of the step (as it does when it checks the step again)."""
    from attndbg.replay import activity

    if "kernelcrash" in os.path.basename(str(path)) and "crashy" not in options.exclude:
        with activity.launching("crashy", "eager"):
            os.kill(os.getpid(), signal.SIGSEGV)
    return check_one(path, only, options)
