"""`attndbg` command line: each command parses, calls one core function, renders, exits 0/1/2/3.

Exit codes: 0 all good, 1 a backend failed (or findings), 2 bad input (one line on stderr),
3 nothing failed but something asked for did not run (a backend named with --backend), 4 (record
only) the command exited 0 but a hook failed before any step was recorded.

Only click and rich are imported here: torch and the kernels load inside the commands that use
them, so `--version`, `--help` and `synth --list` answer at once.

One module per command group, the group itself in group.py, the options several commands share
declared once in options.py, exit codes and bad input in common.py. Importing this package
registers every command on `main` (the `attndbg` entry point, `python -m attndbg`).
"""

from attndbg.cli import check, interop, machine, record, replay, repro, traces  # noqa: F401  (each registers its commands)
from attndbg.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NOT_RECORDED, EXIT_NOT_RUN, EXIT_OK, BadInput
from attndbg.cli.group import main

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_NOT_RECORDED", "EXIT_NOT_RUN", "EXIT_OK", "BadInput", "main"]
