"""What `attndbg record` exits with, and says, after the engine command it ran: the command's own
exit status, as a shell reports it. A command killed by signal N exits 128 + N (the shell's `$?`:
139 for SIGSEGV, 137 for SIGKILL), never Python's `sys.exit(-N)`, which wraps to 256 - N (245, 247)
and reads as an ordinary failure.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class CommandExit:
    status: int  # what record exits with: the command's code, or 128 + N when signal N killed it
    text: str  # "exited 0", "exited 3", "killed by SIGSEGV"


def command_exit(returncode: int) -> CommandExit:
    """From `subprocess`'s returncode (negative N: killed by signal N)."""
    if returncode >= 0:
        return CommandExit(returncode, f"exited {returncode}")
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return CommandExit(128 + number, f"killed by {name}")
